/* The token-counting interface the retriever uses to size chunks and assemble prompts, so the
 * store, chunker and index never depend on the model's tokenizer: the model implements it
 * (model/tokcount_model.h), and a simple, exactly reversible byte-packing counter here serves
 * tests and ingesting without a model. */
#ifndef DIFFRAG_TEXT_TOKCOUNT_H
#define DIFFRAG_TEXT_TOKCOUNT_H

#include <stddef.h>
#include <stdint.h>

/* Return codes. They have the values of RET_OK, RET_EINPUT, RET_ENOMEM and RET_ETOKEN in
 * retriever/status.h, so the retriever passes them on unchanged. */
enum TokCountStatus {
    TOKCOUNT_OK = 0,
    TOKCOUNT_EINPUT = -1,  /* an id the counter never gives (decode) */
    TOKCOUNT_ENOMEM = -4,
    TOKCOUNT_EFAIL = -8,   /* the counter's encode or decode failed */
};

enum TokCountFlags {
    TC_SPECIAL = 1u << 0, /* recognise special-token strings such as <|im_start|> */
    TC_ADD_BOS = 1u << 1, /* prepend BOS when the vocabulary asks for it */
};

struct TokenCounter {
    void *ctx;
    /* Encode len bytes; write at most cap ids; *n_out = full count (cap 0 sizes). 0 or < 0. */
    int (*encode)(void *ctx, const char *text, size_t len, unsigned flags, int32_t *ids,
                  size_t cap, size_t *n_out);
    /* Decode n ids to bytes; write at most cap bytes; *n_out = full length. 0 or < 0. */
    int (*decode)(void *ctx, const int32_t *ids, size_t n, char *out, size_t cap, size_t *n_out);
    /* Optional faster count of encode's ids without special parsing (NULL: use encode). */
    int (*count)(void *count_ctx, const char *text, size_t len, size_t *n_out);
    void *count_ctx;
};
/* All three functions must be safe to call from several threads at once: the store chunks
 * large batches on worker threads. */

/* Number of tokens in text (no special-token parsing). TOKCOUNT_OK or TOKCOUNT_EFAIL. */
int tokcount_count(const struct TokenCounter *tc, const char *text, size_t len, size_t *n);

/* Encode into a malloc'ed array (*ids, caller frees; may be NULL when *n == 0).
 * TOKCOUNT_OK, TOKCOUNT_EFAIL or TOKCOUNT_ENOMEM. */
int tokcount_encode_alloc(const struct TokenCounter *tc, const char *text, size_t len,
                          unsigned flags, int32_t **ids, size_t *n);

/* The simple counter: text splits into pieces (a whitespace run plus the following
 * non-whitespace run) and each piece into tokens of up to 3 bytes; the bytes are packed into
 * the id, so decoding is exact. About one token per 3 bytes of prose. With TC_SPECIAL the
 * strings <|im_start|>, <|im_end|> and <|endoftext|> are single tokens. Stateless (ctx NULL). */
void tokcount_simple(struct TokenCounter *out);

#endif
