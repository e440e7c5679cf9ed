/* CPU kernel tests against independent double-precision references on random inputs, for
 * every instruction-set path this machine supports (portable, AVX2, AVX-512):
 *   - attention (prefill blocks and the key-split decode path, GQA and DIFF V2 head pairs,
 *     f32 and f16 caches, several head sizes) within 1e-5 relative of the reference;
 *   - matrix products for every weight type and layout, one token and many, plain,
 *     accumulating and SwiGLU, through the microkernels and through OpenBLAS;
 *   - the thread count (1..4) changes no result by more than 1e-5 relative;
 *   - a batch of one-row products (decode tokens) gives each row bit for bit its own one-row
 *     product;
 *   - the interleaved weight layout decodes to exactly the file's values, and every path's
 *     vector decoding (prefill panels of X16 tiles, K-quant rows) gives exactly the portable
 *     decoder's values;
 *   - the thread pool runs every task of every job exactly once.
 * Prints the largest difference of each group. */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#include "kernels/dequant.h"
#include "kernels/f16.h"
#include "tests/check.h"

static unsigned long long rng_state = 0x9e3779b97f4a7c15ULL;

static unsigned rnd(void)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(rng_state >> 33);
}

static float frand(void) { return (float)rnd() / 2147483648.f - 1.f; } /* [-1, 1) */

/* max |a - b| / max |b| over n values */
static double rel_diff(const float *a, const double *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > md || isnan(d)) md = isnan(d) ? INFINITY : d;
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return mb > 0 ? md / mb : md;
}

static double rel_diff_f(const float *a, const float *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > md || isnan(d)) md = isnan(d) ? INFINITY : d;
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return mb > 0 ? md / mb : md;
}

/* ------------------------------------------------------------------------------------------ */
/* Attention                                                                                   */

struct AttnCase {
    int n_q_head, n_kv_head, head_dim, n_tok, pos0;
    enum KvType kv;
    int diff;
    int ctx_extra;             /* cache and scratch sized for this many more positions */
};

/* What the cache format says a KV_Q8 head of n values holds (kernels/backend.h): scale =
 * largest magnitude / 127, q = x * (127 / largest) rounded to nearest even, both in f32;
 * x_out = q * scale. Written here from the format, not shared with the store. */
static void q8_reference(float *x, int n)
{
    float amax = 0.f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
    for (int i = 0; i < n; i++) x[i] = (float)nearbyintf(x[i] * inv) * scale;
}

static const char *kv_name(enum KvType t) { return t == KV_F32 ? "f32" : t == KV_F16 ? "f16" : "q8"; }

/* Reference: causal softmax attention in double from the cache's own (f16, int8) values. */
static void attn_reference(const struct AttnCase *c, const float *q, const float *kf,
                           const float *vf, const float *lam, double *out)
{
    int hd = c->head_dim, G = c->n_q_head / c->n_kv_head, n_ctx = c->pos0 + c->n_tok;
    double *o = malloc(sizeof(double) * (size_t)c->n_q_head * hd);
    double *p = malloc(sizeof(double) * (size_t)n_ctx);
    double scale = 1.0 / sqrt((double)hd);
    int n_out_head = c->diff ? c->n_q_head / 2 : c->n_q_head;
    for (int t = 0; t < c->n_tok; t++) {
        int last = c->pos0 + t;
        for (int h = 0; h < c->n_q_head; h++) {
            int g = h / G;
            const float *qh = q + ((size_t)t * c->n_q_head + h) * hd;
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j <= last; j++) {
                const float *kj = kf + ((size_t)g * n_ctx + j) * hd;
                double s = 0;
                for (int d = 0; d < hd; d++) s += (double)qh[d] * kj[d];
                p[j] = s * scale;
                if (p[j] > mx) mx = p[j];
            }
            for (int j = 0; j <= last; j++) { p[j] = exp(p[j] - mx); sum += p[j]; }
            for (int d = 0; d < hd; d++) {
                double acc = 0;
                for (int j = 0; j <= last; j++) acc += p[j] * vf[((size_t)g * n_ctx + j) * hd + d];
                o[(size_t)h * hd + d] = acc / sum;
            }
        }
        for (int h = 0; h < n_out_head; h++)
            for (int d = 0; d < hd; d++) {
                double v;
                if (c->diff) {
                    double sg = 1.0 / (1.0 + exp(-(double)lam[(size_t)t * n_out_head + h]));
                    v = o[(size_t)(2 * h) * hd + d] - sg * o[(size_t)(2 * h + 1) * hd + d];
                } else {
                    v = o[(size_t)h * hd + d];
                }
                out[((size_t)t * n_out_head + h) * hd + d] = v;
            }
    }
    free(o);
    free(p);
}

static double worst_amx;   /* the AMX path's worst difference over the cases */

/* Runs one case on every supported path and thread count; returns the worst difference of
 * the f32 paths (the AMX path's goes to worst_amx). */
