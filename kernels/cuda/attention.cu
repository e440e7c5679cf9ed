/* Attention on the GPU over the paged bf16 KV cache (kernels/gpu.h).
 *
 * Prefill: a flash-attention kernel on the tensor cores (WMMA bf16, f32 accumulation), online
 * softmax, causal, nothing n x n in memory. A block takes GPU_QTILE query positions of the
 * query heads of one KV group (kernels/gpu_plan.h), four warps of 16 rows per head, and loads
 * each K/V page once for all of them. DIFF V2 pairs are in the same block; the odd head's
 * warps hand their output to the even head's through shared memory and the block writes
 * o_2i - sigmoid(lambda) * o_2i+1 once.
 *
 * Decode (one query): flash-decoding. Blocks take (KV head, range of pages); each warp keeps
 * the online-softmax state of every query head of the group for its keys, with the
 * groundedness accumulators (mass on document positions, on generated positions) beside the
 * normaliser; a second kernel merges the warps' partial states, applies the DIFF V2 combine
 * and writes the masses. */
#include <float.h>
#include <mma.h>

#include "kernels/cuda/cuda_common.h"

using namespace nvcuda;

#define LOG2E 1.4426950408889634f

template <int HD>
__device__ __forceinline__ const __nv_bfloat16 *kv_tile(const GpuAttnArgs &a, int tile, int kind,
                                                        int g)
{
    return (const __nv_bfloat16 *)a.pool + (size_t)a.pages[tile] * a.page_elems +
           ((size_t)(a.layer * 2 + kind) * a.n_kv_head + g) * GPU_PAGE * HD;
}

template <int HD, int MAXT>
__global__ void __launch_bounds__(MAXT) k_attn_prefill(GpuAttnArgs a, int heads)
{
    constexpr int LDK = HD + 8, WIDE = HD > GPU_PAGE ? HD : GPU_PAGE, LDS = WIDE + 4;
    constexpr int LDP = GPU_PAGE + 8, E = HD / 2;
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16 *sK = (__nv_bfloat16 *)smem, *sV = sK + GPU_PAGE * LDK;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nthreads = blockDim.x;
    float *sS = (float *)(sV + GPU_PAGE * LDK) + (size_t)warp * 16 * LDS;
    __nv_bfloat16 *sP = (__nv_bfloat16 *)((float *)(sV + GPU_PAGE * LDK) +
                                          (size_t)(nthreads >> 5) * 16 * LDS) + warp * 16 * LDP;

    int group = a.n_q_head / a.n_kv_head, subs = group / heads;
    int qt = gridDim.x - 1 - blockIdx.x;          /* longest tiles first */
    int g = blockIdx.y / subs, hl = warp >> 2;
    int h = g * group + (blockIdx.y % subs) * heads + hl;
    int r0 = qt * GPU_QTILE + (warp & 3) * 16;    /* chunk row of this warp's first query */
    int n_keys = a.pos0 + a.n_tok;
    int nq = a.n_q_head * HD;
    float sl2 = a.scale * LOG2E;

    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> qf[HD / 16];
    const __nv_bfloat16 *qp = (const __nv_bfloat16 *)a.q + (size_t)r0 * nq + (size_t)h * HD;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) wmma::load_matrix_sync(qf[kk], qp + kk * 16, nq);

    int r = lane >> 1, half = lane & 1;
    int qpos = a.pos0 + r0 + r;
    float m = -INFINITY, l = 0.f, o[E];
#pragma unroll
    for (int j = 0; j < E; j++) o[j] = 0.f;

    int last_key = a.pos0 + qt * GPU_QTILE + GPU_QTILE - 1;
    if (last_key > n_keys - 1) last_key = n_keys - 1;
    int warp_last = a.pos0 + r0 + 15;
    for (int t = 0; t <= last_key / GPU_PAGE; t++) {
        __syncthreads();
        const uint4 *gk = (const uint4 *)kv_tile<HD>(a, t, 0, g);
        const uint4 *gv = (const uint4 *)kv_tile<HD>(a, t, 1, g);
        for (int i = threadIdx.x; i < GPU_PAGE * HD / 8; i += nthreads) {
            int row = i / (HD / 8), col = (i % (HD / 8)) * 8;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
            if (t * GPU_PAGE + row < n_keys) {
                kx = gk[i];
                vx = gv[i];
            }
            *(uint4 *)(sK + row * LDK + col) = kx;
            *(uint4 *)(sV + row * LDK + col) = vx;
        }
        __syncthreads();
        if (t * GPU_PAGE > warp_last) continue;   /* every key after every query of the warp */

#pragma unroll
        for (int n = 0; n < GPU_PAGE / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, sK + n * 16 * LDK + kk * 16, LDK);
                wmma::mma_sync(acc, qf[kk], kf, acc);
            }
            wmma::store_matrix_sync(sS + n * 16, acc, LDS, wmma::mem_row_major);
        }
        __syncwarp();
        /* two passes over the row's scores in shared memory (max, then exponentials) rather
         * than 32 more registers per thread */
        int kmax = min(qpos, n_keys - 1) - t * GPU_PAGE;   /* last visible column */
        float mt = -INFINITY;
