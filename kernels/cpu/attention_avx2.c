/* AVX2 instantiation of the attention inner loop (attention_simd.h): 2 query rows by 32 keys
 * of scores, 2 rows by 32 head dims of output per register block (16 ymm registers).
 * Compiled for AVX2 + FMA whatever the build's -march; called only when
 * cpu_isa_supported(CPU_ISA_AVX2). */
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <math.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define VEC __m256
#define VL 8
#define RB 2
#define KC 4
#define DC 4
#define vzero() _mm256_setzero_ps()
#define vload_h(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define vload(p) _mm256_loadu_ps(p)
#define vload_q8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p))))
#define IVEC __m256i
#define ivzero() _mm256_setzero_si256()
#define ivset1(x) _mm256_set1_epi32(x)
#define ivadd(a, b) _mm256_add_epi32((a), (b))
#define ivcvt(v) _mm256_cvtepi32_ps(v)
#define ivload_pairs(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define ivmadd(a, b) _mm256_madd_epi16((a), (b))
#define ivlow16(v) _mm256_srai_epi32(_mm256_slli_epi32((v), 16), 16)
#define ivhigh16(v) _mm256_srai_epi32((v), 16)
#define vstore(p, v) _mm256_storeu_ps((p), (v))
#define vset1(x) _mm256_set1_ps(x)
#define vfma(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define vmul(a, b) _mm256_mul_ps((a), (b))
#define vadd(a, b) _mm256_add_ps((a), (b))
#define vmax(a, b) _mm256_max_ps((a), (b))

static inline float vhsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float vhmax(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 vkeep_lt(__m256 v, int first, int limit, float fill)
{
    __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(limit - first),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(keep));
}

/* 2^x as in attention_avx512.c, with 2^n built in the exponent bits. */
static inline __m256 vexp2(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530393381608e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline void load_half(float *dst, const uint16_t *src, int n)
{
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
}

#define ATTEND cpu_attend_avx2
#include "kernels/cpu/attention_simd.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
void cpu_attend_avx2(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke,
                     float *ws, float *O, float *M, float *L)
{
    (void)a; (void)g; (void)t0; (void)bq; (void)kb; (void)ke; (void)ws; (void)O; (void)M; (void)L;
}
#endif
