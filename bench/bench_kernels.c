/* bench_kernels: the measurements behind `make bench-engine` that need to run inside one
 * process on the engine's own threads:
 *   peaks    the ceilings: an AVX-512 (or AVX2) FMA loop, an AVX-512 VNNI int8 loop and an
 *            AMX bf16 tile loop on every thread (bench/peak_loops.c), and a large OpenBLAS
 *            sgemm with as many OpenBLAS threads;
 *   shapes   each matrix product of a model's layer at a chunk's size through every path
 *            (microkernels per instruction set, OpenBLAS inside the pool), against sgemm on
 *            the same shape with f32 weights; and the one-token products' memory bandwidth;
 *   engine   a prefill of the tokens in a file (and optionally greedy decode steps), with the
 *            engine's own split of time and work between products and attention;
 *   synth    products on random weights of given types and shapes, no model needed: by
 *            default one layer of Qwen2.5-0.5B as its Q4_K_M file stores it (Q5_0 attention
 *            and gate/up, Q8_0 or Q5_0 values, Q4_K or Q6_K down, the Q8_0 output matrix),
 *            one token per instruction-set path and a prefill chunk, with the whole model's
 *            one-token product time extrapolated from the per-layer figures;
 *   sampler  the host's share of one sampled token with its signals: the whole sampler on a CPU
 *            context's logits, against the draw alone from a pass's candidates (what a GPU
 *            context's host does after the device's pass), the two interleaved.
 * Prints logfmt lines; figures are medians of --reps runs. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "bench/peak_loops.h"
#include "bench/stats.h"
#include "kernels/cpu/cpu.h"
#include "kernels/dequant.h"
#include "kernels/f16.h"
#include "model/engine.h"
#include "model/kvpool.h"
#include "model/gguf.h"
#include "model/sampler.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* Wall-clock time by default; --clock cpu measures the process's CPU time instead (all
 * threads, spinning included), which other processes on a shared machine do not inflate. */
static clockid_t bench_clock = CLOCK_MONOTONIC;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(bench_clock, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* --- the instruction ceilings (loops in bench/peak_loops.c) --- */

struct FmaJob { double flop[256]; float sink[256]; int isa, kind; };   /* kind: 0 FMA, 1 VNNI, 2 AMX */

static void fma_task(void *ctx, int task, int thread)
{
    struct FmaJob *j = ctx;
    (void)thread;
#if defined(__x86_64__) && defined(__GNUC__)
    j->flop[task] = j->kind == 1 ? peak_vnni(&j->sink[task])
                    : j->kind == 2 ? peak_amx_bf16(&j->sink[task])
                    : j->isa == CPU_ISA_AVX512 ? peak_fma_avx512(&j->sink[task])
                                               : peak_fma_avx2(&j->sink[task]);
#else
    j->flop[task] = 0;
#endif
}

/* GFLOP/s (or int8 GOPS) of kind 0 (f32 FMA), 1 (VNNI) or 2 (AMX bf16); 0 where the processor
 * lacks it. */
static double fma_peak(struct ThreadPool *pool, int threads, int kind)
{
    struct FmaJob j = {.isa = cpu_isa_supported(CPU_ISA_AVX512) ? CPU_ISA_AVX512 : CPU_ISA_AVX2,
                       .kind = kind};
    if (!cpu_isa_supported(CPU_ISA_AVX2)) return 0;
    if (kind == 1 && !cpu_q8_vnni()) return 0;
    if (kind == 2 && !cpu_amx_usable_once()) return 0;
    double t = now_s();
    pool_run(pool, threads, fma_task, &j);
    t = now_s() - t;
    double f = 0;
    for (int i = 0; i < threads; i++) f += j.flop[i];
    return f / t / 1e9;
}

static double sgemm_peak(int threads)
{
    enum { N = 2048 };
    float *a = malloc(sizeof(float) * N * N), *b = malloc(sizeof(float) * N * N),
          *c = malloc(sizeof(float) * N * N);
    if (!a || !b || !c) { free(a); free(b); free(c); return 0; }
    for (size_t i = 0; i < (size_t)N * N; i++) { a[i] = (float)(i % 7) * 1e-3f; b[i] = (float)(i % 5) * 1e-3f; }
    openblas_set_num_threads(threads);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.f, a, N, b, N, 0.f, c, N);
    double t = now_s();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.f, a, N, b, N, 0.f, c, N);
    t = now_s() - t;
    free(a); free(b); free(c);
    return 2.0 * N * N * N / t / 1e9;
}

static void run_peaks(int threads, int reps)
{
    struct ThreadPool *pool = NULL;
    if (pool_new(threads, &pool) != 0) { fprintf(stderr, "bench_kernels: no threads\n"); return; }
    double f[64], s[64], v[64], x[64];
    if (reps > 64) reps = 64;
    /* All FMA runs first: after an sgemm OpenBLAS's threads spin for a while on our cores. */
    for (int r = 0; r < reps; r++) f[r] = fma_peak(pool, threads, 0);
    for (int r = 0; r < reps; r++) v[r] = fma_peak(pool, threads, 1);
    for (int r = 0; r < reps; r++) x[r] = fma_peak(pool, threads, 2);
    for (int r = 0; r < reps; r++) s[r] = sgemm_peak(threads);
    printf("peaks: threads=%d fma_isa=%s fma_gflops=%.1f vnni_gops=%.1f amx_bf16_gflops=%.1f "
           "sgemm_gflops=%.1f openblas_coretype=%s\n",
           threads, cpu_isa_supported(CPU_ISA_AVX512) ? "avx512" : "avx2", median(f, reps),
           median(v, reps), median(x, reps), median(s, reps),
           getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "auto");
    pool_destroy(&pool);
}

