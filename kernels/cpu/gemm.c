/* Matrix products of the CPU backend: the job split over the thread pool and the portable
 * and OpenBLAS paths. A prefill task owns 32 outputs of one product for a block of input rows
 * small enough to stay in the core's L2 cache across tasks (tasks run row block by row
 * block): it decodes those weights (exact f32 values, as the reference decoder gives) into a
 * k-major panel and runs the path's microkernel over the rows. One token (decode)
 * instead splits the outputs into groups of 16 and uses fused dequantise-and-dot kernels:
 * there each weight is used once, so memory traffic rules. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/kquant.h"
#include "kernels/cpu/vexp.h"
#include "kernels/dequant.h"

enum {
    TASK_COLS = 32,
    MATVEC_GROUP = 16,
    ALIGN_FLOATS = 16,
    ROW_BLOCK_BYTES = 1 << 20, /* input rows per task: about half of a core's L2 */
};

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* Per-thread scratch, in floats: decoded rows (TASK_COLS, k) and the packed panel (k,
 * TASK_COLS), or an int8 panel and its builder's work area, whichever is larger; the
 * up-projection tile of a SwiGLU task (n, TASK_COLS), and one-token outputs. The block sums of
 * x for one-token products, then the int8 input rows, follow the per-thread areas. */
static size_t panel_floats(int k_max)
{
    size_t k = (size_t)(k_max > 0 ? k_max : 1);
    size_t f32 = 2 * round_up((size_t)TASK_COLS * k, ALIGN_FLOATS);
    size_t q8 = (round_up(cpu_q8_panel_bytes((int)k, 16), 64) + cpu_q8_panel_work((int)k) + 64) /
                sizeof(float);
    return f32 > q8 ? f32 : round_up(q8, ALIGN_FLOATS);
}

static size_t per_thread_floats(int n_max, int k_max)
{
    size_t n = (size_t)(n_max > 0 ? n_max : 1);
    return panel_floats(k_max) + round_up(n * TASK_COLS, ALIGN_FLOATS) + 4 * 256;
}

/* The int8 input rows in three views: Q8_0 blocks (sub-blocks of 32), then Q8_K (its integers
 * once) with sums per 32 and per 16; each array 64-byte aligned. */
enum { Q8_VIEWS = 3 };
static const int VIEW_G[Q8_VIEWS] = {32, 32, 16};

static size_t q8_rows_bytes(int n_max, int k_max)
{
    size_t n = (size_t)(n_max > 0 ? n_max : 1), k = (size_t)(k_max > 0 ? k_max : 1);
    size_t bytes = 2 * round_up(n * round_up(k, 64), 64);
    for (int v = 0; v < Q8_VIEWS; v++)
        bytes += 3 * round_up(n * (k / (size_t)VIEW_G[v] + 1) * 4, 64);
    return bytes;
}

size_t cpu_matmul_scratch(int n_max, int k_max, int threads)
{
    return (per_thread_floats(n_max, k_max) * (size_t)threads +
            (size_t)(n_max > 0 ? n_max : 1) * (round_up((size_t)(k_max > 0 ? k_max : 1), 32) / 32) +
            ALIGN_FLOATS) * sizeof(float) +
           q8_rows_bytes(n_max, k_max) + 128;
}

struct GemmJob {
    const struct MatmulArgs *a;
    enum CpuIsa isa;
    enum CpuGemm gemm;
    int per_task;              /* one token: groups of 16 outputs per task */
    int row_block, n_row_blocks; /* prefill: input rows per task */
    int first_task[5];         /* task index where each product's blocks start, per row block */
    float *scratch;
    size_t per_thread;
    const float *xsum;         /* one token: per-32-block sums of x */
    enum CpuIsa q8;            /* the int8 kernel (CPU_ISA_SCALAR: none) for the types that have them */
    struct Q8Rows q8x[Q8_VIEWS];
    int q8_need[Q8_VIEWS];
};

