/* Tests for the context planner (retriever/planner.c), on the simple token counter: documents
 * that fit the budget go in whole and those that do not as chunks; top_k caps the chunks and
 * rules out the budget's whole documents, but a document all of whose chunks are placed goes
 * in whole, the same for every question; the relevance floor drops low scores (and counts
 * them); two searches' chunks are merged by score; the orders (rank, nearest, document) for chunks and for whole documents;
 * stored text past plan_read_bytes is not counted; the default order; the read figures; a
 * document whose chunks alone would fill the prompt read as a window (its opening, the same for
 * every question, then the best chunks outside it); the errors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/planner.h"
#include "retriever/status.h"
#include "tests/check.h"

static struct TokenCounter tc;

/* Three documents; each has two chunks (the halves of its text at a space). */
static const char *doc_ids[3] = { "b-rhine", "a-paris", "c-oxygen" };
static const char *doc_texts[3] = {
    "The Rhine is a European river. It flows into the North Sea near Rotterdam.",
    "Paris is the capital of France. About two million people live in the city.",
    "Oxygen is a chemical element. Its symbol is O and its atomic number is 8.",
};

static struct PlanDoc docs[3];

static void make_docs(enum PlanDocSource source)
{
    for (int i = 0; i < 3; i++)
        docs[i] = (struct PlanDoc){ doc_ids[i], strlen(doc_ids[i]), "", 0, doc_texts[i],
                                    strlen(doc_texts[i]), source, 100 + (uint64_t)i };
}

/* The chunk `half` (0, 1) of document d, with a score. */
static struct CtxChunk chunk_of(int d, int half, double score)
{
    const char *t = doc_texts[d];
    size_t cut = (size_t)(strchr(t, '.') - t) + 1, len = strlen(t);
    size_t start = half ? cut + 1 : 0, end = half ? len : cut;
    return (struct CtxChunk){ doc_ids[d], strlen(doc_ids[d]), "", 0, t + start, end - start,
                              (uint32_t)half, start, end, score, 0, (uint64_t)(10 * d + half),
                              NULL, 0, 0, 0 };
}

static struct PlanRequest request(const struct CtxChunk *chunks, size_t n_chunks, size_t n_docs,
                                  size_t budget)
{
    return (struct PlanRequest){ .tc = &tc, .question = "Where?", .question_len = 6,
                                 .budget = budget, .order = CTX_ORDER_RANK, .chunks = chunks,
                                 .n_chunks = n_chunks, .n_searches = 1, .docs = docs,
                                 .n_docs = n_docs };
}

/* The prompt's tokens without any document: the frame and the question. */
static size_t frame_tokens(void)
{
    struct CtxOptions o = { .budget = 1 << 20 };
    struct Context *c = NULL;
    char err[256];
    if (ctx_assemble(&tc, "Where?", 6, NULL, 0, &o, &c, err, sizeof err))
        return 0;
    size_t n = c->n_tokens;
    ctx_destroy(&c);
    return n;
}

static size_t tokens_of(const char *text)
{
    size_t n = 0;
    tokcount_count(&tc, text, strlen(text), &n);
    return n;
}

/* The plan's citation i is chunk `chunk` of doc_id. */
static int at(const struct Plan *pl, size_t i, const char *doc_id, uint32_t chunk)
{
    const struct Context *c = pl->ctx;
    return i < c->n_cites && !strcmp(c->cites[i].doc_id, doc_id) && c->cites[i].chunk == chunk;
}

static void test_limits(void)
{
    CHECK(plan_search_hits(7, 100000) == 7, "top_k is the hits asked for");
    CHECK(plan_search_hits(0, 8000) == 1064, "one per 8 budget tokens and 64: %zu",
          plan_search_hits(0, 8000));
    CHECK(plan_search_hits(0, (size_t)1 << 30) == 100000, "at most 100,000");
    CHECK(plan_read_bytes(100) == 3200, "32 bytes a budget token");
    CHECK(plan_default_order(0) == CTX_ORDER_RANK && plan_default_order(1) == CTX_ORDER_NEAREST,
          "no order named: best first, or best last with chunk KV reuse");
}

