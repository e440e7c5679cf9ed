/* Sampler: filters are applied in the usual order (temperature, top-k, top-p, min-p) over a
 * candidate list sorted by probability, then one draw from a splitmix64 generator. Only the
 * candidates a filter can keep are sorted: the top k from a bounded heap, or with top-k off
 * those min-p can keep; a full sort of the vocabulary (about 17 ms for 49,152 entries) is left
 * for the one setting that needs it (top-k and min-p both off, temperature on). The pass over
 * the vocabulary (sampler_sample) and the draw over the candidates (sampler_finish) are
 * separate, so that a GPU context makes the pass on the device and only the candidates
 * travel (model/engine_gpu.c). */
#include "model/sampler.h"

#include <math.h>
#include <stdlib.h>

struct Sampler {
    struct SamplerParams p;
    int n_vocab;
    uint64_t state;
    struct SampleCand *cand;
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

/* The signals' sums over the logits given the largest mx at index best: the normaliser, the
 * entropy's sum and the second largest logit (the same value again when the maximum is
 * shared), in one pass. */
static void signal_sums(const float *logits, int n, struct SamplePass *p)
{
    double z0 = 0, z1 = 0, ez0 = 0, ez1 = 0;
    float second = -INFINITY, mx = p->mx;
    for (int i = 0; i < n; i++) {
        float x = clean(logits[i]) - mx, e = expf(x);
        if (i != p->best) second = logits[i] > second ? logits[i] : second;
        if (i & 1) {
            z1 += e;
            ez1 += e > 0.f ? (double)e * x : 0.0;
        } else {
            z0 += e;
            ez0 += e > 0.f ? (double)e * x : 0.0;
        }
    }
    p->z1 = z0 + z1;
    p->ez1 = ez0 + ez1;
    p->second = second;
}

/* The signals of the token whose logit is `logit`, from a pass's sums; p(top-1) is e^0. */
static void signal_from(const struct SamplePass *p, float logit, int n, struct TokenSignal *sig)
{
    if (p->mx == -INFINITY) {
        /* no finite logit: call it uniform (exp(-inf - -inf) cannot say) */
        sig->logprob = (float)-log((double)n);
        sig->entropy = (float)log((double)n);
        sig->margin = 0.f;
        return;
    }
    double logz = log(p->z1);
    double p2 = p->second == -INFINITY ? 0 : exp((double)p->second - p->mx);
    sig->logprob = (float)((double)logit - p->mx - logz);
    sig->entropy = (float)(logz - p->ez1 / p->z1);
    sig->margin = (float)((1.0 - p2) / p->z1);
}

void sampler_signal(const float *logits, int n, int32_t token, struct TokenSignal *sig)
{
    struct SamplePass p = {0};
    p.best = argmax(logits, n, &p.mx);
    if (p.mx > -INFINITY) signal_sums(logits, n, &p);
    signal_from(&p, clean(logits[token]), n, sig);
}

static int cand_cmp(const void *a, const void *b)
{
    float pa = ((const struct SampleCand *)a)->w, pb = ((const struct SampleCand *)b)->w;
    return pa < pb ? 1 : pa > pb ? -1 : 0;
}

/* Candidate order for the bounded heap: larger w first, then lower id. */
static int cand_before(struct SampleCand a, struct SampleCand b)
{
    return a.w > b.w || (a.w == b.w && a.id < b.id);
}

/* The k candidates of e (n values) that come first in cand_before order, into out[0..k) in
 * no particular order: a heap whose root is the worst kept, O(n log k). */
static void top_k_heap(const float *e, int n, int k, struct SampleCand *out)
{
    int m = 0;
    for (int i = 0; i < n; i++) {
        struct SampleCand c = {i, e[i], 0.f};
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
                struct SampleCand wc = c;
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

void sampler_keep(const struct Sampler *s, struct SampleKeep *k)
{
    const struct SamplerParams *p = &s->p;
    *k = (struct SampleKeep){.mode = SAMPLE_GREEDY};
    if (!(p->temperature > 0.f)) return;
    k->inv_temp = 1.f / p->temperature;
    if (p->top_k > 0 && p->top_k < s->n_vocab) {
        k->mode = SAMPLE_TOP_K;
        k->k = p->top_k;
    } else if (p->min_p > 0.f) {
        /* nothing under min_p of the largest (w = 1) survives min-p, whatever top-p keeps:
         * only the rest is sorted (a margin of 1% keeps the boundary to the exact test in
         * sampler_finish; the largest itself always stays) */
        k->mode = SAMPLE_FLOOR;
        k->floor = fminf(0.99f * p->min_p, 1.f);
    } else if (p->top_p < 1.f) {
        k->mode = SAMPLE_MASS;
        k->mass = fminf(p->top_p * 1.0001f, 1.f);
    } else {
        k->mode = SAMPLE_FLOOR;
        k->floor = 0.f;
    }
}

int32_t sampler_finish(struct Sampler *s, struct SamplePass *p, struct TokenSignal *sig)
{
    int32_t chosen = p->best;
    float chosen_logit = p->mx;
    if (s->p.temperature > 0.f && p->mx > -INFINITY && p->n_cand > 0) {
        struct SampleCand *c = p->cand;
        int m = p->n_cand;
        for (int i = 0; i < m; i++) c[i].w = (float)(c[i].w / p->zt);
        qsort(c, (size_t)m, sizeof *c, cand_cmp);
        if (s->p.top_p < 1.f) {
            double acc = 0;
            for (int i = 0; i < m; i++) {
                acc += c[i].w;
                if (acc >= s->p.top_p) { m = i + 1; break; }
            }
        }
        if (s->p.min_p > 0.f) {
            float floor_p = s->p.min_p * c[0].w;
            int k = 1;
            while (k < m && c[k].w >= floor_p) k++;
            m = k;
        }
        double total = 0;
        for (int i = 0; i < m; i++) total += c[i].w;
        double r = (double)(splitmix64(&s->state) >> 11) * 0x1.0p-53 * total, acc = 0;
        int j = m - 1;
        for (int i = 0; i < m; i++) {
            acc += c[i].w;
            if (r < acc) { j = i; break; }
        }
        chosen = c[j].id;
        chosen_logit = c[j].logit;
    }
    if (sig) signal_from(p, chosen_logit, s->n_vocab, sig);
    return chosen;
}

void sampler_pass(struct Sampler *s, const float *logits, int with_signals, struct SamplePass *out)
{
    int n = s->n_vocab;
    struct SamplePass p = {.cand = s->cand};
    p.best = argmax(logits, n, &p.mx);
    if (with_signals && p.mx > -INFINITY) signal_sums(logits, n, &p);
    struct SampleKeep k;
    sampler_keep(s, &k);
    if (k.mode != SAMPLE_GREEDY && p.mx > -INFINITY) {
        /* unnormalised probabilities; only the candidates kept are normalised */
        float *e = s->prob;
        exps(logits, n, p.mx, k.inv_temp, e);
        p.zt = sum_d(e, n);
        int m = 0;
        if (k.mode == SAMPLE_TOP_K) {
            m = k.k;
            top_k_heap(e, n, m, s->cand);
        } else if (k.mode == SAMPLE_FLOOR) {
            for (int i = 0; i < n; i++)
                if (e[i] >= k.floor) s->cand[m++] = (struct SampleCand){i, e[i], 0.f};
        } else {
            /* SAMPLE_MASS: the exact cut needs the sorted order; here everything is sorted */
            for (int i = 0; i < n; i++) s->cand[m++] = (struct SampleCand){i, e[i], 0.f};
        }
        for (int i = 0; i < m; i++) s->cand[i].logit = clean(logits[s->cand[i].id]);
        p.n_cand = m;
    }
    *out = p;
}

int32_t sampler_sample(struct Sampler *s, const float *logits, struct TokenSignal *sig)
{
    struct SamplePass p;
    sampler_pass(s, logits, sig != NULL, &p);
    return sampler_finish(s, &p, sig);
}
