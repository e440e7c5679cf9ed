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

#endif
