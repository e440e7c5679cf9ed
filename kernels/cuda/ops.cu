/* The CUDA backend's context, memory and row-wise operations (embedding gather, RMSNorm,
 * RoPE with the paged KV store, SwiGLU), the cuBLAS products, and the exported table
 * (kernels/gpu.h). Attention lives in attention.cu. */
#include <string.h>

#include "kernels/cuda/cuda_common.h"

#define STR2(x) #x
#define STR(x) STR2(x)

static int device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

static int device_info(int dev, char *buf, size_t len, size_t *free_b, size_t *total_b)
{
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) {
        snprintf(buf, len, "device %d: %s", dev, cudaGetErrorString(cudaGetLastError()));
        return -1;
    }
    size_t fr = 0, tot = 0;
    if (cudaSetDevice(dev) == cudaSuccess) cudaMemGetInfo(&fr, &tot);
    if (free_b) *free_b = fr;
    if (total_b) *total_b = tot;
    snprintf(buf, len, "%s, %.1f GiB (%.1f free), %d multiprocessors, compute capability %d.%d",
             p.name, tot / 1073741824.0, fr / 1073741824.0, p.multiProcessorCount, p.major,
             p.minor);
    return 0;
}

static int ctx_new(int dev, GpuCtx **out, char *err, size_t errlen)
{
    *out = NULL;
    GpuCtx *c = (GpuCtx *)calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    c->dev = dev;
    cudaError_t e = cudaSetDevice(dev);
    cudaDeviceProp p;
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&p, dev);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreate(&c->t0);
    if (e == cudaSuccess) e = cudaEventCreate(&c->t1);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "CUDA device %d: %s", dev, cudaGetErrorString(e));
        free(c);
        return -1;
    }
    c->n_sm = p.multiProcessorCount;
    c->smem_optin = p.sharedMemPerBlockOptin;
    c->sm90 = p.major == 9 && p.minor == 0;
    if (cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS) {
        snprintf(err, errlen, "cuBLAS could not be initialised on device %d", dev);
        cudaStreamDestroy(c->stream);
        free(c);
        return -1;
    }
    *out = c;
    return 0;
}

static void ctx_destroy(GpuCtx *c)
{
    if (!c) return;
    cudaStreamSynchronize(c->stream);
    if (c->work) cudaFree(c->work);
    cublasDestroy(c->blas);
    cudaEventDestroy(c->t0);
    cudaEventDestroy(c->t1);
    cudaStreamDestroy(c->stream);
    free(c);
}

static int sync(GpuCtx *c, char *err, size_t errlen)
{
    gpu_note(c, cudaStreamSynchronize(c->stream), "synchronize");
    if (!c->err[0]) return 0;
    snprintf(err, errlen, "CUDA: %s", c->err);
    c->err[0] = 0;
    return -1;
}

static int alloc(GpuCtx *c, size_t bytes, void **p, char *err, size_t errlen)
{
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cudaGetLastError();
        snprintf(err, errlen, "cannot allocate %zu bytes (%.1f MiB) on CUDA device %d: %s",
                 bytes, bytes / 1048576.0, c->dev, cudaGetErrorString(e));
        *p = NULL;
        return -1;
    }
    return 0;
}

static void dfree(GpuCtx *c, void *p)
{
    (void)c;
    if (p) cudaFree(p);
}

static void upload(GpuCtx *c, void *dst, const void *src, size_t n)
{
    gpu_note(c, cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, c->stream), "upload");
}

static void download(GpuCtx *c, void *dst, const void *src, size_t n)
{
    gpu_note(c, cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, c->stream), "download");
}

static void copy(GpuCtx *c, void *dst, const void *src, size_t n)
{
    gpu_note(c, cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, c->stream), "copy");
}

__global__ void k_fill_u16(uint16_t *p, uint16_t v, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = v;
}

static void fill_u16(GpuCtx *c, uint16_t *p, uint16_t v, size_t n)
{
    if (!n) return;
    size_t blocks = (n + 255) / 256;
    k_fill_u16<<<blocks > 65535 ? 65535 : (unsigned)blocks, 256, 0, c->stream>>>(p, v, n);
    GPU_LAUNCHED(c, "fill");
}

__global__ void k_embed(const __nv_bfloat16 *table, const int32_t *tok, int d, float *x)
{
    const __nv_bfloat16 *row = table + (size_t)tok[blockIdx.x] * d;
    float *y = x + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) y[i] = __bfloat162float(row[i]);
}

static void embed(GpuCtx *c, const uint16_t *table, const int32_t *tokens, int n, int d, float *x)
{
    k_embed<<<n, 256, 0, c->stream>>>((const __nv_bfloat16 *)table, tokens, d, x);
    GPU_LAUNCHED(c, "embed");
}

/* one block per row; the sum of squares in f32 through warp shuffles */
__global__ void k_rmsnorm(const float *x, int x_stride, const float *w, int d, float eps,
                          __nv_bfloat16 *y)
{
    __shared__ float part[32];
    const float *xr = x + (size_t)blockIdx.x * x_stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        ss = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
        for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (threadIdx.x == 0) part[0] = ss;
    }
    __syncthreads();
    float inv = rsqrtf(part[0] / d + eps);
    __nv_bfloat16 *yr = y + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = __float2bfloat16(xr[i] * inv * w[i]);
}

