/* The sampler against a plain reference: the whole vocabulary sorted by probability, then
 * top-k, top-p, min-p and the draw, exactly as the filters are defined (model/sampler.h). The
 * sampler sorts only what a filter can keep; over random logits with distinct values, every
 * setting, and 20 draws each, it must choose the very tokens the reference chooses. Also the
 * per-token signals against double precision, greedy ties, NaN and -inf logits. And the GPU's
 * half of the draw: the pass of kernels/cuda/sample.cu as the host emulation of the GPU table
 * makes it (tests/gpu/host_gpu.c), whose candidates sampler_finish must turn into the same
 * tokens. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include "kernels/gpu.h"
#include "model/sampler.h"
#include "tests/check.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53;
}

/* ---- the reference: the filters over the fully sorted vocabulary ---- */

struct RefCand { int32_t id; float p; };

static int ref_cmp(const void *a, const void *b)
{
    const struct RefCand *x = a, *y = b;
    return x->p < y->p ? 1 : x->p > y->p ? -1 : 0;
}

static uint64_t ref_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The same arithmetic as the sampler for each probability (expf of the scaled difference to
 * the maximum, the sum in double over four chains, then p / z rounded to float), so that the
 * two can be compared token for token. ref_filter sorts and cuts once per set of logits (into
 * c, returning the count kept, or 0 for greedy with *best set); ref_draw draws from it. */
static int ref_filter(const struct SamplerParams *sp, const float *logits, int n,
                      struct RefCand *c, int32_t *best)
{
    float mx = -INFINITY;
    *best = 0;
    for (int i = 0; i < n; i++) {
        float x = isnan(logits[i]) ? -INFINITY : logits[i];
        if (x > mx) mx = x, *best = i;
    }
    if (sp->temperature <= 0.f || mx == -INFINITY) return 0;
    float *e = malloc((size_t)n * sizeof *e);
    for (int i = 0; i < n; i++) {
        float x = isnan(logits[i]) ? -INFINITY : logits[i];
        e[i] = expf((x - mx) * (1.f / sp->temperature));
    }
    double a[4] = {0, 0, 0, 0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) a[j] += e[i + j];
    for (; i < n; i++) a[0] += e[i];
    double z = (a[0] + a[1]) + (a[2] + a[3]);
    for (i = 0; i < n; i++) c[i] = (struct RefCand){i, (float)(e[i] / z)};
    free(e);
    qsort(c, (size_t)n, sizeof *c, ref_cmp);
    int m = n;
    if (sp->top_k > 0 && sp->top_k < m) m = sp->top_k;
    if (sp->top_p < 1.f) {
        double acc = 0;
        for (i = 0; i < m; i++) {
            acc += c[i].p;
            if (acc >= sp->top_p) { m = i + 1; break; }
        }
    }
    if (sp->min_p > 0.f) {
        float floor_p = sp->min_p * c[0].p;
        int k = 1;
        while (k < m && c[k].p >= floor_p) k++;
        m = k;
    }
    return m;
}

static int32_t ref_draw(uint64_t *state, const struct RefCand *c, int m, int32_t best)
{
    if (!m) return best;
    double total = 0;
    for (int i = 0; i < m; i++) total += c[i].p;
    double r = (double)(ref_splitmix64(state) >> 11) * 0x1.0p-53 * total, acc = 0;
    for (int i = 0; i < m; i++) {
        acc += c[i].p;
        if (r < acc) return c[i].id;
    }
    return c[m - 1].id;
}

/* Random logits with distinct values (a permutation of a spread of values plus noise), so
 * that the sorted order is unique. */
static void random_logits(float *l, int n, double spread)
{
    for (int i = 0; i < n; i++) l[i] = (float)((i + 0.5 * urand()) * spread / n - spread / 2);
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(urand() * (i + 1));
        float t = l[i];
        l[i] = l[j];
        l[j] = t;
    }
}

/* The settings both comparisons walk: every combination of the values below; over the largest
 * vocabulary a quarter of them, covering every filter path. Fills *sp for combination i at
 * vocabulary n and returns 1, or 0 for one left out. */
