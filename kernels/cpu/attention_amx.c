/* Prefill attention on the AMX tile unit: the two products of flash attention (scores = Q K^T,
 * output += P V) as bf16 tile products with f32 accumulation (`tdpbf16ps`), the online
 * softmax in f32 with AVX-512, the state (M, L, O) in f32 as on the other paths.
 *
 * Accuracy: a bf16 has 8 significant bits, so one bf16 product of a query and a key would
 * err by about 2^-8 of the score, and the scores of long contexts reach tens in base 2. The
 * scores are therefore computed from split operands, q = q_hi + q_lo and k = k_hi + k_lo
 * (each part a bf16, the pair holding 16 significant bits), as q_hi k_hi + q_hi k_lo +
 * q_lo k_hi: three tile products instead of one, the dropped q_lo k_lo below 2^-16 of the
 * score. The probabilities (in [0, 2^8], see LAZY) and the values go through one bf16 product
 * each, their error averaged over the keys. docs/performance.md measures what the path costs in accuracy.
 *
 * Every task of a call reads the same tiles, so each tile is packed for the tile unit once per
 * call (cpu_amx_pack_tile, a pass of its own before the tasks): the keys as bf16 hi and lo,
 * the values as bf16, CPU_AMX_TILE_ELEMS(hd) elements per tile. A task's workspace
 * (cpu_attend_amx_ws_floats) holds its rows' queries as bf16 hi and lo (rows padded to 32),
 * for one step of keys (STEP, four tiles) every row's scores (f32) and probabilities (bf16),
 * so that the tile products of all blocks run back to back, then the softmax of all rows,
 * then the products with the values; and the rows' outputs (hd f32 each), which the products
 * with the values accumulate in the tiles themselves (loaded, added to, stored back).
 *
 * A tile product B operand holds pairs: row i, column n is (B[2i][n], B[2i+1][n]) as two
 * adjacent bf16. For the scores B[d][j] = K[d][j] (pairs of head dimensions), for the output
 * B[j][d] = V[j][d] (pairs of keys). */
#include "kernels/cpu/cpu.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILE KV_TILE
enum { BR = 16 };          /* rows of a tile */
/* Keys per softmax step: four tiles. Each step reads and writes every row's outputs once (as
 * tile accumulators) and reduces each row's maximum once, so longer steps cost less of both;
 * beyond four tiles the scores of a task's rows (256 rows x 256 keys f32) outgrow the core's
 * second-level cache, and eight tiles measured slower. */
enum { STEP_TILES = 4, STEP = STEP_TILES * TILE };

/* Elements of the split queries for R rows (padded to two blocks) of head_dim hd. */
static size_t q_elems(int R, int hd) { return (size_t)((R + 2 * BR - 1) / (2 * BR) * 2 * BR) * hd; }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")

#include "kernels/cpu/exp2_avx512.h"

struct TileCfg {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* 16 f32 to bf16, rounded to nearest even (the instruction's rounding). */
static inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 from_bf16(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Pairs (a[j], b[j]) as 16 dwords: one B-operand row. */
static inline __m512i pair16(__m256i a, __m256i b)
{
    return _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* 16 floats of a cache row as f32. */
static inline __m512 load_kv16(const void *base, enum KvType t, size_t at)
{
    if (t == KV_F16)
        return _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)base + at)));
    return _mm512_loadu_ps((const float *)base + at);
}

static inline __mmask16 keep_below(int first, int limit)
{
    int n = limit - first;
    return n <= 0 ? 0 : n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
}

/* The tile's keys, split and packed: Kp[(s * 4 + n) * 512 + i * 32 + 2 j + e] is dimension
 * 32 s + 2 i + e of key 16 n + j (hi in Kh, lo in Kl). */
static void pack_keys(const void *k, enum KvType t, size_t at, int hd, uint16_t *Kh, uint16_t *Kl)
{
    for (int d = 0; d < hd; d += 2) {
        int s = d / 32, i = (d % 32) / 2;
        for (int n = 0; n < TILE / 16; n++) {
            __m512 a = load_kv16(k, t, at + (size_t)d * TILE + 16 * n);
            __m512 b = load_kv16(k, t, at + (size_t)(d + 1) * TILE + 16 * n);
            __m256i ah = to_bf16(a), bh = to_bf16(b);
            __m256i al = to_bf16(_mm512_sub_ps(a, from_bf16(ah)));
            __m256i bl = to_bf16(_mm512_sub_ps(b, from_bf16(bh)));
            size_t o = ((size_t)s * 4 + n) * 512 + (size_t)i * 32;
            _mm512_storeu_si512(Kh + o, pair16(ah, bh));
            _mm512_storeu_si512(Kl + o, pair16(al, bl));
        }
    }
}

