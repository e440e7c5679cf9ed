/* Internal to kernels/cpu: a K-quant super-block unpacked with AVX2 byte operations into the
 * integers and factors its values are made of, so that the AVX2 and AVX-512 paths share one
 * unpacking: element e = (float)q[e] * dl[e / 16] - ml[e / 16] (no ml for Q3_K and Q6_K),
 * which is exactly ggml's value (the factors are rounded to f32 as ggml rounds them; the
 * portable decoder in dequant_k.c documents the order). Include only from a file compiled for
 * AVX2 (target pragma), after the pragma. */
#ifndef DIFFRAG_KERNELS_CPU_KQUANT_SIMD_H
#define DIFFRAG_KERNELS_CPU_KQUANT_SIMD_H

#include <immintrin.h>

#include "kernels/cpu/kquant.h"
#include "kernels/dequant.h"

struct KBlock {
    _Alignas(64) int8_t q[QK_K];
    float dl[16];      /* factor of each 16-element chunk */
    float ml[16];      /* subtracted from each element of the chunk (0 without mins) */
    float m32[8];      /* Q4_K, Q5_K: the min of each 32-element sub-block (= ml[2s]) */
};

/* 8 small unsigned integers (bytes at p) times f, as f32 (each product rounded once, as the
 * scalar d * (float)sc). */
static inline __m256 kq_scale8_u(const void *p, float f)
{
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    return _mm256_mul_ps(v, _mm256_set1_ps(f));
}

static inline __m256 kq_scale8_s(const void *p, float f)
{
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    return _mm256_mul_ps(v, _mm256_set1_ps(f));
}

static inline float kq_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Per-32 factors f[s] to per-16 ones: out[2s] = out[2s + 1] = f[s]. */
static inline void kq_spread(__m256 f, float *out)
{
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
    _mm256_storeu_ps(out + 8, _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)));
}

enum KMins { KMINS_NONE = 0, KMINS_32 = 1, KMINS_16 = 2 };

/* How a type's mins vary: none, per 32 elements (Q4_K, Q5_K; ml[2s] == ml[2s + 1]), per 16. */
static inline enum KMins kq_mins(uint32_t type)
{
    return type == DQ_Q4_K || type == DQ_Q5_K ? KMINS_32 : type == DQ_Q2_K ? KMINS_16 : KMINS_NONE;
}

static inline __m256i kq_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)(const void *)p); }
static inline void kq_store(int8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)(void *)p, v); }

/* Bit `from` of every byte of v moved to bit `to` (other bits cleared). 16-bit shifts carry
 * bits between the two bytes of a lane only into bit positions the mask clears. */
static inline __m256i kq_bit(__m256i v, int from, int to)
{
    __m256i s = from >= to ? _mm256_srli_epi16(v, from - to) : _mm256_slli_epi16(v, to - from);
    return _mm256_and_si256(s, _mm256_set1_epi8((char)(1 << to)));
}

static inline void kq_unpack_q45(const uint8_t *b, struct KBlock *o, int five)
{
    float d = kquant_half(b), dmin = kquant_half(b + 2);
    uint8_t sc[8], mn[8];
    kquant_scales_mins(b + 4, sc, mn);
    __m256 dl = kq_scale8_u(sc, d), ml = kq_scale8_u(mn, dmin);
    kq_spread(dl, o->dl);
    kq_spread(ml, o->ml);
    _mm256_storeu_ps(o->m32, ml);
    const uint8_t *qs = b + (five ? 48 : 16);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i qh = five ? kq_load(b + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i v = kq_load(qs + 32 * c);
        __m256i lo = _mm256_and_si256(v, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (five) {
            lo = _mm256_or_si256(lo, kq_bit(qh, 2 * c, 4));
            hi = _mm256_or_si256(hi, kq_bit(qh, 2 * c + 1, 4));
        }
        kq_store(o->q + 64 * c, lo);
        kq_store(o->q + 64 * c + 32, hi);
    }
}

static inline void kq_unpack_q6(const uint8_t *b, struct KBlock *o)
{
    float d = kquant_half(b + 208);
    _mm256_storeu_ps(o->dl, kq_scale8_s(b + 192, d));
    _mm256_storeu_ps(o->dl + 8, kq_scale8_s(b + 200, d));
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const __m256i bias = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        __m256i a = kq_load(b + 64 * h), c = kq_load(b + 64 * h + 32);
        __m256i qh = kq_load(b + 128 + 32 * h);
        __m256i v0 = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        __m256i v1 = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(qh, m30));
        __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        kq_store(o->q + 128 * h, _mm256_sub_epi8(v0, bias));
        kq_store(o->q + 128 * h + 32, _mm256_sub_epi8(v1, bias));
        kq_store(o->q + 128 * h + 64, _mm256_sub_epi8(v2, bias));
        kq_store(o->q + 128 * h + 96, _mm256_sub_epi8(v3, bias));
    }
}

static inline void kq_unpack_q2(const uint8_t *b, struct KBlock *o)
{
    float d = kquant_half(b + 80), dmin = kquant_half(b + 82);
    __m128i sc = _mm_loadu_si128((const __m128i *)(const void *)b);
    uint8_t lo[16], hi[16];
    _mm_storeu_si128((__m128i *)(void *)lo, _mm_and_si128(sc, _mm_set1_epi8(0x0f)));
    _mm_storeu_si128((__m128i *)(void *)hi, _mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(0x0f)));
    _mm256_storeu_ps(o->dl, kq_scale8_u(lo, d));
    _mm256_storeu_ps(o->dl + 8, kq_scale8_u(lo + 8, d));
    _mm256_storeu_ps(o->ml, kq_scale8_u(hi, dmin));
    _mm256_storeu_ps(o->ml + 8, kq_scale8_u(hi + 8, dmin));
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        __m256i v = kq_load(b + 16 + 32 * h);
        for (int i = 0; i < 4; i++)
            kq_store(o->q + 128 * h + 32 * i, _mm256_and_si256(_mm256_srli_epi16(v, 2 * i), m2));
    }
}

static inline void kq_unpack_q3(const uint8_t *b, struct KBlock *o)
{
    float d = kquant_half(b + 108);
    int8_t sc[16];
    kquant_q3_scales(b + 96, sc);
    _mm256_storeu_ps(o->dl, kq_scale8_s(sc, d));
    _mm256_storeu_ps(o->dl + 8, kq_scale8_s(sc + 8, d));
    const __m256i m2 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    __m256i hm = kq_load(b);
    for (int h = 0; h < 2; h++) {
        __m256i v = kq_load(b + 32 + 32 * h);
        for (int i = 0; i < 4; i++) {
            /* (q | hbit << 2) - 4 = q - (hbit ? 0 : 4) */
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * i), m2);
            q = _mm256_or_si256(q, kq_bit(hm, 4 * h + i, 2));
            kq_store(o->q + 128 * h + 32 * i, _mm256_sub_epi8(q, four));
        }
    }
}

static inline void kq_unpack(uint32_t type, const uint8_t *b, struct KBlock *o)
{
    switch (type) {
    case DQ_Q2_K: kq_unpack_q2(b, o); break;
    case DQ_Q3_K: kq_unpack_q3(b, o); break;
    case DQ_Q4_K: kq_unpack_q45(b, o, 0); break;
    case DQ_Q5_K: kq_unpack_q45(b, o, 1); break;
    default: kq_unpack_q6(b, o); break;
    }
}

#endif
