/* Sampler: filters are applied in the usual order (temperature, top-k, top-p, min-p) over a
 * candidate list sorted by probability, then one draw from a splitmix64 generator. Only the
 * candidates a filter can keep are sorted: the top k from a bounded heap, or with top-k off
 * those min-p can keep; a full sort of the vocabulary (about 17 ms for 49,152 entries) is left
 * for the one setting that needs it (top-k and min-p both off, temperature on). */
#include "model/sampler.h"

#include <math.h>
#include <stdlib.h>

struct Cand { int32_t id; float p; };

struct Sampler {
    struct SamplerParams p;
    int n_vocab;
    uint64_t state;
    struct Cand *cand;
    float *prob;              /* (n_vocab) unnormalised probabilities */
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
    s->prob = malloc((size_t)n_vocab * sizeof *s->prob);
    if (!s->cand || !s->prob) { free(s->cand); free(s->prob); free(s); return -1; }
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
    free((*ps)->prob);
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

/* The first index of the largest logit, NaN read as -inf (0 when none is above -inf): the
 * maximum (a NaN never compares greater), then its index, in two plain passes. */
static int32_t argmax(const float *logits, int n, float *mx_out)
{
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = logits[i] > mx ? logits[i] : mx;
    *mx_out = mx;
    if (mx == -INFINITY) return 0;
    for (int i = 0; i < n; i++)
        if (logits[i] == mx) return i;
    return 0;
}

/* e[i] = exp((logits[i] - mx) * scale), 0 for -inf and NaN logits (glibc's expf: about 3 ns
 * an entry here, half of exp in double). */
static void exps(const float *logits, int n, float mx, float scale, float *e)
{
    for (int i = 0; i < n; i++) e[i] = expf((clean(logits[i]) - mx) * scale);
}

/* Sum in double, four chains (the order is fixed, so results repeat exactly). */
static double sum_d(const float *v, int n)
{
    double a[4] = {0, 0, 0, 0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) a[j] += v[i + j];
    for (; i < n; i++) a[0] += v[i];
    return (a[0] + a[1]) + (a[2] + a[3]);
}

/* The signals given the largest logit mx and its first index best (argmax). */
static void signal_at(const float *logits, int n, int32_t token, int32_t best, float mx,
                      struct TokenSignal *sig)
{
    if (mx == -INFINITY) {
        /* no finite logit: call it uniform (exp(-inf - -inf) cannot say) */
        sig->logprob = (float)-log((double)n);
        sig->entropy = (float)log((double)n);
        sig->margin = 0.f;
        return;
    }
    /* one pass: the normaliser, the entropy's sum, and the second largest logit (the same
     * value again when the maximum is shared) for p(top-1) - p(top-2), p(top-1) being e^0 */
    double z0 = 0, z1 = 0, ez0 = 0, ez1 = 0;
    float second = -INFINITY;
    for (int i = 0; i < n; i++) {
        float x = clean(logits[i]) - mx, e = expf(x);
        if (i != best) second = logits[i] > second ? logits[i] : second;
        if (i & 1) {
            z1 += e;
            ez1 += e > 0.f ? (double)e * x : 0.0;
        } else {
            z0 += e;
            ez0 += e > 0.f ? (double)e * x : 0.0;
        }
    }
    double z = z0 + z1, ez = ez0 + ez1, logz = log(z);
    double p2 = second == -INFINITY ? 0 : exp((double)second - mx);
    sig->logprob = (float)((double)clean(logits[token]) - mx - logz);
    sig->entropy = (float)(logz - ez / z);
    sig->margin = (float)((1.0 - p2) / z);
}

void sampler_signal(const float *logits, int n, int32_t token, struct TokenSignal *sig)
{
    float mx;
    int32_t best = argmax(logits, n, &mx);
    signal_at(logits, n, token, best, mx, sig);
}

static int cand_cmp(const void *a, const void *b)
{
    float pa = ((const struct Cand *)a)->p, pb = ((const struct Cand *)b)->p;
    return pa < pb ? 1 : pa > pb ? -1 : 0;
}

/* Candidate order for the bounded heap: larger p first, then lower id. */
static int cand_before(struct Cand a, struct Cand b)
{
    return a.p > b.p || (a.p == b.p && a.id < b.id);
}

/* The k candidates of e (n values) that come first in cand_before order, into out[0..k) in
 * no particular order: a heap whose root is the worst kept, O(n log k). */
static void top_k_heap(const float *e, int n, int k, struct Cand *out)
{
    int m = 0;
    for (int i = 0; i < n; i++) {
        struct Cand c = {i, e[i]};
        if (m < k) {
            int j = m++;
            while (j > 0 && cand_before(out[(j - 1) / 2], c)) {
                out[j] = out[(j - 1) / 2];
                j = (j - 1) / 2;
            }
            out[j] = c;
        } else if (cand_before(c, out[0])) {
            int j = 0;
            for (;;) {
                int l = 2 * j + 1, r = l + 1, w = j;
                struct Cand wc = c;
                if (l < k && cand_before(wc, out[l])) w = l, wc = out[l];
                if (r < k && cand_before(wc, out[r])) w = r;
                if (w == j) break;
                out[j] = out[w];
                j = w;
            }
            out[j] = c;
        }
    }
}

int32_t sampler_sample(struct Sampler *s, const float *logits, struct TokenSignal *sig)
{
    int n = s->n_vocab;
    float mx;
    int32_t best = argmax(logits, n, &mx);
    int32_t chosen = best;
    if (s->p.temperature > 0.f && mx > -INFINITY) {
        /* unnormalised probabilities; only the candidates kept are normalised */
        float *e = s->prob;
        exps(logits, n, mx, 1.f / s->p.temperature, e);
        double z = sum_d(e, n);
        int m;
        if (s->p.top_k > 0 && s->p.top_k < n) {
            m = s->p.top_k;
            top_k_heap(e, n, m, s->cand);
        } else if (s->p.min_p > 0.f) {
            /* nothing under min_p of the largest survives min-p, whatever top-p keeps: sort
             * only the rest (a margin of 1% keeps the boundary to the exact test below) */
            float floor_e = 0.99f * s->p.min_p * e[best];
            m = 0;
            for (int i = 0; i < n; i++)
                if (e[i] >= floor_e) s->cand[m++] = (struct Cand){i, e[i]};
        } else {
            m = n;
            for (int i = 0; i < n; i++) s->cand[i] = (struct Cand){i, e[i]};
        }
        for (int i = 0; i < m; i++) s->cand[i].p = (float)(s->cand[i].p / z);
        qsort(s->cand, (size_t)m, sizeof *s->cand, cand_cmp);
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
    if (sig) signal_at(logits, n, chosen, best, mx, sig);
    return chosen;
}