/* --- products on the model's shapes --- */

struct Shape { const char *name; struct MatmulArgs a; };

static double time_matmul(enum CpuIsa isa, enum CpuGemm gemm, struct ThreadPool *pool,
                          const struct MatmulArgs *a, void *scratch, int reps)
{
    double t[64];
    if (reps > 64) reps = 64;
    cpu_matmul_with(isa, gemm, pool, a, scratch);
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        cpu_matmul_with(isa, gemm, pool, a, scratch);
        t[r] = now_s() - t0;
    }
    return median(t, reps);
}

static void run_shapes(const struct Model *m, int threads, int n, int reps)
{
    const struct ModelConfig *c = &m->cfg;
    const struct LayerWeights *w = &m->layers[0];
    int d = c->dim, F = c->ffn_dim, no = c->n_head * c->head_dim;
    int kmax = F > d ? F : d;
    kmax = no > kmax ? no : kmax;
    size_t big = (size_t)n * (F > 3 * d ? F : 3 * d) + 64;
    float *x = malloc(sizeof(float) * (size_t)n * kmax), *y = calloc(big, 4 * sizeof(float));
    size_t ss = cpu_matmul_scratch(n, kmax, threads);
    void *scratch = malloc(ss);
    struct ThreadPool *pool = NULL;
    if (!x || !y || !scratch || pool_new(threads, &pool) != 0) {
        fprintf(stderr, "bench_kernels: out of memory\n");
        goto out;
    }
    for (size_t i = 0; i < (size_t)n * kmax; i++) x[i] = (float)((i * 7919) % 1000) / 1000.f - 0.5f;
    int diff = c->arch == ARCH_DIFFV2;
    int nq = c->n_q_head * c->head_dim, nkv = c->n_kv_head * c->head_dim;
    struct Shape shapes[] = {
        {"qkv", {.x = x, .x_stride = (size_t)d, .n = n, .k = d, .n_out = diff ? 4 : 3,
                 .out = {{&w->wq, y, (size_t)nq, 0}, {&w->wk, y + (size_t)n * nq, (size_t)nkv, 0},
                         {&w->wv, y + (size_t)n * (nq + nkv), (size_t)nkv, 0},
                         {&w->wlambda, y + (size_t)n * (nq + 2 * nkv), (size_t)c->n_head, 0}}}},
        {"attn_out", {.x = x, .x_stride = (size_t)no, .n = n, .k = no, .n_out = 1,
                      .out = {{&w->wo, y, (size_t)d, 1}}}},
        {"gate_up", {.x = x, .x_stride = (size_t)d, .n = n, .k = d, .n_out = 2, .swiglu = 1,
                     .out = {{&w->w_gate, y, (size_t)F, 0}, {&w->w_up, NULL, 0, 0}}}},
        {"down", {.x = x, .x_stride = (size_t)F, .n = n, .k = F, .n_out = 1,
                  .out = {{&w->w_down, y, (size_t)d, 1}}}},
    };
    /* First, before any OpenBLAS call leaves its threads spinning on our cores. */
    /* One token: the products of a whole forward pass read every weight once. */
    {
        double t[64];
        int nr = reps > 64 ? 64 : reps;
        size_t bytes = 0;
        for (int r = 0; r <= nr; r++) {
            double t0 = now_s();
            for (int l = 0; l < c->n_layer; l++) {
                const struct LayerWeights *lw = &m->layers[l];
                struct MatmulArgs qa = {.x = x, .x_stride = (size_t)d, .n = 1, .k = d,
                    .n_out = diff ? 4 : 3,
                    .out = {{&lw->wq, y, 0, 0}, {&lw->wk, y + nq, 0, 0}, {&lw->wv, y + nq + nkv, 0, 0},
                            {&lw->wlambda, y + nq + 2 * nkv, 0, 0}}};
                struct MatmulArgs oa = {.x = x, .x_stride = (size_t)no, .n = 1, .k = no, .n_out = 1,
                    .out = {{&lw->wo, y, 0, 1}}};
                struct MatmulArgs ga = {.x = x, .x_stride = (size_t)d, .n = 1, .k = d, .n_out = 2,
                    .swiglu = 1, .out = {{&lw->w_gate, y, 0, 0}, {&lw->w_up, NULL, 0, 0}}};
                struct MatmulArgs da = {.x = x, .x_stride = (size_t)F, .n = 1, .k = F, .n_out = 1,
                    .out = {{&lw->w_down, y, 0, 1}}};
                const struct MatmulArgs *all[4] = {&qa, &oa, &ga, &da};
                for (int i = 0; i < 4; i++) {
                    cpu_matmul_with(cpu_isa_best(), cpu_gemm_default(), pool, all[i], scratch);
                    if (r == 0)
                        for (int o = 0; o < all[i]->n_out; o++)
                            bytes += all[i]->out[o].w->row_bytes * (size_t)all[i]->out[o].w->rows;
                }
            }
            struct MatmulArgs lm = {.x = x, .x_stride = (size_t)d, .n = 1, .k = d, .n_out = 1,
                                    .out = {{&m->output, y, 0, 0}}};
            float *logits = malloc(sizeof(float) * (size_t)c->vocab);
            if (logits) {
                lm.out[0].y = logits;
                cpu_matmul_with(cpu_isa_best(), cpu_gemm_default(), pool, &lm, scratch);
                free(logits);
            }
            if (r == 0) bytes += m->output.row_bytes * (size_t)m->output.rows;
            if (r) t[r - 1] = now_s() - t0;
        }
        double tm = median(t, nr);
        printf("matvec: threads=%d weight_mb=%.1f ms_per_token=%.2f gb_s=%.1f\n", threads,
               bytes / 1048576.0, tm * 1e3, bytes / tm / 1e9);
    }
    double tot_flop = 0, tot_best = 0, tot_blas = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        const struct MatmulArgs *a = &shapes[i].a;
        double flop = 0;
        int m_all = 0;
        for (int o = 0; o < a->n_out; o++) { flop += 2.0 * n * a->k * a->out[o].w->rows; m_all += a->out[o].w->rows; }
        printf("shape: name=%s n=%d k=%d m=%d type=%s", shapes[i].name, n, a->k, m_all,
               ggml_type_name(a->out[0].w->type));
        double best = 1e30;
        for (int isa = CPU_ISA_COUNT - 1; isa >= 0; isa--) {
            if (!cpu_isa_supported((enum CpuIsa)isa)) continue;
            if (isa == CPU_ISA_SCALAR) continue; /* too slow to be a candidate */
            double t = time_matmul((enum CpuIsa)isa, CPU_GEMM_NATIVE, pool, a, scratch, reps);
            printf(" native_%s_gflops=%.1f", cpu_isa_name((enum CpuIsa)isa), flop / t / 1e9);
            if (t < best) best = t;
        }
        for (int isa = CPU_ISA_COUNT - 1; isa > 0; isa--) {
            if (!cpu_isa_supported((enum CpuIsa)isa) || (int)cpu_q8_kernel((enum CpuIsa)isa) != isa)
                continue;
            double tq = time_matmul((enum CpuIsa)isa, CPU_GEMM_Q8, pool, a, scratch, reps);
            printf(" q8_%s_gflops=%.1f", cpu_isa_name((enum CpuIsa)isa), flop / tq / 1e9);
            if (tq < best) best = tq;
        }
        double tb = time_matmul(cpu_isa_best(), CPU_GEMM_OPENBLAS, pool, a, scratch, reps);
        printf(" openblas_in_pool_gflops=%.1f", flop / tb / 1e9);
        if (tb < best) best = tb;
        /* Plain multi-threaded sgemm on f32 copies of the same weights. */
        float *wf = malloc(sizeof(float) * (size_t)m_all * a->k);
        if (wf) {
            int r0 = 0;
            for (int o = 0; o < a->n_out; o++) {
                cpu_decode_rows(a->out[o].w, 0, a->out[o].w->rows, wf + (size_t)r0 * a->k);
                r0 += a->out[o].w->rows;
            }
            openblas_set_num_threads(threads);
            double ts[64];
            int nr = reps > 64 ? 64 : reps;
            for (int r = 0; r <= nr; r++) {
                double t0 = now_s();
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m_all, a->k, 1.f, x,
                            (int)a->x_stride, wf, a->k, 0.f, y, m_all);
                if (r) ts[r - 1] = now_s() - t0;
            }
            double t = median(ts, nr);
            printf(" sgemm_f32_gflops=%.1f", flop / t / 1e9);
            /* Let OpenBLAS's threads stop spinning before the next shape's runs. */
            openblas_set_num_threads(1);
            usleep(300000);
            tot_blas += t;
            free(wf);
        }
        printf(" best_gflops=%.1f\n", flop / best / 1e9);
        tot_flop += flop;
        tot_best += best;
    }
    printf("shapes: threads=%d n=%d default_path=%s/%s best_gflops=%.1f sgemm_f32_gflops=%.1f\n",
           threads, n, cpu_isa_name(cpu_isa_best()),
           cpu_gemm_default() == CPU_GEMM_NATIVE ? "native"
           : cpu_gemm_default() == CPU_GEMM_Q8  ? "q8"
                                                : "openblas",
           tot_flop / tot_best / 1e9,
           tot_blas > 0 ? tot_flop / tot_blas / 1e9 : 0.0);

