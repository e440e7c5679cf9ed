/* The forward pass and the calls over it (prefill, decode, batch steps, scoring, sampling),
 * with the RoPE tables, the pages a step takes and the prefix-cache pages a prefill publishes.
 * The pass over one sequence context: embedding, per layer RMSNorm -> attention (GQA
 * or DIFF V2; q, k and v biases where the model has them) -> residual -> RMSNorm -> SwiGLU
 * -> residual, final norm and LM head for the last position only. Chunked: activation memory is bounded by the chunk, not the context.
 * Each step is one backend call over the whole chunk, with the elementwise work fused into
 * the products (q/k/v/lambda in one job, residual adds as accumulating products, SwiGLU in
 * the gate/up job) so the chunk's activations are swept as few times as possible. */
#include "model/engine.h"
#include "model/engine_gpu.h"
#include "model/engine_internal.h"
#include "model/kvpool.h"
#include "model/sampler.h"
#include "text/errmsg.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* cos and sin of (pos0 + t) * inv_freq[i] for n positions, in double precision, times YaRN's
 * magnitude factor, into cs and sn (n_rot/2 a position). The angle of position p = 32a + b is
 * split as 32a f + b f and recombined by the addition formulas, so a chunk of n tokens needs (n / 32 + 32) evaluations
 * of each function per frequency instead of n: an 8,192-token chunk took 5.4 ms here, now
 * 1.7 ms, time a GPU prefill waits for. The split depends on the position only, not on where
 * the chunk starts, so a position's values are the same whatever chunk it falls in (which the
 * prefix cache and batching rely on). The two ways round the angle differently, by up to
 * |angle| * 1.1e-16 (1.4e-11 at 131,072 positions), against an f32 result's 6e-8. */
void eng_rope_rows(const struct Engine *e, int n, int pos0, float *cs, float *sn)
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
    eng_rope_rows(e, n, pos0, e->s.cos + (size_t)row0 * half, e->s.sin + (size_t)row0 * half);
}

double eng_now_s(void)
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

void eng_run_matmul(struct Engine *e, const struct MatmulArgs *a)
{
    double t = eng_now_s();
    e->be->matmul(e->pool, a, e->s.mm);
    e->stats.matmul_s += eng_now_s() - t;
    e->stats.matmul_flop += matmul_flop(a);
}

/* rows[t][0..len) += bias for the chunk's n rows (qwen2's q, k and v); nothing when NULL. A
 * pass over the chunk's q, k and v, small beside the product that wrote them. */
void eng_add_bias(float *rows, size_t len, int n, const float *bias)
{
    if (!bias) return;
    for (int t = 0; t < n; t++) {
        float *r = rows + (size_t)t * len;
        for (size_t i = 0; i < len; i++) r[i] += bias[i];
    }
}

/* Pages for positions up to end - 1. ENGINE_EBUDGET with err when the pool has none left. */
int eng_take_pages(struct Engine *e, int end, char *err, size_t errlen)
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

/* Publishes the full pages that prefills wrote, in order, for later prompts: in the CPU pool,
 * or in the GPU's (the same names, model/kvpool.h). */
static void publish_pages(struct Engine *e)
{
    struct KvPool *pool = e->kv;
    const int32_t *pages = e->pages;
    if (e->gpu) {
        int n_held;
        pool = model_gpu_pool(e->m);
        pages = gpu_seq_pages(e->gpu, &n_held);
    }
    int full = e->prefill_end / KV_TILE;
    for (; e->n_named < full; e->n_named++) {
        int i = e->n_named;
        const int32_t *t = e->tok + (size_t)i * KV_TILE;
        uint64_t h = kvpool_chain_hash(pool, i ? e->page_hash[i - 1] : 0, t);
        e->page_hash[i] = h;
        kvpool_publish(pool, pages[i], i ? pages[i - 1] : -1, h, t);
    }
}

/* A step on the GPU (runner r's device sequence computes every segment's rows; see
 * gpu_seq_step), the masses copied back for the watched layers. On a failure every segment's
 * context holds the device's error. */
