/* The GPU checks (tests/gpu/run.sh runs this on a machine with a CUDA GPU):
 *   1. every operation of the GPU table against the CPU backend on fresh random inputs, the
 *      outputs poisoned (NaN) before each run so an unwritten element fails;
 *   2. the default model end to end: logits and groundedness masses of a GPU context against
 *      a CPU context over a chunked prompt and decode steps, in its GQA form and its exactly
 *      equivalent DIFF V2 form (query heads doubled, lambda 0, output projection doubled);
 *   3. (unless --no-time) a table of speeds: attention TFLOP/s at 4K, 32K and 128K tokens for
 *      the DIFF V2 shape, GEMM TFLOP/s, time to first token at 32K and 128K, decode tokens/s
 *      at depth 32K for both forms, and a sampled token's cost on the device and on the host.
 * Attention runs the default (mma.sync) and reference kernels; with --wgmma, the Hopper
 * prefill kernels loading with cp.async instead (both forms), with --tma the two fed by TMA,
 * each pair with its checks and its own speed rows. --quick: the
 * default kernels only, a prompt of about 200 tokens, no speed table (for the host emulation of the GPU
 * table, tests/gpu/host_gpu.c, under `make test`). --ops MODEL: only the time of each operation
 * outside attention on one 8192-token chunk of the model's DIFF V2 form. --dry-time: the speed
 * table's code with every size divided by 1024 (for the host emulation; the figures mean nothing).
 * Prints "FAIL ..." for each failed check and exits 1 if any failed. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/backend.h"
#include "kernels/gpu.h"
#include "kernels/gpu_plan.h"
#include "model/engine.h"
#include "model/engine_gpu.h"
#include "model/gguf.h"
#include "model/kvpool.h"
#include "model/model.h"
#include "model/model_ctx.h"
#include "model/sampler.h"

static int failures;
/* --dry-time: every size and step count of the speed table divided by this, to run its code
 * on the host emulation (tests/test_gpu_host.py); its figures then mean nothing */
static int shrink = 1;
static const struct GpuApi *A;
static struct GpuCtx *C;
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static void check(int ok, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("%s ", ok ? "ok  " : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    if (!ok) failures++;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static float urand(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) * (1.0 / 16777216.0)) * 2.f - 1.f;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static void *dalloc(size_t n)
{
    void *p;
    char err[256];
    if (A->alloc(C, n, &p, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        exit(2);
    }
    return p;
}

static void dsync(const char *what)
{
    char err[512];
    if (A->sync(C, err, sizeof err)) {
        check(0, "%s: %s", what, err);
        exit(1);
    }
}

/* ||a - b|| / ||b|| over n floats; NaN anywhere in a gives NaN. */
static double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i])) return NAN;
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void round_bf16(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) x[i] = gpu_bf16_to_f32(gpu_f32_to_bf16(x[i]));
}

static uint16_t *to_bf16(const float *x, size_t n)
{
    uint16_t *h = xmalloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = gpu_f32_to_bf16(x[i]);
    return h;
}

static float *bf16_to_f32(const uint16_t *h, size_t n)
{
    float *x = xmalloc(n * 4);
    for (size_t i = 0; i < n; i++) x[i] = gpu_bf16_to_f32(h[i]);
    return x;
}

#define POISON_F32 0xffc00000u   /* a NaN */
#define POISON_BF16 0xffc0u

static void poison_f32(float *d, size_t n)
{
    A->fill_u16(C, (uint16_t *)d, POISON_BF16, 2 * n);   /* 0xffc0ffc0: a NaN too */
}

/* ---- 1. operations ---- */

static void check_gemm(int n, int k, int m, float beta)
{
    float *x = xmalloc((size_t)n * k * 4), *w = xmalloc((size_t)m * k * 4);
    float *y0 = xmalloc((size_t)n * m * 4), *y = xmalloc((size_t)n * m * 4);
    float *ref = xmalloc((size_t)n * m * 4);
    for (size_t i = 0; i < (size_t)n * k; i++) x[i] = urand();
    for (size_t i = 0; i < (size_t)m * k; i++) w[i] = urand() * 0.1f;
    for (size_t i = 0; i < (size_t)n * m; i++) y0[i] = urand();
    round_bf16(x, (size_t)n * k);
    round_bf16(w, (size_t)m * k);
    for (int r = 0; r < n; r++)
        for (int c = 0; c < m; c++) {
            double s = 0;
            for (int i = 0; i < k; i++) s += (double)x[(size_t)r * k + i] * w[(size_t)c * k + i];
            ref[(size_t)r * m + c] = (float)(s + beta * y0[(size_t)r * m + c]);
        }
    uint16_t *xh = to_bf16(x, (size_t)n * k), *wh = to_bf16(w, (size_t)m * k);
    uint16_t *dx = dalloc((size_t)n * k * 2), *dw = dalloc((size_t)m * k * 2);
    float *dy = dalloc((size_t)n * m * 4);
    A->upload(C, dx, xh, (size_t)n * k * 2);
    A->upload(C, dw, wh, (size_t)m * k * 2);
    if (beta != 0.f) A->upload(C, dy, y0, (size_t)n * m * 4);
    else poison_f32(dy, (size_t)n * m);
    A->gemm(C, dx, n, k, dw, m, dy, m, beta);
    A->download(C, y, dy, (size_t)n * m * 4);
    dsync("gemm");
    double e = rel_err(y, ref, (size_t)n * m);
    check(e <= 1e-5, "gemm %dx%dx%d beta %.0f (bf16 in, f32 out): relative error %.2e (<= 1e-5)",
          n, m, k, beta, e);
    A->free(C, dx);
    A->free(C, dw);
    A->free(C, dy);
    free(x); free(w); free(y0); free(y); free(ref); free(xh); free(wh);
}

static void check_rows(void)
{
    int n = 77, d = 576, F = 1536, vocab = 1000;
    float *x = xmalloc((size_t)n * d * 4), *w = xmalloc((size_t)d * 4), *ref = xmalloc((size_t)n * d * 4);
    for (size_t i = 0; i < (size_t)n * d; i++) x[i] = urand() * 3;
    for (int i = 0; i < d; i++) w[i] = urand();
    backend_cpu.rmsnorm(NULL, ref, x, w, n, d, 1e-5f);
    float *dx = dalloc((size_t)n * d * 4), *dw = dalloc((size_t)d * 4);
    uint16_t *dy = dalloc((size_t)n * d * 2), *yh = xmalloc((size_t)n * d * 2);
    A->upload(C, dx, x, (size_t)n * d * 4);
    A->upload(C, dw, w, (size_t)d * 4);
    A->fill_u16(C, dy, POISON_BF16, (size_t)n * d);
    A->rmsnorm(C, dx, d, dw, n, d, 1e-5f, dy);
    A->download(C, yh, dy, (size_t)n * d * 2);
    dsync("rmsnorm");
    float *y = bf16_to_f32(yh, (size_t)n * d);
    double e = rel_err(y, ref, (size_t)n * d);
    check(e <= 1e-2, "rmsnorm %dx%d (bf16 out): relative error %.2e (<= 1e-2)", n, d, e);
    free(y);

    float *gu = xmalloc((size_t)n * 2 * F * 4), *hr = xmalloc((size_t)n * F * 4);
    for (size_t i = 0; i < (size_t)n * 2 * F; i++) gu[i] = urand() * 4;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < F; i++) {
            double g = gu[(size_t)r * 2 * F + i], u = gu[(size_t)r * 2 * F + F + i];
            hr[(size_t)r * F + i] = (float)(g / (1 + exp(-g)) * u);
        }
    float *dgu = dalloc((size_t)n * 2 * F * 4);
    uint16_t *dh = dalloc((size_t)n * F * 2), *hh = xmalloc((size_t)n * F * 2);
    A->upload(C, dgu, gu, (size_t)n * 2 * F * 4);
    A->fill_u16(C, dh, POISON_BF16, (size_t)n * F);
    A->swiglu(C, dgu, n, F, dh);
    A->download(C, hh, dh, (size_t)n * F * 2);
    dsync("swiglu");
    float *h = bf16_to_f32(hh, (size_t)n * F);
    e = rel_err(h, hr, (size_t)n * F);
    check(e <= 1e-2, "swiglu %dx%d (bf16 out): relative error %.2e (<= 1e-2)", n, F, e);
    free(h);

    float *tab = xmalloc((size_t)vocab * d * 4), *er = xmalloc((size_t)n * d * 4);
    int32_t tok[77];
    for (size_t i = 0; i < (size_t)vocab * d; i++) tab[i] = urand();
    round_bf16(tab, (size_t)vocab * d);
    for (int i = 0; i < n; i++) {
        tok[i] = (int32_t)((urand() + 1) * 0.5f * (vocab - 1));
        memcpy(er + (size_t)i * d, tab + (size_t)tok[i] * d, (size_t)d * 4);
    }
    uint16_t *tb = to_bf16(tab, (size_t)vocab * d), *dtab = dalloc((size_t)vocab * d * 2);
    int32_t *dtok = dalloc(sizeof tok);
    float *dex = dalloc((size_t)n * d * 4), *ex = xmalloc((size_t)n * d * 4);
    A->upload(C, dtab, tb, (size_t)vocab * d * 2);
    A->upload(C, dtok, tok, sizeof tok);
    poison_f32(dex, (size_t)n * d);
    A->embed(C, dtab, dtok, n, d, dex);
    A->download(C, ex, dex, (size_t)n * d * 4);
    dsync("embed");
    e = rel_err(ex, er, (size_t)n * d);
    check(e == 0, "embedding gather %d rows of %d: relative error %.2e (exact)", n, d, e);
    void *ptrs[] = {dx, dw, dy, dgu, dh, dtab, dtok, dex};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++) A->free(C, ptrs[i]);
    free(x); free(w); free(ref); free(yh); free(gu); free(hr); free(hh); free(tab); free(er);
    free(tb); free(ex);
}

/* Sampling's pass (GpuApi.sample) against the host's sampler: random logits with NaN and
 * -inf among them, every way of keeping candidates, the head poisoned before each run; the
 * device's candidates through sampler_finish must draw the very tokens sampler_sample draws
 * from the same logits with the same seed, with the same signals. */