/* The tile's values packed: Vp[(s * (hd / 16) + n) * 512 + i * 32 + 2 j + e] is dimension
 * 16 n + j of key 32 s + 2 i + e; keys at nk and past are zeros. */
static void pack_values(const void *v, enum KvType t, size_t at, int hd, int nk, uint16_t *Vp)
{
    int nb = hd / 16;
    for (int kk = 0; kk < TILE; kk += 2) {
        int s = kk / 32, i = (kk % 32) / 2;
        for (int n = 0; n < nb; n++) {
            __m512 a = kk < nk ? load_kv16(v, t, at + (size_t)kk * hd + 16 * n)
                               : _mm512_setzero_ps();
            __m512 b = kk + 1 < nk ? load_kv16(v, t, at + (size_t)(kk + 1) * hd + 16 * n)
                                   : _mm512_setzero_ps();
            _mm512_storeu_si512(Vp + ((size_t)s * nb + n) * 512 + (size_t)i * 32,
                                pair16(to_bf16(a), to_bf16(b)));
        }
    }
}

/* C tiles 0..3 += (A0; A1) (B0 B1): two blocks of 16 rows (A0, A1, rows lda bytes apart) by
 * two column blocks (B0, B1, packed pairs), four accumulators so that consecutive tile
 * products never wait for each other. */
