/* Internal to kernels/cpu: the K-quant block geometry (kernels/dequant.h documents the
 * layouts) and the unpacking of their packed sub-block scales, shared by the portable decoder
 * and the vector paths so that every path reads the same integers. */
#ifndef DIFFRAG_KERNELS_CPU_KQUANT_H
#define DIFFRAG_KERNELS_CPU_KQUANT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/f16.h"

#define QK_K 256

/* nb super-blocks of K-quant `type` (DQ_Q2_K .. DQ_Q6_K) at src into nb * 256 floats. */
void kquant_decode(uint32_t type, const uint8_t *src, float *dst, size_t nb);

static inline int kquant_is_k(uint32_t type) { return type >= 10 && type <= 14; }

static inline float kquant_half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* Q4_K / Q5_K: scale and min of sub-block s (0..7) from the 12 packed bytes. */
static inline void kquant_scale_min(int s, const uint8_t *q, uint8_t *sc, uint8_t *mn)
{
    if (s < 4) {
        *sc = q[s] & 63;
        *mn = q[s + 4] & 63;
    } else {
        *sc = (uint8_t)((q[s + 4] & 0x0f) | ((q[s - 4] >> 6) << 4));
        *mn = (uint8_t)((q[s + 4] >> 4) | ((q[s] >> 6) << 4));
    }
}

/* Q4_K / Q5_K: all 8 scales and mins at once, four at a time in 32-bit words (the same
 * values as kquant_scale_min). */
static inline void kquant_scales_mins(const uint8_t *q, uint8_t sc[8], uint8_t mn[8])
{
    uint32_t w[3], s[2], m[2];
    memcpy(w, q, 12);
    s[0] = w[0] & 0x3f3f3f3fu;
    s[1] = (w[2] & 0x0f0f0f0fu) | ((w[0] >> 6) & 0x03030303u) << 4;
    m[0] = w[1] & 0x3f3f3f3fu;
    m[1] = ((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 6) & 0x03030303u) << 4;
    memcpy(sc, s, 8);
    memcpy(mn, m, 8);
}

/* Q3_K: the 16 signed sub-block scales (6-bit value - 32) from the 12 packed bytes. */
static inline void kquant_q3_scales(const uint8_t *q, int8_t out[16])
{
    for (int s = 0; s < 16; s++) {
        int lo = s < 8 ? q[s] & 0x0f : q[s - 8] >> 4;
        int hi = (q[8 + s % 4] >> (2 * (s / 4))) & 3;
        out[s] = (int8_t)((lo | hi << 4) - 32);
    }
}

#endif