static void check_sample(int n)
{
    float *l = xmalloc((size_t)n * 4);
    for (int i = 0; i < n; i++) l[i] = 6.f * urand() + 1e-4f * (float)i / n;
    l[n / 3] = NAN;
    l[n / 2] = -INFINITY;
    float *dl = dalloc((size_t)n * 4), *dw = dalloc((size_t)n * 4);
    struct GpuSampleHead *dh = dalloc(sizeof *dh + (size_t)n * sizeof(struct GpuCand));
    A->upload(C, dl, l, (size_t)n * 4);
    struct SampleCand *cand = xmalloc((size_t)n * sizeof *cand);
    static const struct SamplerParams set[] = {
        {0.f, 40, 0.95f, 0.05f, 1}, {0.8f, 40, 0.95f, 0.05f, 2}, {1.f, 1, 1.f, 0.f, 3},
        {0.7f, 0, 0.9f, 0.05f, 4}, {1.3f, 0, 0.9f, 0.f, 5}, {1.f, 0, 1.f, 0.f, 6},
        {2.f, 1000, 0.99f, 0.f, 7},
    };
    for (size_t si = 0; si < sizeof set / sizeof *set; si++) {
        struct Sampler *host, *dev;
        if (sampler_new(&set[si], n, &host) || sampler_new(&set[si], n, &dev)) exit(2);
        struct SampleKeep k;
        sampler_keep(dev, &k);
        int differ = 0, sig_bad = 0, head_bad = 0, draws = 20;
        for (int d = 0; d < draws; d++) {
            A->fill_u16(C, (uint16_t *)dh, POISON_BF16,
                        (sizeof *dh + (size_t)n * sizeof(struct GpuCand)) / 2);
            struct GpuSampleArgs sa = {
                .logits = dl, .n = n, .mode = (int)k.mode, .inv_temp = k.inv_temp,
                .floor = k.floor, .mass = k.mass, .k = k.k, .work = dw, .head = dh,
            };
            A->sample(C, &sa);
            struct GpuSampleHead h;
            A->download(C, &h, dh, sizeof h);
            dsync("sample");
            if (h.n_cand < 0 || h.n_cand > n || h.best < 0 || h.best >= n) {
                head_bad++;
                continue;
            }
            A->download(C, cand, dh + 1, (size_t)h.n_cand * sizeof *cand);
            dsync("sample candidates");
            struct SamplePass p = {h.best, h.mx, h.second, h.z1, h.ez1, h.zt, cand, h.n_cand};
            struct TokenSignal sd, sh;
            int32_t got = sampler_finish(dev, &p, &sd), want = sampler_sample(host, l, &sh);
            if (k.mode == SAMPLE_TOP_K) head_bad += h.n_cand != k.k;
            differ += got != want;
            sig_bad += !(fabsf(sd.logprob - sh.logprob) <= 1e-4f) ||
                       !(fabsf(sd.entropy - sh.entropy) <= 1e-4f) ||
                       !(fabsf(sd.margin - sh.margin) <= 1e-5f);
        }
        check(!differ && !sig_bad && !head_bad, "sample (%d logits, T %.1f top-k %d top-p %.2f "
              "min-p %.2f): %d of %d draws differ from the host's, %d signals off, %d bad heads",
              n, set[si].temperature, set[si].top_k, set[si].top_p, set[si].min_p, differ,
              draws, sig_bad, head_bad);
        sampler_destroy(&host);
        sampler_destroy(&dev);
    }
    A->free(C, dl);
    A->free(C, dw);
    A->free(C, dh);
    free(cand);
    free(l);
}

/* The Hopper kernels' two products alone (GpuApi.wgmma_probe) against double-precision
 * products of the same bf16 values: scores a . page^T (keys K-major) and a[:, :64] . page
 * (values MN-major). The first wrong elements are printed: a layout mistake shows as a
 * pattern (rows or columns swapped, a half missing). */
static void check_wgmma_probe(int hd)
{
    float *a = xmalloc((size_t)64 * hd * 4), *pg = xmalloc((size_t)GPU_PAGE * hd * 4);
    for (int i = 0; i < 64 * hd; i++) a[i] = urand();
    for (int i = 0; i < GPU_PAGE * hd; i++) pg[i] = urand();
    round_bf16(a, (size_t)64 * hd);
    round_bf16(pg, (size_t)GPU_PAGE * hd);
    float *rk = xmalloc((size_t)64 * GPU_PAGE * 4), *rv = xmalloc((size_t)64 * hd * 4);
    for (int m = 0; m < 64; m++) {
        for (int n = 0; n < GPU_PAGE; n++) {
            double acc = 0;
            for (int d = 0; d < hd; d++) acc += (double)a[m * hd + d] * pg[n * hd + d];
            rk[m * GPU_PAGE + n] = (float)acc;
        }
        for (int n = 0; n < hd; n++) {
            double acc = 0;
            for (int k = 0; k < GPU_PAGE; k++) acc += (double)a[m * hd + k] * pg[k * hd + n];
            rv[m * hd + n] = (float)acc;
        }
    }
    uint16_t *ah = to_bf16(a, (size_t)64 * hd), *ph = to_bf16(pg, (size_t)GPU_PAGE * hd);
    uint16_t *da = dalloc((size_t)64 * hd * 2), *dp = dalloc((size_t)GPU_PAGE * hd * 2);
    float *dk = dalloc((size_t)64 * GPU_PAGE * 4), *dv = dalloc((size_t)64 * hd * 4);
    A->upload(C, da, ah, (size_t)64 * hd * 2);
    A->upload(C, dp, ph, (size_t)GPU_PAGE * hd * 2);
    poison_f32(dk, (size_t)64 * GPU_PAGE);
    poison_f32(dv, (size_t)64 * hd);
    if (A->wgmma_probe(C, hd, da, dp, dk, dv)) {
        check(0, "wgmma probe hd %d: not run (not a compute capability 9.0 device)", hd);
    } else {
        float *gk = xmalloc((size_t)64 * GPU_PAGE * 4), *gv = xmalloc((size_t)64 * hd * 4);
        A->download(C, gk, dk, (size_t)64 * GPU_PAGE * 4);
        A->download(C, gv, dv, (size_t)64 * hd * 4);
        dsync("wgmma probe");
        double ek = rel_err(gk, rk, (size_t)64 * GPU_PAGE), ev = rel_err(gv, rv, (size_t)64 * hd);
        check(ek <= 1e-5 && ev <= 1e-5, "wgmma probe hd %d: scores (keys K-major) relative error "
              "%.2e, P V (values MN-major) %.2e (<= 1e-5)", hd, ek, ev);
        for (int which = 0; which < 2; which++) {
            const float *g = which ? gv : gk, *r = which ? rv : rk;
            int cols = which ? hd : GPU_PAGE, shown = 0;
            for (int i = 0; i < 64 * cols && shown < 4; i++)
                if (!(fabsf(g[i] - r[i]) <= 1e-3f * (1.f + fabsf(r[i])))) {
                    printf("   %s [%d][%d]: %g, expected %g\n", which ? "P V" : "scores", i / cols,
                           i % cols, g[i], r[i]);
                    shown++;
                }
        }
        free(gk);
        free(gv);
    }
    void *ptrs[] = {da, dp, dk, dv};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++) A->free(C, ptrs[i]);
    free(a); free(pg); free(rk); free(rv); free(ah); free(ph);
}


/* RoPE + KV store + attention (prefill chunks, then decode steps) with the groundedness
 * masses, against the CPU backend (f32 KV cache) on the same rows. The neox cases add q, k
 * and v biases as qwen2 does (GpuRopeArgs.bias; on the CPU side added to the rows first). */