#pragma unroll
        for (int j = 0; j < GPU_PAGE / 2; j++)
            if (half + 2 * j <= kmax) mt = fmaxf(mt, sS[r * LDS + half + 2 * j]);
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1)) * sl2;
        float mn = fmaxf(m, mt);
        float alpha = mn == -INFINITY ? 1.f : exp2f(m - mn), ls = 0.f;
#pragma unroll
        for (int j = 0; j < GPU_PAGE / 2; j++) {
            float p = half + 2 * j <= kmax ? exp2f(sS[r * LDS + half + 2 * j] * sl2 - mn) : 0.f;
            ls += p;
            sP[r * LDP + half + 2 * j] = __float2bfloat16(p);
        }
        ls += __shfl_xor_sync(0xffffffffu, ls, 1);
        l = l * alpha + ls;
        m = mn;
#pragma unroll
        for (int j = 0; j < E; j++) o[j] *= alpha;
        __syncwarp();
#pragma unroll
        for (int n = 0; n < HD / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < GPU_PAGE / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> pf;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> vf;
                wmma::load_matrix_sync(pf, sP + kk * 16, LDP);
                wmma::load_matrix_sync(vf, sV + kk * 16 * LDK + n * 16, LDK);
                wmma::mma_sync(acc, pf, vf, acc);
            }
            wmma::store_matrix_sync(sS + n * 16, acc, LDS, wmma::mem_row_major);
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < E; j++) o[j] += sS[r * LDS + half + 2 * j];
        __syncwarp();
    }

    float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int j = 0; j < E; j++) o[j] *= inv;
    int row = r0 + r;
    if (a.lambda) {
        __syncthreads();
        if (hl & 1) {
#pragma unroll
            for (int j = 0; j < E; j++) sS[r * LDS + half + 2 * j] = o[j];
        }
        __syncthreads();
        if (!(hl & 1) && row < a.n_tok) {
            const float *po = sS + 4 * 16 * LDS;   /* the partner warp, four warps on */
            float lam = a.lambda[(size_t)row * a.lambda_stride + h / 2];
            float sg = 1.f / (1.f + __expf(-lam));
            __nv_bfloat16 *out = (__nv_bfloat16 *)a.out + (size_t)row * (nq / 2) + (h / 2) * HD;
#pragma unroll
            for (int j = 0; j < E; j++)
                out[half + 2 * j] = __float2bfloat16(o[j] - sg * po[r * LDS + half + 2 * j]);
        }
    } else if (row < a.n_tok) {
        __nv_bfloat16 *out = (__nv_bfloat16 *)a.out + (size_t)row * nq + (size_t)h * HD;
#pragma unroll
        for (int j = 0; j < E; j++) out[half + 2 * j] = __float2bfloat16(o[j]);
    }
}

/* ---- prefill, second form: mma.sync m16n8k16 with S, P and O in registers ----
 * The same blocks as k_attn_prefill (four warps of 16 query rows per head, the heads of a KV
 * group together, DIFF V2 pairs in one block), but the scores never leave registers: the
 * accumulator layout of S = Q K^T is the operand layout P needs for P V, so softmax runs on
 * the fragments, and K/V pages stream through two shared-memory stages with cp.async (zero
 * fill past the last key) while the previous page is computed. */

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const void *p)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

__device__ __forceinline__ void cp_async16(void *dst, const void *src, int bytes)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(src), "r"(bytes));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* S (16 rows x one page of keys) = Q K^T: n-tile j holds keys 8j..8j+7 of the page. */
template <int HD>
__device__ __forceinline__ void page_scores(float s[GPU_PAGE / 8][4], const uint32_t qa[HD / 16][4],
                                            const __nv_bfloat16 *sk, int gid, int tig)
{
#pragma unroll
    for (int j = 0; j < GPU_PAGE / 8; j++) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        const __nv_bfloat16 *kr = sk + (j * 8 + gid) * (HD + 8) + tig * 2;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++)
            mma_bf16(s[j], qa[kk], *(const uint32_t *)(kr + kk * 16),
                     *(const uint32_t *)(kr + kk * 16 + 8));
    }
}

/* O (16 rows x HD) = O * (al0 for rows gid, al1 for rows gid + 8) + P V for one page; the V
 * rows are keys, and ldmatrix .trans gives the col-major B fragments. */
