/* The token counter (text/tokcount.h) over the model's tokenizer: chunk sizes and prompt
 * budgets are counted in the tokens the model will actually see. */
#ifndef DIFFRAG_TOKCOUNT_MODEL_H
#define DIFFRAG_TOKCOUNT_MODEL_H

#include "model/tokenizer.h"
#include "text/tokcount.h"

/* Adapter over the model tokenizer; `t` is borrowed and must outlive the counter. */
void tokcount_from_tokenizer(const struct Tokenizer *t, struct TokenCounter *out);

/* The same adapter with a word-count cache for counting (chunk sizing): text is split before
 * each space that sits between two non-space characters, which the GPT-2 family pre-tokenizers
 * never merge across, so the count is exact while each distinct word is encoded once. The
 * cache is bounded (about 11 MB) and shared by threads. `t` must outlive it.
 * tokcount_model_new returns TOKCOUNT_OK or TOKCOUNT_ENOMEM. */
struct TokCountModel;
int tokcount_model_new(const struct Tokenizer *t, struct TokCountModel **out);
void tokcount_model_destroy(struct TokCountModel **m);
/* Fill *out with a counter using m (valid while m lives). */
void tokcount_model_counter(struct TokCountModel *m, struct TokenCounter *out);

#endif