/* silu(g) * u over n elements. */
static void silu_mul_n(enum CpuIsa isa, float *g, const float *u, int n)
{
    if (isa == CPU_ISA_AVX512) {
        cpu_silu_mul_avx512(g, u, n);
        return;
    }
    for (int j = 0; j < n; j++) g[j] = g[j] / (1.f + vexpf(-g[j])) * u[j];
}

/* y (n, mb) (= or +=) x (n, k) . rows (mb, k)^T, portably; rows are decoded weights. */
static void block_scalar(const float *x, size_t xs, int n, int k, const float *rows, int mb,
                         float *y, size_t ys, int acc)
{
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * xs;
        for (int j = 0; j < mb; j++) {
            const float *wj = rows + (size_t)j * k;
            float s = 0.f;
            for (int kk = 0; kk < k; kk++) s += xi[kk] * wj[kk];
            float *dst = y + (size_t)i * ys + j;
            *dst = acc ? *dst + s : s;
        }
    }
}

/* K-quant rows c0..c0+mb-1 into a k-major panel NR floats wide, one super-block column at a
 * time so the decoded rows (mb x 256 floats) stay in L1 on their way to the panel. */
static void panel_k(enum CpuIsa isa, const struct Weights *w, int c0, int mb, float *rows,
                    float *panel)
{
    int nr = isa == CPU_ISA_AVX512 ? 32 : 16, bb = dequant_block_bytes(w->type);
    const uint8_t *base = (const uint8_t *)w->data + (size_t)c0 * w->row_bytes;
    for (int b = 0; b < w->cols / QK_K; b++) {
        for (int j = 0; j < mb; j++) {
            const uint8_t *blk = base + (size_t)j * w->row_bytes + (size_t)b * bb;
            if (isa == CPU_ISA_AVX512) cpu_decode_k_avx512(w->type, blk, rows + (size_t)j * QK_K, 1);
            else cpu_decode_k_avx2(w->type, blk, rows + (size_t)j * QK_K, 1);
        }
        float *dst = panel + (size_t)b * QK_K * nr;
        if (isa == CPU_ISA_AVX512) cpu_pack_panel_avx512(rows, mb, QK_K, dst);
        else cpu_pack_panel_avx2(rows, mb, QK_K, dst);
    }
}

/* Which int8 view of the input a weight type multiplies: -1 for none. */
static int q8_view(uint32_t type)
{
    struct Q8Type t = {Q8_ACT_32, 32, -1, 0};
    if (!cpu_q8_type(type, &t)) return -1;
    return t.act == Q8_ACT_32 ? 0 : t.g == 32 ? 1 : 2;
}

/* One product's block of mb outputs starting at output c0 for rows i0..i0+n-1, written to
 * y (rows ys apart, row i0 first). */
