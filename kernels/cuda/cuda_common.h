/* Shared by the CUDA backend's translation units: the context and error bookkeeping. */
#ifndef DIFFRAG_CUDA_COMMON_H
#define DIFFRAG_CUDA_COMMON_H

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" {
#include "kernels/gpu.h"
#include "kernels/gpu_plan.h"
}

struct GpuCtx {
    int dev;
    int n_sm;
    size_t smem_optin;         /* the largest dynamic shared memory a block may ask for */
    int sm90;                  /* compute capability 9.0: the sm_90a (wgmma) kernels run */
    cudaStream_t stream;
    cublasHandle_t blas;
    cudaEvent_t t0, t1;
    void *tma_encode;          /* cuTensorMapEncodeTiled, looked up at the first TMA launch */
    int tma_looked;
    float *work;               /* decode partial states */
    size_t work_floats;
    char err[256];             /* first error since the last sync */
};

/* Records the first failure of a launch or call; gpu_sync reports it. */
static inline void gpu_note(GpuCtx *c, cudaError_t e, const char *what)
{
    if (e != cudaSuccess && !c->err[0])
        snprintf(c->err, sizeof c->err, "%s: %s", what, cudaGetErrorString(e));
}
#define GPU_LAUNCHED(c, what) gpu_note((c), cudaGetLastError(), (what))

void cuda_attention(GpuCtx *c, const struct GpuAttnArgs *a);
/* Launches the Hopper prefill kernel (attention_sm90.cu), in its pipelined form or not, fed
 * by TMA or not: 0, or -1 when it does not apply (not a 9.0 device, or a shape it has no plan
 * for) and nothing was launched. */
int cuda_prefill_wgmma(GpuCtx *c, const struct GpuAttnArgs *a, int pipelined, int tma);
/* Sampling's pass over the logits (sample.cu). */
void cuda_sample(GpuCtx *c, const struct GpuSampleArgs *a);
int cuda_wgmma_probe(GpuCtx *c, int head_dim, const uint16_t *a, const uint16_t *page, float *d_k,
                     float *d_v);

#endif