static void rmsnorm(GpuCtx *c, const float *x, int x_stride, const float *w, int n, int d,
                    float eps, uint16_t *y)
{
    k_rmsnorm<<<n, 256, 0, c->stream>>>(x, x_stride, w, d, eps, (__nv_bfloat16 *)y);
    GPU_LAUNCHED(c, "rmsnorm");
}

static void gemm(GpuCtx *c, const uint16_t *x, int n, int k, const uint16_t *w, int m, float *y,
                 int ldy, float beta)
{
    const float alpha = 1.f;
    /* column-major view: y^T (m, n) = w (k, m)^T . x^T (k, n) */
    cublasStatus_t s = cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w,
                                    CUDA_R_16BF, k, x, CUDA_R_16BF, k, &beta, y, CUDA_R_32F, ldy,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS && !c->err[0])
        snprintf(c->err, sizeof c->err, "cublasGemmEx (%d x %d x %d): status %d", n, m, k, (int)s);
}

/* One block per token: every element of its q and k heads rotated (each thread reads the
 * pair it needs), q to bf16, k and v into the token's page row. */
/* One block per token: column e of its q|k|v row plus its bias (when there is one), rotated
 * with its pair (x[d] and x[d + half] in the neox layout, x[2i] and x[2i + 1] in the
 * adjacent one; each thread reads both of its pair, biased), then stored as bf16. */
__device__ __forceinline__ float qkv_at(const float *row, const float *bias, int j)
{
    return bias ? row[j] + bias[j] : row[j];
}

__global__ void k_rope_store(GpuRopeArgs a)
{
    int t = blockIdx.x, pos = a.pos0 + t, hd = a.head_dim, half = a.n_rot / 2;
    const float *row = a.qkv + (size_t)t * a.qkv_stride, *b = a.bias;
    const float *cs = a.cos + (size_t)t * half, *sn = a.sin + (size_t)t * half;
    int nq = a.n_q_head * hd, nkv = a.n_kv_head * hd;
    __nv_bfloat16 *page = (__nv_bfloat16 *)a.pool + (size_t)a.pages[pos / GPU_PAGE] * a.page_elems;
    int prow = pos % GPU_PAGE;
    for (int e = threadIdx.x; e < nq + 2 * nkv; e += blockDim.x) {
        float v = qkv_at(row, b, e);
        int d = e % hd, h0 = e - d;
        if (e < nq + nkv && d < a.n_rot) {
            if (a.layout) {
                if (d < half) v = v * cs[d] - qkv_at(row, b, h0 + d + half) * sn[d];
                else v = qkv_at(row, b, h0 + d - half) * sn[d - half] + v * cs[d - half];
            } else {
                int i = d / 2;
                if (d % 2 == 0) v = v * cs[i] - qkv_at(row, b, e + 1) * sn[i];
                else v = qkv_at(row, b, e - 1) * sn[i] + v * cs[i];
            }
        }
        if (e < nq) {
            a.q_out[(size_t)t * nq + e] = __bfloat16_as_ushort(__float2bfloat16(v));
        } else {
            int kind = e < nq + nkv ? 0 : 1;
            int g = (e - nq - kind * nkv) / hd;
            size_t off = ((size_t)(a.layer * 2 + kind) * a.n_kv_head + g) * GPU_PAGE * hd +
                         (size_t)prow * hd + d;
            page[off] = __float2bfloat16(v);
        }
    }
}

static void rope_store(GpuCtx *c, const GpuRopeArgs *a)
{
    k_rope_store<<<a->n_tok, 256, 0, c->stream>>>(*a);
    GPU_LAUNCHED(c, "rope_store");
}

__global__ void k_swiglu(const float *gu, int F, __nv_bfloat16 *h)
{
    const float *g = gu + (size_t)blockIdx.x * 2 * F, *u = g + F;
    __nv_bfloat16 *o = h + (size_t)blockIdx.x * F;
    for (int i = threadIdx.x; i < F; i += blockDim.x) {
        float x = g[i];
        o[i] = __float2bfloat16(x / (1.f + __expf(-x)) * u[i]);
    }
}

static void swiglu(GpuCtx *c, const float *gu, int n, int F, uint16_t *h)
{
    k_swiglu<<<n, 256, 0, c->stream>>>(gu, F, (__nv_bfloat16 *)h);
    GPU_LAUNCHED(c, "swiglu");
}

static void attention(GpuCtx *c, const GpuAttnArgs *a) { cuda_attention(c, a); }

static void timer_start(GpuCtx *c) { cudaEventRecord(c->t0, c->stream); }

static double timer_stop(GpuCtx *c)
{
    float ms = 0.f;
    cudaEventRecord(c->t1, c->stream);
    cudaEventSynchronize(c->t1);
    cudaEventElapsedTime(&ms, c->t0, c->t1);
    return ms * 1e-3;
}

#ifndef DIFFRAG_CUDA_ARCHS
#define DIFFRAG_CUDA_ARCHS "unknown targets"
#endif

static const GpuApi api = {
    GPU_API_VERSION,
    "CUDA " STR(__CUDACC_VER_MAJOR__) "." STR(__CUDACC_VER_MINOR__) ", " DIFFRAG_CUDA_ARCHS,
    device_count, device_info, ctx_new, ctx_destroy, sync, alloc, dfree, upload, download,
    copy, fill_u16, embed, rmsnorm, gemm, rope_store, attention, swiglu, cuda_wgmma_probe,
    cuda_sample, timer_start, timer_stop,
};

extern "C" __attribute__((visibility("default"))) const GpuApi *diffrag_gpu_api(void)
{
    return &api;
}
