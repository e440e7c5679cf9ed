/* AVX-512 paths of the K-quants (row layout): the one-token product of each row with x, and
 * the exact decoding of rows for the prefill panels. Each super-block is unpacked once
 * (kquant_simd.h) into int8 quants and per-16-element factors; the product then sums
 * factor * (q . x) per chunk, with the mins' share taken from the 32-element block sums of x
 * (Q4_K, Q5_K) or summed alongside (Q2_K). */
#include "kernels/cpu/cpu.h"
#include "kernels/dequant.h"

#if defined(__x86_64__) && defined(__GNUC__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#include "kernels/cpu/kquant_simd.h"

static inline __m512 chunk_q(const int8_t *q)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)q)));
}

/* The products below serve nr inputs (1..CPU_MV_ROWS) per unpacking of a row: input r has its
 * own accumulators and gets exactly the operations it gets alone. */
#define KQ_INLINE static inline __attribute__((always_inline))

static inline __m512 sum4(const __m512 *a)
{
    return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
}

/* Sub-blocks 2c and 2c + 1 of a super-block (64 values at x[r] + at, decoded into w0..w3, 16
 * each) for every input r: a sum per sub-block, scaled by its factor into the accumulators
 * 2c and 2c + 1 (mod 4). Q4_K and Q5_K share it. */
KQ_INLINE void pair_rows(__m512 w0, __m512 w1, __m512 w2, __m512 w3, const float *const *x,
                         size_t at, const float *dl, int c, int nr, __m512 (*acc)[4])
{
    for (int r = 0; r < nr; r++) {
        const float *xc = x[r] + at;
        __m512 lo = _mm512_mul_ps(w0, _mm512_loadu_ps(xc));
        lo = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xc + 16), lo);
        __m512 hi = _mm512_mul_ps(w2, _mm512_loadu_ps(xc + 32));
        hi = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xc + 48), hi);
        acc[r][(2 * c) & 3] = _mm512_fmadd_ps(_mm512_set1_ps(dl[0]), lo, acc[r][(2 * c) & 3]);
        acc[r][(2 * c + 1) & 3] = _mm512_fmadd_ps(_mm512_set1_ps(dl[1]), hi, acc[r][(2 * c + 1) & 3]);
    }
}

/* Q4_K without the unpacking buffer: nibbles straight from the loaded bytes to floats through
 * a 16-entry table (vpermps reads only an index's low 4 bits), one factor per 32 values. */
KQ_INLINE void dot_q4k(const uint8_t *row, const float *const *x, const float *const *xsum,
                       int nb, int nr, float *out)
{
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[CPU_MV_ROWS][4];
    __m256 mv[CPU_MV_ROWS];
    for (int r = 0; r < nr; r++) {
        acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
        mv[r] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++, row += 144) {
        uint8_t sc[8], mn[8];
        kquant_scales_mins(row + 4, sc, mn);
        float dl[8];
        _mm256_storeu_ps(dl, kq_scale8_u(sc, kquant_half(row)));
        __m256 ml = kq_scale8_u(mn, kquant_half(row + 2));
        for (int r = 0; r < nr; r++)
            mv[r] = _mm256_fmadd_ps(ml, _mm256_loadu_ps(xsum[r] + 8 * b), mv[r]);
        const uint8_t *qs = row + 16;
        for (int c = 0; c < 4; c++) {
            __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(qs + 32 * c)));
            __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(qs + 32 * c + 16)));
            __m512 w0 = _mm512_permutexvar_ps(v0, table), w1 = _mm512_permutexvar_ps(v1, table);
            __m512 w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), table);
            __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), table);
            pair_rows(w0, w1, w2, w3, x, (size_t)QK_K * b + 64 * c, dl + 2 * c, c, nr, acc);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_reduce_add_ps(sum4(acc[r])) - kq_hsum8(mv[r]);
}

/* Bit s of each lane moved to bit 4, other bits cleared (b4 = 0x10 in each lane). */
static inline __m512i bit4(__m512i h, int s, __m512i b4)
{
    return _mm512_and_si512(s <= 4 ? _mm512_slli_epi32(h, 4 - s) : _mm512_srli_epi32(h, s - 4), b4);
}

/* Q5_K likewise: the fifth bit (bit s of qh[l] for sub-block s) becomes bit 4 of the index into
 * a 32-entry table (vpermt2ps reads the index's low 5 bits). */