static void gemm_one(const struct GemmJob *job, const struct Weights *w, int c0, int mb, int i0,
                     int n, float *y, size_t ys, int acc, float *ws)
{
    const struct MatmulArgs *a = job->a;
    int k = a->k;
    int view = job->q8 ? q8_view(w->type) : -1;
    if (view >= 0) {
        struct Q8Type t;
        cpu_q8_type(w->type, &t);
        uint8_t *panel = (uint8_t *)ws;
        uint8_t *work = panel + round_up(cpu_q8_panel_bytes(k, t.g), 64);
        struct Q8Block qb = {
            .x = &job->q8x[view], .i0 = i0, .n = n, .k = k, .panel = panel, .m_blk = mb,
            .shift = t.shift, .umax = t.umax, .y = y, .y_stride = ys, .accumulate = acc,
        };
        if (job->q8 == CPU_ISA_AVX512) {
            cpu_q8_panel_avx512(w, c0, mb, panel, work);
            cpu_q8_gemm_block_avx512(&qb);
        } else {
            cpu_q8_panel_avx2(w, c0, mb, panel, work);
            cpu_q8_gemm_block_avx2(&qb);
        }
        return;
    }
    const float *x = a->x + (size_t)i0 * a->x_stride;
    float *rows = ws;
    float *panel = ws + round_up((size_t)TASK_COLS * k, ALIGN_FLOATS);
    struct GemmBlock b = {
        .x = x, .x_stride = a->x_stride, .n = n, .k = k, .panel = panel, .y = y,
        .y_stride = ys, .accumulate = acc,
    };
    int x16 = w->layout == WEIGHTS_X16;
    if (job->gemm != CPU_GEMM_OPENBLAS && job->isa == CPU_ISA_AVX512) {
        if (x16) cpu_panel_x16_avx512(w, c0, TASK_COLS, panel);
        else if (kquant_is_k(w->type)) panel_k(job->isa, w, c0, mb, rows, panel);
        else {
            cpu_decode_rows_with(job->isa, w, c0, mb, rows);
            cpu_pack_panel_avx512(rows, mb, k, panel);
        }
        b.m_blk = mb;
        cpu_gemm_block_avx512(&b);
        return;
    }
    if (job->gemm != CPU_GEMM_OPENBLAS && job->isa == CPU_ISA_AVX2) {
        for (int j = 0; j < mb; j += 16) {
            int nb = mb - j < 16 ? mb - j : 16;
            if (x16) cpu_panel_x16_avx2(w, c0 + j, 16, panel);
            else if (kquant_is_k(w->type)) panel_k(job->isa, w, c0 + j, nb, rows, panel);
            else {
                cpu_decode_rows_with(job->isa, w, c0 + j, nb, rows);
                cpu_pack_panel_avx2(rows, nb, k, panel);
            }
            b.m_blk = nb;
            b.y = y + j;
            cpu_gemm_block_avx2(&b);
        }
        return;
    }
    cpu_decode_rows(w, c0, mb, rows);
    if (job->gemm == CPU_GEMM_OPENBLAS)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, mb, k, 1.f, x,
                    (int)a->x_stride, rows, k, acc ? 1.f : 0.f, y, (int)ys);
    else
        block_scalar(x, a->x_stride, n, k, rows, mb, y, ys, acc);
}

static int find_out(const struct GemmJob *job, int task)
{
    int o = 0;
    while (task >= job->first_task[o + 1]) o++;
    return o;
}

static void gemm_task(void *ctx, int task, int thread)
{
    const struct GemmJob *job = ctx;
    const struct MatmulArgs *a = job->a;
    float *ws = job->scratch + job->per_thread * (size_t)thread;
    int per_rb = job->first_task[a->swiglu ? 1 : a->n_out];
    int rb = task / per_rb;
    task %= per_rb;
    int i0 = rb * job->row_block, n = a->n - i0 < job->row_block ? a->n - i0 : job->row_block;
    int o = find_out(job, task);
    const struct MatOut *out = &a->out[o];
    int c0 = (task - job->first_task[o]) * TASK_COLS;
    int mb = out->w->rows - c0 < TASK_COLS ? out->w->rows - c0 : TASK_COLS;
    float *y = out->y + (size_t)i0 * out->y_stride + c0;
    if (!a->swiglu) {
        gemm_one(job, out->w, c0, mb, i0, n, y, out->y_stride, out->accumulate, ws);
        return;
    }
    /* Gate into the output, up into this thread's tile, then combine in place while both
     * are still in cache. */
    float *up = ws + panel_floats(a->k);
    gemm_one(job, a->out[0].w, c0, mb, i0, n, y, out->y_stride, 0, ws);
    gemm_one(job, a->out[1].w, c0, mb, i0, n, up, TASK_COLS, 0, ws);
    for (int i = 0; i < n; i++)
        silu_mul_n(job->isa, y + (size_t)i * out->y_stride, up + (size_t)i * TASK_COLS, mb);
}

/* --- one input row --- */

/* Outputs r0..r1-1 (r0 a multiple of 16) of w . x[i] into y[i][0 .. r1 - r0) for nr inputs
 * (1..CPU_MV_ROWS). The AVX-512 kernels unpack the weights once for all of them; every input's
 * arithmetic is the same as alone. */
