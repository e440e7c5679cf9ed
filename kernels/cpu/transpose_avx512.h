/* Internal to the AVX-512 files of kernels/cpu (each compiles it under its own target
 * attributes): the in-register transpose of a 16 x 16 block of 32-bit elements, used for f32
 * weight panels and for the four-byte groups of int8 panels alike. */
#ifndef DIFFRAG_KERNELS_CPU_TRANSPOSE_AVX512_H
#define DIFFRAG_KERNELS_CPU_TRANSPOSE_AVX512_H

#include <immintrin.h>

/* r[i] (row i, 16 elements) becomes column i. */
static inline void avx512_transpose16(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    /* r[4q + c] now holds, in each 128-bit lane L, column c of rows 4L'.. of group q. */
    for (int i = 0; i < 16; i++) t[i] = r[i];
    for (int c = 0; c < 4; c++) {
        __m512 a = _mm512_shuffle_f32x4(t[c], t[4 + c], 0x44);      /* lanes 0,1 | 0,1 */
        __m512 b = _mm512_shuffle_f32x4(t[c], t[4 + c], 0xee);      /* lanes 2,3 | 2,3 */
        __m512 e = _mm512_shuffle_f32x4(t[8 + c], t[12 + c], 0x44);
        __m512 f = _mm512_shuffle_f32x4(t[8 + c], t[12 + c], 0xee);
        r[c] = _mm512_shuffle_f32x4(a, e, 0x88);                    /* lane 0 of each */
        r[4 + c] = _mm512_shuffle_f32x4(a, e, 0xdd);                /* lane 1 */
        r[8 + c] = _mm512_shuffle_f32x4(b, f, 0x88);                /* lane 2 */
        r[12 + c] = _mm512_shuffle_f32x4(b, f, 0xdd);               /* lane 3 */
    }
}

#endif
