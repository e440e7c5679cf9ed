/* exp for f32 written so that loops over arrays vectorise (no libm call, no branches):
 * range reduction x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r, 2^n through the
 * exponent bits. Relative error below 2e-7 for x in [-87, 88]; inputs below -87 give 0. */
#ifndef DIFFRAG_VEXP_H
#define DIFFRAG_VEXP_H

#include <stdint.h>
#include <string.h>

static inline float vexpf(float x)
{
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    float n = (float)(int32_t)(x * 1.44269504088896341f + (x < 0.f ? -0.5f : 0.5f));
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (0.16666665f + r * (0.041666519f +
              r * (0.0083333477f + r * 0.0013930862f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
