/* AVX2 paths of the K-quants (row layout), as kquant_avx512.c with 8-lane vectors: the
 * one-token product of each row with x, and the exact decoding of rows for the prefill
 * panels. Called only when cpu_isa_supported(CPU_ISA_AVX2). */
#include "kernels/cpu/cpu.h"
#include "kernels/dequant.h"

#if defined(__x86_64__) && defined(__GNUC__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "kernels/cpu/kquant_simd.h"

static inline __m256 chunk8(const int8_t *q)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)q)));
}

static inline __m256i bytes8(const uint8_t *p)
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
}

/* Q4_K straight from the loaded bytes (as kquant_avx512.c; the unpacking buffer's stores and
 * reloads cost more than the unpacking). Q6_K assembled the same way in 8-lane integer
 * operations measured slower than through the buffer, so it keeps the shared path. */
static float dot_q4k(const uint8_t *row, const float *x, const float *xsum, int nb)
{
    const __m256i m4 = _mm256_set1_epi32(0x0f);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), mv = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, row += 144, x += QK_K) {
        uint8_t sc[8], mn[8];
        kquant_scales_mins(row + 4, sc, mn);
        float dl[8];
        _mm256_storeu_ps(dl, kq_scale8_u(sc, kquant_half(row)));
        mv = _mm256_fmadd_ps(kq_scale8_u(mn, kquant_half(row + 2)), _mm256_loadu_ps(xsum + 8 * b), mv);
        const uint8_t *qs = row + 16;
        for (int c = 0; c < 4; c++) {
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int g = 0; g < 4; g++) {
                __m256i v = bytes8(qs + 32 * c + 8 * g);
                const float *xc = x + 64 * c + 8 * g;
                lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, m4)), _mm256_loadu_ps(xc), lo);
                hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), _mm256_loadu_ps(xc + 32), hi);
            }
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dl[2 * c]), lo, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(dl[2 * c + 1]), hi, acc1);
        }
    }
    return kq_hsum8(_mm256_add_ps(acc0, acc1)) - kq_hsum8(mv);
}

float cpu_dot_k_avx2(uint32_t type, const uint8_t *row, const float *x, const float *xsum, int nb)
{
    if (type == DQ_Q4_K) return dot_q4k(row, x, xsum, nb);
    int bb = dequant_block_bytes(type);
    enum KMins mins = kq_mins(type);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    __m256 mv = _mm256_setzero_ps();
    struct KBlock kb = {.m32 = {0}}; /* m32 is only set (and read) for Q4_K, Q5_K */
    for (int b = 0; b < nb; b++, row += bb, x += QK_K) {
        kq_unpack(type, row, &kb);
        for (int s = 0; s < 16; s++) {
            __m256 x0 = _mm256_loadu_ps(x + 16 * s), x1 = _mm256_loadu_ps(x + 16 * s + 8);
            __m256 t = _mm256_mul_ps(chunk8(kb.q + 16 * s), x0);
            t = _mm256_fmadd_ps(chunk8(kb.q + 16 * s + 8), x1, t);
            __m256 dl = _mm256_set1_ps(kb.dl[s]);
            if (s & 1) acc1 = _mm256_fmadd_ps(dl, t, acc1);
            else acc0 = _mm256_fmadd_ps(dl, t, acc0);
            if (mins == KMINS_16)
                macc = _mm256_fmadd_ps(_mm256_set1_ps(kb.ml[s]), _mm256_add_ps(x0, x1), macc);
        }
        if (mins == KMINS_32)
            mv = _mm256_fmadd_ps(_mm256_loadu_ps(kb.m32), _mm256_loadu_ps(xsum + 8 * b), mv);
    }
    return kq_hsum8(_mm256_sub_ps(_mm256_add_ps(acc0, acc1), macc)) - kq_hsum8(mv);
}

void cpu_decode_k_avx2(uint32_t type, const uint8_t *src, float *dst, int nb)
{
    int bb = dequant_block_bytes(type);
    int mins = kq_mins(type) != KMINS_NONE;
    struct KBlock kb = {.m32 = {0}}; /* m32 is only set (and read) for Q4_K, Q5_K */
    for (int b = 0; b < nb; b++, src += bb, dst += QK_K) {
        kq_unpack(type, src, &kb);
        for (int s = 0; s < 32; s++) {
            __m256 v = _mm256_mul_ps(chunk8(kb.q + 8 * s), _mm256_set1_ps(kb.dl[s / 2]));
            if (mins) v = _mm256_sub_ps(v, _mm256_set1_ps(kb.ml[s / 2]));
            _mm256_storeu_ps(dst + 8 * s, v);
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
/* Not an x86-64 build: cpu_isa_supported never reports AVX2, so these are never called. */
float cpu_dot_k_avx2(uint32_t type, const uint8_t *row, const float *x, const float *xsum, int nb)
{
    (void)type; (void)row; (void)x; (void)xsum; (void)nb;
    return 0.f;
}
void cpu_decode_k_avx2(uint32_t type, const uint8_t *src, float *dst, int nb)
{
    (void)type; (void)src; (void)dst; (void)nb;
}
#endif