static void matvec_rows(const struct GemmJob *job, const struct Weights *w, int r0, int r1,
                        const float *const *x, const float *const *xsum, float *const *y,
                        int nr, float *ws)
{
    if (w->layout == WEIGHTS_X16) {
        int g0 = r0 / 16, g1 = (r1 + 15) / 16;
        float *tmp[CPU_MV_ROWS];
        for (int i = 0; i < nr; i++)
            tmp[i] = ws + round_up((size_t)w->cols, ALIGN_FLOATS) + (size_t)i * 256;
        if (job->isa == CPU_ISA_AVX512) {
            cpu_matvec_x16_avx512(w, g0, g1, x, xsum, tmp, nr);
        } else {
            for (int i = 0; i < nr; i++) {
                if (job->isa == CPU_ISA_AVX2) cpu_matvec_x16_avx2(w, g0, g1, x[i], xsum[i], tmp[i]);
                else cpu_matvec_x16_portable(w, g0, g1, x[i], tmp[i]);
            }
        }
        for (int i = 0; i < nr; i++) memcpy(y[i], tmp[i], (size_t)(r1 - r0) * sizeof(float));
        return;
    }
    if (job->isa == CPU_ISA_AVX512 && cpu_matvec_avx512_handles(w->type)) {
        for (int i = 0; i < nr; i++) cpu_matvec_avx512(w, r0, r1, x[i], xsum[i], y[i]);
        return;
    }
    if (kquant_is_k(w->type) && job->isa != CPU_ISA_SCALAR) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)r0 * w->row_bytes;
        for (int r = r0; r < r1; r++, row += w->row_bytes) {
            if (job->isa == CPU_ISA_AVX512) {
                float out[CPU_MV_ROWS];
                cpu_dot_k_avx512(w->type, row, x, xsum, w->cols / QK_K, nr, out);
                for (int i = 0; i < nr; i++) y[i][r - r0] = out[i];
            } else {
                for (int i = 0; i < nr; i++)
                    y[i][r - r0] = cpu_dot_k_avx2(w->type, row, x[i], xsum[i], w->cols / QK_K);
            }
        }
        return;
    }
    int k = w->cols;
    for (int r = r0; r < r1; r++) {
        cpu_weights_row(w, r, ws);
        for (int i = 0; i < nr; i++) {
            float s = 0.f;
            for (int kk = 0; kk < k; kk++) s += ws[kk] * x[i][kk];
            y[i][r - r0] = s;
        }
    }
}

static void matvec_task(void *ctx, int task, int thread)
{
    const struct GemmJob *job = ctx;
    const struct MatmulArgs *a = job->a;
    float *ws = job->scratch + job->per_thread * (size_t)thread;
    int o = find_out(job, task);
    const struct MatOut *out = &a->out[o];
    int span = job->per_task * MATVEC_GROUP;
    int r0 = (task - job->first_task[o]) * span;
    int r1 = out->w->rows - r0 < span ? out->w->rows : r0 + span;
    float tmp[CPU_MV_ROWS][256], up[CPU_MV_ROWS][256];
    /* The rows (a batch of decode tokens) CPU_MV_ROWS at a time through the same kernels:
     * each row's result is that of its own one-row product, and the task's weights are
     * unpacked once per group of rows. */
    size_t xs_stride = (size_t)(a->k / 32);
    for (int i0 = 0; i0 < a->n; i0 += CPU_MV_ROWS) {
        int nr = a->n - i0 < CPU_MV_ROWS ? a->n - i0 : CPU_MV_ROWS;
        const float *x[CPU_MV_ROWS], *xsum[CPU_MV_ROWS];
        float *t[CPU_MV_ROWS], *u[CPU_MV_ROWS];
        for (int i = 0; i < nr; i++) {
            x[i] = a->x + (size_t)(i0 + i) * a->x_stride;
            xsum[i] = job->xsum + (size_t)(i0 + i) * xs_stride;
            t[i] = tmp[i];
            u[i] = up[i];
        }
        matvec_rows(job, out->w, r0, r1, x, xsum, t, nr, ws);
        if (a->swiglu) matvec_rows(job, a->out[1].w, r0, r1, x, xsum, u, nr, ws);
        for (int i = 0; i < nr; i++) {
            float *y = out->y + (size_t)(i0 + i) * out->y_stride;
            if (a->swiglu) {
                silu_mul_n(job->isa, tmp[i], up[i], r1 - r0);
                memcpy(y + r0, tmp[i], (size_t)(r1 - r0) * sizeof(float));
                continue;
            }
            for (int r = r0; r < r1; r++)
                y[r] = out->accumulate ? y[r] + tmp[i][r - r0] : tmp[i][r - r0];
        }
    }
}