template <int HD>
__device__ __forceinline__ void page_pv(float o[HD / 8][4], const uint32_t pa[GPU_PAGE / 16][4],
                                        const __nv_bfloat16 *sv, int lane, float al0, float al1)
{
#pragma unroll
    for (int j = 0; j < HD / 8; j++) {
        o[j][0] *= al0;
        o[j][1] *= al0;
        o[j][2] *= al1;
        o[j][3] *= al1;
    }
#pragma unroll
    for (int kk = 0; kk < GPU_PAGE / 16; kk++)
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
            uint32_t b[4];
            ldsm_x4_trans(b, sv + (kk * 16 + (lane & 15)) * (HD + 8) + j * 8 + (lane >> 4) * 8);
            mma_bf16(o[j], pa[kk], b[0], b[1]);
            mma_bf16(o[j + 1], pa[kk], b[2], b[3]);
        }
}

template <int HD, int MAXT>
__global__ void __launch_bounds__(MAXT) k_attn_prefill_mma(GpuAttnArgs a, int heads)
{
    constexpr int LDK = HD + 8, NT = GPU_PAGE / 8, DT = HD / 8, KT = HD / 16;
    constexpr int STAGE = 2 * GPU_PAGE * LDK;          /* K then V, bf16 elements */
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16 *st = (__nv_bfloat16 *)smem;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nthreads = blockDim.x;
    int gid = lane >> 2, tig = lane & 3;

    int group = a.n_q_head / a.n_kv_head, subs = group / heads;
    int qt = gridDim.x - 1 - blockIdx.x;
    int g = blockIdx.y / subs, hl = warp >> 2;
    int h = g * group + (blockIdx.y % subs) * heads + hl;
    int r0 = qt * GPU_QTILE + (warp & 3) * 16;
    int n_keys = a.pos0 + a.n_tok;
    int nq = a.n_q_head * HD;
    float sl2 = a.scale * LOG2E;

    /* Q fragments, once: rows r0+gid and r0+gid+8, columns 16kk + 2tig (+8) */
    uint32_t qa[KT][4];
    {
        const __nv_bfloat16 *qp = (const __nv_bfloat16 *)a.q + (size_t)r0 * nq + (size_t)h * HD;
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            int c = kk * 16 + tig * 2;
            qa[kk][0] = *(const uint32_t *)(qp + (size_t)gid * nq + c);
            qa[kk][1] = *(const uint32_t *)(qp + (size_t)(gid + 8) * nq + c);
            qa[kk][2] = *(const uint32_t *)(qp + (size_t)gid * nq + c + 8);
            qa[kk][3] = *(const uint32_t *)(qp + (size_t)(gid + 8) * nq + c + 8);
        }
    }
    int qpos0 = a.pos0 + r0 + gid, qpos1 = qpos0 + 8;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    int last_key = a.pos0 + qt * GPU_QTILE + GPU_QTILE - 1;
    if (last_key > n_keys - 1) last_key = n_keys - 1;
    int n_tiles = last_key / GPU_PAGE + 1;
    int warp_first = a.pos0 + r0, warp_last = warp_first + 15;

    auto load = [&](int t, int stage) {
        const __nv_bfloat16 *gk = kv_tile<HD>(a, t, 0, g), *gv = kv_tile<HD>(a, t, 1, g);
        __nv_bfloat16 *sk = st + stage * STAGE, *sv = sk + GPU_PAGE * LDK;
        for (int i = threadIdx.x; i < GPU_PAGE * HD / 8; i += nthreads) {
            int row = i / (HD / 8), col = (i % (HD / 8)) * 8;
            int bytes = t * GPU_PAGE + row < n_keys ? 16 : 0;
            cp_async16(sk + row * LDK + col, gk + (size_t)row * HD + col, bytes);
            cp_async16(sv + row * LDK + col, gv + (size_t)row * HD + col, bytes);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    load(0, 0);
    for (int t = 0; t < n_tiles; t++) {
        if (t + 1 < n_tiles) {
            load(t + 1, (t + 1) & 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        int k0 = t * GPU_PAGE;
        if (k0 <= warp_last) {
            const __nv_bfloat16 *sk = st + (t & 1) * STAGE, *sv = sk + GPU_PAGE * LDK;
            float s[NT][4];
            page_scores<HD>(s, qa, sk, gid, tig);
            /* mask (the diagonal page, and keys past the sequence), scale, row max */
            int need_mask = k0 + GPU_PAGE - 1 > warp_first || k0 + GPU_PAGE > n_keys;
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int key = k0 + j * 8 + tig * 2 + e;
                    float v0 = s[j][e] * sl2, v1 = s[j][2 + e] * sl2;
                    if (need_mask) {
                        if (key > qpos0 || key >= n_keys) v0 = -INFINITY;
                        if (key > qpos1 || key >= n_keys) v1 = -INFINITY;
                    }
                    s[j][e] = v0;
                    s[j][2 + e] = v1;
                    mx0 = fmaxf(mx0, v0);
                    mx1 = fmaxf(mx1, v1);
                }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            float al0 = mn0 == -INFINITY ? 1.f : exp2f(m0 - mn0);
            float al1 = mn1 == -INFINITY ? 1.f : exp2f(m1 - mn1);
            float sum0 = 0.f, sum1 = 0.f;
            uint32_t pa[GPU_PAGE / 16][4];
#pragma unroll
            for (int j = 0; j < NT; j++) {
                float p0 = mn0 == -INFINITY ? 0.f : exp2f(s[j][0] - mn0);
                float p1 = mn0 == -INFINITY ? 0.f : exp2f(s[j][1] - mn0);
                float p2 = mn1 == -INFINITY ? 0.f : exp2f(s[j][2] - mn1);
                float p3 = mn1 == -INFINITY ? 0.f : exp2f(s[j][3] - mn1);
                sum0 += p0 + p1;
                sum1 += p2 + p3;
                /* n-tile j is half of the k-tile j/2: the low half feeds a0/a1, the high a2/a3 */
                pa[j / 2][(j & 1) * 2 + 0] = pack_bf16(p0, p1);
                pa[j / 2][(j & 1) * 2 + 1] = pack_bf16(p2, p3);
            }
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
            l0 = l0 * al0 + sum0;
            l1 = l1 * al1 + sum1;
            m0 = mn0;
            m1 = mn1;
            page_pv<HD>(o, pa, sv, lane, al0, al1);
        }
        __syncthreads();
    }

    float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
    for (int j = 0; j < DT; j++) {
        o[j][0] *= inv0;
        o[j][1] *= inv0;
        o[j][2] *= inv1;
        o[j][3] *= inv1;
    }
    int row0 = r0 + gid, row1 = row0 + 8;
    if (a.lambda) {
        /* the odd head's warps hand their outputs over through the (now idle) stage buffers,
         * laid out [slot][element][lane]; the partner warp holds the same elements per lane */
        float *x = (float *)smem;
        int slot = ((hl >> 1) << 2) + (warp & 3);
        if (hl & 1) {
#pragma unroll
            for (int j = 0; j < DT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) x[((size_t)slot * DT * 4 + j * 4 + e) * 32 + lane] = o[j][e];
        }
        __syncthreads();
        if (!(hl & 1)) {
            float sg0 = 0.f, sg1 = 0.f;
            if (row0 < a.n_tok) sg0 = 1.f / (1.f + __expf(-a.lambda[(size_t)row0 * a.lambda_stride + h / 2]));
            if (row1 < a.n_tok) sg1 = 1.f / (1.f + __expf(-a.lambda[(size_t)row1 * a.lambda_stride + h / 2]));
            __nv_bfloat16 *out = (__nv_bfloat16 *)a.out + (size_t)(h / 2) * HD + tig * 2;
#pragma unroll
            for (int j = 0; j < DT; j++) {
                const float *px = x + ((size_t)slot * DT * 4 + j * 4) * 32 + lane;
                if (row0 < a.n_tok)
                    *(uint32_t *)(out + (size_t)row0 * (nq / 2) + j * 8) =
                        pack_bf16(o[j][0] - sg0 * px[0], o[j][1] - sg0 * px[32]);
                if (row1 < a.n_tok)
                    *(uint32_t *)(out + (size_t)row1 * (nq / 2) + j * 8) =
                        pack_bf16(o[j][2] - sg1 * px[64], o[j][3] - sg1 * px[96]);
            }
        }
    } else {
        __nv_bfloat16 *out = (__nv_bfloat16 *)a.out + (size_t)h * HD + tig * 2;
#pragma unroll
        for (int j = 0; j < DT; j++) {
            if (row0 < a.n_tok)
                *(uint32_t *)(out + (size_t)row0 * nq + j * 8) = pack_bf16(o[j][0], o[j][1]);
            if (row1 < a.n_tok)
                *(uint32_t *)(out + (size_t)row1 * nq + j * 8) = pack_bf16(o[j][2], o[j][3]);
        }
    }
}

/* ---- decode ---- */

#define DEC_WARPS 4
#define DEC_MAXG 8      /* query heads per block; larger groups take several blocks */
#define DEC_UNROLL 4

/* Partial state per (query head, split): m, l, l_doc, l_gen, then HD unnormalised outputs. */
template <int HD>
__global__ void __launch_bounds__(DEC_WARPS * 32) k_attn_decode(GpuAttnArgs a, int pages_per_split,
                                                                int n_part, float *work)
{
    constexpr int E = HD / 32;
    __shared__ float sq[DEC_MAXG][HD];
    int g = blockIdx.x, split = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int group = a.n_q_head / a.n_kv_head;
    int h0 = g * group + blockIdx.z * DEC_MAXG;
    int nh = group - blockIdx.z * DEC_MAXG;
    if (nh > DEC_MAXG) nh = DEC_MAXG;
    int n_keys = a.pos0 + 1;
    const __nv_bfloat16 *q = (const __nv_bfloat16 *)a.q;
    for (int i = threadIdx.x; i < nh * HD; i += blockDim.x)
        sq[i / HD][i % HD] = __bfloat162float(q[(size_t)h0 * HD + i]) * a.scale * LOG2E;
    __syncthreads();

    float qr[DEC_MAXG][E], o[DEC_MAXG][E], m[DEC_MAXG], l[DEC_MAXG], ld[DEC_MAXG], lg[DEC_MAXG];
#pragma unroll
    for (int hh = 0; hh < DEC_MAXG; hh++) {
        m[hh] = -INFINITY;
        l[hh] = ld[hh] = lg[hh] = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            qr[hh][e] = hh < nh ? sq[hh][lane * E + e] : 0.f;
            o[hh][e] = 0.f;
        }
    }
    int k0 = split * pages_per_split * GPU_PAGE;
    int k1 = k0 + pages_per_split * GPU_PAGE;
    if (k1 > n_keys) k1 = n_keys;
    for (int kb = k0 + warp * DEC_UNROLL; kb < k1; kb += DEC_WARPS * DEC_UNROLL) {
        float kx[DEC_UNROLL][E], vx[DEC_UNROLL][E];
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            int key = kb + u;
            int kk = key < k1 ? key : k1 - 1;
            const __nv_bfloat16 *kr = kv_tile<HD>(a, kk / GPU_PAGE, 0, g) + (kk % GPU_PAGE) * HD + lane * E;
            const __nv_bfloat16 *vr = kv_tile<HD>(a, kk / GPU_PAGE, 1, g) + (kk % GPU_PAGE) * HD + lane * E;
#pragma unroll
            for (int e = 0; e < E; e++) {
                kx[u][e] = __bfloat162float(kr[e]);
                vx[u][e] = __bfloat162float(vr[e]);
            }
        }
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            int key = kb + u;
            if (key >= k1) break;
            int doc = key < a.n_marked ? (a.cls && a.cls[key] == 1) : 0;
            int gen = key >= a.n_marked;
#pragma unroll
            for (int hh = 0; hh < DEC_MAXG; hh++) {
                if (hh >= nh) break;
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < E; e++) s += qr[hh][e] * kx[u][e];
#pragma unroll
                for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                float mn = fmaxf(m[hh], s);
                float alpha = exp2f(m[hh] - mn), p = exp2f(s - mn);
                l[hh] = l[hh] * alpha + p;
                ld[hh] = ld[hh] * alpha + (doc ? p : 0.f);
                lg[hh] = lg[hh] * alpha + (gen ? p : 0.f);
#pragma unroll
                for (int e = 0; e < E; e++) o[hh][e] = o[hh][e] * alpha + p * vx[u][e];
                m[hh] = mn;
            }
        }
    }
    /* the block's four warps merge in shared memory: one partial state per block */
    __shared__ float red[DEC_WARPS][DEC_MAXG][HD + 4];
