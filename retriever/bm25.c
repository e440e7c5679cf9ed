/* BM25 term weights, a bounded min-heap for the top k, and document-at-a-time MaxScore: lists
 * whose upper bounds together cannot lift a chunk past the current k-th score stop producing
 * candidates and are only probed (by skipping) for chunks that the other lists found. */
#include "retriever/bm25.h"

#include <math.h>
#include <stdlib.h>

#include "retriever/status.h"

double bm25_idf(uint64_t n_chunks, uint64_t df)
{
    return log(1.0 + ((double)n_chunks - (double)df + 0.5) / ((double)df + 0.5));
}

double bm25_tf_part(uint32_t tf, uint32_t len, const struct Bm25Params *p)
{
    double norm = p->avglen > 0 ? (double)len / p->avglen : 1.0;
    return (double)tf * (p->k1 + 1.0) / ((double)tf + p->k1 * (1.0 - p->b + p->b * norm));
}

static void cursor_set(struct PostingCursor *c)
{
    c->cur = c->pos < c->n ? c->buf[c->pos].id : BM25_END;
}

int cursor_start(struct PostingCursor *c)
{
    c->pos = 0;
    c->n = 0;
    int rc = c->refill(c, 0);
    cursor_set(c);
    return rc;
}

int cursor_advance(struct PostingCursor *c, uint32_t target)
{
    if (c->cur == BM25_END || c->cur >= target)
        return 0;
    while (c->n == 0 || c->buf[c->n - 1].id < target) {
        if (c->n == 0 && c->cur == BM25_END)
            return 0;
        int rc = c->refill(c, target);
        if (rc)
            return rc;
        if (c->n == 0) {
            c->pos = 0;
            c->cur = BM25_END;
            return 0;
        }
        c->pos = 0;
    }
    /* The block holds target's successor: binary search from pos. */
    size_t lo = c->pos, hi = c->n - 1;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c->buf[mid].id < target) lo = mid + 1; else hi = mid;
    }
    c->pos = lo;
    cursor_set(c);
    return 0;
}

int cursor_next(struct PostingCursor *c)
{
    if (c->cur == BM25_END)
        return 0;
    if (++c->pos < c->n) {
        c->cur = c->buf[c->pos].id;
        return 0;
    }
    if (c->cur == BM25_END - 1) {
        c->cur = BM25_END;
        return 0;
    }
    return cursor_advance(c, c->cur + 1);
}

/* Heap of the k best so far; the root is the worst (lowest score, then highest id). */
static int worse(const struct ScoredId *a, const struct ScoredId *b)
{
    return a->score < b->score || (a->score == b->score && a->id > b->id);
}

static void sift_down(struct ScoredId *h, size_t n, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && worse(&h[l], &h[m])) m = l;
        if (r < n && worse(&h[r], &h[m])) m = r;
        if (m == i) return;
        struct ScoredId t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

static void sift_up(struct ScoredId *h, size_t i)
{
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!worse(&h[i], &h[p])) return;
        struct ScoredId t = h[i]; h[i] = h[p]; h[p] = t;
        i = p;
    }
}

static int by_ub(const void *a, const void *b)
{
    const struct PostingCursor *x = *(struct PostingCursor *const *)a;
    const struct PostingCursor *y = *(struct PostingCursor *const *)b;
    return (x->ub > y->ub) - (x->ub < y->ub);
}

static int best_first(const void *a, const void *b)
{
    const struct ScoredId *x = a, *y = b;
    if (x->score != y->score) return x->score < y->score ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* First id >= d inside the filter, or BM25_END. *fi is a monotone hint. */
static uint32_t filter_next(const struct IdRange *f, size_t nf, size_t *fi, uint32_t d)
{
    while (*fi < nf && f[*fi].hi <= d)
        (*fi)++;
    if (*fi == nf)
        return BM25_END;
    return d < f[*fi].lo ? f[*fi].lo : d;
}

int bm25_top_k(struct PostingCursor **cs, size_t n, const struct Bm25Params *p,
               const struct IdRange *filter, size_t n_filter, size_t k, int exhaustive,
               struct ScoredId *heap, size_t *n_out, struct Bm25Stats *stats)
{
    *n_out = 0;
    struct Bm25Stats st = { 0, 0 };
    if (k == 0 || n == 0) {
        if (stats) *stats = st;
        return 0;
    }
    int rc = 0;
    qsort(cs, n, sizeof *cs, by_ub);
    /* prefix[i] = ub[0] + ... + ub[i]; a little slack so rounding never prunes a true hit. */
    double *prefix = malloc(n * sizeof *prefix);
    if (!prefix)
        return RET_ENOMEM;
    double acc = 0;
    for (size_t i = 0; i < n; i++) {
        acc += cs[i]->ub * (1.0 + 1e-9);
        prefix[i] = acc;
    }
    size_t nh = 0, first_ess = 0, fi = 0;
    double theta = -INFINITY;
    for (;;) {
        uint32_t d = BM25_END;
        for (size_t i = first_ess; i < n; i++)
            if (cs[i]->cur < d)
                d = cs[i]->cur;
        if (d == BM25_END)
            break;
        if (n_filter) {
            uint32_t t = filter_next(filter, n_filter, &fi, d);
            if (t != d) {
                if (t == BM25_END)
                    break;
                for (size_t i = first_ess; i < n; i++)
                    if ((rc = cursor_advance(cs[i], t)))
                        goto out;
                continue;
            }
        }
        st.candidates++;
        double score = 0;
        for (size_t i = first_ess; i < n; i++) {
            struct PostingCursor *c = cs[i];
            if (c->cur == d) {
                const struct Posting *ps = &c->buf[c->pos];
                score += c->weight * bm25_tf_part(ps->tf, ps->len, p);
                st.postings++;
                if ((rc = cursor_next(c)))
                    goto out;
            }
        }
        for (size_t i = first_ess; i-- > 0;) {
            if (score + prefix[i] <= theta)
                break;
            struct PostingCursor *c = cs[i];
            if ((rc = cursor_advance(c, d)))
                goto out;
            if (c->cur == d) {
                const struct Posting *ps = &c->buf[c->pos];
                score += c->weight * bm25_tf_part(ps->tf, ps->len, p);
                st.postings++;
            }
        }
        struct ScoredId cand = { score, d };
        if (nh < k) {
            heap[nh] = cand;
            sift_up(heap, nh++);
        } else if (worse(&heap[0], &cand)) {
            heap[0] = cand;
            sift_down(heap, nh, 0);
        } else {
            continue;
        }
        if (nh == k && !exhaustive) {
            theta = heap[0].score;
            while (first_ess < n && prefix[first_ess] <= theta)
                first_ess++;
        }
    }
    qsort(heap, nh, sizeof *heap, best_first);
    *n_out = nh;
out:
    free(prefix);
    if (stats)
        *stats = st;
    return rc;
}
