/* Prefill attention for Hopper (sm_90a): flash attention with warpgroup-wide wgmma products.
 *
 * A block takes one KV head's group at a tile of query positions (kernels/gpu_plan.h,
 * gpu_wg_plan): each warpgroup computes 64 query rows, one head's 64 positions or a DIFF V2
 * pair's 32 positions with the even head in accumulator row gid and the odd head in row
 * gid + 8 of each warp, so the combine o_2i - sigmoid(lambda_i) o_2i+1 happens in the thread
 * that holds both. Per K/V page:
 *   S (64 x 64 keys) = Q K^T: wgmma with Q from registers (loaded once) and the keys from
 *     shared memory (K-major, 128-byte swizzle);
 *   online softmax in base 2 on the accumulator fragments, which are already the operand
 *     layout of P;
 *   O (64 x head_dim) += P V: wgmma with P from registers and the values from shared memory
 *     (MN-major: the page's rows are keys, so the transpose flag reads them as stored).
 * Pages stream through shared-memory stages at the swizzled offsets the descriptors name
 * (gpu_sw128_offset, gpu_wg_desc_k/v; tests/test_gpu_plan.c checks the two agree under the PTX
 * canonical layouts), in one of two ways:
 *   cp.async by every thread of the block (zero fill past the last key), a block-wide barrier
 *     a page;
 *   TMA (the TMA forms): a producer warpgroup after the consumers, one thread of which issues
 *     the tensor copies of each page into GPU_TMA_STAGES stages, each with a "full" mbarrier
 *     (the copies' bytes) and an "empty" one (one arrival per consumer warp once its products
 *     have read the page); the consumers zero the values past the last key themselves, and
 *     no barrier spans the block, so one warpgroup's softmax overlaps another's products.
 *
 * Built into the sm_90a machine code only: the compute_90 PTX gets an empty body, and the host
 * chooses this kernel only on a compute capability 9.0 device. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <float.h>
#include <string.h>

#include "kernels/cuda/cuda_common.h"

#define LOG2E 1.4426950408889634f

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DIFFRAG_WGMMA 1
#endif

#ifdef DIFFRAG_WGMMA

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

/* Pins the accumulators in program order around the asynchronous products. */
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

#define WG_D32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
               "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define WG_OUT32(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
    "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),   \
    "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),            \
    "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),            \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

/* D (64 x 64, f32) = [D +] A (64 x 16, bf16 registers) B (16 x 64, shared memory). */
template <int TNSP_B>
__device__ __forceinline__ void wg_mma_n64(float (&d)[32], const uint32_t a[4], uint64_t desc,
                                           int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32
                 ", {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
                 : WG_OUT32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate),
                   "n"(TNSP_B));
}

/* D (64 x 128) += A (64 x 16, registers) B (16 x 128, shared memory, MN-major). */
__device__ __forceinline__ void wg_mma_n128_t(float (&d)[64], const uint32_t a[4], uint64_t desc)
{
    float *lo = d, *hi = d + 32;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,"
                 "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,"
                 "%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,"
                 "%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                 : WG_OUT32(lo), WG_OUT32(hi)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void *src, int bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

/* mbarriers (shared memory, 8 bytes each) and the TMA copies that complete them */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* one arrival that also announces the bytes the phase's copies will deliver */
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
/* until the phase of the given parity has completed */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
/* box (x, y) of the tensor map into shared memory at dst, completing bar */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int x, int y,
                                            uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(x), "r"(y), "r"(bar)
                 : "memory");
}

/* 2^x by the special-function unit alone (results under 2^-126 flush to 0, -inf gives 0):
 * exp2f would add a range test and two multiplies around it for every score. */
__device__ __forceinline__ float ex2_ftz(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack2_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* Issues S (64 x 64 keys) = Q K^T: Q as A fragments (64 x HD), the keys page at shared
 * address k. Asynchronous: the caller waits. */
template <int HD>
__device__ __forceinline__ void wg_scores(float (&s)[32], const uint32_t (&qa)[HD / 16][4], uint32_t k)
{
    reg_fence(s);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) wg_mma_n64<0>(s, qa[kk], gpu_wg_desc_k(k, kk), kk > 0);
    wg_commit();
}

/* Issues O (64 x HD) += P V: P as A fragments (64 x 64 keys), the values page at shared
 * address v. Asynchronous: the caller waits. */
