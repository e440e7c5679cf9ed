/* The context planner (planner.h): whether a query reads its documents whole or their best
 * chunks, which chunks are offered (merged by score, top_k, the relevance floor), in which
 * order they are laid out, and what the reply says was read. ctx_assemble does the layout. */
#include "retriever/planner.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/chunker.h"
#include "retriever/prompt.h"
#include "retriever/status.h"

/* Chunks asked for per budget token without a top_k (one per 8 tokens, and a few more: short
 * chunks too can fill the budget), and the most ever asked for. */
enum { PLAN_TOKENS_PER_HIT = 8, PLAN_EXTRA_HITS = 64, PLAN_MAX_HITS = 100000 };

/* Bytes of stored candidate documents counted at most, per budget token: past that they
 * cannot fit whole (that would take more than 32 bytes a token). */
enum { PLAN_COUNT_BYTES_PER_TOKEN = 32 };

size_t plan_search_hits(size_t top_k, size_t budget)
{
    if (top_k > 0)
        return top_k;
    size_t k = budget / PLAN_TOKENS_PER_HIT + PLAN_EXTRA_HITS;
    return k > PLAN_MAX_HITS ? PLAN_MAX_HITS : k;
}

size_t plan_read_bytes(size_t budget)
{
    return budget * PLAN_COUNT_BYTES_PER_TOKEN;
}

enum CtxOrder plan_default_order(int chunk_kv_reuse)
{
    return chunk_kv_reuse ? CTX_ORDER_NEAREST : CTX_ORDER_RANK;
}

/* A candidate document, as the whole-document layout sorts it. */
struct Cand {
    const struct PlanDoc *doc;
    double score;              /* its best chunk's; 0 when the search found none */
    size_t order;              /* its place in document order */
};

static int same_id(const char *a, size_t al, const char *b, size_t bl)
{
    return al == bl && (al == 0 || !memcmp(a, b, al));
}

/* The index in rq->docs of the document with this id; rq->n_docs when none has it. */
static size_t doc_index(const struct PlanRequest *rq, const char *id, size_t id_len)
{
    size_t d = 0;
    while (d < rq->n_docs && !same_id(rq->docs[d].id, rq->docs[d].id_len, id, id_len))
        d++;
    return d;
}

static int by_score(const void *a, const void *b)
{
    const struct CtxChunk *x = a, *y = b;
    return x->score < y->score ? 1 : x->score > y->score ? -1 : 0;
}

static int by_cand_id(const void *a, const void *b)
{
    const struct PlanDoc *x = ((const struct Cand *)a)->doc, *y = ((const struct Cand *)b)->doc;
    size_t n = x->id_len < y->id_len ? x->id_len : y->id_len;
    int c = n ? memcmp(x->id, y->id, n) : 0;
    return c ? c : (x->id_len > y->id_len) - (x->id_len < y->id_len);
}

static int by_cand_score(const void *a, const void *b)
{
    const struct Cand *x = a, *y = b;
    if (x->score != y->score)
        return x->score < y->score ? 1 : -1;
    return (x->order > y->order) - (x->order < y->order);
}

static int by_cand_order(const void *a, const void *b)
{
    const struct Cand *x = a, *y = b;
    return (x->order > y->order) - (x->order < y->order);
}

/* The stored documents' text passes what plan_read_bytes lets be read: then they cannot fit
 * whole, and the caller may not have read them all. */
static int docs_too_long(const struct PlanRequest *rq)
{
    size_t bytes = 0;
    for (size_t i = 0; i < rq->n_docs; i++)
        if (rq->docs[i].source != PLAN_DOC_INLINE)
            bytes += rq->docs[i].text_len;
    return bytes > plan_read_bytes(rq->budget);
}

/* The candidates' tokens into *tokens, unless the stored ones hold too much text to count
 * (*counted = 0: then they cannot fit whole anyway). Inline documents are always counted:
 * the message bounds them, and their chunking has just read them as closely. */