static void test_whole_or_chunks(size_t frame)
{
    make_docs(PLAN_DOC_INLINE);
    struct CtxChunk ch[2] = { chunk_of(0, 1, 4.0), chunk_of(0, 0, 2.0) };
    size_t doc_tokens = tokens_of(doc_texts[0]);
    char err[256];
    struct Plan pl;
    /* room for the document, its label and separator: whole */
    struct PlanRequest rq = request(ch, 2, 1, frame + doc_tokens + 32);
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.read.whole && pl.ctx->n_cites == 1 && pl.ctx->cites[0].whole, "a document that fits "
          "goes in whole");
    CHECK(pl.ctx->cites[0].byte_start == 0 && pl.ctx->cites[0].byte_end == strlen(doc_texts[0]) &&
          pl.ctx->cites[0].ref == 100, "the citation spans the document and carries its ref");
    CHECK(pl.read.documents == 1 && pl.read.doc_tokens == (long long)doc_tokens &&
          pl.read.placed_tokens == doc_tokens, "read: %lld of %zu tokens, %zu placed",
          pl.read.doc_tokens, doc_tokens, pl.read.placed_tokens);
    CHECK(pl.read.chunks_matched == 2 && pl.read.chunks_placed == 2 &&
          pl.read.chunks_left_out == 0, "whole: every matched chunk counts as placed");
    ctx_destroy(&pl.ctx);
    /* room for one chunk only: the best chunk, not the document */
    rq.budget = frame + tokens_of(ch[0].text) + 10;
    CHECK(rq.budget < frame + doc_tokens, "the document does not fit (%zu)", rq.budget);
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(!pl.read.whole && pl.ctx->n_cites == 1 && at(&pl, 0, "b-rhine", 1) &&
          !pl.ctx->cites[0].whole && pl.ctx->cites[0].ref == 1, "too long: the best chunk");
    CHECK(pl.read.chunks_matched == 2 && pl.read.chunks_placed == 1 &&
          pl.read.chunks_left_out == 1 && pl.read.doc_tokens == (long long)doc_tokens,
          "one of two chunks placed, one left out");
    ctx_destroy(&pl.ctx);
    /* a top_k rules whole documents out however much room there is, and caps the chunks */
    rq.budget = 4096;
    rq.top_k = 1;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(!pl.read.whole && pl.ctx->n_cites == 1 && at(&pl, 0, "b-rhine", 1) &&
          pl.read.chunks_matched == 1, "top_k 1: one chunk, never the whole document");
    ctx_destroy(&pl.ctx);
}

static void test_floor_and_merge(void)
{
    make_docs(PLAN_DOC_INLINE);
    /* the inline search's chunks, then the collection's, each best first */
    struct CtxChunk ch[5] = { chunk_of(0, 0, 10.0), chunk_of(0, 1, 4.0), chunk_of(1, 0, 12.0),
                              chunk_of(1, 1, 6.0), chunk_of(2, 0, 1.0) };
    char err[256];
    struct Plan pl;
    struct PlanRequest rq = request(ch, 5, 0, 4096);
    rq.top_k = 10;
    rq.n_searches = 2;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.ctx->n_cites == 5 && at(&pl, 0, "a-paris", 0) && at(&pl, 1, "b-rhine", 0) &&
          at(&pl, 2, "a-paris", 1) && at(&pl, 3, "b-rhine", 1) &&
          at(&pl, 4, "c-oxygen", 0), "two searches merged by score");
    ctx_destroy(&pl.ctx);
    /* one search: the caller's order stands */
    rq.n_searches = 1;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.ctx->n_cites == 5 && at(&pl, 0, "b-rhine", 0) && at(&pl, 2, "a-paris", 0),
          "one search: as given");
    ctx_destroy(&pl.ctx);
    /* floor 0.5 of the best (12): 10 and 6 stay, 4 ends the offer (1 after it too) */
    rq.n_searches = 2;
    rq.relevance_floor = 0.5;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.read.chunks_matched == 3 && pl.ctx->n_cites == 3 && at(&pl, 2, "a-paris", 1) &&
          pl.read.chunks_left_out == 0, "the floor drops the chunks under half the best: %zu "
          "matched", pl.read.chunks_matched);
    CHECK(pl.read.chunks_below_floor == 2, "two chunks under the floor: %zu",
          pl.read.chunks_below_floor);
    ctx_destroy(&pl.ctx);
    /* top_k caps after the merge */
    rq.relevance_floor = 0;
    rq.top_k = 2;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.read.chunks_matched == 2 && at(&pl, 0, "a-paris", 0) && at(&pl, 1, "b-rhine", 0),
          "top_k 2: the two best of both searches");
    CHECK(pl.read.chunks_below_floor == 0, "no floor, none under it");
    ctx_destroy(&pl.ctx);
}

