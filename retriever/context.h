/* Context assembly: given a question, ranked chunks and a token budget, build the prompt as a
 * token array (separately encoded segments, concatenated) so the token span of each placed
 * chunk decodes exactly to its text, and return those spans with their citations. A client's
 * system text and the earlier turns of a conversation, when given, go in before the
 * documents (retriever/prompt.h has the layout). */
#ifndef DIFFRAG_CONTEXT_H
#define DIFFRAG_CONTEXT_H

#include <stddef.h>
#include <stdint.h>

#include "retriever/index.h"
#include "text/tokcount.h"

enum CtxOrder {
    CTX_ORDER_RANK = 0,      /* best first */
    CTX_ORDER_DOCUMENT = 1,  /* chosen best first, then laid out by document id and position */
    CTX_ORDER_NEAREST = 2,   /* chosen best first, then laid out worst first: the best chunk
                                ends the documents, next to the question */
};

/* A ranked chunk offered for the prompt (e.g. a SearchHit); all borrowed for the call. */
struct CtxChunk {
    const char *doc_id; size_t doc_id_len;
    const char *title; size_t title_len;
    const char *text; size_t text_len;
    uint32_t chunk;                 /* index in its document */
    uint64_t byte_start, byte_end;  /* in the document */
    double score;
    int whole;                      /* the text is the whole document */
    uint64_t ref;                   /* the caller's name for it, copied to its citation (the
                                       daemon: a stored chunk's collection and chunk ids) */
    const char *heading; size_t heading_len; /* its heading path, shown in its label (0: none) */
    uint32_t page_first, page_last; /* the pages it starts and ends on (chunker.h; 0: none) */
};

/* An earlier turn of the conversation; the text is borrowed for the call. */
struct CtxTurn {
    int assistant;                  /* 0: the user's turn; 1: the assistant's */
    const char *text; size_t len;
};

struct CtxOptions {
    size_t budget;          /* total prompt tokens allowed (everything, frame included) */
    enum CtxOrder order;
    int no_truncate;        /* 0: when no chunk fits whole, place a prefix of the best one */
    size_t pinned;          /* the first `pinned` chunks given, those placed, open the
                               documents in the order given; `order` lays out the rest */
    /* The client's system text, after the instruction in the system turn (NULL, 0: none),
     * and the earlier turns, oldest first (NULL, 0: none); both borrowed for the call. The
     * system text is part of the fixed cost. Turns are placed newest first, whole, while
     * together they take at most half of what the fixed cost leaves of the budget; the
     * first that does not fit ends them, so the placed turns are the most recent ones. With
     * neither, the prompt is the same as without these fields. */
    const char *system; size_t system_len;
    const struct CtxTurn *history; size_t n_history;
};

struct CtxSpan { size_t start, end; };  /* [start, end) */

struct CtxCitation {
    int marker;                     /* the n of [n] */
    size_t rank;                    /* index of the chunk in the caller's array */
    char *doc_id; size_t doc_id_len;  /* owned copy */
    const char *heading; size_t heading_len; /* the chunk's heading path (NUL-terminated, in
                                       doc_id's allocation; "" for none) */
    uint32_t page_first, page_last; /* CtxChunk's pages (0: none), also when truncated */
    uint32_t chunk;
    uint64_t byte_start, byte_end;  /* in the document (a truncated chunk ends earlier) */
    double score;
    int truncated;                  /* only a prefix of the chunk fitted */
    int whole;                      /* the whole document (CtxChunk.whole) */
    uint64_t ref;                   /* CtxChunk.ref */
    struct CtxSpan tokens;          /* the chunk text's tokens in Context.tokens */
    struct CtxSpan lead;            /* its copy label's tokens in Context.leads */
    struct CtxSpan bytes;           /* the chunk text's bytes in Context.text */
};

struct Context {
    int32_t *tokens; size_t n_tokens;   /* the prompt to prefill */
    char *text; size_t text_len;        /* the same prompt as text (NUL-terminated) */
    struct CtxCitation *cites; size_t n_cites; /* in prompt order */
    int32_t *leads; size_t n_leads;     /* each citation's copy label, laid end to end: its
                                           label with marker PROMPT_COPY_MARKER, encoded
                                           alone (what a chunk's KV copy is made after) */
    struct CtxSpan question;            /* the question's tokens */
    struct CtxSpan documents;           /* tokens from the first label to the last separator */
    struct CtxSpan history;             /* the placed earlier turns after the documents,
                                           frame included, up to the question's "Question: "
                                           (empty: none) */
    size_t n_offered, n_skipped;        /* chunks given; chunks that did not fit */
    size_t n_turns, n_turns_skipped;    /* earlier turns placed; given but left out (the
                                           oldest ones) */
};

/* Assemble. The prompt never has more than o->budget tokens as counted by tc. Returns RET_OK;
 * RET_EBUDGET when the instruction, system text, question and frame alone exceed the budget
 * (the message gives both numbers); RET_EINPUT (NULL question, bad chunk, bad turn); RET_ETOKEN;
 * RET_ENOMEM.
 * *out is owned by the caller: free with ctx_destroy. */
int ctx_assemble(const struct TokenCounter *tc, const char *question, size_t question_len,
                 const struct CtxChunk *chunks, size_t n_chunks, const struct CtxOptions *o,
                 struct Context **out, char *err, size_t errlen);
void ctx_destroy(struct Context **c);

/* Fill out[0..n) from search hits (store or in-memory); the CtxChunks borrow what the hits
 * borrow, so assemble before the reader or index that produced the hits goes away. */
void ctx_chunks_from_hits(const struct SearchHit *hits, size_t n, struct CtxChunk *out);

#endif
