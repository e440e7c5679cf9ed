/* Prompt-lookup decoding (model/lookup.h, engine_verify, GenParams.lookup): the drafts, a
 * verify step's rows against decode steps one by one, and generation with lookup against
 * plain decoding, token by token with every signal, over answers that copy the prompt and one
 * that does not, and at the edges (the context filling, a stop string, max_tokens and the end
 * of the turn inside a draft; sampling; quote decoding). Run from the repository root, on the
 * default model (models/SmolLM2-135M-Instruct.Q4_1.gguf) or the one DIFFRAG_TEST_MODEL
 * names; drafts must be accepted only on the default model, which copies. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/engine.h"
#include "model/generate.h"
#include "model/lookup.h"
#include "model/quote.h"
#include "tests/check.h"

static const char *DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

static const char *COPY_DOC =
    "The committee met on Tuesday to discuss the annual budget for the northern district, "
    "which includes the rebuilding of the old stone bridge over the river Alder and a new "
    "library for the village of Westholm.";

/* ---- lookup_draft ---- */

static void check_drafts(void)
{
    int32_t d[LOOKUP_MAX_DRAFT];
    /* the 3-token suffix (7 8 9) occurs at 1 and at 6: the later one is used */
    int32_t h1[] = {5, 7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 7, 8, 9};
    int n1 = (int)(sizeof h1 / sizeof *h1);
    CHECK(lookup_draft(h1, n1, d, 8) == 5 && d[0] == 3 && d[1] == 4 && d[4] == 9,
          "latest occurrence, up to the history's end (got %d...)", d[0]);
    CHECK(lookup_draft(h1, n1, d, 2) == 2 && d[0] == 3 && d[1] == 4, "k_max caps the draft");
    CHECK(lookup_draft(h1, n1, d, 0) == 0, "k_max 0 drafts nothing");
    /* no 3-token match; the 2-token suffix (8 9) follows 1 7 */
    int32_t h2[] = {1, 8, 9, 4, 5, 6, 2, 8, 9};
    CHECK(lookup_draft(h2, 9, d, 4) == 4 && d[0] == 4 && d[3] == 2, "falls back to 2 tokens");
    /* only the last token occurs before: a single token is not enough */
    int32_t h3[] = {1, 2, 3, 4, 5, 3};
    CHECK(lookup_draft(h3, 6, d, 4) == 0, "no draft from a 1-token match");
    CHECK(lookup_draft(h3, 1, d, 4) == 0, "no draft from a 1-token history");
    /* a run of one token repeats itself */
    int32_t h4[] = {6, 6, 6, 6};
    CHECK(lookup_draft(h4, 4, d, 4) == 1 && d[0] == 6, "overlapping match drafts what follows");
}

/* ---- a generation's record: every field a caller sees, token by token ---- */

struct Trace {
    unsigned char *buf;
    size_t len, cap;
    int n_tok;
    int dim;                  /* floats of a captured row */
    size_t at[1024];          /* where each token's record starts */
};

static void trace_put(struct Trace *t, const void *p, size_t n)
{
    if (t->len + n > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 65536;
        while (cap < t->len + n) cap *= 2;
        unsigned char *b = realloc(t->buf, cap);
        if (!b) abort();
        t->buf = b;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, p, n);
    t->len += n;
}

static int trace_cb(void *user, const struct GenToken *g)
{
    struct Trace *t = user;
    if (t->n_tok < 1024) t->at[t->n_tok] = t->len;
    t->n_tok++;
    trace_put(t, &g->id, sizeof g->id);
    trace_put(t, &g->index, sizeof g->index);
    trace_put(t, &g->sig, sizeof g->sig);
    trace_put(t, &g->quote_removed, sizeof g->quote_removed);
    trace_put(t, &g->n_mass, sizeof g->n_mass);
    if (g->n_mass) trace_put(t, g->mass, (size_t)g->n_mass * sizeof *g->mass);
    trace_put(t, &g->n_hidden, sizeof g->n_hidden);
    if (g->n_hidden) trace_put(t, g->hidden, (size_t)g->n_hidden * t->dim * sizeof *g->hidden);
    trace_put(t, &g->text_len, sizeof g->text_len);
    trace_put(t, g->text, g->text_len);
    return 0;
}

