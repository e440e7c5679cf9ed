/* AVX-512 microkernels of the prefill products: a 14 x 32 register tile (28 accumulators,
 * two panel loads and one broadcast per step of k), and the packing of decoded weight rows
 * into the k-major panels it reads. Compiled for AVX-512 whatever the build's -march; called
 * only when cpu_isa_supported(CPU_ISA_AVX512). */
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#include "kernels/cpu/exp2_avx512.h"
#include "kernels/cpu/transpose_avx512.h"

enum { MR = 14, NR = 32 };

/* Transposes a 16 x 16 block: rows src[i*ss .. +16] become columns of dst (rows ds apart). */
static inline void transpose16(const float *src, size_t ss, float *dst, size_t ds)
{
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ss);
    avx512_transpose16(r);
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ds, r[i]);
}

void cpu_pack_panel_avx512(const float *rows, int nr, int k, float *panel)
{
    /* rows: (nr, k) decoded weights, nr <= NR; panel: (k, NR) with zero columns past nr. */
    int k16 = k & ~15;
    for (int h = 0; h < 2; h++) {
        int j0 = 16 * h;
        if (nr >= j0 + 16) {
            for (int kk = 0; kk < k16; kk += 16)
                transpose16(rows + (size_t)j0 * k + kk, (size_t)k, panel + (size_t)kk * NR + j0, NR);
            for (int kk = k16; kk < k; kk++)
                for (int j = 0; j < 16; j++)
                    panel[(size_t)kk * NR + j0 + j] = rows[(size_t)(j0 + j) * k + kk];
        } else {
            for (int kk = 0; kk < k; kk++)
                for (int j = 0; j < 16; j++)
                    panel[(size_t)kk * NR + j0 + j] =
                        j0 + j < nr ? rows[(size_t)(j0 + j) * k + kk] : 0.f;
        }
    }
}

static inline __attribute__((always_inline)) void
kernel(const int mr, const float *x, size_t xs, int k, const float *p, float *y, size_t ys,
       int acc, __mmask16 m0, __mmask16 m1)
{
    __m512 c0[MR], c1[MR];
#pragma GCC unroll 14
    for (int r = 0; r < MR; r++)
        if (r < mr) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
    const float *xr[MR];
#pragma GCC unroll 14
    for (int r = 0; r < MR; r++) xr[r] = x + (size_t)(r < mr ? r : 0) * xs;
    for (int kk = 0; kk < k; kk++) {
        __m512 b0 = _mm512_load_ps(p), b1 = _mm512_load_ps(p + 16);
        p += NR;
#pragma GCC unroll 14
        for (int r = 0; r < MR; r++)
            if (r < mr) {
                __m512 a = _mm512_set1_ps(xr[r][kk]);
                c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
                c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
            }
    }
#pragma GCC unroll 14
    for (int r = 0; r < MR; r++)
        if (r < mr) {
            float *yr = y + (size_t)r * ys;
            if (acc) {
                c0[r] = _mm512_add_ps(c0[r], _mm512_maskz_loadu_ps(m0, yr));
                c1[r] = _mm512_add_ps(c1[r], _mm512_maskz_loadu_ps(m1, yr + 16));
            }
            _mm512_mask_storeu_ps(yr, m0, c0[r]);
            _mm512_mask_storeu_ps(yr + 16, m1, c1[r]);
        }
}

/* g = silu(g) * u = g / (1 + e^-g) * u; e^x as 2^(x log2 e) (exp2_avx512.h). */
void cpu_silu_mul_avx512(float *g, const float *u, int n)
{
    for (int j = 0; j < n; j += 16) {
        __mmask16 m = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + j), uv = _mm512_maskz_loadu_ps(m, u + j);
        __m512 x = _mm512_mul_ps(gv, _mm512_set1_ps(-1.44269504088896341f));
        x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
        __m512 e = cpu_exp2_avx512(x);
        __m512 r = _mm512_div_ps(_mm512_mul_ps(gv, uv), _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_mask_storeu_ps(g + j, m, r);
    }
}

#define KERNEL_CASE(n) case n: kernel(n, x, b->x_stride, b->k, b->panel, y, b->y_stride, b->accumulate, m0, m1); break;

void cpu_gemm_block_avx512(const struct GemmBlock *b)
{
    int mb = b->m_blk;
    __mmask16 m0 = mb >= 16 ? 0xffff : (__mmask16)((1u << mb) - 1);
    __mmask16 m1 = mb >= 32 ? 0xffff : mb <= 16 ? 0 : (__mmask16)((1u << (mb - 16)) - 1);
    for (int i = 0; i < b->n; i += MR) {
        int mr = b->n - i < MR ? b->n - i : MR;
        const float *x = b->x + (size_t)i * b->x_stride;
        float *y = b->y + (size_t)i * b->y_stride;
        switch (mr) {
            KERNEL_CASE(14) KERNEL_CASE(13) KERNEL_CASE(12) KERNEL_CASE(11) KERNEL_CASE(10)
            KERNEL_CASE(9) KERNEL_CASE(8) KERNEL_CASE(7) KERNEL_CASE(6) KERNEL_CASE(5)
            KERNEL_CASE(4) KERNEL_CASE(3) KERNEL_CASE(2) KERNEL_CASE(1)
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
void cpu_pack_panel_avx512(const float *rows, int nr, int k, float *panel)
{
    (void)rows; (void)nr; (void)k; (void)panel;
}
void cpu_gemm_block_avx512(const struct GemmBlock *b) { (void)b; }
void cpu_silu_mul_avx512(float *g, const float *u, int n) { (void)g; (void)u; (void)n; }
#endif