template <int HD>
__device__ __forceinline__ void wg_pv(float (&o)[HD / 2], const uint32_t (*pa)[4], uint32_t v)
{
    reg_fence(o);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < GPU_PAGE / 16; kk++) {
        if constexpr (HD == 64) {
            wg_mma_n64<1>(o, pa[kk], gpu_wg_desc_v(v, kk), 1);
        } else {
            wg_mma_n128_t(o, pa[kk], gpu_wg_desc_v(v, kk));
        }
    }
    wg_commit();
}

#endif /* DIFFRAG_WGMMA */

template <int HD, int WGS, bool PIPE, bool TMA>
__global__ void __launch_bounds__(TMA ? GPU_TMA_THREADS(WGS) : WGS * 128, TMA ? GPU_TMA_MIN_BLOCKS(WGS) : 1)
k_attn_prefill_wgmma(const __grid_constant__ CUtensorMap kv_map, GpuAttnArgs a, int per_wg)
{
#ifdef DIFFRAG_WGMMA
    constexpr int TILE = GPU_PAGE * HD * 2;    /* bytes of one K or V page */
    constexpr int STAGE = 2 * TILE, KT = HD / 16, DT = HD / 8, NT = GPU_PAGE / 8;
    constexpr int ST = TMA ? GPU_TMA_STAGES : GPU_WG_STAGES(PIPE);
    constexpr int NTHREADS = WGS * 128;        /* the consumers: every thread without TMA */
    extern __shared__ unsigned char smem_raw[];
    uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    uint32_t sb = (raw + 1023u) & ~1023u;      /* the swizzle repeats every 1024 bytes */
    uint32_t bar_full = sb + ST * STAGE, bar_empty = bar_full + ST * 8;   /* TMA only */

    int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    int gid = lane >> 2, tig = lane & 3;
    int group = a.n_q_head / a.n_kv_head;
    int g;
    int h0 = gpu_wg_head0(group, per_wg, WGS, blockIdx.y, wg, &g);
    int qt = gridDim.x - 1 - blockIdx.x;       /* longest tiles first */
    int QT = 64 / per_wg;
    int n_keys = a.pos0 + a.n_tok, nq = a.n_q_head * HD;
    float sl2 = a.scale * LOG2E;
    int first_q = a.pos0 + qt * QT;
    int last_q = a.pos0 + min((qt + 1) * QT, a.n_tok) - 1;
    int n_tiles = last_q / GPU_PAGE + 1;

    if constexpr (TMA) {
        if (tid == 0) {
            for (int s = 0; s < ST; s++) {
                mbar_init(bar_full + 8 * s, 1);
                mbar_init(bar_empty + 8 * s, WGS * 4);
            }
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        if (wg == WGS) {
            /* the producer: one thread streams the pages, each stage refilled once its
             * consumers have released it */
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(GPU_TMA_REGS_PRODUCER));
            if (tid == NTHREADS) {
                for (int t = 0; t < n_tiles; t++) {
                    int s = t % ST;
                    if (t >= ST) mbar_wait(bar_empty + 8 * s, (t / ST + 1) & 1);
                    int32_t pg = __ldg(a.pages + t);
                    int rk = (int)gpu_kv_row(pg, a.page_elems, a.layer, 0, a.n_kv_head, g, HD);
                    int rv = (int)gpu_kv_row(pg, a.page_elems, a.layer, 1, a.n_kv_head, g, HD);
                    uint32_t st = sb + (uint32_t)s * STAGE, full = bar_full + 8 * s;
                    mbar_expect(full, STAGE);
#pragma unroll
                    for (int b = 0; b < HD / 64; b++) {
                        tma_load_2d(st + b * (GPU_PAGE * 128), &kv_map, b * 64, rk, full);
                        tma_load_2d(st + TILE + b * (GPU_PAGE * 128), &kv_map, b * 64, rv, full);
                    }
                }
            }
            return;
        }
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(GPU_TMA_REGS_CONSUMER(WGS)));
    }

    int row0, row1, ho0, ho1;
    gpu_wg_row(per_wg, qt, warp, gid, 0, &row0, &ho0);
    gpu_wg_row(per_wg, qt, warp, gid, 1, &row1, &ho1);
    /* Q as wgmma A fragments, once (rows past the chunk read its last row; never written) */
    uint32_t qa[KT][4];
    {
        const __nv_bfloat16 *q0 = (const __nv_bfloat16 *)a.q + (size_t)min(row0, a.n_tok - 1) * nq +
                                  (size_t)(h0 + ho0) * HD + tig * 2;
        const __nv_bfloat16 *q1 = (const __nv_bfloat16 *)a.q + (size_t)min(row1, a.n_tok - 1) * nq +
                                  (size_t)(h0 + ho1) * HD + tig * 2;
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            qa[kk][0] = *(const uint32_t *)(q0 + kk * 16);
            qa[kk][1] = *(const uint32_t *)(q1 + kk * 16);
            qa[kk][2] = *(const uint32_t *)(q0 + kk * 16 + 8);
            qa[kk][3] = *(const uint32_t *)(q1 + kk * 16 + 8);
        }
    }
    int qpos0 = a.pos0 + row0, qpos1 = a.pos0 + row1;

    auto load = [&](int t) {
        if (t < n_tiles) {
            const __nv_bfloat16 *pool = (const __nv_bfloat16 *)a.pool;
            const uint4 *gk = (const uint4 *)(pool + (size_t)gpu_kv_row(a.pages[t], a.page_elems, a.layer, 0,
                                                                       a.n_kv_head, g, HD) * HD);
            const uint4 *gv = (const uint4 *)(pool + (size_t)gpu_kv_row(a.pages[t], a.page_elems, a.layer, 1,
                                                                       a.n_kv_head, g, HD) * HD);
            uint32_t st = sb + (uint32_t)(t % ST) * STAGE;
            for (int i = tid; i < GPU_PAGE * HD / 8; i += NTHREADS) {
                int row = i / (HD / 8), d = (i % (HD / 8)) * 8;
                int bytes = t * GPU_PAGE + row < n_keys ? 16 : 0;
                uint32_t off = gpu_sw128_offset(row, d);
                cp_async16_s(st + off, gk + i, bytes);
                cp_async16_s(st + TILE + off, gv + i, bytes);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    /* page t's copies have landed in every thread and the stage of page t - 1 is free */
    auto arrive = [&]() {
        /* the copies are generic-proxy writes that the tensor cores read next */
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    };
    auto stage_k = [&](int t) { return sb + (uint32_t)(t % ST) * STAGE; };
    /* TMA: page t has landed. The copies take whole pages, so the values past the last key
     * (never written, or another sequence's) are zeroed here as cp.async's zero fill does:
     * a key of weight 0 then adds exactly 0 */
    auto wait_full = [&](int t) {
        mbar_wait(bar_full + 8 * (t % ST), (t / ST) & 1);
        int valid = n_keys - t * GPU_PAGE;
        if (valid < GPU_PAGE) {
            uint32_t v = stage_k(t) + TILE;
            for (int b = 0; b < HD / 64; b++)
                for (int i = valid * 8 + tid; i < GPU_PAGE * 8; i += NTHREADS)
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(
                                     v + b * (GPU_PAGE * 128) + i * 16),
                                 "r"(0)
                                 : "memory");
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            asm volatile("bar.sync 1, %0;\n" ::"n"(NTHREADS) : "memory");
        }
    };
    /* TMA: this warp's products have read page t */
    auto release = [&](int t) {
        if (lane == 0) mbar_arrive(bar_empty + 8 * (t % ST));
    };
    /* issues S = Q K^T for page t into sc (asynchronous: the caller commits and waits) */
    auto scores = [&](int t, float (&sc)[32]) { wg_scores<HD>(sc, qa, stage_k(t)); };

    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.f;

    /* the online softmax of page t's scores into P (bf16 A fragments) and the rescaled O;
     * then issues O += P V for page t */
    auto softmax_pv = [&](int t, float (&sc)[32]) {
        int k0 = t * GPU_PAGE;
        int need_mask = k0 + GPU_PAGE - 1 > first_q || k0 + GPU_PAGE > n_keys;
        /* masked keys are left in the accumulators (nothing but the products writes them, so
         * the compiler keeps the next page's products in flight) and skipped where read */
        auto hidden = [&](int j, int e, int qpos) {
            int key = k0 + j * 8 + tig * 2 + (e & 1);
            return need_mask && (key > qpos || key >= n_keys);
        };
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                mx0 = fmaxf(mx0, hidden(j, e, qpos0) ? -INFINITY : sc[4 * j + e]);
                mx1 = fmaxf(mx1, hidden(j, e, qpos1) ? -INFINITY : sc[4 * j + 2 + e]);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        float mn0 = fmaxf(m0, mx0 * sl2), mn1 = fmaxf(m1, mx1 * sl2);
        float al0 = mn0 == -INFINITY ? 1.f : ex2_ftz(m0 - mn0);
        float al1 = mn1 == -INFINITY ? 1.f : ex2_ftz(m1 - mn1);
        /* a row with every key so far masked has every key of this page masked too: any
         * finite offset serves, and the masked scores become 2^-inf = 0 */
        float off0 = mn0 == -INFINITY ? 0.f : mn0, off1 = mn1 == -INFINITY ? 0.f : mn1;
        float sum0 = 0.f, sum1 = 0.f;
        uint32_t pa[GPU_PAGE / 16][4];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            float x0 = fmaf(sc[4 * j + 0], sl2, -off0), x1 = fmaf(sc[4 * j + 1], sl2, -off0);
            float x2 = fmaf(sc[4 * j + 2], sl2, -off1), x3 = fmaf(sc[4 * j + 3], sl2, -off1);
            if (need_mask) {
                if (hidden(j, 0, qpos0)) x0 = -INFINITY;
                if (hidden(j, 1, qpos0)) x1 = -INFINITY;
                if (hidden(j, 0, qpos1)) x2 = -INFINITY;
                if (hidden(j, 1, qpos1)) x3 = -INFINITY;
            }
            float p0 = ex2_ftz(x0), p1 = ex2_ftz(x1), p2 = ex2_ftz(x2), p3 = ex2_ftz(x3);
            sum0 += p0 + p1;
            sum1 += p2 + p3;
            /* keys 8j..8j+7 are half of the 16-key step j/2: a0/a1 low, a2/a3 high */
            pa[j / 2][(j & 1) * 2 + 0] = pack2_bf16(p0, p1);
            pa[j / 2][(j & 1) * 2 + 1] = pack2_bf16(p2, p3);
        }
        sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
        sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
        sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
        sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
        l0 = l0 * al0 + sum0;
        l1 = l1 * al1 + sum1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int j = 0; j < DT; j++) {
            o[4 * j + 0] *= al0;
            o[4 * j + 1] *= al0;
            o[4 * j + 2] *= al1;
            o[4 * j + 3] *= al1;
        }
        wg_pv<HD>(o, pa, stage_k(t) + TILE);
    };

    float sa[32], sn[32];
