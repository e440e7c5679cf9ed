/* The CPU backend's table and its row-wise operations: RMSNorm, and RoPE fused with the
 * key/value store (one sweep over the chunk's q, k, v). Both split rows over the pool when a
 * chunk is long enough to pay for the hand-off. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"

enum { ROWS_PER_TASK = 16 };


struct RowJob {
    float *y;
    const float *x, *w;
    int n, d;
    float eps;
    const struct RopeStoreArgs *rs;
};

static void rmsnorm_rows(const struct RowJob *j, int r0, int r1)
{
    int d = j->d;
    for (int r = r0; r < r1; r++) {
        const float *xr = j->x + (size_t)r * d;
        float *yr = j->y + (size_t)r * d;
        /* 16 partial sums: a loop-carried single sum would not be vectorised. */
        float part[16] = {0}, ss = 0.f;
        int i = 0;
        for (; i + 16 <= d; i += 16)
            for (int l = 0; l < 16; l++) part[l] += xr[i + l] * xr[i + l];
        for (; i < d; i++) ss += xr[i] * xr[i];
        for (int l = 0; l < 16; l++) ss += part[l];
        float inv = 1.f / sqrtf(ss / d + j->eps);
        for (i = 0; i < d; i++) yr[i] = xr[i] * inv * j->w[i];
    }
}

static void rmsnorm_task(void *ctx, int task, int thread)
{
    (void)thread;
    const struct RowJob *j = ctx;
    int r0 = task * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK < j->n ? r0 + ROWS_PER_TASK : j->n;
    rmsnorm_rows(j, r0, r1);
}

static void cpu_rmsnorm(struct ThreadPool *pool, float *y, const float *x, const float *w, int n,
                        int d, float eps)
{
    struct RowJob j = {.y = y, .x = x, .w = w, .n = n, .d = d, .eps = eps};
    if (n <= ROWS_PER_TASK) {
        rmsnorm_rows(&j, 0, n);
        return;
    }
    pool_run(pool, (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK, rmsnorm_task, &j);
}

static void rope_heads(float *x, int n_heads, int head_dim, int n_rot, int layout,
                       const float *c, const float *s)
{
    int half = n_rot / 2;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        if (layout) {
            for (int i = 0; i < half; i++) {
                float xa = v[i], xb = v[i + half];
                v[i] = xa * c[i] - xb * s[i];
                v[i + half] = xa * s[i] + xb * c[i];
            }
        } else {
            for (int i = 0; i < half; i++) {
                float xa = v[2 * i], xb = v[2 * i + 1];
                v[2 * i] = xa * c[i] - xb * s[i];
                v[2 * i + 1] = xa * s[i] + xb * c[i];
            }
        }
    }
}

static void rope_store_rows(const struct RopeStoreArgs *a, int t0, int t1)
{
    int half = a->n_rot / 2;
    for (int t = t0; t < t1; t++) {
        const float *c = a->cos + (size_t)t * half, *s = a->sin + (size_t)t * half;
        rope_heads(a->q + (size_t)t * a->q_stride, a->n_q_head, a->head_dim, a->n_rot,
                   a->layout, c, s);
        rope_heads(a->k + (size_t)t * a->kv_stride, a->n_kv_head, a->head_dim, a->n_rot,
                   a->layout, c, s);
    }
    cpu_kv_store_rows(a, t0, t1);
}

static void rope_store_task(void *ctx, int task, int thread)
{
    (void)thread;
    const struct RowJob *j = ctx;
    int t0 = task * ROWS_PER_TASK;
    int t1 = t0 + ROWS_PER_TASK < j->rs->n_tok ? t0 + ROWS_PER_TASK : j->rs->n_tok;
    rope_store_rows(j->rs, t0, t1);
}

static void cpu_rope_store(struct ThreadPool *pool, const struct RopeStoreArgs *a)
{
    if (a->n_tok <= ROWS_PER_TASK) {
        rope_store_rows(a, 0, a->n_tok);
        return;
    }
    struct RowJob j = {.rs = a};
    pool_run(pool, (a->n_tok + ROWS_PER_TASK - 1) / ROWS_PER_TASK, rope_store_task, &j);
}

/* kv_write: bit for bit without a rotation; with one, each position's key and value decoded,
 * the key rotated, and both stored as a computed key and value are. */
static void cpu_kv_write(const struct KvCopyArgs *a)
{
    if (!a->cos) {
        cpu_kv_write_packed(a);
        return;
    }
    float *k = a->k, *v = a->v, no_q[1] = {0};
    size_t w = (size_t)a->n_kv_head * a->head_dim;
    for (int t = 0; t < a->n_tok; t++) {
        cpu_kv_unpack(a, t, k, v);
        rope_heads(k, a->n_kv_head, a->head_dim, a->n_rot, a->layout, a->cos, a->sin);
        struct RopeStoreArgs rs = {
            .q = no_q, .k = k, .v = v, .kv_stride = w, .n_tok = 1, .pos0 = a->pos0 + t,
            .n_kv_head = a->n_kv_head, .head_dim = a->head_dim, .kcache = a->kcache,
            .vcache = a->vcache, .kv_type = a->kv_type, .kv_head_stride = a->kv_head_stride,
            .pages = a->pages, .page_stride = a->page_stride,
        };
        cpu_kv_store_rows(&rs, 0, 1);
    }
}

static void cpu_matmul(struct ThreadPool *pool, const struct MatmulArgs *a, void *scratch)
{
    cpu_matmul_with(cpu_isa_best(), cpu_gemm_default(), pool, a, scratch);
}

static void cpu_attention(struct ThreadPool *pool, const struct AttnArgs *a, void *scratch)
{
    cpu_attention_with(cpu_isa_best(), cpu_attn_amx_default(), pool, a, scratch);
}

static char numerics_name[32];

static void numerics_fill(void)
{
    snprintf(numerics_name, sizeof numerics_name, "%s %s", cpu_isa_name(cpu_isa_best()),
             cpu_gemm_name(cpu_gemm_default()));
}

/* The instruction-set path and the prefill products' path (cpu_isa_best, cpu_gemm_default):
 * decided once per process. */
static const char *cpu_numerics(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, numerics_fill);
    return numerics_name;
}

const struct Backend backend_cpu = {
    .name = "cpu",
    .numerics = cpu_numerics,
    .weights_bytes = cpu_weights_bytes,
    .weights_pack = cpu_weights_pack,
    .weights_row = cpu_weights_row,
    .matmul = cpu_matmul,
    .matmul_scratch = cpu_matmul_scratch,
    .rmsnorm = cpu_rmsnorm,
    .rope_store = cpu_rope_store,
    .attention = cpu_attention,
    .attention_scratch = cpu_attention_scratch,
    .kv_head_stride = cpu_kv_head_stride,
    .attention_mass = cpu_attention_mass,
    .attention_mass_scratch = cpu_attention_mass_scratch,
    .attention_weights = cpu_attention_weights,
    .attention_weights_scratch = cpu_attention_weights_scratch,
    .kv_read = cpu_kv_read,
    .kv_write = cpu_kv_write,
};
