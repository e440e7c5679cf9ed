/* The decode loop and stop-string handling: output is released only once it can no longer
 * become part of a stop string, so streamed text never has to be taken back. */
#include "model/generate.h"
#include "model/lookup.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *finish_reason_name(enum FinishReason r)
{
    switch (r) {
    case FINISH_STOP: return "stop";
    case FINISH_LENGTH: return "length";
    case FINISH_CANCELLED: return "cancelled";
    case FINISH_ERROR: return "error";
    }
    return "error";
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct OutBuf { char *p; size_t len, cap; };

static int out_append(struct OutBuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) return -1;
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

/* Length of the longest suffix of text[0..len) that is a proper prefix of a stop string. */
static size_t held_back(const char *text, size_t len, const char *const *stop, size_t n_stop)
{
    size_t hold = 0;
    for (size_t i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        for (size_t k = sl > 1 ? sl - 1 : 0; k > hold; k--)
            if (k <= len && memcmp(text + len - k, stop[i], k) == 0) { hold = k; break; }
    }
    return hold;
}

struct GenState {
    const struct Model *m;
    struct GenParams p;
    gen_token_fn cb;
    void *user;
    struct Sampler *smp;
    struct OutBuf out;
    size_t emitted;
    struct TokStream ts;
    int index;
    int n_generated;
    enum FinishReason finish;
    struct QuoteCursor qc;      /* quote decoding: the answer's walk */
    float *masked;              /* quote decoding: (vocab) the allowed logits */
};

int gen_begin(const struct Model *m, const struct GenParams *p, gen_token_fn cb, void *user,
              struct GenState **out, char *err, size_t errlen)
{
    *out = NULL;
    struct GenState *g = calloc(1, sizeof *g);
    if (!g || sampler_new(&p->sampler, m->cfg.vocab, &g->smp) != 0) {
        free(g);
        snprintf(err, errlen, "out of memory");
        return ENGINE_ENOMEM;
    }
    g->m = m;
    g->p = *p;
    g->cb = cb;
    g->user = user;
    g->finish = FINISH_LENGTH;
    quote_cursor_init(&g->qc);
    if (p->quote && !(g->masked = malloc((size_t)m->cfg.vocab * sizeof *g->masked))) {
        sampler_destroy(&g->smp);
        free(g);
        snprintf(err, errlen, "out of memory");
        return ENGINE_ENOMEM;
    }
    tok_stream_init(&g->ts, m->tok);
    *out = g;
    return ENGINE_OK;
}

int gen_next(struct GenState *g, struct Engine *e, int32_t *next, char *err, size_t errlen)
{
    if (g->index >= g->p.max_tokens) return 0;
    const struct GenParams *p = &g->p;
    struct OutBuf *out = &g->out;
    struct GenToken gt = {.index = g->index++, .quote_removed = NAN};
    if (p->quote) {
        /* the draw over the allowed tokens; the signals of the model's own distribution */
        const float *lg = engine_logits(e);
        if (!lg) {
            snprintf(err, errlen, "quote decoding: the logits could not be read");
            return ENGINE_EDEVICE;
        }
        int nv = g->m->cfg.vocab;
        gt.quote_removed = quote_mask(p->quote, &g->qc, lg, nv, g->masked);
        gt.id = sampler_sample(g->smp, g->masked, NULL);
        sampler_signal(lg, nv, gt.id, &gt.sig);
        if (quote_advance(p->quote, &g->qc, gt.id)) {
            snprintf(err, errlen, "quote decoding drew token %d outside the documents", gt.id);
            return ENGINE_EINPUT;
        }
    } else {
        int rc = engine_sample(e, g->smp, &gt.id, &gt.sig, err, errlen);
        if (rc) return rc;
    }
    gt.mass = engine_attn_mass(e, &gt.n_mass);
    gt.hidden = engine_hidden(e, &gt.n_hidden);
    g->n_generated++;
    /* A control token (e.g. <|im_start|>) never belongs in an answer: it ends the turn like
     * EOS instead of leaking template text into the output. */
    int end = tok_is_end(g->m->tok, gt.id) || tok_is_special(g->m->tok, gt.id);
    char piece[512];
    int nb = end ? tok_stream_flush(&g->ts, piece, sizeof piece)
                 : tok_stream_feed(&g->ts, gt.id, piece, sizeof piece);
    if (nb < 0) nb = 0;
    if (out_append(out, piece, (size_t)nb)) {
        snprintf(err, errlen, "out of memory");
        return ENGINE_ENOMEM;
    }
    /* A stop string anywhere in the unreleased tail ends the output before it. */
    int stopped = end;
    for (size_t s = 0; s < p->n_stop && !stopped; s++) {
        size_t sl = strlen(p->stop[s]);
        size_t from = g->emitted > sl ? g->emitted - sl : 0;
        char *hit = sl ? memmem(out->p + from, out->len - from, p->stop[s], sl) : NULL;
        if (hit) { out->len = (size_t)(hit - out->p); out->p[out->len] = 0; stopped = 1; }
    }
    size_t release = stopped ? out->len : out->len - held_back(out->p, out->len, p->stop, p->n_stop);
    if (release < g->emitted) release = g->emitted;
    gt.text = out->p ? out->p + g->emitted : "";
    gt.text_len = release - g->emitted;
    g->emitted = release;
    if (g->cb && g->cb(g->user, &gt)) { g->finish = FINISH_CANCELLED; return 0; }
    if (stopped) { g->finish = FINISH_STOP; return 0; }
    if (g->index >= p->max_tokens) return 0;
    if (engine_n_past(e) >= engine_opts(e)->n_ctx) return 0; /* context full: length */
    *next = gt.id;
    return 1;
}

void gen_abort(struct GenState **pg)
{
    struct GenState *g = *pg;
    if (!g) return;
    free(g->out.p);
    free(g->masked);
    sampler_destroy(&g->smp);
    free(g);
    *pg = NULL;
}

int gen_end(struct GenState **pg, int cancelled, struct GenResult *r)
{
    struct GenState *g = *pg;
    int rc = ENGINE_OK;
    memset(r, 0, sizeof *r);
    if (cancelled) g->finish = FINISH_CANCELLED;
    if (g->finish != FINISH_STOP) {
        char tail[16];
        int nb = tok_stream_flush(&g->ts, tail, sizeof tail);
        if (nb > 0 && out_append(&g->out, tail, (size_t)nb)) rc = ENGINE_ENOMEM;
        /* Release what was held back for a stop string that never came. */
        if (rc == ENGINE_OK && g->cb && g->emitted < g->out.len) {
            struct GenToken gt = {.id = -1, .index = -1, .text = g->out.p + g->emitted,
                                  .text_len = g->out.len - g->emitted};
            g->cb(g->user, &gt);
        }
    }
    if (rc == ENGINE_OK && !g->out.p && out_append(&g->out, "", 0)) rc = ENGINE_ENOMEM;
    if (rc == ENGINE_OK) {
        r->text = g->out.p;
        r->text_len = g->out.len;
        g->out.p = NULL;
    }
    r->n_generated = g->n_generated;
    r->finish = rc ? FINISH_ERROR : g->finish;
    r->n_quotes = g->qc.n_spans;
    memcpy(r->quotes, g->qc.spans, sizeof r->quotes);
    gen_abort(pg);
    return rc;
}


/* Prompt lookup's state in generate: the history drafts come from (the prompt, then each
 * token once it is in the sequence) and the counts. */
struct Lookup {
    int32_t *hist;
    int n, cap;
    int drafted, accepted;
};

/* The tokens a verify step may draft after the one being decoded: within the context and the
 * chunk, and no more than the answer can still take (each row gives one token). */
int gen_draft_room(const struct GenState *g, const struct Engine *e)
{
    const struct EngineOpts *o = engine_opts(e);
    if (g->p.lookup <= 0 || o->device != ENGINE_CPU) return 0;
    int k = g->p.lookup < LOOKUP_MAX_DRAFT ? g->p.lookup : LOOKUP_MAX_DRAFT;
    int room[3] = {o->n_ctx - engine_n_past(e) - 1, o->chunk - 1, g->p.max_tokens - g->index - 1};
    for (int i = 0; i < 3; i++)
        if (room[i] < k) k = room[i];
    return k;
}

int gen_draft(const struct GenState *g, const int32_t *hist, int n, int32_t *draft, int k_max)
{
    int k = g->p.quote ? quote_draft(g->p.quote, &g->qc, draft, k_max) : 0;
    return k > 0 ? k : lookup_draft(hist, n, draft, k_max);
}

/* Decodes *next, then runs gen_next for what follows. With lookup, tokens drafted after *next
 * are verified in the same step and each row is handed to gen_next in turn while the model
 * keeps choosing the drafted token; the sequence is cut back after the last row kept, so the
 * tokens, their signals and the sequence are those of decoding them one by one. Returns
 * gen_next's 1 (with *next) or 0, a negative ENGINE_E* code, or 0 with *cancelled set. */
static int decode_next(struct GenState *g, struct Engine *e, struct Lookup *lk, int32_t *next,
                       int *cancelled, char *err, size_t errlen)
{
    int32_t row[LOOKUP_MAX_DRAFT + 1];
    int k = 0, rc;
    if (lk) {
        lk->hist[lk->n++] = *next;
        k = gen_draft(g, lk->hist, lk->n, row + 1, gen_draft_room(g, e));
    }
    row[0] = *next;
    rc = k ? engine_verify(e, row, k + 1, err, errlen) : engine_decode(e, *next, err, errlen);
    if (rc == ENGINE_ECANCELLED) { *cancelled = 1; return 0; }
    if (rc) return rc;
    if (!k) return gen_next(g, e, next, err, errlen);
    lk->drafted += k;
    for (int i = 0; i <= k; i++) {
        if (engine_verify_keep(e, i)) {
            snprintf(err, errlen, "verify step: row %d was not computed", i);
            return ENGINE_EINPUT;
        }
        rc = gen_next(g, e, next, err, errlen);
        if (rc != 1 || i == k || *next != row[i + 1]) return rc;
        lk->accepted++;
        lk->hist[lk->n++] = *next;
    }
    return rc;
}

/* Sets up prompt lookup for generate: NULL (and ENGINE_OK) when it is off, or on a context
 * that cannot verify. */
static int lookup_init(struct Lookup *lk, struct Engine *e, const struct GenParams *p,
                       const int32_t *prompt, size_t n_prompt, struct Lookup **out)
{
    *out = NULL;
    if (p->lookup <= 0 || engine_opts(e)->device != ENGINE_CPU) return ENGINE_OK;
    memset(lk, 0, sizeof *lk);
    lk->cap = (int)n_prompt + (p->max_tokens > 0 ? p->max_tokens : 0) + 1;
    if (!(lk->hist = malloc((size_t)lk->cap * sizeof *lk->hist))) return ENGINE_ENOMEM;
    memcpy(lk->hist, prompt, n_prompt * sizeof *prompt);
    lk->n = (int)n_prompt;
    *out = lk;
    return ENGINE_OK;
}

int generate(struct Engine *e, const int32_t *prompt, size_t n_prompt, const struct GenParams *p,
             gen_token_fn cb, void *user, struct GenResult *r, char *err, size_t errlen)
{
    memset(r, 0, sizeof *r);
    r->n_prompt = (int)n_prompt;
    r->finish = FINISH_ERROR;
    if (n_prompt == 0) {
        snprintf(err, errlen, "empty prompt");
        return ENGINE_EINPUT;
    }
    struct GenState *g = NULL;
    int rc = gen_begin(engine_model(e), p, cb, user, &g, err, errlen);
    if (rc) return rc;
    double t0 = now_ms();
    if (p->prefilled && engine_n_past(e) == (int)n_prompt) {
        rc = ENGINE_OK;
    } else {
        engine_reset(e);
        rc = engine_prefill(e, prompt, n_prompt, err, errlen);
    }
    double prefill_ms = now_ms() - t0;
    int cancelled = 0;
    if (rc == ENGINE_ECANCELLED) { cancelled = 1; rc = ENGINE_OK; }
    if (rc) { gen_abort(&g); return rc; }
    struct Lookup lks, *lk = NULL;
    if (lookup_init(&lks, e, p, prompt, n_prompt, &lk)) {
        gen_abort(&g);
        snprintf(err, errlen, "out of memory");
        return ENGINE_ENOMEM;
    }
    double t1 = now_ms();
    int32_t next;
    rc = cancelled ? 0 : gen_next(g, e, &next, err, errlen);
    while (rc == 1) rc = decode_next(g, e, lk, &next, &cancelled, err, errlen);
    double decode_ms = now_ms() - t1;
    if (lk) free(lk->hist);
    if (rc) { gen_abort(&g); return rc; }
    /* A prefill cancelled before any token ends with nothing generated. */
    rc = gen_end(&g, cancelled, r);
    r->n_prompt = (int)n_prompt;
    r->n_drafted = lk ? lk->drafted : 0;
    r->n_accepted = lk ? lk->accepted : 0;
    r->prefill_ms = prefill_ms;
    r->decode_ms = cancelled && r->n_generated == 0 ? 0 : decode_ms;
    if (rc) {
        snprintf(err, errlen, "out of memory");
        return rc;
    }
    return ENGINE_OK;
}