#pragma unroll
    for (int hh = 0; hh < DEC_MAXG; hh++) {
        if (hh >= nh) break;
        if (lane == 0) {
            red[warp][hh][0] = m[hh];
            red[warp][hh][1] = l[hh];
            red[warp][hh][2] = ld[hh];
            red[warp][hh][3] = lg[hh];
        }
#pragma unroll
        for (int e = 0; e < E; e++) red[warp][hh][4 + lane * E + e] = o[hh][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * HD; i += blockDim.x) {
        int hh = i / HD, d = i % HD;
        float M = -INFINITY, f[DEC_WARPS];
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) M = fmaxf(M, red[w][hh][0]);
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++)
            f[w] = red[w][hh][0] == -INFINITY ? 0.f : exp2f(red[w][hh][0] - M);
        float *out = work + ((size_t)(h0 + hh) * n_part + split) * (HD + 4);
        float O = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) O += red[w][hh][4 + d] * f[w];
        out[4 + d] = O;
        if (d < 4) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < DEC_WARPS; w++) v += red[w][hh][d] * f[w];
            out[d] = d == 0 ? M : v;
        }
    }
}

/* One block per output head: PL = 256 / HD lanes of parts times HD dimensions merge the
 * parts of its query head (both heads of a DIFF V2 pair), then write the output row and the
 * masses. */