static int count_docs(const struct PlanRequest *rq, size_t *tokens, int *counted, char *err,
                      size_t errlen)
{
    *tokens = 0;
    *counted = !docs_too_long(rq);
    for (size_t i = 0; *counted && i < rq->n_docs; i++) {
        size_t t;
        if (tokcount_count(rq->tc, rq->docs[i].text, rq->docs[i].text_len, &t))
            return ret_fail(err, errlen, RET_ETOKEN, "the token counter failed on a document");
        *tokens += t;
    }
    return RET_OK;
}

/* The chunks offered, best first, into chunks[0..*n_offered); chunks[0..n_chunks) holds every
 * chunk found (the whole-document layout scores documents by all of them). Inline and stored
 * hits come from two indexes: BM25 scores of one query, merged by score. */
static int offer_chunks(const struct PlanRequest *rq, struct CtxChunk **out, size_t *n_offered,
                        size_t *n_below)
{
    size_t n = rq->n_chunks;
    struct CtxChunk *chunks = malloc((n ? n : 1) * sizeof *chunks);
    if (!chunks)
        return RET_ENOMEM;
    if (n)
        memcpy(chunks, rq->chunks, n * sizeof *chunks);
    if (rq->n_searches > 1)
        qsort(chunks, n, sizeof *chunks, by_score);
    size_t k = plan_search_hits(rq->top_k, rq->budget);
    if (n > k)
        n = k;
    /* the relevance floor: chunks (best first) under a share of the best one's score are not
     * offered, however much budget is left; they do not count as matched */
    if (n > 1 && rq->relevance_floor > 0) {
        double floor_score = rq->relevance_floor * chunks[0].score;
        size_t m = 1;
        while (m < n && chunks[m].score >= floor_score)
            m++;
        *n_below = n - m;
        n = m;
    }
    *out = chunks;
    *n_offered = n;
    return RET_OK;
}

/* Every candidate whole, if they fit the budget together: *ctx set (else left NULL). Laid
 * out best first (by their best chunk's score; documents the search found nothing in last,
 * as sent), with CTX_ORDER_NEAREST the other way round (the best next to the question), or
 * with CTX_ORDER_DOCUMENT in document order (enum PlanDocSource). */
static int place_whole(const struct PlanRequest *rq, const struct CtxChunk *found, size_t n_found,
                       struct Context **ctx, char *err, size_t errlen)
{
    size_t n = rq->n_docs;
    struct Cand *c = calloc(n, sizeof *c);
    struct CtxChunk *whole = calloc(n, sizeof *whole);
    int st = RET_OK;
    if (!c || !whole) {
        st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
        goto done;
    }
    size_t first_found = n;
    for (size_t i = 0; i < n; i++) {
        c[i] = (struct Cand){ &rq->docs[i], 0.0, i };
        if (rq->docs[i].source == PLAN_DOC_FOUND && first_found == n)
            first_found = i;
        for (size_t h = 0; h < n_found; h++)
            if (same_id(found[h].doc_id, found[h].doc_id_len, rq->docs[i].id, rq->docs[i].id_len) &&
                found[h].score > c[i].score)
                c[i].score = found[h].score;
    }
    /* found by the search: in id order, so the layout does not depend on the question */
    qsort(c + first_found, n - first_found, sizeof *c, by_cand_id);
    for (size_t i = first_found; i < n; i++)
        c[i].order = i;
    qsort(c, n, sizeof *c, rq->order == CTX_ORDER_DOCUMENT ? by_cand_order : by_cand_score);
    for (size_t i = 0; i < n; i++) {
        const struct PlanDoc *d = c[i].doc;
        whole[i] = (struct CtxChunk){ d->id, d->id_len, d->title, d->title_len, d->text,
                                      d->text_len, 0, 0, d->text_len, c[i].score, 1, d->ref, NULL, 0,
                                      0, 0 };
        if (chunk_text_pages(d->text, d->text_len, &whole[i].page_first, &whole[i].page_last)) {
            st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
            goto done;
        }
    }
    /* document order is the candidates' own; nearest lays them out best last */
    struct CtxOptions co = { .budget = rq->budget, .no_truncate = 1,
                             .order = rq->order == CTX_ORDER_NEAREST ? CTX_ORDER_NEAREST
                                                                     : CTX_ORDER_RANK,
                             .system = rq->system, .system_len = rq->system_len,
                             .history = rq->history, .n_history = rq->n_history };
    st = ctx_assemble(rq->tc, rq->question, rq->question_len, whole, n, &co, ctx, err, errlen);
    if (st == RET_EBUDGET)
        st = RET_OK;  /* the frame alone does not fit: the chunk layout says so */
    else if (!st && (*ctx)->n_skipped > 0)
        ctx_destroy(ctx);  /* the labels tipped it over: place chunks instead */
done:
    free(c);
    free(whole);
    return st;
}