out:
    pool_destroy(&pool);
    free(x);
    free(y);
    free(scratch);
}

/* --- products on synthetic weights --- */

static unsigned long long synth_rng = 0x2545f4914f6cdd1dULL;

static unsigned synth_rnd(void)
{
    synth_rng = synth_rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(synth_rng >> 33);
}

/* Random bytes with every f16 field of the block a small positive scale (where the fields sit
 * depends on the type; kernels/dequant.h). */
static void synth_blocks(uint32_t type, uint8_t *p, size_t n_blocks)
{
    int bb = dequant_block_bytes(type);
    int at[2] = {-1, -1};
    switch (type) {
    case DQ_Q4_1: case DQ_Q5_1: case DQ_Q4_K: case DQ_Q5_K: at[0] = 0; at[1] = 2; break;
    case DQ_Q2_K: at[0] = 80; at[1] = 82; break;
    case DQ_Q3_K: at[0] = 108; break;
    case DQ_Q6_K: at[0] = 208; break;
    default: at[0] = 0; break;
    }
    for (size_t b = 0; b < n_blocks; b++, p += bb) {
        for (int i = 0; i < bb; i++) p[i] = (uint8_t)synth_rnd();
        if (type == DQ_F32 || type == DQ_F16 || type == DQ_BF16) {
            uint16_t h = type == DQ_BF16 ? f32_to_bf16(0.01f) : f32_to_f16(0.01f);
            if (type == DQ_F32) { float f = 0.01f; memcpy(p, &f, 4); }
            else memcpy(p, &h, 2);
            continue;
        }
        for (int f = 0; f < 2; f++)
            if (at[f] >= 0) {
                uint16_t h = f32_to_f16(0.001f + 0.001f * (float)(synth_rnd() % 100) / 100.f);
                memcpy(p + at[f], &h, 2);
            }
    }
}

