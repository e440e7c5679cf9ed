/* `make bench-lookup`: prompt-lookup decoding (GenParams.lookup, model/lookup.h) against plain
 * decoding, greedy, on one CPU context.
 *
 * Two sets of prompts: (a) RAG: SQuAD 2.0 questions (dev, CC BY-SA 4.0; answerable ones,
 * spread over the file) over the daemon's prompt (retriever/context.h: frame, labelled chunks,
 * question) holding the question's own paragraph, whose answers copy from it; (b) free: chat
 * prompts asking for new text, with no document to copy. Each prompt is answered (up to
 * --max-tokens, default 64) without lookup and with each draft length of --lookup (default
 * 3,8), the runs of a prompt in an order that rotates from prompt to prompt so that every
 * variant meets the same machine state, and the answers must be the same. Decode speed is the
 * generated tokens after the first (which comes from the prefill) over the decode time, as
 * diffrag-run reports it.
 *
 * Prints per set and draft length: the median decode tokens/s off and on, the median of the
 * per-prompt speedups (on / off of the same prompt) and their range, the drafted tokens the model accepted (in
 * all), and the answers that differed (must be 0).
 *
 * --quote: the RAG answers, with lookup and without, in quote decoding over the placed
 * paragraph (model/quote.h), where drafts continue the span being quoted; the free-text set is
 * left out (it has no documents to quote).
 *
 * usage: bench_lookup MODEL SQUAD_DIR [--questions N] [--lookup K[,K...]] [--max-tokens N]
 *                     [--threads T] [--quote] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/jsonl.h"
#include "bench/stats.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/model.h"
#include "model/quote.h"
#include "model/tokcount_model.h"
#include "model/tokenizer.h"
#include "retriever/context.h"
#include "text/json.h"

struct Passage { char *id, *title, *text; };
struct Question { char *text, *gold; };

struct Data {
    struct Passage *ps;
    int n_ps, cap_ps;
    struct Question *qs;
    int n_qs, cap_qs;
};

static char *dup_field(json_t *o, const char *k)
{
    const char *v = bench_jstr(o, k);
    return v ? strdup(v) : NULL;
}

static void add_passage(json_t *o, void *user)
{
    struct Data *d = user;
    if (d->n_ps >= d->cap_ps) return;
    struct Passage *x = &d->ps[d->n_ps];
    x->id = dup_field(o, "id");
    x->title = dup_field(o, "title");
    x->text = dup_field(o, "text");
    if (x->id && x->title && x->text) {
        d->n_ps++;
    } else {
        free(x->id);
        free(x->title);
        free(x->text);
    }
}

/* answerable questions only */
static void add_question(json_t *o, void *user)
{
    struct Data *d = user;
    if (d->n_qs >= d->cap_qs || json_is_true(json_object_get(o, "is_impossible"))) return;
    struct Question *x = &d->qs[d->n_qs];
    x->text = dup_field(o, "question");
    x->gold = dup_field(o, "gold_passage_id");
    if (x->text && x->gold) {
        d->n_qs++;
    } else {
        free(x->text);
        free(x->gold);
    }
}

static const struct Passage *find_passage(const struct Data *d, const char *id)
{
    for (int i = 0; i < d->n_ps; i++)
        if (strcmp(d->ps[i].id, id) == 0) return &d->ps[i];
    return NULL;
}

/* Prompts that ask for new text, nothing in them to copy. */
static const char *const FREE[] = {
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a poem about the first snow of winter in a mountain village.",
    "Invent a recipe for a soup made from three unusual vegetables and describe it.",
    "Describe an imaginary city on the back of a giant turtle.",
    "Write a letter from a cat to its owner complaining about the new dog.",
    "Explain why the sky might be green on another planet, as a fairy tale.",
    "Write the opening of a detective novel set on a train in the desert.",
    "Describe a festival celebrated by people who live under the sea.",
    "Write a dialogue between a robot and a tree about the meaning of time.",
    "Write a travel diary entry from a visitor to a floating island market.",
    "Tell a story about a clockmaker whose clocks run backwards.",
    "Write a song about a river that flows uphill.",
    "Describe a museum of forgotten smells.",
    "Write a fable about a fox who learns to count stars.",
    "Describe the daily life of a librarian on the moon.",
    "Write a short myth explaining where thunder comes from.",
    "Write a short play about two snails racing.",
    "Describe a garden where the flowers sing at night.",
    "Write a story about a baker who bakes bread that grants wishes.",
    "Describe a school for young dragons.",
};
#define N_FREE (int)(sizeof FREE / sizeof *FREE)

#define MAX_VARIANTS 4

/* One draft length's figures over a set of prompts. */
struct Tally {
    int lookup;
    double *off, *on, *speedup;
    int n, differed;
    long drafted, accepted, generated;
};

