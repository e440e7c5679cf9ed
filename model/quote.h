/* Quote decoding: answers made only of verbatim spans of the prompt's documents.
 *
 * A quote index is a suffix automaton over the token sequences of a prompt's document spans
 * (each placed chunk's text), laid end to end with a separator between spans that no answer
 * token can match, so every path from its root spells a run of tokens inside one span. A
 * cursor walks it as the answer is generated: at each step the allowed tokens are those that
 * continue the current span, the tokens that start a new span (once the current one has
 * QUOTE_MIN_SPAN tokens and fewer than QUOTE_MAX_SPANS were used) and the end of the turn
 * (once the answer has a token); while the answer's last character is incomplete (a token
 * that holds part of a multi-byte character) only the current span may go on. At the answer's
 * first step a document token that begins
 * with a space may also be taken without it (the spelling a reply's first word has), which
 * quotes the same bytes less the space.
 *
 * quote_mask writes the logits with every other token at -inf and returns the probability
 * mass (softmax at temperature 1 of the model's own logits) that the constraint removed:
 * what the model would have said outside the documents. */
#ifndef DIFFRAG_QUOTE_H
#define DIFFRAG_QUOTE_H

#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer.h"

#define QUOTE_MAX_SPANS 4      /* spans one answer may join */
#define QUOTE_MIN_SPAN 1       /* tokens a span has before another may start */

struct QuoteIndex;

/* One quoted span, in the coordinates of the prompt's document spans: span `span` (an index
 * into the spans given to quote_index_new), tokens [tok_start, tok_end) of it (offsets from
 * the span's first token). skip_space: the first token was taken without its leading space
 * (the quoted bytes begin one byte into the token's piece). */
struct QuoteSpan {
    uint32_t span;
    uint32_t tok_start, tok_end;
    int skip_space;
};

/* The answer's walk through the index. Zero it (or quote_cursor_init) before the first step. */
struct QuoteCursor {
    int32_t state;          /* automaton state after the current span's tokens (0: none yet) */
    int32_t len;            /* tokens in the current span */
    int32_t n_tokens;       /* answer tokens so far (the end of the turn not counted) */
    int skip_space;         /* the current span's first token was its spaceless alias */
    int pending;            /* continuation bytes the answer's last character still needs: a
                               span ends, and the answer with it, only between characters */
    struct QuoteSpan spans[QUOTE_MAX_SPANS];
    int n_spans;            /* spans closed or open; the last is open while len > 0 */
};
void quote_cursor_init(struct QuoteCursor *c);

/* Builds the index over tokens[spans[2i] .. spans[2i+1]) for each of n_spans spans (bounds
 * checked against n_tokens). tok gives the end-of-turn tokens and the spaceless aliases; it
 * must outlive the index. 0, or -1 with err (out of memory, a span out of range). An index
 * with no document token is valid: every answer then ends at once. */
int quote_index_new(const int32_t *tokens, size_t n_tokens, const uint32_t *spans,
                    size_t n_spans, const struct Tokenizer *tok, struct QuoteIndex **out,
                    char *err, size_t errlen);
void quote_index_destroy(struct QuoteIndex **q);

/* masked[0..n_vocab): logits[i] where token i is allowed after the cursor, -inf elsewhere.
 * Returns the removed probability mass in [0, 1] (NaN logits count as -inf). At least one
 * token is always allowed (the end of the turn when nothing else is). */
float quote_mask(const struct QuoteIndex *q, const struct QuoteCursor *c, const float *logits,
                 int n_vocab, float *masked);

/* Moves the cursor past `token` (chosen from quote_mask's allowed set; an end-of-turn token
 * leaves it as it is). 0, or -1 when the token was not allowed (the cursor is unchanged). */
int quote_advance(const struct QuoteIndex *q, struct QuoteCursor *c, int32_t token);

/* Drafts for prompt lookup (model/lookup.h) in quote decoding: the document tokens that follow
 * the cursor's current span where quote_advance placed it (its first occurrence), up to the end
 * of that document span and at most k_max. 0 when no span is open or it ends there. */
int quote_draft(const struct QuoteIndex *q, const struct QuoteCursor *c, int32_t *draft,
                int k_max);

/* Is the token an end of the turn for this index (tok_is_end or a control token)? */
int quote_is_end(const struct QuoteIndex *q, int32_t token);

#endif