struct SynthMat { struct Weights w; void *data; };

static int synth_mat(struct SynthMat *s, uint32_t type, int rows, int cols)
{
    size_t n_blocks = (size_t)rows * cols / dequant_block_elems(type);
    uint8_t *src = malloc(n_blocks * dequant_block_bytes(type));
    size_t bytes = cpu_weights_bytes(type, rows, cols);
    s->data = bytes ? aligned_alloc(64, (bytes + 63) & ~(size_t)63) : NULL;
    if (!src || !s->data) { free(src); free(s->data); s->data = NULL; return -1; }
    synth_blocks(type, src, n_blocks);
    cpu_weights_pack(type, rows, cols, src, s->data, &s->w);
    free(src);
    return 0;
}

static uint32_t type_by_name(const char *name)
{
    for (uint32_t t = 0; t < 40; t++)
        if (dequant_block_elems(t) && !strcasecmp(ggml_type_name(t), name)) return t;
    return UINT32_MAX;
}

/* One product (or a gate/up SwiGLU pair) of a synthetic layer. */
struct SynthProduct {
    const char *name;
    uint32_t type;
    int k, m, pair;      /* pair: gate and up as one SwiGLU product */
    double per_model;    /* how many of these one forward pass runs */
};

static void run_synth(int threads, int n, int reps, const char *only_type, int only_k, int only_m)
{
    /* Qwen2.5-Coder-0.5B-Instruct Q4_K_M: 24 layers, d 896, 14 q / 2 kv heads of 64, ffn 4864;
     * v is Q8_0 in 12 layers and Q5_0 in the others, down Q6_K in 12 and Q4_K in 12. */
    struct SynthProduct qwen[] = {
        {"q", DQ_Q5_0, 896, 896, 0, 24}, {"k", DQ_Q5_0, 896, 128, 0, 24},
        {"v_q8", DQ_Q8_0, 896, 128, 0, 12}, {"v_q5", DQ_Q5_0, 896, 128, 0, 12},
        {"o", DQ_Q5_0, 896, 896, 0, 24}, {"gate_up", DQ_Q5_0, 896, 4864, 1, 24},
        {"down_q4k", DQ_Q4_K, 4864, 896, 0, 12}, {"down_q6k", DQ_Q6_K, 4864, 896, 0, 12},
        {"output", DQ_Q8_0, 896, 151936, 0, 1},
    };
    struct SynthProduct one = {"product", 0, only_k, only_m, 0, 1};
    struct SynthProduct *set = qwen;
    int n_set = (int)(sizeof qwen / sizeof *qwen);
    if (only_type) {
        one.type = type_by_name(only_type);
        if (one.type == UINT32_MAX || !cpu_weights_bytes(one.type, only_m, only_k)) {
            fprintf(stderr, "bench_kernels: type %s with k=%d m=%d is not handled\n", only_type,
                    only_k, only_m);
            return;
        }
        set = &one;
        n_set = 1;
    }
    int kmax = 4864;
    for (int i = 0; i < n_set; i++) kmax = set[i].k > kmax ? set[i].k : kmax;
    size_t ymax = (size_t)n * 151936;
    float *x = malloc(sizeof(float) * (size_t)n * kmax), *y = malloc(sizeof(float) * ymax);
    void *scratch = malloc(cpu_matmul_scratch(n, kmax, threads));
    struct ThreadPool *pool = NULL;
    if (!x || !y || !scratch || pool_new(threads, &pool) != 0) {
        fprintf(stderr, "bench_kernels: out of memory\n");
        goto out;
    }
    for (size_t i = 0; i < (size_t)n * kmax; i++) x[i] = (float)((i * 7919) % 1000) / 1000.f - 0.5f;
    double model_s[CPU_ISA_COUNT] = {0}, model_prefill_s = 0;
    for (int i = 0; i < n_set; i++) {
        const struct SynthProduct *p = &set[i];
        struct SynthMat a = {0}, b = {0};
        if (synth_mat(&a, p->type, p->m, p->k) || (p->pair && synth_mat(&b, p->type, p->m, p->k))) {
            fprintf(stderr, "bench_kernels: out of memory\n");
            free(a.data);
            goto out;
        }
        struct MatmulArgs args = {.x = x, .x_stride = (size_t)p->k, .n = 1, .k = p->k,
                                  .n_out = p->pair ? 2 : 1, .swiglu = p->pair,
                                  .out = {{&a.w, y, (size_t)p->m, 0}, {&b.w, NULL, 0, 0}}};
        double bytes = (double)a.w.row_bytes * p->m * (p->pair ? 2 : 1);
        double flop1 = 2.0 * p->k * p->m * (p->pair ? 2 : 1);
        printf("synth: name=%s type=%s k=%d m=%d threads=%d", p->name, ggml_type_name(p->type),
               p->k, p->m, threads);
        for (int isa = CPU_ISA_COUNT - 1; isa >= 0; isa--) {
            if (!cpu_isa_supported((enum CpuIsa)isa)) continue;
            double t = time_matmul((enum CpuIsa)isa, CPU_GEMM_NATIVE, pool, &args, scratch, reps);
            printf(" decode_%s_us=%.1f decode_%s_gb_s=%.1f", cpu_isa_name((enum CpuIsa)isa),
                   t * 1e6, cpu_isa_name((enum CpuIsa)isa), bytes / t / 1e9);
            model_s[isa] += t * p->per_model;
        }
        if (n > 1) {
            args.n = n;
            double t = time_matmul(cpu_isa_best(), cpu_gemm_default(), pool, &args, scratch, reps);
            printf(" prefill_n=%d prefill_gflops=%.1f", n, flop1 * n / t / 1e9);
            model_prefill_s += t * p->per_model;
        }
        printf("\n");
        free(a.data);
        free(b.data);
    }
    if (!only_type) {
        printf("synth_model: threads=%d", threads);
        for (int isa = CPU_ISA_COUNT - 1; isa >= 0; isa--)
            if (cpu_isa_supported((enum CpuIsa)isa) && model_s[isa] > 0)
                printf(" products_%s_ms_per_token=%.2f products_%s_tokens_s=%.1f",
                       cpu_isa_name((enum CpuIsa)isa), model_s[isa] * 1e3,
                       cpu_isa_name((enum CpuIsa)isa), 1.0 / model_s[isa]);
        if (n > 1)
            printf(" prefill_n=%d products_prefill_tokens_s=%.1f", n, n / model_prefill_s);
        printf("\n");
    }
out:
    pool_destroy(&pool);
    free(x);
    free(y);
    free(scratch);
}