static void check_attention(int hd, int n_head, int n_kv, int diff, int n_rot, int layout,
                            int kernel)
{
    int nq_h = diff ? 2 * n_head : n_head, n_ctx = 1100, half = n_rot / 2;
    int nq = nq_h * hd, nkv = n_kv * hd, no = n_head * hd, nl = diff ? n_head : 0;
    int stride = nq + 2 * nkv + nl, n_layer = 2, layer = 1;
    int chunks[][2] = {{0, 333}, {333, 450}, {783, 1}, {784, 1}, {785, 200}, {985, 1}};
    /* CPU side */
    size_t khs = backend_cpu.kv_head_stride(n_ctx, hd, KV_F32);
    float *kc = xmalloc((size_t)n_kv * khs * 4), *vc = xmalloc((size_t)n_kv * khs * 4);
    size_t ascr = backend_cpu.attention_scratch(512, n_ctx, hd, nq_h, n_kv, 1);
    size_t mscr = backend_cpu.attention_mass_scratch(n_ctx, hd, nq_h, n_kv, 1);
    void *as = xmalloc(ascr), *ms = xmalloc(mscr);
    uint8_t *cls = xmalloc((size_t)n_ctx);
    int n_marked = 700;
    for (int i = 0; i < n_ctx; i++) cls[i] = urand() > 0.2f;
    int heads[64];
    for (int i = 0; i < nq_h; i++) heads[i] = i;
    struct ThreadPool *pool;
    pool_new(1, &pool);
    /* GPU side: a pool of pages for 2 layers, handed out in a scrambled order */
    size_t pe = gpu_page_elems(n_layer, n_kv, hd);
    int n_pages = (n_ctx + GPU_PAGE - 1) / GPU_PAGE;
    int32_t *pt = xmalloc((size_t)n_pages * 4);
    for (int i = 0; i < n_pages; i++) pt[i] = (int32_t)((i * 7 + 3) % (n_pages + 5));
    uint16_t *dpool = dalloc((n_pages + 5) * pe * 2);
    A->fill_u16(C, dpool, POISON_BF16, (n_pages + 5) * pe);
    int32_t *dpt = dalloc((size_t)n_pages * 4);
    uint8_t *dcls = dalloc((size_t)n_ctx);
    A->upload(C, dpt, pt, (size_t)n_pages * 4);
    A->upload(C, dcls, cls, (size_t)n_ctx);
    int maxn = 512;
    float *bias = NULL, *dbias = NULL;
    if (layout) {
        bias = xmalloc((size_t)(nq + 2 * nkv) * 4);
        for (int i = 0; i < nq + 2 * nkv; i++) bias[i] = urand() * 2;
        dbias = dalloc((size_t)(nq + 2 * nkv) * 4);
        A->upload(C, dbias, bias, (size_t)(nq + 2 * nkv) * 4);
    }
    float *dqkv = dalloc((size_t)maxn * stride * 4), *dcos = dalloc((size_t)maxn * half * 4);
    float *dsin = dalloc((size_t)maxn * half * 4), *dmass = dalloc((size_t)nq_h * 8);
    uint16_t *dq = dalloc((size_t)(maxn + GPU_QTILE) * nq * 2), *dout = dalloc((size_t)maxn * nq * 2);
    A->fill_u16(C, dq, 0, (size_t)(maxn + GPU_QTILE) * nq);
    double worst = 0, worst_mass = 0;
    for (size_t ci = 0; ci < sizeof chunks / sizeof *chunks; ci++) {
        int pos0 = chunks[ci][0], n = chunks[ci][1];
        float *qkv = xmalloc((size_t)n * stride * 4), *cs = xmalloc((size_t)n * half * 4);
        float *sn = xmalloc((size_t)n * half * 4);
        for (size_t i = 0; i < (size_t)n * stride; i++) qkv[i] = urand() * 2;
        for (int t = 0; t < n; t++)
            for (int i = 0; i < half; i++) {
                double ph = (pos0 + t) * pow(10000.0, -2.0 * i / n_rot);
                cs[(size_t)t * half + i] = (float)cos(ph);
                sn[(size_t)t * half + i] = (float)sin(ph);
            }
        /* CPU: split the fused rows, rope + store, attention, masses of the last query */
        float *q = xmalloc((size_t)n * nq * 4), *k = xmalloc((size_t)n * nkv * 4);
        float *v = xmalloc((size_t)n * nkv * 4), *lam = xmalloc((size_t)n * (nl ? nl : 1) * 4);
        for (int t = 0; t < n; t++) {
            const float *r = qkv + (size_t)t * stride;
            memcpy(q + (size_t)t * nq, r, (size_t)nq * 4);
            memcpy(k + (size_t)t * nkv, r + nq, (size_t)nkv * 4);
            memcpy(v + (size_t)t * nkv, r + nq + nkv, (size_t)nkv * 4);
            if (nl) memcpy(lam + (size_t)t * nl, r + nq + 2 * nkv, (size_t)nl * 4);
            for (int i = 0; bias && i < nq; i++) q[(size_t)t * nq + i] += bias[i];
            for (int i = 0; bias && i < nkv; i++) {
                k[(size_t)t * nkv + i] += bias[nq + i];
                v[(size_t)t * nkv + i] += bias[nq + nkv + i];
            }
        }
        struct RopeStoreArgs rs = {
            .q = q, .q_stride = (size_t)nq, .k = k, .v = v, .kv_stride = (size_t)nkv, .n_tok = n,
            .pos0 = pos0, .n_q_head = nq_h, .n_kv_head = n_kv, .head_dim = hd, .n_rot = n_rot,
            .layout = layout, .cos = cs, .sin = sn, .kcache = kc, .vcache = vc,
            .kv_type = KV_F32, .kv_head_stride = khs,
        };
        backend_cpu.rope_store(pool, &rs);
        int nout = diff ? no : nq;
        float *ref = xmalloc((size_t)n * nout * 4);
        struct AttnArgs aa = {
            .q = q, .q_stride = (size_t)nq, .out = ref, .out_stride = (size_t)nout, .k = kc,
            .v = vc, .kv_head_stride = khs, .kv_type = KV_F32, .n_tok = n, .pos0 = pos0,
            .n_q_head = nq_h, .n_kv_head = n_kv, .head_dim = hd, .scale = 1.f / sqrtf((float)hd),
            .lambda = diff ? lam : NULL, .lambda_stride = (size_t)(nl ? nl : 1),
        };
        backend_cpu.attention(pool, &aa, as);
        float mref[128];
        struct MassArgs ma = {
            .q = q + (size_t)(n - 1) * nq, .k = kc, .kv_head_stride = khs, .kv_type = KV_F32,
            .n_keys = pos0 + n, .n_q_head = nq_h, .n_kv_head = n_kv, .head_dim = hd,
            .scale = 1.f / sqrtf((float)hd), .cls = cls, .n_marked = n_marked, .heads = heads,
            .n_heads = nq_h, .mass = mref,
        };
        backend_cpu.attention_mass(pool, &ma, ms);
        /* GPU */
        A->upload(C, dqkv, qkv, (size_t)n * stride * 4);
        A->upload(C, dcos, cs, (size_t)n * half * 4);
        A->upload(C, dsin, sn, (size_t)n * half * 4);
        struct GpuRopeArgs gr = {
            .qkv = dqkv, .qkv_stride = stride, .bias = dbias, .q_out = dq, .n_tok = n,
            .pos0 = pos0, .n_q_head = nq_h, .n_kv_head = n_kv, .head_dim = hd, .n_rot = n_rot,
            .layout = layout, .cos = dcos, .sin = dsin, .pool = dpool, .pages = dpt,
            .page_elems = pe, .layer = layer,
        };
        A->rope_store(C, &gr);
        A->fill_u16(C, dout, POISON_BF16, (size_t)n * nout);
        poison_f32(dmass, (size_t)nq_h * 2);
        struct GpuAttnArgs ga = {
            .q = dq, .out = dout, .pool = dpool, .pages = dpt, .page_elems = pe,
            .pool_pages = n_pages + 5, .layer = layer, .n_tok = n, .pos0 = pos0, .n_q_head = nq_h,
            .n_kv_head = n_kv, .head_dim = hd,
            .scale = 1.f / sqrtf((float)hd), .lambda = diff ? dqkv + nq + 2 * nkv : NULL,
            .lambda_stride = stride, .cls = dcls, .n_marked = n_marked, .mass = dmass,
            .kernel = kernel,
        };
        A->attention(C, &ga);
        uint16_t *oh = xmalloc((size_t)n * nout * 2);
        float gm[128];
        A->download(C, oh, dout, (size_t)n * nout * 2);
        A->download(C, gm, dmass, (size_t)nq_h * 8);
        dsync("attention");
        float *o = bf16_to_f32(oh, (size_t)n * nout);
        double e = rel_err(o, ref, (size_t)n * nout), em = 0, emax = 0, rmax = 0;
        for (size_t i = 0; i < (size_t)n * nout; i++) {
            double d = isnan(o[i]) ? INFINITY : fabs(o[i] - ref[i]);
            emax = d > emax ? d : emax;
            rmax = fabs(ref[i]) > rmax ? fabs(ref[i]) : rmax;
        }
        emax /= rmax > 0 ? rmax : 1;
        for (int i = 0; i < 2 * nq_h; i++) {
            double d = isnan(gm[i]) ? 1 : fabs(gm[i] - mref[i]);
            em = d > em ? d : em;
        }
        if (!(e <= worst)) worst = e;
        if (!(em <= worst_mass)) worst_mass = em;
        check(e <= 1e-2 && emax <= 2e-2 && em <= 1e-2, "attention (%s%s) %s hd %d, %d/%d heads, "
              "rope %s%s: chunk at %d of %d tokens: relative error %.2e (<= 1e-2), worst element "
              "%.2e of the largest (<= 2e-2), masses max abs error %.1e (<= 1e-2)",
              n == 1 ? "decode, " : "prefill, ", gpu_attention_kernels[kernel],
              diff ? "DIFF V2" : "GQA", hd, nq_h, n_kv, layout ? "neox" : "adjacent",
              bias ? ", q/k/v biases" : "", pos0, n, e,
              emax, em);
        free(qkv); free(cs); free(sn); free(q); free(k); free(v); free(lam); free(ref);
        free(oh); free(o);
    }
    void *ptrs[] = {dpool, dpt, dcls, dqkv, dcos, dsin, dmass, dq, dout, dbias};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++) A->free(C, ptrs[i]);
    free(bias);
    pool_destroy(&pool);
    free(kc); free(vc); free(as); free(ms); free(cls); free(pt);
}

/* ---- 2. the model end to end ---- */

/* The DIFF V2 form of a llama or qwen2 model, sharing its weights where they are unchanged:
 * query head j (and its bias) becomes heads 2j and 2j+1, lambda logits are 0 (sigmoid 1/2) and
 * the output projection is doubled, so o_2j - o_2j+1 / 2 = o_j / 2 doubles back to the same
 * layer output. */
struct DiffForm {
    struct Model m;
    struct LayerWeights *layers;
    float **bufs;
    int n_bufs;
};

static struct Weights f32_weights(struct DiffForm *d, int rows, int cols, float **data)
{
    *data = calloc((size_t)rows * cols, sizeof(float));
    if (!*data) exit(2);
    d->bufs[d->n_bufs++] = *data;
    return (struct Weights){.type = GGML_TYPE_F32, .layout = WEIGHTS_ROWS, .rows = rows,
                            .cols = cols, .row_bytes = (size_t)cols * 4, .data = *data};
}

static void diff_form(const struct Model *src, struct DiffForm *d)
{
    const struct ModelConfig *c = &src->cfg;
    int L = c->n_layer, hd = c->head_dim, dim = c->dim;
    memset(d, 0, sizeof *d);
    d->m = *src;
    d->m.gpu = NULL;
    d->m.cfg.arch = ARCH_DIFFV2;
    d->m.cfg.n_q_head = 2 * c->n_head;
    d->layers = xmalloc((size_t)L * sizeof *d->layers);
    d->bufs = xmalloc((size_t)L * 4 * sizeof *d->bufs);
    for (int l = 0; l < L; l++) {
        const struct LayerWeights *s = &src->layers[l];
        struct LayerWeights *w = &d->layers[l];
        *w = *s;
        float *q, *o, *lam;
        w->wq = f32_weights(d, 2 * c->n_head * hd, dim, &q);
        for (int h = 0; h < c->n_head; h++)
            for (int r = 0; r < hd; r++) {
                backend_cpu.weights_row(&s->wq, h * hd + r, q + ((size_t)(2 * h) * hd + r) * dim);
                memcpy(q + ((size_t)(2 * h + 1) * hd + r) * dim, q + ((size_t)(2 * h) * hd + r) * dim,
                       (size_t)dim * 4);
            }
        w->wo = f32_weights(d, dim, c->n_head * hd, &o);
        for (int r = 0; r < dim; r++) {
            float *row = o + (size_t)r * c->n_head * hd;
            backend_cpu.weights_row(&s->wo, r, row);
            for (int i = 0; i < c->n_head * hd; i++) row[i] *= 2.f;
        }
        w->wlambda = f32_weights(d, c->n_head, dim, &lam);
        if (s->bq) {
            float *bq = xmalloc((size_t)2 * c->n_head * hd * sizeof *bq);
            for (int h = 0; h < c->n_head; h++) {
                memcpy(bq + (size_t)(2 * h) * hd, s->bq + (size_t)h * hd, (size_t)hd * 4);
                memcpy(bq + (size_t)(2 * h + 1) * hd, s->bq + (size_t)h * hd, (size_t)hd * 4);
            }
            d->bufs[d->n_bufs++] = bq;
            w->bq = bq;
        }
    }
    d->m.layers = d->layers;
}

