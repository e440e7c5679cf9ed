/* The signals a step captures for groundedness (docs/groundedness.md): the attention mass of
 * the watched heads on the document spans and on the generated positions, and the residual
 * stream of the captured layers; the calls that set them up and read them back. */
#include "model/engine.h"
#include "model/engine_gpu.h"
#include "model/engine_internal.h"
#include "text/errmsg.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The watched heads of layer l at the last position of the sequence's n tokens in this step,
 * step row `row` (its queries are in s->q after RoPE, its keys already in the cache kc). */
void eng_measure_layer(struct Engine *e, int l, int row, int n, const void *kc)
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
    eng_fill_masses(e, l, e->s.lam + (size_t)row * c->n_head);
}

/* The AttnMass entries of layer l's watched heads from their query heads' masses in wq_mass
 * and the position's lambda logits (DIFF V2). */
void eng_fill_masses(struct Engine *e, int l, const float *lam_row)
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

/* Keeps, for each segment that captures layer l (engine_capture), its last row of the residual
 * stream as it enters layer l (l = n_layer: after the last layer). A blend's quiet rows and its
 * probe are not positions the caller evaluates, so they keep nothing. */
void eng_capture_rows(struct Engine *r, int l, const struct StepSeg *segs, int ns)
{
    int d = r->m->cfg.dim;
    for (int i = 0; i < ns; i++) {
        struct Engine *e = segs[i].e;
        if (segs[i].quiet || segs[i].probe) continue;
        for (int j = 0; j < e->n_cap; j++) {
            if (e->cap_layer[j] != l) continue;
            memcpy(e->hidden + (size_t)j * d, r->s.x + (size_t)(segs[i].row0 + segs[i].n - 1) * d,
                   (size_t)d * sizeof *e->hidden);
            for (int t = 0; segs[i].verify && t < segs[i].n; t++)
                memcpy(e->vfy_hidden + ((size_t)t * e->n_cap + j) * d,
                       r->s.x + (size_t)(segs[i].row0 + t) * d, (size_t)d * sizeof *e->hidden);
        }
    }
}

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
