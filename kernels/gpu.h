/* The GPU backend's interface: a table of device operations that model/engine_gpu.c drives.
 * The CUDA implementation (the .cu files of kernels/cuda, CUDA C + cuBLAS) is built as its own shared
 * object, libdiffrag_cuda.so, and loaded with dlopen only when a context asks for a GPU, so
 * the CPU-only programs never link or load CUDA (gpu_api_load in kernels/gpu_load.c).
 *
 * Every operation is asynchronous on its context's stream; gpu_sync reports the first error
 * of any of them. A context (struct GpuCtx) owns its stream, cuBLAS handle and workspace:
 * nothing is kept at file scope, so each daemon worker opens its own.
 *
 * Device data: activations f32 or bf16 (uint16_t here), row-major, rows are tokens. Weights
 * bf16, (rows = outputs, cols = inputs), uploaded once. The KV cache lives in pages of
 * GPU_PAGE positions from one pool (model/engine_gpu.c; its bookkeeping: model/kvpool.h): page
 * p holds, for every layer l, kind c (0 keys, 1 values) and KV head g, GPU_PAGE rows of
 * head_dim bf16 at element ((l * 2 + c) * n_kv_head + g) * GPU_PAGE * head_dim of the page. A
 * sequence's page table maps its position tile t (positions t*GPU_PAGE..) to a page. */
#ifndef DIFFRAG_GPU_H
#define DIFFRAG_GPU_H

#include <stddef.h>
#include <stdint.h>

#define GPU_PAGE 64
#define GPU_API_VERSION 5

struct GpuCtx;

/* The biases added to q, k and v (when bias != NULL), RoPE on q and k (f32, read from the
 * fused q|k|v|lambda projection rows), then q as bf16 into q_out and k, v as bf16 into the
 * sequence's pages at positions pos0.. */
struct GpuRopeArgs {
    const float *qkv;          /* (n_tok, qkv_stride): q at col 0, k at nq, v at nq + nkv */
    int qkv_stride;
    const float *bias;         /* (nq + 2 nkv) f32, device: q|k|v biases (qwen2), or NULL */
    uint16_t *q_out;           /* (n_tok, n_q_head*head_dim) bf16 */
    int n_tok, pos0, n_q_head, n_kv_head, head_dim;
    int n_rot, layout;         /* as struct RopeStoreArgs */
    const float *cos, *sin;    /* (n_tok, n_rot/2), device */
    void *pool;                /* page pool base */
    const int32_t *pages;      /* device page table of the sequence */
    size_t page_elems;         /* bf16 elements per page */
    int layer;
};

/* Causal attention of n_tok queries at positions pos0.. against the sequence's cached keys
 * 0..pos0+n_tok-1. DIFF V2 when lambda != NULL: query heads 2i, 2i+1 combine to output head
 * i as o_2i - sigmoid(lambda[t][i]) * o_2i+1 inside the kernel. */
struct GpuAttnArgs {
    const uint16_t *q;         /* (n_tok, n_q_head*head_dim) bf16, after RoPE */
    uint16_t *out;             /* (n_tok, n_out_head*head_dim) bf16 */
    const void *pool;
    const int32_t *pages;
    size_t page_elems;
    int pool_pages;            /* pages in the pool (the bounds of the TMA kernels' tensor map) */
    int layer;
    int n_tok, pos0, n_q_head, n_kv_head, head_dim;
    float scale;
    const float *lambda;       /* (n_tok, lambda_stride) f32 logits, or NULL */
    int lambda_stride;
    /* Groundedness accumulators (decode path, and the last query of a prefill chunk): when
     * mass != NULL, for every query head h of the last query token, the softmax mass on the
     * positions j < n_marked with cls[j] == 1 (mass[2h]) and on j >= n_marked (mass[2h+1]). */
    const uint8_t *cls;        /* device (n_ctx) */
    int n_marked;
    float *mass;               /* device (n_q_head, 2) */
    /* Kernels: 0 the tensor-core ones with scores in registers (mma.sync; default), 1 the
     * first forms (prefill: WMMA through shared memory; decode: one key at a time per warp),
     * kept as a cross-check, 2 the Hopper prefill kernel (wgmma; decode as 0) and 3 its
     * pipelined form, 4 and 5 the same two fed by TMA from a producer warp (warp-specialised),
     * which fall back to 0 on a device other than compute capability 9.0. */
    int kernel;
};

/* Sampling's pass over the last logits (kernels/cuda/sample.cu): one block finds the largest
 * logit, the summaries the per-token signals need, and the candidates a draw can choose, so
 * that only those leave the device (model/sampler.h, struct SamplePass, says what each is). */