static double attn_case(const struct AttnCase *c)
{
    int hd = c->head_dim, n_ctx = c->pos0 + c->n_tok, G = c->n_q_head / c->n_kv_head;
    int n_out_head = c->diff ? c->n_q_head / 2 : c->n_q_head;
    size_t stride = cpu_kv_head_stride(n_ctx + c->ctx_extra, hd, c->kv), el = kv_elem_bytes(c->kv);
    size_t nq = (size_t)c->n_tok * c->n_q_head * hd, nout = (size_t)c->n_tok * n_out_head * hd;
    float *q = malloc(sizeof(float) * nq);
    float *kf = malloc(sizeof(float) * (size_t)c->n_kv_head * n_ctx * hd);
    float *vf = malloc(sizeof(float) * (size_t)c->n_kv_head * n_ctx * hd);
    float *krow = malloc(sizeof(float) * (size_t)c->n_kv_head * hd);
    float *vrow = malloc(sizeof(float) * (size_t)c->n_kv_head * hd);
    float *lam = malloc(sizeof(float) * (size_t)c->n_tok * n_out_head);
    void *kc = malloc(stride * c->n_kv_head * el), *vc = malloc(stride * c->n_kv_head * el);
    double *want = malloc(sizeof(double) * nout);
    float *got = malloc(sizeof(float) * nout), *first = malloc(sizeof(float) * nout);
    /* Poison the cache so reads past the written positions would show. */
    memset(kc, 0xff, stride * c->n_kv_head * el);
    memset(vc, 0xff, stride * c->n_kv_head * el);
    for (size_t i = 0; i < nq; i++) q[i] = 2.f * frand();
    for (int i = 0; i < c->n_tok * n_out_head; i++) lam[i] = 2.f * frand();
    /* Keys and values stored through the backend one position at a time (no rotation). */
    float no_q[1] = {0}, no_rot[1] = {0};
    for (int pos = 0; pos < n_ctx; pos++) {
        for (int i = 0; i < c->n_kv_head * hd; i++) { krow[i] = frand(); vrow[i] = frand(); }
        if (c->kv == KV_Q8 && pos % 17 == 3) /* an all-zero head: scale 0 */
            for (int i = 0; i < hd; i++) krow[i] = vrow[i] = 0.f;
        struct RopeStoreArgs rs = {
            .q = no_q, .q_stride = 0, .k = krow, .v = vrow, .kv_stride = (size_t)c->n_kv_head * hd,
            .n_tok = 1, .pos0 = pos, .n_q_head = 0, .n_kv_head = c->n_kv_head, .head_dim = hd,
            .n_rot = 0, .layout = 0, .cos = no_rot, .sin = no_rot, .kcache = kc, .vcache = vc,
            .kv_type = c->kv, .kv_head_stride = stride,
        };
        backend_cpu.rope_store(NULL, &rs);
        if (c->kv == KV_Q8)
            for (int g = 0; g < c->n_kv_head; g++) {
                q8_reference(krow + g * hd, hd);
                q8_reference(vrow + g * hd, hd);
            }
        for (int g = 0; g < c->n_kv_head; g++)
            for (int d = 0; d < hd; d++) {
                float kv = krow[g * hd + d], vv = vrow[g * hd + d];
                if (c->kv == KV_F16) { kv = f16_to_f32(f32_to_f16(kv)); vv = f16_to_f32(f32_to_f16(vv)); }
                kf[((size_t)g * n_ctx + pos) * hd + d] = kv;
                vf[((size_t)g * n_ctx + pos) * hd + d] = vv;
            }
    }
    attn_reference(c, q, kf, vf, lam, want);
    struct AttnArgs a = {
        .q = q, .q_stride = (size_t)c->n_q_head * hd, .out = got,
        .out_stride = (size_t)n_out_head * hd, .k = kc, .v = vc, .kv_head_stride = stride,
        .kv_type = c->kv, .n_tok = c->n_tok, .pos0 = c->pos0, .n_q_head = c->n_q_head,
        .n_kv_head = c->n_kv_head, .head_dim = hd, .scale = 1.f / sqrtf((float)hd),
        .lambda = c->diff ? lam : NULL, .lambda_stride = (size_t)n_out_head,
    };
    double worst = 0;
    /* Each path the machine runs: the f32 paths to 1e-5 of the double reference; the AMX
     * path (bf16 products, split operands for the scores: attention_amx.c) to 4e-3. */
    for (int path = 0; path <= CPU_ISA_COUNT; path++) {
        int amx = path == CPU_ISA_COUNT, isa = amx ? CPU_ISA_AVX512 : path;
        if (!cpu_isa_supported((enum CpuIsa)isa)) continue;
        if (amx && !cpu_attn_amx_handles((enum CpuIsa)isa, c->kv, hd)) continue;
        double tol = amx ? 4e-3 : 1e-5;
        const char *pname = amx ? "amx" : cpu_isa_name((enum CpuIsa)isa);
        for (int threads = 1; threads <= 4; threads++) {
            struct ThreadPool *pool = NULL;
            CHECK(pool_new(threads, &pool) == 0, "pool_new(%d)", threads);
            size_t ss = cpu_attention_scratch(c->n_tok, n_ctx + c->ctx_extra, hd, c->n_q_head,
                                              c->n_kv_head, threads);
            void *scratch = malloc(ss);
            memset(got, 0, sizeof(float) * nout);
            cpu_attention_with((enum CpuIsa)isa, amx, pool, &a, scratch);
            double err = rel_diff(got, want, nout);
            if (err > worst && !amx) worst = err;
            if (amx && err > worst_amx) worst_amx = err;
            CHECK(err <= tol, "attention %s threads=%d q_heads=%d kv_heads=%d hd=%d n_tok=%d "
                  "pos0=%d kv=%s diff=%d: relative error %.3e", pname,
                  threads, c->n_q_head, c->n_kv_head, hd, c->n_tok, c->pos0,
                  kv_name(c->kv), c->diff, err);
            if (threads == 1) memcpy(first, got, sizeof(float) * nout);
            else {
                double td = rel_diff_f(got, first, nout);
                CHECK(td <= 1e-5, "attention %s: %d threads differ from 1 thread by %.3e",
                      pname, threads, td);
            }
            free(scratch);
            pool_destroy(&pool);
        }
    }
    /* The weights that the last rows (up to 3) give a range of keys (attention_weights, a
     * blend's probe): summed over rows and query heads, against the softmax in double from the
     * cache's own values, with 1 and 3 threads. */
    {
        int nr = c->n_tok < 3 ? c->n_tok : 3, k0 = n_ctx / 4, k1 = 3 * n_ctx / 4 + 1;
        int32_t rpos[3];
        for (int t = 0; t < nr; t++) rpos[t] = c->pos0 + c->n_tok - nr + t;
        double *ref = calloc((size_t)(k1 - k0), sizeof *ref), *p = malloc(sizeof(double) * n_ctx);
        float *w = malloc(sizeof(float) * (size_t)(k1 - k0));
        float *w1 = malloc(sizeof(float) * (size_t)(k1 - k0));
        for (int t = 0; t < nr; t++)
            for (int h = 0; h < c->n_q_head; h++) {
                const float *qh = q + ((size_t)(c->n_tok - nr + t) * c->n_q_head + h) * hd;
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j <= rpos[t]; j++) {
                    const float *kj = kf + ((size_t)(h / G) * n_ctx + j) * hd;
                    double sc = 0;
                    for (int d = 0; d < hd; d++) sc += (double)qh[d] * kj[d];
                    p[j] = sc / sqrt((double)hd);
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int j = 0; j <= rpos[t]; j++) sum += (p[j] = exp(p[j] - mx));
                for (int j = k0; j < k1 && j <= rpos[t]; j++) ref[j - k0] += p[j] / sum;
            }
        for (int threads = 1; threads <= 3; threads += 2) {
            struct ThreadPool *pool = NULL;
            CHECK(pool_new(threads, &pool) == 0, "pool_new(%d)", threads);
            void *scratch = malloc(cpu_attention_weights_scratch(n_ctx, hd, c->n_q_head,
                                                                 c->n_kv_head, nr, threads));
            struct WeightsArgs wa = {
                .q = q + (size_t)(c->n_tok - nr) * c->n_q_head * hd,
                .q_stride = (size_t)c->n_q_head * hd, .pos = rpos, .n_rows = nr, .k = kc,
                .kv_head_stride = stride, .kv_type = c->kv, .n_q_head = c->n_q_head,
                .n_kv_head = c->n_kv_head, .head_dim = hd, .scale = 1.f / sqrtf((float)hd),
                .k0 = k0, .k1 = k1, .out = w,
            };
            memset(w, 0, sizeof(float) * (size_t)(k1 - k0));
            backend_cpu.attention_weights(pool, &wa, scratch);
            double err = rel_diff(w, ref, (size_t)(k1 - k0));
            CHECK(err <= 1e-5, "attention weights threads=%d q_heads=%d kv=%s n_ctx=%d: "
                  "relative error %.3e", threads, c->n_q_head, kv_name(c->kv), n_ctx, err);
            if (threads == 1) memcpy(w1, w, sizeof(float) * (size_t)(k1 - k0));
            else
                CHECK(!memcmp(w1, w, sizeof(float) * (size_t)(k1 - k0)), "attention weights: "
                      "%d threads differ from 1 thread", threads);
            free(scratch);
            pool_destroy(&pool);
        }
        free(ref);
        free(p);
        free(w);
        free(w1);
    }
    /* Scattered rows (AttnArgs.qpos): every third row and the last, at their positions in one
     * call, give bit for bit what those rows give in the whole rowwise call, on every path. */
    if (c->n_tok >= 3) {
        int *pick = malloc(sizeof(int) * (size_t)c->n_tok), ns = 0;
        for (int t = 0; t < c->n_tok; t++)
            if (t % 3 == 1 || t == c->n_tok - 1) pick[ns++] = t;
        float *qs = malloc(sizeof(float) * (size_t)ns * c->n_q_head * hd);
        float *ls = malloc(sizeof(float) * (size_t)ns * n_out_head + 1);
        float *outs = malloc(sizeof(float) * (size_t)ns * n_out_head * hd);
        int32_t *qpos = malloc(sizeof(int32_t) * (size_t)ns);
        for (int k = 0; k < ns; k++) {
            memcpy(qs + (size_t)k * c->n_q_head * hd, q + (size_t)pick[k] * c->n_q_head * hd,
                   sizeof(float) * (size_t)c->n_q_head * hd);
            memcpy(ls + (size_t)k * n_out_head, lam + (size_t)pick[k] * n_out_head,
                   sizeof(float) * (size_t)n_out_head);
            qpos[k] = c->pos0 + pick[k];
        }
        struct AttnArgs sa = a;
        sa.q = qs;
        sa.out = outs;
        sa.lambda = c->diff ? ls : NULL;
        sa.n_tok = ns;
        sa.pos0 = qpos[0];
        sa.qpos = qpos;
        sa.rowwise = 1;
        a.rowwise = 1;
        struct ThreadPool *pool = NULL;
        CHECK(pool_new(2, &pool) == 0, "pool_new(2)");
        size_t ss = cpu_attention_scratch(c->n_tok, n_ctx + c->ctx_extra, hd, c->n_q_head,
                                          c->n_kv_head, 2);
        void *scratch = malloc(ss);
        size_t row = (size_t)n_out_head * hd;
        for (int path = 0; path <= CPU_ISA_COUNT; path++) {
            int amx = path == CPU_ISA_COUNT, isa = amx ? CPU_ISA_AVX512 : path;
            if (!cpu_isa_supported((enum CpuIsa)isa)) continue;
            if (amx && !cpu_attn_amx_handles((enum CpuIsa)isa, c->kv, hd)) continue;
            cpu_attention_with((enum CpuIsa)isa, amx, pool, &a, scratch);
            cpu_attention_with((enum CpuIsa)isa, amx, pool, &sa, scratch);
            int same = 1;
            for (int k = 0; k < ns; k++)
                same &= !memcmp(outs + (size_t)k * row, got + (size_t)pick[k] * row,
                                sizeof(float) * row);
            CHECK(same, "attention %s q_heads=%d kv=%s n_tok=%d pos0=%d: %d scattered rows "
                  "differ from the same rows of the whole call", amx ? "amx" : cpu_isa_name((enum CpuIsa)isa),
                  c->n_q_head, kv_name(c->kv), c->n_tok, c->pos0, ns);
        }
        free(scratch);
        pool_destroy(&pool);
        free(pick); free(qs); free(ls); free(outs); free(qpos);
    }
    (void)G;
    free(q); free(kf); free(vf); free(krow); free(vrow); free(lam); free(kc); free(vc);
    free(want); free(got); free(first);
    return worst;
}

