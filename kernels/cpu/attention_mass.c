/* Attention probability mass per position class for one query token: the groundedness
 * signals (docs/groundedness.md); and the attention weights a few query rows give a range of
 * keys (a blend's probe, docs/kv-reuse.md), from the same scores, summed per key.
 * The masses: tasks of (KV head, key segment); each converts a K tile to f32 once for every
 * listed query head of its group, scores the segment, and leaves per head a partial softmax
 * state (maximum, sum, document sum, generated sum) that the caller's thread merges. The
 * scores are the attention kernel's (same queries, same cache, same scale); exponentials
 * through vexpf so the loops vectorise. */
#include <math.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/vexp.h"
#include "kernels/f16.h"

enum { SEG_MIN = 1024, SEG_MAX_COUNT = 8 };

static size_t round16(size_t v) { return (v + 15) & ~(size_t)15; }

static int seg_len(int n_keys)
{
    int per = (n_keys + SEG_MAX_COUNT - 1) / SEG_MAX_COUNT;
    per = (per + KV_TILE - 1) / KV_TILE * KV_TILE;
    return per < SEG_MIN ? SEG_MIN : per;
}

/* Floats of one thread's workspace: scores of G heads over a segment, one K tile. */
static size_t ws_floats(int n_ctx, int head_dim, int G)
{
    return (size_t)G * round16((size_t)seg_len(n_ctx)) + round16((size_t)head_dim * KV_TILE);
}

size_t cpu_attention_mass_scratch(int n_ctx, int head_dim, int n_q_head, int n_kv_head,
                                  int threads)
{
    int G = n_q_head / n_kv_head;
    size_t parts = (size_t)n_q_head * SEG_MAX_COUNT * 4;
    return (ws_floats(n_ctx, head_dim, G) * (size_t)threads + parts + 32) * sizeof(float) +
           (size_t)(n_q_head + n_kv_head + 1) * sizeof(int);
}

/* The keys of the tile that starts at element `at` of cache k as f32, K[d][j] (hd x KV_TILE). */
static void tile_to_f32_layout(const void *k, enum KvType kv_type, int hd, size_t at, float *dst)
{
    size_t n = (size_t)hd * KV_TILE;
    if (kv_type == KV_F32) {
        memcpy(dst, (const float *)k + at, n * sizeof(float));
        return;
    }
    if (kv_type == KV_Q8) {
        for (int d = 0; d < hd; d++)
            for (int j = 0; j < KV_TILE; j++)
                dst[(size_t)d * KV_TILE + j] = cpu_kv_key(k, KV_Q8, at, d, j, hd);
        return;
    }
    const uint16_t *src = (const uint16_t *)k + at;
    size_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = f16_to_f32(src[i]);
}

/* s[j] = scale * q . K[.][j] for the n first keys of a tile in f32, K[d][j] (hd x KV_TILE). */
static void score_tile(const float *q, float scale, const float *Kf, int hd, int n,
                       float *restrict s)
{
    for (int j = 0; j < n; j++) s[j] = 0.f;
    for (int d = 0; d < hd; d++) {
        const float *restrict kd = Kf + (size_t)d * KV_TILE;
        float qd = q[d] * scale;
        for (int j = 0; j < n; j++) s[j] += qd * kd[j];
    }
}

struct MassJob {
    const struct MassArgs *a;
    float *scratch;
    size_t per_thread;
    int G, seg, n_seg;
    int n_groups;
    const int *order;       /* listed heads sorted by group: indices into a->heads */
    int *group_start;       /* order[group_start[k] .. group_start[k+1]) share a KV head */
    float *parts;           /* (n_heads, SEG_MAX_COUNT, 4): max, sum, doc, gen */
};

/* s[0..n) becomes p = exp(s - mx); adds the sum of p to *l and, when cls is given, the sum
 * over the positions whose class is 1 to *doc. */
static void sums(float *s, const uint8_t *cls, int n, float mx, double *l, double *doc)
{
    float t = 0.f, d = 0.f;
    for (int j = 0; j < n; j++) {
        s[j] = vexpf(s[j] - mx);
        t += s[j];
    }
    if (cls)
        for (int j = 0; j < n; j++) d += cls[j] == 1 ? s[j] : 0.f;
    *l += t;
    *doc += d;
}

