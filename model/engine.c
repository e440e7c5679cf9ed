/* The forward pass over one sequence context: embedding, per layer RMSNorm -> attention (GQA
 * or DIFF V2; q, k and v biases where the model has them) -> residual -> RMSNorm -> SwiGLU
 * -> residual, final norm and LM head for the last position only. Chunked: activation memory is bounded by the chunk, not the context.
 * Each step is one backend call over the whole chunk, with the elementwise work fused into
 * the products (q/k/v/lambda in one job, residual adds as accumulating products, SwiGLU in
 * the gate/up job) so the chunk's activations are swept as few times as possible. */
#include "model/engine.h"
#include "model/engine_gpu.h"
#include "model/kvpool.h"
#include "model/model_ctx.h"
#include "model/sampler.h"
#include "text/errmsg.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


struct Scratch {
    float *x;      /* (chunk, dim) residual stream */
    float *xb;     /* (chunk, dim) normed input */
    float *q;      /* (chunk, n_q_head*hd) */
    float *k, *v;  /* (chunk, n_kv_head*hd) */
    float *att;    /* (chunk, n_head*hd) attention output (diffv2 heads already combined) */
    float *lam;    /* (chunk, n_head) diffv2 lambda logits */
    float *h;      /* (chunk, ffn) SwiGLU activations */
    float *cos, *sin; /* (chunk, n_rot/2) */
    float *logits; /* (vocab) */
    void *mm;      /* matrix-product panels for every thread */
    void *attn;    /* attention tiles and partial states for every thread */
};

struct Engine {
    struct Engine *runner;    /* whose threads and scratch compute this sequence (itself, or
                                 the context engine_new_seq was given) */
    float *logits;            /* (vocab) the last logits: s.logits, or a sequence's own */
    float *step_logits;       /* runner: the logits rows of a step with several sequences */
    int step_logits_rows;
    const struct Model *m;
    const struct Backend *be;
    struct EngineOpts opts;
    struct ThreadPool *pool;
    /* CPU: the sequence's KV pages (model/kvpool.h) */
    struct KvPool *kv;
    int own_kv;               /* the pool is this context's own */
    struct KvPoolLayout lay;
    int32_t *pages;           /* (pages for n_ctx) page of each tile; n_pages taken */
    uint64_t *page_hash;      /* names of the pages published or taken from the cache */
    int n_pages;
    int n_named;              /* pages [0, n_named) are named (cached or published) */
    int named_ok;             /* 0 once a page could not be published: later ones cannot be */
    int prefill_end;          /* positions [0, prefill_end) were written by prefills */
    int n_cached;             /* positions taken from the prefix cache */
    int32_t *tok;             /* (n_ctx) the sequence's tokens */
    float *block;             /* all scratch */
    struct Scratch s;
    double *inv_freq;         /* (n_rot/2) RoPE frequencies after scaling */
    float rope_mscale;
    int n_past;
    int rope_offset;          /* RoPE positions are the cache's plus this
                                 (engine_set_rope_offset) */
    struct EngineStats stats;
    atomic_int cancel;
    /* a blend's probe (engine_blend): the attention its rows give the region, summed */
    struct BlendProbe *probe;
    struct Blend *blend;      /* a blend in progress (engine_blend_begin) */
    /* groundedness signals: watched heads, position classes, masses of the last position */
    struct AttnWatch *watch;  /* (n_watch) in the caller's order */
    int n_watch;
    int *wq;                  /* query heads to measure, grouped by layer: wq[wq_off[l]..] */
    int *wq_watch;            /* for each, the watch it belongs to */
    int *wq_off;              /* (n_layer + 1) */
    float *wq_mass;           /* (total query heads, 2) */
    struct AttnMass *mass;    /* (n_watch) */
    int mass_valid;
    uint8_t *cls;             /* (n_ctx) position classes */
    int n_marked;
    void *mass_scratch;
    /* residual-stream capture (engine_capture): layers, and their rows at the last position */
    int cap_layer[ENGINE_MAX_CAPTURE];
    int n_cap;
    float *hidden;            /* (n_cap, dim) */
    int hidden_valid;
    /* GPU contexts: the device sequence, and the host side of its masses */
    struct GpuSeq *gpu;
    float *gpu_mass;          /* (n_layer, n_q_head, 2) */
    float *gpu_lam;           /* (n_layer, n_head) */
    uint8_t *gpu_watch;       /* (n_layer) layers with watched heads */
    struct SampleCand *gpu_cand; /* (vocab) sampling candidates from the device */
    int logits_on_host;       /* GPU: s.logits holds the last logits (else only the device) */
    char gpu_err[256];        /* the last device error */
};

const char *engine_numerics(void)
{
    return backend_cpu.numerics();
}

const char *engine_strerror(int s)
{
    switch (s) {
    case ENGINE_OK: return "ok";
    case ENGINE_EINPUT: return "invalid input";
    case ENGINE_EBUDGET: return "over the memory budget";
    case ENGINE_ENOMEM: return "out of memory";
    case ENGINE_ECTX: return "context full";
    case ENGINE_ECANCELLED: return "cancelled";
    case ENGINE_EDEVICE: return "GPU error";
    }
    return "unknown engine error";
}

void engine_opts_default(struct EngineOpts *o)
{
    o->n_ctx = 8192;
    o->chunk = 512;
    o->kv_type = KV_F16;
    o->mem_budget = 0;
    o->n_threads = 2;
    o->device = ENGINE_CPU;
    o->kv_pool = NULL;
}

static int max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Scratch layout in bytes (64-byte aligned pieces); returns the total and fills pointers when
 * s != NULL. */
static size_t scratch_layout(const struct ModelConfig *c, const struct EngineOpts *o,
                             const struct Backend *be, char *base, struct Scratch *s)
{
    size_t n = (size_t)o->chunk, hd = (size_t)c->head_dim, off = 0;
    int k_max = max3(c->dim, c->ffn_dim, c->n_head * c->head_dim);
    size_t sz[12] = {
        n * c->dim, n * c->dim,
        n * c->n_q_head * hd, n * c->n_kv_head * hd, n * c->n_kv_head * hd,
        n * c->n_head * hd,
        c->arch == ARCH_DIFFV2 ? n * c->n_head : 0,
        n * c->ffn_dim,
        n * (c->rope.n_rot / 2) * 2,
        (size_t)c->vocab,
        0, 0,
    };
    for (int i = 0; i < 10; i++) sz[i] *= sizeof(float);
    sz[10] = be->matmul_scratch(o->chunk, k_max, o->n_threads);
    sz[11] = be->attention_scratch(o->chunk, o->n_ctx, c->head_dim, c->n_q_head, c->n_kv_head,
                                   o->n_threads);
    void **dst[12] = {0};
    if (s) {
        void **d[12] = {(void **)&s->x, (void **)&s->xb, (void **)&s->q, (void **)&s->k,
                        (void **)&s->v, (void **)&s->att, (void **)&s->lam, (void **)&s->h,
                        (void **)&s->cos, (void **)&s->logits, &s->mm, &s->attn};
        memcpy(dst, d, sizeof d);
    }
    for (int i = 0; i < 12; i++) {
        if (s) *dst[i] = base + off;
        off += (sz[i] + 63) & ~(size_t)63;
    }
    if (s) s->sin = s->cos + n * (c->rope.n_rot / 2);
    return off;
}

/* GPU contexts keep on the host only the RoPE tables, the logits (when asked for), the
 * sampling candidates and the masses. */
static size_t gpu_host_bytes(const struct ModelConfig *c, const struct EngineOpts *o)
{
    return (size_t)o->chunk * (c->rope.n_rot / 2) * 2 * sizeof(float) +
           (size_t)c->vocab * (sizeof(float) + sizeof(struct SampleCand)) +
           (size_t)c->n_layer * (c->n_q_head * 2 + c->n_head) * sizeof(float) + c->n_layer +
           (size_t)(c->rope.n_rot / 2 + 1) * sizeof(double) + (size_t)o->n_ctx;
}

void engine_estimate(const struct Model *m, const struct EngineOpts *o, struct EngineMemory *out)
{
    const struct ModelConfig *c = &m->cfg;
    const struct Backend *be = &backend_cpu;
    out->kv_bytes = kvpool_pages_for(o->n_ctx) * kvpool_page_bytes(c, o->kv_type);
    struct EngineOpts eff = *o;
    if (eff.chunk > eff.n_ctx) eff.chunk = eff.n_ctx;
    if (o->device == ENGINE_CUDA) {
        gpu_seq_estimate(c, eff.n_ctx, eff.chunk, &out->kv_bytes, &out->scratch_bytes);
        out->scratch_bytes += gpu_host_bytes(c, &eff);
        out->context_bytes = out->kv_bytes + out->scratch_bytes;
        out->weight_bytes = model_weight_bytes(m);
        return;
    }
    out->scratch_bytes = scratch_layout(c, &eff, be, NULL, NULL) +
                         (size_t)(c->rope.n_rot / 2 + 1) * sizeof(double) +
                         be->attention_mass_scratch(eff.n_ctx, c->head_dim, c->n_q_head,
                                                    c->n_kv_head, eff.n_threads) +
                         (size_t)eff.n_ctx;
    out->context_bytes = out->kv_bytes + out->scratch_bytes;
    out->weight_bytes = model_weight_bytes(m);
}