static void diff_form_free(struct DiffForm *d)
{
    model_gpu_free(&d->m);
    for (int i = 0; i < d->n_bufs; i++) free(d->bufs[i]);
    free(d->bufs);
    free(d->layers);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static struct Engine *open_ctx(const struct Model *m, int device, int n_ctx, int chunk, int threads)
{
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = n_ctx;
    o.chunk = chunk;
    o.device = device;
    o.n_threads = threads;
    struct Engine *e;
    char err[512];
    if (engine_new(m, &o, &e, err, sizeof err)) {
        check(0, "engine_new (%s, %d positions): %s", device ? "cuda" : "cpu", n_ctx, err);
        exit(1);
    }
    return e;
}

/* CPU and GPU contexts side by side: a prompt in uneven chunks, then greedy decode steps
 * (the CPU's choice fed to both), logits, masses and the captured residual stream (a hidden-
 * state probe's rows) compared at every step. */
static void check_model(const struct Model *m, const char *form, const int32_t *prompt, int n,
                        int threads)
{
    int vocab = m->cfg.vocab;
    struct Engine *ec = open_ctx(m, ENGINE_CPU, 2048, 160, threads);
    struct Engine *eg = open_ctx(m, ENGINE_CUDA, 2048, 160, 1);
    struct AttnWatch w[ENGINE_MAX_WATCH];
    int nw = engine_default_watch(m, w, ENGINE_MAX_WATCH);
    char err[512];
    uint8_t *cls = xmalloc((size_t)n);
    for (int i = 0; i < n; i++) cls[i] = i >= 16 && i < n - 24;
    int cap[3] = {0, m->cfg.n_layer / 2, m->cfg.n_layer};
    int rc = engine_watch(ec, w, nw, err, sizeof err) | engine_watch(eg, w, nw, err, sizeof err) |
             engine_capture(ec, cap, 3, err, sizeof err) | engine_capture(eg, cap, 3, err, sizeof err) |
             engine_set_spans(ec, cls, (size_t)n, err, sizeof err) |
             engine_set_spans(eg, cls, (size_t)n, err, sizeof err);
    rc |= engine_prefill(ec, prompt, (size_t)n, err, sizeof err);
    if (!rc) rc = engine_prefill(eg, prompt, (size_t)n, err, sizeof err);
    if (rc) {
        check(0, "%s: prefill: %s", form, err);
        free(cls);
        engine_destroy(&ec);
        engine_destroy(&eg);
        return;
    }
    /* the device's span of the prefill is inside its wall time (and the CPU context has none) */
    struct EngineStats sg, sc;
    engine_stats(eg, &sg);
    engine_stats(ec, &sc);
    check(sg.device_s > 0 && sg.device_s <= sg.total_s && sc.device_s == 0,
          "%s: prefill time %.3f s, the device's span of it %.3f s", form, sg.total_s, sg.device_s);
    double worst = 0, worst_mass = 0, worst_sig = 0, worst_hidden = 0;
    int agree = 0, steps = 8, dev_greedy = 0;
    struct SamplerParams gp;
    sampler_params_default(&gp);
    struct Sampler *greedy;
    if (sampler_new(&gp, vocab, &greedy)) exit(2);
    for (int s = 0; s <= steps; s++) {
        /* the device's sampling pass first, on logits that never left the device */
        int32_t td = -1;
        struct TokenSignal sd, sh;
        if (engine_sample(eg, greedy, &td, &sd, err, sizeof err)) {
            check(0, "%s: engine_sample: %s", form, err);
            break;
        }
        const float *lc = engine_logits(ec), *lg = engine_logits(eg);
        if (!lg) {
            check(0, "%s: the GPU context's logits could not be read", form);
            break;
        }
        sampler_signal(lg, vocab, td, &sh);
        dev_greedy += td == argmax(lg, vocab);
        double ds = fabs(sd.logprob - sh.logprob) + fabs(sd.entropy - sh.entropy) +
                    fabs(sd.margin - sh.margin);
        if (!(ds <= worst_sig)) worst_sig = ds;
        double e = rel_err(lg, lc, (size_t)vocab);
        if (!(e <= worst)) worst = e;
        int tc = argmax(lc, vocab), tg = argmax(lg, vocab);
        agree += tc == tg;
        int nc, ng;
        const struct AttnMass *mc = engine_attn_mass(ec, &nc), *mg = engine_attn_mass(eg, &ng);
        for (int i = 0; mc && mg && i < nc && i < ng; i++) {
            /* DIFF V2: sig comes from the lambdas kept on the device layer by layer (0.5 in
             * this form: its lambda weights are 0, while the columns beside them are not) */
            double d = fabs(mc[i].doc - mg[i].doc) + fabs(mc[i].gen - mg[i].gen) +
                       fabs(mc[i].sig - mg[i].sig);
            if (!(d <= worst_mass)) worst_mass = d;
        }
        if (!mc || !mg || nc != ng) worst_mass = INFINITY;
        int hc, hg;
        const float *rc_ = engine_hidden(ec, &hc), *rg = engine_hidden(eg, &hg);
        double eh = rc_ && rg && hc == 3 && hg == 3 ? rel_err(rg, rc_, (size_t)3 * m->cfg.dim)
                                                    : INFINITY;
        if (!(eh <= worst_hidden)) worst_hidden = eh;
        if (s == steps) break;
        if (engine_decode(ec, tc, err, sizeof err) || engine_decode(eg, tc, err, sizeof err)) {
            check(0, "%s: decode: %s", form, err);
            break;
        }
    }
    check(worst <= 5e-2, "%s: logits of a GPU context against a CPU context over a %d-token "
          "prompt (chunks of 160) and %d decode steps: worst relative error %.2e (<= 5e-2: "
          "bf16 weights and activations through every layer)", form, n, steps, worst);
    check(agree >= steps, "%s: greedy token agrees at %d of %d positions", form, agree, steps + 1);
    check(worst_mass <= 2e-2, "%s: groundedness masses (%d watched heads): worst summed "
          "difference of doc, gen and sigmoid(lambda) %.2e (<= 2e-2)", form, nw, worst_mass);
    check(worst_hidden <= 5e-2, "%s: the residual stream entering layers 0, %d and %d (a "
          "hidden-state probe's rows) against the CPU's: worst relative error %.2e (<= 5e-2)",
          form, m->cfg.n_layer / 2, m->cfg.n_layer, worst_hidden);
    check(dev_greedy == steps + 1 && worst_sig <= 1e-4, "%s: greedy sampling on the device picks "
          "the largest of the same logits at %d of %d positions; signals against the host's "
          "over them: worst summed difference %.2e (<= 1e-4)", form, dev_greedy, steps + 1,
          worst_sig);
    sampler_destroy(&greedy);
    free(cls);
    engine_destroy(&ec);
    engine_destroy(&eg);
}

/* The batch scheduler's step on the GPU (engine_step over member sequences of one context): 4
 * prompts of different lengths prefilled in one step, then 6 decode steps of all four at once,
 * against each sequence alone in a context of its own. The products then have other numbers of
 * rows, so the logits may differ by rounding, which bf16 activations carry through the layers
 * (the bound of the CPU comparison above); the greedy tokens must agree. */
static void check_batch(const struct Model *m, const char *form, const int32_t *prompt, int n)
{
    enum { NS = 4, STEPS = 6 };
    int vocab = m->cfg.vocab;
    struct Engine *r = open_ctx(m, ENGINE_CUDA, 2048, 2048, 1);
    struct Engine *seq[NS] = {0}, *alone[NS] = {0};
    struct EngineBatchItem it[NS];
    int32_t tok[NS];
    char err[512];
    double worst = 0;
    int agree = 0, total = 0, failed = -1, rc = 0;
    for (int i = 0; i < NS && !rc; i++) {
        int len = n - 37 * i > 8 ? n - 37 * i : 8;
        alone[i] = open_ctx(m, ENGINE_CUDA, 2048, 2048, 1);
        rc = engine_new_seq(r, &seq[i], err, sizeof err);
        if (!rc) rc = engine_prefill(alone[i], prompt, (size_t)len, err, sizeof err);
        it[i] = (struct EngineBatchItem){seq[i], prompt, len, 1, 1, 0};
    }
    if (!rc) rc = engine_step(r, it, NS, &failed, err, sizeof err);
    for (int s = 0; s <= STEPS && !rc; s++) {
        for (int i = 0; i < NS; i++) {
            const float *la = engine_logits(alone[i]), *lb = engine_logits(seq[i]);
            if (!la || !lb) {
                rc = -1;
                snprintf(err, sizeof err, "logits could not be read");
                break;
            }
            double e = rel_err(lb, la, (size_t)vocab);
            if (!(e <= worst)) worst = e;
            tok[i] = argmax(la, vocab);
            agree += tok[i] == argmax(lb, vocab);
            total++;
        }
        if (rc || s == STEPS) break;
        for (int i = 0; i < NS && !rc; i++) {
            it[i] = (struct EngineBatchItem){seq[i], &tok[i], 1, 0, 1, 0};
            rc = engine_decode(alone[i], tok[i], err, sizeof err);
        }
        if (!rc) rc = engine_step(r, it, NS, &failed, err, sizeof err);
    }
    if (rc)
        check(0, "batch step, %s: %s (item %d)", form, err, failed);
    else
        check(worst <= 5e-2 && agree >= total - 1, "batch step, %s: %d sequences (prompts of "
              "%d..%d tokens) prefilled in one step, then %d decode steps of all of them, against "
              "each alone: worst relative error of the logits %.2e (<= 5e-2), greedy token agrees "
              "at %d of %d", form, NS, n - 37 * (NS - 1) > 8 ? n - 37 * (NS - 1) : 8, n, STEPS, worst,
              agree, total);
    for (int i = 0; i < NS; i++) {
        engine_destroy(&seq[i]);
        engine_destroy(&alone[i]);
    }
    engine_destroy(&r);
}

/* A prompt's greedy run in a new GPU context: the prefill's logits into lg0, the positions it
 * took from the prefix cache, then `steps` greedy tokens into tok[] (the context is returned
 * holding its pages; NULL on a failure, said). */
static struct Engine *greedy_run(const struct Model *m, const int32_t *prompt, int n, int steps,
                                 float *lg0, int *cached, int32_t *tok)
{
    char err[512];
    struct Engine *e = open_ctx(m, ENGINE_CUDA, 1024, 160, 1);
    int rc = engine_prefill(e, prompt, (size_t)n, err, sizeof err);
    const float *lg = rc ? NULL : engine_logits(e);
    if (lg) memcpy(lg0, lg, (size_t)m->cfg.vocab * sizeof *lg0);
    *cached = engine_cached(e);
    for (int s = 0; lg && s < steps; s++) {
        tok[s] = argmax(lg, m->cfg.vocab);
        lg = engine_decode(e, tok[s], err, sizeof err) ? NULL : engine_logits(e);
    }
    if (!lg) {
        check(0, "prefix cache: a run of %d tokens: %s", n, rc ? err : "decode failed");
        engine_destroy(&e);
    }
    return e;
}

/* The GPU pool's pages: used by a sequence, cached, free (which must add up to the pool). */
static void pool_pages(const struct Model *m, struct KvPoolStats *st)
{
    kvpool_stats(model_gpu_pool(m), st);
    if (st->pages_used + st->pages_cached + st->pages_free != st->pages)
        check(0, "prefix cache: the pool's pages do not add up: %zu used, %zu cached, %zu free "
              "of %zu", st->pages_used, st->pages_cached, st->pages_free, st->pages);
}

/* The prefix cache of the GPU's pool: two prompts P and Q sharing their first 300 tokens (4
 * full pages) computed cold, on the pool without a cache that `go` loads, then on a pool of 12
 * pages with the cache: Q after P takes P's 4 pages and prefills the rest, P again after a
 * third prompt evicted the cached tail takes the head that is left; each warm run's logits and
 * greedy tokens against its cold run's (bit-exact on the host emulation computing each
 * product's rows alone, within bf16's error on a GPU, whose products may round a row
 * differently with another number of rows), and the pool's accounting throughout. The model
 * goes back to `go`'s pool. */
static void check_prefix(struct Model *m, const struct GpuModelOpts *go, const char *info,
                         const int32_t *prompt, int n)
{
    enum { NP = 330, NQ = 340, NR = 600, SHARED = 300, STEPS = 4 };
    int vocab = m->cfg.vocab, exact = strstr(info, "host emulation") != NULL;
    const char *rw = getenv("DIFFRAG_HOSTGPU_ROWWISE");
    char *rw_was = rw ? strdup(rw) : NULL;
    if (exact) setenv("DIFFRAG_HOSTGPU_ROWWISE", "1", 1);
    int32_t P[NP], Q[NQ], R[NR], tp[STEPS], tq[STEPS], wp[STEPS], wq[STEPS];
    for (int i = 0; i < NQ; i++) Q[i] = prompt[(i < SHARED ? i : i * 7) % n];
    for (int i = 0; i < NP; i++) P[i] = prompt[i % n];
    Q[SHARED] = (P[SHARED] + 1) % vocab;    /* their fifth pages differ */
    for (int i = 0; i < NR; i++) R[i] = prompt[(i * 5 + 1) % n];
    R[0] = (P[0] + 1) % vocab;
    float *lp = xmalloc((size_t)vocab * 4), *lq = xmalloc((size_t)vocab * 4),
          *wl = xmalloc((size_t)vocab * 4);
    int cp, cq, c2, cr, c3;
    struct Engine *ep = greedy_run(m, P, NP, STEPS, lp, &cp, tp);
    engine_destroy(&ep);
    struct Engine *eq = greedy_run(m, Q, NQ, STEPS, lq, &cq, tq);
    engine_destroy(&eq);
    check(cp == 0 && cq == 0, "prefix cache: a pool without it takes nothing (%d, %d positions)",
          cp, cq);
    char err[512];
    struct GpuModelOpts small = {.device = go->device, .kv_tokens = 12 * GPU_PAGE,
                                 .prefix_cache = 1};
    model_gpu_free(m);
    if (model_gpu_load(m, &small, err, sizeof err)) {
        check(0, "prefix cache: a pool of 12 pages: %s", err);
        goto out;
    }
    struct KvPoolStats st;
    /* P cold in the new pool (its 5 full prompt pages published), then Q beside it */
    ep = greedy_run(m, P, NP, STEPS, wl, &c2, wp);
    int same = ep && c2 == 0 && !memcmp(wl, lp, (size_t)vocab * 4) && !memcmp(wp, tp, sizeof tp);
    eq = ep ? greedy_run(m, Q, NQ, STEPS, wl, &cq, wq) : NULL;
    pool_pages(m, &st);
    double e = eq ? rel_err(wl, lq, (size_t)vocab) : INFINITY;
    int agree = 0;
    for (int s = 0; eq && s < STEPS; s++) agree += wq[s] == tq[s];
    check(eq && cq == 4 * GPU_PAGE && (exact ? e == 0 && agree == STEPS : e <= 5e-2 &&
                                                  agree >= STEPS - 1),
          "prefix cache: Q after P takes their 4 shared pages (%d positions) and prefills %d "
          "tokens: logits against Q's cold run %s %.2e, greedy tokens agree at %d of %d", cq,
          NQ - cq, exact ? "(bit-exact on the emulation computing rows alone)" : "(<= 5e-2)", e,
          agree, STEPS);
    check(same, "prefix cache: P alone in the pool with the cache equals its run without it");
    /* both held: P's 6 pages (5 of its prompt and its decode tokens') and Q's 2 of its own */
    check(st.pages_used == 8, "prefix cache: P and Q hold 8 distinct pages (the 4 shared once): "
          "%zu used", st.pages_used);
    engine_destroy(&ep);
    engine_destroy(&eq);
    pool_pages(m, &st);
    check(st.pages_used == 0 && st.pages_cached == 6 && st.pages_free == 6,
          "prefix cache: given back, their published prompt pages stay cached (P's 5 and Q's "
          "fifth): %zu cached, %zu free, %zu used", st.pages_cached, st.pages_free,
          st.pages_used);
    /* a third prompt of 10 pages: 6 free and 4 cached ones evicted, the oldest first */
    float *lr = xmalloc((size_t)vocab * 4);
    int32_t tr[STEPS];
    struct Engine *er = greedy_run(m, R, NR, 0, lr, &cr, tr);
    pool_pages(m, &st);
    check(er && cr == 0 && st.evicted_pages == 4 && st.pages_used == 10,
          "prefix cache: a prompt of %d tokens evicts 4 cached pages (%llu evicted, %zu used)",
          NR, (unsigned long long)st.evicted_pages, st.pages_used);
    engine_destroy(&er);
    free(lr);
    /* P again: the head of the shared prefix is left (a sequence gives its pages back last
     * first, so the tails went first) */
    ep = greedy_run(m, P, NP, STEPS, wl, &c3, wp);
    e = ep ? rel_err(wl, lp, (size_t)vocab) : INFINITY;
    agree = 0;
    for (int s = 0; ep && s < STEPS; s++) agree += wp[s] == tp[s];
    check(ep && c3 == 2 * GPU_PAGE && (exact ? e == 0 && agree == STEPS : e <= 5e-2 &&
                                                   agree >= STEPS - 1),
          "prefix cache: P after the eviction takes the 2 pages left of its prefix (%d "
          "positions): logits against its cold run %.2e, greedy tokens agree at %d of %d", c3, e,
          agree, STEPS);
    /* a sequence that starts over (the scheduler's preemption, a cancel) gives back every
     * reference it took */
    if (ep) engine_reset(ep);
    pool_pages(m, &st);
    check(st.pages_used == 0, "prefix cache: a reset sequence holds no page (%zu used)",
          st.pages_used);
    engine_destroy(&ep);
    model_gpu_free(m);
    if (model_gpu_load(m, go, err, sizeof err)) check(0, "prefix cache: reloading: %s", err);
out:
    if (rw_was) setenv("DIFFRAG_HOSTGPU_ROWWISE", rw_was, 1);
    else unsetenv("DIFFRAG_HOSTGPU_ROWWISE");
    free(rw_was);
    free(lp);
    free(lq);
    free(wl);
}

/* ---- 3. speed ---- */

static double median(double *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* One layer's attention over a whole causal sequence of n tokens (DIFF V2 shape of the
 * model), random bf16 queries and cache; TFLOP/s as 4 * heads * hd * n(n+1)/2 over the median
 * of several runs. With in_chunks > 0 the sequence runs as the engine's prefill runs it:
 * chunks of that many tokens, each attending to the cache before it and itself. The pages
 * hold `layers` layers (the middle one attended), 1 or the model's: with the model's, a
 * layer's pages are as far apart as in the engine's pool. */
static double time_attention_layout(const struct ModelConfig *c, int n, int diff, int kernel,
                                    int in_chunks, int layers)
{
    int hd = c->head_dim, nq_h = diff ? 2 * c->n_head : c->n_head, n_kv = c->n_kv_head;
    size_t pe = gpu_page_elems(layers, n_kv, hd);
    int pages = (n + GPU_PAGE - 1) / GPU_PAGE;
    uint16_t *pool = dalloc((size_t)pages * pe * 2), *q = dalloc(((size_t)n + GPU_QTILE) * nq_h * hd * 2);
    uint16_t *out = dalloc((size_t)n * nq_h * hd * 2);
    int32_t *pt = xmalloc((size_t)pages * 4), *dpt = dalloc((size_t)pages * 4);
    float *lam = dalloc((size_t)n * c->n_head * 4);
    for (int i = 0; i < pages; i++) pt[i] = i;
    A->upload(C, dpt, pt, (size_t)pages * 4);
    /* random bits as bf16 with a small exponent: 0x3c00..0x3fff and signs */
    size_t chunk = 1 << 20;
    uint16_t *rnd = xmalloc(chunk * 2);
    for (size_t i = 0; i < chunk; i++)
        rnd[i] = (uint16_t)(0x3c00 | ((uint16_t)(urand() * 32767) & 0x83ff));
    size_t pool_n = (size_t)pages * pe, q_n = ((size_t)n + GPU_QTILE) * nq_h * hd;
    for (size_t i = 0; i < pool_n; i += chunk) A->upload(C, pool + i, rnd, (pool_n - i < chunk ? pool_n - i : chunk) * 2);
    for (size_t i = 0; i < q_n; i += chunk) A->upload(C, q + i, rnd, (q_n - i < chunk ? q_n - i : chunk) * 2);
    A->fill_u16(C, (uint16_t *)lam, 0, (size_t)n * c->n_head * 2);
    struct GpuAttnArgs a = {
        .q = q, .out = out, .pool = pool, .pages = dpt, .page_elems = pe, .pool_pages = pages,
        .layer = layers / 2, .n_tok = n,
        .pos0 = 0, .n_q_head = nq_h, .n_kv_head = n_kv, .head_dim = hd,
        .scale = 1.f / sqrtf((float)hd), .lambda = diff ? lam : NULL, .lambda_stride = c->n_head,
        .kernel = kernel,
    };
    int step = in_chunks > 0 ? in_chunks : n;
    /* the chunks one after the other: chunk rows of q, out and lambda, keys up to its end */
    #define RUN_ALL()                                                                       \
        for (int p0 = 0; p0 < n; p0 += step) {                                              \
            struct GpuAttnArgs ca = a;                                                      \
            ca.pos0 = p0;                                                                   \
            ca.n_tok = n - p0 < step ? n - p0 : step;                                       \
            ca.q = q + (size_t)p0 * nq_h * hd;                                              \
            ca.out = out + (size_t)p0 * (diff ? nq_h / 2 : nq_h) * hd;                      \
            ca.lambda = diff ? lam + (size_t)p0 * c->n_head : NULL;                         \
            A->attention(C, &ca);                                                           \
        }
    RUN_ALL();
    dsync("attention warm-up");
    double t[7];
    int reps = n >= 65536 ? 3 : 7;
    for (int r = 0; r < reps; r++) {
        A->timer_start(C);
        RUN_ALL();
        t[r] = A->timer_stop(C);
    }
    #undef RUN_ALL
    dsync("attention timing");
    double flop = 4.0 * nq_h * hd * ((double)n * (n + 1) / 2);
    void *ptrs[] = {pool, q, out, dpt, lam};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++) A->free(C, ptrs[i]);
    free(pt);
    free(rnd);
    return flop / median(t, reps) / 1e12;
}