/* The first token whose record differs, or -1 when the records are equal. */
static int trace_diff(const struct Trace *a, const struct Trace *b)
{
    if (a->len == b->len && memcmp(a->buf, b->buf, a->len) == 0 && a->n_tok == b->n_tok)
        return -1;
    int n = a->n_tok < b->n_tok ? a->n_tok : b->n_tok;
    for (int i = 0; i < n && i < 1024; i++) {
        size_t end_a = i + 1 < a->n_tok ? a->at[i + 1] : a->len;
        size_t end_b = i + 1 < b->n_tok ? b->at[i + 1] : b->len;
        if (a->at[i] != b->at[i] || end_a != end_b ||
            memcmp(a->buf + a->at[i], b->buf + b->at[i], end_a - a->at[i]))
            return i;
    }
    return n;
}

struct Run {
    struct Trace trace;
    struct GenResult res;
    int rc;
};

static void run_free(struct Run *r)
{
    free(r->trace.buf);
    free(r->res.text);
    memset(r, 0, sizeof *r);
}

/* One generation of prompt on a fresh context of n_ctx positions, watching the default heads
 * and capturing two layers' rows. */
static void run_gen(const struct Model *m, const int32_t *prompt, size_t n, int n_ctx,
                    const struct GenParams *gp, struct Run *out)
{
    memset(out, 0, sizeof *out);
    char err[512];
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = n_ctx;
    o.chunk = 64;
    o.n_threads = 2;
    struct Engine *e = NULL;
    out->rc = engine_new(m, &o, &e, err, sizeof err);
    CHECK(out->rc == ENGINE_OK, "engine_new: %s", err);
    if (out->rc) return;
    struct AttnWatch w[ENGINE_MAX_WATCH];
    int nw = engine_default_watch(m, w, ENGINE_MAX_WATCH);
    int layers[2] = {m->cfg.n_layer / 2, m->cfg.n_layer};
    uint8_t *cls = calloc(n, 1);
    for (size_t i = 0; i < n / 2; i++) cls[i] = ATTN_DOC;
    CHECK(engine_watch(e, w, nw, err, sizeof err) == 0, "%s", err);
    CHECK(engine_capture(e, layers, 2, err, sizeof err) == 0, "%s", err);
    CHECK(engine_set_spans(e, cls, n, err, sizeof err) == 0, "%s", err);
    out->trace.dim = m->cfg.dim;
    out->rc = generate(e, prompt, n, gp, trace_cb, &out->trace, &out->res, err, sizeof err);
    CHECK(out->rc == ENGINE_OK, "generate: %s", err);
    free(cls);
    engine_destroy(&e);
}

/* Generates with lookup and without; every token's record, the text, the count and the
 * finish reason must be the same. Returns the tokens drafted and accepted. */
static void same_with_lookup(const struct Model *m, const char *what, const int32_t *prompt,
                             size_t n, int n_ctx, const struct GenParams *gp, int *drafted,
                             int *accepted)
{
    struct GenParams plain = *gp, look = *gp;
    plain.lookup = 0;
    if (!look.lookup) look.lookup = 8;
    struct Run a, b;
    run_gen(m, prompt, n, n_ctx, &plain, &a);
    run_gen(m, prompt, n, n_ctx, &look, &b);
    int d = trace_diff(&a.trace, &b.trace);
    CHECK(d < 0, "%s: token %d differs with lookup (of %d and %d)", what, d, a.trace.n_tok,
          b.trace.n_tok);
    CHECK(a.res.n_generated == b.res.n_generated && a.res.finish == b.res.finish &&
          a.res.text && b.res.text && strcmp(a.res.text, b.res.text) == 0,
          "%s: result differs: %d %s [%s] vs %d %s [%s]", what, a.res.n_generated,
          finish_reason_name(a.res.finish), a.res.text, b.res.n_generated,
          finish_reason_name(b.res.finish), b.res.text);
    CHECK(a.res.n_drafted == 0, "%s: no drafts without lookup", what);
    CHECK(b.res.n_accepted <= b.res.n_drafted, "%s: accepted <= drafted", what);
    printf("%s: %d tokens (%s), drafted %d, accepted %d\n", what, b.res.n_generated,
           finish_reason_name(b.res.finish), b.res.n_drafted, b.res.n_accepted);
    if (drafted) *drafted = b.res.n_drafted;
    if (accepted) *accepted = b.res.n_accepted;
    run_free(&a);
    run_free(&b);
}

