/* The forward pass on a GPU: the same steps as forward_step in model/engine_step.c, each one
 * operation of the GPU table over all the step's rows (RoPE, the KV store and attention once
 * per sequence of the step, over its own pages). The residual stream stays f32; the inputs
 * of products and attention are bf16. q, k, v and lambda come from one fused product, gate
 * and up from another, and the two residual adds are products accumulating into the stream
 * (beta = 1). */
#include "model/engine_gpu.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/gpu.h"
#include "kernels/gpu_plan.h"
#include "model/kvpool.h"

/* The device's candidates are copied straight into the sampler's. */
_Static_assert(sizeof(struct GpuCand) == sizeof(struct SampleCand) &&
               offsetof(struct GpuCand, id) == offsetof(struct SampleCand, id) &&
               offsetof(struct GpuCand, w) == offsetof(struct SampleCand, w) &&
               offsetof(struct GpuCand, logit) == offsetof(struct SampleCand, logit),
               "struct GpuCand and struct SampleCand differ");
_Static_assert(GPU_SAMPLE_GREEDY == (int)SAMPLE_GREEDY && GPU_SAMPLE_TOP_K == (int)SAMPLE_TOP_K &&
               GPU_SAMPLE_FLOOR == (int)SAMPLE_FLOOR && GPU_SAMPLE_MASS == (int)SAMPLE_MASS,
               "sampling modes differ");
/* The GPU pool's pages are named as the CPU pool's are, a page of KV_TILE positions at a time. */
_Static_assert(GPU_PAGE == KV_TILE, "a GPU page and a CPU page hold different positions");

struct GpuLayer {
    float *attn_norm, *ffn_norm;          /* (dim) f32 */
    uint16_t *wqkvl;                      /* (nq + 2 nkv + n_head_lambda, dim) */
    float *bqkv;                          /* (nq + 2 nkv) f32 q|k|v biases, or NULL (none) */
    uint16_t *wo;                         /* (dim, n_head * hd) */
    uint16_t *wgu;                        /* (2 ffn, dim): gate rows, then up rows */
    uint16_t *wdown;                      /* (dim, ffn) */
};

struct GpuModel {
    const struct GpuApi *api;
    struct GpuCtx *ctx;                   /* the context that uploaded (owns the allocations) */
    int device;
    char info[256];
    uint16_t *embd, *output;              /* (vocab, dim); output == embd when tied */
    float *output_norm;
    struct GpuLayer *layers;
    size_t weight_bytes;
    size_t page_elems;
    void *pool_mem;                       /* (n_pages, page_elems) bf16 */
    int n_pages;
    struct KvPool *pool;                  /* the pages' names and references (model/kvpool.h) */
};

struct GpuSeq {
    const struct Model *m;
    struct GpuModel *g;
    struct GpuCtx *ctx;                   /* its own, or (a batch member) its runner's */
    int own_ctx;
    int n_ctx, chunk, n_pages;            /* chunk 0: a batch member, no activations */
    int32_t *pages_h;                     /* the pages it holds, in position order */
    int32_t *pages;                       /* device page table */
    void *block;                          /* every activation, one allocation */
    float *x, *qkv, *gu, *cos, *sin, *logits, *lrows, *mass, *lam, *swork;
    struct GpuSampleHead *shead;          /* the sampling pass's head, then its candidates */
    uint16_t *xb, *q, *att, *h;
    int32_t *tok;
    uint8_t *cls;
    int qkv_stride;
    int kernel;                           /* GpuAttnArgs.kernel, from DIFFRAG_GPU_ATTENTION */
    double last_s;
};

static size_t up256(size_t n) { return (n + 255) & ~(size_t)255; }

static int qkv_cols(const struct ModelConfig *c)
{
    return (c->n_q_head + 2 * c->n_kv_head) * c->head_dim +
           (c->arch == ARCH_DIFFV2 ? c->n_head : 0);
}