static void rope_init(struct Engine *e)
{
    const struct RopeConfig *r = &e->m->cfg.rope;
    int half = r->n_rot / 2;
    double low = 0, high = 0;
    if (r->scaling == ROPE_SCALING_YARN) {
        double two_ln_base = 2.0 * log(r->base);
        double cf = r->n_rot * log(r->orig_ctx / (r->beta_fast * 2 * M_PI)) / two_ln_base;
        double cs = r->n_rot * log(r->orig_ctx / (r->beta_slow * 2 * M_PI)) / two_ln_base;
        low = floor(cf) > 0 ? floor(cf) : 0;
        high = ceil(cs) < r->n_rot - 1 ? ceil(cs) : r->n_rot - 1;
        if (high == low) high += 0.001;
    }
    for (int i = 0; i < half; i++) {
        double theta = pow(r->base, -2.0 * i / r->n_rot);
        switch (r->scaling) {
        case ROPE_SCALING_NONE: e->inv_freq[i] = theta; break;
        case ROPE_SCALING_LINEAR: e->inv_freq[i] = theta / r->factor; break;
        case ROPE_SCALING_YARN: {
            double ramp = (i - low) / (high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double ext = 1.0 - ramp;
            e->inv_freq[i] = theta / r->factor * (1 - ext) + theta * ext;
            break;
        }
        }
    }
    e->rope_mscale = r->scaling == ROPE_SCALING_YARN ? r->attn_factor : 1.f;
}

/* A GPU context: the device sequence, and host memory for the RoPE tables, logits and masses
 * (laid out as the CPU scratch's cos, sin and logits so the shared code reads them alike).
 * With a runner, a member of its batches (engine_new_seq): the runner's steps compute its
 * tokens, so it keeps only the logits and the masses. */
static int gpu_engine_new(struct Engine *e, struct Engine *runner, char *err, size_t errlen)
{
    const struct ModelConfig *c = &e->m->cfg;
    int rc = runner ? gpu_seq_new_member(runner->gpu, &e->gpu, err, errlen)
                    : gpu_seq_new(e->m, e->opts.n_ctx, e->opts.chunk, &e->gpu, err, errlen);
    if (rc) return rc == -2 ? ENGINE_EBUDGET : ENGINE_EDEVICE;
    size_t half = (size_t)(c->rope.n_rot / 2), rows = runner ? 0 : (size_t)e->opts.chunk;
    e->block = malloc((rows * half * 2 + (size_t)c->vocab) * sizeof(float));
    e->inv_freq = calloc(half + 1, sizeof(double));
    e->cls = calloc((size_t)e->opts.n_ctx, 1);
    e->wq_off = calloc((size_t)c->n_layer + 1, sizeof *e->wq_off);
    e->gpu_mass = calloc((size_t)c->n_layer * c->n_q_head * 2, sizeof(float));
    e->gpu_lam = calloc((size_t)c->n_layer * c->n_head, sizeof(float));
    e->gpu_watch = calloc((size_t)c->n_layer, 1);
    e->gpu_cand = malloc((size_t)c->vocab * sizeof *e->gpu_cand);
    if (!e->block || !e->inv_freq || !e->cls || !e->wq_off || !e->gpu_mass || !e->gpu_lam ||
        !e->gpu_watch || !e->gpu_cand)
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory");
    e->s.cos = e->block;
    e->s.sin = e->s.cos + rows * half;
    e->s.logits = e->s.sin + rows * half;
    e->runner = runner ? runner : e;
    e->logits = e->s.logits;
    rope_init(e);
    atomic_init(&e->cancel, 0);
    return ENGINE_OK;
}

int engine_new(const struct Model *m, const struct EngineOpts *o, struct Engine **out,
               char *err, size_t errlen)
{
    *out = NULL;
    if (!m || !o || o->n_ctx < 1 || o->n_ctx > ENGINE_MAX_CTX || o->chunk < 1 ||
        o->n_threads < 1 || o->n_threads > 256 || (unsigned)o->kv_type > KV_Q8 ||
        (o->device != ENGINE_CPU && o->device != ENGINE_CUDA))
        return errmsg_set(err, errlen, ENGINE_EINPUT,
                    "invalid engine options: ctx must be 1..%d, chunk >= 1, threads 1..256",
                    ENGINE_MAX_CTX);
    if (o->kv_type == KV_Q8 && (m->cfg.head_dim % 2 || m->cfg.head_dim > 256))
        return errmsg_set(err, errlen, ENGINE_EINPUT,
                    "the int8 KV cache needs an even head dimension of at most 256 (this model: %d)",
                    m->cfg.head_dim);
    if (o->device == ENGINE_CUDA && o->kv_type == KV_Q8)
        return errmsg_set(err, errlen, ENGINE_EINPUT,
                    "the int8 KV cache is the CPU backend's; the CUDA backend keeps bf16");
    struct EngineOpts opts = *o;
    if (opts.chunk > opts.n_ctx) opts.chunk = opts.n_ctx;
    struct EngineMemory mem;
    engine_estimate(m, &opts, &mem);
    if (opts.mem_budget && mem.context_bytes > opts.mem_budget)
        return errmsg_set(err, errlen, ENGINE_EBUDGET,
                    "a %d-token context needs %zu bytes (%.1f MiB: KV %.1f MiB + activations "
                    "%.1f MiB), over the budget of %zu bytes (%.1f MiB)",
                    opts.n_ctx, mem.context_bytes, mem.context_bytes / 1048576.0,
                    mem.kv_bytes / 1048576.0, mem.scratch_bytes / 1048576.0, opts.mem_budget,
                    opts.mem_budget / 1048576.0);
    if (model_ctx_check(&m->cfg, opts.n_ctx, err, errlen)) return ENGINE_ECTX;

    struct Engine *e = calloc(1, sizeof *e);
    if (!e) return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory");
    e->m = m;
    e->be = &backend_cpu;
    e->opts = opts;
    const struct ModelConfig *c = &m->cfg;
    if (opts.device == ENGINE_CUDA) {
        int rc = gpu_engine_new(e, NULL, err, errlen);
        if (rc != ENGINE_OK) {
            engine_destroy(&e);
            return rc;
        }
        *out = e;
        return ENGINE_OK;
    }
    size_t max_pages = kvpool_pages_for(opts.n_ctx);
    if (opts.kv_pool) {
        e->kv = opts.kv_pool;
    } else {
        int rc = kvpool_new(m, opts.kv_type, max_pages, 1, &e->kv, err, errlen);
        if (rc) {
            engine_destroy(&e);
            return rc;
        }
        e->own_kv = 1;
    }
    kvpool_layout(e->kv, &e->lay);
    if (e->lay.kv_type != opts.kv_type) {
        engine_destroy(&e);
        return errmsg_set(err, errlen, ENGINE_EINPUT, "the KV pool holds another KV type");
    }
    e->pages = malloc(max_pages * sizeof *e->pages);
    e->page_hash = malloc(max_pages * sizeof *e->page_hash);
    e->tok = malloc((size_t)opts.n_ctx * sizeof *e->tok);
    size_t nb = scratch_layout(c, &opts, e->be, NULL, NULL);
    e->block = aligned_alloc(64, (nb + 63) & ~(size_t)63);
    e->inv_freq = calloc((size_t)(c->rope.n_rot / 2) + 1, sizeof(double));
    e->mass_scratch = malloc(e->be->attention_mass_scratch(opts.n_ctx, c->head_dim, c->n_q_head,
                                                           c->n_kv_head, opts.n_threads));
    e->cls = calloc((size_t)opts.n_ctx, 1);
    e->wq_off = calloc((size_t)c->n_layer + 1, sizeof *e->wq_off);
    if (!e->pages || !e->page_hash || !e->tok || !e->block || !e->inv_freq || !e->mass_scratch || !e->cls || !e->wq_off ||
        pool_new(opts.n_threads, &e->pool) != 0) {
        engine_destroy(&e);
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "cannot allocate %zu bytes for the context",
                    mem.context_bytes);
    }
    scratch_layout(c, &opts, e->be, (char *)e->block, &e->s);
    e->runner = e;
    e->logits = e->s.logits;
    rope_init(e);
    atomic_init(&e->cancel, 0);
    *out = e;
    return ENGINE_OK;
}

static void blend_free(struct Engine *e);

void engine_destroy(struct Engine **pe)
{
    struct Engine *e = *pe;
    if (!e) return;
    blend_free(e);
    if (e->kv) kvpool_release(e->kv, e->pages, e->n_pages);
    if (e->runner != e && !e->gpu) {
        /* a sequence of engine_new_seq: the runner's threads and scratch are not its own */
        free(e->logits);
        e->pool = NULL;
        e->block = NULL;
        e->inv_freq = NULL;
        e->mass_scratch = NULL;
    }
    pool_destroy(&e->pool);
    free(e->step_logits);
    if (e->own_kv) kvpool_destroy(&e->kv);
    free(e->pages);
    free(e->page_hash);
    free(e->tok);
    gpu_seq_free(&e->gpu);
    free(e->gpu_mass);
    free(e->gpu_lam);
    free(e->gpu_watch);
    free(e->gpu_cand);
    free(e->block);
    free(e->inv_freq);
    free(e->mass_scratch);
    free(e->cls);
    free(e->wq_off);
    free(e->watch);
    free(e->wq);
    free(e->wq_watch);
    free(e->wq_mass);
    free(e->mass);
    free(e->hidden);
    free(e);
    *pe = NULL;
}

/* cos and sin of (pos0 + t) * inv_freq[i] for n positions, in double precision, times YaRN's
 * magnitude factor, into cs and sn (n_rot/2 a position). The angle of position p = 32a + b is
 * split as 32a f + b f and recombined by the addition formulas, so a chunk of n tokens needs (n / 32 + 32) evaluations
 * of each function per frequency instead of n: an 8,192-token chunk took 5.4 ms here, now
 * 1.7 ms, time a GPU prefill waits for. The split depends on the position only, not on where
 * the chunk starts, so a position's values are the same whatever chunk it falls in (which the
 * prefix cache and batching rely on). The two ways round the angle differently, by up to
 * |angle| * 1.1e-16 (1.4e-11 at 131,072 positions), against an f32 result's 6e-8. */
static void rope_rows(const struct Engine *e, int n, int pos0, float *cs, float *sn)
{
    enum { B = 32 };
    int half = e->m->cfg.rope.n_rot / 2;
    float ms = e->rope_mscale;
    for (int i = 0; i < half; i++) {
        double f = e->inv_freq[i], cb[B], sb[B];
        for (int b = 0; b < B; b++) {
            cb[b] = cos(b * f);
            sb[b] = sin(b * f);
        }
        for (int t = 0; t < n;) {
            int p = pos0 + t, a = p / B * B;
            double phi = (double)a * f, ca = cos(phi), sa = sin(phi);
            for (int b = p - a; b < B && t < n; b++, t++) {
                size_t k = (size_t)t * half + i;
                cs[k] = (float)((ca * cb[b] - sa * sb[b]) * ms);
                sn[k] = (float)((sa * cb[b] + ca * sb[b]) * ms);
            }
        }
    }
}

