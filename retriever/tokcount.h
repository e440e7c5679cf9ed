/* The token-counting interface the retriever uses to size chunks and assemble prompts, so the
 * store, chunker and index never depend on the model's tokenizer directly. Two providers: the
 * model tokenizer (tokcount_model.c) and a simple, exactly reversible byte-packing counter
 * for tests and for ingesting without a model. */
#ifndef DIFFRAG_TOKCOUNT_H
#define DIFFRAG_TOKCOUNT_H

#include <stddef.h>
#include <stdint.h>

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

/* Number of tokens in text (no special-token parsing). RET_OK or RET_ETOKEN. */
int tokcount_count(const struct TokenCounter *tc, const char *text, size_t len, size_t *n);

/* Encode into a malloc'ed array (*ids, caller frees; may be NULL when *n == 0).
 * RET_OK, RET_ETOKEN or RET_ENOMEM. */
int tokcount_encode_alloc(const struct TokenCounter *tc, const char *text, size_t len,
                          unsigned flags, int32_t **ids, size_t *n);

/* The simple counter: text splits into pieces (a whitespace run plus the following
 * non-whitespace run) and each piece into tokens of up to 3 bytes; the bytes are packed into
 * the id, so decoding is exact. About one token per 3 bytes of prose. With TC_SPECIAL the
 * strings <|im_start|>, <|im_end|> and <|endoftext|> are single tokens. Stateless (ctx NULL). */
void tokcount_simple(struct TokenCounter *out);

struct Tokenizer;
/* Adapter over the model tokenizer (model/tokenizer.h); `t` is borrowed and must outlive the
 * counter. Defined in tokcount_model.c so unit tests can link without the model library. */
void tokcount_from_tokenizer(const struct Tokenizer *t, struct TokenCounter *out);

/* The same adapter with a word-count cache for counting (chunk sizing): text is split before
 * each space that sits between two non-space characters, which the GPT-2 family pre-tokenizers
 * never merge across, so the count is exact while each distinct word is encoded once. The
 * cache is bounded (about 11 MB) and shared by threads. `t` must outlive it.
 * tokcount_model_new returns RET_OK or RET_ENOMEM. */
struct TokCountModel;
int tokcount_model_new(const struct Tokenizer *t, struct TokCountModel **out);
void tokcount_model_destroy(struct TokCountModel **m);
/* Fill *out with a counter using m (valid while m lives). */
void tokcount_model_counter(struct TokCountModel *m, struct TokenCounter *out);

#endif
