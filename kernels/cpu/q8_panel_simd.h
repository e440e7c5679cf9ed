/* Internal to the int8 panel builders of kernels/cpu (gemm_q8_avx512.c, gemm_q8_avx2.c; each
 * compiles it under its own target attributes, AVX2 at least): the SSE2 / AVX2 pieces both
 * share. */
#ifndef DIFFRAG_KERNELS_CPU_Q8_PANEL_SIMD_H
#define DIFFRAG_KERNELS_CPU_Q8_PANEL_SIMD_H

#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#include "kernels/cpu/kquant.h"
#include "kernels/dequant.h"

/* Columns c0..c0+3 (16 rows each, one byte per row) as 16 rows of four bytes at dst. */
static inline void q8_put4(uint8_t *dst, __m128i c0, __m128i c1, __m128i c2, __m128i c3)
{
    __m128i t0 = _mm_unpacklo_epi8(c0, c1), t1 = _mm_unpackhi_epi8(c0, c1);
    __m128i t2 = _mm_unpacklo_epi8(c2, c3), t3 = _mm_unpackhi_epi8(c2, c3);
    _mm_store_si128((__m128i *)(void *)dst, _mm_unpacklo_epi16(t0, t2));
    _mm_store_si128((__m128i *)(void *)(dst + 16), _mm_unpackhi_epi16(t0, t2));
    _mm_store_si128((__m128i *)(void *)(dst + 32), _mm_unpacklo_epi16(t1, t3));
    _mm_store_si128((__m128i *)(void *)(dst + 48), _mm_unpackhi_epi16(t1, t3));
}

/* One super-block of a row-layout K-quant row as 256 unsigned quants, with each sub-block's
 * factor and offset stored for output j of the panel from sub-block s0 on. */
static inline void q8_row_k(uint32_t type, const uint8_t *blk, uint8_t *u, uint8_t *ps0, size_t sbs,
                  int g, int j)
{
    const __m256i lo4 = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x30);
    if (type == DQ_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(const void *)(blk + 192);
        float d = kquant_half(blk + 208);
        for (int s = 0; s < 16; s++) {
            float *fa = (float *)(void *)(ps0 + (size_t)s * sbs + (size_t)g * 32);
            fa[j] = d * (float)sc[s];
            fa[32 + j] = -fa[j] * 32.f;
        }
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, u += 128) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(const void *)ql);
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(const void *)(ql + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(const void *)qh);
            __m256i e0 = _mm256_or_si256(_mm256_and_si256(l0, lo4),
                                         _mm256_and_si256(_mm256_slli_epi16(hb, 4), two));
            __m256i e1 = _mm256_or_si256(_mm256_and_si256(l1, lo4),
                                         _mm256_and_si256(_mm256_slli_epi16(hb, 2), two));
            __m256i e2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4),
                                         _mm256_and_si256(hb, two));
            __m256i e3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4),
                                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), two));
            _mm256_storeu_si256((__m256i *)(void *)u, e0);
            _mm256_storeu_si256((__m256i *)(void *)(u + 32), e1);
            _mm256_storeu_si256((__m256i *)(void *)(u + 64), e2);
            _mm256_storeu_si256((__m256i *)(void *)(u + 96), e3);
        }
        return;
    }
    /* Q4_K, Q5_K */
    int five = type == DQ_Q5_K;
    float d = kquant_half(blk), dmin = kquant_half(blk + 2);
    uint8_t sc[8], mn[8];
    kquant_scales_mins(blk + 4, sc, mn);
    for (int s = 0; s < 8; s++) {
        float *fa = (float *)(void *)(ps0 + (size_t)s * sbs + (size_t)g * 32);
        fa[j] = d * (float)sc[s];
        fa[32 + j] = -(dmin * (float)mn[s]);
    }
    const uint8_t *q = blk + (five ? 48 : 16);
    __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(const void *)(blk + 16))
                      : _mm256_setzero_si256();
    const __m256i one = _mm256_set1_epi8(1);
    for (int p = 0; p < 4; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * p));
        __m256i e0 = _mm256_and_si256(v, lo4);
        __m256i e1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        if (five) {
            __m128i s0 = _mm_cvtsi32_si128(2 * p), s1 = _mm_cvtsi32_si128(2 * p + 1);
            e0 = _mm256_or_si256(e0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, s0), one), 4));
            e1 = _mm256_or_si256(e1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, s1), one), 4));
        }
        _mm256_storeu_si256((__m256i *)(void *)(u + 64 * p), e0);
        _mm256_storeu_si256((__m256i *)(void *)(u + 64 * p + 32), e1);
    }
}

/* The 32 columns (one byte per row of the 16) of an X16 tile's quants at q, as unsigned quants
 * without Q5's fifth bit (Q8_0: its quants plus 128). */
static inline void q8_x16_cols(uint32_t type, const uint8_t *q, __m128i col[32])
{
    if (type == DQ_Q8_0) {
        for (int c = 0; c < 32; c++)
            col[c] = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)(q + 16 * c)),
                                   _mm_set1_epi8((char)0x80));
        return;
    }
    const __m128i lo4 = _mm_set1_epi8(0x0f);
    for (int c = 0; c < 16; c++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(q + 16 * c));
        col[c] = _mm_and_si128(v, lo4);
        col[c + 16] = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
    }
}

/* Super-block sb of the 32 rows r0.. of a row-layout Q4_K, Q5_K or Q6_K matrix as 32 rows of
 * 256 unsigned quants at `rows` (rows from mb on: zeros), their factors and offsets stored in
 * the panel's sub-blocks from ps0 on. */
static inline void q8_k_rows(const struct Weights *w, int g, int r0, int mb, int sb,
                             uint8_t *ps0, size_t sbs, uint8_t *rows)
{
    int bb = dequant_block_bytes(w->type);
    for (int j = 0; j < 32; j++) {
        if (j < mb) {
            const uint8_t *blk = (const uint8_t *)w->data + (size_t)(r0 + j) * w->row_bytes +
                                 (size_t)sb * bb;
            q8_row_k(w->type, blk, rows + (size_t)j * QK_K, ps0, sbs, g, j);
            continue;
        }
        memset(rows + (size_t)j * QK_K, 0, QK_K);
        for (int s = 0; s < QK_K / g; s++) {
            float *fa = (float *)(void *)(ps0 + (size_t)s * sbs + (size_t)g * 32);
            fa[j] = fa[32 + j] = 0.f;
        }
    }
}

#endif