static int forward_step_gpu(struct Engine *r, struct StepSeg *segs, int ns)
{
    enum { MAX_SEGS = 256 };
    const struct ModelConfig *c = &r->m->cfg;
    double t_start = eng_now_s();
    struct GpuStepSeg gs[MAX_SEGS];
    int n = 0;
    if (ns > MAX_SEGS) ns = MAX_SEGS;
    for (int i = 0; i < ns; i++) {
        struct Engine *e = segs[i].e;
        segs[i].row0 = n;
        memcpy(e->tok + e->n_past, segs[i].tokens, (size_t)segs[i].n * sizeof *e->tok);
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
            eng_fill_masses(e, l, e->gpu_lam + (size_t)l * c->n_head);
        }
        for (int t = 0; t < segs[i].n; t++)
            r->stats.attention_flop += 4.0 * (e->n_past + t + 1) * c->head_dim * c->n_q_head *
                                       c->n_layer;
        e->n_past += segs[i].n;
        e->mass_valid = e->n_watch > 0;
        e->hidden_valid = e->n_cap > 0;
    }
    r->stats.device_s += gpu_seq_last_seconds(r->gpu);
    r->stats.total_s += eng_now_s() - t_start;
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
        eng_run_matmul(r, a);
    }
    if (n > np) {
        a->n = n - np;
        a->rowwise = 0;
        a->onerow = 1;
        a->x = x0 + (size_t)np * a->x_stride;
        for (int o = 0; o < a->n_out; o++)
            if (a->out[o].y) a->out[o].y = y0[o] + (size_t)np * a->out[o].y_stride;
        eng_run_matmul(r, a);
    }
}

/* Segment g's rows [r0, r0 + sn) at positions pos0.. of layer l: queries and keys rotated, keys
 * and values stored, the watched heads measured at the last row (over the sequence's first
 * n_past + mass_n positions), then attention over the sequence's cache. */
static void attend_rows(struct Engine *r, int l, const struct StepSeg *g, int r0, int sn,
                        int pos0, int mass_n, void *kc, void *vc)
{
    const struct ModelConfig *c = &r->m->cfg;
    struct Scratch *s = &r->s;
    struct Engine *e = g->e;
    const struct KvPoolLayout *lay = &r->lay;
    int hd = c->head_dim, nq = c->n_q_head * hd, nkv = c->n_kv_head * hd, no = c->n_head * hd;
    struct RopeStoreArgs rs = {
        .q = s->q + (size_t)r0 * nq, .q_stride = (size_t)nq, .k = s->k + (size_t)r0 * nkv,
        .v = s->v + (size_t)r0 * nkv, .kv_stride = (size_t)nkv, .n_tok = sn, .pos0 = pos0,
        .n_q_head = c->n_q_head, .n_kv_head = c->n_kv_head, .head_dim = hd,
        .pos = g->qpos, .n_rot = c->rope.n_rot, .layout = c->rope.layout,
        .cos = s->cos + (size_t)r0 * (c->rope.n_rot / 2),
        .sin = s->sin + (size_t)r0 * (c->rope.n_rot / 2), .kcache = kc, .vcache = vc,
        .kv_type = r->opts.kv_type, .kv_head_stride = lay->head_stride,
        .pages = e->pages, .page_stride = lay->page_stride,
    };
    r->be->rope_store(r->pool, &rs);
    if (!g->quiet && e->wq_off[l + 1] > e->wq_off[l])
        eng_measure_layer(e, l, r0 + sn - 1, mass_n, kc);
    if (g->probe) eng_probe_layer(e, r0, sn, g->qpos, pos0, kc);
    struct AttnArgs a = {
        .q = s->q + (size_t)r0 * nq, .q_stride = (size_t)nq,
        .out = s->att + (size_t)r0 * no, .out_stride = (size_t)no,
        .k = kc, .v = vc, .kv_head_stride = lay->head_stride, .pages = e->pages,
        .page_stride = lay->page_stride, .kv_type = r->opts.kv_type, .n_tok = sn,
        .pos0 = pos0, .qpos = g->qpos, .n_q_head = c->n_q_head,
        .n_kv_head = c->n_kv_head, .head_dim = hd,
        .scale = 1.f / sqrtf((float)hd), .rowwise = g->prefill,
        .lambda = c->arch == ARCH_DIFFV2 ? s->lam + (size_t)r0 * c->n_head : NULL,
        .lambda_stride = (size_t)c->n_head,
    };
    double t = eng_now_s();
    r->be->attention(r->pool, &a, s->attn);
    r->stats.attention_s += eng_now_s() - t;
}

/* Layer l of a step on the CPU over rows [0, n) of runner r's scratch (s->x holds their
 * residual stream; rows [0, np) take the many-row products), computed with r's threads: each
 * segment's queries and keys rotated and stored at its positions, then its attention over its
 * sequence's cache. Segments of one sequence come in position order. */