KQ_INLINE void dot_q5k(const uint8_t *row, const float *const *x, const float *const *xsum,
                       int nb, int nr, float *out)
{
    const __m512 t_lo = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t_hi = _mm512_add_ps(t_lo, _mm512_set1_ps(16.f));
    const __m512i m4 = _mm512_set1_epi32(0x0f), b4 = _mm512_set1_epi32(0x10);
    __m512 acc[CPU_MV_ROWS][4];
    __m256 mv[CPU_MV_ROWS];
    for (int r = 0; r < nr; r++) {
        acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
        mv[r] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++, row += 176) {
        uint8_t sc[8], mn[8];
        kquant_scales_mins(row + 4, sc, mn);
        float dl[8];
        _mm256_storeu_ps(dl, kq_scale8_u(sc, kquant_half(row)));
        __m256 ml = kq_scale8_u(mn, kquant_half(row + 2));
        for (int r = 0; r < nr; r++)
            mv[r] = _mm256_fmadd_ps(ml, _mm256_loadu_ps(xsum[r] + 8 * b), mv[r]);
        const uint8_t *qh = row + 16, *qs = row + 48;
        __m512i h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)qh));
        __m512i h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(qh + 16)));
        for (int c = 0; c < 4; c++) {
            __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(qs + 32 * c)));
            __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(qs + 32 * c + 16)));
            /* sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles), fifth bits at bit 4 */
            __m512i l0 = _mm512_or_si512(_mm512_and_si512(v0, m4), bit4(h0, 2 * c, b4));
            __m512i l1 = _mm512_or_si512(_mm512_and_si512(v1, m4), bit4(h1, 2 * c, b4));
            __m512i u0 = _mm512_or_si512(_mm512_srli_epi32(v0, 4), bit4(h0, 2 * c + 1, b4));
            __m512i u1 = _mm512_or_si512(_mm512_srli_epi32(v1, 4), bit4(h1, 2 * c + 1, b4));
            __m512 w0 = _mm512_permutex2var_ps(t_lo, l0, t_hi), w1 = _mm512_permutex2var_ps(t_lo, l1, t_hi);
            __m512 w2 = _mm512_permutex2var_ps(t_lo, u0, t_hi), w3 = _mm512_permutex2var_ps(t_lo, u1, t_hi);
            pair_rows(w0, w1, w2, w3, x, (size_t)QK_K * b + 64 * c, dl + 2 * c, c, nr, acc);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_reduce_add_ps(sum4(acc[r])) - kq_hsum8(mv[r]);
}

/* Q6_K without the unpacking buffer: q - 32 = table1[low 4 bits] + table2[2 high bits], where
 * table2 (16 * h - 32) is indexed by the qh byte shifted so the two bits are lowest (vpermps
 * reads only the index's low 4 bits: table2 repeats every 4 entries, so the bits above do not
 * matter). */
KQ_INLINE void dot_q6k(const uint8_t *row, const float *const *x, int nb, int nr, float *out)
{
    const __m512 t1 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t2 = _mm512_setr_ps(-32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16);
    __m512 acc[CPU_MV_ROWS][4];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, row += 210) {
        float dl[16];
        float d = kquant_half(row + 208);
        _mm256_storeu_ps(dl, kq_scale8_s(row + 192, d));
        _mm256_storeu_ps(dl + 8, kq_scale8_s(row + 200, d));
        for (int h = 0; h < 2; h++)
            for (int l0 = 0; l0 < 32; l0 += 16) {
                const uint8_t *ql = row + 64 * h + l0, *qh = row + 128 + 32 * h + l0;
                __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)ql));
                __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(ql + 32)));
                __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)qh));
                __m512 q[4] = {
                    _mm512_add_ps(_mm512_permutexvar_ps(a, t1), _mm512_permutexvar_ps(hb, t2)),
                    _mm512_add_ps(_mm512_permutexvar_ps(c, t1),
                                  _mm512_permutexvar_ps(_mm512_srli_epi32(hb, 2), t2)),
                    _mm512_add_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), t1),
                                  _mm512_permutexvar_ps(_mm512_srli_epi32(hb, 4), t2)),
                    _mm512_add_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t1),
                                  _mm512_permutexvar_ps(_mm512_srli_epi32(hb, 6), t2)),
                };
                for (int r = 0; r < nr; r++) {
                    const float *xh = x[r] + (size_t)QK_K * b + 128 * h + l0;
                    for (int i = 0; i < 4; i++) {
                        /* values 128h + 32i + l0 .. +15: chunk 8h + 2i + l0/16 */
                        __m512 t = _mm512_mul_ps(q[i], _mm512_loadu_ps(xh + 32 * i));
                        acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(dl[8 * h + 2 * i + l0 / 16]), t, acc[r][i]);
                    }
                }
            }
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_reduce_add_ps(sum4(acc[r]));
}