/* The tables of n positions from pos0 into rows row0.. of the scratch's. */
static void rope_tables(struct Engine *e, int n, int pos0, int row0)
{
    size_t half = (size_t)(e->m->cfg.rope.n_rot / 2);
    rope_rows(e, n, pos0, e->s.cos + (size_t)row0 * half, e->s.sin + (size_t)row0 * half);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double matmul_flop(const struct MatmulArgs *a)
{
    double f = 0;
    for (int i = 0; i < a->n_out; i++) f += 2.0 * a->n * a->k * a->out[i].w->rows;
    return f;
}

static void run_matmul(struct Engine *e, const struct MatmulArgs *a)
{
    double t = now_s();
    e->be->matmul(e->pool, a, e->s.mm);
    e->stats.matmul_s += now_s() - t;
    e->stats.matmul_flop += matmul_flop(a);
}

static void fill_masses(struct Engine *e, int l, const float *lam_row);
static void probe_layer(struct Engine *e, int r0, int sn, const int32_t *qpos, int pos0,
                        const void *kc);

/* The watched heads of layer l at the last position of the sequence's n tokens in this step,
 * step row `row` (its queries are in s->q after RoPE, its keys already in the cache kc). */
static void measure_layer(struct Engine *e, int l, int row, int n, const void *kc)
{
    const struct KvPoolLayout *lay = &e->lay;
    const struct ModelConfig *c = &e->m->cfg;
    int b = e->wq_off[l], nh = e->wq_off[l + 1] - b;
    struct MassArgs ma = {
        .q = e->s.q + (size_t)row * c->n_q_head * c->head_dim, .k = kc,
        .kv_head_stride = lay->head_stride, .pages = e->pages, .page_stride = lay->page_stride,
        .kv_type = e->opts.kv_type,
        .n_keys = e->n_past + n, .n_q_head = c->n_q_head, .n_kv_head = c->n_kv_head,
        .head_dim = c->head_dim, .scale = 1.f / sqrtf((float)c->head_dim), .cls = e->cls,
        .n_marked = e->n_marked, .heads = e->wq + b, .n_heads = nh, .mass = e->wq_mass + 2 * b,
    };
    e->be->attention_mass(e->pool, &ma, e->mass_scratch);
    fill_masses(e, l, e->s.lam + (size_t)row * c->n_head);
}

/* The AttnMass entries of layer l's watched heads from their query heads' masses in wq_mass
 * and the position's lambda logits (DIFF V2). */
static void fill_masses(struct Engine *e, int l, const float *lam_row)
{
    const struct ModelConfig *c = &e->m->cfg;
    int b = e->wq_off[l], nh = e->wq_off[l + 1] - b;
    int diff = c->arch == ARCH_DIFFV2;
    for (int i = b; i < b + nh; i += diff ? 2 : 1) {
        struct AttnMass *o = &e->mass[e->wq_watch[i]];
        const float *m1 = e->wq_mass + 2 * i;
        memset(o, 0, sizeof *o);
        o->doc = m1[0];
        o->gen = m1[1];
        if (!diff) {
            o->diff_doc = o->doc;
            o->diff_gen = o->gen;
            continue;
        }
        const float *m2 = m1 + 2;
        double lam = lam_row[e->wq[i] / 2];
        double sg = 1.0 / (1.0 + exp(-lam)), rest = 1.0 - sg;
        if (rest < 1e-7) rest = 1e-7;
        o->doc2 = m2[0];
        o->gen2 = m2[1];
        o->sig = (float)sg;
        o->diff_doc = (float)((m1[0] - sg * m2[0]) / rest);
        o->diff_gen = (float)((m1[1] - sg * m2[1]) / rest);
    }
}

/* rows[t][0..len) += bias for the chunk's n rows (qwen2's q, k and v); nothing when NULL. A
 * pass over the chunk's q, k and v, small beside the product that wrote them. */
static void add_bias(float *rows, size_t len, int n, const float *bias)
{
    if (!bias) return;
    for (int t = 0; t < n; t++) {
        float *r = rows + (size_t)t * len;
        for (size_t i = 0; i < len; i++) r[i] += bias[i];
    }
}

/* Pages for positions up to end - 1. ENGINE_EBUDGET with err when the pool has none left. */
static int take_pages(struct Engine *e, int end, char *err, size_t errlen)
{
    if (e->gpu) {
        int rc = gpu_seq_reserve(e->gpu, end, e->gpu_err, sizeof e->gpu_err);
        return rc == 0 ? ENGINE_OK
                       : errmsg_set(err, errlen, rc == -2 ? ENGINE_EBUDGET : ENGINE_ECTX, "%s",
                                    e->gpu_err);
    }
    int need = (int)kvpool_pages_for(end);
    while (e->n_pages < need) {
        if (kvpool_alloc(e->kv, &e->pages[e->n_pages]))
            return errmsg_set(err, errlen, ENGINE_EBUDGET,
                              "the KV pool has no free page: every page is in use by a sequence");
        e->n_pages++;
    }
    return ENGINE_OK;
}

/* Publishes the full pages that prefills wrote, in order, for later prompts. */
static void publish_pages(struct Engine *e)
{
    int full = e->prefill_end / KV_TILE;
    for (; e->n_named < full; e->n_named++) {
        int i = e->n_named;
        const int32_t *t = e->tok + (size_t)i * KV_TILE;
        uint64_t h = kvpool_chain_hash(e->kv, i ? e->page_hash[i - 1] : 0, t);
        e->page_hash[i] = h;
        kvpool_publish(e->kv, e->pages[i], i ? e->pages[i - 1] : -1, h, t);
    }
}

/* A step's share of one sequence: n tokens at its positions n_past.., rows row0.. of the
 * step's activations. prefill: prompt tokens (the rowwise form, published pages); else one
 * decode token. */
struct StepSeg {
    struct Engine *e;
    const int32_t *tokens;
    int n, prefill, want_logits, row0;
    int pos0;                 /* CPU: the first token's position (forward_step: n_past) */
    const int32_t *qpos;      /* CPU: when non-NULL, row t's position (increasing), not pos0 + t */
    int quiet;                /* CPU: 1 = no masses measured (a blend's recomputed rows) */
    int probe;                /* CPU: 1 = the rows are a blend's probe (e->probe) */
};

/* A step on the GPU (runner r's device sequence computes every segment's rows; see
 * gpu_seq_step), the masses copied back for the watched layers. On a failure every segment's
 * context holds the device's error. */
static int forward_step_gpu(struct Engine *r, struct StepSeg *segs, int ns)
{
    enum { MAX_SEGS = 256 };
    const struct ModelConfig *c = &r->m->cfg;
    double t_start = now_s();
    struct GpuStepSeg gs[MAX_SEGS];
    int n = 0;
    if (ns > MAX_SEGS) ns = MAX_SEGS;
    for (int i = 0; i < ns; i++) {
        struct Engine *e = segs[i].e;
        segs[i].row0 = n;
        rope_tables(r, segs[i].n, e->n_past, n);
        for (int l = 0; l < c->n_layer; l++) e->gpu_watch[l] = e->wq_off[l + 1] > e->wq_off[l];
        gs[i] = (struct GpuStepSeg){.seq = e->gpu, .tokens = segs[i].tokens, .n = segs[i].n,
                                    .pos0 = e->n_past, .watch = e->gpu_watch,
                                    .n_marked = e->n_marked, .want_logits = segs[i].want_logits,
                                    .mass = e->gpu_mass, .lam = e->gpu_lam,
                                    .cap = e->cap_layer, .n_cap = e->n_cap, .hidden = e->hidden};
        n += segs[i].n;
    }
    int rc = gpu_seq_step(r->gpu, gs, ns, r->s.cos, r->s.sin, r->gpu_err, sizeof r->gpu_err);
    if (rc) {
        for (int i = 0; i < ns; i++)
            if (segs[i].e != r)
                snprintf(segs[i].e->gpu_err, sizeof segs[i].e->gpu_err, "%s", r->gpu_err);
        return rc == -2 ? ENGINE_EBUDGET : ENGINE_EDEVICE;
    }
    for (int i = 0; i < ns; i++) {
        struct Engine *e = segs[i].e;
        if (segs[i].want_logits) e->logits_on_host = 0;
        for (int l = 0; l < c->n_layer; l++) {
            if (!e->gpu_watch[l]) continue;
            for (int j = e->wq_off[l]; j < e->wq_off[l + 1]; j++) {
                const float *src = e->gpu_mass + ((size_t)l * c->n_q_head + e->wq[j]) * 2;
                e->wq_mass[2 * j] = src[0];
                e->wq_mass[2 * j + 1] = src[1];
            }
            fill_masses(e, l, e->gpu_lam + (size_t)l * c->n_head);
        }
        for (int t = 0; t < segs[i].n; t++)
            r->stats.attention_flop += 4.0 * (e->n_past + t + 1) * c->head_dim * c->n_q_head *
                                       c->n_layer;
        e->n_past += segs[i].n;
        e->mass_valid = e->n_watch > 0;
        e->hidden_valid = e->n_cap > 0;
    }
    r->stats.device_s += gpu_seq_last_seconds(r->gpu);
    r->stats.total_s += now_s() - t_start;
    r->stats.tokens += n;
    return ENGINE_OK;
}

/* The step's products: the prefill rows [0, np) through the many-row products (each row's
 * arithmetic independent of the others), the decode rows [np, n) each as its own one-row
 * product, so a batched token computes exactly what it would alone. */
static void step_matmul(struct Engine *r, struct MatmulArgs *a, int np)
{
    int n = a->n;
    float *y0[4] = {0};
    for (int o = 0; o < a->n_out; o++) y0[o] = a->out[o].y;
    const float *x0 = a->x;
    if (np > 0) {
        a->n = np;
        a->rowwise = 1;
        run_matmul(r, a);
    }
    if (n > np) {
        a->n = n - np;
        a->rowwise = 0;
        a->onerow = 1;
        a->x = x0 + (size_t)np * a->x_stride;
        for (int o = 0; o < a->n_out; o++)
            if (a->out[o].y) a->out[o].y = y0[o] + (size_t)np * a->out[o].y_stride;
        run_matmul(r, a);
    }
}

/* Layer l of a step on the CPU over rows [0, n) of runner r's scratch (s->x holds their
 * residual stream; rows [0, np) take the many-row products), computed with r's threads: each
 * segment's queries and keys rotated and stored at its positions, then its attention over its
 * sequence's cache. Segments of one sequence come in position order. */
static void layer_step(struct Engine *r, int l, struct StepSeg *segs, int ns, int n, int np,
                       double attn_flop)
{
    const struct Model *m = r->m;
    const struct ModelConfig *c = &m->cfg;
    const struct Backend *be = r->be;
    struct Scratch *s = &r->s;
    int d = c->dim, hd = c->head_dim, nq = c->n_q_head * hd, nkv = c->n_kv_head * hd;
    int no = c->n_head * hd, F = c->ffn_dim;
    size_t el = kv_elem_bytes(r->opts.kv_type);
    const struct KvPoolLayout *lay = &r->lay;
    int diff = c->arch == ARCH_DIFFV2;
    double t;
    const struct LayerWeights *w = &m->layers[l];
    void *kc = (char *)lay->base + (size_t)l * lay->layer_stride * el;
    void *vc = (char *)lay->base + (lay->value_offset + (size_t)l * lay->layer_stride) * el;

    be->rmsnorm(r->pool, s->xb, s->x, w->attn_norm, n, d, c->norm_eps);
    struct MatmulArgs qkv = {
        .x = s->xb, .x_stride = (size_t)d, .n = n, .k = d, .n_out = diff ? 4 : 3,
        .out = {{&w->wq, s->q, (size_t)nq, 0}, {&w->wk, s->k, (size_t)nkv, 0},
                {&w->wv, s->v, (size_t)nkv, 0}, {&w->wlambda, s->lam, (size_t)c->n_head, 0}},
    };
    step_matmul(r, &qkv, np);
    add_bias(s->q, (size_t)nq, n, w->bq);
    add_bias(s->k, (size_t)nkv, n, w->bk);
    add_bias(s->v, (size_t)nkv, n, w->bv);
    for (int i = 0; i < ns; i++) {
        struct Engine *e = segs[i].e;
        int r0 = segs[i].row0, sn = segs[i].n, pos0 = segs[i].pos0;
        struct RopeStoreArgs rs = {
            .q = s->q + (size_t)r0 * nq, .q_stride = (size_t)nq, .k = s->k + (size_t)r0 * nkv,
            .v = s->v + (size_t)r0 * nkv, .kv_stride = (size_t)nkv, .n_tok = sn, .pos0 = pos0,
            .n_q_head = c->n_q_head, .n_kv_head = c->n_kv_head, .head_dim = hd,
            .pos = segs[i].qpos, .n_rot = c->rope.n_rot, .layout = c->rope.layout,
            .cos = s->cos + (size_t)r0 * (c->rope.n_rot / 2),
            .sin = s->sin + (size_t)r0 * (c->rope.n_rot / 2), .kcache = kc, .vcache = vc,
            .kv_type = r->opts.kv_type, .kv_head_stride = lay->head_stride,
            .pages = e->pages, .page_stride = lay->page_stride,
        };
        be->rope_store(r->pool, &rs);
        if (!segs[i].quiet && e->wq_off[l + 1] > e->wq_off[l])
            measure_layer(e, l, r0 + sn - 1, sn, kc);
        if (segs[i].probe) probe_layer(e, r0, sn, segs[i].qpos, pos0, kc);
        struct AttnArgs a = {
            .q = s->q + (size_t)r0 * nq, .q_stride = (size_t)nq,
            .out = s->att + (size_t)r0 * no, .out_stride = (size_t)no,
            .k = kc, .v = vc, .kv_head_stride = lay->head_stride, .pages = e->pages,
            .page_stride = lay->page_stride, .kv_type = r->opts.kv_type, .n_tok = sn,
            .pos0 = pos0, .qpos = segs[i].qpos, .n_q_head = c->n_q_head,
            .n_kv_head = c->n_kv_head, .head_dim = hd,
            .scale = 1.f / sqrtf((float)hd), .rowwise = segs[i].prefill,
            .lambda = diff ? s->lam + (size_t)r0 * c->n_head : NULL,
            .lambda_stride = (size_t)c->n_head,
        };
        t = now_s();
        be->attention(r->pool, &a, s->attn);
        r->stats.attention_s += now_s() - t;
    }
    r->stats.attention_flop += attn_flop;
    struct MatmulArgs o = {
        .x = s->att, .x_stride = (size_t)no, .n = n, .k = no, .n_out = 1,
        .out = {{&w->wo, s->x, (size_t)d, 1}},
    };
    step_matmul(r, &o, np);

    be->rmsnorm(r->pool, s->xb, s->x, w->ffn_norm, n, d, c->norm_eps);
    struct MatmulArgs up = {
        .x = s->xb, .x_stride = (size_t)d, .n = n, .k = d, .n_out = 2, .swiglu = 1,
        .out = {{&w->w_gate, s->h, (size_t)F, 0}, {&w->w_up, NULL, 0, 0}},
    };
    step_matmul(r, &up, np);
    struct MatmulArgs down = {
        .x = s->h, .x_stride = (size_t)F, .n = n, .k = F, .n_out = 1,
        .out = {{&w->w_down, s->x, (size_t)d, 1}},
    };
    step_matmul(r, &down, np);
}

/* A blend's probe (engine_blend): the tokens that will follow the region, run once through
 * every layer after it, and the attention that its rows at positions >= first give each
 * region position (the backend's attention_weights, from the cache as it stands then: layer 0
 * computed, the stored KV above it), summed over the rows, query heads and layers. */
struct BlendProbe {
    int p0, n_reg, first;
    float *sum;               /* (n_reg) the sums */
    void *scratch;            /* attention_weights_scratch bytes */
};

/* Layer l's share of the probe: the rows of this step (r0.., sn of them, at qpos or pos0..)
 * at positions >= first, their queries in the scratch and their keys already in the cache kc. */
static void probe_layer(struct Engine *e, int r0, int sn, const int32_t *qpos, int pos0,
                        const void *kc)
{
    struct BlendProbe *pb = e->probe;
    const struct ModelConfig *c = &e->m->cfg;
    int32_t pos[ENGINE_BLEND_PROBE_ROWS];
    int n = 0, t0 = -1;
    for (int t = 0; t < sn && n < ENGINE_BLEND_PROBE_ROWS; t++) {
        int p = qpos ? qpos[t] : pos0 + t;
        if (p < pb->first) continue;
        if (t0 < 0) t0 = t;
        pos[n++] = p;
    }
    if (!n) return;
    size_t nq = (size_t)c->n_q_head * c->head_dim;
    struct WeightsArgs wa = {
        .q = e->runner->s.q + (size_t)(r0 + t0) * nq, .q_stride = nq, .pos = pos, .n_rows = n,
        .k = kc, .kv_head_stride = e->lay.head_stride, .pages = e->pages,
        .page_stride = e->lay.page_stride, .kv_type = e->opts.kv_type,
        .n_q_head = c->n_q_head, .n_kv_head = c->n_kv_head, .head_dim = c->head_dim,
        .scale = 1.f / sqrtf((float)c->head_dim), .k0 = pb->p0, .k1 = pb->p0 + pb->n_reg,
        .out = pb->sum,
    };
    e->be->attention_weights(e->runner->pool, &wa, pb->scratch);
}

/* Keeps, for each segment that captures layer l (engine_capture), its last row of the residual
 * stream as it enters layer l (l = n_layer: after the last layer). A blend's quiet rows and its
 * probe are not positions the caller evaluates, so they keep nothing. */
static void capture_rows(struct Engine *r, int l, const struct StepSeg *segs, int ns)
{
    int d = r->m->cfg.dim;
    for (int i = 0; i < ns; i++) {
        struct Engine *e = segs[i].e;
        if (segs[i].quiet || segs[i].probe) continue;
        for (int j = 0; j < e->n_cap; j++)
            if (e->cap_layer[j] == l)
                memcpy(e->hidden + (size_t)j * d, r->s.x + (size_t)(segs[i].row0 + segs[i].n - 1) * d,
                       (size_t)d * sizeof *e->hidden);
    }
}

/* One forward pass over segs[0..ns) on the CPU, computed with runner r's threads and scratch:
 * the prefill segments first, then the decode ones; at most r's chunk rows in all. The caller
 * has taken each sequence's pages. */
static int forward_step(struct Engine *r, struct StepSeg *segs, int ns)
{
    const struct Model *m = r->m;
    const struct ModelConfig *c = &m->cfg;
    const struct Backend *be = r->be;
    struct Scratch *s = &r->s;
    int d = c->dim, hd = c->head_dim;
    double t_start = now_s();
    int n = 0, np = 0;
    double attn_flop = 0;
    for (int i = 0; i < ns; i++) {
        struct StepSeg *g = &segs[i];
        g->row0 = n;
        g->pos0 = g->e->n_past;
        memcpy(g->e->tok + g->e->n_past, g->tokens, (size_t)g->n * sizeof *g->tokens);
        for (int k = 0; k < g->n; k++) {
            be->weights_row(&m->tok_embd, g->tokens[k], s->x + (size_t)(n + k) * d);
            attn_flop += 4.0 * (g->e->n_past + k + 1) * hd * c->n_q_head;
        }
        rope_tables(r, g->n, g->e->n_past + g->e->rope_offset, n);
        n += g->n;
        if (g->prefill) np = n;
    }
    for (int l = 0; l < c->n_layer; l++) {
        capture_rows(r, l, segs, ns);
        layer_step(r, l, segs, ns, n, np, attn_flop);
    }
    capture_rows(r, c->n_layer, segs, ns);
    /* The logits of the segments that want them: their last rows, each through the LM head
     * as its own one-row product. */
    int nl = 0;
    for (int i = 0; i < ns; i++) {
        struct StepSeg *g = &segs[i];
        g->e->n_past += g->n;
        g->e->mass_valid = g->e->n_watch > 0;
        if (!g->quiet && !g->probe) g->e->hidden_valid = g->e->n_cap > 0;
        if (!g->want_logits) continue;
        be->rmsnorm(r->pool, s->xb + (size_t)nl * d, s->x + (size_t)(g->row0 + g->n - 1) * d,
                    m->output_norm, 1, d, c->norm_eps);
        nl++;
    }
    if (nl > 0) {
        float *lg = nl == 1 ? NULL : r->step_logits;
        if (nl > 1 && (!lg || r->step_logits_rows < nl)) {
            free(r->step_logits);
            r->step_logits = lg = malloc((size_t)nl * c->vocab * sizeof *lg);
            r->step_logits_rows = lg ? nl : 0;
            if (!lg) return ENGINE_ENOMEM;
        }
        struct Engine *only = NULL;
        for (int i = 0; i < ns && !only; i++)
            if (segs[i].want_logits) only = segs[i].e;
        struct MatmulArgs lm = {
            .x = s->xb, .x_stride = (size_t)d, .n = nl, .k = d, .n_out = 1, .onerow = 1,
            .out = {{&m->output, nl == 1 ? only->logits : lg, (size_t)c->vocab, 0}},
        };
        run_matmul(r, &lm);
        for (int i = 0, k = 0; i < ns && nl > 1; i++)
            if (segs[i].want_logits)
                memcpy(segs[i].e->logits, lg + (size_t)k++ * c->vocab,
                       (size_t)c->vocab * sizeof *lg);
    }
    r->stats.total_s += now_s() - t_start;
    r->stats.tokens += n;
    return ENGINE_OK;
}

/* One chunk of n tokens at positions n_past..n_past+n-1; logits of the last one if asked.
 * rowwise: the prefill form (each row's arithmetic independent of the chunk, see
 * engine_prefill); else one token takes the one-row products and split attention. */
static int forward_chunk(struct Engine *e, const int32_t *tokens, int n, int want_logits,
                         int rowwise)
{
    struct StepSeg g = {.e = e, .tokens = tokens, .n = n, .prefill = rowwise,
                        .want_logits = want_logits};
    if (e->gpu) return forward_step_gpu(e->runner, &g, 1);
    return forward_step(e->runner, &g, 1);
}

/* engine_prefill (prefill = 1: the prefix cache, the rowwise form, publishing) and
 * engine_decode (prefill = 0). */
static int append_tokens(struct Engine *e, const int32_t *tokens, size_t n, int prefill,
                         char *err, size_t errlen)
{
    if (!e || (!tokens && n)) return errmsg_set(err, errlen, ENGINE_EINPUT, "no tokens");
    if (e->blend)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "the sequence is blending: its blend "
                          "ends first");
    if (n == 0) return ENGINE_OK;
    if (n > (size_t)(e->opts.n_ctx - e->n_past))
        return errmsg_set(err, errlen, ENGINE_ECTX,
                    "%zu tokens do not fit: the context holds %d and %d are in use", n,
                    e->opts.n_ctx, e->n_past);
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= e->m->cfg.vocab)
            return errmsg_set(err, errlen, ENGINE_EINPUT, "token %d at index %zu is outside the vocabulary "
                        "(%d)", tokens[i], i, e->m->cfg.vocab);
    size_t i = prefill ? (size_t)engine_take_cached(e, tokens, n) : 0;
    for (; i < n; i += (size_t)e->opts.chunk) {
        if (atomic_exchange(&e->cancel, 0))
            return errmsg_set(err, errlen, ENGINE_ECANCELLED, "cancelled after %zu of %zu tokens", i, n);
        int len = n - i < (size_t)e->opts.chunk ? (int)(n - i) : e->opts.chunk;
        int rc = take_pages(e, e->n_past + len, err, errlen);
        if (rc) return rc;
        if (forward_chunk(e, tokens + i, len, i + (size_t)len == n, prefill) != ENGINE_OK) {
            /* the failed chunk's positions may be half written: the sequence ends before it */
            return errmsg_set(err, errlen, ENGINE_EDEVICE, "after %zu of %zu tokens: %s", i, n,
                        e->gpu_err);
        }
        /* Only pages whose every position a prefill wrote are published: a decoded position
         * went through the one-row form and would not equal a cold prefill's. */
        if (prefill && !e->gpu && e->prefill_end == e->n_past - len) {
            e->prefill_end = e->n_past;
            publish_pages(e);
        }
    }
    return ENGINE_OK;
}