static void test_orders(void)
{
    make_docs(PLAN_DOC_FOUND);
    struct CtxChunk ch[4] = { chunk_of(2, 1, 9.0), chunk_of(0, 1, 7.0), chunk_of(2, 0, 5.0),
                              chunk_of(1, 0, 3.0) };
    char err[256];
    struct Plan pl;
    /* chunks (a top_k keeps whole documents out) */
    struct PlanRequest rq = request(ch, 4, 3, 4096);
    rq.top_k = 4;
    rq.order = CTX_ORDER_NEAREST;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    /* both chunks of c-oxygen are placed: it goes in whole (test_covered) */
    CHECK(pl.ctx->n_cites == 3 && at(&pl, 0, "a-paris", 0) && at(&pl, 2, "c-oxygen", 0) &&
          pl.ctx->cites[2].whole && !pl.read.whole, "nearest: the best chunk last");
    ctx_destroy(&pl.ctx);
    rq.order = CTX_ORDER_DOCUMENT;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.ctx->n_cites == 3 && at(&pl, 0, "a-paris", 0) && at(&pl, 1, "b-rhine", 1) &&
          at(&pl, 2, "c-oxygen", 0) && pl.ctx->cites[2].whole,
          "document: by id, then by position");
    ctx_destroy(&pl.ctx);
    /* whole documents: rank by each one's best chunk; nearest the other way round; document
     * order by id for documents the search found */
    rq.top_k = 0;
    const char *want[3][3] = { { "c-oxygen", "b-rhine", "a-paris" },
                               { "a-paris", "b-rhine", "c-oxygen" },
                               { "a-paris", "b-rhine", "c-oxygen" } };
    enum CtxOrder orders[3] = { CTX_ORDER_RANK, CTX_ORDER_NEAREST, CTX_ORDER_DOCUMENT };
    for (int o = 0; o < 3; o++) {
        rq.order = orders[o];
        CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
        CHECK(pl.read.whole && pl.ctx->n_cites == 3 && at(&pl, 0, want[o][0], 0) &&
              at(&pl, 1, want[o][1], 0) && at(&pl, 2, want[o][2], 0),
              "whole documents in order %d", (int)orders[o]);
        ctx_destroy(&pl.ctx);
    }
    /* named by ids: document order is the ids' order; a document without a hit ranks last */
    make_docs(PLAN_DOC_NAMED);
    rq.order = CTX_ORDER_DOCUMENT;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.read.whole && at(&pl, 0, "b-rhine", 0) && at(&pl, 1, "a-paris", 0) &&
          at(&pl, 2, "c-oxygen", 0), "named documents as the ids list them");
    ctx_destroy(&pl.ctx);
    rq.order = CTX_ORDER_RANK;
    rq.n_chunks = 2;   /* hits in c-oxygen and b-rhine only */
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.read.whole && at(&pl, 0, "c-oxygen", 0) && at(&pl, 1, "b-rhine", 0) &&
          at(&pl, 2, "a-paris", 0) && pl.ctx->cites[2].score == 0.0,
          "a document the search found nothing in goes last");
    ctx_destroy(&pl.ctx);
}