/* Host bf16 copy of up to 3 matrices stacked by rows, then one upload. */
static int upload_stack(struct GpuModel *g, const struct Weights *const *w, int n, uint16_t **out,
                        char *err, size_t errlen)
{
    int rows = 0, cols = w[0]->cols;
    for (int i = 0; i < n; i++) rows += w[i]->rows;
    size_t elems = (size_t)rows * cols;
    uint16_t *host = malloc(elems * sizeof *host);
    float *row = malloc((size_t)cols * sizeof *row);
    if (!host || !row) {
        free(host);
        free(row);
        snprintf(err, errlen, "out of host memory converting weights");
        return -1;
    }
    size_t k = 0;
    for (int i = 0; i < n; i++)
        for (int r = 0; r < w[i]->rows; r++) {
            backend_cpu.weights_row(w[i], r, row);
            for (int j = 0; j < cols; j++) host[k++] = gpu_f32_to_bf16(row[j]);
        }
    free(row);
    int rc = g->api->alloc(g->ctx, elems * 2, (void **)out, err, errlen);
    if (rc == 0) {
        g->api->upload(g->ctx, *out, host, elems * 2);
        rc = g->api->sync(g->ctx, err, errlen);
        g->weight_bytes += elems * 2;
    }
    free(host);
    return rc;
}

static int upload_f32(struct GpuModel *g, const float *v, int n, float **out, char *err,
                      size_t errlen)
{
    if (g->api->alloc(g->ctx, (size_t)n * 4, (void **)out, err, errlen)) return -1;
    g->api->upload(g->ctx, *out, v, (size_t)n * 4);
    g->weight_bytes += (size_t)n * 4;
    return g->api->sync(g->ctx, err, errlen);
}

/* A layer's q, k and v biases as one vector in the fused product's column order (zeros for
 * a part without one); *out stays NULL when the layer has none. */
static int upload_bias(struct GpuModel *g, const struct ModelConfig *c,
                       const struct LayerWeights *w, float **out, char *err, size_t errlen)
{
    if (!w->bq && !w->bk && !w->bv) return 0;
    int nq = c->n_q_head * c->head_dim, nkv = c->n_kv_head * c->head_dim;
    float *host = calloc((size_t)(nq + 2 * nkv), sizeof *host);
    if (!host) {
        snprintf(err, errlen, "out of host memory converting weights");
        return -1;
    }
    if (w->bq) memcpy(host, w->bq, (size_t)nq * sizeof *host);
    if (w->bk) memcpy(host + nq, w->bk, (size_t)nkv * sizeof *host);
    if (w->bv) memcpy(host + nq + nkv, w->bv, (size_t)nkv * sizeof *host);
    int rc = upload_f32(g, host, nq + 2 * nkv, out, err, errlen);
    free(host);
    return rc;
}

void model_gpu_free(struct Model *m)
{
    struct GpuModel *g = m->gpu;
    if (!g) return;
    if (g->ctx) {
        const struct GpuApi *a = g->api;
        if (g->layers)
            for (int l = 0; l < m->cfg.n_layer; l++) {
                struct GpuLayer *L = &g->layers[l];
                a->free(g->ctx, L->attn_norm);
                a->free(g->ctx, L->ffn_norm);
                a->free(g->ctx, L->wqkvl);
                a->free(g->ctx, L->bqkv);
                a->free(g->ctx, L->wo);
                a->free(g->ctx, L->wgu);
                a->free(g->ctx, L->wdown);
            }
        if (g->output != g->embd) a->free(g->ctx, g->output);
        a->free(g->ctx, g->embd);
        a->free(g->ctx, g->output_norm);
        a->free(g->ctx, g->pool_mem);
        a->ctx_destroy(g->ctx);
    }
    kvpool_destroy(&g->pool);
    free(g->layers);
    free(g);
    m->gpu = NULL;
}

