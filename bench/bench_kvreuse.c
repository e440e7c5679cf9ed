/* `make bench-kvreuse`: chunk KV reuse (engine_blend, docs/kv-reuse.md) against full prefills.
 *
 * For each context budget (default 8K, 16K and 32K tokens) it asks SQuAD 2.0 questions (dev,
 * CC BY-SA 4.0; answerable ones, spread over the file) over a retrieved context of that size:
 * the question's own paragraph among paragraphs of other articles, one shared set of
 * paragraphs a budget in a different order for each question (retrieval brings the same
 * chunks back in other orders), the gold paragraph at a depth that moves from question to
 * question. The prompt is the daemon's (retriever/context.h: frame, labelled chunks,
 * question). Each question runs
 *   off: the whole prompt prefilled (the prefix cache takes what it can: the frame);
 *   on:  the frame prefilled, the documents blended (every chunk's stored KV, its label and
 *        separator computed, the recompute share), the question prefilled;
 * on one context, off and then on at each recompute share asked for (--shares), and the time
 * to first token (the prompt's last logits) of each is taken; then the greedy answer (up to 24
 * tokens) of each. "On" runs the daemon's path (model/chunkkv.h: the chunk store, blends
 * from it, the question as the probe that weighs which tokens are recomputed); with
 * --selections probe,deviation it also runs without the probe (the tokens whose values moved
 * most). Every chunk's KV is made at its first use, after the frame and its copy label (the
 * daemon's; --copies frame: after the frame alone; --copies label,frame: both, side by side;
 * --copies gold: as label, but the question's gold paragraph is computed in the blend, as its
 * labels are, an upper bound for recomputing the chunk that holds the answer; --copies full:
 * as label, with the --full N (default 2) chunks that BM25 over the placed paragraphs ranks
 * best for the question computed in full, as the daemon's kv_reuse_full_chunks does), before
 * the question that first uses it is timed (an untimed blend at share 0); that cost is printed
 * apart.
 * Then each "on" is blended again and fed the full prefill's answer, token by token, for the
 * mean KL divergence of its next-token distributions from the full prefill's over the whole
 * answer (the answer's divergence, which a first token alone understates).
 * Prints per budget, share and selection the median time to first token off and on and their
 * ratio (target: 3x at 16K), the answers that contain a gold answer off and on, the answers
 * equal to the full prefill's, the first answer tokens equal to its, the median KL divergence
 * of the first token's distribution and the mean over the answer (each the median over the
 * questions), and the stored KV bytes a token.
 *
 * With --shared G, G questions share one context: their gold paragraphs (spread over its depths)
 * among other articles' paragraphs, the same documents in every one's prompt, as when the
 * questions are asked of one collection; the full prefill of the documents is then made once
 * a context (the group's first prompt gives the time to first token, the others take the
 * documents from the prefix cache), which makes larger samples affordable. The blend is made
 * for every question, since the question weighs it. --answer-kl 0 leaves out the answer's
 * divergence (a second blend a question).
 * Also printed: SQuAD's word F1 off and on, and the questions only one side answered.
 *
 * Usage: bench_kvreuse MODEL SQUAD_DIR [--budgets 8192,16384,32768] [--questions N]
 *        [--shares 0.15,...] [--selections probe,deviation] [--threads T] [--kv f16|q8]
 *        [--shared G] [--answer-kl 0|1] [--copies label,frame,gold,full] [--full N] */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/jsonl.h"
#include "bench/stats.h"
#include "model/chunkkv.h"
#include "model/engine.h"
#include "model/kvpool.h"
#include "model/model.h"
#include "model/tokcount_model.h"
#include "model/tokenizer.h"
#include "retriever/context.h"
#include "retriever/memindex.h"
#include "text/json.h"

struct Passage {
    char *id, *title, *text;
    int article;          /* index of its title among the titles, in file order */
};