static void test_attention(void)
{
    const struct AttnCase cases[] = {
        /* prefill blocks: causal diagonal, partial tiles, chunk after a cached prefix */
        {9, 3, 64, 77, 0, KV_F32, 0, 0},
        {9, 3, 64, 40, 100, KV_F16, 0, 0},
        {18, 3, 64, 37, 70, KV_F32, 1, 0},   /* DIFF V2: 6 query heads per KV head */
        {4, 4, 16, 50, 13, KV_F32, 0, 0},
        {8, 2, 32, 21, 64, KV_F16, 1, 0},
        {4, 1, 128, 19, 45, KV_F32, 0, 0},
        {4, 2, 24, 30, 9, KV_F32, 0, 0},     /* head size no vector path takes: portable */
        {14, 2, 64, 200, 300, KV_F16, 0, 0}, /* the default model's shape, 7 rows per token */
        {14, 2, 64, 90, 910, KV_F16, 0, 0},  /* AMX: four steps of 256 keys, the last partial */
        /* key split (decode): several segments, a few tokens */
        {9, 3, 64, 1, 700, KV_F16, 0, 0},
        {18, 3, 64, 3, 600, KV_F32, 1, 0},
        {4, 4, 16, 2, 1030, KV_F16, 0, 0},
        {9, 3, 64, 1, 0, KV_F32, 0, 0},      /* the very first token */
        /* 64 segments of 256 keys in a cache sized for a longer context (longer segments) */
        {9, 3, 64, 1, 16383, KV_F16, 0, 64},
        /* the int8 cache: staged tiles (prefill) and tiles read as stored (decode) */
        {9, 3, 64, 40, 100, KV_Q8, 0, 0},
        {18, 3, 64, 37, 70, KV_Q8, 1, 0},
        {8, 2, 32, 21, 64, KV_Q8, 1, 0},
        {4, 2, 24, 30, 9, KV_Q8, 0, 0},
        {9, 3, 64, 1, 700, KV_Q8, 0, 0},
        {18, 3, 64, 3, 600, KV_Q8, 1, 0},
        {4, 4, 16, 2, 1030, KV_Q8, 0, 0},
        {9, 3, 64, 1, 4095, KV_Q8, 0, 64},
    };
    double worst = 0;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        double e = attn_case(&cases[i]);
        if (e > worst) worst = e;
    }
    printf("attention: %zu cases on every supported path, 1-4 threads: max relative error %.3e "
           "(f32 paths), %.3e (AMX bf16 path%s); scattered rows equal to the whole call's; the "
           "weights of a key range as a double softmax gives them, the same with 1 and 3 "
           "threads\n", sizeof cases / sizeof *cases, worst, worst_amx,
           cpu_amx_usable_once() ? "" : ": not on this processor");
}

