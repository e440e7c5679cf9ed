/* AVX-512 paths of the K-quants (row layout): the one-token product of each row with x, and
 * the exact decoding of rows for the prefill panels. Each super-block is unpacked once
 * (kquant_simd.h) into int8 quants and per-16-element factors; the product then sums
 * factor * (q . x) per chunk, with the mins' share taken from the 32-element block sums of x
 * (Q4_K, Q5_K) or summed alongside (Q2_K). */
#include "kernels/cpu/cpu.h"
#include "kernels/dequant.h"

#if defined(__x86_64__) && defined(__GNUC__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#include "kernels/cpu/kquant_simd.h"

static inline __m512 chunk_q(const int8_t *q)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)q)));
}

float cpu_dot_k_avx512(uint32_t type, const uint8_t *row, const float *x, const float *xsum,
                       int nb)
{
    int bb = dequant_block_bytes(type);
    enum KMins mins = kq_mins(type);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    __m512 macc = _mm512_setzero_ps();
    __m256 mv = _mm256_setzero_ps();
    struct KBlock kb = {.m32 = {0}}; /* m32 is only set (and read) for Q4_K, Q5_K */
    for (int b = 0; b < nb; b++, row += bb, x += QK_K) {
        _mm_prefetch((const char *)(row + 4 * bb), _MM_HINT_T0);
        _mm_prefetch((const char *)(row + 4 * bb + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(row + 4 * bb + 128), _MM_HINT_T0);
        kq_unpack(type, row, &kb);
        if (mins == KMINS_32) {
            /* one factor per 32 elements: two chunks per multiply by the factor */
            for (int s = 0; s < 16; s += 2) {
                __m512 t = _mm512_mul_ps(chunk_q(kb.q + 16 * s), _mm512_loadu_ps(x + 16 * s));
                t = _mm512_fmadd_ps(chunk_q(kb.q + 16 * s + 16), _mm512_loadu_ps(x + 16 * s + 16), t);
                acc[(s >> 1) & 3] = _mm512_fmadd_ps(_mm512_set1_ps(kb.dl[s]), t, acc[(s >> 1) & 3]);
            }
        } else {
            for (int s = 0; s < 16; s++) {
                __m512 xv = _mm512_loadu_ps(x + 16 * s);
                __m512 t = _mm512_mul_ps(chunk_q(kb.q + 16 * s), xv);
                acc[s & 3] = _mm512_fmadd_ps(_mm512_set1_ps(kb.dl[s]), t, acc[s & 3]);
                if (mins == KMINS_16) macc = _mm512_fmadd_ps(_mm512_set1_ps(kb.ml[s]), xv, macc);
            }
        }
        if (mins == KMINS_32)
            mv = _mm256_fmadd_ps(_mm256_loadu_ps(kb.m32), _mm256_loadu_ps(xsum + 8 * b), mv);
    }
    __m512 a = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    return _mm512_reduce_add_ps(_mm512_sub_ps(a, macc)) - kq_hsum8(mv);
}

void cpu_decode_k_avx512(uint32_t type, const uint8_t *src, float *dst, int nb)
{
    int bb = dequant_block_bytes(type);
    int mins = kq_mins(type) != KMINS_NONE;
    struct KBlock kb = {.m32 = {0}}; /* m32 is only set (and read) for Q4_K, Q5_K */
    for (int b = 0; b < nb; b++, src += bb, dst += QK_K) {
        kq_unpack(type, src, &kb);
        for (int s = 0; s < 16; s++) {
            __m512 v = _mm512_mul_ps(chunk_q(kb.q + 16 * s), _mm512_set1_ps(kb.dl[s]));
            if (mins) v = _mm512_sub_ps(v, _mm512_set1_ps(kb.ml[s]));
            _mm512_storeu_ps(dst + 16 * s, v);
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
float cpu_dot_k_avx512(uint32_t type, const uint8_t *row, const float *x, const float *xsum,
                       int nb)
{
    (void)type; (void)row; (void)x; (void)xsum; (void)nb;
    return 0.f;
}
void cpu_decode_k_avx512(uint32_t type, const uint8_t *src, float *dst, int nb)
{
    (void)type; (void)src; (void)dst; (void)nb;
}
#endif
