/* Scalar IEEE half (f16) and bfloat16 (bf16) <-> f32 conversions, shared by the dequantisation
 * kernels and the KV cache. Narrowing conversions round to nearest, ties to even; infinities
 * pass through, NaNs stay NaN (quieted), f16 subnormals are exact in both directions.
 * The F16C instructions are used when the compiler targets them (-march=native on x86); the
 * *_portable versions are always defined so tests can check one against the other. */
#ifndef DIFFRAG_F16_H
#define DIFFRAG_F16_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline uint32_t f16_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f16_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f16_to_f32_portable(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f)                        /* inf / NaN: keep the payload */
        return f16_f32_from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp != 0)                           /* normal: rebias 15 -> 127 */
        return f16_f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0)
        return f16_f32_from_bits(sign);
    /* Subnormal half (mant * 2^-24) is a normal float: shift the leading one into place. */
    uint32_t e = 113;
    while (!(mant & 0x400u)) {
        mant <<= 1;
        e--;
    }
    return f16_f32_from_bits(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

static inline uint16_t f32_to_f16_portable(float f)
{
    uint32_t x = f16_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {                /* inf, or NaN forced quiet with the top payload */
        if (ax == 0x7f800000u)
            return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u)                  /* >= 65520 rounds past the largest half (65504) */
        return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {                /* normal half: drop 13 mantissa bits, RNE */
        uint32_t r = ax - (112u << 23);
        r += 0xfffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (ax < 0x33000000u)                   /* below half the smallest subnormal: zero */
        return sign;
    /* Subnormal result: value / 2^-24 = mant * 2^(e - 126), rounded to nearest even. A carry
     * into bit 10 correctly yields the smallest normal. */
    uint32_t e = ax >> 23;
    uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;              /* 14..24 here */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u)))
        q++;
    return (uint16_t)(sign | q);
}

static inline float f16_to_f32(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_to_f32_portable(h);
#endif
}

static inline uint16_t f32_to_f16(float f)
{
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return f32_to_f16_portable(f);
#endif
}

static inline float bf16_to_f32(uint16_t h)
{
    return f16_f32_from_bits((uint32_t)h << 16);
}

/* Same rule as ggml: NaN is quieted rather than rounded (rounding could carry it into inf). */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t x = f16_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#endif