/* The tokens of the plan's prompt before the question. */
static int same_prefix(const struct Plan *a, const struct Plan *b)
{
    size_t n = a->ctx->question.start;
    return n == b->ctx->question.start &&
           !memcmp(a->ctx->tokens, b->ctx->tokens, n * sizeof *a->ctx->tokens);
}

/* A document all of whose chunks are placed goes in whole, in its own order, whatever top_k
 * and the scores: its prompt is the same for every question. */
static void test_covered(size_t frame)
{
    make_docs(PLAN_DOC_INLINE);
    char err[256];
    struct Plan p1, p2;
    size_t doc_tokens = tokens_of(doc_texts[0]);
    /* two questions rank the document's two chunks the other way round */
    struct CtxChunk q1[2] = { chunk_of(0, 1, 4.0), chunk_of(0, 0, 2.0) };
    struct CtxChunk q2[2] = { chunk_of(0, 0, 5.0), chunk_of(0, 1, 1.0) };
    struct PlanRequest rq = request(q1, 2, 1, 4096);
    rq.top_k = 5;
    CHECK(plan_context(&rq, &p1, err, sizeof err) == RET_OK, "plan: %s", err);
    rq.chunks = q2;
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(p1.read.whole && p1.ctx->n_cites == 1 && p1.ctx->cites[0].whole &&
          p1.ctx->cites[0].byte_end == strlen(doc_texts[0]) && p1.ctx->cites[0].ref == 100,
          "every chunk placed under a top_k: the document whole");
    CHECK(p1.read.chunks_matched == 2 && p1.read.chunks_placed == 2 &&
          p1.read.chunks_left_out == 0 && p1.read.placed_tokens == doc_tokens,
          "read: %zu placed, %zu tokens", p1.read.chunks_placed, p1.read.placed_tokens);
    CHECK(same_prefix(&p1, &p2), "two rank orders, the same prompt up to the question");
    ctx_destroy(&p1.ctx);
    ctx_destroy(&p2.ctx);
    /* the same without a top_k when the document is too long to go in whole by the budget
     * rule: it fits when its chunks do */
    rq.top_k = 0;
    rq.chunks = q1;
    rq.budget = frame + doc_tokens + 12;
    CHECK(plan_context(&rq, &p1, err, sizeof err) == RET_OK && p1.read.whole &&
          p1.ctx->n_cites == 1, "no top_k: whole too (%s)", err);
    ctx_destroy(&p1.ctx);
    /* text between the placed chunks that no chunk holds: not whole */
    struct CtxChunk gap[2] = { chunk_of(0, 1, 4.0), chunk_of(0, 0, 2.0) };
    gap[1].text_len = gap[1].byte_end = 9;   /* "The Rhine" */
    rq.chunks = gap;
    rq.top_k = 5;
    rq.budget = 4096;
    CHECK(plan_context(&rq, &p1, err, sizeof err) == RET_OK && !p1.read.whole &&
          p1.ctx->n_cites == 2 && !p1.ctx->cites[0].whole, "a gap: chunks as before");
    ctx_destroy(&p1.ctx);
    /* two documents: the one whose chunks are all placed whole, at its best chunk's place;
     * the other's one chunk as a chunk */
    struct CtxChunk mix[3] = { chunk_of(1, 0, 6.0), chunk_of(0, 1, 5.0), chunk_of(0, 0, 1.0) };
    rq = request(mix, 3, 2, 4096);
    rq.top_k = 5;
    CHECK(plan_context(&rq, &p1, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(!p1.read.whole && p1.ctx->n_cites == 2 && at(&p1, 0, "a-paris", 0) &&
          !p1.ctx->cites[0].whole && at(&p1, 1, "b-rhine", 0) && p1.ctx->cites[1].whole &&
          p1.read.chunks_placed == 3 && p1.read.chunks_left_out == 0,
          "one document whole among chunks (%zu cites)", p1.ctx->n_cites);
    ctx_destroy(&p1.ctx);
    /* every chunk of both: the whole-document layout, in document order (as sent) when asked */
    struct CtxChunk all[4] = { chunk_of(1, 0, 6.0), chunk_of(0, 1, 5.0), chunk_of(1, 1, 3.0),
                               chunk_of(0, 0, 1.0) };
    rq.chunks = all;
    rq.n_chunks = 4;
    CHECK(plan_context(&rq, &p1, err, sizeof err) == RET_OK && p1.read.whole &&
          p1.ctx->n_cites == 2 && at(&p1, 0, "a-paris", 0) && at(&p1, 1, "b-rhine", 0),
          "all whole, best first");
    ctx_destroy(&p1.ctx);
    rq.order = CTX_ORDER_DOCUMENT;
    CHECK(plan_context(&rq, &p1, err, sizeof err) == RET_OK && p1.read.whole &&
          p1.ctx->n_cites == 2 && at(&p1, 0, "b-rhine", 0) && at(&p1, 1, "a-paris", 0),
          "all whole, in document order as sent");
    ctx_destroy(&p1.ctx);
    /* a budget that leaves a-paris's second chunk out: b-rhine whole, a-paris's best chunk
     * as a chunk */
    rq.order = CTX_ORDER_RANK;
    rq.budget = frame + tokens_of(all[0].text) + tokens_of(all[1].text) + 4;
    CHECK(plan_context(&rq, &p1, err, sizeof err) == RET_OK && !p1.read.whole &&
          p1.ctx->n_cites == 2 && at(&p1, 0, "a-paris", 0) && !p1.ctx->cites[0].whole &&
          at(&p1, 1, "b-rhine", 0) && p1.ctx->cites[1].whole && p1.read.chunks_placed == 3 &&
          p1.read.chunks_left_out == 1, "a chunk left out by the budget: its document as "
          "chunks (%zu placed)", p1.read.chunks_placed);
    ctx_destroy(&p1.ctx);
    /* room for a-paris's and b-rhine's first chunks only: neither document is whole */
    rq.budget = frame + tokens_of(all[0].text) + 2;
    CHECK(plan_context(&rq, &p1, err, sizeof err) == RET_OK && !p1.read.whole &&
          p1.ctx->n_cites == 2 && at(&p1, 0, "a-paris", 0) && at(&p1, 1, "b-rhine", 0) &&
          !p1.ctx->cites[0].whole && !p1.ctx->cites[1].whole && p1.read.chunks_left_out == 2,
          "half of each document placed: chunks");
    ctx_destroy(&p1.ctx);
}

/* A long document of LONG_PARAS paragraphs, each a chunk; "Title" is its title. */
enum { LONG_PARAS = 200 };
static char long_text[LONG_PARAS * 80];
static struct CtxChunk long_chunks[LONG_PARAS];

static void make_long(void)
{
    size_t off = 0;
    for (int i = 0; i < LONG_PARAS; i++) {
        size_t start = off;
        off += (size_t)snprintf(long_text + off, sizeof long_text - off,
                                "Paragraph %d tells of river %d and of its town %d.", i, i * 7, i);
        long_chunks[i] = (struct CtxChunk){ "long", 4, "Title", 5, long_text + start,
                                            off - start, (uint32_t)i, start, off, 0.0, 0,
                                            (uint64_t)i, NULL, 0, 0, 0 };
        if (i + 1 < LONG_PARAS)
            off += (size_t)snprintf(long_text + off, sizeof long_text - off, "\n\n");
    }
}

/* The long document's chunks ranked by a question: chunk (seed * 17 + k) % LONG_PARAS k-th. */
static void rank_long(struct CtxChunk *out, size_t n, int seed)
{
    for (size_t k = 0; k < n; k++) {
        out[k] = long_chunks[((size_t)seed * 17 + k * 7) % LONG_PARAS];
        out[k].score = 100.0 - (double)k;
    }
}

/* A document whose offered chunks alone would fill the prompt is read as a window: its opening
 * in order, the same for every question, then the best chunks outside it, the best last. */
static void test_window(void)
{
    make_long();
    struct PlanDoc d[2] = { { "long", 4, "Title", 5, long_text, strlen(long_text), PLAN_DOC_FOUND,
                              77 },
                            { "zz", 2, "", 0, doc_texts[2], strlen(doc_texts[2]),
                              PLAN_DOC_FOUND, 78 } };
    struct CtxChunk q1[LONG_PARAS + 1], q2[LONG_PARAS];
    rank_long(q1, LONG_PARAS, 1);
    rank_long(q2, LONG_PARAS, 2);
    q1[LONG_PARAS] = chunk_of(2, 0, 1.0);   /* another document's chunk, ranked last */
    q1[LONG_PARAS].doc_id = "zz";
    q1[LONG_PARAS].doc_id_len = 2;
    size_t doc_tokens = tokens_of(long_text), budget = doc_tokens * 2 / 3;
    char err[256];
    struct Plan p1, p2;
    struct PlanRequest rq = request(q1, LONG_PARAS + 1, 2, budget);
    rq.docs = d;
    rq.window = 1;
    CHECK(budget > 1400 && plan_context(&rq, &p1, err, sizeof err) == RET_OK, "plan: %s", err);
    const struct Context *c = p1.ctx;
    const struct CtxCitation *w = &c->cites[0];
    CHECK(p1.read.window && !p1.read.whole && c->n_cites > 1 && !strcmp(w->doc_id, "long") &&
          w->byte_start == 0 && !w->whole && !w->truncated && w->ref == 77 &&
          long_text[w->byte_end] == '\n' && long_text[w->byte_end + 1] == '\n',
          "the window: the document's opening, ending a paragraph (%zu cites)", c->n_cites);
    size_t open_tokens = w->tokens.end - w->tokens.start;
    CHECK(open_tokens * 8 <= (budget - c->documents.start) * 7 &&
          open_tokens * 4 > budget * 3 - 400,
          "the opening takes about seven eighths of the documents' budget: %zu of %zu",
          open_tokens, budget);
    size_t inside = 0, placed = 0;
    for (size_t i = 0; i < LONG_PARAS + 1; i++)
        inside += i < LONG_PARAS && q1[i].byte_end <= w->byte_end;
    int outside = 1;
    for (size_t i = 1; i < c->n_cites; i++) {
        outside &= strcmp(c->cites[i].doc_id, "long") || c->cites[i].byte_end > w->byte_end;
        placed += c->cites[i].tokens.end - c->cites[i].tokens.start;
    }
    CHECK(outside, "the chunks after the opening lie outside it");
    CHECK(c->cites[c->n_cites - 1].byte_start == q1[0].byte_start ||
          q1[0].byte_end <= w->byte_end, "the best chunk outside the opening is placed last");
    size_t best_out = 0;
    while (q1[best_out].byte_end <= w->byte_end)
        best_out++;
    CHECK(c->cites[c->n_cites - 1].byte_start == q1[best_out].byte_start &&
          !strcmp(c->cites[c->n_cites - 1].doc_id, "long"), "best last: chunk %zu",
          (size_t)c->cites[c->n_cites - 1].chunk);
    CHECK(p1.read.chunks_placed == inside + c->n_cites - 1 &&
          p1.read.chunks_left_out == LONG_PARAS + 1 - p1.read.chunks_placed &&
          p1.read.placed_tokens == open_tokens + placed && c->n_tokens <= budget,
          "read: %zu placed (%zu inside the opening), %zu left out", p1.read.chunks_placed,
          inside, p1.read.chunks_left_out);
    /* another question, ranked otherwise and longer: the same prompt up to the opening's end */
    rq.chunks = q2;
    rq.n_chunks = LONG_PARAS;
    rq.question = "Which town lies on the river of paragraph forty?";
    rq.question_len = strlen(rq.question);
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && p2.read.window, "plan: %s", err);
    size_t n_open = p1.ctx->cites[0].tokens.end;
    CHECK(p2.ctx->cites[0].tokens.end == n_open &&
          !memcmp(p1.ctx->tokens, p2.ctx->tokens, n_open * sizeof *p1.ctx->tokens),
          "two questions share the prompt up to the opening's end (%zu tokens)", n_open);
    ctx_destroy(&p2.ctx);
    /* a conversation too: the earlier turns follow the documents */
    struct CtxTurn turns[2] = { { 0, "What is paragraph one about?", 28 },
                                { 1, "A river.", 8 } };
    rq.history = turns;
    rq.n_history = 2;
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && p2.read.window &&
          !memcmp(p1.ctx->tokens, p2.ctx->tokens, n_open * sizeof *p1.ctx->tokens) &&
          p2.ctx->n_turns == 2, "with earlier turns, the same opening: %s", err);
    ctx_destroy(&p2.ctx);
    /* a question so long that the opening no longer fits beside it: chunks, within budget */
    static char longq[4000];
    memset(longq, 'x', sizeof longq - 1);
    for (size_t i = 5; i + 1 < sizeof longq; i += 6)
        longq[i] = ' ';
    rq.history = NULL;
    rq.n_history = 0;
    rq.question = longq;
    rq.question_len = strlen(longq);
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && !p2.read.window &&
          p2.ctx->n_tokens <= budget, "a long question: no window (%s)", err);
    ctx_destroy(&p2.ctx);
    rq.question = "Where?";
    rq.question_len = 6;
    /* not without the daemon's leave, nor under a top_k */
    rq.window = 0;
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && !p2.read.window &&
          p2.ctx->cites[0].byte_start == q2[0].byte_start, "window 0: chunks best first");
    ctx_destroy(&p2.ctx);
    rq.window = 1;
    rq.top_k = 40;
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && !p2.read.window,
          "a top_k: no window");
    ctx_destroy(&p2.ctx);
    rq.top_k = 0;
    /* too few of its chunks offered to fill the opening: chunks (the relevance floor's case) */
    rq.n_chunks = 10;
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && !p2.read.window &&
          p2.ctx->n_cites == 10, "ten chunks offered: no window");
    ctx_destroy(&p2.ctx);
    rq.n_chunks = LONG_PARAS;
    /* an opening of about a third of the document: no window (of a document many times the
     * budget it would hold mostly what the question did not match) */
    rq.budget = doc_tokens * 2 / 5;
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && !p2.read.window &&
          rq.budget > 1400, "an opening under half the document: no window (budget %zu)",
          rq.budget);
    ctx_destroy(&p2.ctx);
    /* a budget whose opening would be under 1,024 tokens: no window */
    rq.budget = 1100;
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && !p2.read.window,
          "a small budget: no window");
    ctx_destroy(&p2.ctx);
    /* a budget the document fits: whole */
    rq.budget = doc_tokens + 400;
    rq.n_docs = 1;
    CHECK(plan_context(&rq, &p2, err, sizeof err) == RET_OK && !p2.read.window && p2.read.whole,
          "the document fits: whole");
    ctx_destroy(&p2.ctx);
    ctx_destroy(&p1.ctx);
}

