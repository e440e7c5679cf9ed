/* AVX2 int8 prefill products, for processors without AVX-512 VNNI: the int8 panels of gemm_q8.c
 * (X16 matrices and the row-layout Q4_K, Q5_K, Q6_K built here, the others by the portable
 * builder) and the microkernel. A 4-row x 16-output tile (one half of the panel at a time) multiplies
 * unsigned weight quants by signed inputs with vpmaddubsw, adds the 16-bit pair sums of as many
 * steps as cannot overflow for the type's largest quant, widens them with vpmaddwd, and scales
 * each sub-block's sum in f32 in the order of the portable and AVX-512 kernels, so all three
 * agree bit for bit. Q8_0, whose unsigned quants reach 255, runs on its signed quants instead
 * (|w| times x with w's sign: at most 2 x 128 x 127 per pair). Compiled for AVX2 whatever the
 * build's -march; called only when cpu_isa_supported(CPU_ISA_AVX2). */
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "kernels/cpu/q8_panel_simd.h"
#include "kernels/cpu/transpose_avx2.h"

enum { MR = 4 };

/* --- weight panels --- */

/* Outputs j0..15 of half h as zeros: quants, factors and offsets (rows past the matrix). */
static void zero_outputs(uint8_t *panel, int k, int g, int h, int j0)
{
    size_t sbs = (size_t)g * 32 + 256;
    for (int s = 0; s < k / g; s++) {
        uint8_t *ps = panel + (size_t)s * sbs;
        for (int t = 0; t < g / 4; t++) memset(ps + (size_t)t * 128 + 64 * h + 4 * j0, 0, 4 * (size_t)(16 - j0));
        float *fa = (float *)(void *)(ps + (size_t)g * 32);
        for (int j = j0; j < 16; j++) fa[16 * h + j] = fa[32 + 16 * h + j] = 0.f;
    }
}

/* Half h (outputs 16h..16h+15) of an X16 matrix's panel: group grp's tiles, one per
 * 32-element block (sub-block). */
static void panel_x16(const struct Weights *w, const struct Q8Type *t, int grp, int h,
                      uint8_t *panel)
{
    const size_t sbs = 32 * 32 + 256;
    int hdr = cpu_x16_header(w->type), five = w->type == DQ_Q5_0 || w->type == DQ_Q5_1;
    const __m128i bit5 = _mm_set1_epi8(0x10);
    /* Bit j of a 16-bit mask to byte j: each half's byte, then its bit. */
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i bits = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    for (int b = 0; b < w->cols / 32; b++) {
        const uint8_t *tile = cpu_x16_tile(w, grp, b), *q = tile + hdr;
        uint8_t *ps = panel + (size_t)b * sbs;
        float *fa = (float *)(void *)(ps + 32 * 32) + 16 * h;
        for (int e = 0; e < 2; e++) {
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(tile + 16 * e)));
            __m256 off = t->shift >= 0
                             ? _mm256_mul_ps(a, _mm256_set1_ps(-(float)(1 << t->shift)))
                             : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(tile + 32 + 16 * e)));
            _mm256_storeu_ps(fa + 8 * e, a);
            _mm256_storeu_ps(fa + 32 + 8 * e, off);
        }
        __m128i col[32];
        q8_x16_cols(w->type, q, col);
        if (five) {
            const uint8_t *hm = q - 64;
            for (int c = 0; c < 32; c++) {
                __m128i m = _mm_shuffle_epi8(_mm_cvtsi32_si128(hm[2 * c] | hm[2 * c + 1] << 8), spread);
                m = _mm_cmpeq_epi8(_mm_and_si128(m, bits), bits);
                col[c] = _mm_or_si128(col[c], _mm_and_si128(m, bit5));
            }
        }
        for (int s = 0; s < 8; s++)
            q8_put4(ps + (size_t)s * 128 + 64 * h, col[4 * s], col[4 * s + 1], col[4 * s + 2],
                    col[4 * s + 3]);
    }
}