struct Question {
    char *text, *gold;
    char **answers;
    int n_answers;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct Data {
    struct Passage *ps;
    int n_ps, cap_ps;
    struct Question *qs;
    int n_qs, cap_qs;
    char **titles;
    int n_titles;
};

static void add_passage(json_t *o, void *user)
{
    struct Data *d = user;
    const char *id = bench_jstr(o, "id"), *title = bench_jstr(o, "title"), *text = bench_jstr(o, "text");
    if (!id || !title || !text) return;
    if (d->n_ps == d->cap_ps) {
        d->cap_ps = d->cap_ps ? 2 * d->cap_ps : 1024;
        d->ps = realloc(d->ps, (size_t)d->cap_ps * sizeof *d->ps);
        d->titles = realloc(d->titles, (size_t)d->cap_ps * sizeof *d->titles);
    }
    int a = 0;
    while (a < d->n_titles && strcmp(d->titles[a], title)) a++;
    if (a == d->n_titles) d->titles[d->n_titles++] = strdup(title);
    d->ps[d->n_ps++] = (struct Passage){strdup(id), strdup(title), strdup(text), a};
}

static void add_question(json_t *o, void *user)
{
    struct Data *d = user;
    const char *q = bench_jstr(o, "question"), *gold = bench_jstr(o, "gold_passage_id");
    json_t *ans = json_object_get(o, "answers");
    if (!q || !gold || json_is_true(json_object_get(o, "is_impossible")) || !json_is_array(ans) ||
        json_array_size(ans) == 0)
        return;
    if (d->n_qs == d->cap_qs) {
        d->cap_qs = d->cap_qs ? 2 * d->cap_qs : 1024;
        d->qs = realloc(d->qs, (size_t)d->cap_qs * sizeof *d->qs);
    }
    struct Question *x = &d->qs[d->n_qs++];
    x->text = strdup(q);
    x->gold = strdup(gold);
    x->n_answers = (int)json_array_size(ans);
    x->answers = calloc((size_t)x->n_answers, sizeof *x->answers);
    for (int i = 0; i < x->n_answers; i++) {
        json_t *a = json_array_get(ans, (size_t)i);
        x->answers[i] = strdup(json_is_string(a) ? json_string_value(a) : "");
    }
}

/* Lower-cased alphanumerics only, for "the answer contains a gold answer". */
static void norm(const char *s, char *out, size_t cap)
{
    size_t n = 0;
    for (; *s && n + 1 < cap; s++)
        if (isalnum((unsigned char)*s)) out[n++] = (char)tolower((unsigned char)*s);
    out[n] = 0;
}

static int contains_gold(const char *answer, const struct Question *q)
{
    char a[4096], g[1024];
    norm(answer, a, sizeof a);
    for (int i = 0; i < q->n_answers; i++) {
        norm(q->answers[i], g, sizeof g);
        if (g[0] && strstr(a, g)) return 1;
    }
    return 0;
}

/* SQuAD's word F1 of an answer against the best of the gold answers: lower case, punctuation
 * and the articles a, an, the dropped, words split at white space. */
static int squad_words(const char *s, char words[][32], int cap)
{
    int n = 0;
    while (*s && n < cap) {
        while (*s && (isspace((unsigned char)*s) || ispunct((unsigned char)*s))) s++;
        int len = 0;
        while (*s && !isspace((unsigned char)*s)) {
            if (!ispunct((unsigned char)*s) && len < 31)
                words[n][len++] = (char)tolower((unsigned char)*s);
            s++;
        }
        words[n][len] = 0;
        if (len && strcmp(words[n], "a") && strcmp(words[n], "an") && strcmp(words[n], "the"))
            n++;
    }
    return n;
}

static double squad_f1(const char *answer, const struct Question *q)
{
    enum { MAX_WORDS = 256 };
    static char a[MAX_WORDS][32], g[MAX_WORDS][32];
    int na = squad_words(answer, a, MAX_WORDS);
    double best = 0;
    for (int i = 0; i < q->n_answers; i++) {
        int ng = squad_words(q->answers[i], g, MAX_WORDS), common = 0;
        unsigned char used[MAX_WORDS] = {0};
        for (int x = 0; x < na; x++)
            for (int y = 0; y < ng; y++)
                if (!used[y] && !strcmp(a[x], g[y])) {
                    used[y] = 1;
                    common++;
                    break;
                }
        if (!common) continue;
        double p = (double)common / na, r = (double)common / ng, f = 2 * p * r / (p + r);
        if (f > best) best = f;
    }
    return best;
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb3f97185e4cbULL;
    return x ^ (x >> 33);
}

/* Fisher-Yates over idx[0..n), its swaps drawn from mix(base + i): the same order for the
 * same base. */
static void shuffle(int *idx, int n, uint64_t base)
{
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(mix(base + (uint64_t)i) % (uint64_t)(i + 1));
        int t = idx[i]; idx[i] = idx[j]; idx[j] = t;
    }
}

/* --copies: what the chunks' copies are made after, by its index in cps */
static const char *const COPIES[] = {"frame", "label", "gold", "full"};

/* The placed chunks' ranks by the retriever's BM25 over them (an in-memory index of the
 * placed paragraphs, as for inline documents): ranks[c] for cite c, 0 the best; chunks no hit
 * names come after, in prompt order. 0, or -1 (err set). */
