/* AVX-512 products of weights with one f32 input (the decode step's), dequantising in
 * registers: each weight byte is read once and never written back as f32. Interleaved (X16)
 * matrices give 16 outputs per vector with no horizontal sums (the fifth bits of Q5_0/Q5_1
 * are per-column row masks, added with masked adds); affine and offset formats use
 * sum((q*d + m) x) = d*sum(q x) + m*sum(x) with the block sums of x computed once per
 * product. Also the exact decoding of X16 tiles into the prefill products' panels. */
#include "kernels/cpu/cpu.h"
#include "kernels/dequant.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <string.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

int cpu_matvec_avx512_handles(uint32_t type)
{
    return type == DQ_F32 || type == DQ_F16 || type == DQ_BF16 || type == DQ_Q4_0 ||
           type == DQ_Q4_1 || type == DQ_Q8_0;
}

static inline float half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __mmask16 tail_mask(int n) { return (__mmask16)((1u << n) - 1); }

static float dot_f32(const float *w, const float *x, int k)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    }
    for (; i < k; i += 16) {
        __mmask16 m = k - i >= 16 ? 0xffff : tail_mask(k - i);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_maskz_loadu_ps(m, x + i), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static float dot_f16(const uint16_t *w, const float *x, int k)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i))),
                             _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i + 16))),
                             _mm512_loadu_ps(x + i + 16), a1);
    }
    for (; i < k; i += 16) {
        __mmask16 m = k - i >= 16 ? 0xffff : tail_mask(k - i);
        __m512 wv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w + i));
        a0 = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + i), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static float dot_bf16(const uint16_t *w, const float *x, int k)
{
    __m512 a0 = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        __mmask16 m = k - i >= 16 ? 0xffff : tail_mask(k - i);
        __m512i wi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + i)), 16);
        a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(wi), _mm512_maskz_loadu_ps(m, x + i), a0);
    }
    return _mm512_reduce_add_ps(a0);
}

/* Sum over the block of nibble * x for the 16 bytes at q (low nibbles: x[0..15], high:
 * x[16..31]). */
static inline __m512 nibble_dot(const uint8_t *q, const float *x)
{
    __m128i b = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), _mm512_loadu_ps(x));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), _mm512_loadu_ps(x + 16), s);
}

static float dot_q4_1(const uint8_t *w, const float *x, const float *xsum, int nb)
{
    __m512 acc = _mm512_setzero_ps();
    float macc = 0.f;
    for (int b = 0; b < nb; b++, w += 20, x += 32) {
        acc = _mm512_fmadd_ps(_mm512_set1_ps(half(w)), nibble_dot(w + 4, x), acc);
        macc += half(w + 2) * xsum[b];
    }
    return _mm512_reduce_add_ps(acc) + macc;
}

static float dot_q4_0(const uint8_t *w, const float *x, const float *xsum, int nb)
{
    __m512 acc = _mm512_setzero_ps();
    float macc = 0.f;
    for (int b = 0; b < nb; b++, w += 18, x += 32) {
        float d = half(w);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), nibble_dot(w + 2, x), acc);
        macc -= 8.f * d * xsum[b];
    }
    return _mm512_reduce_add_ps(acc) + macc;
}

static float dot_q8_0(const uint8_t *w, const float *x, int nb)
{
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, w += 34, x += 32) {
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 2))));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 18))));
        __m512 s = _mm512_mul_ps(q0, _mm512_loadu_ps(x));
        s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + 16), s);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(half(w)), s, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* --- interleaved (X16) matrices: 16 outputs per group --- */

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 16384
#endif