/* A document whose paragraphs give way to a long table: the opening ends at a row (a line
 * end), not at the last paragraph end before the table, which would leave most of its share
 * unused. */
static void test_window_line_cut(void)
{
    enum { PARAS = 20, ROWS = 400 };
    static char text[PARAS * 80 + ROWS * 40];
    static struct CtxChunk ch[PARAS + ROWS];
    size_t off = 0, n = 0, table = 0;
    for (int i = 0; i < PARAS + ROWS; i++) {
        if (i == PARAS)
            table = off;
        size_t start = off;
        off += (size_t)(i < PARAS
                            ? snprintf(text + off, sizeof text - off,
                                       "Paragraph %d tells of river %d and of its town.", i, i)
                            : snprintf(text + off, sizeof text - off, "| row %d | value %d |",
                                       i, i * 3));
        ch[n] = (struct CtxChunk){ "tab", 3, "T", 1, text + start, off - start, (uint32_t)i,
                                   start, off, 100.0 - (double)i, 0, 0, NULL, 0, 0, 0 };
        n++;
        if (i + 1 < PARAS + ROWS)
            off += (size_t)snprintf(text + off, sizeof text - off, i < PARAS ? "\n\n" : "\n");
    }
    struct PlanDoc d[1] = { { "tab", 3, "T", 1, text, off, PLAN_DOC_FOUND, 5 } };
    size_t budget = tokens_of(text) * 2 / 3;
    struct PlanRequest rq = request(ch, n, 1, budget);
    rq.docs = d;
    rq.window = 1;
    char err[256];
    struct Plan pl;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK && pl.read.window, "plan: %s", err);
    const struct CtxCitation *w = &pl.ctx->cites[0];
    CHECK(w->byte_end > table && text[w->byte_end] == '\n' && text[w->byte_end + 1] == '|',
          "the opening ends at a table row: byte %zu (the table starts at %zu)",
          (size_t)w->byte_end, table);
    CHECK((w->tokens.end - w->tokens.start) * 4 > budget * 3 - 400,
          "it takes its share: %zu tokens of %zu", w->tokens.end - w->tokens.start, budget);
    ctx_destroy(&pl.ctx);
}