static inline void quad(const uint16_t *A0, const uint16_t *A1, int lda, const uint16_t *B0,
                        const uint16_t *B1)
{
    _tile_loadd(4, A0, lda);
    _tile_loadd(5, A1, lda);
    _tile_loadd(6, B0, 64);
    _tile_loadd(7, B1, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* C tiles 0..3 to a (32, 32-column) block of out (rows ldo floats apart). */
static inline void store_quad(float *out, size_t ldo)
{
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
    _tile_stored(2, out + BR * ldo, ldo * 4);
    _tile_stored(3, out + BR * ldo + 16, ldo * 4);
}

/* The scores of two blocks of 16 rows (the second 16 rows after the first) against a tile's
 * 64 keys, into S (rows STEP floats apart): q_hi k_lo + q_hi k_hi + q_lo k_hi, over the head
 * dimensions 32 at a time, 32 keys at a time. The operands are loaded in that order so that
 * each is loaded once per product it takes part in: q_hi for the first two, k_hi for the last
 * two. */
static inline void pair_scores(const uint16_t *Qh, const uint16_t *Ql, const uint16_t *Kh,
                               const uint16_t *Kl, int hd, float *S)
{
    size_t qb = (size_t)BR * hd;   /* the second block's queries */
    int lda = hd * 2;
    for (int n = 0; n < 4; n += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int s = 0; s < hd / 32; s++) {
            const uint16_t *kh = Kh + ((size_t)s * 4 + n) * 512;
            const uint16_t *kl = Kl + ((size_t)s * 4 + n) * 512;
            quad(Qh + 32 * s, Qh + qb + 32 * s, lda, kl, kl + 512);
            _tile_loadd(6, kh, 64);
            _tile_loadd(7, kh + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            _tile_loadd(4, Ql + 32 * s, lda);
            _tile_loadd(5, Ql + qb + 32 * s, lda);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        store_quad(S + 16 * n, STEP);
    }
}

/* O (32, hd), rows hd floats apart, += the probabilities of two blocks of 16 rows (P, rows
 * STEP bf16 apart, 32 ns columns) times the values of a step's tiles (Vp0 for the first 64
 * keys, Vp1 for the next), 32 dimensions at a time: the output rows are the tile products'
 * accumulators. */
static inline void pair_values(const uint16_t *P, int ns, const uint16_t *Vp0,
                               size_t tile_elems, int hd, float *O)
{
    int nb = hd / 16, ldo = hd * 4;
    for (int n = 0; n < nb; n += 2) {
        float *o = O + 16 * n;
        _tile_loadd(0, o, ldo);
        _tile_loadd(1, o + 16, ldo);
        _tile_loadd(2, o + BR * hd, ldo);
        _tile_loadd(3, o + BR * hd + 16, ldo);
        for (int s = 0; s < ns; s++) {
            int t = s % (TILE / 32);
            const uint16_t *v = Vp0 + (size_t)(s / (TILE / 32)) * tile_elems +
                                ((size_t)t * nb + n) * 512;
            quad(P + 32 * s, P + BR * STEP + 32 * s, STEP * 2, v, v + 512);
        }
        store_quad(o, (size_t)hd);
    }
}

void cpu_amx_pack_tile(const struct AttnArgs *a, int g, int k0, int k_end, uint16_t *dst)
{
    int hd = a->head_dim, nk = k_end - k0 < TILE ? k_end - k0 : TILE;
    size_t at = kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride, a->kv_type, hd, g, k0);
    uint16_t *Kh = dst, *Kl = Kh + (size_t)hd * TILE, *Vp = Kl + (size_t)hd * TILE;
    pack_keys(a->k, a->kv_type, at, hd, Kh, Kl);
    pack_values(a->v, a->kv_type, at, hd, nk, Vp);
}

void cpu_attend_amx(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke,
                    const uint16_t *packed, float *ws, float *O, float *M, float *L)
{
    int hd = a->head_dim, G = a->n_q_head / a->n_kv_head, R = bq * G;
    size_t qe = q_elems(R, hd);
    int Rp = (int)(qe / hd);   /* rows padded to whole blocks */
    uint16_t *Qh = (uint16_t *)(void *)ws, *Ql = Qh + qe;
    float *S = (float *)(void *)(Ql + qe);                   /* (Rp, STEP) scores */
    uint16_t *P = (uint16_t *)(void *)(S + (size_t)Rp * STEP);  /* (Rp, STEP) probabilities */
    float *Oa = (float *)(void *)(P + (size_t)Rp * STEP);    /* (Rp, hd) output accumulators */
    float *Lv = Oa + (size_t)Rp * hd;                        /* (Rp, 16) row sums, by lane */
    float *Mr = Lv + (size_t)Rp * 16, *corr = Mr + Rp;       /* (Rp) each */
    int *lim = (int *)(void *)(corr + Rp), *seen = lim + Rp; /* (Rp) each */

    const float qscale = a->scale * 1.44269504088896341f;
    for (int r = 0; r < Rp; r++) {
        for (int d = 0; d < hd; d += 16) {
            __m512 x = _mm512_setzero_ps();
            if (r < R) {
                const float *src = a->q + (size_t)(t0 + r / G) * a->q_stride +
                                   (size_t)(g * G + r % G) * hd;
                x = _mm512_mul_ps(_mm512_loadu_ps(src + d), _mm512_set1_ps(qscale));
            }
            __m256i h = to_bf16(x);
            _mm256_storeu_si256((__m256i *)(void *)(Qh + (size_t)r * hd + d), h);
            _mm256_storeu_si256((__m256i *)(void *)(Ql + (size_t)r * hd + d),
                                to_bf16(_mm512_sub_ps(x, from_bf16(h))));
        }
        /* Keys a row sees: those before ke at or before its position. */
        int v = r < R ? ATTN_ROW_POS(a, t0 + r / G) + 1 : 0;
        seen[r] = v < ke ? v : ke;
        Mr[r] = r < R ? M[r] : -INFINITY;
        _mm512_storeu_ps(Lv + (size_t)r * 16, _mm512_setzero_ps());
        Lv[(size_t)r * 16] = r < R ? L[r] : 0.f;
    }
    memset(Oa, 0, (size_t)Rp * hd * sizeof *Oa);
    for (int r = 0; r < R; r++)
        memcpy(Oa + (size_t)r * hd, O + (size_t)r * hd, (size_t)hd * sizeof *Oa);

    struct TileCfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = BR;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);

    /* Per step of keys, three passes, each a run of independent work: every block's scores
     * (tile products only), every row's softmax (vector work only), every block's values.
     * A row's maximum moves only when a score passes it by more than LAZY (in base 2), as in
     * FlashAttention-4: until then the probabilities stay below 2^LAZY (exact in f32, as
     * exact in bf16 as any), and the row's output and sum need no rescaling, so most steps
     * add their products straight into the accumulators. */
    const float LAZY = 8.f;
    size_t tile_elems = CPU_AMX_TILE_ELEMS(hd);
    for (int k0 = kb; k0 < ke; k0 += STEP) {
        int nk = ke - k0 < STEP ? ke - k0 : STEP, nt = (nk + TILE - 1) / TILE, cols = nt * TILE;
        const uint16_t *Kh = packed + (size_t)(k0 / TILE) * tile_elems;
        const uint16_t *Kl = Kh + (size_t)hd * TILE, *Vp = Kl + (size_t)hd * TILE;
        int r_first = Rp;   /* the first row that sees a key of this step */
        for (int r = 0; r < Rp; r++) {
            int v = seen[r] - k0;
            lim[r] = v > nk ? nk : v;
            if (lim[r] > 0 && r < r_first) r_first = r;
        }
        if (r_first >= R) continue;
        int b_first = r_first / (2 * BR) * (2 * BR);
        for (int r0 = b_first; r0 < R; r0 += 2 * BR) {
            for (int t = 0; t < nt; t++)
                pair_scores(Qh + (size_t)r0 * hd, Ql + (size_t)r0 * hd, Kh + t * tile_elems,
                            Kl + t * tile_elems, hd, S + (size_t)r0 * STEP + t * TILE);
        }
        for (int r = b_first; r < Rp; r++) {
            uint16_t *pr = P + (size_t)r * STEP;
            corr[r] = 1.f;
            if (lim[r] <= 0) {
                memset(pr, 0, (size_t)cols * sizeof *pr);
                continue;
            }
            const float *sr = S + (size_t)r * STEP;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            if (lim[r] == cols)
                for (int c = 0; c < cols; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + c));
            else
                for (int c = 0; c < cols; c += 16)
                    mx = _mm512_mask_max_ps(mx, keep_below(c, lim[r]), mx,
                                            _mm512_loadu_ps(sr + c));
            __mmask16 past = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(Mr[r] + LAZY), _CMP_GT_OQ);
            if (past || Mr[r] == -INFINITY) {
                float mt = _mm512_reduce_max_ps(mx);
                corr[r] = Mr[r] == -INFINITY ? 0.f : exp2f(Mr[r] - mt);
                Mr[r] = mt;
            }
            __m512 sum = _mm512_setzero_ps(), neg = _mm512_set1_ps(-Mr[r]);
            for (int c = 0; c < cols; c += 16) {
                __m512 p = cpu_exp2_avx512_short(_mm512_add_ps(_mm512_loadu_ps(sr + c), neg));
                if (lim[r] < cols) p = _mm512_maskz_mov_ps(keep_below(c, lim[r]), p);
                sum = _mm512_add_ps(sum, p);
                _mm256_storeu_si256((__m256i *)(void *)(pr + c), to_bf16(p));
            }
            float *lv = Lv + (size_t)r * 16;
            _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(corr[r]), sum));
        }
        for (int r0 = b_first; r0 < R; r0 += 2 * BR) {
            for (int r = r0; r < r0 + 2 * BR; r++) {
                if (corr[r] == 1.f) continue;
                float *o = Oa + (size_t)r * hd;
                __m512 cr = _mm512_set1_ps(corr[r]);
                for (int c = 0; c < hd; c += 16)
                    _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), cr));
            }
            pair_values(P + (size_t)r0 * STEP, cols / 32, Vp, tile_elems, hd,
                        Oa + (size_t)r0 * hd);
        }
    }
    _tile_release();
    for (int r = 0; r < R; r++) {
        memcpy(O + (size_t)r * hd, Oa + (size_t)r * hd, (size_t)hd * sizeof *O);
        M[r] = Mr[r];
        L[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(Lv + (size_t)r * 16));
    }
}