template <int HD>
__global__ void __launch_bounds__(256) k_attn_merge(GpuAttnArgs a, int n_part, const float *work)
{
    constexpr int PL = 256 / HD;
    __shared__ float sO[PL][HD], sL[PL][3], sMax[8], res[2][HD];
    int diff = a.lambda != NULL, per = diff ? 2 : 1;
    int ho = blockIdx.x, tid = threadIdx.x, d = tid % HD, pl = tid / HD;
    for (int p = 0; p < per; p++) {
        int h = ho * per + p;
        const float *w = work + (size_t)h * n_part * (HD + 4);
        float M = -INFINITY;
        for (int i = tid; i < n_part; i += 256) M = fmaxf(M, w[(size_t)i * (HD + 4)]);
        for (int off = 16; off; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        if ((tid & 31) == 0) sMax[tid >> 5] = M;
        __syncthreads();
        M = sMax[0];
        for (int i = 1; i < 8; i++) M = fmaxf(M, sMax[i]);
        float O = 0.f, L = 0.f, Ld = 0.f, Lg = 0.f;
#pragma unroll 4
        for (int i = pl; i < n_part; i += PL) {
            const float *wi = w + (size_t)i * (HD + 4);
            float f = wi[0] == -INFINITY ? 0.f : exp2f(wi[0] - M);
            O += wi[4 + d] * f;
            if (d == 0) {
                L += wi[1] * f;
                Ld += wi[2] * f;
                Lg += wi[3] * f;
            }
        }
        sO[pl][d] = O;
        if (d == 0) {
            sL[pl][0] = L;
            sL[pl][1] = Ld;
            sL[pl][2] = Lg;
        }
        __syncthreads();
        if (pl == 0) {
            float Ot = 0.f, Lt = 0.f;
#pragma unroll
            for (int j = 0; j < PL; j++) {
                Ot += sO[j][d];
                Lt += sL[j][0];
            }
            res[p][d] = Ot / Lt;
            if (a.mass && d == 0) {
                float Ldt = 0.f, Lgt = 0.f;
#pragma unroll
                for (int j = 0; j < PL; j++) {
                    Ldt += sL[j][1];
                    Lgt += sL[j][2];
                }
                a.mass[2 * h] = Ldt / Lt;
                a.mass[2 * h + 1] = Lgt / Lt;
            }
        }
        __syncthreads();
    }
    if (pl == 0) {
        float out = res[0][d];
        if (diff) out -= res[1][d] / (1.f + __expf(-a.lambda[ho]));
        ((__nv_bfloat16 *)a.out)[(size_t)ho * HD + d] = __float2bfloat16(out);
    }
}

/* Decode, second form: the query heads of a KV group are the 16 rows of one mma.sync tile
 * (padded with zero rows), so a page of keys costs the same few tensor-core instructions
 * whether the group has 3 query heads (GQA) or 6 (DIFF V2): DIFF V2 adds query heads, not
 * key/value traffic. Each warp streams its own pages through shared memory with cp.async;
 * the groundedness accumulators ride along as two more row sums; the block's warps merge in
 * shared memory and write one partial state per head for k_attn_merge. */
#define DEC_ROWS 16

template <int HD>
__global__ void __launch_bounds__(DEC_WARPS * 32) k_attn_decode_mma(GpuAttnArgs a, int pages_per_split,
                                                                    int n_part, float *work)
{
    constexpr int LDK = HD + 8, NT = GPU_PAGE / 8, DT = HD / 8, KT = HD / 16;
    constexpr int WBUF = 2 * GPU_PAGE * LDK;            /* one warp's K and V page, bf16 */
    extern __shared__ __align__(128) unsigned char smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    __nv_bfloat16 *sk = (__nv_bfloat16 *)smem + warp * WBUF, *sv = sk + GPU_PAGE * LDK;
    int g = blockIdx.x, split = blockIdx.y;
    int group = a.n_q_head / a.n_kv_head;
    int h0 = g * group + blockIdx.z * DEC_ROWS;
    int nh = min(group - (int)blockIdx.z * DEC_ROWS, DEC_ROWS);
    int n_keys = a.pos0 + 1;
    float sl2 = a.scale * LOG2E;

    uint32_t qa[KT][4];
    {
        const __nv_bfloat16 *qp = (const __nv_bfloat16 *)a.q + (size_t)h0 * HD;
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            int c = kk * 16 + tig * 2;
            qa[kk][0] = gid < nh ? *(const uint32_t *)(qp + (size_t)gid * HD + c) : 0u;
            qa[kk][1] = gid + 8 < nh ? *(const uint32_t *)(qp + (size_t)(gid + 8) * HD + c) : 0u;
            qa[kk][2] = gid < nh ? *(const uint32_t *)(qp + (size_t)gid * HD + c + 8) : 0u;
            qa[kk][3] = gid + 8 < nh ? *(const uint32_t *)(qp + (size_t)(gid + 8) * HD + c + 8) : 0u;
        }
    }
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, ld[2] = {0.f, 0.f}, lg[2] = {0.f, 0.f};
    float o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    int p0 = split * pages_per_split;
    int p1 = min(p0 + pages_per_split, (n_keys + GPU_PAGE - 1) / GPU_PAGE);
    for (int t = p0 + warp; t < p1; t += DEC_WARPS) {
        const __nv_bfloat16 *gk = kv_tile<HD>(a, t, 0, g), *gv = kv_tile<HD>(a, t, 1, g);
        for (int i = lane; i < GPU_PAGE * HD / 8; i += 32) {
            int row = i / (HD / 8), col = (i % (HD / 8)) * 8;
            int bytes = t * GPU_PAGE + row < n_keys ? 16 : 0;
            cp_async16(sk + row * LDK + col, gk + (size_t)row * HD + col, bytes);
            cp_async16(sv + row * LDK + col, gv + (size_t)row * HD + col, bytes);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 0;\n" ::);
        __syncwarp();
        int k0 = t * GPU_PAGE;
        float s[NT][4];
        page_scores<HD>(s, qa, sk, gid, tig);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = k0 + j * 8 + tig * 2 + (e & 1);
                s[j][e] = key < n_keys ? s[j][e] * sl2 : -INFINITY;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
            }
        float al[2], mn[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            mn[r] = fmaxf(m[r], mx[r]);
            al[r] = mn[r] == -INFINITY ? 1.f : exp2f(m[r] - mn[r]);
        }
        float sum[2] = {0.f, 0.f}, sd[2] = {0.f, 0.f}, sg[2] = {0.f, 0.f};
        uint32_t pa[GPU_PAGE / 16][4];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = e >> 1, key = k0 + j * 8 + tig * 2 + (e & 1);
                p[e] = mn[r] == -INFINITY ? 0.f : exp2f(s[j][e] - mn[r]);
                sum[r] += p[e];
                if (key < a.n_marked) {
                    if (a.cls && a.cls[key] == 1) sd[r] += p[e];
                } else if (key < n_keys) {
                    sg[r] += p[e];
                }
            }
            pa[j / 2][(j & 1) * 2 + 0] = pack_bf16(p[0], p[1]);
            pa[j / 2][(j & 1) * 2 + 1] = pack_bf16(p[2], p[3]);
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int off = 1; off <= 2; off <<= 1) {
                sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], off);
                sd[r] += __shfl_xor_sync(0xffffffffu, sd[r], off);
                sg[r] += __shfl_xor_sync(0xffffffffu, sg[r], off);
            }
            l[r] = l[r] * al[r] + sum[r];
            ld[r] = ld[r] * al[r] + sd[r];
            lg[r] = lg[r] * al[r] + sg[r];
            m[r] = mn[r];
        }
        page_pv<HD>(o, pa, sv, lane, al[0], al[1]);
        __syncwarp();
    }

    /* merge the warps: states into shared memory (the page buffers are free now) */
    __syncthreads();
    float *so = (float *)smem;                          /* [warp][row][HD + 4] */
    constexpr int RS = HD + 4;