static void mass_task(void *ctx, int task, int thread)
{
    const struct MassJob *job = ctx;
    const struct MassArgs *a = job->a;
    int hd = a->head_dim, gi = task / job->n_seg, sg = task % job->n_seg;
    int kb = sg * job->seg, ke = kb + job->seg < a->n_keys ? kb + job->seg : a->n_keys;
    int h0 = job->group_start[gi], nh = job->group_start[gi + 1] - h0;
    float *ws = job->scratch + job->per_thread * (size_t)thread;
    size_t stride = round16((size_t)job->seg);
    float *Kf = ws + (size_t)job->G * stride;
    int g = a->heads[job->order[h0]] / job->G;
    for (int k0 = kb; k0 < ke; k0 += KV_TILE) {
        int nk = ke - k0 < KV_TILE ? ke - k0 : KV_TILE;
        /* keys are stored transposed per tile, K[d][j]; unwritten columns are never read */
        tile_to_f32_layout(a->k, a->kv_type, hd,
                           kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride, a->kv_type,
                                        hd, g, k0), Kf);
        for (int i = 0; i < nh; i++)
            score_tile(a->q + (size_t)a->heads[job->order[h0 + i]] * hd, a->scale, Kf, hd, nk,
                       ws + (size_t)i * stride + (k0 - kb));
    }
    int n = ke - kb;
    int marked = a->n_marked < ke ? a->n_marked : ke;   /* keys [kb, marked) are marked */
    int n_m = marked > kb ? marked - kb : 0;
    for (int i = 0; i < nh; i++) {
        float *s = ws + (size_t)i * stride;
        float mx = -INFINITY;
        for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        double l = 0, doc = 0, gen = 0, none = 0;
        /* p overwrites s in place, block by block (float sums stay short) */
        for (int j = 0; j < n_m; j += KV_TILE) {
            int c = n_m - j < KV_TILE ? n_m - j : KV_TILE;
            sums(s + j, a->cls + kb + j, c, mx, &l, &doc);
        }
        for (int j = n_m; j < n; j += KV_TILE) {
            int c = n - j < KV_TILE ? n - j : KV_TILE;
            double g = 0;
            sums(s + j, NULL, c, mx, &g, &none);
            gen += g;
            l += g;
        }
        float *part = job->parts + ((size_t)job->order[h0 + i] * SEG_MAX_COUNT + sg) * 4;
        part[0] = mx;
        part[1] = (float)l;
        part[2] = (float)doc;
        part[3] = (float)gen;
    }
}

void cpu_attention_mass(struct ThreadPool *pool, const struct MassArgs *a, void *scratch)
{
    if (a->n_keys < 1 || a->n_heads < 1 || a->n_heads > a->n_q_head) return;
    int G = a->n_q_head / a->n_kv_head;
    struct MassJob job = {
        .a = a,
        .scratch = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63),
        .G = G,
        .seg = seg_len(a->n_keys),
    };
    job.n_seg = (a->n_keys + job.seg - 1) / job.seg;
    job.per_thread = (size_t)G * round16((size_t)job.seg) + round16((size_t)a->head_dim * KV_TILE);
    int threads = pool_threads(pool);
    job.parts = job.scratch + job.per_thread * (size_t)(threads > 0 ? threads : 1);
    int *order = (int *)(void *)(job.parts + (size_t)a->n_q_head * SEG_MAX_COUNT * 4);
    job.group_start = order + a->n_q_head;
    /* group the listed heads by KV head (stable) */
    int k = 0;
    for (int g = 0; g < a->n_kv_head; g++) {
        int start = k;
        for (int i = 0; i < a->n_heads; i++)
            if (a->heads[i] / G == g) order[k++] = i;
        if (k > start) job.group_start[job.n_groups++] = start;
    }
    job.group_start[job.n_groups] = k;
    job.order = order;
    pool_run(pool, job.n_groups * job.n_seg, mass_task, &job);
    for (int i = 0; i < a->n_heads; i++) {
        const float *p = job.parts + (size_t)i * SEG_MAX_COUNT * 4;
        float mx = -INFINITY;
        for (int s = 0; s < job.n_seg; s++) mx = p[4 * s] > mx ? p[4 * s] : mx;
        double l = 0, doc = 0, gen = 0;
        for (int s = 0; s < job.n_seg; s++) {
            double w = exp((double)p[4 * s] - mx);
            l += w * p[4 * s + 1];
            doc += w * p[4 * s + 2];
            gen += w * p[4 * s + 3];
        }
        a->mass[2 * i] = (float)(doc / l);
        a->mass[2 * i + 1] = (float)(gen / l);
    }
}