void cpu_q8_panel_avx2(const struct Weights *w, int r0, int mb, uint8_t *panel, uint8_t *work)
{
    struct Q8Type t = {Q8_ACT_32, 32, -1, 0};
    cpu_q8_type(w->type, &t);
    if (w->layout == WEIGHTS_X16) {
        int groups = (w->rows + 15) / 16;
        for (int h = 0; h < 2; h++) {
            int grp = r0 / 16 + h;
            if (grp < groups && 16 * h < mb) {
                panel_x16(w, &t, grp, h, panel);
                if (mb - 16 * h < 16) zero_outputs(panel, w->cols, 32, h, mb - 16 * h);
            } else {
                zero_outputs(panel, w->cols, 32, h, 0);
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
        /* 8 rows x 8 groups of four quants at a time into 8 steps of the panel. */
        for (int r8 = 0; r8 < 4; r8++)
            for (int c0 = 0; c0 < QK_K; c0 += 32) {
                __m256 r[8];
                for (int i = 0; i < 8; i++)
                    r[i] = _mm256_loadu_ps((const float *)(const void *)(rows + (size_t)(8 * r8 + i) * QK_K + c0));
                avx2_transpose8(r);
                for (int st = 0; st < 8; st++) {
                    int c = c0 + 4 * st;
                    _mm256_storeu_ps((float *)(void *)(ps0 + (size_t)(c / g) * sbs +
                                                       (size_t)(c % g / 4) * 128 + 32 * r8),
                                     r[st]);
                }
            }
    }
}

/* --- the microkernel --- */

/* Rows i..i+mr-1 of the block against outputs 16h..16h+15 of the panel. g: sub-block; sym:
 * offset folded into the integer sum; steps: panel steps (four inputs each) summed in 16 bits
 * before widening; sgn: the weights as signed quants (Q8_0). */
static inline __attribute__((always_inline)) void
kernel(const int mr, const int g, const int sym, const int steps, const int sgn,
       const struct Q8Block *b, int i, int h, __m256i m0, __m256i m1)
{
    const struct Q8Rows *x = b->x;
    const int ns = b->k / g;
    const size_t sbs = (size_t)g * 32 + 256;
    const int32_t mul = sym && !sgn ? 1 << b->shift : 0;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    /* The f32 sums stay in memory: they change once a sub-block, and the registers go to the
     * 16-bit sums. */
    float f[MR][16] __attribute__((aligned(32)));
    const int8_t *q[MR];
    const float *d[MR], *dx[MR];
    const int32_t *nx[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) {
        size_t row = (size_t)(b->i0 + i + (r < mr ? r : 0));
        q[r] = x->q + row * x->q_stride;
        d[r] = x->d + row * x->s_stride;
        dx[r] = x->dx + row * x->s_stride;
        nx[r] = x->nx + row * x->s_stride;
        _mm256_store_ps(f[r], _mm256_setzero_ps());
        _mm256_store_ps(f[r] + 8, _mm256_setzero_ps());
    }
    const uint8_t *p = b->panel + 64 * h;
    const float *fa = (const float *)(const void *)(b->panel + (size_t)g * 32) + 16 * h;
    for (int s = 0; s < ns; s++, p += sbs, fa += sbs / sizeof(float)) {
        __m256i s0[MR], s1[MR];
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++)
            if (r < mr) s0[r] = s1[r] = mul ? _mm256_set1_epi32(nx[r][s] * mul) : _mm256_setzero_si256();
        for (int t0 = 0; t0 < g / 4; t0 += steps) {
            __m256i p0[MR], p1[MR];
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++) p0[r] = p1[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
            for (int t = t0; t < t0 + steps; t++) {
                __m256i w0 = _mm256_load_si256((const __m256i *)(const void *)(p + 128 * t));
                __m256i w1 = _mm256_load_si256((const __m256i *)(const void *)(p + 128 * t + 32));
                __m256i a0 = w0, a1 = w1;
                if (sgn) {
                    w0 = _mm256_xor_si256(w0, flip);
                    w1 = _mm256_xor_si256(w1, flip);
                    a0 = _mm256_abs_epi8(w0);
                    a1 = _mm256_abs_epi8(w1);
                }
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++)
                    if (r < mr) {
                        int32_t v;
                        memcpy(&v, q[r] + s * g + 4 * t, 4);
                        __m256i xb = _mm256_set1_epi32(v);
                        __m256i x0 = sgn ? _mm256_sign_epi8(xb, w0) : xb;
                        __m256i x1 = sgn ? _mm256_sign_epi8(xb, w1) : xb;
                        p0[r] = _mm256_add_epi16(p0[r], _mm256_maddubs_epi16(a0, x0));
                        p1[r] = _mm256_add_epi16(p1[r], _mm256_maddubs_epi16(a1, x1));
                    }
            }
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++)
                if (r < mr) {
                    s0[r] = _mm256_add_epi32(s0[r], _mm256_madd_epi16(p0[r], ones));
                    s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(p1[r], ones));
                }
        }
        __m256 a0 = _mm256_load_ps(fa), a1 = _mm256_load_ps(fa + 8);
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++)
            if (r < mr) {
                __m256 dr = _mm256_set1_ps(d[r][s]);
                __m256 f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[r]), _mm256_mul_ps(a0, dr),
                                            _mm256_load_ps(f[r]));
                __m256 f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[r]), _mm256_mul_ps(a1, dr),
                                            _mm256_load_ps(f[r] + 8));
                if (!sym) {
                    __m256 e = _mm256_set1_ps(dx[r][s]);
                    f0 = _mm256_fmadd_ps(_mm256_load_ps(fa + 32), e, f0);
                    f1 = _mm256_fmadd_ps(_mm256_load_ps(fa + 40), e, f1);
                }
                _mm256_store_ps(f[r], f0);
                _mm256_store_ps(f[r] + 8, f1);
            }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
        if (r < mr) {
            float *yr = b->y + (size_t)(i + r) * b->y_stride + 16 * h;
            __m256 f0 = _mm256_load_ps(f[r]), f1 = _mm256_load_ps(f[r] + 8);
            if (b->accumulate) {
                f0 = _mm256_add_ps(f0, _mm256_maskload_ps(yr, m0));
                f1 = _mm256_add_ps(f1, _mm256_maskload_ps(yr + 8, m1));
            }
            _mm256_maskstore_ps(yr, m0, f0);
            _mm256_maskstore_ps(yr + 8, m1, f1);
        }
}