int model_gpu_load(struct Model *m, const struct GpuModelOpts *o, char *err, size_t errlen)
{
    if (m->gpu) return 0;
    const struct ModelConfig *c = &m->cfg;
    struct GpuAttnPlan plan;
    if (gpu_attn_plan(1, c->n_q_head, c->n_kv_head, c->head_dim, c->arch == ARCH_DIFFV2, &plan)) {
        snprintf(err, errlen, "the CUDA backend does not handle this model's attention shape "
                 "(%d query heads over %d KV heads of dimension %d; dimensions 64 and 128)",
                 c->n_q_head, c->n_kv_head, c->head_dim);
        return -1;
    }
    if (o->kv_tokens < 1) {
        snprintf(err, errlen, "the GPU KV pool needs a capacity of at least one position");
        return -1;
    }
    const struct GpuApi *api = gpu_api_load(err, errlen);
    if (!api) return -1;
    int n_dev = api->device_count();
    if (o->device < 0 || o->device >= n_dev) {
        snprintf(err, errlen, "no CUDA device %d (%d visible)", o->device, n_dev);
        return -1;
    }
    struct GpuModel *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m->gpu = g;
    g->api = api;
    g->device = o->device;
    api->device_info(o->device, g->info, sizeof g->info, NULL, NULL);
    g->layers = calloc((size_t)c->n_layer, sizeof *g->layers);
    if (!g->layers || api->ctx_new(o->device, &g->ctx, err, errlen)) goto fail;
    const struct Weights *e1[1] = {&m->tok_embd};
    if (upload_stack(g, e1, 1, &g->embd, err, errlen)) goto fail;
    if (m->output.data == m->tok_embd.data) {
        g->output = g->embd;
    } else {
        const struct Weights *o1[1] = {&m->output};
        if (upload_stack(g, o1, 1, &g->output, err, errlen)) goto fail;
    }
    if (upload_f32(g, m->output_norm, c->dim, &g->output_norm, err, errlen)) goto fail;
    for (int l = 0; l < c->n_layer; l++) {
        const struct LayerWeights *w = &m->layers[l];
        struct GpuLayer *L = &g->layers[l];
        const struct Weights *qkv[4] = {&w->wq, &w->wk, &w->wv, &w->wlambda};
        const struct Weights *gu[2] = {&w->w_gate, &w->w_up};
        const struct Weights *wo[1] = {&w->wo}, *wd[1] = {&w->w_down};
        if (upload_bias(g, c, w, &L->bqkv, err, errlen) ||
            upload_f32(g, w->attn_norm, c->dim, &L->attn_norm, err, errlen) ||
            upload_f32(g, w->ffn_norm, c->dim, &L->ffn_norm, err, errlen) ||
            upload_stack(g, qkv, c->arch == ARCH_DIFFV2 ? 4 : 3, &L->wqkvl, err, errlen) ||
            upload_stack(g, wo, 1, &L->wo, err, errlen) ||
            upload_stack(g, gu, 2, &L->wgu, err, errlen) ||
            upload_stack(g, wd, 1, &L->wdown, err, errlen))
            goto fail;
    }
    g->page_elems = gpu_page_elems(c->n_layer, c->n_kv_head, c->head_dim);
    long n_pages = (o->kv_tokens + GPU_PAGE - 1) / GPU_PAGE;
    if (n_pages > 1 << 24) n_pages = 1 << 24;
    g->n_pages = (int)n_pages;
    if (api->alloc(g->ctx, (size_t)n_pages * g->page_elems * 2, &g->pool_mem, err, errlen) ||
        kvpool_new_names(m, g->page_elems * 2, (size_t)n_pages, o->prefix_cache, &g->pool, err,
                         errlen))
        goto fail;
    return 0;
fail:
    if (!err[0]) snprintf(err, errlen, "out of memory");
    model_gpu_free(m);
    return -1;
}

const char *model_gpu_info(const struct Model *m, size_t *weight_bytes, int *pages,
                           int *free_pages)
{
    struct GpuModel *g = m->gpu;
    if (!g) return NULL;
    if (weight_bytes) *weight_bytes = g->weight_bytes;
    if (pages) *pages = g->n_pages;
    if (free_pages) {
        struct KvPoolStats st;
        kvpool_stats(g->pool, &st);
        *free_pages = (int)(st.pages - st.pages_used);
    }
    return g->info;
}

struct KvPool *model_gpu_pool(const struct Model *m) { return m->gpu ? m->gpu->pool : NULL; }

/* The activation block: sizes in bytes, each piece 256-byte aligned. Row counts of the
 * buffers attention reads by whole query tiles (q) are rounded up to GPU_QTILE. */
enum { B_X, B_QKV, B_GU, B_COS, B_LOGITS, B_LROWS, B_MASS, B_LAM, B_XB, B_Q, B_ATT, B_H, B_TOK,
       B_CLS, B_PAGES, B_SWORK, B_SHEAD, B_N };

/* Rows of the LM head's product in one go: the last positions of that many sequences of a
 * step (their logits then go to each sequence's own buffer). */
enum { GPU_STEP_LOGITS = 32 };