/* --- attention on random data of the default model's shape --- */

static void run_attention(int threads, int ctx, int n_q_head, int reps, enum KvType kv)
{
    int n_kv = 3, hd = 64, chunk = 512 < ctx ? 512 : ctx;
    size_t stride = cpu_kv_head_stride(ctx, hd, kv), cache = stride * n_kv * kv_elem_bytes(kv);
    void *k = malloc(cache), *v = malloc(cache);
    float *q = malloc(sizeof(float) * (size_t)chunk * n_q_head * hd);
    float *out = malloc(sizeof(float) * (size_t)chunk * n_q_head * hd);
    float *row = malloc(sizeof(float) * 2 * n_kv * hd);
    size_t ss = cpu_attention_scratch(chunk, ctx, hd, n_q_head, n_kv, threads);
    void *scratch = malloc(ss);
    struct ThreadPool *pool = NULL;
    if (!k || !v || !q || !out || !row || !scratch || pool_new(threads, &pool) != 0) {
        fprintf(stderr, "bench_kernels: out of memory\n");
        goto out;
    }
    /* Random keys and values stored through the backend, as the engine stores them. */
    unsigned seed = 1;
    float no_rot[1] = {0};
    for (int pos = 0; pos < ctx; pos++) {
        for (int i = 0; i < 2 * n_kv * hd; i++) {
            seed = seed * 1103515245u + 12345u;
            row[i] = (float)((seed >> 16) & 1023) / 512.f - 1.f;
        }
        struct RopeStoreArgs rs = {
            .q = no_rot, .k = row, .v = row + n_kv * hd, .kv_stride = (size_t)n_kv * hd,
            .n_tok = 1, .pos0 = pos, .n_kv_head = n_kv, .head_dim = hd, .cos = no_rot,
            .sin = no_rot, .kcache = k, .vcache = v, .kv_type = kv, .kv_head_stride = stride,
        };
        backend_cpu.rope_store(NULL, &rs);
    }
    for (size_t i = 0; i < (size_t)chunk * n_q_head * hd; i++) q[i] = (float)(i % 97) / 48.f - 1.f;
    struct AttnArgs a = {
        .q = q, .q_stride = (size_t)n_q_head * hd, .out = out,
        .out_stride = (size_t)n_q_head * hd, .k = k, .v = v, .kv_head_stride = stride,
        .kv_type = kv, .n_tok = chunk, .pos0 = ctx - chunk, .n_q_head = n_q_head,
        .n_kv_head = n_kv, .head_dim = hd, .scale = 0.125f,
    };
    double flop = 0;
    for (int i = 0; i < chunk; i++) flop += 4.0 * (a.pos0 + i + 1) * hd * n_q_head;
    printf("attention: threads=%d ctx=%d q_heads=%d chunk=%d kv=%s", threads, ctx, n_q_head, chunk,
           kv == KV_F32 ? "f32" : kv == KV_F16 ? "f16" : "q8");
    /* The AMX path first (where it runs), then every f32 path. */
    for (int path = CPU_ISA_COUNT; path >= 0; path--) {
        int amx = path == CPU_ISA_COUNT, isa = amx ? CPU_ISA_AVX512 : path;
        if (!cpu_isa_supported((enum CpuIsa)isa)) continue;
        if (amx && !cpu_attn_amx_handles((enum CpuIsa)isa, kv, hd)) continue;
        double t[64];
        int nr = reps > 64 ? 64 : reps;
        if (isa == CPU_ISA_SCALAR) nr = 1;
        for (int r = 0; r < nr; r++) {
            double t0 = now_s();
            cpu_attention_with((enum CpuIsa)isa, amx, pool, &a, scratch);
            t[r] = now_s() - t0;
        }
        printf(" prefill_%s_gflops=%.1f", amx ? "amx" : cpu_isa_name((enum CpuIsa)isa),
               flop / median(t, nr) / 1e9);
    }
    /* One token at the end of the cache: flash-decoding over the whole context. */
    a.n_tok = 1;
    a.pos0 = ctx - 1;
    double t[64];
    int nr = reps > 64 ? 64 : reps;
    for (int r = 0; r < nr; r++) {
        double t0 = now_s();
        for (int i = 0; i < 10; i++) cpu_attention_with(cpu_isa_best(), cpu_attn_amx_default(), pool, &a, scratch);
        t[r] = (now_s() - t0) / 10;
    }
    double tm = median(t, nr), bytes = 2.0 * (double)cache * ctx / ((ctx + KV_TILE - 1) / KV_TILE * KV_TILE);
    printf(" decode_us=%.1f decode_gb_s=%.1f\n", tm * 1e6, bytes / tm / 1e9);
out:
    pool_destroy(&pool);
    free(k); free(v); free(q); free(out); free(row); free(scratch);
}

