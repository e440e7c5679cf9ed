/* Okapi BM25 scoring and top-k retrieval with MaxScore dynamic pruning, over posting cursors
 * that any source (the LMDB store, an in-memory index) can feed block by block.
 *
 *   score(q, c) = sum over query terms t of  qtf(t) * idf(t) * tf (k1 + 1) / (tf + k1 (1 - b + b len / avglen))
 *   idf(t)      = ln(1 + (N - df + 0.5) / (df + 0.5))
 *
 * with N the number of chunks in the collection, df the chunks containing t, tf the count of t
 * in the chunk, len the chunk's length in terms and avglen the collection's mean length. */
#ifndef DIFFRAG_BM25_H
#define DIFFRAG_BM25_H

#include <stddef.h>
#include <stdint.h>

#include "retriever/postings.h"

#define BM25_DEFAULT_K1 0.9
#define BM25_DEFAULT_B 0.4
#define BM25_END UINT32_MAX  /* cursor exhausted */

struct Bm25Params { double k1, b, avglen; };

double bm25_idf(uint64_t n_chunks, uint64_t df);
double bm25_tf_part(uint32_t tf, uint32_t len, const struct Bm25Params *p);

/* One query term's postings, read a block at a time. The source sets `refill`; the search
 * owns pos/cur. `cur` is the current chunk id or BM25_END. */
struct PostingCursor {
    struct Posting *buf;   /* the decoded block: buf[0..n) */
    size_t n, pos;
    uint32_t cur;
    double weight;         /* qtf * idf */
    double ub;             /* upper bound of this term's contribution to any chunk */
    /* Load a block holding the first posting with id >= target into buf/n (or set n = 0 at the
     * end of the list). Returns 0 or a negative status. */
    int (*refill)(struct PostingCursor *c, uint32_t target);
    void *src;
};

/* Position at the first posting (call once after setting up buf/refill). */
int cursor_start(struct PostingCursor *c);
int cursor_next(struct PostingCursor *c);
/* Move to the first posting with id >= target (no-op when already there). */
int cursor_advance(struct PostingCursor *c, uint32_t target);

struct IdRange { uint32_t lo, hi; }; /* [lo, hi) */

struct ScoredId { double score; uint32_t id; };

struct Bm25Stats {
    uint64_t candidates;   /* chunks whose score was (at least partly) computed */
    uint64_t postings;     /* postings examined */
};

/* Top k chunks by score (ties: lower id first) over the cursors, restricted to `filter` (sorted,
 * disjoint ranges) when n_filter > 0. Cursors must have been started. out holds k entries;
 * *n_out receives how many were found, best first. Chunks that match no term are never
 * returned. `exhaustive` disables pruning (for tests). Returns 0 or a cursor's error. */
int bm25_top_k(struct PostingCursor **cursors, size_t n_cursors, const struct Bm25Params *p,
               const struct IdRange *filter, size_t n_filter, size_t k, int exhaustive,
               struct ScoredId *out, size_t *n_out, struct Bm25Stats *stats);

#endif