/* ------------------------------------------------------------------------------------------ */
/* Weights and matrix products                                                                 */

/* Random file-layout blocks of `type` for a (rows, cols) matrix, scales kept moderate. */
static void *random_blocks(uint32_t type, int rows, int cols, size_t *row_bytes)
{
    int be = dequant_block_elems(type), bb = dequant_block_bytes(type);
    *row_bytes = (size_t)(cols / be) * bb;
    uint8_t *p = malloc(*row_bytes * rows);
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < cols / be; b++) {
            uint8_t *blk = p + (size_t)r * *row_bytes + (size_t)b * bb;
            if (type == DQ_F32) { float f = frand(); memcpy(blk, &f, 4); continue; }
            if (type == DQ_F16) { uint16_t h = f32_to_f16(frand()); memcpy(blk, &h, 2); continue; }
            if (type == DQ_BF16) { uint16_t h = f32_to_bf16(frand()); memcpy(blk, &h, 2); continue; }
            for (int i = 0; i < bb; i++) blk[i] = (uint8_t)rnd();
            uint16_t d = f32_to_f16(0.01f + 0.05f * (float)(rnd() % 1000) / 1000.f);
            uint16_t m = f32_to_f16(-0.2f * (float)(rnd() % 1000) / 1000.f);
            /* K-quants: d relative to sub-block scales up to 63, dmin likewise. */
            uint16_t dk = f32_to_f16(0.0005f + 0.002f * (float)(rnd() % 1000) / 1000.f);
            uint16_t mk = f32_to_f16(0.0005f + 0.002f * (float)(rnd() % 1000) / 1000.f);
            switch (type) {
            case DQ_Q4_1: case DQ_Q5_1: memcpy(blk, &d, 2); memcpy(blk + 2, &m, 2); break;
            case DQ_Q2_K: memcpy(blk + 80, &dk, 2); memcpy(blk + 82, &mk, 2); break;
            case DQ_Q3_K: memcpy(blk + 108, &dk, 2); break;
            case DQ_Q4_K: case DQ_Q5_K: memcpy(blk, &dk, 2); memcpy(blk + 2, &mk, 2); break;
            case DQ_Q6_K: memcpy(blk + 208, &dk, 2); break;
            default: memcpy(blk, &d, 2); break;
            }
        }
    return p;
}

static const uint32_t TYPES[] = {DQ_F32, DQ_F16, DQ_BF16, DQ_Q4_0, DQ_Q4_1, DQ_Q5_0, DQ_Q5_1,
                                 DQ_Q8_0, DQ_Q2_K, DQ_Q3_K, DQ_Q4_K, DQ_Q5_K, DQ_Q6_K};
static const char *const TYPE_NAMES[] = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                         "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
enum { N_TYPES = sizeof TYPES / sizeof *TYPES };

static int is_k(uint32_t type) { return dequant_block_elems(type) == 256; }

static void test_weights_layout(void)
{
    int bad = 0, checked = 0;
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        int rows = 37, cols = is_k(TYPES[ti]) ? 512 : 96;
        size_t rb;
        void *src = random_blocks(TYPES[ti], rows, cols, &rb);
        size_t bytes = cpu_weights_bytes(TYPES[ti], rows, cols);
        void *dst = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        struct Weights w;
        cpu_weights_pack(TYPES[ti], rows, cols, src, dst, &w);
        CHECK((w.layout == WEIGHTS_X16) == cpu_weights_x16(TYPES[ti]), "%s layout", TYPE_NAMES[ti]);
        float got[512], want[512];
        for (int r = 0; r < rows; r++) {
            cpu_weights_row(&w, r, got);
            dequant_row(TYPES[ti], (const uint8_t *)src + (size_t)r * rb, want, (size_t)cols);
            checked++;
            if (memcmp(got, want, sizeof(float) * cols)) bad++;
        }
        free(src);
        free(dst);
    }
    CHECK(bad == 0, "%d of %d rows decode differently from the file's blocks", bad, checked);
    printf("weights: %d rows of %d types decode bit-exactly in the backend's layout\n", checked,
           (int)N_TYPES);
}

/* Bit patterns equal, or both NaN. */
static int same_values(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) && !(isnan(a[i]) && isnan(b[i]))) return 0;
    return 1;
}

/* Every path's decoding for the prefill products against the portable decoder, bit for bit:
 * rows of each type (K-quants through their vector decoders) and panels of X16 tiles. */