int engine_take_cached(struct Engine *e, const int32_t *prompt, size_t n)
{
    if (e->gpu || e->n_past != 0 || e->n_pages != 0 || e->rope_offset || n < 2) return 0;
    /* the longest cached run of full pages, leaving the last token to compute */
    int m = kvpool_match(e->kv, prompt, n, (int)((n - 1) / KV_TILE), e->pages, e->page_hash);
    e->n_pages = e->n_named = m;
    memcpy(e->tok, prompt, (size_t)m * KV_TILE * sizeof *prompt);
    e->n_past = e->prefill_end = e->n_cached = m * KV_TILE;
    return e->n_cached;
}

int engine_pages_needed(const struct Engine *e, int n)
{
    if (e->gpu) return gpu_seq_pages_needed(e->gpu, e->n_past + n);
    if (!e->kv) return 0;
    int need = (int)kvpool_pages_for(e->n_past + n) - e->n_pages;
    return need > 0 ? need : 0;
}

long engine_pages_available(const struct Engine *e)
{
    if (e->gpu) {
        int free_pages = 0;
        model_gpu_info(e->m, NULL, NULL, &free_pages);
        return free_pages;
    }
    if (!e->kv) return 0;
    struct KvPoolStats st;
    kvpool_stats(e->kv, &st);
    return (long)(st.pages - st.pages_used);
}