#pragma unroll
    for (int j = 0; j < DT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            so[((size_t)warp * DEC_ROWS + gid + (e >> 1) * 8) * RS + 4 + j * 8 + tig * 2 + (e & 1)] = o[j][e];
    if (tig == 0)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float *st = so + ((size_t)warp * DEC_ROWS + gid + r * 8) * RS;
            st[0] = m[r];
            st[1] = l[r];
            st[2] = ld[r];
            st[3] = lg[r];
        }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * HD; i += blockDim.x) {
        int row = i / HD, d = i % HD;
        float M = -INFINITY, f[DEC_WARPS];
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) M = fmaxf(M, so[((size_t)w * DEC_ROWS + row) * RS]);
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) {
            float mw = so[((size_t)w * DEC_ROWS + row) * RS];
            f[w] = mw == -INFINITY ? 0.f : exp2f(mw - M);
        }
        float *out = work + ((size_t)(h0 + row) * n_part + split) * (HD + 4);
        float O = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) O += so[((size_t)w * DEC_ROWS + row) * RS + 4 + d] * f[w];
        out[4 + d] = O;
        if (d < 4) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < DEC_WARPS; w++) v += so[((size_t)w * DEC_ROWS + row) * RS + d] * f[w];
            out[d] = d == 0 ? M : v;
        }
    }
}

