/* AVX-512 VNNI int8 prefill products: the rounding of input rows to 8 bits, the int8 panels
 * of the weight types that take part (gemm_q8.c defines both), and a 6 x 32 microkernel that
 * accumulates each sub-block's integer dot products with vpdpbusd (unsigned weight quants
 * times signed inputs, four per 32-bit lane) and scales them in f32. Compiled for AVX-512
 * VNNI whatever the build's -march; called only when cpu_q8_vnni(). */
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "kernels/cpu/kquant.h"
#include "kernels/dequant.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

#include "kernels/cpu/q8_panel_simd.h"
#include "kernels/cpu/transpose_avx512.h"

enum { MR = 6 };

/* --- input rows --- */

/* Per sub-block of g (16 or 32) integers in v[0..] (16 per vector): scale, minus sum, scaled
 * sum, for the sub-blocks of one rounding block starting at element c0. */
static inline void put_sums(const struct Q8Rows *r, int i, int c0, const __m512i *v, int nvec,
                            float d)
{
    int per = r->g / 16;
    for (int s = 0; s < nvec / per; s++) {
        __m512i acc = v[s * per];
        if (per == 2) acc = _mm512_add_epi32(acc, v[s * per + 1]);
        int32_t sum = _mm512_reduce_add_epi32(acc);
        size_t at = (size_t)i * r->s_stride + (size_t)(c0 / r->g + s);
        r->d[at] = d;
        r->nx[at] = -sum;
        r->dx[at] = d * (float)sum;
    }
}

void cpu_q8_quantize_row_avx512(enum Q8Act act, const float *x, int k, const struct Q8Rows *r,
                                int i)
{
    int8_t *q = r->q + (size_t)i * r->q_stride;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    if (act == Q8_ACT_32) {
        for (int c0 = 0; c0 < k; c0 += 32) {
            __m512 v0 = _mm512_loadu_ps(x + c0), v1 = _mm512_loadu_ps(x + c0 + 16);
            __m512 m = _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask));
            float amax = _mm512_reduce_max_ps(m);
            float d = _cvtsh_ss(_cvtss_sh(amax / 127.f, _MM_FROUND_TO_NEAREST_INT));
            __m512 id = _mm512_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
            __m512i q32[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(v0, id)),
                              _mm512_cvtps_epi32(_mm512_mul_ps(v1, id))};
            _mm_storeu_si128((__m128i *)(void *)(q + c0), _mm512_cvtsepi32_epi8(q32[0]));
            _mm_storeu_si128((__m128i *)(void *)(q + c0 + 16), _mm512_cvtsepi32_epi8(q32[1]));
            put_sums(r, i, c0, q32, 2, d);
        }
        return;
    }
    for (int c0 = 0; c0 < k; c0 += QK_K) {
        __m512 v[16], m = _mm512_setzero_ps();
        for (int j = 0; j < 16; j++) {
            v[j] = _mm512_loadu_ps(x + c0 + 16 * j);
            m = _mm512_max_ps(m, _mm512_and_ps(v[j], absmask));
        }
        float amax = _mm512_reduce_max_ps(m);
        __m512i q32[16];
        if (amax == 0.f) {
            memset(q + c0, 0, QK_K);
            for (int j = 0; j < 16; j++) q32[j] = _mm512_setzero_si512();
            put_sums(r, i, c0, q32, 16, 0.f);
            continue;
        }
        /* The signed value of the first element of largest magnitude, as GGML takes it. */
        float max = 0.f;
        __m512 am = _mm512_set1_ps(amax);
        for (int j = 0; j < 16; j++) {
            __mmask16 hit = _mm512_cmp_ps_mask(_mm512_and_ps(v[j], absmask), am, _CMP_EQ_OQ);
            if (hit) {
                max = x[c0 + 16 * j + __builtin_ctz(hit)];
                break;
            }
        }
        float iscale = -127.f / max;
        __m512 is = _mm512_set1_ps(iscale);
        __m512i top = _mm512_set1_epi32(127);
        for (int j = 0; j < 16; j++) {
            q32[j] = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[j], is)), top);
            _mm_storeu_si128((__m128i *)(void *)(q + c0 + 16 * j), _mm512_cvtsepi32_epi8(q32[j]));
        }
        put_sums(r, i, c0, q32, 16, 1.f / iscale);
    }
}

/* --- weight panels --- */

/* Half h (outputs 16h..16h+15) of an X16 matrix's panel: group g's tiles, one per
 * 32-element block (sub-block). */