int engine_new_seq(struct Engine *r, struct Engine **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!r || r->runner != r)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "sequences of a batch are made by the "
                          "context that runs the batch");
    const struct ModelConfig *c = &r->m->cfg;
    struct Engine *e = calloc(1, sizeof *e);
    if (!e) return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory");
    if (r->gpu) {
        e->m = r->m;
        e->be = r->be;
        e->opts = r->opts;
        int rc = gpu_engine_new(e, r, err, errlen);
        if (rc != ENGINE_OK) {
            engine_destroy(&e);
            return rc;
        }
        *out = e;
        return ENGINE_OK;
    }
    e->runner = r;
    e->m = r->m;
    e->be = r->be;
    e->opts = r->opts;
    e->kv = r->kv;
    e->lay = r->lay;
    e->s = r->s;
    e->pool = r->pool;
    e->block = r->block;
    e->inv_freq = r->inv_freq;
    e->mass_scratch = r->mass_scratch;
    e->rope_mscale = r->rope_mscale;
    size_t max_pages = kvpool_pages_for(e->opts.n_ctx);
    e->logits = malloc((size_t)c->vocab * sizeof *e->logits);
    e->pages = malloc(max_pages * sizeof *e->pages);
    e->page_hash = malloc(max_pages * sizeof *e->page_hash);
    e->tok = malloc((size_t)e->opts.n_ctx * sizeof *e->tok);
    e->cls = calloc((size_t)e->opts.n_ctx, 1);
    e->wq_off = calloc((size_t)c->n_layer + 1, sizeof *e->wq_off);
    atomic_init(&e->cancel, 0);
    if (!e->logits || !e->pages || !e->page_hash || !e->tok || !e->cls || !e->wq_off) {
        engine_destroy(&e);
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory for a sequence");
    }
    *out = e;
    return ENGINE_OK;
}

int engine_step(struct Engine *r, const struct EngineBatchItem *items, int n_items, int *failed,
                char *err, size_t errlen)
{
    enum { MAX_ITEMS = 256 };
    if (failed) *failed = -1;
    if (!r || r->runner != r || n_items < 1 || n_items > MAX_ITEMS)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a step takes 1..%d sequences of the "
                          "context that runs it", MAX_ITEMS);
    struct StepSeg segs[MAX_ITEMS];
    int rows = 0, k = 0;
    /* the prefill items first, then the decode ones */
    for (int pass = 1; pass >= 0; pass--)
        for (int i = 0; i < n_items; i++) {
            const struct EngineBatchItem *it = &items[i];
            if (!!it->prefill != pass) continue;
            struct Engine *e = it->seq;
            if (!e || e->runner != r || it->n < 1 || !it->tokens || (!it->prefill && it->n != 1) ||
                e->blend)
                return errmsg_set(err, errlen, ENGINE_EINPUT, "bad step item %d", i);
            if (it->n > e->opts.n_ctx - e->n_past) {
                if (failed) *failed = i;
                return errmsg_set(err, errlen, ENGINE_ECTX, "%d tokens do not fit: the context "
                                  "holds %d and %d are in use", it->n, e->opts.n_ctx, e->n_past);
            }
            for (int t = 0; t < it->n; t++)
                if (it->tokens[t] < 0 || it->tokens[t] >= r->m->cfg.vocab) {
                    if (failed) *failed = i;
                    return errmsg_set(err, errlen, ENGINE_EINPUT, "token %d is outside the "
                                      "vocabulary (%d)", it->tokens[t], r->m->cfg.vocab);
                }
            segs[k++] = (struct StepSeg){.e = e, .tokens = it->tokens, .n = it->n,
                                         .prefill = it->prefill, .want_logits = it->logits};
            rows += it->n;
        }
    if (rows > r->opts.chunk)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a step of %d tokens is over the context's "
                          "%d", rows, r->opts.chunk);
    for (int i = 0; i < n_items; i++) {
        int rc = take_pages(items[i].seq, items[i].seq->n_past + items[i].n, err, errlen);
        if (rc) {
            if (failed) *failed = i;
            return rc;
        }
    }
    if (r->gpu) {
        int rc = forward_step_gpu(r, segs, k);
        return rc == ENGINE_OK ? ENGINE_OK
                               : errmsg_set(err, errlen, rc, "a step on the GPU: %s", r->gpu_err);
    }
    if (forward_step(r, segs, k) != ENGINE_OK)
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory for a step's logits");
    for (int i = 0; i < k; i++) {
        struct Engine *e = segs[i].e;
        if (segs[i].prefill && e->prefill_end == e->n_past - segs[i].n) {
            e->prefill_end = e->n_past;
            publish_pages(e);
        }
    }
    return ENGINE_OK;
}

int engine_prefill(struct Engine *e, const int32_t *tokens, size_t n, char *err, size_t errlen)
{
    return append_tokens(e, tokens, n, 1, err, errlen);
}

/* The first index of the largest logit (NaN never wins); 0 when all are -inf or NaN. */
static int32_t logits_argmax(const float *lg, int n)
{
    int32_t best = 0;
    float mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (lg[i] > mx) { mx = lg[i]; best = i; }
    return best;
}

/* engine_score and engine_score_positions: the logits of every position, ROWS rows at a time
 * through the LM head, each scored against the next token. Optional outputs may be NULL. */
static int score_tokens(struct Engine *e, const int32_t *tokens, size_t n, float *nll,
                        int32_t *top, double *nll_sum, size_t *n_scored, char *err, size_t errlen)
{
    enum { ROWS = 64 };
    if (nll_sum) *nll_sum = 0;
    if (n_scored) *n_scored = 0;
    if (!e || !tokens || n < 2) return errmsg_set(err, errlen, ENGINE_EINPUT, "need at least 2 tokens");
    if (e->gpu)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "scoring runs on CPU contexts only (it needs "
                    "the logits of every position)");
    int rc = ENGINE_OK;
    if (n > (size_t)(e->opts.n_ctx - e->n_past))
        return errmsg_set(err, errlen, ENGINE_ECTX, "%zu tokens do not fit in a %d-token context", n,
                    e->opts.n_ctx - e->n_past);
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= e->m->cfg.vocab)
            return errmsg_set(err, errlen, ENGINE_EINPUT, "token %d outside the vocabulary", tokens[i]);
    const struct ModelConfig *c = &e->m->cfg;
    float *lg = malloc((size_t)ROWS * c->vocab * sizeof(float));
    if (!lg) return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory");
    for (size_t i = 0; i < n && rc == ENGINE_OK; i += (size_t)e->opts.chunk) {
        if (atomic_exchange(&e->cancel, 0)) { rc = errmsg_set(err, errlen, ENGINE_ECANCELLED, "cancelled"); break; }
        int len = n - i < (size_t)e->opts.chunk ? (int)(n - i) : e->opts.chunk;
        rc = e->gpu ? ENGINE_OK : take_pages(e, e->n_past + len, err, errlen);
        if (rc) break;
        (void)forward_chunk(e, tokens + i, len, 0, 1);
        for (int r0 = 0; r0 < len; r0 += ROWS) {
            int nr = len - r0 < ROWS ? len - r0 : ROWS;
            const float *rows = e->s.x + (size_t)r0 * c->dim;
            e->be->rmsnorm(e->pool, e->s.xb, rows, e->m->output_norm, nr, c->dim, c->norm_eps);
            struct MatmulArgs lm = {
                .x = e->s.xb, .x_stride = (size_t)c->dim, .n = nr, .k = c->dim, .n_out = 1,
                .out = {{&e->m->output, lg, (size_t)c->vocab, 0}},
            };
            run_matmul(e, &lm);
            for (int r = 0; r < nr; r++) {
                size_t pos = i + (size_t)r0 + r;
                if (pos + 1 >= n) break;
                const float *row = lg + (size_t)r * c->vocab;
                struct TokenSignal sig;
                sampler_signal(row, c->vocab, tokens[pos + 1], &sig);
                if (nll) nll[pos] = -sig.logprob;
                if (top) top[pos] = logits_argmax(row, c->vocab);
                if (nll_sum) *nll_sum -= sig.logprob;
                if (n_scored) (*n_scored)++;
            }
        }
    }
    free(lg);
    return rc;
}