void eng_layer_step(struct Engine *r, int l, struct StepSeg *segs, int ns, int n, int np,
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
    eng_add_bias(s->q, (size_t)nq, n, w->bq);
    eng_add_bias(s->k, (size_t)nkv, n, w->bk);
    eng_add_bias(s->v, (size_t)nkv, n, w->bv);
    for (int i = 0; i < ns; i++) {
        struct StepSeg *g = &segs[i];
        if (!g->verify) {
            attend_rows(r, l, g, g->row0, g->n, g->pos0, g->n, kc, vc);
            continue;
        }
        /* Row by row, as decode steps one after another would: row t's key and value are
         * stored before it attends, and its masses see the positions up to its own. */
        for (int t = 0; t < g->n; t++) {
            attend_rows(r, l, g, g->row0 + t, 1, g->pos0 + t, t + 1, kc, vc);
            if (g->e->wq_off[l + 1] > g->e->wq_off[l]) eng_verify_keep_masses(g->e, l, t);
        }
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
    double t_start = eng_now_s();
    int n = 0, np = 0;
    double attn_flop = 0;
    for (int i = 0; i < ns; i++) {
        struct StepSeg *g = &segs[i];
        g->row0 = n;
        g->pos0 = g->e->n_past;
        g->e->vfy_rows = 0;
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
        eng_capture_rows(r, l, segs, ns);
        eng_layer_step(r, l, segs, ns, n, np, attn_flop);
    }
    eng_capture_rows(r, c->n_layer, segs, ns);
    /* The logits of the segments that want them: their last rows, each through the LM head
     * as its own one-row product. */
    int nl = 0;
    for (int i = 0; i < ns; i++) {
        struct StepSeg *g = &segs[i];
        g->e->n_past += g->n;
        g->e->mass_valid = g->e->n_watch > 0;
        if (!g->quiet && !g->probe) g->e->hidden_valid = g->e->n_cap > 0;
        if (g->verify) {
            g->e->vfy_rows = g->n;
            g->e->vfy_base = g->pos0;
        }
        if (!g->want_logits || g->verify) continue;
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
            if (segs[i].want_logits && !segs[i].verify) only = segs[i].e;
        struct MatmulArgs lm = {
            .x = s->xb, .x_stride = (size_t)d, .n = nl, .k = d, .n_out = 1, .onerow = 1,
            .out = {{&m->output, nl == 1 ? only->logits : lg, (size_t)c->vocab, 0}},
        };
        eng_run_matmul(r, &lm);
        for (int i = 0, k = 0; i < ns && nl > 1; i++)
            if (segs[i].want_logits)
                memcpy(segs[i].e->logits, lg + (size_t)k++ * c->vocab,
                       (size_t)c->vocab * sizeof *lg);
    }
    for (int i = 0; i < ns; i++)
        if (segs[i].verify) eng_verify_logits(r, &segs[i]);
    r->stats.total_s += eng_now_s() - t_start;
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
        int rc = eng_take_pages(e, e->n_past + len, err, errlen);
        if (rc) return rc;
        if (forward_chunk(e, tokens + i, len, i + (size_t)len == n, prefill) != ENGINE_OK) {
            /* the failed chunk's positions may be half written: the sequence ends before it */
            return errmsg_set(err, errlen, ENGINE_EDEVICE, "after %zu of %zu tokens: %s", i, n,
                        e->gpu_err);
        }
        /* Only pages whose every position a prefill wrote are published: a decoded position
         * went through the one-row form and would not equal a cold prefill's. */
        if (prefill && e->prefill_end == e->n_past - len) {
            e->prefill_end = e->n_past;
            publish_pages(e);
        }
    }
    return ENGINE_OK;
}

/* Whether a prefix lookup may start the sequence: nothing in it, no page held. */
static int empty_seq(const struct Engine *e)
{
    int n_gpu = 0;
    if (e->gpu) gpu_seq_pages(e->gpu, &n_gpu);
    return e->n_past == 0 && e->n_pages == 0 && n_gpu == 0 && !e->rope_offset;
}

