/* Engine contexts: their options, the memory a context needs, creation (CPU and GPU contexts,
 * the sequences of a batch), the RoPE frequencies, reset and destruction, and the small
 * accessors. The forward pass is model/engine_step.c; the shared state model/engine_internal.h. */
#include "model/engine.h"
#include "kernels/gpu.h"
#include "model/engine_gpu.h"
#include "model/engine_internal.h"
#include "model/kvpool.h"
#include "model/model_ctx.h"
#include "model/sampler.h"
#include "text/errmsg.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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
    /* the prompt's tokens and its pages' names: the prefix cache's, as on the CPU */
    e->tok = malloc((size_t)e->opts.n_ctx * sizeof *e->tok);
    e->page_hash = malloc(kvpool_pages_for(e->opts.n_ctx) * sizeof *e->page_hash);
    if (!e->block || !e->inv_freq || !e->cls || !e->wq_off || !e->gpu_mass || !e->gpu_lam ||
        !e->gpu_watch || !e->gpu_cand || !e->tok || !e->page_hash)
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

void engine_destroy(struct Engine **pe)
{
    struct Engine *e = *pe;
    if (!e) return;
    eng_blend_free(e);
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
    eng_verify_free(e);
    free(e);
    *pe = NULL;
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

int engine_pages_for(const struct Engine *e, int n)
{
    if (n <= 0) return 0;
    if (e->gpu) return (n + GPU_PAGE - 1) / GPU_PAGE;
    return (int)kvpool_pages_for(n);
}

long engine_pages_total(const struct Engine *e)
{
    if (e->gpu) {
        int pages = 0;
        model_gpu_info(e->m, NULL, &pages, NULL);
        return pages;
    }
    if (!e->kv) return 0;
    struct KvPoolStats st;
    kvpool_stats(e->kv, &st);
    return (long)st.pages;
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

int engine_cached(const struct Engine *e) { return e->n_cached; }
int engine_n_past(const struct Engine *e) { return e->n_past; }
const struct Model *engine_model(const struct Engine *e) { return e->m; }
const struct EngineOpts *engine_opts(const struct Engine *e) { return &e->opts; }

void engine_reset(struct Engine *e)
{
    eng_blend_free(e);
    if (e->kv) kvpool_release(e->kv, e->pages, e->n_pages);
    if (e->gpu) gpu_seq_release(e->gpu);
    e->n_pages = e->n_named = e->prefill_end = e->n_cached = 0;
    e->n_past = e->rope_offset = 0;
    e->mass_valid = 0;
    e->hidden_valid = 0;
    e->vfy_rows = 0;
    atomic_store(&e->cancel, 0);
}

void engine_cancel(struct Engine *e) { atomic_store(&e->cancel, 1); }

void engine_stats(const struct Engine *e, struct EngineStats *out) { *out = e->stats; }

void engine_stats_reset(struct Engine *e) { memset(&e->stats, 0, sizeof e->stats); }
