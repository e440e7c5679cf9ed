/* Internal to the AVX2 files of kernels/cpu (each compiles it under its own target
 * attributes): the in-register transpose of an 8 x 8 block of 32-bit elements, used for f32
 * weight panels and for the four-byte groups of int8 panels alike. */
#ifndef DIFFRAG_KERNELS_CPU_TRANSPOSE_AVX2_H
#define DIFFRAG_KERNELS_CPU_TRANSPOSE_AVX2_H

#include <immintrin.h>

/* r[i] (row i, 8 elements) becomes column i. */
static inline void avx2_transpose8(__m256 r[8])
{
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        t[c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x20);
        t[4 + c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}

#endif
