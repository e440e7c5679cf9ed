/* Attention probability mass per position class for one query token: the groundedness
 * signals (docs/groundedness.md). One task per listed query head: the head's scores against
 * every cached key, tile by tile (each K tile converted to f32 once), then one softmax pass
 * that sums the probabilities of document and of generated positions. The scores are the
 * attention kernel's (same queries, same cache, same scale); only the summation differs. */
#include <math.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/cpu/cpu.h"
#include "kernels/f16.h"

static size_t round16(size_t v) { return (v + 15) & ~(size_t)15; }

size_t cpu_attention_mass_scratch(int n_ctx, int head_dim, int threads)
{
    size_t per = round16((size_t)n_ctx + KV_TILE) + round16((size_t)head_dim * KV_TILE);
    return (per * (size_t)threads + 16) * sizeof(float);
}

static void tile_to_f32(const struct MassArgs *a, size_t at, size_t n, float *dst)
{
    if (a->kv_type == KV_F32) {
        memcpy(dst, (const float *)a->k + at, n * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)a->k + at;
    size_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = f16_to_f32(src[i]);
}

struct MassJob {
    const struct MassArgs *a;
    float *scratch;
    size_t per_thread;
};

static void mass_task(void *ctx, int task, int thread)
{
    const struct MassJob *job = ctx;
    const struct MassArgs *a = job->a;
    int hd = a->head_dim, G = a->n_q_head / a->n_kv_head, h = a->heads[task];
    float *S = job->scratch + job->per_thread * (size_t)thread;
    float *Kf = S + round16((size_t)a->n_keys + KV_TILE);
    const float *q = a->q + (size_t)h * hd;
    size_t head = (size_t)(h / G) * a->kv_head_stride;
    float mx = -INFINITY;
    for (int k0 = 0; k0 < a->n_keys; k0 += KV_TILE) {
        int nk = a->n_keys - k0 < KV_TILE ? a->n_keys - k0 : KV_TILE;
        /* Keys are stored transposed per tile: K[d][j]; unwritten columns are never read. */
        tile_to_f32(a, head + (size_t)k0 * hd, (size_t)hd * KV_TILE, Kf);
        float *s = S + k0;
        for (int j = 0; j < nk; j++) s[j] = 0.f;
        for (int d = 0; d < hd; d++) {
            const float *kd = Kf + (size_t)d * KV_TILE;
            float qd = q[d] * a->scale;
            for (int j = 0; j < nk; j++) s[j] += qd * kd[j];
        }
        for (int j = 0; j < nk; j++) mx = s[j] > mx ? s[j] : mx;
    }
    double l = 0, doc = 0, gen = 0;
    int marked = a->n_marked < a->n_keys ? a->n_marked : a->n_keys;
    for (int j = 0; j < marked; j++) {
        double p = expf(S[j] - mx);
        l += p;
        if (a->cls[j] == 1) doc += p;
    }
    for (int j = marked; j < a->n_keys; j++) {
        double p = expf(S[j] - mx);
        l += p;
        gen += p;
    }
    a->mass[2 * task] = (float)(doc / l);
    a->mass[2 * task + 1] = (float)(gen / l);
}

void cpu_attention_mass(struct ThreadPool *pool, const struct MassArgs *a, void *scratch)
{
    struct MassJob job = {
        .a = a,
        .scratch = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63),
        .per_thread = round16((size_t)a->n_keys + KV_TILE) + round16((size_t)a->head_dim * KV_TILE),
    };
    if (a->n_keys < 1 || a->n_heads < 1) return;
    pool_run(pool, a->n_heads, mass_task, &job);
}
