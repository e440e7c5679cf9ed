/* AVX2 microkernels of the prefill products: a 6 x 16 register tile (12 accumulators) over
 * k-major panels of 16 outputs. Compiled for AVX2 + FMA whatever the build's -march; called
 * only when cpu_isa_supported(CPU_ISA_AVX2). */
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "kernels/cpu/transpose_avx2.h"

enum { MR = 6, NR = 16 };

static inline void transpose8(const float *src, size_t ss, float *dst, size_t ds)
{
    __m256 r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ss);
    avx2_transpose8(r);
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * ds, r[i]);
}

void cpu_pack_panel_avx2(const float *rows, int nr, int k, float *panel)
{
    int k8 = k & ~7;
    for (int h = 0; h < 2; h++) {
        int j0 = 8 * h;
        if (nr >= j0 + 8) {
            for (int kk = 0; kk < k8; kk += 8)
                transpose8(rows + (size_t)j0 * k + kk, (size_t)k, panel + (size_t)kk * NR + j0, NR);
            for (int kk = k8; kk < k; kk++)
                for (int j = 0; j < 8; j++)
                    panel[(size_t)kk * NR + j0 + j] = rows[(size_t)(j0 + j) * k + kk];
        } else {
            for (int kk = 0; kk < k; kk++)
                for (int j = 0; j < 8; j++)
                    panel[(size_t)kk * NR + j0 + j] =
                        j0 + j < nr ? rows[(size_t)(j0 + j) * k + kk] : 0.f;
        }
    }
}

static inline __m256i lane_mask(int n)
{
    n = n < 0 ? 0 : n > 8 ? 8 : n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __attribute__((always_inline)) void
kernel(const int mr, const float *x, size_t xs, int k, const float *p, float *y, size_t ys,
       int acc, __m256i m0, __m256i m1)
{
    __m256 c0[MR], c1[MR];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
        if (r < mr) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
    const float *xr[MR];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) xr[r] = x + (size_t)(r < mr ? r : 0) * xs;
    for (int kk = 0; kk < k; kk++) {
        __m256 b0 = _mm256_load_ps(p), b1 = _mm256_load_ps(p + 8);
        p += NR;
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++)
            if (r < mr) {
                __m256 a = _mm256_broadcast_ss(xr[r] + kk);
                c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
                c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
            }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
        if (r < mr) {
            float *yr = y + (size_t)r * ys;
            if (acc) {
                c0[r] = _mm256_add_ps(c0[r], _mm256_maskload_ps(yr, m0));
                c1[r] = _mm256_add_ps(c1[r], _mm256_maskload_ps(yr + 8, m1));
            }
            _mm256_maskstore_ps(yr, m0, c0[r]);
            _mm256_maskstore_ps(yr + 8, m1, c1[r]);
        }
}

#define KERNEL_CASE(n) case n: kernel(n, x, b->x_stride, b->k, b->panel, y, b->y_stride, b->accumulate, m0, m1); break;

void cpu_gemm_block_avx2(const struct GemmBlock *b)
{
    __m256i m0 = lane_mask(b->m_blk), m1 = lane_mask(b->m_blk - 8);
    for (int i = 0; i < b->n; i += MR) {
        int mr = b->n - i < MR ? b->n - i : MR;
        const float *x = b->x + (size_t)i * b->x_stride;
        float *y = b->y + (size_t)i * b->y_stride;
        switch (mr) {
            KERNEL_CASE(6) KERNEL_CASE(5) KERNEL_CASE(4) KERNEL_CASE(3) KERNEL_CASE(2)
            KERNEL_CASE(1)
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
void cpu_pack_panel_avx2(const float *rows, int nr, int k, float *panel)
{
    (void)rows; (void)nr; (void)k; (void)panel;
}
void cpu_gemm_block_avx2(const struct GemmBlock *b) { (void)b; }
#endif
