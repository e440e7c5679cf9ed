/* The GPU table (kernels/gpu.h) carried out on the host, for tests on machines without a GPU:
 * every operation as its definition in kernels/gpu.h says, in plain C over host memory (the
 * products through OpenBLAS on bf16 inputs widened to f32). Built as
 * build/tests/libdiffrag_hostgpu.so and loaded in place of the CUDA backend through
 * DIFFRAG_CUDA_LIB, it lets `make test` drive everything above the kernels exactly as on a
 * GPU: the engine's GPU contexts (model/engine_gpu.c: page tables, the activation block, the
 * logits left on the device, sampling's pass and the candidates' copy, the masses and lambdas
 * copied after the last layer) and the GPU checks themselves (tests/gpu/gpu_check.c). It says
 * nothing about the CUDA kernels, which only tests/gpu/run.sh on a GPU checks.
 *
 * Memory from alloc is filled with 0xff bytes (a NaN in f32 and bf16), as a GPU's is not
 * cleared, so that reading what was never written shows; allocations over 64 MiB (the KV pool)
 * start zeroed instead, so that their untouched pages cost nothing. */
#include <cblas.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/gpu.h"
#include "kernels/gpu_plan.h"

struct GpuCtx {
    char err[256];
    double t0;
};

static void note(struct GpuCtx *c, const char *fmt, ...)
{
    if (c->err[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
}

static float bf(uint16_t h) { return gpu_bf16_to_f32(h); }
static uint16_t to_bf(float f) { return gpu_f32_to_bf16(f); }

static int device_count(void) { return 1; }

static int device_info(int dev, char *buf, size_t len, size_t *free_b, size_t *total_b)
{
    if (free_b) *free_b = (size_t)16 << 30;
    if (total_b) *total_b = (size_t)16 << 30;
    snprintf(buf, len, "host emulation of the GPU table (device %d; no GPU, no CUDA kernels)", dev);
    return 0;
}

static int ctx_new(int dev, struct GpuCtx **out, char *err, size_t errlen)
{
    *out = calloc(1, sizeof **out);
    if (!*out) {
        snprintf(err, errlen, "out of memory (emulated device %d)", dev);
        return -1;
    }
    return 0;
}

static void ctx_destroy(struct GpuCtx *c) { free(c); }

static int sync_ctx(struct GpuCtx *c, char *err, size_t errlen)
{
    if (!c->err[0]) return 0;
    snprintf(err, errlen, "emulated device: %s", c->err);
    c->err[0] = 0;
    return -1;
}

static int alloc(struct GpuCtx *c, size_t bytes, void **p, char *err, size_t errlen)
{
    (void)c;
    size_t n = bytes ? bytes : 1;
    *p = n > ((size_t)64 << 20) ? calloc(1, n) : malloc(n);
    if (!*p) {
        snprintf(err, errlen, "cannot allocate %zu bytes on the emulated device", bytes);
        return -1;
    }
    if (n <= ((size_t)64 << 20)) memset(*p, 0xff, n);
    return 0;
}

static void dfree(struct GpuCtx *c, void *p)
{
    (void)c;
    free(p);
}

static void copy_bytes(struct GpuCtx *c, void *dst, const void *src, size_t n)
{
    (void)c;
    memmove(dst, src, n);
}

static void fill_u16(struct GpuCtx *c, uint16_t *p, uint16_t v, size_t n)
{
    (void)c;
    for (size_t i = 0; i < n; i++) p[i] = v;
}

static void embed(struct GpuCtx *c, const uint16_t *table, const int32_t *tokens, int n, int d,
                  float *x)
{
    (void)c;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < d; i++) x[(size_t)t * d + i] = bf(table[(size_t)tokens[t] * d + i]);
}

static void rmsnorm(struct GpuCtx *c, const float *x, int x_stride, const float *w, int n, int d,
                    float eps, uint16_t *y)
{
    (void)c;
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * x_stride;
        float ss = 0.f;
        for (int i = 0; i < d; i++) ss += xr[i] * xr[i];
        float inv = 1.f / sqrtf(ss / d + eps);
        for (int i = 0; i < d; i++) y[(size_t)t * d + i] = to_bf(xr[i] * inv * w[i]);
    }
}