static void test_vector_decode(void)
{
    int checked = 0;
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        uint32_t type = TYPES[ti];
        int rows = 45, cols = is_k(type) ? 1280 : 160;
        size_t rb;
        void *src = random_blocks(type, rows, cols, &rb);
        void *dst = aligned_alloc(64, (cpu_weights_bytes(type, rows, cols) + 63) & ~(size_t)63);
        struct Weights w;
        cpu_weights_pack(type, rows, cols, src, dst, &w);
        float *want = malloc(sizeof(float) * (size_t)rows * cols);
        float *got = malloc(sizeof(float) * (size_t)rows * cols);
        float *pw = malloc(sizeof(float) * (size_t)cols * 32), *pg = malloc(sizeof(float) * (size_t)cols * 32);
        cpu_decode_rows(&w, 0, rows, want);
        for (int isa = 0; isa < CPU_ISA_COUNT; isa++) {
            if (!cpu_isa_supported((enum CpuIsa)isa)) continue;
            memset(got, 0xff, sizeof(float) * (size_t)rows * cols);
            cpu_decode_rows_with((enum CpuIsa)isa, &w, 3, rows - 3, got + (size_t)3 * cols);
            CHECK(same_values(got + (size_t)3 * cols, want + (size_t)3 * cols,
                              (size_t)(rows - 3) * cols),
                  "%s: %s row decoding differs from the portable decoder", TYPE_NAMES[ti],
                  cpu_isa_name((enum CpuIsa)isa));
            checked++;
            if (w.layout == WEIGHTS_X16 && isa != CPU_ISA_SCALAR)
                for (int r0 = 0; r0 < rows; r0 += 32) { /* the last panel is part padding */
                    cpu_panel_x16(&w, r0, 32, pw);
                    if (isa == CPU_ISA_AVX512) cpu_panel_x16_avx512(&w, r0, 32, pg);
                    else cpu_panel_x16_avx2(&w, r0, 32, pg);
                    CHECK(same_values(pg, pw, (size_t)cols * 32), "%s: %s panel at row %d "
                          "differs from the portable one", TYPE_NAMES[ti],
                          cpu_isa_name((enum CpuIsa)isa), r0);
                    int bad = 0;
                    for (int c = 0; c < cols; c++)
                        for (int j = 0; j < 32; j++) {
                            float p = pw[(size_t)c * 32 + j];
                            if (r0 + j >= rows) bad += p != 0.f; /* padding: zero of either sign */
                            else bad += memcmp(&p, &want[(size_t)(r0 + j) * cols + c], 4) != 0;
                        }
                    CHECK(bad == 0, "%s: %d panel values differ from the rows", TYPE_NAMES[ti], bad);
                    checked++;
                }
        }
        free(src); free(dst); free(want); free(got); free(pw); free(pg);
    }
    printf("decode: %d row sets and panels of %d types on every path equal the portable decoder "
           "bit for bit\n", checked, (int)N_TYPES);
}

static int q8_cases;

/* An input row as GGML's CPU backend rounds it before a quantised product, written from
 * GGML's definitions (x86 quantize_row_q8_0; quantize_row_q8_K_ref): out = q * d. */
static void ggml_round_row(enum Q8Act act, const float *x, int k, float *out)
{
    int block = act == Q8_ACT_32 ? 32 : 256;
    for (int c0 = 0; c0 < k; c0 += block) {
        float amax = 0.f, max = 0.f;
        for (int c = c0; c < c0 + block; c++)
            if (fabsf(x[c]) > amax) { amax = fabsf(x[c]); max = x[c]; }
        if (act == Q8_ACT_32) {
            float d = f16_to_f32(f32_to_f16(amax / 127.f)), id = amax ? 127.f / amax : 0.f;
            for (int c = c0; c < c0 + block; c++) out[c] = nearbyintf(x[c] * id) * d;
            continue;
        }
        if (!amax) {
            for (int c = c0; c < c0 + block; c++) out[c] = 0.f;
            continue;
        }
        float is = -127.f / max;
        for (int c = c0; c < c0 + block; c++) out[c] = fminf(127.f, nearbyintf(is * x[c])) * (1.f / is);
    }
}

/* Largest-magnitude sums for the AVX2 microkernel's 16-bit pair sums: every quant of the panel
 * at 0 or at the type's largest value, inputs at +-127, against the portable kernel. */
static int q8_extremes(const struct Q8Type *t, int k)
{
    size_t pb = (cpu_q8_panel_bytes(k, t->g) + 63) & ~(size_t)63;
    uint8_t *panel = aligned_alloc(64, pb);
    int n = 6, ns = k / t->g, bad = 0;
    struct Q8Rows qr = {.q = malloc((size_t)n * k), .q_stride = (size_t)k,
                        .d = malloc(4 * (size_t)n * ns), .nx = malloc(4 * (size_t)n * ns),
                        .dx = malloc(4 * (size_t)n * ns), .s_stride = (size_t)ns, .g = t->g};
    float *y0 = malloc(sizeof(float) * (size_t)n * 32), *y1 = malloc(sizeof(float) * (size_t)n * 32);
    for (int form = 0; form < 4; form++) {
        /* form 0: all at the top; 1: all zero; 2, 3: mixed by output and input */
        for (int s = 0; s < ns; s++) {
            uint8_t *ps = panel + (size_t)s * ((size_t)t->g * 32 + 256);
            for (int e = 0; e < t->g * 32; e++)
                ps[e] = form == 0 ? (uint8_t)t->umax : form == 1 ? 0
                        : ((e / 4 + e % 4 + form) & 1) ? (uint8_t)t->umax : 0;
            float *fa = (float *)(void *)(ps + (size_t)t->g * 32);
            for (int j = 0; j < 64; j++) fa[j] = 0.001f * (float)(j + 1);
        }
        for (int i = 0; i < n; i++) {
            for (int c = 0; c < k; c++)
                qr.q[(size_t)i * k + c] = (int8_t)(form < 2 ? (i % 2 ? -127 : 127)
                                                   : ((c + i) % 3 ? 127 : -127));
            for (int s = 0; s < ns; s++) {
                int32_t sum = 0;
                for (int c = 0; c < t->g; c++) sum += qr.q[(size_t)i * k + s * t->g + c];
                qr.d[i * ns + s] = 0.5f;
                qr.nx[i * ns + s] = -sum;
                qr.dx[i * ns + s] = 0.5f * (float)sum;
            }
        }
        struct Q8Block qb = {.x = &qr, .i0 = 0, .n = n, .k = k, .panel = panel, .m_blk = 32,
                             .shift = t->shift, .umax = t->umax, .y = y0, .y_stride = 32};
        cpu_q8_gemm_block(&qb);
        qb.y = y1;
        cpu_q8_gemm_block_avx2(&qb);
        bad += memcmp(y0, y1, sizeof(float) * (size_t)n * 32) != 0;
    }
    free(panel); free(qr.q); free(qr.d); free(qr.nx); free(qr.dx); free(y0); free(y1);
    return bad;
}

/* The int8 pieces on their own: the AVX-512 rounding, panels and microkernel and the AVX2
 * panels and microkernel against the portable ones, bit for bit, and the panels against the
 * decoded weights. */