static double decode_tok_s(const struct GenResult *r)
{
    return r->decode_ms > 0 && r->n_generated > 1 ? (r->n_generated - 1) / (r->decode_ms / 1e3) : 0;
}

/* Answers prompt without lookup (variant 0) and with each of the nv draft lengths of t[0..nv),
 * in an order that rotates with i, and adds the figures to each t. */
static int measure(struct Engine *e, const int32_t *prompt, size_t n, int max_tokens, int i,
                   const struct QuoteIndex *quote, struct Tally *t, int nv)
{
    char err[512];
    struct GenResult res[MAX_VARIANTS + 1];
    memset(res, 0, sizeof res);
    int rc = 0;
    for (int k = 0; k <= nv && !rc; k++) {
        int v = (k + i) % (nv + 1);
        struct GenParams gp = {.max_tokens = max_tokens, .lookup = v ? t[v - 1].lookup : 0,
                               .quote = quote};
        sampler_params_default(&gp.sampler);
        gp.sampler.temperature = 0;
        if ((rc = generate(e, prompt, n, &gp, NULL, NULL, &res[v], err, sizeof err)))
            fprintf(stderr, "bench_lookup: %s\n", err);
    }
    for (int v = 1; v <= nv && !rc; v++) {
        struct Tally *x = &t[v - 1];
        x->off[x->n] = decode_tok_s(&res[0]);
        x->on[x->n] = decode_tok_s(&res[v]);
        x->speedup[x->n] = x->off[x->n] > 0 ? x->on[x->n] / x->off[x->n] : 0;
        x->n++;
        x->differed += strcmp(res[0].text, res[v].text) != 0 ||
                       res[0].n_generated != res[v].n_generated;
        x->drafted += res[v].n_drafted;
        x->accepted += res[v].n_accepted;
        x->generated += res[v].n_generated;
    }
    for (int v = 0; v <= nv; v++) free(res[v].text);
    return rc ? -1 : 0;
}

static void report(const char *what, struct Tally *t)
{
    if (!t->n) return;
    long gen = t->generated;
    double off = median(t->off, t->n), on = median(t->on, t->n), sp = median(t->speedup, t->n);
    /* median sorted the speedups */
    double lo = t->speedup[0], hi = t->speedup[t->n - 1];
    printf("%s, lookup %d: %d prompts, %ld tokens; decode tok/s median off %.1f, on %.1f; "
           "speedup median %.2fx (prompts %.2f-%.2fx); drafted %ld, accepted %ld (%.0f%%; %.2f "
           "tokens a step); answers differing %d\n", what, t->lookup, t->n, gen, off, on, sp, lo,
           hi, t->drafted, t->accepted,
           t->drafted ? 100.0 * t->accepted / t->drafted : 0.0,
           gen > t->accepted ? (double)gen / (double)(gen - t->accepted) : 0.0, t->differed);
}

static int tally_new(struct Tally *t, int lookup, int n)
{
    memset(t, 0, sizeof *t);
    t->lookup = lookup;
    t->off = calloc((size_t)n, sizeof *t->off);
    t->on = calloc((size_t)n, sizeof *t->on);
    t->speedup = calloc((size_t)n, sizeof *t->speedup);
    return t->off && t->on && t->speedup ? 0 : -1;
}