static void gemm(struct GpuCtx *c, const uint16_t *x, int n, int k, const uint16_t *w, int m,
                 float *y, int ldy, float beta)
{
    float *xf = malloc((size_t)n * k * sizeof *xf), *wf = malloc((size_t)m * k * sizeof *wf);
    if (!xf || !wf) {
        note(c, "gemm %d x %d x %d: out of host memory", n, m, k);
        free(xf);
        free(wf);
        return;
    }
    for (size_t i = 0; i < (size_t)n * k; i++) xf[i] = bf(x[i]);
    for (size_t i = 0; i < (size_t)m * k; i++) wf[i] = bf(w[i]);
    if (beta == 0.f)   /* what was there (unwritten memory included) does not count */
        for (int t = 0; t < n; t++) memset(y + (size_t)t * ldy, 0, (size_t)m * sizeof *y);
    /* DIFFRAG_HOSTGPU_ROWWISE=1: each row as its own product, so its rounding does not depend
     * on the rows beside it (the scheduler's batches then compute exactly what they would
     * alone, which its test compares); else one product, whose rounding may, as cuBLAS's */
    const char *rw = getenv("DIFFRAG_HOSTGPU_ROWWISE");
    if (rw && !strcmp(rw, "1"))
        for (int t = 0; t < n; t++)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, m, k, 1.f, wf, k, xf + (size_t)t * k, 1,
                        beta, y + (size_t)t * ldy, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.f, xf, k, wf, k, beta,
                    y, ldy);
    free(xf);
    free(wf);
}

/* The bf16 element of page row `pos`, kind 0 keys / 1 values, KV head g, dimension d. */
static uint16_t *kv_at(void *pool, const int32_t *pages, size_t page_elems, int layer, int kind,
                       int n_kv, int hd, int g, int pos)
{
    return (uint16_t *)pool + (size_t)pages[pos / GPU_PAGE] * page_elems +
           ((size_t)(layer * 2 + kind) * n_kv + g) * GPU_PAGE * hd + (size_t)(pos % GPU_PAGE) * hd;
}

static void rope_store(struct GpuCtx *c, const struct GpuRopeArgs *a)
{
    (void)c;
    int hd = a->head_dim, half = a->n_rot / 2, nq = a->n_q_head * hd;
    float *rot = malloc((size_t)hd * sizeof *rot);
    if (!rot) return;
    float *biased = malloc((size_t)hd * sizeof *biased);
    if (!biased) { free(rot); return; }
    for (int t = 0; t < a->n_tok; t++) {
        const float *row = a->qkv + (size_t)t * a->qkv_stride;
        const float *cs = a->cos + (size_t)t * half, *sn = a->sin + (size_t)t * half;
        for (int h = 0; h < a->n_q_head + 2 * a->n_kv_head; h++) {
            const float *x = row + (size_t)h * hd;
            if (a->bias) {
                for (int d = 0; d < hd; d++) biased[d] = x[d] + a->bias[(size_t)h * hd + d];
                x = biased;
            }
            int rotate = h < a->n_q_head + a->n_kv_head;
            for (int d = 0; d < hd; d++) {
                float v = x[d];
                if (rotate && d < a->n_rot) {
                    if (a->layout) {
                        if (d < half) v = x[d] * cs[d] - x[d + half] * sn[d];
                        else v = x[d - half] * sn[d - half] + x[d] * cs[d - half];
                    } else {
                        int i = d / 2;
                        if (d % 2 == 0) v = x[d] * cs[i] - x[d + 1] * sn[i];
                        else v = x[d - 1] * sn[i] + x[d] * cs[i];
                    }
                }
                rot[d] = v;
            }
            if (h < a->n_q_head) {
                for (int d = 0; d < hd; d++) a->q_out[(size_t)t * nq + (size_t)h * hd + d] = to_bf(rot[d]);
            } else {
                int kind = h < a->n_q_head + a->n_kv_head ? 0 : 1;
                int g = h - a->n_q_head - kind * a->n_kv_head;
                uint16_t *dst = kv_at(a->pool, a->pages, a->page_elems, a->layer, kind,
                                      a->n_kv_head, hd, g, a->pos0 + t);
                for (int d = 0; d < hd; d++) dst[d] = to_bf(rot[d]);
            }
        }
    }
    free(biased);
    free(rot);
}