int engine_take_cached(struct Engine *e, const int32_t *prompt, size_t n)
{
    if (!empty_seq(e) || n < 2) return 0;
    /* the longest cached run of full pages, leaving the last token to compute */
    int max = (int)((n - 1) / KV_TILE), m;
    if (e->gpu) {
        m = gpu_seq_take_cached(e->gpu, prompt, n, max, e->page_hash);
    } else {
        m = kvpool_match(e->kv, prompt, n, max, e->pages, e->page_hash);
        e->n_pages = m;
    }
    e->n_named = m;
    memcpy(e->tok, prompt, (size_t)m * KV_TILE * sizeof *prompt);
    e->n_past = e->prefill_end = e->n_cached = m * KV_TILE;
    return e->n_cached;
}

int engine_peek_cached(const struct Engine *e, const int32_t *prompt, size_t n, int *idle_pages)
{
    *idle_pages = 0;
    if (!empty_seq(e) || n < 2) return 0;
    struct KvPool *pool = e->gpu ? model_gpu_pool(e->m) : e->kv;
    return kvpool_peek(pool, prompt, n, (int)((n - 1) / KV_TILE), idle_pages) * KV_TILE;
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
            if (!e || e->runner != r || it->n < 1 || !it->tokens ||
                (!it->prefill && !it->verify && it->n != 1) || (it->verify && it->prefill) ||
                e->blend)
                return errmsg_set(err, errlen, ENGINE_EINPUT, "bad step item %d", i);
            if (it->verify && r->gpu)
                return errmsg_set(err, errlen, ENGINE_EINPUT, "step item %d: verify steps run "
                                  "on CPU contexts only", i);
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
            if (it->verify && eng_verify_reserve(e, it->n)) {
                if (failed) *failed = i;
                return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory for a verify "
                                  "step's rows");
            }
            segs[k++] = (struct StepSeg){.e = e, .tokens = it->tokens, .n = it->n,
                                         .prefill = it->prefill, .verify = it->verify,
                                         .want_logits = it->logits && !it->verify};
            rows += it->n;
        }
    if (rows > r->opts.chunk)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a step of %d tokens is over the context's "
                          "%d", rows, r->opts.chunk);
    for (int i = 0; i < n_items; i++) {
        int rc = eng_take_pages(items[i].seq, items[i].seq->n_past + items[i].n, err, errlen);
        if (rc) {
            if (failed) *failed = i;
            return rc;
        }
    }
    if (r->gpu) {
        int rc = forward_step_gpu(r, segs, k);
        if (rc != ENGINE_OK)
            return errmsg_set(err, errlen, rc, "a step on the GPU: %s", r->gpu_err);
    } else if (forward_step(r, segs, k) != ENGINE_OK) {
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory for a step's logits");
    }
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

/* The largest logit less the second largest. */
static float logits_gap(const float *lg, int n)
{
    float a = -INFINITY, b = -INFINITY;
    for (int i = 0; i < n; i++)
        if (lg[i] > a) { b = a; a = lg[i]; }
        else if (lg[i] > b) b = lg[i];
    return a - b;
}

/* engine_score and engine_score_positions: the logits of every position, ROWS rows at a time
 * through the LM head, each scored against the next token. Optional outputs may be NULL. */
static int score_tokens(struct Engine *e, const int32_t *tokens, size_t n, float *nll,
                        int32_t *top, float *gap, double *nll_sum, size_t *n_scored, char *err, size_t errlen)
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
        rc = e->gpu ? ENGINE_OK : eng_take_pages(e, e->n_past + len, err, errlen);
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
            eng_run_matmul(e, &lm);
            for (int r = 0; r < nr; r++) {
                size_t pos = i + (size_t)r0 + r;
                if (pos + 1 >= n) break;
                const float *row = lg + (size_t)r * c->vocab;
                struct TokenSignal sig;
                sampler_signal(row, c->vocab, tokens[pos + 1], &sig);
                if (nll) nll[pos] = -sig.logprob;
                if (top) top[pos] = logits_argmax(row, c->vocab);
                if (gap) gap[pos] = logits_gap(row, c->vocab);
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
    return score_tokens(e, tokens, n, NULL, NULL, NULL, nll_sum, n_scored, err, errlen);
}

int engine_score_positions(struct Engine *e, const int32_t *tokens, size_t n, float *nll,
                           int32_t *top, float *gap, char *err, size_t errlen)
{
    return score_tokens(e, tokens, n, nll, top, gap, NULL, NULL, err, errlen);
}

int engine_decode(struct Engine *e, int32_t token, char *err, size_t errlen)
{
    return append_tokens(e, &token, 1, 0, err, errlen);
}

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