#define N_SETTINGS (5 * 5 * 4 * 3)
static int setting(int i, int n, uint64_t seed, struct SamplerParams *sp)
{
    static const float temps[] = {0.f, 0.3f, 0.7f, 1.f, 2.5f};
    static const int top_ks[] = {0, 1, 5, 40, -1};          /* -1: n - 1 */
    static const float top_ps[] = {1.f, 0.95f, 0.5f, 1e-4f};
    static const float min_ps[] = {0.f, 0.05f, 0.5f};
    int ti = i / 60, ki = i / 12 % 5, pi = i / 3 % 4, mi = i % 3;
    if (n > 3000 && (ti + ki + pi + mi) % 4) return 0;
    *sp = (struct SamplerParams){
        .temperature = temps[ti], .top_k = top_ks[ki] < 0 ? n - 1 : top_ks[ki],
        .top_p = top_ps[pi], .min_p = min_ps[mi], .seed = seed,
    };
    return 1;
}

static void test_against_reference(int big)
{
    int sizes[] = {1, 2, 7, 50, 1000, 3000, 49152};
    int n_sizes = big ? 7 : 5;
    int cases = 0, draws = 0, differ = 0;
    for (int si = 0; si < n_sizes; si++) {
        int n = sizes[si];
        float *l = malloc((size_t)n * sizeof *l);
        struct RefCand *c = malloc((size_t)n * sizeof *c);
        for (int i = 0; i < N_SETTINGS; i++) {
            struct SamplerParams sp;
            if (!setting(i, n, 1000 + (uint64_t)cases, &sp)) continue;
            random_logits(l, n, 4 + 20 * urand());
            struct Sampler *s;
            if (sampler_new(&sp, n, &s)) {
                CHECK(0, "sampler_new %d", n);
                continue;
            }
            uint64_t state = sp.seed;
            int32_t best;
            int m = ref_filter(&sp, l, n, c, &best);
            for (int d = 0; d < 20; d++) {
                int32_t got = sampler_sample(s, l, NULL);
                int32_t want = ref_draw(&state, c, m, best);
                if (got != want && differ++ < 5)
                    fprintf(stderr, "n %d T %g k %d p %g min_p %g draw %d: %d, "
                            "reference %d\n", n, sp.temperature, sp.top_k, sp.top_p,
                            sp.min_p, d, got, want);
                draws++;
            }
            sampler_destroy(&s);
            cases++;
        }
        free(l);
        free(c);
    }
    printf("%d settings, %d draws against the fully sorted reference: %d differ\n", cases, draws,
           differ);
    CHECK(differ == 0, "%d settings, %d draws: %d differ from the fully sorted reference", cases,
          draws, differ);
}

static void test_signals(void)
{
    int n = 5000;
    float *l = malloc((size_t)n * sizeof *l);
    random_logits(l, n, 30);
    l[17] = -INFINITY;
    l[99] = NAN;
    struct TokenSignal sig;
    int32_t tok = 1234;
    sampler_signal(l, n, tok, &sig);
    double mx = -INFINITY, z = 0, ez = 0, p[2] = {0, 0};
    for (int i = 0; i < n; i++)
        if (!isnan(l[i]) && l[i] > mx) mx = l[i];
    for (int i = 0; i < n; i++) {
        if (isnan(l[i]) || l[i] == -INFINITY) continue;
        double e = exp((double)l[i] - mx);
        z += e;
        ez += e * ((double)l[i] - mx);
        if (e > p[0]) p[1] = p[0], p[0] = e;
        else if (e > p[1]) p[1] = e;
    }
    double lp = l[tok] - mx - log(z), ent = log(z) - ez / z, mg = (p[0] - p[1]) / z;
    CHECK(fabs(sig.logprob - lp) < 1e-5 && fabs(sig.entropy - ent) < 1e-5 * fmax(1, ent) &&
          fabs(sig.margin - mg) < 1e-6, "signals %g %g %g against %g %g %g", sig.logprob,
          sig.entropy, sig.margin, lp, ent, mg);
    /* a shared maximum: greedy takes the first, the margin is 0 */
    float t[6] = {0.5f, 2.f, NAN, 2.f, -INFINITY, 1.f};
    struct SamplerParams sp;
    sampler_params_default(&sp);
    struct Sampler *s;
    sampler_new(&sp, 6, &s);
    CHECK(sampler_sample(s, t, &sig) == 1 && sig.margin == 0.f, "ties: first index, margin 0");
    sampler_destroy(&s);
    /* no finite logit at all: token 0, finite signals */
    float u[4] = {NAN, -INFINITY, NAN, -INFINITY};
    sp.temperature = 0.8f;
    sampler_new(&sp, 4, &s);
    CHECK(sampler_sample(s, u, &sig) == 0 && isfinite(sig.logprob) && isfinite(sig.entropy) &&
          isfinite(sig.margin), "no finite logit: token 0, signals %g %g %g", sig.logprob,
          sig.entropy, sig.margin);
    sampler_destroy(&s);
    /* NaN and -inf never drawn */
    float w[5] = {NAN, 1.f, -INFINITY, 1.5f, NAN};
    sp.top_k = 0;
    sp.top_p = 1.f;
    sp.min_p = 0.f;
    sp.temperature = 5.f;
    sampler_new(&sp, 5, &s);
    int bad = 0;
    for (int i = 0; i < 200; i++) {
        int32_t k = sampler_sample(s, w, NULL);
        bad += k != 1 && k != 3;
    }
    CHECK(!bad, "only finite logits are drawn (%d bad of 200)", bad);
    sampler_destroy(&s);
    free(l);
}