static int by_size(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return (x > y) - (x < y);
}

static int is_blank(const char *s, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++)
        if (s[i] != ' ' && s[i] != '\n' && s[i] != '\t' && s[i] != '\r')
            return 0;
    return 1;
}

static int by_cite_doc(const void *a, const void *b, void *cites_v)
{
    const struct CtxCitation *cites = cites_v;
    const struct CtxCitation *x = &cites[*(const size_t *)a], *y = &cites[*(const size_t *)b];
    size_t n = x->doc_id_len < y->doc_id_len ? x->doc_id_len : y->doc_id_len;
    int c = n ? memcmp(x->doc_id, y->doc_id, n) : 0;
    if (c || x->doc_id_len != y->doc_id_len)
        return c ? c : x->doc_id_len < y->doc_id_len ? -1 : 1;
    return (x->byte_start > y->byte_start) - (x->byte_start < y->byte_start);
}

/* Marks in covered[] (one per rq->docs) the documents whose placed chunks, untruncated, cover
 * their whole text (what lies between and around them is blank); returns how many. */
static size_t find_covered(const struct PlanRequest *rq, const struct Context *ctx,
                           unsigned char *covered, size_t *order)
{
    const struct CtxCitation *ci = ctx->cites;
    size_t n = ctx->n_cites, n_covered = 0;
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    qsort_r(order, n, sizeof *order, by_cite_doc, (void *)ci);
    for (size_t g = 0, e; g < n; g = e) {
        for (e = g + 1; e < n && same_id(ci[order[e]].doc_id, ci[order[e]].doc_id_len,
                                         ci[order[g]].doc_id, ci[order[g]].doc_id_len); e++)
            ;
        size_t d = doc_index(rq, ci[order[g]].doc_id, ci[order[g]].doc_id_len);
        if (d == rq->n_docs || covered[d])
            continue;
        const struct PlanDoc *doc = &rq->docs[d];
        uint64_t end = 0;
        int ok = 1;
        for (size_t i = g; i < e && ok; i++) {
            const struct CtxCitation *c = &ci[order[i]];
            ok = !c->truncated && c->byte_end <= doc->text_len &&
                 (c->byte_start <= end || is_blank(doc->text, end, c->byte_start));
            if (c->byte_end > end)
                end = c->byte_end;
        }
        if (ok && is_blank(doc->text, end, doc->text_len)) {
            covered[d] = 1;
            n_covered++;
        }
    }
    return n_covered;
}

/* After the chunk layout *ctx: a document all of whose chunks were placed goes in whole
 * instead, one piece of text in its own order (its prompt then does not depend on which of its
 * chunks the question ranked best). Every candidate so covered: the whole-document layout
 * (place_whole); else each covered document takes its best chunk's place among the other
 * chunks. Kept only if everything fits as it did; *n_whole: the documents placed whole. */