static inline __m512 half16(const uint8_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

/* The block sums below serve nr inputs (1..CPU_MV_ROWS) per unpacking of the weights: input r
 * has its own four chains and gets exactly the operations it gets alone. */
#define MV_INLINE static inline __attribute__((always_inline))

/* sum over the block of nibble * x for the 16 rows: four chains hide the FMA latency. The
 * nibble becomes a float through a 16-entry table (vpermps reads only the index's low 4 bits,
 * so the low nibble needs no mask), one instruction instead of a mask and a conversion. */
MV_INLINE void x16_nibbles(const uint8_t *q, const float *const *xb, int nr, __m512 *out)
{
    __m512 s0[CPU_MV_ROWS], s1[CPU_MV_ROWS], s2[CPU_MV_ROWS], s3[CPU_MV_ROWS];
    for (int r = 0; r < nr; r++)
        s0[r] = s1[r] = s2[r] = s3[r] = _mm512_setzero_ps();
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < 16; i += 2) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * i)));
        __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * i + 16)));
        __m512 w0 = _mm512_permutexvar_ps(v, table), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        __m512 w2 = _mm512_permutexvar_ps(u, table), w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), table);
        for (int r = 0; r < nr; r++) {
            s0[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[r][i]), s0[r]);
            s1[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[r][i + 16]), s1[r]);
            s2[r] = _mm512_fmadd_ps(w2, _mm512_set1_ps(xb[r][i + 1]), s2[r]);
            s3[r] = _mm512_fmadd_ps(w3, _mm512_set1_ps(xb[r][i + 17]), s3[r]);
        }
    }
    for (int r = 0; r < nr; r++)
        out[r] = _mm512_add_ps(_mm512_add_ps(s0[r], s1[r]), _mm512_add_ps(s2[r], s3[r]));
}

/* The little-endian 16-bit row mask of column c. */
static inline __mmask16 mask_at(const uint8_t *hm, int c)
{
    uint16_t m;
    memcpy(&m, hm + 2 * c, sizeof m);
    return (__mmask16)m;
}

/* sum over the block of fifth-bit * x for the 16 rows: hm[c] masks the rows whose column c
 * has its fifth bit set (the bit's weight, 16, is applied by the caller). */
MV_INLINE void x16_fifth_bits(const uint8_t *hm, const float *const *xb, int nr, __m512 *out)
{
    __m512 s0[CPU_MV_ROWS], s1[CPU_MV_ROWS], s2[CPU_MV_ROWS], s3[CPU_MV_ROWS];
    for (int r = 0; r < nr; r++)
        s0[r] = s1[r] = s2[r] = s3[r] = _mm512_setzero_ps();
    /* The masks are read one at a time: a 64-byte local copy let the compiler store it with an
     * aligned vector move, which faults where a sanitizer's fake stack aligns frames to 32. */
    for (int c = 0; c < 32; c += 4) {
        __mmask16 m0 = mask_at(hm, c), m1 = mask_at(hm, c + 1), m2 = mask_at(hm, c + 2),
                  m3 = mask_at(hm, c + 3);
        for (int r = 0; r < nr; r++) {
            s0[r] = _mm512_mask_add_ps(s0[r], m0, s0[r], _mm512_set1_ps(xb[r][c]));
            s1[r] = _mm512_mask_add_ps(s1[r], m1, s1[r], _mm512_set1_ps(xb[r][c + 1]));
            s2[r] = _mm512_mask_add_ps(s2[r], m2, s2[r], _mm512_set1_ps(xb[r][c + 2]));
            s3[r] = _mm512_mask_add_ps(s3[r], m3, s3[r], _mm512_set1_ps(xb[r][c + 3]));
        }
    }
    for (int r = 0; r < nr; r++)
        out[r] = _mm512_add_ps(_mm512_add_ps(s0[r], s1[r]), _mm512_add_ps(s2[r], s3[r]));
}

MV_INLINE void x16_bytes(const uint8_t *q, const float *const *xb, int nr, __m512 *out)
{
    __m512 s0[CPU_MV_ROWS], s1[CPU_MV_ROWS], s2[CPU_MV_ROWS], s3[CPU_MV_ROWS];
    for (int r = 0; r < nr; r++)
        s0[r] = s1[r] = s2[r] = s3[r] = _mm512_setzero_ps();
    for (int c = 0; c < 32; c += 4) {
#define Q8COL(i) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * (c + (i))))))
        __m512 w0 = Q8COL(0), w1 = Q8COL(1), w2 = Q8COL(2), w3 = Q8COL(3);
#undef Q8COL
        for (int r = 0; r < nr; r++) {
            s0[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[r][c]), s0[r]);
            s1[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[r][c + 1]), s1[r]);
            s2[r] = _mm512_fmadd_ps(w2, _mm512_set1_ps(xb[r][c + 2]), s2[r]);
            s3[r] = _mm512_fmadd_ps(w3, _mm512_set1_ps(xb[r][c + 3]), s3[r]);
        }
    }
    for (int r = 0; r < nr; r++)
        out[r] = _mm512_add_ps(_mm512_add_ps(s0[r], s1[r]), _mm512_add_ps(s2[r], s3[r]));
}

