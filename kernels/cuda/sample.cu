/* Sampling's pass over the last logits on the device (GpuApi.sample): one block of 1024
 * threads reads the vocabulary a few times from L2 and leaves a head (the largest logit, its
 * index, the second largest, the signals' sums in double, the sum of the weights) and the
 * candidates the draw needs, found by radix select (kernels/gpu_plan.h). The host then draws
 * from the candidates alone (model/sampler.c, sampler_finish), so a decode step moves a few
 * hundred bytes off the device instead of the logits, and the host makes no pass of its own.
 * Every reduction runs in a fixed order, so the head repeats exactly; only the mass
 * histograms of top-p add floats in a varying order (their selection has a margin). */
#include <math.h>

#include "kernels/cuda/cuda_common.h"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)

__device__ static inline float clean_logit(float x) { return isnan(x) ? -INFINITY : x; }

struct OpMax { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct OpMin { __device__ int operator()(int a, int b) const { return a < b ? a : b; } };
struct OpAdd { __device__ double operator()(double a, double b) const { return a + b; } };

/* Every thread receives op over all threads' v: a butterfly within each warp, then the warps'
 * results combined in warp order by every thread (the same order each time). */
template <class T, class Op>
__device__ static T block_all(T v, Op op, T *sh)
{
    for (int o = 16; o; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();                          /* sh may still be read by a previous call */
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    T r = sh[0];
    for (int w = 1; w < SAMPLE_WARPS; w++) r = op(r, sh[w]);
    return r;
}

/* The exclusive prefix sum of v over threads in thread order, and the total. */
__device__ static int block_scan(int v, int *sh, int *total)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    int base = 0, tot = 0;
    for (int w = 0; w < SAMPLE_WARPS; w++) {
        base += w < warp ? sh[w] : 0;
        tot += sh[w];
    }
    *total = tot;
    return base + x - v;
}

__global__ void __launch_bounds__(SAMPLE_THREADS) k_sample(GpuSampleArgs a)
{
    __shared__ float sh_f[SAMPLE_WARPS];
    __shared__ int sh_i[SAMPLE_WARPS];
    __shared__ double sh_d[SAMPLE_WARPS];
    __shared__ float hist[GPU_RADIX];
    __shared__ uint32_t s_prefix;
    __shared__ float s_want;
    const int n = a.n, t = threadIdx.x;
    const float *x = a.logits;

    float mx = -INFINITY;
    for (int i = t; i < n; i += SAMPLE_THREADS) mx = fmaxf(mx, clean_logit(x[i]));
    mx = block_all(mx, OpMax(), sh_f);
    int best = n;
    if (mx > -INFINITY)
        for (int i = t; i < n; i += SAMPLE_THREADS)
            if (clean_logit(x[i]) == mx) { best = i; break; }
    best = block_all(best, OpMin(), sh_i);
    if (mx == -INFINITY) best = 0;

    /* the signals' sums at temperature 1 (skipped exp(-inf) terms as on the host), the
     * second largest, and the weights at the sampling temperature */
    const int sampling = a.mode != GPU_SAMPLE_GREEDY && mx > -INFINITY;
    float second = -INFINITY;
    double z1 = 0, ez1 = 0, zt = 0;
    if (mx > -INFINITY)
        for (int i = t; i < n; i += SAMPLE_THREADS) {
            float v = clean_logit(x[i]), d = v - mx, e = expf(d);
            if (i != best) second = fmaxf(second, v);
            z1 += e;
            ez1 += e > 0.f ? (double)e * d : 0.0;
            if (sampling) {
                float w = expf(d * a.inv_temp);
                a.work[i] = w;
                zt += w;
            }
        }
    second = block_all(second, OpMax(), sh_f);
    z1 = block_all(z1, OpAdd(), sh_d);
    ez1 = block_all(ez1, OpAdd(), sh_d);
    zt = block_all(zt, OpAdd(), sh_d);   /* its barriers also publish work[] to the block */

    int n_cand = 0;
    if (sampling) {
        /* the boundary bit pattern kv: everything above it is kept, and `ties` of the w equal
         * to it (in id order) */
        uint32_t kv = __float_as_uint(a.floor);
        float ties = INFINITY;
        if (a.mode == GPU_SAMPLE_TOP_K || a.mode == GPU_SAMPLE_MASS) {
            const int count = a.mode == GPU_SAMPLE_TOP_K;
            uint32_t prefix = 0, mask = 0;
            float want = count ? (float)a.k : a.mass * (float)zt;
            for (int shift = 32 - GPU_RADIX_BITS; shift >= 0; shift -= GPU_RADIX_BITS) {
                for (int d = t; d < GPU_RADIX; d += SAMPLE_THREADS) hist[d] = 0.f;
                __syncthreads();
                /* whole warps each step: a count is added once per digit a warp holds (the
                 * weights crowd into a few exponents, and lanes adding to one address queue) */
                for (int base = 0; base < n; base += SAMPLE_THREADS) {
                    int i = base + t;
                    uint32_t b = i < n ? __float_as_uint(a.work[i]) : 0u;
                    int in = i < n && (b & mask) == prefix;
                    int key = in ? (int)((b >> shift) & (GPU_RADIX - 1)) : -1;
                    if (count) {
                        unsigned peers = __match_any_sync(0xffffffffu, key);
                        if (in && __ffs(peers) - 1 == (t & 31))
                            atomicAdd(&hist[key], (float)__popc(peers));
                    } else if (in) {
                        atomicAdd(&hist[key], __uint_as_float(b));
                    }
                }
                __syncthreads();
                if (t == 0) {
                    float above;
                    int d = gpu_radix_digit(hist, want, &above);
                    s_want = want - above;
                    s_prefix = prefix | (uint32_t)d << shift;
                }
                __syncthreads();
                prefix = s_prefix;
                want = s_want;
                mask |= (uint32_t)(GPU_RADIX - 1) << shift;
            }
            kv = prefix;
            if (count) ties = want;
        }
        /* compaction in id order: each thread a contiguous range, the slots from two scans */
        int per = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
        int lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
        int gt = 0, eq = 0;
        for (int i = lo; i < hi; i++) {
            uint32_t b = __float_as_uint(a.work[i]);
            gt += b > kv;
            eq += b == kv;
        }
        int n_gt, n_eq;
        int pg = block_scan(gt, sh_i, &n_gt);
        int pe = block_scan(eq, sh_i, &n_eq);
        int take = (float)n_eq <= ties ? n_eq : (int)ties;
        GpuCand *cand = (GpuCand *)(a.head + 1);
        for (int i = lo; i < hi; i++) {
            float w = a.work[i];
            uint32_t b = __float_as_uint(w);
            if (b > kv) {
                cand[pg++] = GpuCand{i, w, clean_logit(x[i])};
            } else if (b == kv) {
                if (pe < take) cand[n_gt + pe] = GpuCand{i, w, clean_logit(x[i])};
                pe++;
            }
        }
        n_cand = n_gt + take;
    }
    if (t == 0) *a.head = GpuSampleHead{best, n_cand, mx, second, z1, ez1, zt};
}

void cuda_sample(GpuCtx *c, const GpuSampleArgs *a)
{
    if (a->n < 1 || a->n > GPU_SAMPLE_MAX_N ||
        (a->mode == GPU_SAMPLE_TOP_K && (a->k < 1 || a->k > a->n))) {
        if (!c->err[0])
            snprintf(c->err, sizeof c->err, "sample: %d logits, mode %d, k %d not handled", a->n,
                     a->mode, a->k);
        return;
    }
    k_sample<<<1, SAMPLE_THREADS, 0, c->stream>>>(*a);
    GPU_LAUNCHED(c, "sample");
}