#define Q8_ROWS(G, SYM, STEPS, SGN)                                                             \
    switch (mr) {                                                                               \
    case 4: kernel(4, G, SYM, STEPS, SGN, b, i, h, m0, m1); break;                              \
    case 3: kernel(3, G, SYM, STEPS, SGN, b, i, h, m0, m1); break;                              \
    case 2: kernel(2, G, SYM, STEPS, SGN, b, i, h, m0, m1); break;                              \
    default: kernel(1, G, SYM, STEPS, SGN, b, i, h, m0, m1); break;                             \
    }

/* Lanes j of 8 from `from` on that are below the block's outputs, as a maskload mask. */
static __m256i lanes(int from, int m_blk)
{
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m_blk - from), idx);
}

void cpu_q8_gemm_block_avx2(const struct Q8Block *b)
{
    int g = b->x->g, sym = b->shift >= 0;
    /* Panel steps whose 16-bit pair sums (each at most 2 x umax x 127) stay below 2^15. */
    int sgn = b->umax >= 255, steps = sgn || b->umax <= 0 ? 1 : 32767 / (2 * 127 * b->umax);
    steps = steps >= 8 ? 8 : steps >= 4 ? 4 : steps >= 2 ? 2 : 1;
    if (steps > g / 4) steps = g / 4;
    /* The combinations the weight types have (cpu_q8_type); any other runs portably. */
    int form = sgn ? 1 : g == 32 && steps == 8 ? 2 : g == 32 && steps == 4 ? 3
             : g == 16 && steps == 4 ? 4 : g == 16 && sym && steps == 2 ? 5 : 0;
    if (!form) {
        cpu_q8_gemm_block(b);
        return;
    }
    for (int i = 0; i < b->n; i += MR) {
        int mr = b->n - i < MR ? b->n - i : MR;
        for (int h = 0; h < 2 && 16 * h < b->m_blk; h++) {
            __m256i m0 = lanes(16 * h, b->m_blk), m1 = lanes(16 * h + 8, b->m_blk);
            switch (form * 2 + sym) {
            case 3: Q8_ROWS(32, 1, 1, 1) break;      /* Q8_0 */
            case 5: Q8_ROWS(32, 1, 8, 0) break;      /* Q4_0 */
            case 4: Q8_ROWS(32, 0, 8, 0) break;      /* Q4_1, Q4_K */
            case 7: Q8_ROWS(32, 1, 4, 0) break;      /* Q5_0 */
            case 6: Q8_ROWS(32, 0, 4, 0) break;      /* Q5_1, Q5_K */
            case 9: Q8_ROWS(16, 1, 4, 0) break;      /* Q3_K */
            case 8: Q8_ROWS(16, 0, 4, 0) break;      /* Q2_K */
            default: Q8_ROWS(16, 1, 2, 0) break;     /* Q6_K */
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
void cpu_q8_panel_avx2(const struct Weights *w, int r0, int mb, uint8_t *panel, uint8_t *work)
{
    cpu_q8_panel(w, r0, mb, panel, work);
}
void cpu_q8_gemm_block_avx2(const struct Q8Block *b) { cpu_q8_gemm_block(b); }
#endif