static void panel_x16(const struct Weights *w, const struct Q8Type *t, int g, int h,
                      uint8_t *panel)
{
    const size_t sbs = 32 * 32 + 256;
    int hdr = cpu_x16_header(w->type), five = w->type == DQ_Q5_0 || w->type == DQ_Q5_1;
    const __m128i bit5 = _mm_set1_epi8(0x10);
    for (int b = 0; b < w->cols / 32; b++) {
        const uint8_t *tile = cpu_x16_tile(w, g, b), *q = tile + hdr;
        uint8_t *ps = panel + (size_t)b * sbs;
        float *fa = (float *)(void *)(ps + 32 * 32);
        __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)tile));
        __m512 off = t->shift >= 0
                         ? _mm512_mul_ps(a, _mm512_set1_ps(-(float)(1 << t->shift)))
                         : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(tile + 32)));
        _mm512_store_ps(fa + 16 * h, a);
        _mm512_store_ps(fa + 32 + 16 * h, off);
        __m128i col[32];
        q8_x16_cols(w->type, q, col);
        if (five) {
            const uint8_t *hm = q - 64;
            for (int c = 0; c < 32; c++) {
                __mmask16 m = (__mmask16)(hm[2 * c] | hm[2 * c + 1] << 8);
                col[c] = _mm_or_si128(col[c], _mm_maskz_mov_epi8(m, bit5));
            }
        }
        for (int s = 0; s < 8; s++)
            q8_put4(ps + (size_t)s * 128 + 64 * h, col[4 * s], col[4 * s + 1], col[4 * s + 2],
                 col[4 * s + 3]);
    }
}

void cpu_q8_panel_avx512(const struct Weights *w, int r0, int mb, uint8_t *panel, uint8_t *work)
{
    struct Q8Type t = {Q8_ACT_32, 32, -1, 0};
    cpu_q8_type(w->type, &t);
    if (w->layout == WEIGHTS_X16) {
        int groups = (w->rows + 15) / 16;
        for (int h = 0; h < 2; h++) {
            int g = r0 / 16 + h;
            if (g < groups && 16 * h < mb) {
                panel_x16(w, &t, g, h, panel);
                /* Outputs past the matrix (its padding rows) as zeros, as the portable panel. */
                for (int j = mb - 16 * h; j < 16; j++)
                    for (int b = 0; b < w->cols / 32; b++) {
                        uint8_t *ps = panel + (size_t)b * (32 * 32 + 256);
                        for (int s = 0; s < 8; s++) memset(ps + (size_t)s * 128 + 64 * h + 4 * j, 0, 4);
                        float *fa = (float *)(void *)(ps + 32 * 32);
                        fa[16 * h + j] = fa[32 + 16 * h + j] = 0.f;
                    }
            } else {
                /* No rows here: zero quants, factors and offsets. */
                size_t sbs = 32 * 32 + 256;
                for (int b = 0; b < w->cols / 32; b++) {
                    uint8_t *ps = panel + (size_t)b * sbs;
                    for (int s = 0; s < 8; s++) memset(ps + (size_t)s * 128 + 64 * h, 0, 64);
                    float *fa = (float *)(void *)(ps + 32 * 32);
                    memset(fa + 16 * h, 0, 64);
                    memset(fa + 32 + 16 * h, 0, 64);
                }
            }
        }
        return;
    }
    if (w->type != DQ_Q4_K && w->type != DQ_Q5_K && w->type != DQ_Q6_K) {
        cpu_q8_panel(w, r0, mb, panel, work);
        return;
    }
    int g = t.g;
    size_t sbs = (size_t)g * 32 + 256;
    uint8_t *rows = work; /* 32 rows x 256 quants */
    for (int sb = 0; sb < w->cols / QK_K; sb++) {
        uint8_t *ps0 = panel + (size_t)(sb * QK_K / g) * sbs;
        q8_k_rows(w, g, r0, mb, sb, ps0, sbs, rows);
        /* 16 rows x 16 groups of four quants at a time into 16 steps of the panel. */
        for (int h = 0; h < 2; h++)
            for (int c0 = 0; c0 < QK_K; c0 += 64) {
                __m512 r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm512_loadu_ps((const float *)(const void *)(rows + (size_t)(16 * h + i) * QK_K + c0));
                avx512_transpose16(r);
                for (int st = 0; st < 16; st++) {
                    int c = c0 + 4 * st;
                    _mm512_store_ps((float *)(void *)(ps0 + (size_t)(c / g) * sbs +
                                                      (size_t)(c % g / 4) * 128 + 64 * h),
                                    r[st]);
                }
            }
    }
}

/* --- the microkernel --- */