static double time_attention_chunked(const struct ModelConfig *c, int n, int diff, int kernel,
                                     int in_chunks)
{
    return time_attention_layout(c, n, diff, kernel, in_chunks, 1);
}

static double time_attention(const struct ModelConfig *c, int n, int diff, int kernel)
{
    return time_attention_chunked(c, n, diff, kernel, 0);
}

/* The row for attention as a 128K prefill runs it: its rate, and what all the model's layers
 * of it take, the attention's part of the time to first token. */
static void print_chunked(const struct ModelConfig *c, const char *kernel, double tflops)
{
    double flop = 4.0 * 2 * c->n_head * c->head_dim * (131072.0 * 131073.0 / 2);
    printf("| prefill attention (%s), DIFF V2 shape, 128K tokens in chunks of 8192 | %.1f TFLOP/s; "
           "%d layers: %.3f s |\n", kernel, tflops, c->n_layer, flop / (tflops * 1e12) * c->n_layer);
}

static double time_gemm(int n, int k, int m)
{
    uint16_t *x = dalloc((size_t)n * k * 2), *w = dalloc((size_t)m * k * 2);
    float *y = dalloc((size_t)n * m * 4);
    size_t chunk = 1 << 20;
    uint16_t *rnd = xmalloc(chunk * 2);
    for (size_t i = 0; i < chunk; i++) rnd[i] = gpu_f32_to_bf16(urand());
    for (size_t i = 0; i < (size_t)n * k; i += chunk) A->upload(C, x + i, rnd, ((size_t)n * k - i < chunk ? (size_t)n * k - i : chunk) * 2);
    for (size_t i = 0; i < (size_t)m * k; i += chunk) A->upload(C, w + i, rnd, ((size_t)m * k - i < chunk ? (size_t)m * k - i : chunk) * 2);
    A->gemm(C, x, n, k, w, m, y, m, 0.f);
    double t[9];
    for (int r = 0; r < 9; r++) {
        A->timer_start(C);
        A->gemm(C, x, n, k, w, m, y, m, 0.f);
        t[r] = A->timer_stop(C);
    }
    dsync("gemm timing");
    A->free(C, x);
    A->free(C, w);
    A->free(C, y);
    free(rnd);
    return 2.0 * n * k * m / median(t, 9) / 1e12;
}

