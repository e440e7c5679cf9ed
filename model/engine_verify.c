/* Verify steps for speculative decoding: several decode tokens computed in one step, each row
 * exactly as its own decode step would compute it, and the sequence then cut back to end after
 * any of them. The rows' arithmetic is engine_step.c's; this file keeps what each row gives. */
#include "model/engine.h"
#include "model/engine_internal.h"
#include "text/errmsg.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

int eng_verify_reserve(struct Engine *e, int n)
{
    int d = e->m->cfg.dim, vocab = e->m->cfg.vocab;
    if (n <= e->vfy_cap && e->vfy_watch == e->n_watch && e->vfy_ncap == e->n_cap) return 0;
    int cap = n > e->vfy_cap ? n : e->vfy_cap;
    eng_verify_free(e);
    e->vfy_logits = malloc((size_t)cap * vocab * sizeof *e->vfy_logits);
    e->vfy_mass = e->n_watch ? malloc((size_t)cap * e->n_watch * sizeof *e->vfy_mass) : NULL;
    e->vfy_hidden = e->n_cap ? malloc((size_t)cap * e->n_cap * d * sizeof *e->vfy_hidden) : NULL;
    if (!e->vfy_logits || (e->n_watch && !e->vfy_mass) || (e->n_cap && !e->vfy_hidden)) {
        eng_verify_free(e);
        return ENGINE_ENOMEM;
    }
    e->vfy_cap = cap;
    e->vfy_watch = e->n_watch;
    e->vfy_ncap = e->n_cap;
    return 0;
}

void eng_verify_free(struct Engine *e)
{
    free(e->vfy_logits);
    free(e->vfy_mass);
    free(e->vfy_hidden);
    e->vfy_logits = NULL;
    e->vfy_mass = NULL;
    e->vfy_hidden = NULL;
    e->vfy_cap = e->vfy_watch = e->vfy_ncap = e->vfy_rows = 0;
}

void eng_verify_keep_masses(struct Engine *e, int l, int t)
{
    struct AttnMass *row = e->vfy_mass + (size_t)t * e->n_watch;
    for (int j = e->wq_off[l]; j < e->wq_off[l + 1]; j++) row[e->wq_watch[j]] = e->mass[e->wq_watch[j]];
}

void eng_verify_logits(struct Engine *r, const struct StepSeg *g)
{
    const struct Model *m = r->m;
    const struct ModelConfig *c = &m->cfg;
    struct Engine *e = g->e;
    int d = c->dim;
    /* each row normed alone and through the LM head's one-row product, as a decode step's is */
    for (int t = 0; t < g->n; t++)
        r->be->rmsnorm(r->pool, r->s.xb + (size_t)t * d, r->s.x + (size_t)(g->row0 + t) * d,
                       m->output_norm, 1, d, c->norm_eps);
    struct MatmulArgs lm = {
        .x = r->s.xb, .x_stride = (size_t)d, .n = g->n, .k = d, .n_out = 1, .onerow = 1,
        .out = {{&m->output, e->vfy_logits, (size_t)c->vocab, 0}},
    };
    eng_run_matmul(r, &lm);
    memcpy(e->logits, e->vfy_logits + (size_t)(g->n - 1) * c->vocab, (size_t)c->vocab * sizeof *e->logits);
}

int engine_verify(struct Engine *e, const int32_t *tokens, int n, char *err, size_t errlen)
{
    if (!e || !tokens || n < 1 || n > e->opts.chunk)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a verify step takes 1..%d tokens",
                          e ? e->opts.chunk : 0);
    if (e->gpu)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "verify steps run on CPU contexts only");
    if (atomic_exchange(&e->cancel, 0))
        return errmsg_set(err, errlen, ENGINE_ECANCELLED, "cancelled before a verify step");
    struct EngineBatchItem it = {.seq = e, .tokens = tokens, .n = n, .verify = 1};
    return engine_step(e->runner, &it, 1, NULL, err, errlen);
}

int engine_verify_keep(struct Engine *e, int i)
{
    if (i < 0 || i >= e->vfy_rows || e->vfy_watch != e->n_watch || e->vfy_ncap != e->n_cap)
        return ENGINE_EINPUT;
    const struct ModelConfig *c = &e->m->cfg;
    e->n_past = e->vfy_base + i + 1;
    memcpy(e->logits, e->vfy_logits + (size_t)i * c->vocab, (size_t)c->vocab * sizeof *e->logits);
    if (e->n_watch)
        memcpy(e->mass, e->vfy_mass + (size_t)i * e->n_watch, (size_t)e->n_watch * sizeof *e->mass);
    if (e->n_cap)
        memcpy(e->hidden, e->vfy_hidden + (size_t)i * e->n_cap * c->dim,
               (size_t)e->n_cap * c->dim * sizeof *e->hidden);
    return ENGINE_OK;
}