/* --- the engine --- */

static int read_tokens(const char *path, int32_t **ids, size_t *n)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t cap = 4096, k = 0;
    int32_t *v = malloc(cap * sizeof *v);
    long x;
    int ch;
    while (v) {
        if (fscanf(f, "%ld", &x) == 1) {
            if (k == cap) {
                int32_t *nv = realloc(v, (cap *= 2) * sizeof *v);
                if (!nv) { free(v); v = NULL; break; }
                v = nv;
            }
            v[k++] = (int32_t)x;
        } else if ((ch = fgetc(f)) == EOF) {
            break;
        }
    }
    fclose(f);
    if (!v) return -1;
    *ids = v;
    *n = k;
    return 0;
}

/* The tokens of a file (*n > 0) and the options of a context for them plus `extra` positions;
 * 1 after saying why not. */
static int bench_setup(const char *tokens_path, int threads, enum KvType kv, int extra,
                       int32_t **ids, size_t *n, struct EngineOpts *o)
{
    if (read_tokens(tokens_path, ids, n) != 0 || *n == 0) {
        fprintf(stderr, "bench_kernels: cannot read tokens from %s\n", tokens_path);
        free(*ids);
        *ids = NULL;
        return 1;
    }
    engine_opts_default(o);
    o->n_threads = threads;
    o->kv_type = kv;
    o->n_ctx = (int)*n + extra;
    return 0;
}