/* What the prefill of one 8192-token chunk spends outside attention, operation by operation,
 * each timed alone (CUDA events, median of 5) at the model's shapes on random data: per layer,
 * in ms. The sum over the layers and chunks of a 128K prompt, set against the time to first
 * token less its attention, tells kernel time from launch gaps and host time. */
enum { OP_NORM, OP_QKV, OP_ROPE, OP_WO, OP_GU, OP_SWIGLU, OP_DOWN, N_OPS };
static const char *const op_name[N_OPS] = {"RMSNorm x2", "q|k|v(|lambda) product", "RoPE + KV store",
                                           "output product", "gate|up product", "SwiGLU",
                                           "down product"};

static void time_ops(const struct ModelConfig *c, int n, double ms[N_OPS])
{
    int d = c->dim, hd = c->head_dim, F = c->ffn_dim, diff = c->arch == ARCH_DIFFV2;
    int nq = c->n_q_head * hd, nkv = c->n_kv_head * hd, no = c->n_head * hd;
    int cols = nq + 2 * nkv + (diff ? c->n_head : 0), half = c->rope.n_rot / 2;
    size_t pe = gpu_page_elems(1, c->n_kv_head, hd);
    int pages = (n + GPU_PAGE - 1) / GPU_PAGE;
    float *x = dalloc((size_t)n * d * 4), *qkv = dalloc((size_t)n * cols * 4);
    float *gu = dalloc((size_t)n * 2 * F * 4), *nw = dalloc((size_t)d * 4);
    float *cs = dalloc((size_t)n * half * 4), *sn = dalloc((size_t)n * half * 4);
    int big = F > no ? F : no;
    big = big > d ? big : d;
    uint16_t *xb = dalloc((size_t)n * big * 2), *q = dalloc((size_t)n * nq * 2);
    int w_rows = cols > 2 * F ? cols : 2 * F;   /* the largest product's outputs */
    uint16_t *w = dalloc((size_t)w_rows * big * 2);
    uint16_t *pool = dalloc((size_t)pages * pe * 2);
    int32_t *pt = xmalloc((size_t)pages * 4), *dpt = dalloc((size_t)pages * 4);
    for (int i = 0; i < pages; i++) pt[i] = i;
    A->upload(C, dpt, pt, (size_t)pages * 4);
    /* small finite values everywhere (bf16 1/256 and f32 0.5): the rates do not depend on them */
    A->fill_u16(C, xb, 0x3b80, (size_t)n * big);
    A->fill_u16(C, w, 0x3b80, (size_t)w_rows * big);
    A->fill_u16(C, (uint16_t *)x, 0x3f00, (size_t)n * d * 2);
    A->fill_u16(C, (uint16_t *)qkv, 0x3f00, (size_t)n * cols * 2);
    A->fill_u16(C, (uint16_t *)gu, 0x3f00, (size_t)n * 2 * F * 2);
    A->fill_u16(C, (uint16_t *)nw, 0x3f00, (size_t)d * 2);
    A->fill_u16(C, (uint16_t *)cs, 0x3f00, (size_t)n * half * 2);
    A->fill_u16(C, (uint16_t *)sn, 0x3f00, (size_t)n * half * 2);
    struct GpuRopeArgs rs = {
        .qkv = qkv, .qkv_stride = cols, .q_out = q, .n_tok = n, .pos0 = 0, .n_q_head = c->n_q_head,
        .n_kv_head = c->n_kv_head, .head_dim = hd, .n_rot = c->rope.n_rot, .layout = c->rope.layout,
        .cos = cs, .sin = sn, .pool = pool, .pages = dpt, .page_elems = pe, .layer = 0,
    };
    for (int op = 0; op < N_OPS; op++) {
        double t[6];
        for (int r = 0; r < 6; r++) {
            A->timer_start(C);
            switch (op) {
            case OP_NORM:
                A->rmsnorm(C, x, d, nw, n, d, 1e-5f, xb);
                A->rmsnorm(C, x, d, nw, n, d, 1e-5f, xb);
                break;
            case OP_QKV: A->gemm(C, xb, n, d, w, cols, qkv, cols, 0.f); break;
            case OP_ROPE: A->rope_store(C, &rs); break;
            case OP_WO: A->gemm(C, xb, n, no, w, d, x, d, 1.f); break;
            case OP_GU: A->gemm(C, xb, n, d, w, 2 * F, gu, 2 * F, 0.f); break;
            case OP_SWIGLU: A->swiglu(C, gu, n, F, xb); break;
            default: A->gemm(C, xb, n, F, w, d, x, d, 1.f); break;
            }
            t[r] = A->timer_stop(C);
        }
        /* the first run is a warm-up */
        ms[op] = median(t + 1, 5) * 1e3;
    }
    dsync("operation timing");
    void *ptrs[] = {x, qkv, gu, nw, cs, sn, xb, q, w, pool, dpt};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++) A->free(C, ptrs[i]);
    free(pt);
}

/* Time to first token of an n-token prompt (random ids), chunks of 8192, with the device's
 * span of it (struct EngineStats.device_s); then decode tokens/s over `steps` steps at that
 * depth. */
static void time_model_dev(const struct Model *m, int n, int steps, double *ttft, double *dev,
                           double *tps)
{
    int n_ctx = n + steps + 8 < ENGINE_MAX_CTX ? n + steps + 8 : ENGINE_MAX_CTX;
    struct Engine *e = open_ctx(m, ENGINE_CUDA, n_ctx, 8192, 1);
    int32_t *ids = xmalloc((size_t)n * 4);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)((urand() + 1) * 0.5f * (m->cfg.vocab - 1));
    char err[512];
    /* warm-up: one chunk, then start over */
    if (engine_prefill(e, ids, n < 512 ? (size_t)n : 512, err, sizeof err)) goto fail;
    engine_reset(e);
    engine_stats_reset(e);
    double t0 = now_s();
    if (engine_prefill(e, ids, (size_t)n, err, sizeof err)) goto fail;
    *ttft = now_s() - t0;
    struct EngineStats st;
    engine_stats(e, &st);
    if (dev) *dev = st.device_s;
    int tok = argmax(engine_logits(e), m->cfg.vocab);
    t0 = now_s();
    for (int i = 0; i < steps; i++) {
        if (engine_decode(e, tok, err, sizeof err)) goto fail;
        tok = argmax(engine_logits(e), m->cfg.vocab);
    }
    *tps = steps ? steps / (now_s() - t0) : 0;
    free(ids);
    engine_destroy(&e);
    return;
fail:
    check(0, "timing %d tokens: %s", n, err);
    *ttft = *tps = NAN;
    if (dev) *dev = NAN;
    free(ids);
    engine_destroy(&e);
}

static void time_model(const struct Model *m, int n, int steps, double *ttft, double *tps)
{
    time_model_dev(m, n, steps, ttft, NULL, tps);
}

/* One sampled token with its signals after a decode step's logits (the default settings at
 * temperature 0.8: top-k 40, top-p 0.95, min-p 0.05): the pass on the device (engine_sample)
 * against the logits copied back and sampled on the host, interleaved, medians in ms. */
static void time_sampling(const struct Model *m, int steps, double *dev_ms, double *host_ms)
{
    struct Engine *e = open_ctx(m, ENGINE_CUDA, 64 + steps + 8, 256, 1);
    int32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = (int32_t)((urand() + 1) * 0.5f * (m->cfg.vocab - 1));
    char err[512];
    struct SamplerParams sp;
    sampler_params_default(&sp);
    sp.temperature = 0.8f;
    struct Sampler *sd, *sh;
    double *td = xmalloc((size_t)steps * sizeof *td), *th = xmalloc((size_t)steps * sizeof *th);
    if (sampler_new(&sp, m->cfg.vocab, &sd) || sampler_new(&sp, m->cfg.vocab, &sh)) exit(2);
    int rc = engine_prefill(e, ids, 64, err, sizeof err);
    for (int i = 0; i < steps && !rc; i++) {
        struct TokenSignal sig;
        int32_t tok;
        double t0 = now_s();
        rc = engine_sample(e, sd, &tok, &sig, err, sizeof err);
        double t1 = now_s();
        const float *lg = engine_logits(e);   /* the step's logits still on the device: copied */
        if (!lg) {
            snprintf(err, sizeof err, "the logits could not be read");
            rc = -1;
            break;
        }
        sampler_sample(sh, lg, &sig);
        th[i] = now_s() - t1;
        td[i] = t1 - t0;
        if (!rc) rc = engine_decode(e, tok, err, sizeof err);
    }
    if (rc) {
        check(0, "sampling timing: %s", err);
        exit(1);
    }
    *dev_ms = median(td, steps) * 1e3;
    *host_ms = median(th, steps) * 1e3;
    free(td);
    free(th);
    sampler_destroy(&sd);
    sampler_destroy(&sh);
    engine_destroy(&e);
}