int engine_score(struct Engine *e, const int32_t *tokens, size_t n, double *nll_sum,
                 size_t *n_scored, char *err, size_t errlen)
{
    return score_tokens(e, tokens, n, NULL, NULL, nll_sum, n_scored, err, errlen);
}

int engine_score_positions(struct Engine *e, const int32_t *tokens, size_t n, float *nll,
                           int32_t *top, char *err, size_t errlen)
{
    return score_tokens(e, tokens, n, nll, top, NULL, NULL, err, errlen);
}

int engine_decode(struct Engine *e, int32_t token, char *err, size_t errlen)
{
    return append_tokens(e, &token, 1, 0, err, errlen);
}

int engine_cached(const struct Engine *e) { return e->n_cached; }

const float *engine_logits(struct Engine *e)
{
    if (e->gpu && !e->logits_on_host) {
        if (gpu_seq_logits(e->gpu, e->logits, e->gpu_err, sizeof e->gpu_err)) return NULL;
        e->logits_on_host = 1;
    }
    return e->logits;
}

int engine_sample(struct Engine *e, struct Sampler *s, int32_t *token, struct TokenSignal *sig,
                  char *err, size_t errlen)
{
    if (!e->gpu) {
        *token = sampler_sample(s, e->logits, sig);
        return ENGINE_OK;
    }
    struct SampleKeep k;
    sampler_keep(s, &k);
    struct SamplePass p = {.cand = e->gpu_cand};
    if (gpu_seq_sample(e->gpu, &k, &p, e->gpu_err, sizeof e->gpu_err))
        return errmsg_set(err, errlen, ENGINE_EDEVICE, "sampling: %s", e->gpu_err);
    *token = sampler_finish(s, &p, sig);
    return ENGINE_OK;
}
int engine_n_past(const struct Engine *e) { return e->n_past; }
const struct Model *engine_model(const struct Engine *e) { return e->m; }
const struct EngineOpts *engine_opts(const struct Engine *e) { return &e->opts; }

void engine_reset(struct Engine *e)
{
    blend_free(e);
    if (e->kv) kvpool_release(e->kv, e->pages, e->n_pages);
    if (e->gpu) gpu_seq_release(e->gpu);
    e->n_pages = e->n_named = e->prefill_end = e->n_cached = 0;
    e->n_past = e->rope_offset = 0;
    e->mass_valid = 0;
    e->hidden_valid = 0;
    atomic_store(&e->cancel, 0);
}

void engine_cancel(struct Engine *e) { atomic_store(&e->cancel, 1); }

void engine_stats(const struct Engine *e, struct EngineStats *out) { *out = e->stats; }

void engine_stats_reset(struct Engine *e) { memset(&e->stats, 0, sizeof e->stats); }

/* ---- groundedness signals ---- */

int engine_capture(struct Engine *e, const int *layers, int n, char *err, size_t errlen)
{
    const struct ModelConfig *c = &e->m->cfg;
    if (n < 0 || n > ENGINE_MAX_CAPTURE)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "capture at most %d layers",
                          ENGINE_MAX_CAPTURE);
    for (int i = 0; i < n; i++) {
        if (layers[i] < 0 || layers[i] > c->n_layer)
            return errmsg_set(err, errlen, ENGINE_EINPUT, "captured layer %d is outside the "
                              "model (0..%d)", layers[i], c->n_layer);
        for (int j = 0; j < i; j++)
            if (layers[j] == layers[i])
                return errmsg_set(err, errlen, ENGINE_EINPUT, "layer %d is captured twice",
                                  layers[i]);
    }
    if (n != e->n_cap) {          /* a sequence serves job after job: same count, same rows */
        float *h = NULL;
        if (n > 0 && !(h = malloc((size_t)n * c->dim * sizeof *h)))
            return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory");
        free(e->hidden);
        e->hidden = h;
        e->n_cap = n;
    }
    for (int i = 0; i < n; i++) e->cap_layer[i] = layers[i];
    e->hidden_valid = 0;
    return ENGINE_OK;
}

const float *engine_hidden(const struct Engine *e, int *n)
{
    *n = e->hidden_valid ? e->n_cap : 0;
    return e->hidden_valid ? e->hidden : NULL;
}

int engine_watch(struct Engine *e, const struct AttnWatch *w, int n, char *err, size_t errlen)
{
    const struct ModelConfig *c = &e->m->cfg;
    int diff = c->arch == ARCH_DIFFV2, per = diff ? 2 : 1;
    int heads = diff ? c->n_head : c->n_q_head;
    if (n < 0 || n > ENGINE_MAX_WATCH || (n && !w))
        return errmsg_set(err, errlen, ENGINE_EINPUT, "watch at most %d heads", ENGINE_MAX_WATCH);
    for (int i = 0; i < n; i++) {
        if (w[i].layer < 0 || w[i].layer >= c->n_layer || w[i].head < 0 || w[i].head >= heads)
            return errmsg_set(err, errlen, ENGINE_EINPUT, "watched head %d:%d is outside the model "
                        "(%d layers of %d %s heads)", w[i].layer, w[i].head, c->n_layer, heads,
                        diff ? "DIFF V2 output" : "query");
        for (int j = 0; j < i; j++)
            if (w[j].layer == w[i].layer && w[j].head == w[i].head)
                return errmsg_set(err, errlen, ENGINE_EINPUT, "head %d:%d is watched twice",
                            w[i].layer, w[i].head);
    }
    struct AttnWatch *nw = n ? malloc((size_t)n * sizeof *nw) : NULL;
    int *wq = n ? malloc((size_t)n * per * sizeof *wq) : NULL;
    int *wqw = n ? malloc((size_t)n * per * sizeof *wqw) : NULL;
    float *wm = n ? calloc((size_t)n * per * 2, sizeof *wm) : NULL;
    struct AttnMass *ms = n ? calloc((size_t)n, sizeof *ms) : NULL;
    if (n && (!nw || !wq || !wqw || !wm || !ms)) {
        free(nw); free(wq); free(wqw); free(wm); free(ms);
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory");
    }
    if (n) memcpy(nw, w, (size_t)n * sizeof *nw);
    int k = 0;
    for (int l = 0; l < c->n_layer; l++) {
        e->wq_off[l] = k;
        for (int i = 0; i < n; i++)
            if (w[i].layer == l)
                for (int p = 0; p < per; p++) {
                    wq[k] = w[i].head * per + p;
                    wqw[k++] = i;
                }
    }
    e->wq_off[c->n_layer] = k;
    free(e->watch); free(e->wq); free(e->wq_watch); free(e->wq_mass); free(e->mass);
    e->watch = nw;
    e->wq = wq;
    e->wq_watch = wqw;
    e->wq_mass = wm;
    e->mass = ms;
    e->n_watch = n;
    e->mass_valid = 0;
    return ENGINE_OK;
}

int engine_set_spans(struct Engine *e, const uint8_t *cls, size_t n, char *err, size_t errlen)
{
    if (n > (size_t)e->opts.n_ctx || (n && !cls))
        return errmsg_set(err, errlen, ENGINE_EINPUT, "%zu marked positions do not fit a %d-token "
                    "context", n, e->opts.n_ctx);
    if (n) memcpy(e->cls, cls, n);
    if (e->gpu && gpu_seq_set_spans(e->gpu, cls, n, err, errlen)) return ENGINE_EDEVICE;
    e->n_marked = (int)n;
    return ENGINE_OK;
}

const struct AttnMass *engine_attn_mass(const struct Engine *e, int *n)
{
    *n = e->mass_valid ? e->n_watch : 0;
    return e->mass_valid ? e->mass : NULL;
}

int engine_default_watch(const struct Model *m, struct AttnWatch *out, int cap)
{
    const struct ModelConfig *c = &m->cfg;
    int heads = c->arch == ARCH_DIFFV2 ? c->n_head : c->n_q_head, k = 0;
    int layers[2] = {c->n_layer / 2, 3 * c->n_layer / 4};
    for (int i = 0; i < 2; i++) {
        if (i == 1 && layers[1] == layers[0]) break;
        for (int h = 0; h < heads && k < cap; h++) out[k++] = (struct AttnWatch){layers[i], h};
    }
    return k;
}

/* ---- chunk KV reuse ---- */

size_t engine_kv_bytes(const struct Engine *e, int n)
{
    const struct ModelConfig *c = &e->m->cfg;
    return kv_row_bytes(e->opts.kv_type, c->n_kv_head, c->head_dim) * (size_t)c->n_layer *
           (size_t)(n > 0 ? n : 0);
}

/* The copy arguments of layer l's cache over n positions from pos0, packed rows at `rows`. */
static struct KvCopyArgs kv_copy_args(struct Engine *e, int l, int pos0, int n, void *rows)
{
    const struct ModelConfig *c = &e->m->cfg;
    size_t el = kv_elem_bytes(e->opts.kv_type);
    const struct KvPoolLayout *lay = &e->lay;
    return (struct KvCopyArgs){
        .kcache = (char *)lay->base + (size_t)l * lay->layer_stride * el,
        .vcache = (char *)lay->base + (lay->value_offset + (size_t)l * lay->layer_stride) * el,
        .kv_type = e->opts.kv_type, .kv_head_stride = lay->head_stride, .pages = e->pages,
        .page_stride = lay->page_stride, .n_tok = n, .pos0 = pos0, .n_kv_head = c->n_kv_head,
        .head_dim = c->head_dim, .rows = rows,
        .row_stride = kv_row_bytes(e->opts.kv_type, c->n_kv_head, c->head_dim),
        .n_rot = c->rope.n_rot, .layout = c->rope.layout,
    };
}

int engine_kv_export(struct Engine *e, int pos0, int n, void *out, char *err, size_t errlen)
{
    if (!e || !out || e->gpu)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "exporting KV needs a CPU context");
    if (pos0 < 0 || n < 1 || n > e->n_past - pos0)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "positions %d..%d are not in the sequence "
                          "(%d positions)", pos0, pos0 + n - 1, e->n_past);
    size_t lb = engine_kv_bytes(e, n) / (size_t)e->m->cfg.n_layer;
    for (int l = 0; l < e->m->cfg.n_layer; l++) {
        struct KvCopyArgs a = kv_copy_args(e, l, pos0, n, (char *)out + (size_t)l * lb);
        e->be->kv_read(&a);
    }
    return ENGINE_OK;
}