#pragma unroll
    for (int i = 0; i < 32; i++) sa[i] = sn[i] = 0.f;

    if constexpr (!TMA) {
#pragma unroll
        for (int s = 0; s < ST - 1; s++) load(s);
    }
    /* page t is in its stage, and (cp.async) the next copy is issued */
    auto ready = [&](int t) {
        if constexpr (TMA) {
            wait_full(t);
        } else {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2));
            arrive();
            load(t + ST - 1);
        }
    };
    if constexpr (!PIPE) {
        /* per page: wait for it, S, softmax, P V, each product waited for at once */
        for (int t = 0; t < n_tiles; t++) {
            ready(t);
            scores(t, sa);
            wg_wait0();
            reg_fence(sa);
            softmax_pv(t, sa);
            wg_wait0();
            reg_fence(o);
            if constexpr (TMA) release(t);
        }
    } else {
        /* the tensor cores compute page t + 1's scores while this warpgroup runs page t's
         * softmax: two score tiles in registers, taking turns */
        if constexpr (TMA) {
            wait_full(0);
        } else {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2));
            arrive();
        }
        scores(0, sa);
        wg_wait0();
        reg_fence(sa);
        auto step = [&](int t, float (&cur)[32], float (&next)[32]) {
            /* cp.async: pages up to t + 1 in (ST - 1 + t copies issued before this one) */
            if constexpr (TMA) {
                if (t + 1 < n_tiles) wait_full(t + 1);
            } else {
                asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 3));
                arrive();
                load(t + ST - 1);
            }
            if (t + 1 < n_tiles) scores(t + 1, next);
            softmax_pv(t, cur);
            wg_wait0();
            reg_fence(o);
            reg_fence(next);
            if constexpr (TMA) release(t);
        };
        int t = 0;
        for (; t + 1 < n_tiles; t += 2) {
            step(t, sa, sn);
            step(t + 1, sn, sa);
        }
        if (t < n_tiles) step(t, sa, sn);
    }
    if constexpr (!TMA) asm volatile("cp.async.wait_group 0;\n" ::);

    float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    if (per_wg == 2) {
        /* row0 == row1: the even head (h0) and the odd head (h0 + 1) of one position */
        if (row0 < a.n_tok) {
            float lam = a.lambda[(size_t)row0 * a.lambda_stride + h0 / 2];
            float sg = 1.f / (1.f + __expf(-lam));
            __nv_bfloat16 *out = (__nv_bfloat16 *)a.out + (size_t)row0 * (nq / 2) + (size_t)(h0 / 2) * HD + tig * 2;
#pragma unroll
            for (int j = 0; j < DT; j++)
                *(uint32_t *)(out + j * 8) =
                    pack2_bf16(o[4 * j + 0] * inv0 - sg * (o[4 * j + 2] * inv1),
                               o[4 * j + 1] * inv0 - sg * (o[4 * j + 3] * inv1));
        }
    } else {
        __nv_bfloat16 *out = (__nv_bfloat16 *)a.out + (size_t)h0 * HD + tig * 2;
#pragma unroll
        for (int j = 0; j < DT; j++) {
            if (row0 < a.n_tok)
                *(uint32_t *)(out + (size_t)row0 * nq + j * 8) = pack2_bf16(o[4 * j] * inv0, o[4 * j + 1] * inv0);
            if (row1 < a.n_tok)
                *(uint32_t *)(out + (size_t)row1 * nq + j * 8) = pack2_bf16(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
        }
    }
#else
    (void)a;
    (void)per_wg;
#endif
}

