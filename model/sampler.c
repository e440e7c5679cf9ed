/* Sampler: filters are applied in the usual order (temperature, top-k, top-p, min-p) over a
 * candidate list sorted by probability, then one draw from a splitmix64 generator. */
#include "model/sampler.h"

#include <math.h>
#include <stdlib.h>

struct Cand { int32_t id; float p; };

struct Sampler {
    struct SamplerParams p;
    int n_vocab;
    uint64_t state;
    struct Cand *cand;
};

void sampler_params_default(struct SamplerParams *p)
{
    p->temperature = 0.f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->seed = 0x5eed;
}

int sampler_new(const struct SamplerParams *p, int n_vocab, struct Sampler **out)
{
    *out = NULL;
    if (n_vocab < 1) return -1;
    struct Sampler *s = calloc(1, sizeof *s);
    if (!s) return -1;
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    if (!s->cand) { free(s); return -1; }
    s->p = *p;
    s->n_vocab = n_vocab;
    s->state = p->seed;
    *out = s;
    return 0;
}

void sampler_destroy(struct Sampler **ps)
{
    if (!*ps) return;
    free((*ps)->cand);
    free(*ps);
    *ps = NULL;
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float clean(float x) { return isnan(x) ? -INFINITY : x; }

void sampler_signal(const float *logits, int n, int32_t token, struct TokenSignal *sig)
{
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) if (clean(logits[i]) > mx) mx = clean(logits[i]);
    double z = 0, ez = 0, p1 = 0, p2 = 0;
    for (int i = 0; i < n; i++) {
        double e = exp((double)clean(logits[i]) - mx);
        z += e;
        if (e > 0) ez += e * ((double)clean(logits[i]) - mx);
        if (e > p1) { p2 = p1; p1 = e; } else if (e > p2) p2 = e;
    }
    double logz = log(z);
    sig->logprob = (float)((double)clean(logits[token]) - mx - logz);
    sig->entropy = (float)(logz - ez / z);
    sig->margin = (float)((p1 - p2) / z);
}

static int cand_cmp(const void *a, const void *b)
{
    float pa = ((const struct Cand *)a)->p, pb = ((const struct Cand *)b)->p;
    return pa < pb ? 1 : pa > pb ? -1 : 0;
}

int32_t sampler_sample(struct Sampler *s, const float *logits, struct TokenSignal *sig)
{
    int n = s->n_vocab;
    int32_t best = 0;
    for (int i = 1; i < n; i++) if (clean(logits[i]) > clean(logits[best])) best = i;
    int32_t chosen = best;
    if (s->p.temperature > 0.f) {
        float mx = clean(logits[best]);
        double z = 0;
        for (int i = 0; i < n; i++) {
            float p = expf((clean(logits[i]) - mx) / s->p.temperature);
            s->cand[i] = (struct Cand){i, p};
            z += p;
        }
        for (int i = 0; i < n; i++) s->cand[i].p = (float)(s->cand[i].p / z);
        int m = n;
        if (s->p.top_k > 0 && s->p.top_k < m) {
            /* Partial selection would be faster; a full sort of 50K floats is ~3 ms and runs
             * once per token only when sampling is on. */
            qsort(s->cand, (size_t)m, sizeof *s->cand, cand_cmp);
            m = s->p.top_k;
        } else {
            qsort(s->cand, (size_t)m, sizeof *s->cand, cand_cmp);
        }
        if (s->p.top_p < 1.f) {
            double acc = 0;
            for (int i = 0; i < m; i++) {
                acc += s->cand[i].p;
                if (acc >= s->p.top_p) { m = i + 1; break; }
            }
        }
        if (s->p.min_p > 0.f) {
            float floor_p = s->p.min_p * s->cand[0].p;
            int k = 1;
            while (k < m && s->cand[k].p >= floor_p) k++;
            m = k;
        }
        double total = 0;
        for (int i = 0; i < m; i++) total += s->cand[i].p;
        double r = (double)(splitmix64(&s->state) >> 11) * 0x1.0p-53 * total, acc = 0;
        chosen = s->cand[m - 1].id;
        for (int i = 0; i < m; i++) {
            acc += s->cand[i].p;
            if (r < acc) { chosen = s->cand[i].id; break; }
        }
    }
    if (sig) sampler_signal(logits, n, chosen, sig);
    return chosen;
}