int engine_set_rope_offset(struct Engine *e, int offset, char *err, size_t errlen)
{
    if (!e || e->gpu || e->n_past != 0 || offset < 0 || offset > ENGINE_MAX_CTX)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a RoPE offset (0..%d) is set on an empty "
                          "CPU sequence", ENGINE_MAX_CTX);
    e->rope_offset = offset;
    /* its pages hold other positions' keys than the prefix cache's: none is published */
    e->prefill_end = offset ? -1 : 0;
    return ENGINE_OK;
}

/* A part's stored KV into the sequence's cache at positions pos.., every key rotated from the
 * position it was computed at to its new one (no rotation when they are the same: the copy is
 * bit for bit). The rotation's table has no YaRN magnitude factor: the stored keys carry it
 * already, and rotations compose. */
static void blend_import(struct Engine *e, const struct EngineKvPart *p, int pos)
{
    struct Engine *r = e->runner;
    struct Scratch *s = &r->s;
    int half = e->m->cfg.rope.n_rot / 2;
    long delta = (long)pos + e->rope_offset - p->kv_pos;
    for (int i = 0; i < half && delta; i++) {
        double phi = (double)delta * e->inv_freq[i];
        s->cos[i] = (float)cos(phi);
        s->sin[i] = (float)sin(phi);
    }
    size_t lb = engine_kv_bytes(e, p->kv_len ? p->kv_len : p->n) / (size_t)e->m->cfg.n_layer;
    for (int l = 0; l < e->m->cfg.n_layer; l++) {
        struct KvCopyArgs a = kv_copy_args(e, l, pos, p->n, (char *)p->kv + (size_t)l * lb);
        if (delta) {
            a.cos = s->cos;
            a.sin = s->sin;
            a.k = s->k;
            a.v = s->v;
        }
        e->be->kv_write(&a);
    }
}

/* One block of layer l over the blend region's selected rows (sel[i] for position p0 + i; sel
 * NULL: every row) from row *at on: at most cap rows (and the chunk's), position order, their residual
 * rows gathered from x into the scratch with their RoPE tables (rc, rs: the region's), the
 * layer run over them as one segment of scattered positions, and the rows scattered back; *at
 * moves past them. Returns the rows run (0: none were left). */
static int blend_block(struct Engine *e, int l, float *x, const uint8_t *sel, int p0, int n_reg,
                       const float *rc, const float *rs, int32_t *qpos, int probe, int cap,
                       int *at)
{
    struct Engine *r = e->runner;
    const struct ModelConfig *c = &e->m->cfg;
    int d = c->dim, n = 0, i = *at;
    if (cap < 1 || cap > r->opts.chunk) cap = r->opts.chunk;
    size_t half = (size_t)(c->rope.n_rot / 2);
    double flop = 0;
    for (; i < n_reg && n < cap; i++) {
        if (sel && !sel[i]) continue;
        qpos[n] = p0 + i;
        memcpy(r->s.x + (size_t)n * d, x + (size_t)i * d, (size_t)d * sizeof *x);
        memcpy(r->s.cos + (size_t)n * half, rc + (size_t)i * half, half * sizeof *rc);
        memcpy(r->s.sin + (size_t)n * half, rs + (size_t)i * half, half * sizeof *rs);
        flop += 4.0 * (p0 + i + 1) * c->head_dim * c->n_q_head;
        n++;
    }
    *at = i;
    if (!n) return 0;
    struct StepSeg seg = {.e = e, .n = n, .prefill = 1, .row0 = 0, .pos0 = qpos[0],
                          .qpos = qpos, .quiet = 1, .probe = probe};
    layer_step(r, l, &seg, 1, n, n, flop);
    for (int k = 0; k < n; k++)
        memcpy(x + (size_t)(qpos[k] - p0) * d, r->s.x + (size_t)k * d, (size_t)d * sizeof *x);
    return n;
}

/* The value deviation of region rows i0..i0+n at layer 1: the squared distance between the
 * value each row computes now, from its layer-0 output in x, and the value in the cache (the
 * stored one), into dev[i0..]. */
static void blend_deviation(struct Engine *e, const float *x, int p0, int i0, int n_rows,
                            float *dev)
{
    struct Engine *r = e->runner;
    struct Scratch *s = &r->s;
    const struct ModelConfig *c = &e->m->cfg;
    const struct LayerWeights *w = &e->m->layers[1];
    int d = c->dim, nkv = c->n_kv_head * c->head_dim, cap = r->opts.chunk;
    for (int i = i0; i < i0 + n_rows; i += cap) {
        int n = i0 + n_rows - i < cap ? i0 + n_rows - i : cap;
        r->be->rmsnorm(r->pool, s->xb, x + (size_t)i * d, w->attn_norm, n, d, c->norm_eps);
        struct MatmulArgs mv = {.x = s->xb, .x_stride = (size_t)d, .n = n, .k = d, .n_out = 1,
                                .rowwise = 1, .out = {{&w->wv, s->v, (size_t)nkv, 0}}};
        run_matmul(r, &mv);
        add_bias(s->v, (size_t)nkv, n, w->bv);
        struct KvCopyArgs a = kv_copy_args(e, 1, p0 + i, n, NULL);
        a.v = s->k;
        a.kv_stride = (size_t)nkv;
        r->be->kv_read(&a);
        for (int t = 0; t < n; t++) {
            double sum = 0;
            const float *vf = s->v + (size_t)t * nkv, *vr = s->k + (size_t)t * nkv;
            for (int k = 0; k < nkv; k++) sum += (double)(vf[k] - vr[k]) * (vf[k] - vr[k]);
            dev[i + t] = (float)sum;
        }
    }
}

/* What a region row's part is. */
enum { ROW_STORED, ROW_FRESH, ROW_UNSTORED };

/* Zero keys and values at layers 1 and up for the rows of parts without stored KV (kind[i] ==
 * ROW_UNSTORED for position p0 + i): they are computed only after the probe, which would
 * otherwise read whatever their pages held before (a zero key draws little attention, a zero
 * value adds nothing). 0, or -1 out of memory. */
static int blank_unstored(struct Engine *e, const uint8_t *kind, int p0, int n_reg)
{
    const struct ModelConfig *c = &e->m->cfg;
    int longest = 0;
    for (int i = 0, run = 0; i < n_reg; i++) {
        run = kind[i] == ROW_UNSTORED ? run + 1 : 0;
        if (run > longest) longest = run;
    }
    if (!longest) return 0;
    void *zeros = calloc((size_t)longest, kv_row_bytes(e->opts.kv_type, c->n_kv_head,
                                                        c->head_dim));
    if (!zeros) return -1;
    for (int i = 0; i < n_reg;) {
        if (kind[i] != ROW_UNSTORED) {
            i++;
            continue;
        }
        int n = 1;
        while (i + n < n_reg && kind[i + n] == ROW_UNSTORED) n++;
        for (int l = 1; l < c->n_layer; l++) {
            struct KvCopyArgs a = kv_copy_args(e, l, p0 + i, n, zeros);
            e->be->kv_write(&a);
        }
        i += n;
    }
    free(zeros);
    return 0;
}

struct DevRank {
    float dev;
    int i;
};

/* A reusable token's weight in a blend with a probe: the attention the answer's rows give it
 * times the distance its value moved, to first order the error it passes to their outputs. */
static float probe_weight(float att, float dev)
{
    return att * sqrtf(dev);
}

static int dev_rank_cmp(const void *a, const void *b)
{
    const struct DevRank *x = a, *y = b;
    if (x->dev != y->dev) return x->dev < y->dev ? 1 : -1;
    return x->i - y->i;
}

/* A blend in progress (engine_blend_begin): what is left to compute, and where it stands. */
enum { PHASE_LAYER0, PHASE_PROBE, PHASE_LAYERS, PHASE_DONE };

struct Blend {
    int p0, n_reg;             /* the region: positions p0..p0+n_reg */
    int forced, reusable, want;
    int phase, l, at;          /* the next block: its phase, layer and first region row */
    uint8_t *sel;              /* (n_reg) rows recomputed at layers 1 and up */
    uint8_t *kind;             /* (n_reg) ROW_* */
    float *x;                  /* (n_reg, dim) the region's residual rows */
    float *dev;                /* (n_reg) deviations (with a check) */
    struct DevRank *rank;      /* (reusable) their order (with a check) */
    float *rope_c, *rope_s;    /* (n_reg, n_rot/2) the region's RoPE tables */
    int32_t *qpos;             /* (chunk) a block's positions */
    int32_t *probe;            /* (n_probe) */
    int n_probe, probed;
    double probe_s;
    /* the probe under way (PHASE_PROBE): its rows and RoPE tables, the next layer, the sums */
    struct BlendProbe pb;
    float *px, *prc, *prs, *att;
    int probe_l;
    size_t imported_bytes;
};

static void blend_free(struct Engine *e)
{
    struct Blend *b = e->blend;
    if (!b) return;
    free(b->sel);
    free(b->kind);
    free(b->x);
    free(b->dev);
    free(b->rank);
    free(b->rope_c);
    free(b->rope_s);
    free(b->qpos);
    free(b->probe);
    free(b->px);
    free(b->prc);
    free(b->prs);
    free(b->att);
    free(b->pb.scratch);
    free(b);
    e->blend = NULL;
}

int engine_blending(const struct Engine *e) { return e->blend != NULL; }