MV_INLINE void matvec_x16(const struct Weights *w, int g0, int g1, const float *const *x,
                          const float *const *xsum, float *const *y, int nr)
{
    int nb = w->cols / 32;
    size_t tile_bytes = 16 * (size_t)dequant_block_bytes(w->type);
    for (int g = g0; g < g1; g++) {
        const uint8_t *t = (const uint8_t *)w->data + (size_t)g * nb * tile_bytes;
        __m512 acc[CPU_MV_ROWS], macc[CPU_MV_ROWS], s[CPU_MV_ROWS], h[CPU_MV_ROWS];
        const float *xb[CPU_MV_ROWS];
        for (int r = 0; r < nr; r++) acc[r] = macc[r] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++, t += tile_bytes) {
            for (int r = 0; r < nr; r++) xb[r] = x[r] + 32 * b;
            /* Weights stream from memory once per token: keep PREFETCH_BYTES ahead in flight. */
            for (size_t off = 0; off < tile_bytes; off += 64)
                _mm_prefetch((const char *)(t + PREFETCH_BYTES + off), _MM_HINT_T0);
            switch (w->type) {
            case DQ_Q4_1:
                x16_nibbles(t + 64, xb, nr, s);
                for (int r = 0; r < nr; r++) {
                    acc[r] = _mm512_fmadd_ps(half16(t), s[r], acc[r]);
                    macc[r] = _mm512_fmadd_ps(half16(t + 32), _mm512_set1_ps(xsum[r][b]), macc[r]);
                }
                break;
            case DQ_Q4_0:
                x16_nibbles(t + 32, xb, nr, s);
                for (int r = 0; r < nr; r++) {
                    __m512 v = _mm512_sub_ps(s[r], _mm512_set1_ps(8.f * xsum[r][b]));
                    acc[r] = _mm512_fmadd_ps(half16(t), v, acc[r]);
                }
                break;
            case DQ_Q5_0:
                /* sum((nibble + 16 hbit - 16) x) */
                x16_fifth_bits(t + 32, xb, nr, h);
                x16_nibbles(t + 96, xb, nr, s);
                for (int r = 0; r < nr; r++) {
                    __m512 v = _mm512_fmadd_ps(h[r], _mm512_set1_ps(16.f), s[r]);
                    v = _mm512_sub_ps(v, _mm512_set1_ps(16.f * xsum[r][b]));
                    acc[r] = _mm512_fmadd_ps(half16(t), v, acc[r]);
                }
                break;
            case DQ_Q5_1:
                x16_fifth_bits(t + 64, xb, nr, h);
                x16_nibbles(t + 128, xb, nr, s);
                for (int r = 0; r < nr; r++) {
                    __m512 v = _mm512_fmadd_ps(h[r], _mm512_set1_ps(16.f), s[r]);
                    acc[r] = _mm512_fmadd_ps(half16(t), v, acc[r]);
                    macc[r] = _mm512_fmadd_ps(half16(t + 32), _mm512_set1_ps(xsum[r][b]), macc[r]);
                }
                break;
            default:
                x16_bytes(t + 32, xb, nr, s);
                for (int r = 0; r < nr; r++) acc[r] = _mm512_fmadd_ps(half16(t), s[r], acc[r]);
                break;
            }
        }
        for (int r = 0; r < nr; r++)
            _mm512_storeu_ps(y[r] + (size_t)(g - g0) * 16, _mm512_add_ps(acc[r], macc[r]));
    }
}

/* One specialised body per count of inputs, so each input's chains live in registers. */
void cpu_matvec_x16_avx512(const struct Weights *w, int g0, int g1, const float *const *x,
                           const float *const *xsum, float *const *y, int nr)
{
    switch (nr) {
    case 1: matvec_x16(w, g0, g1, x, xsum, y, 1); break;
    case 2: matvec_x16(w, g0, g1, x, xsum, y, 2); break;
    case 3: matvec_x16(w, g0, g1, x, xsum, y, 3); break;
    default: matvec_x16(w, g0, g1, x, xsum, y, 4); break;
    }
}