static int place_covered(const struct PlanRequest *rq, const struct CtxChunk *chunks,
                         size_t n_chunks, struct Context **ctx, size_t *n_whole, char *err,
                         size_t errlen)
{
    const struct Context *c1 = *ctx;
    size_t n = c1->n_cites;
    unsigned char *covered = calloc(rq->n_docs ? rq->n_docs : 1, 1);
    size_t *order = malloc((n ? n : 1) * sizeof *order);
    struct CtxChunk *list = malloc((n ? n : 1) * sizeof *list);
    struct Context *c2 = NULL;
    int st = RET_OK;
    *n_whole = 0;
    if (!covered || !order || !list) {
        st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
        goto done;
    }
    size_t n_covered = find_covered(rq, c1, covered, order), n_list = 0, in_docs = 0;
    if (n_covered == 0)
        goto done;
    /* the placed chunks best first, each covered document whole at its best chunk's place */
    for (size_t i = 0; i < n; i++)
        order[i] = c1->cites[i].rank;
    qsort(order, n, sizeof *order, by_size);
    for (size_t i = 0; i < n; i++) {
        const struct CtxChunk *ch = &chunks[order[i]];
        size_t d = doc_index(rq, ch->doc_id, ch->doc_id_len);
        in_docs += d < rq->n_docs && covered[d];
        if (d == rq->n_docs || !covered[d]) {
            list[n_list++] = *ch;
        } else if (covered[d] == 1) {
            const struct PlanDoc *p = &rq->docs[d];
            struct CtxChunk *w = &list[n_list++];
            *w = (struct CtxChunk){ p->id, p->id_len, p->title, p->title_len, p->text,
                                    p->text_len, 0, 0, p->text_len, ch->score, 1, p->ref, NULL,
                                    0, 0, 0 };
            if (chunk_text_pages(p->text, p->text_len, &w->page_first, &w->page_last)) {
                st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
                goto done;
            }
            covered[d] = 2;
        }
    }
    if (n_covered == rq->n_docs && in_docs == n) {
        if ((st = place_whole(rq, chunks, n_chunks, &c2, err, errlen)))
            goto done;
    } else {
        struct CtxOptions co = { .budget = rq->budget, .no_truncate = 1, .order = rq->order,
                                 .system = rq->system, .system_len = rq->system_len,
                                 .history = rq->history, .n_history = rq->n_history };
        if ((st = ctx_assemble(rq->tc, rq->question, rq->question_len, list, n_list, &co, &c2,
                               err, errlen)))
            goto done;
        if (c2->n_skipped > 0)
            ctx_destroy(&c2);  /* the whole text did not fit where its chunks did */
    }
    if (c2) {
        ctx_destroy(ctx);
        *ctx = c2;
        *n_whole = n_covered;
    }
done:
    free(covered);
    free(order);
    free(list);
    return st;
}

/* A window: a document whose offered chunks alone would fill the prompt is read in order from
 * its start, and the best chunks outside that opening follow it, the best last, next to the
 * question. The opening depends only on the document, the budget and the frame before the
 * documents, never on the question, so every later question over the document takes it from
 * the prefix cache and computes only the chunks after it and itself (docs/retriever.md). The
 * window takes all but an eighth of what the frame leaves of the budget; the eighth (2,048
 * tokens at 16K) is the CPU workers' whole default budget of best chunks. A window under
 * PLAN_WINDOW_MIN_TOKENS saves too little prefill to be worth a layout of its own, and one
 * that holds less than half of its document trades too much of what the question matched. */
enum { PLAN_WINDOW_TAIL_DIV = 8, PLAN_WINDOW_MIN_TOKENS = 1024, PLAN_WINDOW_SLACK = 16 };

/* The longest opening of text that ends at a cut (a line end; with para, one before a blank
 * line) and holds at most `avail` tokens: its length into *len and its tokens into *tokens
 * (0, 0: none fits). */
static int fit_cut(const struct TokenCounter *tc, const char *text, size_t text_len, int para,
                   size_t avail, size_t *cuts, size_t *len, size_t *tokens)
{
    size_t n_cuts = 0;
    *len = *tokens = 0;
    for (size_t i = 1; i + 1 < text_len; i++)
        if (text[i] == '\n' && text[i - 1] != '\n' && (!para || text[i + 1] == '\n'))
            cuts[n_cuts++] = i;
    size_t lo = 0, hi = n_cuts;  /* cuts[0..lo) fit; cuts[hi..) do not */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2, t;
        if (tokcount_count(tc, text, cuts[mid], &t))
            return RET_ETOKEN;
        if (t <= avail) {
            lo = mid + 1;
            *len = cuts[mid];
            *tokens = t;
        } else {
            hi = mid;
        }
    }
    return RET_OK;
}

/* The opening of text with at most `avail` tokens: its length into *len (0: none fits). It ends
 * a paragraph (before a blank line), unless the last paragraph end that fits leaves more than
 * an eighth of `avail` unused (a long table, list or code block there): then a line. */