int engine_blend_begin(struct Engine *e, const struct EngineKvPart *parts, int n_parts,
                       double recompute, const int32_t *probe, int n_probe, char *err,
                       size_t errlen)
{
    if (!e || !parts || n_parts < 1 || !(recompute >= 0 && recompute <= 1))
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a blend takes parts and a recompute share "
                          "in [0, 1]");
    if (e->gpu)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "chunk KV reuse runs on CPU contexts");
    if (e->blend)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "the sequence is blending already");
    const struct ModelConfig *c = &e->m->cfg;
    long total = 0;
    for (int k = 0; k < n_parts; k++) {
        const struct EngineKvPart *p = &parts[k];
        if (!p->tokens || p->n < 1 ||
            (p->kv && (p->kv_pos < 0 || p->kv_pos > ENGINE_MAX_CTX || p->kv_len < 0 ||
                       (p->kv_len && p->kv_len < p->n))))
            return errmsg_set(err, errlen, ENGINE_EINPUT, "blend part %d: no tokens, or a stored "
                              "position or length out of range", k);
        for (int t = 0; t < p->n; t++)
            if (p->tokens[t] < 0 || p->tokens[t] >= c->vocab)
                return errmsg_set(err, errlen, ENGINE_EINPUT, "blend part %d: token %d is outside "
                                  "the vocabulary (%d)", k, p->tokens[t], c->vocab);
        total += p->n;
    }
    if (n_probe < 0 || (n_probe && !probe))
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a blend's probe needs its tokens");
    for (int t = 0; t < n_probe; t++)
        if (probe[t] < 0 || probe[t] >= c->vocab)
            return errmsg_set(err, errlen, ENGINE_EINPUT, "probe token %d is outside the "
                              "vocabulary (%d)", t, c->vocab);
    if (total > e->opts.n_ctx - e->n_past)
        return errmsg_set(err, errlen, ENGINE_ECTX, "%ld tokens do not fit: the context holds %d "
                          "and %d are in use", total, e->opts.n_ctx, e->n_past);
    int n_reg = (int)total, p0 = e->n_past;
    int rc = take_pages(e, p0 + n_reg, err, errlen);
    if (rc) return rc;

    struct Engine *r = e->runner;
    double t_start = now_s();
    struct Blend *b = calloc(1, sizeof *b);
    if (!b) goto oom;
    e->blend = b;
    b->p0 = p0;
    b->n_reg = n_reg;
    b->sel = calloc((size_t)n_reg, 1);
    b->kind = malloc((size_t)n_reg);
    b->qpos = malloc((size_t)r->opts.chunk * sizeof *b->qpos);
    b->probe = malloc((size_t)n_probe * sizeof *b->probe + 1);
    if (!b->sel || !b->kind || !b->qpos || !b->probe) goto oom;
    if (n_probe) memcpy(b->probe, probe, (size_t)n_probe * sizeof *probe);
    b->n_probe = n_probe;

    for (int k = 0, at = 0; k < n_parts; at += parts[k].n, k++) {
        memcpy(e->tok + p0 + at, parts[k].tokens, (size_t)parts[k].n * sizeof *e->tok);
        memset(b->kind + at, !parts[k].kv ? ROW_UNSTORED : parts[k].fresh ? ROW_FRESH : ROW_STORED,
               (size_t)parts[k].n);
        if (parts[k].kv) {
            /* at share 1 every row is recomputed, layer by layer in position order, before
             * anything reads it: the stored copy would only be overwritten */
            if (recompute < 1)
                blend_import(e, &parts[k], p0 + at);
        } else {
            memset(b->sel + at, 1, (size_t)parts[k].n);
            b->forced += parts[k].n;
        }
    }
    b->reusable = n_reg - b->forced;
    b->want = recompute >= 1 ? b->reusable : (int)ceil(recompute * b->reusable);
    b->imported_bytes = recompute < 1 ? engine_kv_bytes(e, b->reusable) : 0;
    int check = b->want > 0 && b->want < b->reusable && c->n_layer > 1;
    if (b->want == b->reusable) memset(b->sel, 1, (size_t)n_reg);
    b->phase = check ? PHASE_LAYER0 : b->forced + b->want > 0 ? PHASE_LAYERS : PHASE_DONE;
    if (b->phase != PHASE_DONE) {
        size_t half = (size_t)(c->rope.n_rot / 2);
        b->x = malloc((size_t)n_reg * c->dim * sizeof *b->x);
        b->rope_c = malloc((size_t)n_reg * half * sizeof *b->rope_c + 1);
        b->rope_s = malloc((size_t)n_reg * half * sizeof *b->rope_s + 1);
        if (check) {
            b->dev = malloc((size_t)n_reg * sizeof *b->dev);
            b->rank = malloc((size_t)b->reusable * sizeof *b->rank);
        }
        if (!b->x || !b->rope_c || !b->rope_s || (check && (!b->dev || !b->rank))) goto oom;
        rope_rows(e, n_reg, p0 + e->rope_offset, b->rope_c, b->rope_s);
        for (int i = 0; i < n_reg; i++)
            r->be->weights_row(&e->m->tok_embd, e->tok[p0 + i], b->x + (size_t)i * c->dim);
    }
    r->stats.total_s += now_s() - t_start;
    return ENGINE_OK;
oom:
    blend_free(e);
    return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory for a blend of %d tokens", n_reg);
}

/* The probe begins: the question at positions p0 + n_reg.., after the region, run layer by
 * layer (probe_layer_step) over the KV as it stands, its KV written there (the sequence ends
 * before it: nothing reads it until a prefill writes those positions again) and the attention
 * that its last rows give the region summed into att. A probe that does not fit the context
 * or the pool, or memory, is left out (the choice is then by deviation alone). */
static void probe_start(struct Engine *e, struct Blend *b)
{
    struct Engine *r = e->runner;
    const struct ModelConfig *c = &e->m->cfg;
    size_t half = (size_t)(c->rope.n_rot / 2);
    int n = b->n_probe, p0 = b->p0 + b->n_reg;
    b->probe_l = c->n_layer;
    if (!n || n > e->opts.n_ctx - p0 || take_pages(e, p0 + n, NULL, 0)) return;
    int rows = n < ENGINE_BLEND_PROBE_ROWS ? n : ENGINE_BLEND_PROBE_ROWS;
    b->pb = (struct BlendProbe){.p0 = b->p0, .n_reg = b->n_reg, .first = p0 + n - rows};
    b->px = malloc((size_t)n * c->dim * sizeof *b->px);
    b->prc = malloc((size_t)n * half * sizeof *b->prc + 1);
    b->prs = malloc((size_t)n * half * sizeof *b->prs + 1);
    b->att = calloc((size_t)b->n_reg, sizeof *b->att);
    b->pb.scratch = malloc(e->be->attention_weights_scratch(p0 + n, c->head_dim, c->n_q_head,
                                                             c->n_kv_head, rows,
                                                             pool_threads(r->pool)));
    if (!b->px || !b->prc || !b->prs || !b->att || !b->pb.scratch ||
        blank_unstored(e, b->kind, b->p0, b->n_reg)) {
        free(b->att);
        b->att = NULL;
        return;
    }
    b->pb.sum = b->att;
    rope_rows(e, n, p0 + e->rope_offset, b->prc, b->prs);
    for (int i = 0; i < n; i++)
        r->be->weights_row(&e->m->tok_embd, b->probe[i], b->px + (size_t)i * c->dim);
    b->probe_l = 0;
}

/* One layer of the probe, all its rows (in blocks of the chunk's rows, whatever the step's
 * size: the sums then add up in the same order). */
static void probe_layer_step(struct Engine *e, struct Blend *b)
{
    e->probe = &b->pb;
    for (int at = 0; blend_block(e, b->probe_l, b->px, NULL, b->p0 + b->n_reg, b->n_probe,
                                 b->prc, b->prs, b->qpos, 1, 0, &at) > 0;) {}
    e->probe = NULL;
    b->probe_l++;
}

/* The choice: the `want` reusable rows of largest weight (the probe's attention times the
 * deviation, or the deviation alone) join the recomputed ones. */
static void blend_choose(struct Blend *b)
{
    const float *att = b->att;      /* NULL: the probe was left out */
    if (att) b->probed = b->n_probe;
    int nr = 0;
    for (int i = 0; i < b->n_reg; i++)
        if (!b->sel[i])
            b->rank[nr++] = (struct DevRank){att ? probe_weight(att[i], b->dev[i]) : b->dev[i], i};
    qsort(b->rank, (size_t)nr, sizeof *b->rank, dev_rank_cmp);
    for (int k = 0; k < b->want; k++) b->sel[b->rank[k].i] = 1;
}

int engine_blend_step(struct Engine *e, int tokens, int *done, struct EngineBlendStats *st,
                      char *err, size_t errlen)
{
    *done = 0;
    struct Blend *b = e ? e->blend : NULL;
    if (!b)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "no blend is in progress");
    struct Engine *r = e->runner;
    const struct ModelConfig *c = &e->m->cfg;
    double t_start = now_s();
    /* the work is counted in rows through one layer: a token's prefill is n_layer of them */
    long work = (long)(tokens > 0 ? tokens : 1) * c->n_layer, spent = 0;
    while (b->phase != PHASE_DONE && (spent == 0 || spent < work)) {
        if (atomic_exchange(&e->cancel, 0)) {
            int l = b->phase == PHASE_LAYERS ? b->l : 0;
            blend_free(e);
            r->stats.total_s += now_s() - t_start;
            return errmsg_set(err, errlen, ENGINE_ECANCELLED, "blend cancelled at layer %d", l);
        }
        /* a block holds no more rows than the step has left (the rows compute alike in
         * blocks of any size) */
        long room = work - spent;
        int cap = room < r->opts.chunk ? (int)room : r->opts.chunk;
        if (b->phase == PHASE_LAYER0) {
            /* layer 0 for every row, then the rows whose layer-1 values moved most, weighed
             * by the attention the probe gives them when there is one */
            int i0 = b->at;
            int n = blend_block(e, 0, b->x, NULL, b->p0, b->n_reg, b->rope_c, b->rope_s, b->qpos,
                                0, cap, &b->at);
            blend_deviation(e, b->x, b->p0, i0, n, b->dev);
            spent += n;
            if (b->at >= b->n_reg) {
                b->phase = PHASE_PROBE;
                probe_start(e, b);
            }
        } else if (b->phase == PHASE_PROBE) {
            if (b->probe_l < c->n_layer) {
                double t0 = now_s();
                probe_layer_step(e, b);
                b->probe_s += now_s() - t0;
                spent += b->n_probe;
            }
            if (b->probe_l >= c->n_layer) {
                blend_choose(b);
                b->phase = PHASE_LAYERS;
                b->l = 1;
                b->at = 0;
            }
        } else {
            int n = blend_block(e, b->l, b->x, b->sel, b->p0, b->n_reg, b->rope_c, b->rope_s,
                                b->qpos, 0, cap, &b->at);
            spent += n;
            if (n == 0 || b->at >= b->n_reg) {
                b->at = 0;
                if (++b->l == c->n_layer) b->phase = PHASE_DONE;
            }
        }
    }
    r->stats.total_s += now_s() - t_start;
    if (b->phase != PHASE_DONE) return ENGINE_OK;
    e->n_past = b->p0 + b->n_reg;
    e->mass_valid = 0;
    if (st) {
        memset(st, 0, sizeof *st);
        st->recomputed = b->forced + b->want;
        st->reused = b->reusable - b->want;
        for (int i = 0; i < b->n_reg; i++) st->fresh += b->kind[i] == ROW_FRESH && !b->sel[i];
        st->forced = b->forced;
        st->probed = b->probed;
        st->probe_s = b->probe_s;
        st->imported_bytes = b->imported_bytes;
    }
    r->stats.tokens += b->forced + b->want;
    blend_free(e);
    *done = 1;
    return ENGINE_OK;
}

int engine_blend(struct Engine *e, const struct EngineKvPart *parts, int n_parts, double recompute,
                 const int32_t *probe, int n_probe, struct EngineBlendStats *st, char *err,
                 size_t errlen)
{
    if (st) memset(st, 0, sizeof *st);
    int rc = engine_blend_begin(e, parts, n_parts, recompute, probe, n_probe, err, errlen);
    for (int done = 0; rc == ENGINE_OK && !done;)
        rc = engine_blend_step(e, INT_MAX / 256, &done, st, err, errlen);
    return rc;
}