/* ---- the weights a few rows give a range of keys (WeightsArgs) ----
 * Tasks of (row, KV head): each converts the K tiles up to its row's position to f32 once for
 * the group's query heads, scores them, takes each head's softmax and writes the weights of
 * the range's keys, summed over its heads in order, to its own partial sums; the caller's
 * thread adds the partial sums up in task order, so the result does not depend on which
 * thread ran which task. */

struct WeightsJob {
    const struct WeightsArgs *a;
    float *scratch;
    size_t per_thread;        /* floats: G score rows and a K tile */
    size_t stride;            /* of a score row */
    float *partial;           /* (tasks, range_stride) */
    size_t range_stride;
    int G;
};

size_t cpu_attention_weights_scratch(int n_keys, int head_dim, int n_q_head, int n_kv_head,
                                     int n_rows, int threads)
{
    size_t stride = round16((size_t)n_keys + KV_TILE);
    size_t per = (size_t)(n_q_head / n_kv_head) * stride + round16((size_t)head_dim * KV_TILE);
    size_t partial = (size_t)n_rows * n_kv_head * round16((size_t)n_keys);
    return (per * (size_t)(threads > 0 ? threads : 1) + partial + 16) * sizeof(float);
}

static void weights_task(void *ctx, int task, int thread)
{
    const struct WeightsJob *job = ctx;
    const struct WeightsArgs *a = job->a;
    int hd = a->head_dim, G = job->G, t = task / a->n_kv_head, g = task % a->n_kv_head;
    int nk = a->pos[t] + 1;
    float *ws = job->scratch + job->per_thread * (size_t)thread;
    float *Kf = ws + (size_t)G * job->stride;
    float *part = job->partial + job->range_stride * (size_t)task;
    for (int k0 = 0; k0 < nk; k0 += KV_TILE) {
        int n = nk - k0 < KV_TILE ? nk - k0 : KV_TILE;
        tile_to_f32_layout(a->k, a->kv_type, hd,
                           kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride, a->kv_type,
                                        hd, g, k0), Kf);
        for (int i = 0; i < G; i++)
            score_tile(a->q + (size_t)t * a->q_stride + (size_t)(g * G + i) * hd, a->scale, Kf,
                       hd, n, ws + (size_t)i * job->stride + k0);
    }
    int range = a->k1 - a->k0, e1 = a->k1 < nk ? a->k1 : nk;
    memset(part, 0, (size_t)range * sizeof *part);
    for (int i = 0; i < G; i++) {
        float *s = ws + (size_t)i * job->stride;
        float mx = -INFINITY;
        for (int j = 0; j < nk; j++) mx = s[j] > mx ? s[j] : mx;
        double l = 0, none = 0;
        for (int j = 0; j < nk; j += KV_TILE)
            sums(s + j, NULL, nk - j < KV_TILE ? nk - j : KV_TILE, mx, &l, &none);
        float inv = (float)(1.0 / l);
        for (int j = a->k0; j < e1; j++) part[j - a->k0] += s[j] * inv;
    }
}

void cpu_attention_weights(struct ThreadPool *pool, const struct WeightsArgs *a, void *scratch)
{
    int range = a->k1 - a->k0;
    if (range < 1 || a->n_rows < 1) return;
    int nk = a->pos[a->n_rows - 1] + 1, threads = pool_threads(pool) > 0 ? pool_threads(pool) : 1;
    int tasks = a->n_rows * a->n_kv_head;
    struct WeightsJob job = {
        .a = a,
        .scratch = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63),
        .stride = round16((size_t)nk + KV_TILE),
        .range_stride = round16((size_t)range),
        .G = a->n_q_head / a->n_kv_head,
    };
    job.per_thread = (size_t)job.G * job.stride + round16((size_t)a->head_dim * KV_TILE);
    job.partial = job.scratch + job.per_thread * (size_t)threads;
    pool_run(pool, tasks, weights_task, &job);
    for (int k = 0; k < tasks; k++) {
        const float *part = job.partial + job.range_stride * (size_t)k;
        for (int j = 0; j < range; j++) a->out[j] += part[j];
    }
}