/* The chat prompt asking the model to repeat the document (copy = 1; 2: the document ends the
 * message, so the prompt's end-of-turn token follows it) or to write something new (0). */
static size_t chat_prompt(const struct Model *m, int copy, int32_t *ids, size_t cap)
{
    char user[1024], text[2048];
    if (copy == 1)
        snprintf(user, sizeof user, "Document: %s\nRepeat the document exactly.", COPY_DOC);
    else if (copy == 2)
        snprintf(user, sizeof user, "Repeat this document exactly:\n%s", COPY_DOC);
    else
        snprintf(user, sizeof user, "Write a short poem about autumn leaves and rain.");
    struct ChatMessage msg = {CHAT_USER, user, strlen(user)};
    size_t len = 0, n = 0;
    tok_chat_format(m->tok, &msg, 1, 1, text, sizeof text, &len);
    tok_encode(m->tok, text, len, TOK_ADD_BOS | TOK_PARSE_SPECIAL, ids, cap, &n);
    return n < cap ? n : cap;
}

/* ---- engine_verify against decode steps ---- */

static void check_verify_rows(const struct Model *m, const int32_t *prompt, size_t n)
{
    char err[512];
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = (int)n + 64;
    o.chunk = 32;
    o.n_threads = 2;
    struct Engine *a = NULL, *b = NULL;
    CHECK(engine_new(m, &o, &a, err, sizeof err) == 0 && engine_new(m, &o, &b, err, sizeof err) == 0,
          "engine_new: %s", err);
    if (!a || !b) goto out;
    struct AttnWatch w[ENGINE_MAX_WATCH];
    int nw = engine_default_watch(m, w, ENGINE_MAX_WATCH), layers[1] = {1};
    int V = m->cfg.vocab, d = m->cfg.dim;
    enum { ROWS = 12 };
    int32_t toks[ROWS + 8];
    for (int i = 0; i < ROWS + 8; i++) toks[i] = prompt[(i * 7) % n];
    struct Engine *both[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        CHECK(engine_watch(both[k], w, nw, err, sizeof err) == 0, "%s", err);
        CHECK(engine_capture(both[k], layers, 1, err, sizeof err) == 0, "%s", err);
        CHECK(engine_prefill(both[k], prompt, n, err, sizeof err) == 0, "%s", err);
    }
    /* a: decode steps one by one, each row's outputs kept */
    float *lg = malloc((size_t)ROWS * V * sizeof *lg), *hid = malloc((size_t)ROWS * d * sizeof *hid);
    struct AttnMass *ms = malloc((size_t)ROWS * nw * sizeof *ms);
    for (int t = 0; t < ROWS; t++) {
        int nm, nh;
        CHECK(engine_decode(a, toks[t], err, sizeof err) == 0, "%s", err);
        memcpy(lg + (size_t)t * V, engine_logits(a), (size_t)V * sizeof *lg);
        memcpy(ms + (size_t)t * nw, engine_attn_mass(a, &nm), (size_t)nw * sizeof *ms);
        memcpy(hid + (size_t)t * d, engine_hidden(a, &nh), (size_t)d * sizeof *hid);
    }
    /* b: one verify step; every row is what the decode step gave, bit for bit */
    CHECK(engine_verify(b, toks, ROWS, err, sizeof err) == 0, "verify: %s", err);
    CHECK(engine_n_past(b) == (int)n + ROWS, "a verify step appends its rows");
    CHECK(memcmp(engine_logits(b), lg + (size_t)(ROWS - 1) * V, (size_t)V * sizeof *lg) == 0,
          "the last row's logits are current after the step");
    for (int t = 0; t < ROWS; t++) {
        int nm, nh;
        CHECK(engine_verify_keep(b, t) == 0, "keep %d", t);
        CHECK(engine_n_past(b) == (int)n + t + 1, "keep %d: n_past %d", t, engine_n_past(b));
        CHECK(memcmp(engine_logits(b), lg + (size_t)t * V, (size_t)V * sizeof *lg) == 0,
              "row %d: logits equal a decode step's", t);
        const struct AttnMass *bm = engine_attn_mass(b, &nm);
        CHECK(nm == nw && memcmp(bm, ms + (size_t)t * nw, (size_t)nw * sizeof *ms) == 0,
              "row %d: masses equal a decode step's", t);
        const float *bh = engine_hidden(b, &nh);
        CHECK(nh == 1 && memcmp(bh, hid + (size_t)t * d, (size_t)d * sizeof *hid) == 0,
              "row %d: captured row equals a decode step's", t);
    }
    CHECK(engine_verify_keep(b, ROWS) == ENGINE_EINPUT && engine_verify_keep(b, -1) == ENGINE_EINPUT,
          "keep refuses rows the step did not compute");
    /* KV rollback: keep 4 rows, then decode other tokens over the rejected positions; a
     * fresh sequence that decoded the same tokens one by one gives the same logits */
    CHECK(engine_verify_keep(b, 3) == 0, "keep 3");
    engine_reset(a);
    CHECK(engine_prefill(a, prompt, n, err, sizeof err) == 0, "%s", err);
    for (int t = 0; t < 4; t++) CHECK(engine_decode(a, toks[t], err, sizeof err) == 0, "%s", err);
    for (int t = 0; t < 6; t++) {
        int32_t other = toks[ROWS + t];
        CHECK(engine_decode(a, other, err, sizeof err) == 0 && engine_decode(b, other, err, sizeof err) == 0,
              "%s", err);
        CHECK(memcmp(engine_logits(a), engine_logits(b), (size_t)V * sizeof *lg) == 0,
              "after rollback, decode %d equals a sequence that never saw the rejected rows", t);
    }
    CHECK(engine_verify_keep(b, 0) == ENGINE_EINPUT, "a decode step ends the verify rows");
    /* a step too long for the chunk or the context is refused and leaves the sequence */
    int before = engine_n_past(b);
    int32_t many[40] = {0};
    CHECK(engine_verify(b, many, 40, err, sizeof err) == ENGINE_EINPUT, "over the chunk");
    CHECK(engine_verify(b, many, 0, err, sizeof err) == ENGINE_EINPUT, "no rows");
    CHECK(engine_n_past(b) == before, "refused steps leave the sequence");
    free(lg);
    free(hid);
    free(ms);
out:
    engine_destroy(&a);
    engine_destroy(&b);
}

