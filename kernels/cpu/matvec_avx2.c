/* AVX2 one-token products of interleaved (X16) matrices: the 16 outputs of a group as two
 * 8-lane vectors, each weight dequantised in registers and read once (as the AVX-512 kernels
 * in matvec_avx512.c; the K-quants' AVX2 products are in kquant_avx2.c); and the exact
 * decoding of X16 tiles into the AVX2 prefill panels. Called only when
 * cpu_isa_supported(CPU_ISA_AVX2). */
#include "kernels/cpu/cpu.h"
#include "kernels/dequant.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <string.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

static inline __m256i bytes8(const uint8_t *p)
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
}

/* 16 for the lanes (rows r0..r0+7) whose bit is set in the row mask m, else 0. */
static inline __m256i fifth8(uint32_t m, __m256i lane_bits)
{
    __m256i b = _mm256_and_si256(_mm256_set1_epi32((int)m), lane_bits);
    return _mm256_and_si256(_mm256_cmpeq_epi32(b, lane_bits), _mm256_set1_epi32(16));
}

void cpu_matvec_x16_avx2(const struct Weights *w, int g0, int g1, const float *x,
                         const float *xsum, float *y)
{
    int nb = w->cols / 32;
    uint32_t type = w->type;
    size_t tile_bytes = 16 * (size_t)dequant_block_bytes(type);
    int affine = type == DQ_Q4_1 || type == DQ_Q5_1;
    int five = type == DQ_Q5_0 || type == DQ_Q5_1;
    float bias = type == DQ_Q4_0 ? 8.f : type == DQ_Q5_0 ? 16.f : 0.f;
    int hdr = cpu_x16_header(type);
    const __m256i lo_mask = _mm256_set1_epi32(0x0f);
    const __m256i bits0 = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i bits1 = _mm256_slli_epi32(bits0, 8);
    for (int g = g0; g < g1; g++) {
        const uint8_t *t = (const uint8_t *)w->data + (size_t)g * nb * tile_bytes;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        __m256 macc0 = _mm256_setzero_ps(), macc1 = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++, t += tile_bytes) {
            const float *xb = x + 32 * b;
            const uint8_t *q = t + hdr;
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
            __m256 u0 = _mm256_setzero_ps(), u1 = _mm256_setzero_ps();
            if (type == DQ_Q8_0) {
                for (int c = 0; c < 32; c += 2) {
                    __m256 xa = _mm256_set1_ps(xb[c]), xc = _mm256_set1_ps(xb[c + 1]);
                    const uint8_t *qa = q + 16 * c, *qc = qa + 16;
                    s0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)qa))), xa, s0);
                    s1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(qa + 8)))), xa, s1);
                    u0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)qc))), xc, u0);
                    u1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(qc + 8)))), xc, u1);
                }
            } else {
                uint16_t hm[32] = {0};
                if (five) memcpy(hm, q - 64, sizeof hm);
                for (int i = 0; i < 16; i++) {
                    __m256i v0 = bytes8(q + 16 * i), v1 = bytes8(q + 16 * i + 8);
                    __m256i l0 = _mm256_and_si256(v0, lo_mask), h0 = _mm256_srli_epi32(v0, 4);
                    __m256i l1 = _mm256_and_si256(v1, lo_mask), h1 = _mm256_srli_epi32(v1, 4);
                    if (five) {
                        l0 = _mm256_add_epi32(l0, fifth8(hm[i], bits0));
                        l1 = _mm256_add_epi32(l1, fifth8(hm[i], bits1));
                        h0 = _mm256_add_epi32(h0, fifth8(hm[i + 16], bits0));
                        h1 = _mm256_add_epi32(h1, fifth8(hm[i + 16], bits1));
                    }
                    __m256 xl = _mm256_set1_ps(xb[i]), xh = _mm256_set1_ps(xb[i + 16]);
                    s0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l0), xl, s0);
                    s1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l1), xl, s1);
                    u0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0), xh, u0);
                    u1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1), xh, u1);
                }
            }
            s0 = _mm256_add_ps(s0, u0);
            s1 = _mm256_add_ps(s1, u1);
            if (bias != 0.f) {
                __m256 bx = _mm256_set1_ps(bias * xsum[b]);
                s0 = _mm256_sub_ps(s0, bx);
                s1 = _mm256_sub_ps(s1, bx);
            }
            __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)t));
            __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(t + 16)));
            acc0 = _mm256_fmadd_ps(d0, s0, acc0);
            acc1 = _mm256_fmadd_ps(d1, s1, acc1);
            if (affine) {
                __m256 xs = _mm256_set1_ps(xsum[b]);
                macc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(t + 32))), xs, macc0);
                macc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(t + 48))), xs, macc1);
            }
        }
        _mm256_storeu_ps(y + (size_t)(g - g0) * 16, _mm256_add_ps(acc0, macc0));
        _mm256_storeu_ps(y + (size_t)(g - g0) * 16 + 8, _mm256_add_ps(acc1, macc1));
    }
}