template <int HD>
static void decode(GpuCtx *c, const GpuAttnArgs *a)
{
    GpuDecodePlan p;
    gpu_decode_plan(a->pos0 + 1, a->n_q_head, a->n_kv_head, HD, c->n_sm, &p);
    int n_part = p.splits;
    size_t need = (size_t)a->n_q_head * n_part * (HD + 4);
    if (need > c->work_floats) {
        if (c->work) cudaFree(c->work);
        c->work = NULL;
        c->work_floats = 0;
        cudaError_t e = cudaMalloc(&c->work, need * sizeof(float));
        gpu_note(c, e, "decode workspace");
        if (e != cudaSuccess) return;
        c->work_floats = need;
    }
    int group = a->n_q_head / a->n_kv_head;
    if (a->kernel == 1) {
        dim3 grid(a->n_kv_head, p.splits, (group + DEC_MAXG - 1) / DEC_MAXG);
        k_attn_decode<HD><<<grid, DEC_WARPS * 32, 0, c->stream>>>(*a, p.pages_per_split, n_part,
                                                                  c->work);
    } else {
        size_t smem = gpu_decode_smem_mma(HD);
        gpu_note(c, cudaFuncSetAttribute(k_attn_decode_mma<HD>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                 "decode shared memory");
        dim3 grid(a->n_kv_head, p.splits, (group + DEC_ROWS - 1) / DEC_ROWS);
        k_attn_decode_mma<HD><<<grid, DEC_WARPS * 32, smem, c->stream>>>(*a, p.pages_per_split,
                                                                        n_part, c->work);
    }
    GPU_LAUNCHED(c, "decode attention");
    int n_out = a->lambda ? a->n_q_head / 2 : a->n_q_head;
    k_attn_merge<HD><<<n_out, 256, 0, c->stream>>>(*a, n_part, c->work);
    GPU_LAUNCHED(c, "decode merge");
}

template <int HD, int MAXT>
static void prefill(GpuCtx *c, const GpuAttnArgs *a)
{
    if (a->kernel >= 2 && a->kernel <= 5 &&
        cuda_prefill_wgmma(c, a, a->kernel == 3 || a->kernel == 5, a->kernel >= 4) == 0)
        return;
    GpuAttnPlan p;
    if (gpu_attn_plan(a->n_tok, a->n_q_head, a->n_kv_head, HD, a->lambda != NULL, &p) ||
        p.warps * 32 > MAXT || p.smem > c->smem_optin) {
        if (!c->err[0])
            snprintf(c->err, sizeof c->err, "attention: no launch plan for %d query heads over %d "
                     "KV heads of dimension %d", a->n_q_head, a->n_kv_head, HD);
        return;
    }
    dim3 grid(p.blocks_x, p.blocks_y);
    if (a->kernel == 1) {
        gpu_note(c, cudaFuncSetAttribute(k_attn_prefill<HD, MAXT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem),
                 "attention shared memory");
        k_attn_prefill<HD, MAXT><<<grid, p.warps * 32, p.smem, c->stream>>>(*a, p.heads);
    } else {
        gpu_note(c, cudaFuncSetAttribute(k_attn_prefill_mma<HD, MAXT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)p.smem_mma),
                 "attention shared memory");
        k_attn_prefill_mma<HD, MAXT><<<grid, p.warps * 32, p.smem_mma, c->stream>>>(*a, p.heads);
    }
    GPU_LAUNCHED(c, "prefill attention");
}