static int bm25_ranks(const struct TokenCounter *tc, const struct Context *cx,
                      const struct CtxChunk *ch, const char *question, uint32_t *ranks,
                      char *err, size_t errlen)
{
    size_t nc = cx->n_cites, n_hits = 0;
    struct StoreDoc *docs = calloc(nc + 1, sizeof *docs);
    struct SearchHit *hits = calloc(4 * nc + 1, sizeof *hits);
    struct MemIndex *mi = NULL;
    int rc = -1;
    if (!docs || !hits) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (size_t c = 0; c < nc; c++) {
        const struct CtxChunk *k = &ch[cx->cites[c].rank];
        docs[c] = (struct StoreDoc){k->doc_id, k->doc_id_len, k->text, k->text_len, k->title,
                                    k->title_len, NULL, 0};
        ranks[c] = UINT32_MAX;
    }
    struct SearchOptions so;
    search_options_default(&so);
    so.k = 4 * nc;
    if (memidx_build(docs, nc, NULL, 0, tc, &mi, err, errlen) ||
        memidx_search(mi, question, strlen(question), &so, hits, 4 * nc, &n_hits, NULL, err,
                      errlen))
        goto out;
    uint32_t next = 0;
    for (size_t h = 0; h < n_hits; h++)
        for (size_t c = 0; c < nc; c++)
            if (ranks[c] == UINT32_MAX && hits[h].doc_id_len == docs[c].id_len &&
                !memcmp(hits[h].doc_id, docs[c].id, docs[c].id_len))
                ranks[c] = next++;
    for (size_t c = 0; c < nc; c++)
        if (ranks[c] == UINT32_MAX) ranks[c] = next++;
    rc = 0;
out:
    memidx_destroy(&mi);
    free(hits);
    free(docs);
    return rc;
}

static struct CtxChunk chunk_of(const struct Passage *p)
{
    size_t n = strlen(p->text);
    return (struct CtxChunk){.doc_id = p->id, .doc_id_len = strlen(p->id), .title = p->title,
                             .title_len = strlen(p->title), .text = p->text, .text_len = n,
                             .byte_end = n};
}

static int gold_passage(const struct Data *d, const struct Question *q)
{
    for (int i = 0; i < d->n_ps; i++)
        if (!strcmp(d->ps[i].id, q->gold)) return i;
    return -1;
}

/* The chunks of question qi's own context (without --shared): its gold paragraph among
 * paragraphs of other articles (one set a budget, in this question's order), at a depth that
 * moves with the question, into ch (room for d->n_ps + 1). Their number, or -1. */
static int question_chunks(const struct Data *d, int gold, int qi, int budget,
                           struct CtxChunk *ch)
{
    int *idx = calloc((size_t)d->n_ps, sizeof *idx), nc = 0;
    if (!idx) return -1;
    for (int i = 0; i < d->n_ps; i++)
        if (d->ps[i].article != d->ps[gold].article) idx[nc++] = i;
    shuffle(idx, nc, 0x5eedULL * 1000);  /* the budget's set: the first of a fixed shuffle */
    int set = budget / 130 + 8; /* more than the budget holds: assembly stops it */
    if (set > nc) set = nc;
    shuffle(idx, set, (uint64_t)qi * 7919);
    /* well inside what the budget holds (paragraphs are about 150 tokens) */
    double frac = qi * 0.381966 - floor(qi * 0.381966);
    int depth = (int)(frac * (budget / 200)), n_ch = 0;
    for (int i = 0; i < set; i++) {
        if (i == depth) ch[n_ch++] = chunk_of(&d->ps[gold]);
        ch[n_ch++] = chunk_of(&d->ps[idx[i]]);
    }
    free(idx);
    return n_ch;
}

/* --shared: the chunks that the questions qs[qidx[0..n)] share, into ch (room for d->n_ps):
 * each one's gold paragraph (once) among paragraphs of the other articles, the golds spread
 * evenly over the depths the budget holds, in group g's order; then cut to what the prompt
 * holds beside the group's longest question, so that every question of the group gets the
 * same documents. The number of chunks, or -1 (err set). */