static void seq_layout(const struct ModelConfig *c, int n_ctx, int chunk, size_t off[B_N + 1])
{
    /* q is read by whole query tiles from any sequence's first row of a step: one tile more */
    size_t n = (size_t)chunk, np = n ? (n + GPU_QTILE - 1) / GPU_QTILE * GPU_QTILE + GPU_QTILE : 0;
    size_t lr = n < GPU_STEP_LOGITS ? n : GPU_STEP_LOGITS;
    size_t hd = (size_t)c->head_dim, nq = c->n_q_head * hd, no = c->n_head * hd;
    size_t wide = (size_t)c->dim > no ? (size_t)c->dim : no;
    size_t sz[B_N] = {
        [B_X] = n * c->dim * 4,
        [B_QKV] = n * qkv_cols(c) * 4,
        [B_GU] = n * 2 * c->ffn_dim * 4,
        [B_COS] = n * (c->rope.n_rot / 2) * 4 * 2,
        [B_LOGITS] = (size_t)c->vocab * 4,
        [B_LROWS] = lr * c->vocab * 4,
        [B_MASS] = (size_t)c->n_layer * c->n_q_head * 2 * 4,
        [B_LAM] = (size_t)c->n_layer * c->n_head * 4,
        [B_XB] = n * wide * 2,
        [B_Q] = np * nq * 2,
        [B_ATT] = n * no * 2,
        [B_H] = n * c->ffn_dim * 2,
        [B_TOK] = n * 4,
        [B_CLS] = (size_t)n_ctx,
        [B_PAGES] = (size_t)(n_ctx + GPU_PAGE - 1) / GPU_PAGE * 4,
        [B_SWORK] = (size_t)c->vocab * 4,
        [B_SHEAD] = sizeof(struct GpuSampleHead) + (size_t)c->vocab * sizeof(struct GpuCand),
    };
    off[0] = 0;
    for (int i = 0; i < B_N; i++) off[i + 1] = off[i] + up256(sz[i]);
}

void gpu_seq_estimate(const struct ModelConfig *c, int n_ctx, int chunk, size_t *kv_bytes,
                      size_t *scratch_bytes)
{
    size_t off[B_N + 1];
    if (chunk > n_ctx) chunk = n_ctx;
    seq_layout(c, n_ctx, chunk, off);
    *kv_bytes = (size_t)((n_ctx + GPU_PAGE - 1) / GPU_PAGE) *
                gpu_page_elems(c->n_layer, c->n_kv_head, c->head_dim) * 2;
    *scratch_bytes = off[B_N];
}

void gpu_seq_free(struct GpuSeq **ps)
{
    struct GpuSeq *s = *ps;
    if (!s) return;
    gpu_seq_release(s);
    if (s->ctx) {
        s->g->api->free(s->ctx, s->block);
        if (s->own_ctx) s->g->api->ctx_destroy(s->ctx);
    }
    free(s->pages_h);
    free(s);
    *ps = NULL;
}

const char *const gpu_attention_kernels[GPU_ATTENTION_KERNELS] = {
    "mma", "reference", "wgmma", "wgmma-pipe", "wgmma-tma", "wgmma-tma-pipe"};

/* The attention kernels DIFFRAG_GPU_ATTENTION names: the default (mma.sync), the Hopper
 * prefill (wgmma, its pipelined form, and both fed by TMA), or the first forms kept as a
 * cross-check. 0.. or -1 with err. */
static int attention_kernel(char *err, size_t errlen)
{
    const char *ak = getenv("DIFFRAG_GPU_ATTENTION");
    if (!ak || !*ak) return 0;
    for (int k = 0; k < GPU_ATTENTION_KERNELS; k++)
        if (!strcmp(ak, gpu_attention_kernels[k])) return k;
    snprintf(err, errlen, "DIFFRAG_GPU_ATTENTION=%.64s: expected mma, wgmma, wgmma-pipe, "
             "wgmma-tma, wgmma-tma-pipe or reference", ak);
    return -1;
}

const char *gpu_numerics(void)
{
    static char name[64];   /* one environment, so every call writes the same bytes */
    char err[256];
    int k = attention_kernel(err, sizeof err);
    snprintf(name, sizeof name, "cuda bf16 %s",
             k < 0 ? "(unknown attention kernel)" : gpu_attention_kernels[k]);
    return name;
}

/* A sequence on context ctx (owned when own_ctx), or on a new one when ctx is NULL; chunk 0
 * makes a batch member, without activations of its own. It holds no page yet. */