void cuda_attention(GpuCtx *c, const GpuAttnArgs *a)
{
    if (a->head_dim != 64 && a->head_dim != 128) {
        if (!c->err[0])
            snprintf(c->err, sizeof c->err, "attention: head dimension %d (64 and 128 are handled)",
                     a->head_dim);
        return;
    }
    if (a->n_tok > 1) {
        if (a->head_dim == 64) prefill<64, 512>(c, a);
        else prefill<128, 256>(c, a);
        if (!a->mass) return;
        /* the masses of the chunk's last query: its row again through the decode kernels */
        GpuAttnArgs last = *a;
        int nq = a->n_q_head * a->head_dim, no = a->lambda ? nq / 2 : nq;
        last.q = a->q + (size_t)(a->n_tok - 1) * nq;
        last.out = a->out + (size_t)(a->n_tok - 1) * no;
        last.lambda = a->lambda ? a->lambda + (size_t)(a->n_tok - 1) * a->lambda_stride : NULL;
        last.pos0 = a->pos0 + a->n_tok - 1;
        last.n_tok = 1;
        a = &last;
        if (a->head_dim == 64) decode<64>(c, a);
        else decode<128>(c, a);
        return;
    }
    if (a->head_dim == 64) decode<64>(c, a);
    else decode<128>(c, a);
}