static int group_chunks(const struct Data *d, const struct TokenCounter *tc, const int *qidx,
                        int n, int g, int budget, struct CtxChunk *ch, char *err, size_t errlen)
{
    int *gold = calloc((size_t)n, sizeof *gold), ng = 0;
    int *idx = calloc((size_t)d->n_ps, sizeof *idx), nc = 0, rc = -1;
    struct CtxChunk *all = calloc((size_t)d->n_ps, sizeof *all);
    struct Context *cx = NULL;
    if (!gold || !idx || !all) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (int k = 0; k < n; k++) {
        int p = gold_passage(d, &d->qs[qidx[k]]), seen = 0;
        if (p < 0) {
            snprintf(err, errlen, "the paragraph %s is not in the passages", d->qs[qidx[k]].gold);
            goto out;
        }
        for (int j = 0; j < ng; j++) seen |= gold[j] == p;
        if (!seen) gold[ng++] = p;
    }
    for (int i = 0; i < d->n_ps; i++) {
        int other = 1;
        for (int j = 0; j < ng; j++) other &= d->ps[i].article != d->ps[gold[j]].article;
        if (other) idx[nc++] = i;
    }
    shuffle(idx, nc, 0x5eedULL * 1000);  /* the set: the first paragraphs of a fixed shuffle */
    int set = budget / 130 + 8;
    if (set > nc) set = nc;
    shuffle(idx, set, 0x9e37ULL * 1000 + (uint64_t)g * 7919);  /* in the group's order */
    /* gold k at list position (k + 0.5) / ng of the depths the budget surely holds
     * (paragraphs are about 150 tokens) */
    int depths = budget / 200, na = 0, k = 0;
    for (int i = 0; i < set || k < ng;) {
        if (k < ng && (i == set || (int)((k + 0.5) * depths / ng) <= na))
            all[na++] = chunk_of(&d->ps[gold[k++]]);
        else
            all[na++] = chunk_of(&d->ps[idx[i++]]);
    }
    /* the longest question's tokens, and the chunks the first question's prompt holds when
     * it leaves that much room */
    struct CtxOptions co = {.budget = (size_t)budget - 32, .order = CTX_ORDER_RANK,
                            .no_truncate = 1};
    size_t longest = 0, first = 0;
    for (int q = 0; q < n; q++) {
        const char *text = d->qs[qidx[q]].text;
        if (ctx_assemble(tc, text, strlen(text), all, 0, &co, &cx, err, errlen)) goto out;
        size_t len = cx->question.end - cx->question.start;
        if (len > longest) longest = len;
        if (!q) first = len;
        ctx_destroy(&cx);
    }
    co.budget -= longest - first;
    const char *text = d->qs[qidx[0]].text;
    if (ctx_assemble(tc, text, strlen(text), all, (size_t)na, &co, &cx, err, errlen)) goto out;
    for (size_t c = 0; c < cx->n_cites; c++) ch[c] = all[cx->cites[c].rank];
    rc = (int)cx->n_cites;
    for (int j = 0; j < ng; j++) {
        int placed = 0;
        for (int c = 0; c < rc; c++) placed |= !strcmp(ch[c].doc_id, d->ps[gold[j]].id);
        if (!placed) {
            snprintf(err, errlen, "the paragraph %s does not fit the budget", d->ps[gold[j]].id);
            rc = -1;
            break;
        }
    }
out:
    ctx_destroy(&cx);
    free(all);
    free(idx);
    free(gold);
    return rc;
}

/* KL(p || q) of the softmax distributions of two logits vectors, in nats. */
static double kl_logits(const float *p, const float *q, int n)
{
    double mp = p[0], mq = q[0], zp = 0, zq = 0, kl = 0;
    for (int i = 1; i < n; i++) {
        if (p[i] > mp) mp = p[i];
        if (q[i] > mq) mq = q[i];
    }
    for (int i = 0; i < n; i++) {
        zp += exp(p[i] - mp);
        zq += exp(q[i] - mq);
    }
    double lzp = log(zp) + mp, lzq = log(zq) + mq;
    for (int i = 0; i < n; i++) {
        double lp = p[i] - lzp, lq = q[i] - lzq;
        kl += exp(lp) * (lp - lq);
    }
    return kl > 0 ? kl : 0;
}

enum { ANSWER_MAX = 24 };

/* An answer as the full prefill gave it: its tokens and the logits before each (and before
 * the end, when it ended), for the answer's divergence. */
struct Answer {
    int32_t ids[ANSWER_MAX];
    int n_ids, n_steps;
    float *logits;            /* (ANSWER_MAX + 1, vocab) */
};

/* The greedy answer after the prompt the context holds (its last logits current); returns its
 * first token. With rec, the tokens and each step's logits are kept there. */
static int32_t answer(struct Engine *e, const struct Tokenizer *t, char *out, size_t cap,
                      struct Answer *rec)
{
    int32_t ids[ANSWER_MAX];
    int n = 0;
    char err[256];
    const struct Model *m = engine_model(e);
    if (rec) rec->n_steps = 0;
    while (n < ANSWER_MAX) {
        const float *lg = engine_logits(e);
        if (rec)
            memcpy(rec->logits + (size_t)rec->n_steps++ * m->cfg.vocab, lg,
                   (size_t)m->cfg.vocab * sizeof *lg);
        int32_t best = 0;
        for (int i = 1; i < m->cfg.vocab; i++)
            if (lg[i] > lg[best]) best = i;
        if (tok_is_end(t, best)) break;
        ids[n++] = best;
        if (engine_decode(e, best, err, sizeof err)) break;
    }
    if (rec) {
        memcpy(rec->ids, ids, (size_t)n * sizeof *ids);
        rec->n_ids = n;
        if (rec->n_steps > n + 1) rec->n_steps = n + 1;
    }
    size_t len = 0;
    if (tok_decode(t, ids, (size_t)n, out, cap - 1, &len) != 0) len = 0;
    out[len < cap - 1 ? len : cap - 1] = 0;
    return n ? ids[0] : -1;
}