/* ---- generation with lookup against plain decoding ---- */

static void check_generation(const struct Model *m, int real)
{
    int32_t copy[512], fresh[512];
    size_t nc = chat_prompt(m, 1, copy, 512), nf = chat_prompt(m, 0, fresh, 512);
    CHECK(nc > 40 && nf > 10, "prompts encoded (%zu, %zu tokens)", nc, nf);
    int drafted = 0, accepted = 0;
    struct GenParams gp = {.max_tokens = 80};
    sampler_params_default(&gp.sampler);
    gp.sampler.temperature = 0;

    same_with_lookup(m, "copying answer", copy, nc, (int)nc + 128, &gp, &drafted, &accepted);
    if (real)
        CHECK(accepted >= 20, "a copying answer takes drafts (%d of %d accepted)", accepted,
              drafted);
    same_with_lookup(m, "fresh answer", fresh, nf, (int)nf + 128, &gp, NULL, NULL);
    struct GenParams g16 = gp;
    g16.lookup = 16;
    same_with_lookup(m, "copying answer, drafts of 16", copy, nc, (int)nc + 128, &g16, NULL, NULL);

    /* the context fills inside a draft: every size up to the answer's length ends there
     * (DIFFRAG_TEST_SCALE=small, valgrind's pass: every ninth size, and of max_tokens below) */
    int stride = check_small_scale() ? 9 : 3;
    if (stride > 3) printf("reduced scale (DIFFRAG_TEST_SCALE=small): every ninth size\n");
    for (int room = 1; room <= 24; room += stride) {
        char what[64];
        snprintf(what, sizeof what, "context full after %d tokens", room);
        same_with_lookup(m, what, copy, nc, (int)nc + room, &gp, NULL, NULL);
    }
    /* max_tokens inside a draft */
    for (int mt = 1; mt <= 20; mt += stride) {
        struct GenParams g = gp;
        g.max_tokens = mt;
        char what[64];
        snprintf(what, sizeof what, "max_tokens %d", mt);
        same_with_lookup(m, what, copy, nc, (int)nc + 128, &g, NULL, NULL);
    }
    /* stop strings that the copied text reaches inside an accepted draft */
    const char *stops[] = {"bridge", "river Al", "Westholm.", ", "};
    for (int i = 0; i < 4; i++) {
        struct GenParams g = gp;
        g.stop = &stops[i];
        g.n_stop = 1;
        char what[64];
        snprintf(what, sizeof what, "stop string \"%s\"", stops[i]);
        same_with_lookup(m, what, copy, nc, (int)nc + 128, &g, NULL, NULL);
    }
    /* sampling: each row is drawn from a decode step's logits with the sampler's next draw, so
     * the sampled answer is the same too */
    struct GenParams gs = gp;
    gs.sampler.temperature = 0.7f;
    gs.sampler.top_p = 0.95f;
    gs.sampler.seed = 42;
    same_with_lookup(m, "sampled copying answer", copy, nc, (int)nc + 128, &gs, NULL, NULL);
    gs.sampler.temperature = 1.2f;
    gs.sampler.seed = 7;
    same_with_lookup(m, "sampled fresh answer", fresh, nf, (int)nf + 128, &gs, NULL, NULL);
}