static void test_uncounted_and_errors(size_t frame)
{
    char err[256];
    struct Plan pl;
    /* stored text past plan_read_bytes: not counted, and not whole however large the budget
     * (the caller may have stopped reading) */
    static char big[20000];
    for (size_t i = 0; i + 1 < sizeof big; i++)
        big[i] = i % 6 == 5 ? ' ' : 'a' + (char)(i % 5);
    struct PlanDoc stored[1] = { { "big", 3, "", 0, big, strlen(big), PLAN_DOC_FOUND, 0 } };
    struct CtxChunk ch[1] = { { "big", 3, "", 0, big, 60, 0, 0, 60, 1.0, 0, 0, NULL, 0, 0, 0 } };
    struct PlanRequest rq = request(ch, 1, 1, strlen(big) / 32 - 1);
    rq.docs = stored;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK, "plan: %s", err);
    CHECK(pl.read.doc_tokens == -1 && !pl.read.whole && pl.read.documents == 1 &&
          pl.ctx->n_cites == 1, "stored text past 32 bytes a token is not counted (%lld)",
          pl.read.doc_tokens);
    ctx_destroy(&pl.ctx);
    /* inline documents always are */
    stored[0].source = PLAN_DOC_INLINE;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK && pl.read.doc_tokens > 0 &&
          !pl.read.whole, "inline documents are counted: %lld", pl.read.doc_tokens);
    ctx_destroy(&pl.ctx);
    make_docs(PLAN_DOC_INLINE);
    rq.docs = docs;
    rq.n_docs = 3;
    /* the frame alone over the budget */
    rq.budget = frame - 1;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_EBUDGET && !pl.ctx &&
          strstr(err, "budget is"), "a budget under the frame: RET_EBUDGET (%s)", err);
    /* stored documents before inline ones */
    rq.budget = 4096;
    docs[0].source = PLAN_DOC_NAMED;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_EINPUT && !pl.ctx,
          "documents out of source order: RET_EINPUT (%s)", err);
    rq.docs = NULL;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_EINPUT && !pl.ctx,
          "no documents: RET_EINPUT");
    rq.tc = NULL;
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_EINPUT, "no token counter: RET_EINPUT");
    /* nothing found, nothing to read: an empty context, not an error */
    rq = request(NULL, 0, 0, 4096);
    CHECK(plan_context(&rq, &pl, err, sizeof err) == RET_OK && pl.ctx->n_cites == 0 &&
          !pl.read.whole && pl.read.chunks_matched == 0, "no chunks, no documents: %s", err);
    ctx_destroy(&pl.ctx);
}

int main(void)
{
    tokcount_simple(&tc);
    size_t frame = frame_tokens();
    CHECK(frame > 0, "the frame has tokens");
    test_limits();
    test_whole_or_chunks(frame);
    test_floor_and_merge();
    test_orders();
    test_covered(frame);
    test_window();
    test_window_line_cut();
    test_uncounted_and_errors(frame);
    return check_report("test_planner");
}