/* ---- the device's pass, from the host emulation of the GPU table ----
 * tests/gpu/host_gpu.c, beside this program as libdiffrag_hostgpu.so, carries out
 * kernels/cuda/sample.cu's steps on the host: its sums in the kernel's order (another order than
 * the host sampler's four chains), the radix select through gpu_radix_digit, the candidates in
 * id order. Its device memory is host memory. */
static const struct GpuApi *dev_api;
static struct GpuCtx *dev_ctx;

static int open_device(void)
{
    char exe[4096], path[4200], err[512];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char *slash = len > 0 ? (exe[len] = 0, strrchr(exe, '/')) : NULL;
    if (!slash) return -1;
    *slash = 0;
    snprintf(path, sizeof path, "%s/libdiffrag_hostgpu.so", exe);
    setenv("DIFFRAG_CUDA_LIB", path, 1);
    dev_api = gpu_api_load(err, sizeof err);
    if (!dev_api || dev_api->ctx_new(0, &dev_ctx, err, sizeof err)) {
        fprintf(stderr, "the host emulation of the GPU table (%s): %s\n", path, err);
        return -1;
    }
    return 0;
}

static void emulate_pass(const float *l, int n, const struct SampleKeep *k, float *w,
                         struct SampleCand *cand, struct SamplePass *p)
{
    struct GpuSampleHead *h = malloc(sizeof *h + (size_t)n * sizeof(struct GpuCand));
    struct GpuSampleArgs a = {
        .logits = l, .n = n, .mode = (int)k->mode, .inv_temp = k->inv_temp, .floor = k->floor,
        .mass = k->mass, .k = k->k, .work = w, .head = h,
    };
    char err[512];
    dev_api->sample(dev_ctx, &a);
    if (dev_api->sync(dev_ctx, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
    memcpy(cand, h + 1, (size_t)h->n_cand * sizeof *cand);
    *p = (struct SamplePass){.best = h->best, .mx = h->mx, .second = h->second, .z1 = h->z1,
                             .ez1 = h->ez1, .zt = h->zt, .cand = cand, .n_cand = h->n_cand};
    free(h);
}

static int id_cmp(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Whether two candidate lists hold the same ids. */
static int same_ids(const struct SampleCand *a, int na, const struct SampleCand *b, int nb)
{
    if (na != nb) return 0;
    int32_t *x = malloc(((size_t)na + 1) * 2 * sizeof *x), *y = x + na + 1;
    for (int i = 0; i < na; i++) x[i] = a[i].id, y[i] = b[i].id;
    qsort(x, (size_t)na, sizeof *x, id_cmp);
    qsort(y, (size_t)na, sizeof *y, id_cmp);
    int same = !memcmp(x, y, (size_t)na * sizeof *x);
    free(x);
    return same;
}

static void test_device_pass(int big)
{
    if (open_device()) {
        CHECK(0, "the host emulation of the GPU table did not load (run make)");
        return;
    }
    int sizes[] = {1, 2, 7, 50, 1000, 3000, 49152};
    int n_sizes = big ? 7 : 6;
    int cases = 0, draws = 0, differ = 0, sig_bad = 0, count_bad = 0, set_bad = 0;
    for (int si = 0; si < n_sizes; si++) {
        int n = sizes[si];
        float *l = malloc((size_t)n * sizeof *l), *w = malloc((size_t)n * sizeof *w);
        struct SampleCand *cand = malloc((size_t)n * sizeof *cand);
        for (int i = 0; i < N_SETTINGS; i++) {
            struct SamplerParams sp;
            if (!setting(i, n, 7000 + (uint64_t)cases, &sp)) continue;
            random_logits(l, n, 4 + 20 * urand());
            if (n > 7) l[n / 3] = NAN, l[n / 2] = -INFINITY;
            struct Sampler *host, *dev, *aux;
            if (sampler_new(&sp, n, &host) || sampler_new(&sp, n, &dev) ||
                sampler_new(&sp, n, &aux)) {
                CHECK(0, "sampler_new %d", n);
                continue;
            }
            struct SampleKeep k;
            sampler_keep(dev, &k);
            /* top-k and min-p: the very candidates the host's pass keeps */
            if (k.mode == SAMPLE_TOP_K || k.mode == SAMPLE_FLOOR) {
                struct SamplePass p, hp;
                emulate_pass(l, n, &k, w, cand, &p);
                sampler_pass(aux, l, 1, &hp);
                set_bad += !same_ids(p.cand, p.n_cand, hp.cand, hp.n_cand);
            }
            for (int d = 0; d < 5; d++) {
                struct TokenSignal sh, sd;
                struct SamplePass p;
                int32_t want = sampler_sample(host, l, &sh);
                emulate_pass(l, n, &k, w, cand, &p);
                if (k.mode == SAMPLE_TOP_K) count_bad += p.n_cand != k.k;
                int32_t got = sampler_finish(dev, &p, &sd);
                if (got != want && differ++ < 5)
                    fprintf(stderr, "device pass: n %d T %g k %d p %g min_p %g draw %d:"
                            " %d, host %d\n", n, sp.temperature, sp.top_k, sp.top_p,
                            sp.min_p, d, got, want);
                sig_bad += fabsf(sd.logprob - sh.logprob) > 1e-5f ||
                           fabsf(sd.entropy - sh.entropy) > 1e-5f ||
                           fabsf(sd.margin - sh.margin) > 1e-6f;
                draws++;
            }
            sampler_destroy(&host);
            sampler_destroy(&dev);
            sampler_destroy(&aux);
            cases++;
        }
        free(l);
        free(w);
        free(cand);
    }
    printf("%d settings, %d draws from the replayed device pass: %d differ from the host's\n",
           cases, draws, differ);
    CHECK(differ == 0 && sig_bad == 0 && count_bad == 0 && set_bad == 0, "device pass: %d of %d "
          "draws differ, %d signals off, %d top-k counts off, %d candidate sets differ from the "
          "host pass's", differ, draws, sig_bad, count_bad, set_bad);

    /* ties at the top-k boundary: the lower ids, as the host's heap keeps them */
    int n = 1000;
    float *l = malloc((size_t)n * sizeof *l), *w = malloc((size_t)n * sizeof *w);
    struct SampleCand *cand = malloc((size_t)n * sizeof *cand);
    for (int i = 0; i < n; i++) l[i] = i % 7 == 3 ? 2.f : (float)(i % 11) * 0.1f;
    l[500] = 3.f;
    struct SamplerParams sp = {.temperature = 1.f, .top_k = 40, .top_p = 1.f, .min_p = 0.f};
    struct Sampler *s;
    sampler_new(&sp, n, &s);
    struct SampleKeep k;
    sampler_keep(s, &k);
    struct SamplePass p;
    emulate_pass(l, n, &k, w, cand, &p);
    /* the largest, then (in id order) the 39 lowest ids of the tied weights */
    int ok = p.n_cand == 40 && cand[0].id == 500;
    for (int i = 1; i < 40 && ok; i++) ok = cand[i].id == 3 + 7 * (i - 1);
    CHECK(ok, "top-k ties: %d candidates, first %d, second %d, last %d", p.n_cand, cand[0].id,
          cand[1].id, cand[39].id);
    /* the largest always stays, even with min_p above 1 */
    sp = (struct SamplerParams){.temperature = 1.f, .top_k = 0, .top_p = 1.f, .min_p = 3.f};
    struct Sampler *s2;
    sampler_new(&sp, n, &s2);
    sampler_keep(s2, &k);
    emulate_pass(l, n, &k, w, cand, &p);
    CHECK(p.n_cand == 1 && cand[0].id == 500 && sampler_finish(s2, &p, NULL) == 500 &&
          sampler_sample(s2, l, NULL) == 500, "min_p 3: the largest alone (%d candidates)",
          p.n_cand);
    sampler_destroy(&s);
    sampler_destroy(&s2);
    free(l);
    free(w);
    free(cand);
}

int main(void)
{
    test_against_reference(!check_small_scale());
    test_signals();
    test_device_pass(!check_small_scale());
    return check_report("test_sampler");
}
