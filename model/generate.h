/* The decode loop: prefill a prompt, then sample token by token until EOS/end-of-turn, a stop
 * string, max_tokens or cancellation, streaming complete UTF-8 text through a callback. */
#ifndef DIFFRAG_GENERATE_H
#define DIFFRAG_GENERATE_H

#include <stddef.h>
#include <stdint.h>

#include "model/engine.h"
#include "model/quote.h"
#include "model/sampler.h"

enum FinishReason { FINISH_STOP = 0, FINISH_LENGTH = 1, FINISH_CANCELLED = 2, FINISH_ERROR = 3 };
const char *finish_reason_name(enum FinishReason r);

struct GenParams {
    int max_tokens;
    struct SamplerParams sampler;
    const char *const *stop;   /* stop strings (not included in the output) */
    size_t n_stop;
    int prefilled;             /* the engine already holds exactly `prompt` (the caller
                                  prefilled it, e.g. to read its logits): skip the prefill */
    const struct QuoteIndex *quote; /* non-NULL: quote decoding over it (model/quote.h): every
                                  token is drawn from the allowed set; borrowed, it must
                                  outlive the generation */
    int lookup;                /* > 0: prompt-lookup decoding (model/lookup.h): each decode
                                  step also verifies up to this many tokens drafted from the
                                  prompt and the answer so far; the output, signals included,
                                  is that of plain decoding. CPU contexts (generate only; a
                                  GPU context decodes plainly). 0: off */
};

/* One generated token (or, with id -1, the release of text held back for a stop string that
 * never completed, delivered once at the end). `text` is the new output text this token releases (complete UTF-8,
 * possibly empty while a multi-byte character or a possible stop string is held back);
 * borrowed for the duration of the callback. */
struct GenToken {
    int32_t id;
    int index;
    const char *text;
    size_t text_len;
    struct TokenSignal sig;
    /* The watched heads' attention masses at the position whose logits gave this token
     * (engine_attn_mass); NULL and 0 when nothing is watched. Borrowed for the callback. */
    const struct AttnMass *mass;
    int n_mass;
    /* The captured residual-stream rows at that position (engine_hidden: n_hidden rows of the
     * model's dim); NULL and 0 when nothing is captured. Borrowed for the callback. */
    const float *hidden;
    int n_hidden;
    /* Quote decoding: the probability mass the constraint removed at this step (model/quote.h);
     * NaN without it. sig stays the model's own distribution's. */
    float quote_removed;
};
/* Return non-zero to stop generation (finish reason: cancelled). */
typedef int (*gen_token_fn)(void *user, const struct GenToken *t);

struct GenResult {
    char *text;                 /* malloc'd, NUL-terminated; caller frees */
    size_t text_len;
    int n_prompt, n_generated;
    int n_drafted, n_accepted;  /* prompt lookup: tokens drafted, and those the model kept */
    enum FinishReason finish;
    double prefill_ms, decode_ms;
    /* Quote decoding: the answer's spans, in order (their tokens make the answer's tokens
     * before the end of the turn) */
    struct QuoteSpan quotes[QUOTE_MAX_SPANS];
    int n_quotes;
};

/* Generation one token at a time, for a scheduler that runs many sequences (and for
 * generate): gen_begin sets up the sampler, the stop strings and the text stream; whenever the
 * engine holds the logits for the next token, gen_next samples it, streams its text through
 * cb and returns 1 with *next the token to decode (the caller appends it and calls again), 0
 * when generation is over (end of turn, a stop string, max_tokens, a full context, or cb asked
 * to stop), or a negative ENGINE_E* code; gen_end releases held-back text and fills the result
 * (text, n_generated, finish; the caller sets n_prompt and the timings) and frees the state;
 * gen_abort frees it without a result. */
struct GenState;
int gen_begin(const struct Model *m, const struct GenParams *p, gen_token_fn cb, void *user,
              struct GenState **out, char *err, size_t errlen);
int gen_next(struct GenState *g, struct Engine *e, int32_t *next, char *err, size_t errlen);
/* Prompt lookup for a caller that drives the engine itself (a scheduler): how many tokens may
 * be drafted after the token about to be decoded (GenParams.lookup, capped by the context, the
 * chunk and the answer's max_tokens); 0 when lookup is off or e is not a CPU context. The
 * caller verifies them with the token (engine_verify or a verify step item), then for each row
 * i in turn calls engine_verify_keep(e, i) and gen_next, going on while gen_next returns the
 * drafted token that follows row i. */
int gen_draft_room(const struct GenState *g, const struct Engine *e);
/* The draft itself, at most k_max tokens into draft, after the token gen_next just returned
 * (hist[0..n): the prompt and the answer through that token): in quote decoding the document
 * tokens that follow the span being quoted (quote_draft), else, or when that span ends there,
 * those that followed the latest earlier occurrence of the answer's last tokens
 * (lookup_draft). */
int gen_draft(const struct GenState *g, const int32_t *hist, int n, int32_t *draft, int k_max);
/* cancelled: finish "cancelled" whatever came before. ENGINE_OK or ENGINE_ENOMEM. */
int gen_end(struct GenState **g, int cancelled, struct GenResult *r);
void gen_abort(struct GenState **g);

/* Prefills `prompt` into the (reset) engine, unless p->prefilled, and decodes. Returns ENGINE_OK with
 * result->finish telling why it ended (cancellation is not an error), or a negative
 * ENGINE_E* code with `err` filled. */
int generate(struct Engine *e, const int32_t *prompt, size_t n_prompt, const struct GenParams *p,
             gen_token_fn cb, void *user, struct GenResult *result, char *err, size_t errlen);

#endif