/* Decode tokens/s of two models at the same depth, their steps interleaved so both see the
 * same machine: 1 / the median step time over `steps` steps each. Where watch[k] is set,
 * context k measures the default groundedness heads over a document span (the first half of
 * the prompt), as the daemon's contexts do. */
static void time_decode_pair(const struct Model *ma, const struct Model *mb, const int watch[2],
                             int depth, int steps, double *tps_a, double *tps_b)
{
    const struct Model *ms[2] = {ma, mb};
    struct Engine *e[2];
    int tok[2];
    double *t[2];
    char err[512];
    int32_t *ids = xmalloc((size_t)depth * 4);
    for (int i = 0; i < depth; i++) ids[i] = (int32_t)((urand() + 1) * 0.5f * (ma->cfg.vocab - 1));
    for (int k = 0; k < 2; k++) {
        e[k] = open_ctx(ms[k], ENGINE_CUDA, depth + steps + 8, 8192, 1);
        t[k] = xmalloc((size_t)steps * sizeof(double));
        if (watch && watch[k]) {
            struct AttnWatch w[ENGINE_MAX_WATCH];
            int nw = engine_default_watch(ms[k], w, ENGINE_MAX_WATCH);
            uint8_t *cls = xmalloc((size_t)depth);
            for (int i = 0; i < depth; i++) cls[i] = i < depth / 2;
            if (engine_watch(e[k], w, nw, err, sizeof err) ||
                engine_set_spans(e[k], cls, (size_t)depth, err, sizeof err)) {
                check(0, "decode timing: %s", err);
                exit(1);
            }
            free(cls);
        }
        if (engine_prefill(e[k], ids, (size_t)depth, err, sizeof err)) {
            check(0, "decode timing: %s", err);
            exit(1);
        }
        tok[k] = argmax(engine_logits(e[k]), ms[k]->cfg.vocab);
    }
    for (int i = 0; i < steps; i++)
        for (int k = 0; k < 2; k++) {
            double t0 = now_s();
            if (engine_decode(e[k], tok[k], err, sizeof err)) {
                check(0, "decode timing: %s", err);
                exit(1);
            }
            tok[k] = argmax(engine_logits(e[k]), ms[k]->cfg.vocab);
            t[k][i] = now_s() - t0;
        }
    *tps_a = 1.0 / median(t[0], steps);
    *tps_b = 1.0 / median(t[1], steps);
    for (int k = 0; k < 2; k++) {
        free(t[k]);
        engine_destroy(&e[k]);
    }
    free(ids);
}

/* Decode through the batch scheduler's step: `ns` member sequences of one context, each
 * prefilled to `depth` tokens, then `steps` steps of one token for every one of them; the
 * aggregate tokens/s (median step), against one of them stepping alone. */
static void time_batch_decode(const struct Model *m, int ns, int depth, int steps, double *tps_batch,
                              double *tps_one)
{
    enum { MAX_NS = 64 };
    if (ns > MAX_NS) ns = MAX_NS;
    /* (a step takes ns rows: the context's chunk, at most its length, must hold them) */
    int n_ctx = depth + steps + 8 > 2 * MAX_NS ? depth + steps + 8 : 2 * MAX_NS;
    struct Engine *r = open_ctx(m, ENGINE_CUDA, n_ctx, 8192, 1);
    struct Engine *seq[MAX_NS] = {0};
    struct EngineBatchItem it[MAX_NS];
    int32_t tok[MAX_NS];
    char err[512];
    int32_t *ids = xmalloc((size_t)depth * 4);
    double *tb = xmalloc((size_t)steps * sizeof(double)), *t1 = xmalloc((size_t)steps * sizeof(double));
    int rc = 0;
    for (int i = 0; i < ns && !rc; i++) {
        for (int j = 0; j < depth; j++) ids[j] = (int32_t)((urand() + 1) * 0.5f * (m->cfg.vocab - 1));
        rc = engine_new_seq(r, &seq[i], err, sizeof err);
        if (!rc) rc = engine_prefill(seq[i], ids, (size_t)depth, err, sizeof err);
        if (!rc) tok[i] = argmax(engine_logits(seq[i]), m->cfg.vocab);
    }
    for (int s = 0; s < steps && !rc; s++) {
        for (int pass = 0; pass < 2 && !rc; pass++) {
            int k = pass ? 1 : ns;
            for (int i = 0; i < k; i++) it[i] = (struct EngineBatchItem){seq[i], &tok[i], 1, 0, 1, 0};
            double t0 = now_s();
            rc = engine_step(r, it, k, NULL, err, sizeof err);
            for (int i = 0; i < k && !rc; i++) tok[i] = argmax(engine_logits(seq[i]), m->cfg.vocab);
            (pass ? t1 : tb)[s] = now_s() - t0;
        }
    }
    if (rc) {
        check(0, "batched decode timing: %s", err);
        *tps_batch = *tps_one = NAN;
    } else {
        *tps_batch = ns / median(tb, steps);
        *tps_one = 1.0 / median(t1, steps);
    }
    for (int i = 0; i < ns; i++) engine_destroy(&seq[i]);
    engine_destroy(&r);
    free(ids);
    free(tb);
    free(t1);
}