static void attention(struct GpuCtx *c, const struct GpuAttnArgs *a)
{
    int hd = a->head_dim, nq = a->n_q_head * hd, group = a->n_q_head / a->n_kv_head;
    int diff = a->lambda != NULL, n_out = diff ? a->n_q_head / 2 : a->n_q_head;
    int n_keys = a->pos0 + a->n_tok;
    double *p = malloc((size_t)n_keys * sizeof *p), *o = malloc(2 * (size_t)hd * sizeof *o);
    if (!p || !o) {
        note(c, "attention: out of host memory");
        free(p);
        free(o);
        return;
    }
    for (int t = 0; t < a->n_tok; t++) {
        int pos = a->pos0 + t, last = t == a->n_tok - 1;
        for (int ho = 0; ho < n_out; ho++) {
            int per = diff ? 2 : 1;
            for (int k = 0; k < per; k++) {
                int h = ho * per + k, g = h / group;
                const uint16_t *q = a->q + (size_t)t * nq + (size_t)h * hd;
                double mx = -INFINITY;
                for (int j = 0; j <= pos; j++) {
                    const uint16_t *kr = kv_at((void *)a->pool, a->pages, a->page_elems, a->layer,
                                               0, a->n_kv_head, hd, g, j);
                    double s = 0;
                    for (int d = 0; d < hd; d++) s += (double)bf(q[d]) * bf(kr[d]);
                    p[j] = s * a->scale;
                    if (p[j] > mx) mx = p[j];
                }
                double z = 0, doc = 0, gen = 0;
                for (int j = 0; j <= pos; j++) {
                    p[j] = exp(p[j] - mx);
                    z += p[j];
                    if (j < a->n_marked && a->cls && a->cls[j] == 1) doc += p[j];
                    if (j >= a->n_marked) gen += p[j];
                }
                double *ok = o + (size_t)k * hd;
                for (int d = 0; d < hd; d++) ok[d] = 0;
                for (int j = 0; j <= pos; j++) {
                    const uint16_t *vr = kv_at((void *)a->pool, a->pages, a->page_elems, a->layer,
                                               1, a->n_kv_head, hd, g, j);
                    for (int d = 0; d < hd; d++) ok[d] += p[j] * bf(vr[d]);
                }
                for (int d = 0; d < hd; d++) ok[d] /= z;
                if (a->mass && last) {
                    a->mass[2 * h] = (float)(doc / z);
                    a->mass[2 * h + 1] = (float)(gen / z);
                }
            }
            double sg = diff ? 1.0 / (1.0 + exp(-(double)a->lambda[(size_t)t * a->lambda_stride + ho])) : 0;
            uint16_t *out = a->out + ((size_t)t * n_out + ho) * hd;
            for (int d = 0; d < hd; d++) out[d] = to_bf((float)(diff ? o[d] - sg * o[hd + d] : o[d]));
        }
    }
    free(p);
    free(o);
}

static void swiglu(struct GpuCtx *c, const float *gu, int n, int F, uint16_t *h)
{
    (void)c;
    for (int t = 0; t < n; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        for (int i = 0; i < F; i++) h[(size_t)t * F + i] = to_bf(g[i] / (1.f + expf(-g[i])) * u[i]);
    }
}

static int wgmma_probe(struct GpuCtx *c, int head_dim, const uint16_t *a, const uint16_t *page,
                       float *d_k, float *d_v)
{
    (void)c, (void)head_dim, (void)a, (void)page, (void)d_k, (void)d_v;
    return -1;   /* not a compute capability 9.0 device */
}

static float clean(float x) { return isnan(x) ? -INFINITY : x; }
static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* A sum over the kernel's 1024 threads in its order: each warp's 32 partial sums by a
 * butterfly, then the warps' results one after the other. */
#define SAMPLE_THREADS 1024
static double block_sum(const double *part)
{
    double r = 0;
    for (int w = 0; w < SAMPLE_THREADS / 32; w++) {
        double v[32], nv[32];
        memcpy(v, part + w * 32, sizeof v);
        for (int o = 16; o; o >>= 1) {
            for (int l = 0; l < 32; l++) nv[l] = v[l] + v[l ^ o];
            memcpy(v, nv, sizeof v);
        }
        r = w ? r + v[0] : v[0];
    }
    return r;
}

/* Sampling's pass as kernels/cuda/sample.cu makes it, its threads taken one after the other:
 * the sums in its order, the same radix select through gpu_radix_digit, the candidates in its
 * order. tests/test_sampler.c draws from these candidates against the host sampler. */