/* The products of the attention kernel alone, on one page (GpuApi.wgmma_probe): if the GPU
 * checks fail, this tells the operand layouts and descriptors apart from the rest. */
template <int HD>
__global__ void __launch_bounds__(128) k_wgmma_probe(const uint16_t *a, const uint16_t *page,
                                                     float *dk, float *dv)
{
#ifdef DIFFRAG_WGMMA
    extern __shared__ unsigned char smem_raw[];
    uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem_raw);
    uint32_t sb = (raw + 1023u) & ~1023u;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
    for (int i = tid; i < GPU_PAGE * HD / 8; i += 128) {
        int row = i / (HD / 8), d = (i % (HD / 8)) * 8;
        *(uint4 *)(smem_raw + (sb - raw) + gpu_sw128_offset(row, d)) = ((const uint4 *)page)[i];
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    int r0 = warp * 16 + gid, r1 = r0 + 8;
    uint32_t qa[HD / 16][4];
    const uint16_t *a0 = a + r0 * HD + tig * 2, *a1 = a + r1 * HD + tig * 2;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        qa[kk][0] = *(const uint32_t *)(a0 + kk * 16);
        qa[kk][1] = *(const uint32_t *)(a1 + kk * 16);
        qa[kk][2] = *(const uint32_t *)(a0 + kk * 16 + 8);
        qa[kk][3] = *(const uint32_t *)(a1 + kk * 16 + 8);
    }
    float s[32], o[HD / 2];