int main(int argc, char **argv)
{
    /* a line at a time: if a kernel hangs and run.sh's timeout stops this process, the output
     * so far still says where */
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *model_path = NULL;
    int do_time = 1, threads = 8, wgmma = 0, quick = 0, tma = 0, ops_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-time")) do_time = 0;
        else if (!strcmp(argv[i], "--quick")) quick = 1, do_time = 0;
        else if (!strcmp(argv[i], "--wgmma")) wgmma = 1;
        else if (!strcmp(argv[i], "--tma")) wgmma = tma = 1;
        else if (!strcmp(argv[i], "--ops")) ops_only = 1;
        else if (!strcmp(argv[i], "--dry-time")) shrink = 1024;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else model_path = argv[i];
    }
    if (shrink > 1) quick = 1, do_time = 1;     /* the quick checks, then the shrunken table */
    char err[512];
    double t0 = now_s();
    struct Model *m = NULL;
    struct DiffForm df;
    int32_t prompt[2048];
    size_t n = 0, got;
    if (model_path) {
        if (model_load(model_path, &m, err, sizeof err)) {
            printf("FAIL %s\n", err);
            return 1;
        }
        diff_form(m, &df);
        static const char text[] =
            "The Normans were the people who in the 10th and 11th centuries gave their name to "
            "Normandy, a region in France. They were descended from Norse raiders and pirates "
            "from Denmark, Iceland and Norway who, under their leader Rollo, agreed to swear "
            "fealty to King Charles III of West Francia. Through generations of assimilation "
            "and mixing with the native Frankish and Roman-Gaulish populations, their "
            "descendants would gradually merge with the Carolingian-based cultures of West "
            "Francia. ";
        while (n < (quick ? 200 : 600)) {
            tok_encode(m->tok, text, sizeof text - 1, 0, prompt + n, 2048 - n, &got);
            n += got;
        }
        /* the DIFF V2 form on the CPU reproduces the GQA form (exact up to rounding) */
        struct Engine *a = open_ctx(m, ENGINE_CPU, 1024, 256, threads);
        struct Engine *b = open_ctx(&df.m, ENGINE_CPU, 1024, 256, threads);
        size_t head = n < 300 ? n : 300;
        if (engine_prefill(a, prompt, head, err, sizeof err) ||
            engine_prefill(b, prompt, head, err, sizeof err)) {
            printf("FAIL %s\n", err);
            return 1;
        }
        double e = rel_err(engine_logits(b), engine_logits(a), (size_t)m->cfg.vocab);
        check(e <= 1e-4, "DIFF V2 form on the CPU against the GQA form: relative error %.2e "
              "(<= 1e-4)", e);
        engine_destroy(&a);
        engine_destroy(&b);
    }
    A = gpu_api_load(err, sizeof err);
    if (!A) {
        printf("FAIL %s\n", err);
        return 1;
    }
    int n_dev = A->device_count();
    if (n_dev < 1) {
        printf("FAIL no CUDA device is visible\n");
        return 1;
    }
    char info[256];
    A->device_info(0, info, sizeof info, NULL, NULL);
    printf("device 0: %s\nbackend: %s\n", info, A->build);
    if (wgmma && !strstr(info, "compute capability 9.0")) {
        printf("not a compute capability 9.0 device: the Hopper (wgmma) kernels cannot run "
               "here, nothing of theirs is checked\n");
        return 0;
    }
    if (A->ctx_new(0, &C, err, sizeof err)) {
        printf("FAIL %s\n", err);
        return 1;
    }
    if (ops_only) {
        /* --ops MODEL: only the operation times of one 8192-token chunk of its DIFF V2 form */
        if (!m) {
            printf("FAIL --ops needs a model\n");
            return 1;
        }
        double ops[N_OPS];
        time_ops(&df.m.cfg, 8192, ops);
        for (int i = 0; i < N_OPS; i++) printf("%-24s %8.3f ms\n", op_name[i], ops[i]);
        A->ctx_destroy(C);
        diff_form_free(&df);
        model_destroy(&m);
        return failures ? 1 : 0;
    }
    printf("-- operations against the CPU backend (fresh random inputs, outputs poisoned)\n");
    /* the kernels this run checks: the default and reference ones, or (--wgmma, --tma: each a
     * process of its own so that a fault there cannot spoil the others' results) a pair of
     * Hopper prefill kernels */
    int k_lo = tma ? 4 : wgmma ? 2 : 0, k_hi = wgmma ? k_lo + 2 : quick ? 1 : 2;
    if (wgmma) {
        check_wgmma_probe(64);
        check_wgmma_probe(128);
    } else {
        check_gemm(300, 576, 1000, 0.f);
        check_gemm(1, 576, 49152, 0.f);
        check_gemm(129, 1536, 576, 1.f);
        check_rows();
        check_sample(49152);
        check_sample(1000);
    }
    for (int kernel = k_lo; kernel < k_hi; kernel++) {
        check_attention(64, 9, 3, 0, 64, 1, kernel);
        check_attention(64, 9, 3, 1, 64, 1, kernel);
        check_attention(128, 8, 2, 1, 64, 0, kernel);
        check_attention(128, 4, 4, 0, 128, 1, kernel);
    }
    printf("(%.1f s)\n", now_s() - t0);

    if (m) {
        printf("-- %s end to end\n", model_path);
        struct GpuModelOpts go = {.device = 0, .kv_tokens = 140000};
        if (model_gpu_load(m, &go, err, sizeof err) || model_gpu_load(&df.m, &go, err, sizeof err)) {
            printf("FAIL %s\n", err);
            return 1;
        }
        size_t wb;
        int pages;
        model_gpu_info(m, &wb, &pages, NULL);
        printf("weights on the GPU: %.1f MiB; KV pool %d pages of %d positions\n",
               wb / 1048576.0, pages, GPU_PAGE);
        for (int k = k_lo; k < k_hi; k++) {
            char what[64];
            setenv("DIFFRAG_GPU_ATTENTION", gpu_attention_kernels[k], 1);
            snprintf(what, sizeof what, "GQA form, %s attention kernels", gpu_attention_kernels[k]);
            check_model(m, what, prompt, (int)n, threads);
            snprintf(what, sizeof what, "DIFF V2 form, %s attention kernels", gpu_attention_kernels[k]);
            check_model(&df.m, what, prompt, (int)n, threads);
        }
        unsetenv("DIFFRAG_GPU_ATTENTION");
        check_batch(m, "GQA form", prompt, (int)n);
        check_batch(&df.m, "DIFF V2 form", prompt, (int)n);
        check_prefix(m, &go, info, prompt, (int)n);
        printf("(%.1f s)\n", now_s() - t0);
        /* The speed figures open contexts of up to 131072 positions, past the training context
         * of the default model on purpose (times, not answers): a linear RoPE override says so
         * to the engine, which refuses longer contexts than a model serves (model_ctx.h). */
        int usable = model_usable_ctx(m);
        float stretch = (float)((ENGINE_MAX_CTX + usable - 1) / usable);
        if (do_time && stretch > 1.f &&
            (model_rope_override(m, "linear", stretch, 0, err, sizeof err) ||
             model_rope_override(&df.m, "linear", stretch, 0, err, sizeof err))) {
            printf("FAIL %s\n", err);
            return 1;
        }

        if (do_time && wgmma) {
            const struct ModelConfig *c = &m->cfg;
            printf("-- speed of the Hopper prefill kernels (as below)\n");
            double at[2][3], atg[2], atc[2], ttft[2][2], dummy;
            int ns[3] = {4096, 32768, 131072};
            for (int k = k_lo; k < k_hi; k++) {
                printf("timing %s\n", gpu_attention_kernels[k]);
                for (int i = 0; i < 3; i++) at[k - k_lo][i] = time_attention(c, ns[i], 1, k);
                atg[k - k_lo] = time_attention(c, 32768, 0, k);
                atc[k - k_lo] = time_attention_chunked(c, 131072, 1, k, 8192);
                setenv("DIFFRAG_GPU_ATTENTION", gpu_attention_kernels[k], 1);
                time_model(&df.m, 32768, 0, &ttft[k - k_lo][0], &dummy);
                time_model(&df.m, 131072, 0, &ttft[k - k_lo][1], &dummy);
                unsetenv("DIFFRAG_GPU_ATTENTION");
            }
            printf("\n| measure | value |\n|---|---|\n");
            for (int k = k_lo; k < k_hi; k++) {
                for (int i = 0; i < 3; i++)
                    printf("| prefill attention (%s), DIFF V2 shape (%d query heads / %d KV, hd %d), "
                           "%dK tokens causal | %.1f TFLOP/s |\n", gpu_attention_kernels[k],
                           2 * c->n_head, c->n_kv_head, c->head_dim, ns[i] / 1024, at[k - k_lo][i]);
                printf("| prefill attention (%s), GQA shape (%d / %d), 32K tokens | %.1f TFLOP/s |\n",
                       gpu_attention_kernels[k], c->n_head, c->n_kv_head, atg[k - k_lo]);
                print_chunked(c, gpu_attention_kernels[k], atc[k - k_lo]);
                printf("| time to first token, 32K / 128K prompt, DIFF V2 form, %s prefill | %.3f / %.3f s |\n",
                       gpu_attention_kernels[k], ttft[k - k_lo][0], ttft[k - k_lo][1]);
            }
        } else if (do_time) {
            const struct ModelConfig *c = &m->cfg;
            printf("-- speed (medians of CUDA-event timings; TTFT and decode by wall clock)\n");
            if (shrink > 1)
                printf("(--dry-time: every size divided by %d, the figures mean nothing)\n", shrink);
            double at[2][3], atg[2];
            const int K4 = 4096 / shrink, K8 = 8192 / shrink, K32 = 32768 / shrink, K128 = 131072 / shrink;
            int ns[3] = {K4, K32, K128};
            for (int k = 0; k < 2; k++) {
                for (int i = 0; i < 3; i++) at[k][i] = time_attention(c, ns[i], 1, k);
                atg[k] = time_attention(c, K32, 0, k);
            }
            double atc = time_attention_chunked(c, K128, 1, 0, K8);
            double atc_l = time_attention_layout(c, K128, 1, 0, K8, c->n_layer);
            double g1 = time_gemm(K8, 576, 3072), g2 = time_gemm(K8, K8, K8);
            double ttft32, ttft128, tps_diff, tps_gqa, ttft32g, dummy;
            time_model(&df.m, K32, 0, &ttft32, &dummy);
            double dev128, ops[N_OPS], ops_s = 0;
            time_model_dev(&df.m, K128, 0, &ttft128, &dev128, &dummy);
            time_model(m, K32, 0, &ttft32g, &dummy);
            time_ops(&df.m.cfg, K8, ops);
            for (int i = 0; i < N_OPS; i++) ops_s += ops[i] * 1e-3 * c->n_layer * 16;
            time_decode_pair(&df.m, m, NULL, K32, (shrink > 1 ? 2 : 256), &tps_diff, &tps_gqa);
            double tps_plain, tps_watched;
            const int watch_b[2] = {0, 1};
            time_decode_pair(&df.m, &df.m, watch_b, K32, (shrink > 1 ? 2 : 128), &tps_plain, &tps_watched);
            double tps_diff_ref, tps_gqa_ref;
            setenv("DIFFRAG_GPU_ATTENTION", "reference", 1);
            time_decode_pair(&df.m, m, NULL, K32, (shrink > 1 ? 2 : 128), &tps_diff_ref, &tps_gqa_ref);
            unsetenv("DIFFRAG_GPU_ATTENTION");
            double smp_dev, smp_host;
            time_sampling(m, (shrink > 1 ? 2 : 200), &smp_dev, &smp_host);
            double tps_b16, tps_b1;
            time_batch_decode(m, 16, K4, (shrink > 1 ? 2 : 64), &tps_b16, &tps_b1);
            printf("\n| measure | value |\n|---|---|\n");
            static const char *const timed[] = {"mma", "wmma"};
            for (int k = 0; k < 2; k++) {
                for (int i = 0; i < 3; i++)
                    printf("| prefill attention (%s), DIFF V2 shape (%d query heads / %d KV, hd %d), "
                           "%dK tokens causal | %.1f TFLOP/s |\n", timed[k],
                           2 * c->n_head, c->n_kv_head, c->head_dim, ns[i] / 1024, at[k][i]);
                printf("| prefill attention (%s), GQA shape (%d / %d), 32K tokens | %.1f TFLOP/s |\n",
                       timed[k], c->n_head, c->n_kv_head, atg[k]);
            }
            print_chunked(c, "mma", atc);
            printf("| the same in the engine's pool layout (pages of %d layers, so a layer's pages "
                   "%.2f MiB apart) | %.1f TFLOP/s |\n", c->n_layer,
                   gpu_page_elems(c->n_layer, c->n_kv_head, c->head_dim) * 2 / 1048576.0, atc_l);
            printf("| GEMM bf16 8192 x 576 -> 3072 (gate+up of the model) | %.1f TFLOP/s |\n", g1);
            printf("| GEMM bf16 8192 x 8192 x 8192 | %.1f TFLOP/s |\n", g2);
            printf("| time to first token, 32K prompt, DIFF V2 form | %.3f s |\n", ttft32);
            printf("| time to first token, 128K prompt, DIFF V2 form | %.3f s |\n", ttft128);
            printf("| time to first token, 32K prompt, GQA form | %.3f s |\n", ttft32g);
            printf("| time to first token, 128K prompt, DIFF V2 form: the device's span of it (events "
                   "around each chunk) | %.3f s |\n", dev128);
            printf("| one 8192-token chunk outside attention, a layer, each operation alone:");
            for (int i = 0; i < N_OPS; i++) printf("%s %s", i ? "," : "", op_name[i]);
            printf(" |");
            for (int i = 0; i < N_OPS; i++) printf("%s %.3f", i ? " /" : "", ops[i]);
            printf(" ms |\n");
            double att_s = 4.0 * 2 * c->n_head * c->head_dim * (131072.0 * 131073.0 / 2) /
                           (atc_l * 1e12) * c->n_layer;
            printf("| time to first token, 128K, DIFF V2 form, split: attention (the engine's layout, "
                   "above) / "
                   "the other operations (those times x %d layers x 16 chunks) / launch gaps and the "
                   "rest inside the device's span / host outside it | %.3f / %.3f / %.3f / %.3f s |\n",
                   c->n_layer, att_s, ops_s, dev128 - att_s - ops_s, ttft128 - dev128);
            printf("| decode at depth 32K, DIFF V2 form (median of 256 steps, interleaved with GQA's) "
                   "| %.1f tokens/s |\n", tps_diff);
            printf("| decode at depth 32K, GQA form | %.1f tokens/s |\n", tps_gqa);
            printf("| decode DIFF V2 / GQA | %.3f |\n", tps_diff / tps_gqa);
            printf("| decode at depth 32K, reference kernels: DIFF V2 / GQA | %.1f / %.1f tokens/s |\n",
                   tps_diff_ref, tps_gqa_ref);
            printf("| decode at depth 32K, DIFF V2 form: without / with the groundedness heads "
                   "measured (as the daemon runs; median of 128 interleaved) | %.1f / %.1f tokens/s |\n",
                   tps_plain, tps_watched);
            printf("| a sampled token with its signals (T 0.8, top-k 40): pass on the device / logits "
                   "copied and sampled on the host (median of 200) | %.3f / %.3f ms |\n", smp_dev,
                   smp_host);
            printf("| decode through the batch step at depth 4K, GQA form: 16 sequences in one step "
                   "(aggregate) / one alone (median of 64 steps; logits copied back) | %.1f / %.1f "
                   "tokens/s |\n", tps_b16, tps_b1);
        }
        diff_form_free(&df);
        model_destroy(&m);
    }
    A->ctx_destroy(C);
    printf("%s: %d failed checks (%.1f s)\n", failures ? "FAIL" : "PASS", failures, now_s() - t0);
    return failures ? 1 : 0;
}