static int seq_make(const struct Model *m, struct GpuCtx *ctx, int n_ctx, int chunk,
                    struct GpuSeq **out, char *err, size_t errlen)
{
    *out = NULL;
    int kernel = attention_kernel(err, errlen);
    if (kernel < 0) return -1;
    struct GpuModel *g = m->gpu;
    if (!g) {
        snprintf(err, errlen, "the model is not on a GPU (model_gpu_load)");
        return -1;
    }
    const struct ModelConfig *c = &m->cfg;
    if (chunk > n_ctx) chunk = n_ctx;
    struct GpuSeq *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    s->m = m;
    s->g = g;
    s->n_ctx = n_ctx;
    s->chunk = chunk;
    s->pages_h = malloc((size_t)((n_ctx + GPU_PAGE - 1) / GPU_PAGE) * sizeof *s->pages_h);
    if (!s->pages_h) {
        free(s);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    const struct GpuApi *a = g->api;
    size_t off[B_N + 1];
    seq_layout(c, n_ctx, chunk, off);
    if (ctx) {
        s->ctx = ctx;
    } else if (a->ctx_new(g->device, &s->ctx, err, errlen)) {
        gpu_seq_free(&s);
        return -1;
    } else {
        s->own_ctx = 1;
    }
    if (a->alloc(s->ctx, off[B_N], &s->block, err, errlen)) {
        gpu_seq_free(&s);
        return -1;
    }
    char *b = s->block;
    s->x = (float *)(b + off[B_X]);
    s->qkv = (float *)(b + off[B_QKV]);
    s->gu = (float *)(b + off[B_GU]);
    s->cos = (float *)(b + off[B_COS]);
    s->sin = s->cos + (size_t)chunk * (c->rope.n_rot / 2);
    s->logits = (float *)(b + off[B_LOGITS]);
    s->lrows = (float *)(b + off[B_LROWS]);
    s->mass = (float *)(b + off[B_MASS]);
    s->lam = (float *)(b + off[B_LAM]);
    s->xb = (uint16_t *)(b + off[B_XB]);
    s->q = (uint16_t *)(b + off[B_Q]);
    s->att = (uint16_t *)(b + off[B_ATT]);
    s->h = (uint16_t *)(b + off[B_H]);
    s->tok = (int32_t *)(b + off[B_TOK]);
    s->cls = (uint8_t *)(b + off[B_CLS]);
    s->pages = (int32_t *)(b + off[B_PAGES]);
    s->swork = (float *)(b + off[B_SWORK]);
    s->shead = (struct GpuSampleHead *)(b + off[B_SHEAD]);
    s->qkv_stride = qkv_cols(c);
    s->kernel = kernel;
    /* the query rows past a step's rows are read by whole tiles: keep them finite */
    if (chunk) a->fill_u16(s->ctx, s->q, 0, (off[B_ATT] - off[B_Q]) / 2);
    if (a->sync(s->ctx, err, errlen)) {
        gpu_seq_free(&s);
        return -1;
    }
    *out = s;
    return 0;
}

int gpu_seq_new(const struct Model *m, int n_ctx, int chunk, struct GpuSeq **out, char *err,
                size_t errlen)
{
    return seq_make(m, NULL, n_ctx, chunk < 1 ? 1 : chunk, out, err, errlen);
}

int gpu_seq_new_member(struct GpuSeq *runner, struct GpuSeq **out, char *err, size_t errlen)
{
    return seq_make(runner->m, runner->ctx, runner->n_ctx, 0, out, err, errlen);
}

int gpu_seq_pages_needed(const struct GpuSeq *s, int n_pos)
{
    int need = (n_pos + GPU_PAGE - 1) / GPU_PAGE - s->n_pages;
    return need > 0 ? need : 0;
}

int gpu_seq_reserve(struct GpuSeq *s, int n_pos, char *err, size_t errlen)
{
    if (n_pos > s->n_ctx) {
        snprintf(err, errlen, "%d positions do not fit a %d-token context", n_pos, s->n_ctx);
        return -1;
    }
    int need = gpu_seq_pages_needed(s, n_pos);
    if (!need) return 0;
    if (kvpool_alloc_n(s->g->pool, need, s->pages_h + s->n_pages)) {
        int fr = 0;
        model_gpu_info(s->m, NULL, NULL, &fr);
        snprintf(err, errlen, "%d more KV pages (%.1f MiB) and the GPU pool has %d of %d free",
                 need, need * s->g->page_elems * 2 / 1048576.0, fr, s->g->n_pages);
        return -2;
    }
    s->g->api->upload(s->ctx, s->pages + s->n_pages, s->pages_h + s->n_pages, (size_t)need * 4);
    s->n_pages += need;
    return 0;
}

void gpu_seq_release(struct GpuSeq *s)
{
    kvpool_release(s->g->pool, s->pages_h, s->n_pages);
    s->n_pages = 0;
}

int gpu_seq_take_cached(struct GpuSeq *s, const int32_t *prompt, size_t n, int max_pages,
                        uint64_t *hashes)
{
    if (s->n_pages) return 0;
    int m = kvpool_match(s->g->pool, prompt, n, max_pages, s->pages_h, hashes);
    if (m) s->g->api->upload(s->ctx, s->pages, s->pages_h, (size_t)m * 4);
    s->n_pages = m;
    return m;
}

const int32_t *gpu_seq_pages(const struct GpuSeq *s, int *n)
{
    *n = s->n_pages;
    return s->pages_h;
}

int gpu_seq_set_spans(struct GpuSeq *s, const uint8_t *cls, size_t n, char *err, size_t errlen)
{
    if (!n) return 0;
    s->g->api->upload(s->ctx, s->cls, cls, n);
    return s->g->api->sync(s->ctx, err, errlen);
}

double gpu_seq_last_seconds(const struct GpuSeq *s) { return s->last_s; }

/* The rows of the segments that capture layer l (GpuStepSeg.cap): each one's last row of the
 * residual stream x as it enters layer l, downloaded in stream order (the copy sees x before
 * the layer changes it). */
static void capture_rows(void *x, const struct GpuApi *a, const struct GpuStepSeg *sg, int ns,
                         const float *rx, int d, int l)
{
    for (int i = 0, row = 0; i < ns; row += sg[i].n, i++)
        for (int j = 0; j < sg[i].n_cap; j++)
            if (sg[i].cap[j] == l)
                a->download(x, sg[i].hidden + (size_t)j * d, rx + (size_t)(row + sg[i].n - 1) * d,
                            (size_t)d * 4);
}

int gpu_seq_step(struct GpuSeq *r, const struct GpuStepSeg *sg, int ns, const float *cos,
                 const float *sin, char *err, size_t errlen)
{
    const struct Model *m = r->m;
    const struct ModelConfig *c = &m->cfg;
    const struct GpuApi *a = r->g->api;
    struct GpuCtx *x = r->ctx;
    struct GpuModel *g = r->g;
    int d = c->dim, hd = c->head_dim, nq = c->n_q_head * hd, nkv = c->n_kv_head * hd;
    int no = c->n_head * hd, F = c->ffn_dim, half = c->rope.n_rot / 2;
    int diff = c->arch == ARCH_DIFFV2;
    int n = 0;
    for (int i = 0; i < ns; i++) {
        const struct GpuStepSeg *q = &sg[i];
        if (!q->seq || q->seq->g != g || q->seq->ctx != x || q->n < 1 || q->pos0 < 0 ||
            q->pos0 + q->n > q->seq->n_ctx) {
            snprintf(err, errlen, "step segment %d: not a sequence of this context, or its "
                     "positions do not fit", i);
            return -1;
        }
        n += q->n;
    }
    if (ns < 1 || n > r->chunk) {
        snprintf(err, errlen, "a step of %d tokens in %d sequences; this context takes 1..%d "
                 "tokens", n, ns, r->chunk);
        return -1;
    }
    for (int i = 0; i < ns; i++) {
        int rc = gpu_seq_reserve(sg[i].seq, sg[i].pos0 + sg[i].n, err, errlen);
        if (rc) return rc;
    }
    a->timer_start(x);
    for (int i = 0, row = 0; i < ns; row += sg[i].n, i++)
        a->upload(x, r->tok + row, sg[i].tokens, (size_t)sg[i].n * 4);
    a->upload(x, r->cos, cos, (size_t)n * half * 4);
    a->upload(x, r->sin, sin, (size_t)n * half * 4);
    a->embed(x, g->embd, r->tok, n, d, r->x);
    for (int l = 0; l <= c->n_layer; l++) {
        capture_rows(x, a, sg, ns, r->x, d, l);
        if (l == c->n_layer) break;
        const struct GpuLayer *L = &g->layers[l];
        /* the products over every row of the step; RoPE and attention per sequence, over its
         * own pages */
        a->rmsnorm(x, r->x, d, L->attn_norm, n, d, c->norm_eps, r->xb);
        a->gemm(x, r->xb, n, d, L->wqkvl, r->qkv_stride, r->qkv, r->qkv_stride, 0.f);
        const float *lam_col = diff ? r->qkv + nq + 2 * nkv : NULL;
        for (int i = 0, row = 0; i < ns; row += sg[i].n, i++) {
            const struct GpuStepSeg *q = &sg[i];
            struct GpuSeq *s = q->seq;
            struct GpuRopeArgs rs = {
                .qkv = r->qkv + (size_t)row * r->qkv_stride, .qkv_stride = r->qkv_stride,
                .bias = L->bqkv, .q_out = r->q + (size_t)row * nq, .n_tok = q->n,
                .pos0 = q->pos0, .n_q_head = c->n_q_head, .n_kv_head = c->n_kv_head,
                .head_dim = hd, .n_rot = c->rope.n_rot, .layout = c->rope.layout,
                .cos = r->cos + (size_t)row * half, .sin = r->sin + (size_t)row * half,
                .pool = g->pool_mem, .pages = s->pages, .page_elems = g->page_elems, .layer = l,
            };
            a->rope_store(x, &rs);
            int watched = q->watch && q->watch[l];
            const float *lam_rows = lam_col ? lam_col + (size_t)row * r->qkv_stride : NULL;
            struct GpuAttnArgs at = {
                .q = r->q + (size_t)row * nq, .out = r->att + (size_t)row * no,
                .pool = g->pool_mem, .pages = s->pages, .page_elems = g->page_elems,
                .pool_pages = g->n_pages, .layer = l, .n_tok = q->n, .pos0 = q->pos0,
                .n_q_head = c->n_q_head, .n_kv_head = c->n_kv_head, .head_dim = hd,
                .scale = 1.f / sqrtf((float)hd), .lambda = lam_rows,
                .lambda_stride = r->qkv_stride, .cls = s->cls, .n_marked = q->n_marked,
                .mass = watched ? s->mass + (size_t)l * c->n_q_head * 2 : NULL,
                .kernel = r->kernel,
            };
            a->attention(x, &at);
            /* the next layer's product overwrites these lambdas: keep the last position's on
             * the device (a copy the host need not wait for) */
            if (watched && diff && q->lam)
                a->copy(x, s->lam + (size_t)l * c->n_head,
                        lam_rows + (size_t)(q->n - 1) * r->qkv_stride, (size_t)c->n_head * 4);
        }
        a->gemm(x, r->att, n, no, L->wo, d, r->x, d, 1.f);
        a->rmsnorm(x, r->x, d, L->ffn_norm, n, d, c->norm_eps, r->xb);
        a->gemm(x, r->xb, n, d, L->wgu, 2 * F, r->gu, 2 * F, 0.f);
        a->swiglu(x, r->gu, n, F, r->h);
        a->gemm(x, r->h, n, F, L->wdown, d, r->x, d, 1.f);
    }
    /* the LM head over the last positions of the sequences that want logits, up to
     * GPU_STEP_LOGITS rows in one product; each row then goes to its sequence */
    int lr = r->chunk < GPU_STEP_LOGITS ? r->chunk : GPU_STEP_LOGITS;
    int who[GPU_STEP_LOGITS], k = 0;
    for (int i = 0, row = 0; i <= ns; i++) {
        if (i < ns && sg[i].want_logits) {
            a->rmsnorm(x, r->x + (size_t)(row + sg[i].n - 1) * d, d, g->output_norm, 1, d,
                       c->norm_eps, r->xb + (size_t)k * d);
            who[k++] = i;
        }
        if (k && (k == lr || i == ns)) {
            a->gemm(x, r->xb, k, d, g->output, c->vocab, r->lrows, c->vocab, 0.f);
            for (int j = 0; j < k; j++)
                a->copy(x, sg[who[j]].seq->logits, r->lrows + (size_t)j * c->vocab,
                        (size_t)c->vocab * 4);
            k = 0;
        }
        if (i < ns) row += sg[i].n;
    }
    /* the watched layers' masses and lambdas in one copy each per sequence, after the last
     * layer (the other layers' entries come along unread) */
    for (int i = 0; i < ns; i++) {
        const struct GpuStepSeg *q = &sg[i];
        int any = 0;
        for (int l = 0; q->watch && l < c->n_layer; l++) any |= q->watch[l];
        if (q->mass && any)
            a->download(x, q->mass, q->seq->mass, (size_t)c->n_layer * c->n_q_head * 8);
        if (q->lam && any && diff)
            a->download(x, q->lam, q->seq->lam, (size_t)c->n_layer * c->n_head * 4);
    }
    r->last_s = a->timer_stop(x);
    return a->sync(x, err, errlen);
}

int gpu_seq_forward(struct GpuSeq *s, const int32_t *tokens, int n, int pos0, const float *cos,
                    const float *sin, const uint8_t *watch, int n_marked, int want_logits,
                    float *mass, float *lam, char *err, size_t errlen)
{
    struct GpuStepSeg one = {.seq = s, .tokens = tokens, .n = n, .pos0 = pos0, .watch = watch,
                             .n_marked = n_marked, .want_logits = want_logits, .mass = mass,
                             .lam = lam};
    return gpu_seq_step(s, &one, 1, cos, sin, err, errlen);
}

int gpu_seq_logits(struct GpuSeq *s, float *logits, char *err, size_t errlen)
{
    s->g->api->download(s->ctx, logits, s->logits, (size_t)s->m->cfg.vocab * 4);
    return s->g->api->sync(s->ctx, err, errlen);
}

int gpu_seq_sample(struct GpuSeq *s, const struct SampleKeep *k, struct SamplePass *p, char *err,
                   size_t errlen)
{
    const struct GpuApi *a = s->g->api;
    int n = s->m->cfg.vocab;
    struct GpuSampleArgs sa = {
        .logits = s->logits, .n = n, .mode = (int)k->mode, .inv_temp = k->inv_temp,
        .floor = k->floor, .mass = k->mass, .k = k->k, .work = s->swork, .head = s->shead,
    };
    a->sample(s->ctx, &sa);
    /* the head, with as many candidates as a top-k draw has (else the first 64), in one round
     * trip; more candidates (min-p or top-p over a flat distribution) in a second */
    const struct GpuCand *dc = (const struct GpuCand *)(s->shead + 1);
    int first = k->mode == SAMPLE_GREEDY ? 0 : k->mode == SAMPLE_TOP_K ? k->k : 64;
    if (first > n) first = n;
    struct GpuSampleHead h;
    a->download(s->ctx, &h, s->shead, sizeof h);
    if (first) a->download(s->ctx, p->cand, dc, (size_t)first * sizeof *dc);
    if (a->sync(s->ctx, err, errlen)) return -1;
    if (h.n_cand < 0 || h.n_cand > n || h.best < 0 || h.best >= n) {
        snprintf(err, errlen, "sampling pass returned %d candidates, best %d, of %d", h.n_cand,
                 h.best, n);
        return -1;
    }
    if (h.n_cand > first) {
        a->download(s->ctx, p->cand + first, dc + first, (size_t)(h.n_cand - first) * sizeof *dc);
        if (a->sync(s->ctx, err, errlen)) return -1;
    }
    p->best = h.best;
    p->n_cand = h.n_cand;
    p->mx = h.mx;
    p->second = h.second;
    p->z1 = h.z1;
    p->ez1 = h.ez1;
    p->zt = h.zt;
    return 0;
}

int engine_device_select(struct Model *m, const char *setting, long kv_tokens,
                         int prefix_cache, enum EngineDevice *out, char *note, size_t note_len)
{
    if (note_len) note[0] = 0;
    *out = ENGINE_CPU;
    if (!strcmp(setting, "cpu")) return 0;
    int want_cuda = !strcmp(setting, "cuda");
    if (!want_cuda && strcmp(setting, "auto")) {
        snprintf(note, note_len, "device must be auto, cpu or cuda, not \"%s\"", setting);
        return -1;
    }
    /* auto: no NVIDIA driver, no reason to load the CUDA libraries */
    if (!want_cuda && access("/proc/driver/nvidia/version", R_OK) != 0 &&
        access("/dev/nvidia0", F_OK) != 0) {
        snprintf(note, note_len, "no NVIDIA driver: computing on the CPU");
        return 0;
    }
    char err[512];
    struct GpuModelOpts o = {.device = 0, .kv_tokens = kv_tokens, .prefix_cache = prefix_cache};
    if (model_gpu_load(m, &o, err, sizeof err)) {
        if (want_cuda) {
            snprintf(note, note_len, "%s", err);
            return -1;
        }
        snprintf(note, note_len, "no usable GPU (%s): computing on the CPU", err);
        return 0;
    }
    *out = ENGINE_CUDA;
    size_t wb = 0;
    int pages = 0;
    const char *info = model_gpu_info(m, &wb, &pages, NULL);
    snprintf(note, note_len, "computing on %s; weights %.1f MiB, KV pool %d positions", info,
             wb / 1048576.0, pages * GPU_PAGE);
    return 0;
}
