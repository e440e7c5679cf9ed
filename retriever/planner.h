/* The context planner: the one place that decides what of a query's documents goes into its
 * prompt, in which order, and what the reply says it read. Whole documents when, with no
 * top_k, they fit the token budget together; else the chunks the searches found, merged by
 * score, at most top_k (or about one per 8 budget tokens), none under the relevance floor,
 * laid out best first, best last (nearest) or in document order; a document all of whose
 * chunks are placed goes in whole instead, in its own order, whatever top_k and the scores
 * (its prompt then does not depend on the question); a long document whose offered chunks
 * alone would fill the prompt may be read as a window instead (PlanRequest.window): its
 * opening, the same for every question, then the best chunks outside it. The caller does the
 * I/O: it searches for plan_search_hits chunks, reads the candidate documents (stored ones
 * until their text passes plan_read_bytes) and hands both over; ctx_assemble (context.h) lays
 * out the prompt the plan chooses. */
#ifndef DIFFRAG_PLANNER_H
#define DIFFRAG_PLANNER_H

#include <stddef.h>
#include <stdint.h>

#include "retriever/context.h"
#include "text/tokcount.h"

/* Where a candidate document comes from: it decides the document's place in document order. */
enum PlanDocSource {
    PLAN_DOC_INLINE = 0,  /* sent with the query: as sent */
    PLAN_DOC_NAMED = 1,   /* stored, named by the query's ids: as the ids list them */
    PLAN_DOC_FOUND = 2,   /* stored, holding a chunk the search found: by id, so that the
                             layout does not depend on the question */
};

/* A document the query could read whole. */
struct PlanDoc {
    const char *id; size_t id_len;
    const char *title; size_t title_len;
    const char *text; size_t text_len;
    enum PlanDocSource source;
    uint64_t ref;                   /* copied to its citation when it is placed whole
                                       (CtxChunk.ref) */
};

/* One query's question to the planner. Every pointer is borrowed for the call only: the plan
 * copies what it keeps, so search hits and documents read from the store (valid until the read
 * transaction ends) may go as soon as plan_context returns. */
struct PlanRequest {
    const struct TokenCounter *tc;  /* counts and encodes the prompt */
    const char *question; size_t question_len;    /* the prompt's question */
    const char *system; size_t system_len;        /* the client's system text (NULL, 0: none) */
    const struct CtxTurn *history; size_t n_history;  /* earlier turns, oldest first */
    size_t budget;                  /* prompt tokens allowed, frame included
                                       (max_context_tokens) */
    size_t top_k;                   /* 0: none (the budget decides how many chunks are read,
                                       and documents that fit it together go in whole); else
                                       at most this many chunks (a document all of whose
                                       chunks are placed still goes in whole) */
    double relevance_floor;         /* 0..1: chunks scoring under this share of the best
                                       one's are not offered (0: every chunk found is) */
    enum CtxOrder order;
    int window;                     /* 1: a document whose offered chunks alone would fill the
                                       prompt may be read as a window: its opening in order,
                                       then the best chunks outside it, the best last
                                       (without top_k; the daemon allows it when the query
                                       names no order and chunk KV reuse is off) */
    /* The chunks the searches found, each search's best first, one search's after the
     * other's; with n_searches 2 (the inline documents' and a collection's) they are merged
     * by score. CtxChunk.ref is the caller's name for each, copied to its citation. */
    const struct CtxChunk *chunks; size_t n_chunks;
    int n_searches;
    /* The candidate documents, each once: the inline ones, then the stored ones (named or
     * found: sources in that order). The caller may stop reading stored ones once their text
     * passes plan_read_bytes(budget): then none go in whole and their tokens are not
     * counted. */
    const struct PlanDoc *docs; size_t n_docs;
};

/* What the prompt holds of the candidate documents (the reply's `context`). */
struct PlanRead {
    size_t documents;          /* candidate documents */
    long long doc_tokens;      /* their tokens; -1: not counted (too much stored text) */
    size_t placed_tokens;      /* document tokens placed in the prompt */
    size_t chunks_matched;     /* chunks found, within top_k (or the hits asked for) and the
                                  relevance floor */
    size_t chunks_placed;      /* of those, placed (whole documents: all of them) */
    size_t chunks_left_out;    /* matched but not placed */
    size_t chunks_below_floor; /* found within top_k (or the hits asked for) but under the
                                  relevance floor: not matched */
    int whole;                 /* every candidate document placed whole (by the budget, or
                                  because every chunk of each was placed) */
    int window;                /* the best chunk's document was read as a window: its
                                  opening in order (the first citation), then the best chunks
                                  outside it; its chunks inside the opening count as placed */
};

struct Plan {
    struct Context *ctx;       /* the prompt; owned by the caller (ctx_destroy), and holding
                                  copies of everything it needs, so it outlives the request */
    struct PlanRead read;
};

/* Chunks to ask each search for: top_k, or without one (0) enough chunks of any plausible
 * length to fill the budget (one per 8 tokens and 64 more, at most 100,000), so that the
 * budget, not a count, decides how much is read. */
size_t plan_search_hits(size_t top_k, size_t budget);

/* Bytes of stored candidate text worth reading for a budget: past 32 bytes a token the
 * documents cannot fit whole, and counting them could cost more than the question. */
size_t plan_read_bytes(size_t budget);

/* The order of a query that names none: best first (CTX_ORDER_RANK); with chunk KV reuse
 * (chunk_kv_reuse 1) best last (CTX_ORDER_NEAREST), since a blend computes the chunks ranked
 * best in full: laid out next to the question they read every other chunk, and the question
 * reads them nearest (docs/kv-reuse.md). */
enum CtxOrder plan_default_order(int chunk_kv_reuse);

/* Plan the prompt of rq into *out. Returns RET_OK; RET_EINPUT (a NULL pointer with a length,
 * documents out of source order, a bad chunk or turn); RET_ETOKEN (the token counter failed);
 * RET_EBUDGET (the instruction, system text, question and frame alone exceed the budget: the
 * message gives both numbers); RET_ENOMEM. On failure out->ctx is NULL and err says why. */
int plan_context(const struct PlanRequest *rq, struct Plan *out, char *err, size_t errlen);

#endif
