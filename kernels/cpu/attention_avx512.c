/* AVX-512 instantiation of the attention inner loop (attention_simd.h): 6 query rows by 64
 * keys of scores in registers, 6 rows by 64 head dims of output. Compiled for AVX-512
 * whatever the build's -march; called only when cpu_isa_supported(CPU_ISA_AVX512). */
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <math.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#include "kernels/cpu/exp2_avx512.h"

#define VEC __m512
#define VL 16
#define RB 6
#define KC 4
#define DC 4
#define vzero() _mm512_setzero_ps()
#define vload_h(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define vload(p) _mm512_loadu_ps(p)
#define vload_q8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p))))
#define IVEC __m512i
#define ivzero() _mm512_setzero_si512()
#define ivset1(x) _mm512_set1_epi32(x)
#define ivadd(a, b) _mm512_add_epi32((a), (b))
#define ivcvt(v) _mm512_cvtepi32_ps(v)
#define ivload_pairs(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define ivmadd(a, b) _mm512_madd_epi16((a), (b))
#define ivlow16(v) _mm512_srai_epi32(_mm512_slli_epi32((v), 16), 16)
#define ivhigh16(v) _mm512_srai_epi32((v), 16)
#define vstore(p, v) _mm512_storeu_ps((p), (v))
#define vset1(x) _mm512_set1_ps(x)
#define vfma(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define vmul(a, b) _mm512_mul_ps((a), (b))
#define vadd(a, b) _mm512_add_ps((a), (b))
#define vmax(a, b) _mm512_max_ps((a), (b))
#define vhmax(v) _mm512_reduce_max_ps(v)
#define vhsum(v) _mm512_reduce_add_ps(v)

static inline __m512 vkeep_lt(__m512 v, int first, int limit, float fill)
{
    int n = limit - first;
    __mmask16 m = n <= 0 ? 0 : n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    return _mm512_mask_blend_ps(m, _mm512_set1_ps(fill), v);
}

#define vexp2(x) cpu_exp2_avx512(x)

static inline void load_half(float *dst, const uint16_t *src, int n)
{
    for (int i = 0; i < n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
}

#define ATTEND cpu_attend_avx512
#include "kernels/cpu/attention_simd.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
void cpu_attend_avx512(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke,
                       float *ws, float *O, float *M, float *L)
{
    (void)a; (void)g; (void)t0; (void)bq; (void)kb; (void)ke; (void)ws; (void)O; (void)M; (void)L;
}
#endif