static void sample(struct GpuCtx *c, const struct GpuSampleArgs *a)
{
    int n = a->n;
    if (n < 1 || n > GPU_SAMPLE_MAX_N || (a->mode == GPU_SAMPLE_TOP_K && (a->k < 1 || a->k > n))) {
        note(c, "sample: %d logits, mode %d, k %d not handled", n, a->mode, a->k);
        return;
    }
    const float *x = a->logits;
    float mx = -INFINITY, second = -INFINITY;
    for (int i = 0; i < n; i++) mx = fmaxf(mx, clean(x[i]));
    int best = 0;
    for (int i = 0; i < n && mx > -INFINITY; i++)
        if (clean(x[i]) == mx) { best = i; break; }
    int sampling = a->mode != GPU_SAMPLE_GREEDY && mx > -INFINITY;
    double *p1 = malloc(3 * SAMPLE_THREADS * sizeof *p1), *pe = p1 + SAMPLE_THREADS,
           *pt = pe + SAMPLE_THREADS;
    if (!p1) {
        note(c, "sample: out of host memory");
        return;
    }
    for (int t = 0; t < SAMPLE_THREADS; t++) {
        p1[t] = pe[t] = pt[t] = 0;
        for (int i = t; i < n && mx > -INFINITY; i += SAMPLE_THREADS) {
            float v = clean(x[i]), d = v - mx, e = expf(d);
            if (i != best) second = fmaxf(second, v);
            p1[t] += e;
            pe[t] += e > 0.f ? (double)e * d : 0.0;
            if (sampling) {
                a->work[i] = expf(d * a->inv_temp);
                pt[t] += a->work[i];
            }
        }
    }
    double z1 = block_sum(p1), ez1 = block_sum(pe), zt = block_sum(pt);
    free(p1);
    struct GpuCand *cand = (struct GpuCand *)(a->head + 1);
    int m = 0;
    if (sampling) {
        uint32_t kv = bits(a->floor);
        float ties = INFINITY;
        if (a->mode == GPU_SAMPLE_TOP_K || a->mode == GPU_SAMPLE_MASS) {
            int count = a->mode == GPU_SAMPLE_TOP_K;
            uint32_t prefix = 0, mask = 0;
            float want = count ? (float)a->k : a->mass * (float)zt;
            for (int shift = 32 - GPU_RADIX_BITS; shift >= 0; shift -= GPU_RADIX_BITS) {
                float hist[GPU_RADIX] = {0}, above;
                for (int i = 0; i < n; i++)
                    if ((bits(a->work[i]) & mask) == prefix)
                        hist[(bits(a->work[i]) >> shift) & (GPU_RADIX - 1)] += count ? 1.f : a->work[i];
                int d = gpu_radix_digit(hist, want, &above);
                want -= above;
                prefix |= (uint32_t)d << shift;
                mask |= (uint32_t)(GPU_RADIX - 1) << shift;
            }
            kv = prefix;
            if (count) ties = want;
        }
        int n_gt = 0, n_eq = 0;
        for (int i = 0; i < n; i++) n_gt += bits(a->work[i]) > kv, n_eq += bits(a->work[i]) == kv;
        int take = (float)n_eq <= ties ? n_eq : (int)ties, eq = 0;
        for (int i = 0; i < n; i++) {
            uint32_t b = bits(a->work[i]);
            if (b > kv) cand[m++] = (struct GpuCand){i, a->work[i], clean(x[i])};
        }
        for (int i = 0; i < n && eq < take; i++)
            if (bits(a->work[i]) == kv) cand[n_gt + eq++] = (struct GpuCand){i, a->work[i], clean(x[i])};
        m = n_gt + take;
    }
    *a->head = (struct GpuSampleHead){best, m, mx, second, z1, ez1, zt};
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void timer_start(struct GpuCtx *c) { c->t0 = now_s(); }
static double timer_stop(struct GpuCtx *c) { return now_s() - c->t0; }

static const struct GpuApi api = {
    .version = GPU_API_VERSION,
    .build = "host emulation (tests/gpu/host_gpu.c; no CUDA)",
    .device_count = device_count,
    .device_info = device_info,
    .ctx_new = ctx_new,
    .ctx_destroy = ctx_destroy,
    .sync = sync_ctx,
    .alloc = alloc,
    .free = dfree,
    .upload = copy_bytes,
    .download = copy_bytes,
    .copy = copy_bytes,
    .fill_u16 = fill_u16,
    .embed = embed,
    .rmsnorm = rmsnorm,
    .gemm = gemm,
    .rope_store = rope_store,
    .attention = attention,
    .swiglu = swiglu,
    .wgmma_probe = wgmma_probe,
    .sample = sample,
    .timer_start = timer_start,
    .timer_stop = timer_stop,
};

__attribute__((visibility("default"))) const struct GpuApi *diffrag_gpu_api(void);
const struct GpuApi *diffrag_gpu_api(void) { return &api; }