static inline __attribute__((always_inline)) void
kernel(const int mr, const int g, const int sym, const struct Q8Block *b, int i,
       __mmask16 m0, __mmask16 m1)
{
    const struct Q8Rows *x = b->x;
    const int ns = b->k / g;
    const size_t sbs = (size_t)g * 32 + 256;
    const int32_t mul = sym ? 1 << b->shift : 0;
    __m512 f0[MR], f1[MR];
    const int8_t *q[MR];
    const float *d[MR], *dx[MR];
    const int32_t *nx[MR];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        size_t row = (size_t)(b->i0 + i + (r < mr ? r : 0));
        q[r] = x->q + row * x->q_stride;
        d[r] = x->d + row * x->s_stride;
        dx[r] = x->dx + row * x->s_stride;
        nx[r] = x->nx + row * x->s_stride;
        f0[r] = f1[r] = _mm512_setzero_ps();
    }
    const uint8_t *p = b->panel;
    for (int s = 0; s < ns; s++, p += sbs) {
        __m512i s0[MR], s1[MR];
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++)
            if (r < mr) s0[r] = s1[r] = sym ? _mm512_set1_epi32(nx[r][s] * mul) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int t = 0; t < g / 4; t++) {
            __m512i w0 = _mm512_load_si512((const void *)(p + 128 * t));
            __m512i w1 = _mm512_load_si512((const void *)(p + 128 * t + 64));
#pragma GCC unroll 6
            for (int r = 0; r < MR; r++)
                if (r < mr) {
                    int32_t v;
                    memcpy(&v, q[r] + s * g + 4 * t, 4);
                    __m512i xb = _mm512_set1_epi32(v);
                    s0[r] = _mm512_dpbusd_epi32(s0[r], w0, xb);
                    s1[r] = _mm512_dpbusd_epi32(s1[r], w1, xb);
                }
        }
        const float *fa = (const float *)(const void *)(p + (size_t)g * 32);
        __m512 a0 = _mm512_load_ps(fa), a1 = _mm512_load_ps(fa + 16);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++)
            if (r < mr) {
                __m512 dr = _mm512_set1_ps(d[r][s]);
                f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), _mm512_mul_ps(a0, dr), f0[r]);
                f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[r]), _mm512_mul_ps(a1, dr), f1[r]);
            }
        if (!sym) {
            __m512 o0 = _mm512_load_ps(fa + 32), o1 = _mm512_load_ps(fa + 48);
#pragma GCC unroll 6
            for (int r = 0; r < MR; r++)
                if (r < mr) {
                    __m512 e = _mm512_set1_ps(dx[r][s]);
                    f0[r] = _mm512_fmadd_ps(o0, e, f0[r]);
                    f1[r] = _mm512_fmadd_ps(o1, e, f1[r]);
                }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
        if (r < mr) {
            float *yr = b->y + (size_t)(i + r) * b->y_stride;
            if (b->accumulate) {
                f0[r] = _mm512_add_ps(f0[r], _mm512_maskz_loadu_ps(m0, yr));
                f1[r] = _mm512_add_ps(f1[r], _mm512_maskz_loadu_ps(m1, yr + 16));
            }
            _mm512_mask_storeu_ps(yr, m0, f0[r]);
            _mm512_mask_storeu_ps(yr + 16, m1, f1[r]);
        }
}

#define Q8_CASES(G, SYM)                                                                        \
    switch (mr) {                                                                               \
    case 6: kernel(6, G, SYM, b, i, m0, m1); break;                                             \
    case 5: kernel(5, G, SYM, b, i, m0, m1); break;                                             \
    case 4: kernel(4, G, SYM, b, i, m0, m1); break;                                             \
    case 3: kernel(3, G, SYM, b, i, m0, m1); break;                                             \
    case 2: kernel(2, G, SYM, b, i, m0, m1); break;                                             \
    default: kernel(1, G, SYM, b, i, m0, m1); break;                                            \
    }

void cpu_q8_gemm_block_avx512(const struct Q8Block *b)
{
    int mb = b->m_blk, sym = b->shift >= 0, g = b->x->g;
    __mmask16 m0 = mb >= 16 ? 0xffff : (__mmask16)((1u << mb) - 1);
    __mmask16 m1 = mb >= 32 ? 0xffff : mb <= 16 ? 0 : (__mmask16)((1u << (mb - 16)) - 1);
    for (int i = 0; i < b->n; i += MR) {
        int mr = b->n - i < MR ? b->n - i : MR;
        if (g == 32 && sym) { Q8_CASES(32, 1) }
        else if (g == 32) { Q8_CASES(32, 0) }
        else if (sym) { Q8_CASES(16, 1) }
        else { Q8_CASES(16, 0) }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
void cpu_q8_quantize_row_avx512(enum Q8Act act, const float *x, int k, const struct Q8Rows *r,
                                int i)
{
    cpu_q8_quantize_row(act, x, k, r, i);
}
void cpu_q8_panel_avx512(const struct Weights *w, int r0, int mb, uint8_t *panel, uint8_t *work)
{
    cpu_q8_panel(w, r0, mb, panel, work);
}
void cpu_q8_gemm_block_avx512(const struct Q8Block *b) { cpu_q8_gemm_block(b); }
#endif