#pragma unroll
    for (int i = 0; i < 32; i++) s[i] = 0.f;
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.f;
    /* the same calls as the attention kernel's, the page serving as keys and as values */
    wg_scores<HD>(s, qa, sb);
    wg_wait0();
    reg_fence(s);
    wg_pv<HD>(o, qa, sb);
    wg_wait0();
    reg_fence(o);
#pragma unroll
    for (int j = 0; j < GPU_PAGE / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[(e < 2 ? r0 : r1) * GPU_PAGE + j * 8 + tig * 2 + (e & 1)] = s[4 * j + e];
#pragma unroll
    for (int j = 0; j < HD / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) dv[(e < 2 ? r0 : r1) * HD + j * 8 + tig * 2 + (e & 1)] = o[4 * j + e];
#else
    (void)a;
    (void)page;
    (void)dk;
    (void)dv;
#endif
}

template <int HD>
static void probe(GpuCtx *c, const uint16_t *a, const uint16_t *page, float *dk, float *dv)
{
    int smem = GPU_PAGE * HD * 2 + 1024;
    gpu_note(c, cudaFuncSetAttribute(k_wgmma_probe<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "wgmma probe shared memory");
    k_wgmma_probe<HD><<<1, 128, smem, c->stream>>>(a, page, dk, dv);
    GPU_LAUNCHED(c, "wgmma probe");
}

int cuda_wgmma_probe(GpuCtx *c, int head_dim, const uint16_t *a, const uint16_t *page, float *d_k,
                     float *d_v)
{
    if (!c->sm90 || (head_dim != 64 && head_dim != 128)) return -1;
    if (head_dim == 64) probe<64>(c, a, page, d_k, d_v);
    else probe<128>(c, a, page, d_k, d_v);
    return 0;
}

template <int HD, int WGS, bool PIPE, bool TMA>
static void launch(GpuCtx *c, const GpuAttnArgs *a, const GpuWgPlan *p, const CUtensorMap *map)
{
    size_t smem = PIPE ? p->smem_pipe : p->smem;
    gpu_note(c, cudaFuncSetAttribute(k_attn_prefill_wgmma<HD, WGS, PIPE, TMA>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
             "wgmma attention shared memory");
    dim3 grid(p->blocks_x, p->blocks_y);
    int threads = TMA ? GPU_TMA_THREADS(WGS) : WGS * 128;
    k_attn_prefill_wgmma<HD, WGS, PIPE, TMA><<<grid, threads, smem, c->stream>>>(*map, *a, p->per_wg);
    GPU_LAUNCHED(c, TMA ? "prefill attention (wgmma, TMA)" : "prefill attention (wgmma)");
}

/* the plans' warpgroup counts: up to gpu_wg_max, or gpu_tma_max_wgs with TMA */
template <bool PIPE, bool TMA>
static void launch_any(GpuCtx *c, const GpuAttnArgs *a, const GpuWgPlan *p, const CUtensorMap *map)
{
    if (a->head_dim == 64) {
        if constexpr (!(TMA && PIPE)) {
            if (p->wgs == 3) return launch<64, 3, PIPE, TMA>(c, a, p, map);
        }
        if (p->wgs == 2) launch<64, 2, PIPE, TMA>(c, a, p, map);
        else launch<64, 1, PIPE, TMA>(c, a, p, map);
    } else {
        if (p->wgs == 2) launch<128, 2, PIPE, TMA>(c, a, p, map);
        else launch<128, 1, PIPE, TMA>(c, a, p, map);
    }
}

/* The tensor map of the pool (struct GpuTmaGeom) through the driver's encoder, which the
 * runtime hands out (no link to the driver library): 0; -1 when the pool cannot be seen so
 * (nothing noted: the caller falls back); 1 on a failure, noted for gpu_sync. */
static int tma_map(GpuCtx *c, const GpuAttnArgs *a, CUtensorMap *map)
{
    GpuTmaGeom g;
    if (a->pool_pages < 1) {
        gpu_note(c, cudaErrorInvalidValue, "TMA attention: the pool's size (pool_pages) is not set");
        return 1;
    }
    if (gpu_tma_geom(a->pool_pages, a->page_elems, a->head_dim, &g)) return -1;
    if (!c->tma_looked) {
        c->tma_looked = 1;
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            c->tma_encode = fn;
    }
    if (!c->tma_encode) {
        if (!c->err[0])
            snprintf(c->err, sizeof c->err, "TMA attention: the driver has no cuTensorMapEncodeTiled");
        return 1;
    }
    cuuint64_t dims[2] = {g.dims[0], g.dims[1]}, strides[1] = {g.row_bytes};
    cuuint32_t box[2] = {g.box[0], g.box[1]}, elem[2] = {1, 1};
    CUresult r = ((PFN_cuTensorMapEncodeTiled_v12000)c->tma_encode)(
        map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)a->pool, dims, strides, box, elem,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        if (!c->err[0])
            snprintf(c->err, sizeof c->err, "TMA attention: cuTensorMapEncodeTiled failed (CUresult %d) "
                     "for %llu rows of %d", (int)r, (unsigned long long)g.dims[1], a->head_dim);
        return 1;
    }
    return 0;
}

int cuda_prefill_wgmma(GpuCtx *c, const GpuAttnArgs *a, int pipelined, int tma)
{
    GpuWgPlan p;
    int diff = a->lambda != NULL;
    if (!c->sm90 ||
        (tma ? gpu_tma_plan(a->n_tok, a->n_q_head, a->n_kv_head, a->head_dim, diff, pipelined, &p)
             : gpu_wg_plan(a->n_tok, a->n_q_head, a->n_kv_head, a->head_dim, diff, &p)) ||
        (pipelined ? p.smem_pipe : p.smem) > c->smem_optin)
        return -1;
    CUtensorMap map;
    memset(&map, 0, sizeof map);
    if (tma) {
        int r = tma_map(c, a, &map);
        if (r) return r < 0 ? -1 : 0;       /* an error noted counts as handled */
        if (pipelined) launch_any<true, true>(c, a, &p, &map);
        else launch_any<false, true>(c, a, &p, &map);
    } else if (pipelined) {
        launch_any<true, false>(c, a, &p, &map);
    } else {
        launch_any<false, false>(c, a, &p, &map);
    }
    return 0;
}