static void test_q8(void)
{
    int vnni = cpu_q8_vnni(), avx2 = cpu_isa_supported(CPU_ISA_AVX2);
    if (!vnni && !avx2) {
        printf("q8: this processor has neither AVX-512 VNNI nor AVX2; only the portable int8 "
               "pieces are checked (through matmul)\n");
        return;
    }
    int checked = 0;
    /* Rounding: rows with zero blocks, ties and one large element. */
    for (int act = 0; act < Q8_ACT_COUNT && vnni; act++)
        for (int g = 16; g <= 32; g += 16) {
            if (act == Q8_ACT_32 && g == 16) continue;
            int k = 1024, n = 5;
            float *x = malloc(sizeof(float) * (size_t)n * k);
            for (int i = 0; i < n * k; i++) x[i] = frand() * (i % 7 ? 1.f : 9.f);
            for (int c = 256; c < 512; c++) x[c] = 0.f;            /* a zero block */
            for (int c = 512; c < 544; c++) x[c] = (float)(c % 5) - 2.f; /* ties */
            x[1024 + 77] = -40.f;
            struct Q8Rows r[2];
            void *mem[2][4];
            for (int v = 0; v < 2; v++) {
                mem[v][0] = calloc((size_t)n * k, 1);
                for (int j = 1; j < 4; j++) mem[v][j] = calloc((size_t)n * (k / g), 4);
                r[v] = (struct Q8Rows){.q = mem[v][0], .q_stride = (size_t)k, .d = mem[v][1],
                                       .nx = mem[v][2], .dx = mem[v][3], .s_stride = (size_t)(k / g),
                                       .g = g};
            }
            float *back = malloc(sizeof(float) * (size_t)k);
            int bad = 0, off = 0;
            for (int i = 0; i < n; i++) {
                cpu_q8_quantize_row((enum Q8Act)act, x + (size_t)i * k, k, &r[0], i);
                cpu_q8_quantize_row_avx512((enum Q8Act)act, x + (size_t)i * k, k, &r[1], i);
                ggml_round_row((enum Q8Act)act, x + (size_t)i * k, k, back);
                for (int c = 0; c < k; c++) {
                    float got = (float)r[1].q[(size_t)i * k + c] * r[1].d[(size_t)i * (k / g) + c / g];
                    if (got != back[c]) off++;
                }
            }
            bad += memcmp(r[0].q, r[1].q, (size_t)n * k) != 0;
            for (int j = 1; j < 4; j++) bad += memcmp(mem[0][j], mem[1][j], (size_t)n * (k / g) * 4) != 0;
            CHECK(bad == 0, "q8 rounding act=%d g=%d: AVX-512 differs from portable in %d arrays",
                  act, g, bad);
            CHECK(off == 0, "q8 rounding act=%d g=%d: %d values differ from GGML's", act, g, off);
            checked++;
            for (int v = 0; v < 2; v++) for (int j = 0; j < 4; j++) free(mem[v][j]);
            free(x); free(back);
        }
    /* Panels and microkernel per type. */
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        struct Q8Type t;
        if (!cpu_q8_type(TYPES[ti], &t)) continue;
        int k = is_k(TYPES[ti]) ? 768 : 160, m = 45, n = 13;
        size_t rb;
        void *src = random_blocks(TYPES[ti], m, k, &rb);
        size_t bytes = cpu_weights_bytes(TYPES[ti], m, k);
        void *wd = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        struct Weights w;
        cpu_weights_pack(TYPES[ti], m, k, src, wd, &w);
        size_t pb = (cpu_q8_panel_bytes(k, t.g) + 63) & ~(size_t)63;
        uint8_t *p0 = aligned_alloc(64, pb), *p1 = aligned_alloc(64, pb);
        uint8_t *work = aligned_alloc(64, (cpu_q8_panel_work(k) + 63) & ~(size_t)63);
        float *wf = malloc(sizeof(float) * (size_t)k);
        int bad = 0, wrong = 0;
        for (int r0 = 0; r0 < m; r0 += 32) {
            int mb = m - r0 < 32 ? m - r0 : 32;
            memset(p0, 0xa5, pb);
            cpu_q8_panel(&w, r0, mb, p0, work);
            for (int path = 0; path < 2; path++) {
                if (!(path ? avx2 : vnni)) continue;
                memset(p1, 0x5a, pb);
                if (path) cpu_q8_panel_avx2(&w, r0, mb, p1, work);
                else cpu_q8_panel_avx512(&w, r0, mb, p1, work);
                bad += memcmp(p0, p1, cpu_q8_panel_bytes(k, t.g)) != 0;
            }
            /* a * (u - 2^shift) or a * u + off gives the decoded weight exactly. */
            size_t sbs = (size_t)t.g * 32 + 256;
            for (int j = 0; j < mb; j++) {
                dequant_row(TYPES[ti], (const uint8_t *)src + (size_t)(r0 + j) * rb, wf, (size_t)k);
                for (int c = 0; c < k; c++) {
                    const uint8_t *ps = p1 + (size_t)(c / t.g) * sbs;
                    const float *fa = (const float *)(const void *)(ps + (size_t)t.g * 32);
                    int u = ps[(c % t.g / 4) * 128 + (j / 16) * 64 + 4 * (j % 16) + c % 4];
                    float v = t.shift >= 0 ? fa[j] * (float)(u - (1 << t.shift))
                                           : fa[j] * (float)u + fa[32 + j];
                    if (v != wf[c]) wrong++;
                }
            }
            /* The microkernel on n rows against the portable one. */
            float *x = malloc(sizeof(float) * (size_t)n * k);
            for (int i = 0; i < n * k; i++) x[i] = frand();
            struct Q8Rows qr = {.q = malloc((size_t)n * k), .q_stride = (size_t)k,
                                .d = malloc(4 * (size_t)n * (k / t.g)), .nx = malloc(4 * (size_t)n * (k / t.g)),
                                .dx = malloc(4 * (size_t)n * (k / t.g)), .s_stride = (size_t)(k / t.g), .g = t.g};
            for (int i = 0; i < n; i++) cpu_q8_quantize_row(t.act, x + (size_t)i * k, k, &qr, i);
            float *y0 = malloc(sizeof(float) * (size_t)n * 40), *y1 = malloc(sizeof(float) * (size_t)n * 40);
            float *ys = malloc(sizeof(float) * (size_t)n * 40);
            for (int acc = 0; acc < 2; acc++) {
                for (int i = 0; i < n * 40; i++) ys[i] = y0[i] = frand();
                struct Q8Block qb = {.x = &qr, .i0 = 2, .n = n - 2, .k = k, .panel = p1, .m_blk = mb,
                                     .shift = t.shift, .umax = t.umax, .y = y0, .y_stride = 40,
                                     .accumulate = acc};
                cpu_q8_gemm_block(&qb);
                qb.y = y1;
                for (int path = 0; path < 2; path++) {
                    if (!(path ? avx2 : vnni)) continue;
                    memcpy(y1, ys, sizeof(float) * (size_t)n * 40);
                    if (path) cpu_q8_gemm_block_avx2(&qb);
                    else cpu_q8_gemm_block_avx512(&qb);
                    bad += memcmp(y0, y1, sizeof(float) * (size_t)n * 40) != 0;
                }
            }
            free(ys);
            free(x); free(qr.q); free(qr.d); free(qr.nx); free(qr.dx); free(y0); free(y1);
        }
        if (avx2) bad += q8_extremes(&t, k);
        CHECK(bad == 0, "q8 %s: %d panels or products differ from the portable ones",
              TYPE_NAMES[ti], bad);
        CHECK(wrong == 0, "q8 %s: %d panel values differ from the decoded weights", TYPE_NAMES[ti],
              wrong);
        checked++;
        free(src); free(wd); free(p0); free(p1); free(work); free(wf);
    }
    printf("q8: %d roundings and types: %s%s%s equal the portable ones bit for bit; panels "
           "give the decoded weights exactly\n", checked,
           vnni ? "the AVX-512 rounding, panels and products" : "", vnni && avx2 ? " and " : "",
           avx2 ? "the AVX2 panels and products (also at the largest sums)" : "");
}