/* Task t rounds input rows t*per .. into the int8 views the job needs (the Q8_K sums per 32
 * from those per 16). */
struct QuantJob {
    struct GemmJob *job;
    int per;
};

static void quant_task(void *ctx, int task, int thread)
{
    (void)thread;
    const struct QuantJob *qj = ctx;
    struct GemmJob *job = qj->job;
    const struct MatmulArgs *a = job->a;
    int i1 = (task + 1) * qj->per < a->n ? (task + 1) * qj->per : a->n;
    for (int i = task * qj->per; i < i1; i++) {
        const float *x = a->x + (size_t)i * a->x_stride;
        void (*round)(enum Q8Act, const float *, int, const struct Q8Rows *, int) =
            job->q8 == CPU_ISA_AVX512 ? cpu_q8_quantize_row_avx512 : cpu_q8_quantize_row;
        if (job->q8_need[0]) round(Q8_ACT_32, x, a->k, &job->q8x[0], i);
        if (!job->q8_need[1] && !job->q8_need[2]) continue;
        const struct Q8Rows *v16 = &job->q8x[2], *v32 = &job->q8x[1];
        if (!job->q8_need[2]) {
            round(Q8_ACT_K, x, a->k, v32, i);
            continue;
        }
        round(Q8_ACT_K, x, a->k, v16, i);
        if (!job->q8_need[1]) continue;
        for (int s = 0; s < a->k / 32; s++) {
            size_t at = (size_t)i * v32->s_stride + s, f = (size_t)i * v16->s_stride + 2 * s;
            int32_t sum = -(v16->nx[f] + v16->nx[f + 1]);
            v32->d[at] = v16->d[f];
            v32->nx[at] = -sum;
            v32->dx[at] = v16->d[f] * (float)sum;
        }
    }
}

/* Sets up the int8 views of a job's input after the scratch's other areas and fills them. */
static void q8_prepare(struct GemmJob *job, struct ThreadPool *pool, uint8_t *area)
{
    const struct MatmulArgs *a = job->a;
    int n_prod = a->swiglu ? 2 : a->n_out;
    for (int o = 0; o < n_prod; o++) {
        int v = q8_view(a->out[o].w->type);
        if (v >= 0) job->q8_need[v] = 1;
    }
    size_t n = (size_t)a->n, k = (size_t)a->k, qs = round_up(k, 64);
    int8_t *q32 = (int8_t *)area, *qk = (int8_t *)(area + round_up(n * qs, 64));
    uint8_t *p = area + 2 * round_up(n * qs, 64);
    for (int v = 0; v < Q8_VIEWS; v++) {
        struct Q8Rows *r = &job->q8x[v];
        size_t ss = k / (size_t)VIEW_G[v] + 1, arr = round_up(n * ss * 4, 64);
        *r = (struct Q8Rows){.q = v == 0 ? q32 : qk, .q_stride = qs, .s_stride = ss,
                             .g = VIEW_G[v]};
        r->d = (float *)(void *)p;
        r->nx = (int32_t *)(void *)(p + arr);
        r->dx = (float *)(void *)(p + 2 * arr);
        p += 3 * arr;
    }
    int threads = pool_threads(pool);
    struct QuantJob qj = {.job = job, .per = (a->n + 4 * threads - 1) / (4 * threads)};
    pool_run(pool, (a->n + qj.per - 1) / qj.per, quant_task, &qj);
}

