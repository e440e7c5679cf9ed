/* Token sampling: greedy, temperature, top-k, top-p, min-p with a seeded generator, and the
 * per-token signals of the model's own distribution (at temperature 1, whatever the sampling
 * temperature): log-probability of the chosen token, entropy, top-1/top-2 margin. */
#ifndef DIFFRAG_SAMPLER_H
#define DIFFRAG_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

struct SamplerParams {
    float temperature;   /* <= 0: greedy */
    int top_k;           /* <= 0: off */
    float top_p;         /* >= 1: off */
    float min_p;         /* <= 0: off */
    uint64_t seed;
};
void sampler_params_default(struct SamplerParams *p);

struct TokenSignal {
    float logprob;       /* log p(chosen) under softmax(logits) */
    float entropy;       /* nats, of softmax(logits) */
    float margin;        /* p(top-1) - p(top-2) */
};

struct Sampler;
int sampler_new(const struct SamplerParams *p, int n_vocab, struct Sampler **out);
void sampler_destroy(struct Sampler **s);
/* Draws a token from logits (n_vocab); fills *sig when non-NULL. Never fails for finite
 * logits; NaN logits are treated as -inf. */
int32_t sampler_sample(struct Sampler *s, const float *logits, struct TokenSignal *sig);
/* The signals of a given token (e.g. for scoring a fixed continuation). */
void sampler_signal(const float *logits, int n_vocab, int32_t token, struct TokenSignal *sig);

/* ---- The draw in two halves, for a pass over the vocabulary made elsewhere (a GPU) ----
 * sampler_sample is a pass over the logits that gathers a few summaries and the candidates
 * a draw can choose, then the draw over those candidates alone. sampler_keep says which
 * candidates the current settings need; whoever makes the pass fills a struct SamplePass;
 * sampler_finish draws from it exactly as sampler_sample would from the same figures. */
enum SampleKeepMode {
    SAMPLE_GREEDY = 0,   /* no candidates: the largest logit */
    SAMPLE_TOP_K = 1,    /* the k largest w (ties: the lower ids) */
    SAMPLE_FLOOR = 2,    /* every id with w >= floor (floor 0: all) */
    SAMPLE_MASS = 3,     /* the fewest largest w whose sum reaches mass * sum(w), and every w
                            equal to the smallest of those */
};
struct SampleKeep {
    enum SampleKeepMode mode;
    float inv_temp;      /* w_i = exp((x_i - max) * inv_temp): the largest is exactly 1 */
    int k;
    float floor;
    float mass;          /* top_p with a margin of 1e-4 (relative): a sum in another order
                            never leaves the exact top-p cut outside the candidates */
};
void sampler_keep(const struct Sampler *s, struct SampleKeep *k);

struct SampleCand {
    int32_t id;
    float w;             /* w_id on entry; sampler_finish normalises it in place */
    float logit;         /* the logit, NaN read as -inf */
};
struct SamplePass {
    int32_t best;        /* the first index of the largest logit (NaN read as -inf); 0 when no
                            logit is finite */
    float mx;            /* that logit (-inf: none finite) */
    float second;        /* the largest logit at any other index (-inf: none) */
    double z1, ez1;      /* sum of exp(x - mx) and of exp(x - mx) (x - mx), at temperature 1:
                            the signals' normaliser and entropy sum */
    double zt;           /* sum of w over the whole vocabulary */
    struct SampleCand *cand; /* what sampler_keep asked for, in any order (sorted in place) */
    int n_cand;
};
/* The pass on the host, as sampler_sample makes it (the signals' sums only with
 * with_signals): *p borrows the sampler's candidate array, valid until its next call. */
void sampler_pass(struct Sampler *s, const float *logits, int with_signals, struct SamplePass *p);
/* The draw from a pass: the token, and *sig when non-NULL (then z1, ez1 and second must be
 * filled). Never fails; with no candidate (or mx = -inf) it returns best. */
int32_t sampler_finish(struct Sampler *s, struct SamplePass *p, struct TokenSignal *sig);

#endif