/* The end of the turn inside a draft: the prompt's own end-of-turn token follows the copied
 * text in the prompt, so the draft that finishes the copy carries it; and quote decoding. */
static void check_end_and_quote(const struct Model *m, int real)
{
    int32_t copy[512], last[512 + 120];
    size_t nl = chat_prompt(m, 2, last, 512);
    struct GenParams gp = {.max_tokens = 120};
    sampler_params_default(&gp.sampler);
    gp.sampler.temperature = 0;
    same_with_lookup(m, "to the end of the turn", last, nl, (int)nl + 160, &gp, NULL, NULL);
    /* the answer's last token ends the turn, and the draft made before it carries it */
    struct Run r;
    run_gen(m, last, nl, (int)nl + 160, &gp, &r);
    int n = r.trace.n_tok, ids_ok = n > 1 && n < 120;
    for (int i = 0; ids_ok && i < n - 1; i++)
        memcpy(&last[nl + i], r.trace.buf + r.trace.at[i], sizeof *last);
    int32_t end = 0, d[LOOKUP_MAX_DRAFT];
    if (ids_ok) memcpy(&end, r.trace.buf + r.trace.at[n - 1], sizeof end);
    int k = ids_ok ? lookup_draft(last, (int)nl + n - 2, d, 8) : 0;
    if (real)
        CHECK(r.res.finish == FINISH_STOP && tok_is_end(m->tok, end) && k >= 2 && d[1] == end,
              "the end of the turn comes inside a draft (%d tokens, draft of %d)", n, k);
    run_free(&r);
    size_t nc = chat_prompt(m, 1, copy, 512);
    /* quote decoding over the document's tokens in the prompt */
    char err[256];
    int32_t doc[256];
    size_t nd = 0;
    tok_encode(m->tok, COPY_DOC, strlen(COPY_DOC), 0, doc, 256, &nd);
    size_t at = 0;
    for (size_t i = 0; i + nd <= nc && !at; i++)
        if (memcmp(copy + i + 1, doc + 1, (nd - 2) * sizeof *doc) == 0) at = i;
    uint32_t spans[2] = {(uint32_t)at, (uint32_t)(at + nd)};
    struct QuoteIndex *q = NULL;
    CHECK(at > 0 && quote_index_new(copy, nc, spans, 1, m->tok, &q, err, sizeof err) == 0,
          "quote index over the document (at %zu): %s", at, err);
    if (!q) return;
    gp.quote = q;
    int drafted = 0, accepted = 0;
    same_with_lookup(m, "quote decoding", copy, nc, (int)nc + 160, &gp, &drafted, &accepted);
    /* drafts continue the span being quoted (quote_draft): the model, held to the documents,
     * takes nearly all of them */
    if (real)
        CHECK(accepted >= 30 && accepted * 10 >= drafted * 9,
              "quote decoding takes its drafts (%d of %d accepted)", accepted, drafted);
    quote_index_destroy(&q);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    check_drafts();
    const char *path = getenv("DIFFRAG_TEST_MODEL");
    int real = !path || !*path;
    if (real) path = DEFAULT_MODEL;
    char err[512];
    struct Model *m = NULL;
    if (model_load(path, &m, err, sizeof err) != MODEL_OK) {
        printf("FAIL cannot load %s: %s\n", path, err);
        return 1;
    }
    int32_t copy[512];
    size_t nc = chat_prompt(m, 1, copy, 512);
    check_verify_rows(m, copy, nc);
    check_generation(m, real);
    check_end_and_quote(m, real);
    model_destroy(&m);
    return check_report("test_lookup");
}