void cpu_matmul_with(enum CpuIsa isa, enum CpuGemm gemm, struct ThreadPool *pool,
                     const struct MatmulArgs *a, void *scratch)
{
    if (a->n <= 0 || a->n_out <= 0) return;
    struct GemmJob job = {.a = a, .isa = isa, .gemm = gemm};
    float *base = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int threads = pool_threads(pool);
    job.per_thread = per_thread_floats(a->n, a->k);
    job.scratch = base;
    int single = (a->n == 1 && !a->rowwise) || a->onerow;
    int n_prod = a->swiglu ? 1 : a->n_out;
    if (single) {
        /* Enough tasks to balance the threads, few enough to keep each one a few
         * microseconds of streaming; at most 256 outputs per task (matvec_task's buffers). */
        int rows = 0;
        for (int o = 0; o < n_prod; o++) rows += a->out[o].w->rows;
        int groups = (rows + MATVEC_GROUP - 1) / MATVEC_GROUP;
        job.per_task = groups / (16 * threads);
        job.per_task = job.per_task < 1 ? 1 : job.per_task > 16 ? 16 : job.per_task;
    }
    int width = single ? job.per_task * MATVEC_GROUP : TASK_COLS;
    job.first_task[0] = 0;
    for (int o = 0; o < n_prod; o++)
        job.first_task[o + 1] = job.first_task[o] + (a->out[o].w->rows + width - 1) / width;
    for (int o = n_prod + 1; o < 5; o++) job.first_task[o] = job.first_task[n_prod];
    if (single) {
        float *xsum = base + job.per_thread * (size_t)threads;
        for (int i = 0; i < a->n; i++) {
            const float *x = a->x + (size_t)i * a->x_stride;
            for (int b = 0; b < a->k / 32; b++) {
                float s = 0.f;
                for (int j = 0; j < 32; j++) s += x[b * 32 + j];
                xsum[(size_t)i * (a->k / 32) + b] = s;
            }
        }
        job.xsum = xsum;
    }
    job.row_block = a->n;
    job.n_row_blocks = 1;
    job.q8 = !single && gemm == CPU_GEMM_Q8 ? cpu_q8_kernel(isa) : CPU_ISA_SCALAR;
    if (job.q8) {
        uint8_t *area = (uint8_t *)(base + job.per_thread * (size_t)threads +
                                    (size_t)a->n * (round_up((size_t)a->k, 32) / 32) + ALIGN_FLOATS);
        q8_prepare(&job, pool, (uint8_t *)(((uintptr_t)area + 63) & ~(uintptr_t)63));
    }
    if (!single) {
        /* Row blocks of whole microkernel tiles (14 rows f32; int8 6, or 4 on AVX2) whose
         * inputs fit the cache budget. */
        int unit = job.q8 == CPU_ISA_AVX512 ? 6 : job.q8 ? 4 : 14;
        int fit = (int)(ROW_BLOCK_BYTES / ((size_t)a->k * (job.q8 ? 1 : sizeof(float))));
        fit = fit < unit ? unit : fit / unit * unit;
        job.n_row_blocks = (a->n + fit - 1) / fit;
        job.row_block = (a->n + job.n_row_blocks - 1) / job.n_row_blocks;
        job.row_block = (job.row_block + unit - 1) / unit * unit;
        job.n_row_blocks = (a->n + job.row_block - 1) / job.row_block;
    }
    if (gemm == CPU_GEMM_OPENBLAS && !single) openblas_set_num_threads(1);
    pool_run(pool, job.first_task[n_prod] * (single ? 1 : job.n_row_blocks),
             single ? matvec_task : gemm_task, &job);
}