static int run_engine(const struct Model *m, const char *tokens_path, int threads, int chunk,
                      int n_decode, enum KvType kv)
{
    int32_t *ids = NULL;
    size_t n = 0;
    char err[512];
    struct EngineOpts o;
    /* the prompt, then one token per decode step: a prompt of the model's whole context
     * (32,768 for Qwen2.5) fits */
    if (bench_setup(tokens_path, threads, kv, n_decode, &ids, &n, &o))
        return 1;
    o.chunk = chunk;
    struct Engine *e = NULL;
    if (engine_new(m, &o, &e, err, sizeof err) != ENGINE_OK) {
        fprintf(stderr, "bench_kernels: %s\n", err);
        free(ids);
        return 1;
    }
    double t = now_s();
    int rc = engine_prefill(e, ids, n, err, sizeof err);
    double prefill_s = now_s() - t;
    struct EngineStats st;
    engine_stats(e, &st);
    double decode_s = 0;
    struct EngineStats ds = {0};
    engine_stats_reset(e);
    if (rc == ENGINE_OK && n_decode > 0) {
        t = now_s();
        for (int i = 0; i < n_decode && rc == ENGINE_OK; i++) {
            const float *lg = engine_logits(e);
            if (!lg) { rc = ENGINE_EDEVICE; break; }
            int best = 0;
            for (int v = 1; v < m->cfg.vocab; v++) if (lg[v] > lg[best]) best = v;
            rc = engine_decode(e, best, err, sizeof err);
        }
        decode_s = now_s() - t;
        engine_stats(e, &ds);
    }
    if (rc != ENGINE_OK) {
        fprintf(stderr, "bench_kernels: %s\n", err);
        engine_destroy(&e);
        free(ids);
        return 1;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double other = st.total_s - st.matmul_s - st.attention_s;
    printf("engine: tokens=%zu threads=%d prefill_tok_s=%.1f prefill_gflops=%.1f "
           "matmul_gflops=%.1f attention_gflops=%.1f matmul_s=%.3f attention_s=%.3f other_s=%.3f "
           "decode_tokens=%d decode_tok_s=%.1f decode_matmul_ms=%.2f decode_attention_ms=%.2f "
           "peak_rss_mb=%.1f\n",
           n, threads, n / prefill_s, (st.matmul_flop + st.attention_flop) / prefill_s / 1e9,
           st.matmul_s > 0 ? st.matmul_flop / st.matmul_s / 1e9 : 0.0,
           st.attention_s > 0 ? st.attention_flop / st.attention_s / 1e9 : 0.0, st.matmul_s,
           st.attention_s, other, n_decode, decode_s > 0 ? n_decode / decode_s : 0.0,
           n_decode ? ds.matmul_s * 1e3 / n_decode : 0.0,
           n_decode ? ds.attention_s * 1e3 / n_decode : 0.0, ru.ru_maxrss / 1024.0);
    engine_destroy(&e);
    free(ids);
    return 0;
}

/* --- batched decode: B sequences stepping together against one at a time --- */

/* B sequences of one runner, each prefilled with the tokens rotated by a different offset (so
 * that no prefix is shared), then n_decode greedy steps: first each sequence alone, then all B
 * in one engine_step per token. Prints the tokens/s of both and checks that the batched steps
 * chose the same tokens. */
static int run_batch(const struct Model *m, const char *tokens_path, int threads, int batch,
                     int n_decode, enum KvType kv)
{
    int32_t *ids = NULL;
    size_t n = 0;
    char err[512] = "";
    struct EngineOpts o;
    if (bench_setup(tokens_path, threads, kv, n_decode + 1, &ids, &n, &o))
        return 1;
    struct Engine *run = NULL;
    struct KvPool *pool = NULL;
    struct Engine **seq = calloc((size_t)batch, sizeof *seq);
    int32_t *prompt = malloc(n * sizeof *prompt), *alone = malloc((size_t)batch * n_decode * sizeof *alone);
    struct EngineBatchItem *items = calloc((size_t)batch, sizeof *items);
    int32_t *next = calloc((size_t)batch, sizeof *next);
    int rc = !seq || !prompt || !alone || !items || !next;
    if (!rc && kvpool_new(m, kv, (size_t)(batch + 1) * kvpool_pages_for(o.n_ctx), 0, &pool, err,
                          sizeof err) != 0)
        rc = 1;
    o.kv_pool = pool;
    if (!rc && engine_new(m, &o, &run, err, sizeof err) != ENGINE_OK) rc = 1;
    for (int b = 0; b < batch && !rc; b++)
        if (engine_new_seq(run, &seq[b], err, sizeof err) != ENGINE_OK) rc = 1;
    double alone_s = 0, batch_s = 0;
    struct EngineStats st;
    for (int pass = 0; pass < 2 && !rc; pass++) {
        for (int b = 0; b < batch && !rc; b++) {
            engine_reset(seq[b]);
            for (size_t i = 0; i < n; i++) prompt[i] = ids[(i + (size_t)b * 97) % n];
            if (engine_prefill(seq[b], prompt, n, err, sizeof err) != ENGINE_OK) rc = 1;
        }
        engine_stats_reset(run);
        double t = now_s();
        for (int s = 0; s < n_decode && !rc; s++) {
            for (int b = 0; b < batch; b++) {
                const float *lg = engine_logits(seq[b]);
                int best = 0;
                for (int v = 1; v < m->cfg.vocab; v++) if (lg[v] > lg[best]) best = v;
                next[b] = best;
                if (pass == 0) alone[(size_t)b * n_decode + s] = best;
                else if (alone[(size_t)b * n_decode + s] != best) {
                    fprintf(stderr, "bench_kernels: sequence %d step %d: batched token %d, alone %d\n",
                            b, s, best, alone[(size_t)b * n_decode + s]);
                    rc = 1;
                }
                items[b] = (struct EngineBatchItem){.seq = seq[b], .tokens = &next[b], .n = 1,
                                                    .logits = 1};
            }
            if (pass == 0) {
                for (int b = 0; b < batch && !rc; b++)
                    if (engine_decode(seq[b], next[b], err, sizeof err) != ENGINE_OK) rc = 1;
            } else if (!rc && engine_step(run, items, batch, NULL, err, sizeof err) != ENGINE_OK) {
                rc = 1;
            }
        }
        *(pass ? &batch_s : &alone_s) = now_s() - t;
        engine_stats(run, &st);
        if (!rc)
            printf("batch: mode=%s sequences=%d depth=%zu steps=%d tok_s=%.1f matmul_ms_per_step=%.2f "
                   "attention_ms_per_step=%.2f\n", pass ? "together" : "alone", batch, n, n_decode,
                   batch * n_decode / (pass ? batch_s : alone_s),
                   st.matmul_s * 1e3 / n_decode, st.attention_s * 1e3 / n_decode);
    }
    if (!rc) printf("batch: together/alone=%.2fx tokens_equal=1\n", alone_s / batch_s);
    else if (err[0]) fprintf(stderr, "bench_kernels: %s\n", err);
    for (int b = 0; b < batch; b++) if (seq[b]) engine_destroy(&seq[b]);
    engine_destroy(&run);
    kvpool_destroy(&pool);
    free(seq); free(prompt); free(alone); free(items); free(next); free(ids);
    return rc;
}

/* --- sampling: the host's share of a token --- */

static void run_sampler(int n, int reps)
{
    static const struct { const char *name; struct SamplerParams p; } set[] = {
        {"greedy", {0.f, 40, 0.95f, 0.05f, 1}},
        {"T0.8_topk40_topp0.95_minp0.05", {0.8f, 40, 0.95f, 0.05f, 2}},
        {"T0.8_minp0.05", {0.8f, 0, 1.f, 0.05f, 3}},
    };
    float *l = malloc((size_t)n * sizeof *l);
    struct SampleCand *saved = malloc((size_t)n * sizeof *saved);
    double *tf = malloc((size_t)reps * sizeof *tf), *td = malloc((size_t)reps * sizeof *td);
    if (!l || !saved || !tf || !td) exit(1);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        l[i] = (float)((double)(x >> 11) * 0x1.0p-53 * 24.0 - 12.0);
    }
    for (size_t si = 0; si < sizeof set / sizeof *set; si++) {
        struct Sampler *a, *b;
        if (sampler_new(&set[si].p, n, &a) || sampler_new(&set[si].p, n, &b)) exit(1);
        struct SamplePass pass;
        sampler_pass(b, l, 1, &pass);
        memcpy(saved, pass.cand, (size_t)pass.n_cand * sizeof *saved);
        volatile int32_t sink = 0;
        for (int r = 0; r < reps; r++) {
            struct TokenSignal sig;
            double t0 = now_s();
            sink += sampler_sample(a, l, &sig);
            double t1 = now_s();
            memcpy(pass.cand, saved, (size_t)pass.n_cand * sizeof *saved);
            double t2 = now_s();
            sink += sampler_finish(b, &pass, &sig);
            td[r] = now_s() - t2;
            tf[r] = t1 - t0;
        }
        printf("bench=sampler setting=%s n_vocab=%d candidates=%d host_pass_and_draw_ms=%.4f "
               "draw_alone_ms=%.4f reps=%d\n", set[si].name, n, pass.n_cand,
               median(tf, reps) * 1e3, median(td, reps) * 1e3, reps);
        sampler_destroy(&a);
        sampler_destroy(&b);
    }
    free(l);
    free(saved);
    free(tf);
    free(td);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_kernels peaks [--threads N] [--reps R]\n"
            "       bench_kernels shapes -m MODEL [--threads N] [--n ROWS] [--reps R]\n"
            "       bench_kernels attention [--ctx N] [--q-heads 9|18] [--threads N] [--reps R]\n"
            "       bench_kernels sampler [--n VOCAB] [--reps R]\n"
            "       bench_kernels synth [--type T --k K --m M] [--n ROWS] [--threads N] [--reps R]\n"
            "       bench_kernels engine -m MODEL --tokens-file F [--threads N] [--chunk C]\n"
            "                            [--decode N] [--kv f16|f32|q8]\n"
            "       bench_kernels batch -m MODEL --tokens-file F [--batch B] [--decode N]\n"
            "                            [--threads N] [--kv f16|f32|q8]\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) { usage(); return 2; }
    const char *mode = argv[1], *model_path = NULL, *tokens = NULL, *synth_type = NULL;
    int synth_k = 0, synth_m = 0;
    int threads = 2, batch = 16, reps = 5, n = 512, chunk = 512, n_decode = 0, ctx = 2048, q_heads = 9;
    enum KvType kv = KV_F16;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { usage(); return 2; }
        if (!strcmp(a, "-m")) model_path = v;
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--reps")) reps = atoi(v);
        else if (!strcmp(a, "--n")) n = atoi(v);
        else if (!strcmp(a, "--chunk")) chunk = atoi(v);
        else if (!strcmp(a, "--decode")) n_decode = atoi(v);
        else if (!strcmp(a, "--batch")) batch = atoi(v);
        else if (!strcmp(a, "--ctx")) ctx = atoi(v);
        else if (!strcmp(a, "--clock")) bench_clock = !strcmp(v, "cpu") ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC;
        else if (!strcmp(a, "--q-heads")) q_heads = atoi(v);
        else if (!strcmp(a, "--tokens-file")) tokens = v;
        else if (!strcmp(a, "--type")) synth_type = v;
        else if (!strcmp(a, "--k")) synth_k = atoi(v);
        else if (!strcmp(a, "--m")) synth_m = atoi(v);
        else if (!strcmp(a, "--kv")) {
            if (!strcmp(v, "f32")) kv = KV_F32;
            else if (!strcmp(v, "q8")) kv = KV_Q8;
            else if (!strcmp(v, "f16")) kv = KV_F16;
            else { fprintf(stderr, "bench_kernels: --kv must be f16, f32 or q8\n"); return 2; }
        }
        else { usage(); return 2; }
        i++;
    }
    if (threads < 1 || threads > 256 || reps < 1 || n < 1 || chunk < 1 || n_decode < 0 ||
        ctx < 1 || q_heads < 3 || q_heads % 3) {
        usage();
        return 2;
    }
    if (!strcmp(mode, "peaks")) {
        run_peaks(threads, reps);
        return 0;
    }
    if (!strcmp(mode, "attention")) {
        run_attention(threads, ctx, q_heads, reps, kv);
        return 0;
    }
    if (!strcmp(mode, "synth")) {
        if (synth_type && (synth_k < 1 || synth_m < 1)) { usage(); return 2; }
        run_synth(threads, n, reps, synth_type, synth_k, synth_m);
        return 0;
    }
    if (!strcmp(mode, "sampler")) {
        run_sampler(n, reps);
        return 0;
    }
    if (!model_path) { usage(); return 2; }
    char err[512];
    struct Model *m = NULL;
    if (model_load(model_path, &m, err, sizeof err) != MODEL_OK) {
        fprintf(stderr, "bench_kernels: %s\n", err);
        return 1;
    }
    int rc = 0;
    if (!strcmp(mode, "shapes")) run_shapes(m, threads, n, reps);
    else if (!strcmp(mode, "engine") && tokens) rc = run_engine(m, tokens, threads, chunk, n_decode, kv);
    else if (!strcmp(mode, "batch") && tokens && batch >= 1 && n_decode >= 1)
        rc = run_batch(m, tokens, threads, batch, n_decode, kv);
    else { usage(); rc = 2; }
    model_destroy(&m);
    return rc;
}