/* Exact decoding of X16 tiles into a k-major panel `width` floats wide; multiply then add as
 * separate operations, as the reference decoder. */
void cpu_panel_x16_avx512(const struct Weights *w, int r0, int width, float *panel)
{
    int nb = w->cols / 32, groups = (w->rows + 15) / 16;
    size_t tile_bytes = 16 * (size_t)dequant_block_bytes(w->type);
    const __m512i lo_mask = _mm512_set1_epi32(0x0f);
    for (int h = 0; h < width / 16; h++) {
        int g = r0 / 16 + h;
        float *col = panel + 16 * h;
        if (g >= groups) {
            for (int c = 0; c < w->cols; c++) _mm512_storeu_ps(col + (size_t)c * width, _mm512_setzero_ps());
            continue;
        }
        const uint8_t *t = (const uint8_t *)w->data + (size_t)g * nb * tile_bytes;
        for (int b = 0; b < nb; b++, t += tile_bytes) {
            __m512 d = half16(t);
            float *out = col + (size_t)32 * b * width;
            if (w->type == DQ_Q8_0) {
                for (int c = 0; c < 32; c++) {
                    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * c))));
                    _mm512_storeu_ps(out + (size_t)c * width, _mm512_mul_ps(q, d));
                }
                continue;
            }
            int affine = w->type == DQ_Q4_1 || w->type == DQ_Q5_1;
            int five = w->type == DQ_Q5_0 || w->type == DQ_Q5_1;
            int bias = w->type == DQ_Q4_0 ? 8 : w->type == DQ_Q5_0 ? 16 : 0;
            __m512 m = affine ? half16(t + 32) : _mm512_setzero_ps();
            const uint8_t *q = t + cpu_x16_header(w->type);
            uint16_t hm[32] = {0};
            if (five) memcpy(hm, q - 64, sizeof hm);
            for (int i = 0; i < 16; i++) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * i)));
                __m512i lo = _mm512_and_si512(v, lo_mask), hi = _mm512_srli_epi32(v, 4);
                if (five) {
                    lo = _mm512_mask_add_epi32(lo, (__mmask16)hm[i], lo, _mm512_set1_epi32(16));
                    hi = _mm512_mask_add_epi32(hi, (__mmask16)hm[i + 16], hi, _mm512_set1_epi32(16));
                }
                if (bias) {
                    lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(bias));
                    hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(bias));
                }
                __m512 wl = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
                __m512 wh = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
                if (affine) {
                    wl = _mm512_add_ps(wl, m);
                    wh = _mm512_add_ps(wh, m);
                }
                _mm512_storeu_ps(out + (size_t)i * width, wl);
                _mm512_storeu_ps(out + (size_t)(i + 16) * width, wh);
            }
        }
    }
}

void cpu_matvec_avx512(const struct Weights *w, int r0, int r1, const float *x,
                       const float *xsum, float *y)
{
    int k = w->cols, nb = k / 32;
    for (int r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
        float s;
        switch (w->type) {
        case DQ_F32: s = dot_f32((const float *)(const void *)row, x, k); break;
        case DQ_F16: s = dot_f16((const uint16_t *)(const void *)row, x, k); break;
        case DQ_BF16: s = dot_bf16((const uint16_t *)(const void *)row, x, k); break;
        case DQ_Q4_0: s = dot_q4_0(row, x, xsum, nb); break;
        case DQ_Q4_1: s = dot_q4_1(row, x, xsum, nb); break;
        default: s = dot_q8_0(row, x, nb); break;
        }
        y[r - r0] = s;
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
int cpu_matvec_avx512_handles(uint32_t type) { (void)type; return 0; }
void cpu_matvec_x16_avx512(const struct Weights *w, int g0, int g1, const float *const *x,
                           const float *const *xsum, float *const *y, int nr)
{
    (void)w; (void)g0; (void)g1; (void)x; (void)xsum; (void)y; (void)nr;
}
void cpu_panel_x16_avx512(const struct Weights *w, int r0, int width, float *panel)
{
    (void)w; (void)r0; (void)width; (void)panel;
}
void cpu_matvec_avx512(const struct Weights *w, int r0, int r1, const float *x,
                       const float *xsum, float *y)
{
    (void)w; (void)r0; (void)r1; (void)x; (void)xsum; (void)y;
}
#endif
