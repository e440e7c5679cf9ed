/* Chunk KV reuse (CacheBlend: arXiv 2405.16444; docs/kv-reuse.md): the export of a sequence's
 * KV and RoPE offsets, and the blend that places stored KV in a sequence, rotated to its new
 * positions, with a probe and a share of its tokens recomputed. CPU contexts only. */
#include "model/engine.h"
#include "model/engine_internal.h"
#include "text/errmsg.h"

#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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
void eng_probe_layer(struct Engine *e, int r0, int sn, const int32_t *qpos, int pos0,
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
    eng_layer_step(r, l, &seg, 1, n, n, flop);
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
        eng_run_matmul(r, &mv);
        eng_add_bias(s->v, (size_t)nkv, n, w->bv);
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

void eng_blend_free(struct Engine *e)
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
    int rc = eng_take_pages(e, p0 + n_reg, err, errlen);
    if (rc) return rc;

    struct Engine *r = e->runner;
    double t_start = eng_now_s();
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
        eng_rope_rows(e, n_reg, p0 + e->rope_offset, b->rope_c, b->rope_s);
        for (int i = 0; i < n_reg; i++)
            r->be->weights_row(&e->m->tok_embd, e->tok[p0 + i], b->x + (size_t)i * c->dim);
    }
    r->stats.total_s += eng_now_s() - t_start;
    return ENGINE_OK;
oom:
    eng_blend_free(e);
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
    if (!n || n > e->opts.n_ctx - p0 || eng_take_pages(e, p0 + n, NULL, 0)) return;
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
    eng_rope_rows(e, n, p0 + e->rope_offset, b->prc, b->prs);
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
    double t_start = eng_now_s();
    /* the work is counted in rows through one layer: a token's prefill is n_layer of them */
    long work = (long)(tokens > 0 ? tokens : 1) * c->n_layer, spent = 0;
    while (b->phase != PHASE_DONE && (spent == 0 || spent < work)) {
        if (atomic_exchange(&e->cancel, 0)) {
            int l = b->phase == PHASE_LAYERS ? b->l : 0;
            eng_blend_free(e);
            r->stats.total_s += eng_now_s() - t_start;
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
                double t0 = eng_now_s();
                probe_layer_step(e, b);
                b->probe_s += eng_now_s() - t0;
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
    r->stats.total_s += eng_now_s() - t_start;
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
    eng_blend_free(e);
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