/* The other K-quants through the unpacking buffer (kquant_simd.h). */
KQ_INLINE void dot_other(uint32_t type, const uint8_t *row, const float *const *x,
                         const float *const *xsum, int nb, int nr, float *out)
{
    int bb = dequant_block_bytes(type);
    enum KMins mins = kq_mins(type);
    __m512 acc[CPU_MV_ROWS][4], macc[CPU_MV_ROWS];
    __m256 mv[CPU_MV_ROWS];
    for (int r = 0; r < nr; r++) {
        acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = macc[r] = _mm512_setzero_ps();
        mv[r] = _mm256_setzero_ps();
    }
    struct KBlock kb = {.m32 = {0}}; /* m32 is only set (and read) for Q4_K, Q5_K */
    for (int b = 0; b < nb; b++, row += bb) {
        _mm_prefetch((const char *)(row + 4 * bb), _MM_HINT_T0);
        _mm_prefetch((const char *)(row + 4 * bb + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(row + 4 * bb + 128), _MM_HINT_T0);
        kq_unpack(type, row, &kb);
        for (int r = 0; r < nr; r++) {
            const float *xr = x[r] + (size_t)QK_K * b;
            if (mins == KMINS_32) {
                /* one factor per 32 elements: two chunks per multiply by the factor */
                for (int s = 0; s < 16; s += 2) {
                    __m512 t = _mm512_mul_ps(chunk_q(kb.q + 16 * s), _mm512_loadu_ps(xr + 16 * s));
                    t = _mm512_fmadd_ps(chunk_q(kb.q + 16 * s + 16), _mm512_loadu_ps(xr + 16 * s + 16), t);
                    acc[r][(s >> 1) & 3] = _mm512_fmadd_ps(_mm512_set1_ps(kb.dl[s]), t, acc[r][(s >> 1) & 3]);
                }
            } else {
                for (int s = 0; s < 16; s++) {
                    __m512 xv = _mm512_loadu_ps(xr + 16 * s);
                    __m512 t = _mm512_mul_ps(chunk_q(kb.q + 16 * s), xv);
                    acc[r][s & 3] = _mm512_fmadd_ps(_mm512_set1_ps(kb.dl[s]), t, acc[r][s & 3]);
                    if (mins == KMINS_16) macc[r] = _mm512_fmadd_ps(_mm512_set1_ps(kb.ml[s]), xv, macc[r]);
                }
            }
            if (mins == KMINS_32)
                mv[r] = _mm256_fmadd_ps(_mm256_loadu_ps(kb.m32), _mm256_loadu_ps(xsum[r] + 8 * b), mv[r]);
        }
    }
    for (int r = 0; r < nr; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_sub_ps(sum4(acc[r]), macc[r])) - kq_hsum8(mv[r]);
}

KQ_INLINE void dot_k(uint32_t type, const uint8_t *row, const float *const *x,
                     const float *const *xsum, int nb, int nr, float *out)
{
    if (type == DQ_Q4_K) dot_q4k(row, x, xsum, nb, nr, out);
    else if (type == DQ_Q6_K) dot_q6k(row, x, nb, nr, out);
    else if (type == DQ_Q5_K) dot_q5k(row, x, xsum, nb, nr, out);
    else dot_other(type, row, x, xsum, nb, nr, out);
}

/* One specialised body per count of inputs, so each input's accumulators live in registers. */
void cpu_dot_k_avx512(uint32_t type, const uint8_t *row, const float *const *x,
                      const float *const *xsum, int nb, int nr, float *out)
{
    switch (nr) {
    case 1: dot_k(type, row, x, xsum, nb, 1, out); break;
    case 2: dot_k(type, row, x, xsum, nb, 2, out); break;
    case 3: dot_k(type, row, x, xsum, nb, 3, out); break;
    default: dot_k(type, row, x, xsum, nb, 4, out); break;
    }
}

void cpu_decode_k_avx512(uint32_t type, const uint8_t *src, float *dst, int nb)
{
    int bb = dequant_block_bytes(type);
    int mins = kq_mins(type) != KMINS_NONE;
    struct KBlock kb = {.m32 = {0}}; /* m32 is only set (and read) for Q4_K, Q5_K */
    for (int b = 0; b < nb; b++, src += bb, dst += QK_K) {
        kq_unpack(type, src, &kb);
        for (int s = 0; s < 16; s++) {
            __m512 v = _mm512_mul_ps(chunk_q(kb.q + 16 * s), _mm512_set1_ps(kb.dl[s]));
            if (mins) v = _mm512_sub_ps(v, _mm512_set1_ps(kb.ml[s]));
            _mm512_storeu_ps(dst + 16 * s, v);
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
/* Not an x86-64 build: cpu_isa_supported never reports AVX-512, so these are never called. */
void cpu_dot_k_avx512(uint32_t type, const uint8_t *row, const float *const *x,
                      const float *const *xsum, int nb, int nr, float *out)
{
    (void)type; (void)row; (void)x; (void)xsum; (void)nb; (void)nr; (void)out;
}
void cpu_decode_k_avx512(uint32_t type, const uint8_t *src, float *dst, int nb)
{
    (void)type; (void)src; (void)dst; (void)nb;
}
#endif
