/* Causal attention on the CPU, tiled with an online softmax: never an N x N matrix. A task is
 * (KV head, block of query tokens); each K/V tile is converted to f32 once and reused by every
 * query head of its group for every token of the block. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/vexp.h"
#include "kernels/f16.h"

enum { ATTN_BQ = 16, ATTN_BK = 64 };

size_t cpu_attention_scratch(int head_dim, int group, int threads)
{
    size_t rows = (size_t)ATTN_BQ * group;
    size_t per = 2 * (size_t)ATTN_BK * head_dim /* Kt, V tiles */ + ATTN_BK /* scores */ +
                 rows * ((size_t)head_dim + 2) /* acc, m, l */;
    return per * (size_t)threads;
}

struct AttnJob { const struct AttnArgs *a; float *scratch; size_t per_thread; int n_qblocks; };

static void load_tile(const struct AttnArgs *a, int g, int k0, int nk, float *kt, float *vt)
{
    int hd = a->head_dim;
    size_t base = (size_t)g * a->kv_head_stride + (size_t)k0 * hd;
    if (a->kv_type == KV_F32) {
        const float *ks = (const float *)a->k + base, *vs = (const float *)a->v + base;
        for (int j = 0; j < nk; j++)
            for (int d = 0; d < hd; d++) kt[(size_t)d * ATTN_BK + j] = ks[(size_t)j * hd + d];
        memcpy(vt, vs, (size_t)nk * hd * sizeof(float));
    } else {
        const uint16_t *ks = (const uint16_t *)a->k + base, *vs = (const uint16_t *)a->v + base;
        for (int j = 0; j < nk; j++)
            for (int d = 0; d < hd; d++)
                kt[(size_t)d * ATTN_BK + j] = f16_to_f32(ks[(size_t)j * hd + d]);
        for (size_t i = 0; i < (size_t)nk * hd; i++) vt[i] = f16_to_f32(vs[i]);
    }
    /* Columns past nk are never read for scores that count, but keep them finite. */
    for (int d = 0; d < hd; d++)
        for (int j = nk; j < ATTN_BK; j++) kt[(size_t)d * ATTN_BK + j] = 0.f;
}

static void attn_task(void *ctx, int task, int thread)
{
    const struct AttnJob *job = ctx;
    const struct AttnArgs *a = job->a;
    int hd = a->head_dim, G = a->n_q_head / a->n_kv_head;
    int g = task / job->n_qblocks, qb = task % job->n_qblocks;
    int t0 = qb * ATTN_BQ, bq = a->n_tok - t0 < ATTN_BQ ? a->n_tok - t0 : ATTN_BQ;
    int rows = bq * G;

    float *restrict kt = job->scratch + job->per_thread * (size_t)thread;
    float *restrict vt = kt + (size_t)ATTN_BK * hd;
    float *restrict s = vt + (size_t)ATTN_BK * hd;
    float *restrict acc = s + ATTN_BK;
    float *mx = acc + (size_t)ATTN_BQ * G * hd;
    float *sum = mx + (size_t)ATTN_BQ * G;
    memset(acc, 0, (size_t)rows * hd * sizeof(float));
    for (int r = 0; r < rows; r++) { mx[r] = -INFINITY; sum[r] = 0.f; }

    int k_end = a->pos0 + t0 + bq; /* exclusive: the block's last token sees up to here */
    for (int k0 = 0; k0 < k_end; k0 += ATTN_BK) {
        int nk = k_end - k0 < ATTN_BK ? k_end - k0 : ATTN_BK;
        load_tile(a, g, k0, nk, kt, vt);
        for (int t = 0; t < bq; t++) {
            int limit = a->pos0 + t0 + t + 1 - k0; /* keys k0..k0+limit-1 are visible */
            int nv = limit < nk ? limit : nk;
            if (nv <= 0) continue;
            for (int j = 0; j < G; j++) {
                int r = t * G + j;
                const float *restrict q = a->q + (size_t)(t0 + t) * a->q_stride + (size_t)(g * G + j) * hd;
                for (int kk = 0; kk < ATTN_BK; kk++) s[kk] = 0.f;
                for (int d = 0; d < hd; d++) {
                    float qd = q[d];
                    const float *restrict kr = kt + (size_t)d * ATTN_BK;
                    for (int kk = 0; kk < ATTN_BK; kk++) s[kk] += qd * kr[kk];
                }
                float m_tile = -INFINITY;
                for (int kk = 0; kk < nv; kk++) {
                    s[kk] *= a->scale;
                    if (s[kk] > m_tile) m_tile = s[kk];
                }
                float m_new = m_tile > mx[r] ? m_tile : mx[r];
                float corr = vexpf(mx[r] - m_new); /* 0 on the first tile (mx = -inf) */
                if (mx[r] == -INFINITY) corr = 0.f;
                float *restrict ar = acc + (size_t)r * hd;
                if (corr != 1.f)
                    for (int d = 0; d < hd; d++) ar[d] *= corr;
                for (int kk = 0; kk < nv; kk++) s[kk] = vexpf(s[kk] - m_new);
                float l = sum[r] * corr;
                for (int kk = 0; kk < nv; kk++) l += s[kk];
                for (int kk = 0; kk < nv; kk++) {
                    float p = s[kk];
                    const float *restrict vr = vt + (size_t)kk * hd;
                    for (int d = 0; d < hd; d++) ar[d] += p * vr[d];
                }
                sum[r] = l;
                mx[r] = m_new;
            }
        }
    }
    for (int t = 0; t < bq; t++)
        for (int j = 0; j < G; j++) {
            int r = t * G + j;
            float inv = 1.f / sum[r];
            float *o = a->out + (size_t)(t0 + t) * a->out_stride + (size_t)(g * G + j) * hd;
            const float *ar = acc + (size_t)r * hd;
            for (int d = 0; d < hd; d++) o[d] = ar[d] * inv;
        }
}

void cpu_attention(struct ThreadPool *pool, const struct AttnArgs *a, float *scratch)
{
    int G = a->n_q_head / a->n_kv_head;
    struct AttnJob job = {
        .a = a,
        .scratch = scratch,
        .per_thread = cpu_attention_scratch(a->head_dim, G, 1),
        .n_qblocks = (a->n_tok + ATTN_BQ - 1) / ATTN_BQ,
    };
    pool_run(pool, a->n_kv_head * job.n_qblocks, attn_task, &job);
}