static int fit_opening(const struct TokenCounter *tc, const char *text, size_t text_len,
                       size_t avail, size_t *len)
{
    size_t *cuts = malloc((text_len / 2 + 1) * sizeof *cuts), t, line_len;
    if (!cuts)
        return RET_ENOMEM;
    int st = fit_cut(tc, text, text_len, 1, avail, cuts, len, &t);
    if (!st && t < avail - avail / PLAN_WINDOW_TAIL_DIV &&
        !(st = fit_cut(tc, text, text_len, 0, avail, cuts, &line_len, &t)) && line_len > *len)
        *len = line_len;
    free(cuts);
    return st;
}

/* The window layout into *ctx when it applies (else *ctx stays NULL); *n_inside: the offered
 * chunks its opening holds whole. */
static int place_window(const struct PlanRequest *rq, const struct CtxChunk *chunks,
                        size_t n_offered, struct Context **ctx, size_t *n_inside, char *err,
                        size_t errlen)
{
    if (!rq->window || rq->top_k || n_offered == 0)
        return RET_OK;
    const struct CtxChunk *best = &chunks[0];
    size_t d_index = doc_index(rq, best->doc_id, best->doc_id_len);
    if (d_index == rq->n_docs)
        return RET_OK;  /* not read (too much stored text): no opening to place */
    const struct PlanDoc *d = &rq->docs[d_index];
    /* what the frame before the documents leaves, whatever the question and earlier turns */
    struct CtxOptions co = { .budget = rq->budget, .no_truncate = 1, .system = rq->system,
                             .system_len = rq->system_len };
    struct Context *frame = NULL;
    int st = ctx_assemble(rq->tc, "", 0, NULL, 0, &co, &frame, err, errlen);
    if (st)
        return st == RET_EBUDGET ? RET_OK : st;
    size_t docs_avail = rq->budget - frame->n_tokens;
    ctx_destroy(&frame);
    char label[PROMPT_LABEL_BYTES];
    int label_len = prompt_label(1, d->title, d->title_len, NULL, 0, label, sizeof label);
    size_t label_tokens, open_len;
    if (label_len < 0 || tokcount_count(rq->tc, label, (size_t)label_len, &label_tokens))
        return ret_fail(err, errlen, RET_ETOKEN, "the token counter failed on a label");
    size_t allow = docs_avail - docs_avail / PLAN_WINDOW_TAIL_DIV;
    if (allow < PLAN_WINDOW_MIN_TOKENS + label_tokens + PLAN_WINDOW_SLACK)
        return RET_OK;
    allow -= label_tokens + PLAN_WINDOW_SLACK;
    if ((st = fit_opening(rq->tc, d->text, d->text_len, allow, &open_len)))
        return ret_fail(err, errlen, st, "%s", st == RET_ENOMEM
                                                   ? "out of memory"
                                                   : "the token counter failed on a document");
    /* only when the document does not fit, the opening holds at least half of it (of a
     * document many times the budget it would hold mostly what the question did not match)
     * and the document's offered chunks alone would fill the opening */
    size_t offered_bytes = 0;
    for (size_t i = 0; i < n_offered; i++)
        if (same_id(chunks[i].doc_id, chunks[i].doc_id_len, d->id, d->id_len))
            offered_bytes += chunks[i].text_len;
    if (open_len == 0 || open_len >= d->text_len || open_len < d->text_len / 2 ||
        offered_bytes < open_len)
        return RET_OK;
    struct CtxChunk *list = malloc((n_offered + 1) * sizeof *list);
    if (!list)
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
    size_t n_list = 1;
    *n_inside = 0;
    list[0] = (struct CtxChunk){ d->id, d->id_len, d->title, d->title_len, d->text, open_len, 0,
                                 0, open_len, best->score, 0, d->ref, NULL, 0, 0, 0 };
    if (chunk_text_pages(d->text, open_len, &list[0].page_first, &list[0].page_last)) {
        free(list);
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n_offered; i++) {
        int inside = same_id(chunks[i].doc_id, chunks[i].doc_id_len, d->id, d->id_len) &&
                     chunks[i].byte_end <= open_len;
        *n_inside += inside;
        if (!inside)
            list[n_list++] = chunks[i];
    }
    co = (struct CtxOptions){ .budget = rq->budget, .no_truncate = 1, .pinned = 1,
                              .order = CTX_ORDER_NEAREST, .system = rq->system,
                              .system_len = rq->system_len, .history = rq->history,
                              .n_history = rq->n_history };
    st = ctx_assemble(rq->tc, rq->question, rq->question_len, list, n_list, &co, ctx, err,
                      errlen);
    free(list);
    if (st == RET_EBUDGET)
        st = RET_OK;  /* the frame alone does not fit: the chunk layout says so */
    else if (!st && ((*ctx)->n_cites == 0 || (*ctx)->cites[0].rank != 0))
        ctx_destroy(ctx);  /* a long question or conversation left no room for the opening */
    return st;
}