static int onerow_cases;

/* One product configuration through every path: y = x.w^T (plain / accumulate) or SwiGLU. */
static double matmul_case(uint32_t type, int n, int k, int m, int mode, const char *tname)
{
    size_t rb;
    void *src = random_blocks(type, m, k, &rb), *src2 = random_blocks(type, m, k, &rb);
    size_t bytes = cpu_weights_bytes(type, m, k);
    void *wd = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    void *wd2 = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    struct Weights w, w2;
    cpu_weights_pack(type, m, k, src, wd, &w);
    cpu_weights_pack(type, m, k, src2, wd2, &w2);
    float *wf = malloc(sizeof(float) * (size_t)m * k), *wf2 = malloc(sizeof(float) * (size_t)m * k);
    for (int r = 0; r < m; r++) {
        dequant_row(type, (const uint8_t *)src + (size_t)r * rb, wf + (size_t)r * k, (size_t)k);
        dequant_row(type, (const uint8_t *)src2 + (size_t)r * rb, wf2 + (size_t)r * k, (size_t)k);
    }
    size_t xs = (size_t)k + 3, ys = (size_t)m + 5; /* strides wider than the rows */
    float *x = malloc(sizeof(float) * (size_t)n * xs), *y0 = malloc(sizeof(float) * (size_t)n * ys);
    float *y = malloc(sizeof(float) * (size_t)n * ys), *first = malloc(sizeof(float) * (size_t)n * ys);
    double *want = malloc(sizeof(double) * (size_t)n * ys);
    double *want_q8 = malloc(sizeof(double) * (size_t)n * ys);
    float *xr = malloc(sizeof(float) * (size_t)n * k);
    for (size_t i = 0; i < (size_t)n * xs; i++) x[i] = frand();
    struct Q8Type qt;
    int q8 = cpu_q8_type(type, &qt);
    for (int i = 0; i < n; i++)
        ggml_round_row(q8 ? qt.act : Q8_ACT_32, x + (size_t)i * xs, k, xr + (size_t)i * k);
    for (size_t i = 0; i < (size_t)n * ys; i++) y0[i] = frand();
    for (int i = 0; i < n; i++)
        for (int j = 0; j < (int)ys; j++) {
            size_t at = (size_t)i * ys + j;
            if (j >= m) { want[at] = want_q8[at] = y0[at]; continue; }
            double s = 0, s2 = 0, r = 0, r2 = 0;
            for (int kk = 0; kk < k; kk++) {
                s += (double)x[(size_t)i * xs + kk] * wf[(size_t)j * k + kk];
                s2 += (double)x[(size_t)i * xs + kk] * wf2[(size_t)j * k + kk];
                r += (double)xr[(size_t)i * k + kk] * wf[(size_t)j * k + kk];
                r2 += (double)xr[(size_t)i * k + kk] * wf2[(size_t)j * k + kk];
            }
            want[at] = mode == 0 ? s : mode == 1 ? y0[at] + s : s / (1.0 + exp(-s)) * s2;
            want_q8[at] = mode == 0 ? r : mode == 1 ? y0[at] + r : r / (1.0 + exp(-r)) * r2;
        }
    struct MatmulArgs a = {
        .x = x, .x_stride = xs, .n = n, .k = k, .n_out = mode == 2 ? 2 : 1, .swiglu = mode == 2,
        .out = {{&w, y, ys, mode == 1}, {&w2, NULL, 0, 0}},
    };
    double worst = 0;
    for (int isa = 0; isa < CPU_ISA_COUNT; isa++) {
        if (!cpu_isa_supported((enum CpuIsa)isa)) continue;
        for (int gemm = 0; gemm < 3; gemm++)
            for (int threads = 1; threads <= 4; threads += (threads == 1 ? 1 : 2)) {
                /* int8 products: with AVX-512 VNNI or AVX2, for more than one row of the types
                 * that have them, against the inputs rounded as GGML rounds them; else as
                 * native. */
                int int8 = gemm == CPU_GEMM_Q8 && q8 && n > 1 &&
                           cpu_q8_kernel((enum CpuIsa)isa) != CPU_ISA_SCALAR;
                if (gemm == CPU_GEMM_Q8 && int8) q8_cases++;
                struct ThreadPool *pool = NULL;
                CHECK(pool_new(threads, &pool) == 0, "pool_new");
                void *scratch = malloc(cpu_matmul_scratch(n, k, threads));
                memcpy(y, y0, sizeof(float) * (size_t)n * ys);
                cpu_matmul_with((enum CpuIsa)isa, (enum CpuGemm)gemm, pool, &a, scratch);
                double err = rel_diff(y, int8 ? want_q8 : want, (size_t)n * ys);
                if (err > worst) worst = err;
                CHECK(err <= 1e-5, "matmul %s %s/%s threads=%d n=%d k=%d m=%d mode=%d: relative "
                      "error %.3e", tname, cpu_isa_name((enum CpuIsa)isa),
                      gemm == 2 ? "q8" : gemm ? "openblas" : "native", threads, n, k, m, mode, err);
                if (threads == 1) memcpy(first, y, sizeof(float) * (size_t)n * ys);
                else {
                    double td = rel_diff_f(y, first, (size_t)n * ys);
                    CHECK(td <= 1e-5, "matmul %s %s: %d threads differ from 1 by %.3e", tname,
                          cpu_isa_name((enum CpuIsa)isa), threads, td);
                }
                free(scratch);
                pool_destroy(&pool);
            }
    }
    /* A batch of decode tokens (onerow): the rows go through the one-row kernels several at a
     * time (CPU_MV_ROWS share one unpacking of the weights), and each must equal its own
     * one-row product bit for bit. */
    if (n > 1) {
        for (int isa = 0; isa < CPU_ISA_COUNT; isa++) {
            if (!cpu_isa_supported((enum CpuIsa)isa)) continue;
            struct ThreadPool *pool = NULL;
            CHECK(pool_new(2, &pool) == 0, "pool_new");
            void *scratch = malloc(cpu_matmul_scratch(n, k, 2));
            memcpy(y, y0, sizeof(float) * (size_t)n * ys);
            a.onerow = 1;
            cpu_matmul_with((enum CpuIsa)isa, CPU_GEMM_Q8, pool, &a, scratch);
            a.onerow = 0;
            int differ = 0;
            for (int i = 0; i < n; i++) {
                struct MatmulArgs one = a;
                one.x = x + (size_t)i * xs;
                one.n = 1;
                one.out[0].y = first;
                memcpy(first, y0 + (size_t)i * ys, sizeof(float) * ys);
                cpu_matmul_with((enum CpuIsa)isa, CPU_GEMM_Q8, pool, &one, scratch);
                differ += memcmp(first, y + (size_t)i * ys, sizeof(float) * (size_t)m) != 0;
            }
            CHECK(differ == 0, "matmul %s %s n=%d mode=%d: %d rows of a one-row batch differ "
                  "from their one-row products", tname, cpu_isa_name((enum CpuIsa)isa), n, mode,
                  differ);
            onerow_cases++;
            free(scratch);
            pool_destroy(&pool);
        }
    }
    free(src); free(src2); free(wd); free(wd2); free(wf); free(wf2);
    free(x); free(y0); free(y); free(first); free(want); free(want_q8); free(xr);
    return worst;
}