#pragma GCC pop_options

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int cpu_amx_usable(void)
{
    __builtin_cpu_init();
    if (!cpu_isa_supported(CPU_ISA_AVX512) || !__builtin_cpu_supports("avx512bf16")) return 0;
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    if (!(edx >> 24 & 1) || !(edx >> 22 & 1)) return 0;   /* AMX-TILE, AMX-BF16 */
    /* Linux enables the tile data state per process on request. */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

#else
void cpu_amx_pack_tile(const struct AttnArgs *a, int g, int k0, int k_end, uint16_t *dst)
{
    (void)a; (void)g; (void)k0; (void)k_end; (void)dst;
}
void cpu_attend_amx(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke,
                    const uint16_t *packed, float *ws, float *O, float *M, float *L)
{
    (void)a; (void)g; (void)t0; (void)bq; (void)kb; (void)ke; (void)packed; (void)ws; (void)O;
    (void)M; (void)L;
}
int cpu_amx_usable(void) { return 0; }
static size_t q_elems(int R, int hd) { return (size_t)((R + 31) / 32 * 32) * hd; }
#endif

size_t cpu_attend_amx_ws_floats(int R, int hd)
{
    /* Queries hi + lo and P (bf16); S, the output accumulators and the row sums by lane;
     * the maxima, rescale factors, limits and keys seen per row. */
    size_t rows = q_elems(R, hd) / hd;
    size_t bf16 = 2 * q_elems(R, hd) + rows * STEP_TILES * KV_TILE;
    return (bf16 + 1) / 2 + rows * (STEP_TILES * KV_TILE + (size_t)hd + 16 + 4) + 16;
}