static void tally_free(struct Tally *t)
{
    free(t->off);
    free(t->on);
    free(t->speedup);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_lookup MODEL SQUAD_DIR [--questions N] [--lookup K[,K...]] "
                        "[--max-tokens N] [--threads T] [--quote]\n");
        return 2;
    }
    int n_q = 20, max_tokens = 64, threads = 2, nv = 0, lookups[MAX_VARIANTS], quote = 0;
    const char *lookup_arg = "3,8";
    for (int i = 3; i < argc; i += 2) {
        if (!strcmp(argv[i], "--quote")) {
            quote = 1;
            i--;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "bench_lookup: %s needs a value\n", argv[i]);
            return 2;
        }
        int v = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--questions")) n_q = v;
        else if (!strcmp(argv[i], "--lookup")) lookup_arg = argv[i + 1];
        else if (!strcmp(argv[i], "--max-tokens")) max_tokens = v;
        else if (!strcmp(argv[i], "--threads")) threads = v;
        else {
            fprintf(stderr, "bench_lookup: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    for (const char *p = lookup_arg; *p && nv <= MAX_VARIANTS; p += strcspn(p, ","), p += *p == ',') {
        int k = atoi(p);
        if (nv < MAX_VARIANTS) lookups[nv] = k;
        nv = k < 1 ? MAX_VARIANTS + 1 : nv + 1;
    }
    if (n_q < 1 || nv < 1 || nv > MAX_VARIANTS || max_tokens < 2 || threads < 1) {
        fprintf(stderr, "bench_lookup: counts must be positive (at most %d draft lengths)\n",
                MAX_VARIANTS);
        return 2;
    }
    char err[512], path[4096];
    struct Data d = {.cap_ps = 30000, .cap_qs = 20000};
    d.ps = calloc((size_t)d.cap_ps, sizeof *d.ps);
    d.qs = calloc((size_t)d.cap_qs, sizeof *d.qs);
    snprintf(path, sizeof path, "%s/passages.jsonl", argv[2]);
    if (!d.ps || !d.qs || bench_each_line(path, add_passage, &d)) return 1;
    snprintf(path, sizeof path, "%s/questions.jsonl", argv[2]);
    if (bench_each_line(path, add_question, &d) || d.n_qs == 0) return 1;
    struct Model *m = NULL;
    if (model_load(argv[1], &m, err, sizeof err) != MODEL_OK) {
        fprintf(stderr, "bench_lookup: %s\n", err);
        return 1;
    }
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = 2048;
    o.n_threads = threads;
    struct Engine *e = NULL;
    if (engine_new(m, &o, &e, err, sizeof err)) {
        fprintf(stderr, "bench_lookup: %s\n", err);
        return 1;
    }
    struct TokenCounter tc;
    tokcount_from_tokenizer(m->tok, &tc);
    struct Tally rag[MAX_VARIANTS], fr[MAX_VARIANTS];
    for (int v = 0; v < nv; v++)
        if (tally_new(&rag[v], lookups[v], n_q) || tally_new(&fr[v], lookups[v], n_q)) return 1;
    printf("model %s, max_tokens %d, %d threads, engine %s%s\n", argv[1], max_tokens, threads,
           engine_numerics(), quote ? ", quote decoding (RAG prompts only)" : "");
    for (int i = 0; i < n_q; i++) {
        const struct Question *q = &d.qs[(size_t)i * d.n_qs / n_q];
        const struct Passage *p = find_passage(&d, q->gold);
        if (!p) continue;
        size_t n = strlen(p->text);
        struct CtxChunk ch = {.doc_id = p->id, .doc_id_len = strlen(p->id), .title = p->title,
                              .title_len = strlen(p->title), .text = p->text, .text_len = n,
                              .byte_end = n, .whole = 1};
        struct CtxOptions co = {.budget = (size_t)o.n_ctx - (size_t)max_tokens - 1};
        struct Context *cx = NULL;
        if (ctx_assemble(&tc, q->text, strlen(q->text), &ch, 1, &co, &cx, err, sizeof err)) {
            fprintf(stderr, "bench_lookup: %s\n", err);
            return 1;
        }
        /* --quote: every answer, with lookup or without, quotes the placed paragraph */
        struct QuoteIndex *qi = NULL;
        if (quote) {
            if (cx->n_cites != 1) {
                ctx_destroy(&cx);
                continue;   /* the paragraph did not fit: nothing to quote */
            }
            uint32_t span[2] = {(uint32_t)cx->cites[0].tokens.start,
                                (uint32_t)cx->cites[0].tokens.end};
            if (quote_index_new(cx->tokens, cx->n_tokens, span, 1, m->tok, &qi, err, sizeof err)) {
                fprintf(stderr, "bench_lookup: %s\n", err);
                return 1;
            }
        }
        int rc = measure(e, cx->tokens, cx->n_tokens, max_tokens, i, qi, rag, nv);
        quote_index_destroy(&qi);
        ctx_destroy(&cx);
        if (rc) return 1;
    }
    for (int i = 0; i < n_q && !quote; i++) {
        const char *u = FREE[i % N_FREE];
        struct ChatMessage msg = {CHAT_USER, u, strlen(u)};
        char text[1024];
        int32_t ids[512];
        size_t len = 0, n = 0;
        tok_chat_format(m->tok, &msg, 1, 1, text, sizeof text, &len);
        tok_encode(m->tok, text, len, TOK_ADD_BOS | TOK_PARSE_SPECIAL, ids, 512, &n);
        if (measure(e, ids, n < 512 ? n : 512, max_tokens, i, NULL, fr, nv)) return 1;
    }
    int bad = 0;
    for (int v = 0; v < nv; v++) {
        report("rag (SQuAD, the daemon's prompt)", &rag[v]);
        bad += rag[v].differed;
    }
    for (int v = 0; v < nv; v++) {
        report("free text (nothing to copy)", &fr[v]);
        bad += fr[v].differed;
        tally_free(&rag[v]);
        tally_free(&fr[v]);
    }
    engine_destroy(&e);
    model_destroy(&m);
    for (int i = 0; i < d.n_ps; i++) {
        free(d.ps[i].id);
        free(d.ps[i].title);
        free(d.ps[i].text);
    }
    for (int i = 0; i < d.n_qs; i++) {
        free(d.qs[i].text);
        free(d.qs[i].gold);
    }
    free(d.ps);
    free(d.qs);
    return bad ? 1 : 0;
}