static int check_request(const struct PlanRequest *rq, char *err, size_t errlen)
{
    if (!rq->tc)
        return ret_fail(err, errlen, RET_EINPUT, "no token counter");
    if (!rq->chunks && rq->n_chunks)
        return ret_fail(err, errlen, RET_EINPUT, "no chunks");
    if (!rq->docs && rq->n_docs)
        return ret_fail(err, errlen, RET_EINPUT, "no documents");
    for (size_t i = 0; i < rq->n_docs; i++) {
        const struct PlanDoc *d = &rq->docs[i];
        if ((!d->id && d->id_len) || (!d->text && d->text_len) || (!d->title && d->title_len))
            return ret_fail(err, errlen, RET_EINPUT, "document %zu has no id, title or text", i);
        if (d->source > PLAN_DOC_FOUND || (i > 0 && d->source < rq->docs[i - 1].source))
            return ret_fail(err, errlen, RET_EINPUT, "document %zu is out of source order", i);
    }
    return RET_OK;
}

int plan_context(const struct PlanRequest *rq, struct Plan *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    struct PlanRead *rd = &out->read;
    struct CtxChunk *chunks = NULL;
    size_t tokens = 0, n_offered = 0;
    int counted = 0, st;
    if ((st = check_request(rq, err, errlen)) ||
        (st = count_docs(rq, &tokens, &counted, err, errlen)))
        return st;
    rd->documents = rq->n_docs;
    rd->doc_tokens = counted ? (long long)tokens : -1;
    if ((st = offer_chunks(rq, &chunks, &n_offered, &rd->chunks_below_floor)))
        return ret_fail(err, errlen, st, "out of memory");
    rd->chunks_matched = n_offered;
    /* Without a top_k cap, documents that fit the budget together go in whole. */
    if (rq->top_k == 0 && counted && rq->n_docs > 0 && tokens <= rq->budget &&
        (st = place_whole(rq, chunks, rq->n_chunks, &out->ctx, err, errlen)))
        goto done;
    rd->whole = out->ctx != NULL;
    rd->chunks_placed = n_offered;
    if (!rd->whole) {
        size_t n_inside = 0;
        if ((st = place_window(rq, chunks, n_offered, &out->ctx, &n_inside, err, errlen)))
            goto done;
        rd->window = out->ctx != NULL;
        if (rd->window)
            rd->chunks_placed = n_inside + out->ctx->n_cites - 1;
    }
    if (!rd->whole && !rd->window) {
        struct CtxOptions co = { .budget = rq->budget, .order = rq->order,
                                 .system = rq->system, .system_len = rq->system_len,
                                 .history = rq->history, .n_history = rq->n_history };
        size_t n_whole = 0;
        if ((st = ctx_assemble(rq->tc, rq->question, rq->question_len, chunks, n_offered, &co,
                               &out->ctx, err, errlen)))
            goto done;
        rd->chunks_placed = out->ctx->n_cites;
        if ((st = place_covered(rq, chunks, n_offered, &out->ctx, &n_whole, err, errlen)))
            goto done;
        rd->whole = n_whole > 0 && n_whole == rq->n_docs;
        for (size_t i = 0; rd->whole && i < out->ctx->n_cites; i++)
            rd->whole = out->ctx->cites[i].whole;
    }
    rd->chunks_left_out = rd->chunks_matched - rd->chunks_placed;
    for (size_t i = 0; i < out->ctx->n_cites; i++)
        rd->placed_tokens += out->ctx->cites[i].tokens.end - out->ctx->cites[i].tokens.start;
done:
    free(chunks);
    if (st)
        ctx_destroy(&out->ctx);
    return st;
}