/* The mean KL divergence, over the answer's steps, of the next-token distributions of the
 * context (its last logits current, after the prompt) fed the recorded answer from the
 * recorded ones. */
static double answer_kl(struct Engine *e, const struct Answer *a)
{
    int vocab = engine_model(e)->cfg.vocab;
    char err[256];
    double sum = 0;
    int k = 0;
    for (; k < a->n_steps; k++) {
        sum += kl_logits(a->logits + (size_t)k * vocab, engine_logits(e), vocab);
        if (k < a->n_ids && k + 1 < a->n_steps && engine_decode(e, a->ids[k], err, sizeof err)) {
            k++;
            break;
        }
    }
    return k ? sum / k : 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL SQUAD_DIR [--budgets 8192,16384,32768] [--questions N] "
                        "[--shares S,...] [--selections probe,deviation] [--threads T] "
                        "[--kv f16|q8] [--shared G] [--answer-kl 0|1] "
                        "[--copies label,frame,gold,full] [--full N]\n", argv[0]);
        return 2;
    }
    const char *model_path = argv[1], *squad = argv[2], *budgets_arg = "8192,16384,32768";
    int n_q = 4, threads = 2, shared = 0, with_akl = 1, n_full = 2;
    const char *shares_arg = "0.15", *sel_arg = "probe", *copies_arg = "label";
    enum KvType kvt = KV_F16;
    for (int i = 3; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--budgets")) budgets_arg = argv[i + 1];
        else if (!strcmp(argv[i], "--questions")) n_q = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--shares")) shares_arg = argv[i + 1];
        else if (!strcmp(argv[i], "--selections")) sel_arg = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--shared")) shared = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--answer-kl")) with_akl = atoi(argv[i + 1]) != 0;
        else if (!strcmp(argv[i], "--copies")) copies_arg = argv[i + 1];
        else if (!strcmp(argv[i], "--full")) n_full = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kv")) kvt = !strcmp(argv[i + 1], "q8") ? KV_Q8 : KV_F16;
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    int budgets[8], nb = 0, max_b = 0;
    for (const char *p = budgets_arg; *p && nb < 8;) {
        budgets[nb] = atoi(p);
        if (budgets[nb] > max_b) max_b = budgets[nb];
        nb++;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    enum { MAX_SHARES = 8 };
    double shares[MAX_SHARES];
    int ns = 0;
    for (const char *p = shares_arg; *p && ns < MAX_SHARES;) {
        shares[ns] = atof(p);
        if (!(shares[ns] >= 0 && shares[ns] <= 1)) {
            fprintf(stderr, "a share is in [0, 1]: %s\n", shares_arg);
            return 2;
        }
        ns++;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    /* the selections: with the question as the probe (the daemon's), or without */
    int sels[2], n_sel = 0;
    for (const char *p = sel_arg; *p && n_sel < 2;) {
        size_t len = strcspn(p, ",");
        if (len == 5 && !strncmp(p, "probe", 5)) sels[n_sel++] = 1;
        else if (len == 9 && !strncmp(p, "deviation", 9)) sels[n_sel++] = 0;
        else {
            fprintf(stderr, "a selection is probe or deviation: %s\n", sel_arg);
            return 2;
        }
        p += len + (p[len] == ',');
    }
    if (!n_sel) {
        fprintf(stderr, "no selection in %s\n", sel_arg);
        return 2;
    }
    /* what the chunks' copies are made after: the frame and the copy label (the daemon's),
     * or the frame alone */
    int cps[4], n_cp = 0;
    for (const char *p = copies_arg; *p && n_cp < 4;) {
        size_t len = strcspn(p, ",");
        if (len == 5 && !strncmp(p, "label", 5)) cps[n_cp++] = 1;
        else if (len == 5 && !strncmp(p, "frame", 5)) cps[n_cp++] = 0;
        else if (len == 4 && !strncmp(p, "gold", 4)) cps[n_cp++] = 2;
        else if (len == 4 && !strncmp(p, "full", 4)) cps[n_cp++] = 3;
        else {
            fprintf(stderr, "copies are made after the label or the frame: %s\n", copies_arg);
            return 2;
        }
        p += len + (p[len] == ',');
    }
    if (!n_cp) {
        fprintf(stderr, "no copies in %s\n", copies_arg);
        return 2;
    }
    enum { MAX_VAR = 4 * MAX_SHARES };
    int nv = ns * n_sel * n_cp;
    char err[512], path[4096];
    struct Data d = {0};
    snprintf(path, sizeof path, "%s/passages.jsonl", squad);
    if (bench_each_line(path, add_passage, &d)) return 1;
    snprintf(path, sizeof path, "%s/questions.jsonl", squad);
    if (bench_each_line(path, add_question, &d)) return 1;
    if (shared < 0 || shared > 64) {
        fprintf(stderr, "--shared takes 0 (a context a question) to 64 questions a context\n");
        return 2;
    }
    if (d.n_qs < n_q || n_q < 1) {
        fprintf(stderr, "%d answerable questions, %d asked for\n", d.n_qs, n_q);
        return 1;
    }
    struct Model *m = NULL;
    if (model_load(model_path, &m, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    struct TokenCounter tc;
    tokcount_from_tokenizer(m->tok, &tc);
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = max_b; /* each prompt leaves 32 of its budget for the answer */
    o.kv_type = kvt;
    o.n_threads = threads;
    struct Engine *e = NULL, *helper = NULL;
    struct ChunkKv *store = NULL;
    struct KvPool *pool = NULL;
    /* --shared: room for the documents' full prefill to stay cached beside a blend, the
     * helper's copies and the next question's prefill */
    if (shared && kvpool_new(m, kvt, 4 * kvpool_pages_for(max_b), 1, &pool, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    o.kv_pool = pool;
    if (engine_new(m, &o, &e, err, sizeof err) || engine_new_seq(e, &helper, err, sizeof err) ||
        chunkkv_new((size_t)8 << 30, &store)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    printf("bench-kvreuse: %s, %d threads, KV %s, recompute shares %s, selections %s, copies "
           "after the %s, %d questions a budget", model_path, threads,
           kvt == KV_Q8 ? "int8" : "f16", shares_arg, sel_arg, copies_arg, n_q);
    if (shared) printf(", %d questions a context", shared);
    printf("\n");
    struct Answer rec = {.logits = malloc((size_t)(ANSWER_MAX + 1) * m->cfg.vocab *
                                          sizeof(float))};
    if (!rec.logits) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }

    for (int bi = 0; bi < nb; bi++) {
        int budget = budgets[bi];
        double t_off[64], t_on[MAX_VAR][64], kl[MAX_VAR][64], akl[MAX_VAR][64];
        float *lg_off = malloc((size_t)m->cfg.vocab * sizeof *lg_off);
        int gold_off = 0, gold_on[MAX_VAR] = {0}, agree[MAX_VAR] = {0};
        int first_agree[MAX_VAR] = {0}, tokens_sum = 0;
        long reused_sum[MAX_VAR] = {0}, region_sum[MAX_VAR] = {0};
        double first_use_s = 0;
        long first_use_chunks = 0;
        int nq = n_q < 64 ? n_q : 64, n_off = 0, off_only[MAX_VAR] = {0}, on_only[MAX_VAR] = {0};
        double f1_off = 0, f1_on[MAX_VAR] = {0};
        struct CtxChunk *chunks = calloc((size_t)d.n_ps + 1, sizeof *chunks); /* a context's */
        int n_group = 0;
        int32_t *group_docs = NULL;   /* the group's documents' tokens, the first prompt's */
        size_t n_group_docs = 0;
        for (int qi = 0; qi < nq; qi++) {
            const struct Question *q = &d.qs[(size_t)qi * d.n_qs / nq];
            int gold = gold_passage(&d, q);
            if (gold < 0) {
                fprintf(stderr, "question %d: its paragraph %s is not in the passages\n", qi,
                        q->gold);
                return 1;
            }
            int group_first = shared && qi % shared == 0;
            if (group_first) {
                int qidx[64], n = 0;
                for (int k = qi; k < nq && k < qi + shared; k++)
                    qidx[n++] = (int)((size_t)k * d.n_qs / nq);
                n_group = group_chunks(&d, &tc, qidx, n, qi / shared, budget, chunks, err,
                                       sizeof err);
                if (n_group < 0) {
                    fprintf(stderr, "questions %d-%d: %s\n", qi, qi + n - 1, err);
                    return 1;
                }
                printf("  questions %d-%d share %d paragraphs\n", qi, qi + n - 1, n_group);
            }
            struct CtxChunk *ch = chunks;
            int n_ch = shared ? n_group : question_chunks(&d, gold, qi, budget, ch);
            if (n_ch < 0) {
                fprintf(stderr, "out of memory\n");
                return 1;
            }
            struct CtxOptions co = {.budget = (size_t)budget - 32, .order = CTX_ORDER_RANK,
                                    .no_truncate = 1};
            struct Context *cx = NULL;
            if (ctx_assemble(&tc, q->text, strlen(q->text), ch, (size_t)n_ch, &co, &cx, err,
                             sizeof err)) {
                fprintf(stderr, "assemble: %s\n", err);
                return 1;
            }
            int nf = (int)cx->documents.start, n_all = (int)cx->n_tokens;
            int tail0 = (int)cx->documents.end;
            if (shared) {  /* every prompt of the group holds the same documents */
                size_t nd = (size_t)tail0;
                if (group_first) {
                    free(group_docs);
                    group_docs = malloc(nd * sizeof *group_docs);
                    if (!group_docs) {
                        fprintf(stderr, "out of memory\n");
                        return 1;
                    }
                    memcpy(group_docs, cx->tokens, nd * sizeof *group_docs);
                    n_group_docs = nd;
                }
                if (cx->n_cites != (size_t)n_group || nd != n_group_docs ||
                    memcmp(group_docs, cx->tokens, nd * sizeof *group_docs)) {
                    fprintf(stderr, "question %d: its prompt's documents differ from its "
                                    "group's\n", qi);
                    return 1;
                }
            }
            /* the spans and their leads; then the same without the question's gold
             * paragraph (--copies gold: computed in the blend like the labels) */
            size_t nc = cx->n_cites, ng = 0;
            uint32_t *spans = malloc(9 * nc * sizeof *spans + sizeof *spans);
            if (!spans) {
                fprintf(stderr, "out of memory\n");
                return 1;
            }
            uint32_t *lead_r = spans + 2 * nc, *spans_g = spans + 4 * nc, *lead_g = spans + 6 * nc;
            for (size_t c = 0; c < nc; c++) {
                const struct CtxCitation *ci = &cx->cites[c];
                spans[2 * c] = (uint32_t)ci->tokens.start;
                spans[2 * c + 1] = (uint32_t)ci->tokens.end;
                lead_r[2 * c] = (uint32_t)ci->lead.start;
                lead_r[2 * c + 1] = (uint32_t)ci->lead.end;
                if (!strcmp(ci->doc_id, d.ps[gold].id)) continue;
                memcpy(spans_g + 2 * ng, spans + 2 * c, 2 * sizeof *spans);
                memcpy(lead_g + 2 * ng, lead_r + 2 * c, 2 * sizeof *spans);
                ng++;
            }
            uint32_t *ranks = spans + 8 * nc;
            if (bm25_ranks(&tc, cx, ch, q->text, ranks, err, sizeof err)) {
                fprintf(stderr, "question %d: ranking: %s\n", qi, err);
                return 1;
            }
            struct ChunkKvSpans leads = {cx->leads, cx->n_leads, lead_r, NULL, 0};
            struct ChunkKvSpans leads_g = {cx->leads, cx->n_leads, lead_g, NULL, 0};
            struct ChunkKvSpans leads_f = {cx->leads, cx->n_leads, lead_r, ranks, n_full};
            int gold_rank = -1;
            for (size_t c = 0; c < nc; c++)
                if (!strcmp(cx->cites[c].doc_id, d.ps[gold].id)) gold_rank = (int)ranks[c];
            /* the chunks' first use, untimed: a blend at share 0 makes the copies the store
             * lacks (each a prefill of the frame, from the prefix cache, its lead and the
             * chunk), for each way of making them */
            for (int ci = 0; ci < n_cp; ci++) {
                struct ChunkKvBlend cb;
                engine_reset(e);
                double tu = now_s();
                if (chunkkv_blend(store, e, helper, cx->tokens, nf, tail0, tail0, spans,
                                  (int)cx->n_cites, cps[ci] ? &leads : NULL, 0.0, &cb, err,
                                  sizeof err)) {
                    fprintf(stderr, "first use: %s\n", err);
                    return 1;
                }
                if (cb.computed) {
                    first_use_s += now_s() - tu;
                    first_use_chunks += cb.computed;
                }
            }
            char a_off[2048], a_on[2048];
            int32_t first_off;
            /* off; with --shared only a group's first prompt is a time to first token: the
             * others take the documents from the prefix cache */
            engine_reset(e);
            double t0 = now_s();
            if (engine_prefill(e, cx->tokens, (size_t)n_all, err, sizeof err)) {
                fprintf(stderr, "prefill: %s\n", err);
                return 1;
            }
            double t = now_s() - t0;
            int cached = engine_cached(e);
            if (!shared || group_first) t_off[n_off++] = t;
            memcpy(lg_off, engine_logits(e), (size_t)m->cfg.vocab * sizeof *lg_off);
            first_off = answer(e, m->tok, a_off, sizeof a_off, &rec);
            int g0 = contains_gold(a_off, q);
            double f0 = squad_f1(a_off, q);
            gold_off += g0;
            f1_off += f0;
            tokens_sum += n_all;
            printf("  %d tokens (%d cached), off %.2f s: gold %d F1 %.2f \"%.70s\" (its "
                   "paragraph's BM25 rank %d of %zu)\n", n_all, cached, t, g0, f0, a_off,
                   gold_rank, nc);
            /* on, at each share and selection */
            for (int vi = 0; vi < nv; vi++) {
                double share = shares[vi / (n_sel * n_cp)];
                int probe = sels[(vi / n_cp) % n_sel], label = cps[vi % n_cp];
                int g = label == 2;
                const struct ChunkKvSpans *info = g ? &leads_g : label == 3 ? &leads_f
                                                  : label ? &leads : NULL;
                int n_prompt = probe ? n_all : tail0;
                struct ChunkKvBlend st;
                for (int pass = 0; pass < 2; pass++) {
                    /* pass 0: the time to first token and the greedy answer; pass 1: the
                     * same blend fed the full prefill's answer */
                    engine_reset(e);
                    t0 = now_s();
                    if (chunkkv_blend(store, e, helper, cx->tokens, nf, tail0, n_prompt,
                                      g ? spans_g : spans, g ? (int)ng : (int)nc,
                                      info, share, &st, err, sizeof err) ||
                        engine_prefill(e, cx->tokens + tail0, (size_t)(n_all - tail0), err,
                                       sizeof err)) {
                        fprintf(stderr, "blend: %s\n", err);
                        return 1;
                    }
                    if (pass) {
                        akl[vi][qi] = answer_kl(e, &rec);
                        break;
                    }
                    t_on[vi][qi] = now_s() - t0;
                    kl[vi][qi] = kl_logits(lg_off, engine_logits(e), m->cfg.vocab);
                    int32_t first_on = answer(e, m->tok, a_on, sizeof a_on, NULL);
                    int g1 = contains_gold(a_on, q);
                    double f1 = squad_f1(a_on, q);
                    gold_on[vi] += g1;
                    f1_on[vi] += f1;
                    off_only[vi] += g0 && !g1;
                    on_only[vi] += g1 && !g0;
                    agree[vi] += !strcmp(a_off, a_on);
                    first_agree[vi] += first_on == first_off;
                    reused_sum[vi] += st.reused;
                    region_sum[vi] += st.reused + st.recomputed;
                    printf("    share %.2f %s %s, on %.2f s (%d of %d reused; probe %.2f s), "
                           "KL %.4f: gold %d F1 %.2f \"%.70s\"\n", share,
                           probe ? "probe" : "deviation", COPIES[label],
                           t_on[vi][qi], st.reused,
                           st.reused + st.recomputed, st.probe_s, kl[vi][qi], g1, f1, a_on);
                    if (!with_akl) break;
                }
                if (with_akl)
                    printf("      fed the full prefill's answer (%d tokens): mean KL %.4f\n",
                           rec.n_ids, akl[vi][qi]);
            }
            fflush(stdout);
            free(spans);
            ctx_destroy(&cx);
        }
        double mo = median(t_off, n_off);
        printf("%8s %6s %9s %6s %8s %10s %10s %7s %9s %9s %9s %9s %8s %9s %9s %6s %6s %8s\n",
               "budget", "share", "selection", "copies", "tokens", "ttft_off_s", "ttft_on_s", "ratio",
               "gold_off", "gold_on", "same_ans", "same_1st", "reused", "KL_med", "ansKL_med",
               "F1_off", "F1_on", "off/on");
        for (int vi = 0; vi < nv; vi++) {
            double mn = median(t_on[vi], nq);
            char akl_s[32] = "-";
            if (with_akl) snprintf(akl_s, sizeof akl_s, "%.4f", median(akl[vi], nq));
            printf("%8d %6.2f %9s %6s %8d %10.2f %10.2f %6.2fx %5d/%-3d %5d/%-3d %5d/%-3d "
                   "%5d/%-3d %7.1f%% %9.4f %9s %6.3f %6.3f %4d/%-3d\n", budget,
                   shares[vi / (n_sel * n_cp)], sels[(vi / n_cp) % n_sel] ? "probe" : "deviation",
                   COPIES[cps[vi % n_cp]], tokens_sum / nq, mo, mn, mo / mn,
                   gold_off, nq, gold_on[vi], nq, agree[vi], nq, first_agree[vi], nq,
                   100.0 * reused_sum[vi] / (region_sum[vi] ? region_sum[vi] : 1),
                   median(kl[vi], nq), akl_s, f1_off / nq, f1_on[vi] / nq, off_only[vi],
                   on_only[vi]);
        }
        if (shared)
            printf("         %d questions a context: ttft_off is the median of the %d contexts' "
                   "first prompts (the others took the documents from the prefix cache)\n",
                   shared, n_off);
        printf("         off/on: the questions only the full prefill answered with a gold "
               "answer, and those only the blend did\n");
        free(chunks);
        free(group_docs);
        free(lg_off);
        struct ChunkKvStats ss;
        chunkkv_stats(store, &ss);
        printf("         stored KV: %zu bytes a token; first use: %ld chunks made in %.1f s; the "
               "store: %zu chunks, %.1f MiB\n", engine_kv_bytes(e, 1), first_use_chunks,
               first_use_s, ss.entries, ss.bytes / 1048576.0);
        fflush(stdout);
    }
    free(rec.logits);
    chunkkv_destroy(&store);
    engine_destroy(&helper);
    engine_destroy(&e);
    kvpool_destroy(&pool);
    model_destroy(&m);
    return 0;
}