/* Exact decoding of X16 tiles into a k-major panel `width` floats wide (the prefill products'
 * AVX2 panels); multiply then add as separate operations, as the reference decoder. */
void cpu_panel_x16_avx2(const struct Weights *w, int r0, int width, float *panel)
{
    int nb = w->cols / 32, groups = (w->rows + 15) / 16;
    uint32_t type = w->type;
    size_t tile_bytes = 16 * (size_t)dequant_block_bytes(type);
    int affine = type == DQ_Q4_1 || type == DQ_Q5_1;
    int five = type == DQ_Q5_0 || type == DQ_Q5_1;
    int bias = type == DQ_Q4_0 ? 8 : type == DQ_Q5_0 ? 16 : 0;
    int hdr = cpu_x16_header(type);
    const __m256i lo_mask = _mm256_set1_epi32(0x0f), vbias = _mm256_set1_epi32(bias);
    const __m256i bits0 = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i bits1 = _mm256_slli_epi32(bits0, 8);
    for (int h = 0; h < width / 16; h++) {
        int g = r0 / 16 + h;
        float *col = panel + 16 * h;
        if (g >= groups) {
            for (int c = 0; c < w->cols; c++) {
                _mm256_storeu_ps(col + (size_t)c * width, _mm256_setzero_ps());
                _mm256_storeu_ps(col + (size_t)c * width + 8, _mm256_setzero_ps());
            }
            continue;
        }
        const uint8_t *t = (const uint8_t *)w->data + (size_t)g * nb * tile_bytes;
        for (int b = 0; b < nb; b++, t += tile_bytes) {
            __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)t));
            __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(t + 16)));
            float *out = col + (size_t)32 * b * width;
            const uint8_t *q = t + hdr;
            if (type == DQ_Q8_0) {
                for (int c = 0; c < 32; c++) {
                    __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(q + 16 * c))));
                    __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(q + 16 * c + 8))));
                    _mm256_storeu_ps(out + (size_t)c * width, _mm256_mul_ps(q0, d0));
                    _mm256_storeu_ps(out + (size_t)c * width + 8, _mm256_mul_ps(q1, d1));
                }
                continue;
            }
            __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
            if (affine) {
                m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(t + 32)));
                m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(t + 48)));
            }
            uint16_t hm[32] = {0};
            if (five) memcpy(hm, q - 64, sizeof hm);
            for (int i = 0; i < 16; i++) {
                __m256i v0 = bytes8(q + 16 * i), v1 = bytes8(q + 16 * i + 8);
                __m256i q_[4] = {_mm256_and_si256(v0, lo_mask), _mm256_and_si256(v1, lo_mask),
                                 _mm256_srli_epi32(v0, 4), _mm256_srli_epi32(v1, 4)};
                if (five) {
                    q_[0] = _mm256_add_epi32(q_[0], fifth8(hm[i], bits0));
                    q_[1] = _mm256_add_epi32(q_[1], fifth8(hm[i], bits1));
                    q_[2] = _mm256_add_epi32(q_[2], fifth8(hm[i + 16], bits0));
                    q_[3] = _mm256_add_epi32(q_[3], fifth8(hm[i + 16], bits1));
                }
                for (int e = 0; e < 4; e++) {
                    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q_[e], vbias)),
                                             e & 1 ? d1 : d0);
                    if (affine) v = _mm256_add_ps(v, e & 1 ? m1 : m0);
                    /* e = 0, 1: column i (rows 0-7, 8-15); e = 2, 3: column i + 16 */
                    _mm256_storeu_ps(out + (size_t)(i + 16 * (e >> 1)) * width + 8 * (e & 1), v);
                }
            }
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
void cpu_panel_x16_avx2(const struct Weights *w, int r0, int width, float *panel)
{
    (void)w; (void)r0; (void)width; (void)panel;
}
void cpu_matvec_x16_avx2(const struct Weights *w, int g0, int g1, const float *x,
                         const float *xsum, float *y)
{
    (void)w; (void)g0; (void)g1; (void)x; (void)xsum; (void)y;
}
#endif
