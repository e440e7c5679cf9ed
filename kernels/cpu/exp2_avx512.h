/* 2^x on 16 f32 lanes with AVX-512, for the attention softmax and SiLU: x = n + f with
 * |f| <= 1/2, a polynomial for 2^f, scalef for 2^n; inputs below -127 give (nearly) zero.
 * Include it where AVX-512 is enabled (the target pragma of the AVX-512 and AMX files). */
#ifndef DIFFRAG_EXP2_AVX512_H
#define DIFFRAG_EXP2_AVX512_H

#include <immintrin.h>

/* The polynomial c[0] f^deg + ... + c[deg] (Horner's scheme; constant arguments unroll). */
static inline __m512 exp2_poly_avx512(__m512 x, const float *c, int deg)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i <= deg; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* Degree 6, relative error ~2e-7: f32 results. */
static inline __m512 cpu_exp2_avx512(__m512 x)
{
    static const float c[7] = {1.5403530393381608e-4f, 1.3333558146428443e-3f,
                               9.6181291076284772e-3f, 5.5504108664821580e-2f,
                               2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.f};
    return exp2_poly_avx512(x, c, 6);
}

/* Degree 4, relative error ~2.6e-6 (fitted for least maximum relative error on [-1/2, 1/2]):
 * for probabilities that are rounded to bf16 (8 significant bits) on their way to a product,
 * and summed beside it. */
static inline __m512 cpu_exp2_avx512_short(__m512 x)
{
    static const float c[5] = {9.570100358545412e-3f, 5.5917862831544866e-2f,
                               2.4024744889079797e-1f, 6.931218144399189e-1f,
                               9.999992614201451e-1f};
    return exp2_poly_avx512(x, c, 4);
}

#endif