static void test_matmul(void)
{
    double worst = 0;
    int cases = 0;
    const int shapes[][3] = {{1, 96, 40}, {2, 64, 33}, {13, 160, 70}, {77, 96, 48}, {30, 1600, 20}};
    /* K-quants: rows of 1 to 7 super-blocks. */
    const int k_shapes[][3] = {{1, 256, 40}, {2, 512, 33}, {13, 768, 70}, {77, 256, 48}, {30, 1792, 20}};
    for (size_t ti = 0; ti < N_TYPES; ti++)
        for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
            for (int mode = 0; mode < 3; mode++) {
                const int *sh = is_k(TYPES[ti]) ? k_shapes[si] : shapes[si];
                double e = matmul_case(TYPES[ti], sh[0], sh[1], sh[2], mode, TYPE_NAMES[ti]);
                if (e > worst) worst = e;
                cases++;
            }
    printf("matmul: %d cases (%d types, 1-77 rows, plain/accumulate/SwiGLU) on every path: max "
           "relative error %.3e\n", cases, (int)N_TYPES, worst);
    printf("matmul: %d batches of one-row products (2-77 rows) on every path: each row equals "
           "its own one-row product bit for bit\n", onerow_cases);
    if (cpu_q8_kernel(cpu_isa_best()) != CPU_ISA_SCALAR)
        printf("matmul: %d int8 (q8) runs checked against GGML-rounded inputs\n", q8_cases);
    else
        printf("matmul: this processor has neither AVX-512 VNNI nor AVX2; the int8 products "
               "ran as native\n");
}

/* ------------------------------------------------------------------------------------------ */
/* Thread pool                                                                                 */

struct CountJob { atomic_int *hits; int n; };

static void count_task(void *ctx, int task, int thread)
{
    struct CountJob *j = ctx;
    (void)thread;
    atomic_fetch_add(&j->hits[task], 1);
}

/* Every task of every job runs exactly once. A worker running late once ran a task of the next
 * job under the old job's ticket, about once in 300,000 jobs on 2 busy cores: hence many jobs
 * (2,000 per thread count under valgrind, DIFFRAG_TEST_SCALE=small). */
static void test_pool(int jobs)
{
    enum { MAX_TASKS = 300 };
    atomic_int hits[MAX_TASKS];
    int bad = 0;
    for (int threads = 1; threads <= 4; threads++) {
        struct ThreadPool *pool = NULL;
        CHECK(pool_new(threads, &pool) == 0 && pool_threads(pool) == threads, "pool_new(%d)", threads);
        for (int job = 0; job < jobs; job++) {
            int n = 1 + (int)(rnd() % MAX_TASKS);
            for (int i = 0; i < n; i++) atomic_init(&hits[i], 0);
            struct CountJob j = {hits, n};
            pool_run(pool, n, count_task, &j);
            for (int i = 0; i < n; i++)
                if (atomic_load(&hits[i]) != 1) bad++;
        }
        pool_destroy(&pool);
        CHECK(pool == NULL, "pool_destroy clears the pointer");
    }
    CHECK(bad == 0, "%d tasks ran other than exactly once", bad);
    printf("pool: %d jobs of 1-%d tasks on 1-4 threads, every task exactly once\n", 4 * jobs,
           MAX_TASKS);
}

int main(void)
{
    printf("paths supported here:");
    for (int isa = 0; isa < CPU_ISA_COUNT; isa++)
        if (cpu_isa_supported((enum CpuIsa)isa)) printf(" %s", cpu_isa_name((enum CpuIsa)isa));
    printf(" (default %s)\n", cpu_isa_name(cpu_isa_best()));
    int small = check_small_scale();
    if (small) printf("reduced scale (DIFFRAG_TEST_SCALE=small): 2,000 pool jobs per thread count\n");
    test_pool(small ? 2000 : 100000);
    test_weights_layout();
    test_vector_decode();
    test_q8();
    test_matmul();
    test_attention();
    return check_report("test_kernels");
}