enum { GPU_SAMPLE_GREEDY = 0, GPU_SAMPLE_TOP_K = 1, GPU_SAMPLE_FLOOR = 2, GPU_SAMPLE_MASS = 3 };
struct GpuSampleHead {
    int32_t best, n_cand;
    float mx, second;
    double z1, ez1, zt;
};
struct GpuCand { int32_t id; float w, logit; };
struct GpuSampleArgs {
    const float *logits;       /* (n) f32, device */
    int n;
    int mode;                  /* GPU_SAMPLE_*: which candidates, with w_i = exp((x_i - max) *
                                  inv_temp): the k largest (ties: lower ids), every w >= floor,
                                  or the fewest largest reaching mass * sum(w) and their ties */
    float inv_temp, floor, mass;
    int k;
    float *work;               /* (n) f32 device scratch (the w) */
    struct GpuSampleHead *head; /* device: the head, then up to n struct GpuCand right after it
                                  (those above the boundary in id order, then the
                                  boundary's ties in id order) */
};

struct GpuApi {
    int version;               /* GPU_API_VERSION */
    const char *build;         /* what the library was built with, e.g. "CUDA 13.0, sm_90a + PTX" */
    /* Visible devices (0 when none or no driver; never fails). */
    int (*device_count)(void);
    /* One line naming device `dev`: name, memory, multiprocessors, compute capability. */
    int (*device_info)(int dev, char *buf, size_t len, size_t *free_bytes, size_t *total_bytes);

    int (*ctx_new)(int dev, struct GpuCtx **out, char *err, size_t errlen);
    void (*ctx_destroy)(struct GpuCtx *c);
    /* Waits for the context's work; 0, or -1 with the first error since the last sync. */
    int (*sync)(struct GpuCtx *c, char *err, size_t errlen);

    int (*alloc)(struct GpuCtx *c, size_t bytes, void **p, char *err, size_t errlen);
    void (*free)(struct GpuCtx *c, void *p);
    void (*upload)(struct GpuCtx *c, void *dst, const void *src, size_t bytes);
    void (*download)(struct GpuCtx *c, void *dst, const void *src, size_t bytes);
    /* Device to device. */
    void (*copy)(struct GpuCtx *c, void *dst, const void *src, size_t bytes);
    void (*fill_u16)(struct GpuCtx *c, uint16_t *p, uint16_t v, size_t n);

    /* x (n, d) f32 = table[tokens[i]] (bf16 rows). */
    void (*embed)(struct GpuCtx *c, const uint16_t *table, const int32_t *tokens, int n, int d,
                  float *x);
    /* y (n, d) bf16 = x / rms(x) * w; x rows x_stride floats apart. */
    void (*rmsnorm)(struct GpuCtx *c, const float *x, int x_stride, const float *w, int n, int d,
                    float eps, uint16_t *y);
    /* y (n, m) f32, rows ldy apart, = x (n, k) bf16 . w (m, k)^T + beta * y. */
    void (*gemm)(struct GpuCtx *c, const uint16_t *x, int n, int k, const uint16_t *w, int m,
                 float *y, int ldy, float beta);
    void (*rope_store)(struct GpuCtx *c, const struct GpuRopeArgs *a);
    void (*attention)(struct GpuCtx *c, const struct GpuAttnArgs *a);
    /* h (n, F) bf16 = silu(gu[:, :F]) * gu[:, F:] for gu (n, 2F) f32. */
    void (*swiglu)(struct GpuCtx *c, const float *gu, int n, int F, uint16_t *h);

    /* The Hopper kernels' building block alone (kernels/cuda/attention_sm90.cu), for the GPU
     * checks: one warpgroup stages `page` (64 rows of head_dim bf16, a K/V page) in shared
     * memory as the attention kernel does and multiplies `a` (64 x head_dim bf16, row-major,
     * in registers) with it: d_k (64 x 64 f32) = a . page^T, as the scores, and d_v
     * (64 x head_dim f32) = a[:, :64] . page, as P V. All device pointers. 0, or -1 (nothing
     * launched) on a device other than compute capability 9.0 or another head_dim. */
    int (*wgmma_probe)(struct GpuCtx *c, int head_dim, const uint16_t *a, const uint16_t *page,
                       float *d_k, float *d_v);
    void (*sample)(struct GpuCtx *c, const struct GpuSampleArgs *a);
    /* Device-event timing of everything issued between the two calls, in seconds. */
    void (*timer_start)(struct GpuCtx *c);
    double (*timer_stop)(struct GpuCtx *c);
};

/* Loads libdiffrag_cuda.so (the path in DIFFRAG_CUDA_LIB, else beside the running program or
 * one folder up, else the loader's search path) and returns its table, or NULL with the
 * reason in err (no library in this build, no driver, version mismatch). Thread safe; the
 * library stays loaded. */
const struct GpuApi *gpu_api_load(char *err, size_t errlen);

/* float <-> bf16 (round to nearest even; NaN stays NaN). */
static inline uint16_t gpu_f32_to_bf16(float f)
{
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1)) >> 16);
}
static inline float gpu_bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

#endif
