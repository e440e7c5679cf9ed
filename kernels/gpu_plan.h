/* Host-side planning for the GPU backend, in plain C so the CPU unit tests check it without a
 * GPU (tests/test_gpu_plan.c): the attention kernels' launch shapes and the memory a GPU
 * context needs (the KV page pool's bookkeeping is model/kvpool.h's). */
#ifndef DIFFRAG_GPU_PLAN_H
#define DIFFRAG_GPU_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/gpu.h"

/* Prefill attention (tensor cores): a block takes GPU_QTILE query positions of `heads`
 * query heads that share one KV head, four warps (16 rows each) per head, so each K/V tile
 * it loads serves all of them. DIFF V2 pairs stay in one block (heads is even) so the
 * combine happens in the block's epilogue. */
#define GPU_QTILE 64

struct GpuAttnPlan {
    int heads;                 /* query heads per block (divides the group size) */
    int warps;                 /* 4 * heads */
    int blocks_x;              /* query tiles: ceil(n_tok / GPU_QTILE) */
    int blocks_y;              /* n_kv_head * group / heads */
    size_t smem;               /* dynamic shared memory bytes per block (WMMA kernel) */
    size_t smem_mma;           /* the same for the mma.sync kernel */
};

/* The largest warp count per block the kernel for head_dim allows (register budget). */
static inline int gpu_attn_max_warps(int head_dim) { return head_dim <= 64 ? 16 : 8; }

/* Bytes of shared memory: K and V tiles (GPU_PAGE rows of head_dim + 8 bf16) plus, per warp,
 * a 16-row f32 tile of max(GPU_PAGE, head_dim) + 4 columns and a 16-row bf16 tile of
 * GPU_PAGE + 8. */
static inline size_t gpu_attn_smem(int head_dim, int warps)
{
    int wide = head_dim > GPU_PAGE ? head_dim : GPU_PAGE;
    return 2u * GPU_PAGE * (head_dim + 8) * 2 +
           (size_t)warps * (16u * (wide + 4) * 4 + 16u * (GPU_PAGE + 8) * 2);
}

/* The register-resident kernel's shared memory: two stages of K and V pages (the DIFF V2
 * hand-over after the loop reuses them: at most 8 slots of 16 x head_dim floats, which fit). */
static inline size_t gpu_attn_smem_mma(int head_dim)
{
    return 2u * 2u * GPU_PAGE * (head_dim + 8) * 2;
}

/* 0, or -1 when the shape is not handled (head_dim not 64 or 128, heads not a multiple of
 * the KV heads, DIFF V2 with an odd group). */
static inline int gpu_attn_plan(int n_tok, int n_q_head, int n_kv_head, int head_dim, int diff,
                                struct GpuAttnPlan *p)
{
    if ((head_dim != 64 && head_dim != 128) || n_kv_head < 1 || n_q_head % n_kv_head ||
        n_tok < 1)
        return -1;
    int group = n_q_head / n_kv_head;
    if (diff && group % 2) return -1;
    int best = 0;
    for (int h = 1; h <= group; h++)
        if (group % h == 0 && (!diff || h % 2 == 0) && 4 * h <= gpu_attn_max_warps(head_dim))
            best = h;
    if (!best) return -1;
    p->heads = best;
    p->warps = 4 * best;
    p->blocks_x = (n_tok + GPU_QTILE - 1) / GPU_QTILE;
    p->blocks_y = n_kv_head * (group / best);
    p->smem = gpu_attn_smem(head_dim, p->warps);
    p->smem_mma = gpu_attn_smem_mma(head_dim);
    return 0;
}

/* Prefill attention on Hopper (wgmma, sm_90a only; DIFFRAG_GPU_ATTENTION=wgmma). A warpgroup
 * computes 64 query rows with warpgroup-wide wgmma instructions: one query head's 64
 * positions, or for DIFF V2 one pair's 32 positions, arranged so that in each warp's 16 rows
 * row gid holds the even head and row gid + 8 the odd head of the same position (the
 * accumulator layout then puts both in the same thread, and the combine needs no exchange).
 * A block holds `wgs` warpgroups of one KV group at the same positions, so each K/V page it
 * loads serves wgs * 64 query rows; pages stream through shared-memory stages laid out with
 * the 128-byte swizzle the wgmma descriptors name: three stages, or four for the pipelined
 * form, in which the tensor cores compute the next page's scores during this page's softmax. */
#define GPU_WG_STAGES(pipe) ((pipe) ? 4 : 3)

#if defined(__CUDACC__)
#define GPU_HD __host__ __device__
#else
#define GPU_HD
#endif

struct GpuWgPlan {
    int per_wg;                /* query heads a warpgroup computes: 2 for DIFF V2, else 1 */
    int qt;                    /* query positions a block covers: 64 / per_wg */
    int wgs;                   /* warpgroups per block */
    int blocks_x;              /* ceil(n_tok / qt) */
    int blocks_y;              /* n_kv_head * (group / per_wg) / wgs */
    size_t smem;               /* dynamic shared memory bytes (with 1 KiB for alignment) */
    size_t smem_pipe;          /* the same for the pipelined form */
};

/* The most warpgroups a block takes (the kernel's register cap at one block a multiprocessor). */
static inline int gpu_wg_max(int head_dim) { return head_dim <= 64 ? 3 : 2; }

static inline size_t gpu_wg_smem(int head_dim, int pipe)
{
    return (size_t)GPU_WG_STAGES(pipe) * 2u * GPU_PAGE * head_dim * 2 + 1024;
}

/* The launch shape with at most max_wgs warpgroups a block (the shared part of the plans). */
static inline int gpu_wg_shape(int n_tok, int n_q_head, int n_kv_head, int head_dim, int diff,
                               int max_wgs, struct GpuWgPlan *p)
{
    if ((head_dim != 64 && head_dim != 128) || n_kv_head < 1 || n_q_head % n_kv_head ||
        n_tok < 1)
        return -1;
    int group = n_q_head / n_kv_head;
    if (diff && group % 2) return -1;
    p->per_wg = diff ? 2 : 1;
    p->qt = 64 / p->per_wg;
    int units = group / p->per_wg;
    p->wgs = 1;
    for (int w = 1; w <= max_wgs; w++)
        if (units % w == 0) p->wgs = w;
    p->blocks_x = (n_tok + p->qt - 1) / p->qt;
    p->blocks_y = n_kv_head * (units / p->wgs);
    return 0;
}

static inline int gpu_wg_plan(int n_tok, int n_q_head, int n_kv_head, int head_dim, int diff,
                              struct GpuWgPlan *p)
{
    if (gpu_wg_shape(n_tok, n_q_head, n_kv_head, head_dim, diff, gpu_wg_max(head_dim), p))
        return -1;
    p->smem = gpu_wg_smem(head_dim, 0);
    p->smem_pipe = gpu_wg_smem(head_dim, 1);
    return 0;
}

/* The same kernel fed by the tensor memory accelerator (DIFFRAG_GPU_ATTENTION=wgmma-tma and
 * wgmma-tma-pipe): the block's wgs consumer warpgroups are followed by a producer warpgroup
 * of which one thread issues the TMA copies of each K/V page into GPU_TMA_STAGES stages of
 * the same swizzled layout (a box of GPU_PAGE rows by 64 dimensions is one 128-byte-swizzled
 * atom), so the consumers neither compute addresses nor wait for each other. Each stage has
 * a "full" barrier (complete when the copies' bytes have landed) and an "empty" one (one
 * arrival per consumer warp once its products have read the page). The producer gives up
 * registers with setmaxnreg and the consumers take them: with T threads and B blocks a
 * multiprocessor, every thread starts with min(255, 65536 / (T B)) registers (rounded down
 * to 8), and 128 * producer + wgs * 128 * consumer must not exceed what the block started
 * with (tests/test_gpu_plan.c). */
#define GPU_TMA_STAGES 4
#define GPU_TMA_THREADS(wgs) (((wgs) + 1) * 128)
#define GPU_TMA_MIN_BLOCKS(wgs) ((wgs) == 1 ? 2 : 1)
#define GPU_TMA_REGS_PRODUCER 24
#define GPU_TMA_REGS_CONSUMER(wgs) ((wgs) == 1 ? 232 : (wgs) == 2 ? 240 : 160)

/* At most three consumers (160 registers each) for head_dim 64 unpipelined (which needs
 * about 125), else two (240: the pipelined form keeps two score tiles). */
static inline int gpu_tma_max_wgs(int head_dim, int pipe) { return head_dim <= 64 && !pipe ? 3 : 2; }

/* The stages, then the 2 * GPU_TMA_STAGES barriers (8 bytes each), plus 1 KiB for alignment. */
static inline size_t gpu_tma_smem(int head_dim)
{
    return (size_t)GPU_TMA_STAGES * 2u * GPU_PAGE * head_dim * 2 + 2u * GPU_TMA_STAGES * 8 + 1024;
}

static inline int gpu_tma_plan(int n_tok, int n_q_head, int n_kv_head, int head_dim, int diff,
                               int pipe, struct GpuWgPlan *p)
{
    if (gpu_wg_shape(n_tok, n_q_head, n_kv_head, head_dim, diff, gpu_tma_max_wgs(head_dim, pipe), p))
        return -1;
    p->smem = p->smem_pipe = gpu_tma_smem(head_dim);
    return 0;
}

/* The TMA kernels' view of the page pool: a matrix of head_dim-wide bf16 rows, copied in
 * boxes of 64 dimensions by GPU_PAGE rows (the 128-byte swizzle allows boxes 128 bytes wide;
 * head_dim 128 takes two, into the two halves gpu_sw128_offset lays out). */
struct GpuTmaGeom {
    uint64_t dims[2];          /* elements of a row (head_dim), rows */
    uint64_t row_bytes;        /* the stride of dimension 1 */
    uint32_t box[2];           /* 64, GPU_PAGE */
    int boxes;                 /* per page: head_dim / 64 */
};

/* 0, or -1 when the pool cannot be seen so (another head_dim, or rows beyond a 32-bit
 * coordinate). */
static inline int gpu_tma_geom(int pool_pages, size_t page_elems, int head_dim, struct GpuTmaGeom *g)
{
    if ((head_dim != 64 && head_dim != 128) || pool_pages < 1 || page_elems % (size_t)head_dim)
        return -1;
    uint64_t rows = (uint64_t)pool_pages * (page_elems / (size_t)head_dim);
    if (rows > 0x7fffffffu) return -1;
    g->dims[0] = (uint64_t)head_dim;
    g->dims[1] = rows;
    g->row_bytes = (uint64_t)head_dim * 2;
    g->box[0] = 64;
    g->box[1] = GPU_PAGE;
    g->boxes = head_dim / 64;
    return 0;
}

/* The query row that lane (gid = lane / 4) of `warp` (0-3 in its warpgroup) holds in
 * accumulator rows gid (upper 0) and gid + 8 (upper 1), for query tile qt: the chunk row
 * (token index) and the head's offset within the warpgroup's heads. */
GPU_HD static inline void gpu_wg_row(int per_wg, int qt, int warp, int gid, int upper, int *row,
                                     int *head_off)
{
    if (per_wg == 2) {
        *row = qt * 32 + warp * 8 + gid;
        *head_off = upper;
    } else {
        *row = qt * 64 + warp * 16 + gid + 8 * upper;
        *head_off = 0;
    }
}

/* The first query head of warpgroup wg of block row by (blockIdx.y), and its KV head. */
GPU_HD static inline int gpu_wg_head0(int group, int per_wg, int wgs, int by, int wg, int *kv)
{
    int subs = group / per_wg / wgs;
    *kv = by / subs;
    return *kv * group + ((by % subs) * wgs + wg) * per_wg;
}

/* Byte offset of element (row, d) of a K or V page in shared memory: 64-dimension halves one
 * after the other (GPU_PAGE rows of 128 bytes each), and in a row the 16-byte chunk c stored
 * at c ^ (row % 8): the 128-byte swizzle, given a 1024-byte aligned page. */
GPU_HD static inline uint32_t gpu_sw128_offset(int row, int d)
{
    return (uint32_t)((d / 64) * (GPU_PAGE * 128) + row * 128 + ((((d % 64) / 8) ^ (row & 7)) * 16) +
                      (d % 8) * 2);
}

/* A wgmma shared-memory matrix descriptor: start address, leading and stride byte offsets
 * (all in 16-byte units), 128-byte swizzle. */
GPU_HD static inline uint64_t gpu_wgmma_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFFu) << 16 |
           (uint64_t)((sbo >> 4) & 0x3FFFu) << 32 | (uint64_t)1 << 62;
}

/* The descriptors the kernel gives each 16-deep step: keys (S = Q K^T, K-major, depth = head
 * dimension) and values (O = P V, MN-major, depth = keys), for a page at shared address base. */
GPU_HD static inline uint64_t gpu_wg_desc_k(uint32_t base, int step)
{
    return gpu_wgmma_desc(base + (uint32_t)(step / 4) * (GPU_PAGE * 128) + (uint32_t)(step % 4) * 32,
                          16, 1024);
}
GPU_HD static inline uint64_t gpu_wg_desc_v(uint32_t base, int step)
{
    return gpu_wgmma_desc(base + (uint32_t)step * 2048, GPU_PAGE * 128, 1024);
}

/* The first row, in the TMA kernels' view of the pool (struct GpuTmaGeom), of the GPU_PAGE
 * rows of KV head g, kind c (0 keys, 1 values) and layer l in page p. */
GPU_HD static inline int64_t gpu_kv_row(int32_t p, size_t page_elems, int layer, int kind,
                                        int n_kv_head, int g, int head_dim)
{
    return (int64_t)p * (int64_t)(page_elems / (size_t)head_dim) +
           ((int64_t)(layer * 2 + kind) * n_kv_head + g) * GPU_PAGE;
}

/* Decode attention (one query token, flash-decoding): the keys are cut into `splits` ranges
 * of whole pages, each range one block per KV head; a second kernel merges the ranges. */
struct GpuDecodePlan {
    int splits;
    int pages_per_split;
    size_t work_floats;        /* partial-state floats: n_q_head * splits * (head_dim + 4) */
};

static inline void gpu_decode_plan(int n_keys, int n_q_head, int n_kv_head, int head_dim,
                                   int n_sm, struct GpuDecodePlan *p)
{
    int pages = (n_keys + GPU_PAGE - 1) / GPU_PAGE;
    /* about four blocks per multiprocessor, and at least 4 pages per block */
    int want = (4 * (n_sm > 0 ? n_sm : 1) + n_kv_head - 1) / n_kv_head;
    int per = (pages + want - 1) / want;
    if (per < 4) per = 4;
    p->pages_per_split = per;
    p->splits = (pages + per - 1) / per;
    p->work_floats = (size_t)n_q_head * p->splits * (head_dim + 4);
}

/* The tensor-core decode kernel's shared memory: a K and a V page per warp (4 warps), which
 * also holds the warps' merge (4 x 16 rows of head_dim + 4 floats) afterwards. */
static inline size_t gpu_decode_smem_mma(int head_dim)
{
    return 4u * 2u * GPU_PAGE * (head_dim + 8) * 2;
}

/* The most splits gpu_decode_plan gives at any length (workspace sizing): ceil(pages / per)
 * with per >= ceil(pages / want) never exceeds want. */
static inline int gpu_decode_max_splits(int n_kv_head, int n_sm)
{
    return (4 * (n_sm > 0 ? n_sm : 1) + n_kv_head - 1) / n_kv_head;
}

/* Sampling's candidates on the device (kernels/cuda/sample.cu) by radix select: the weights
 * w are non-negative floats, whose bit patterns order as their values do, so four passes of
 * GPU_RADIX_BITS bits, from the top, narrow a prefix down to the exact bit pattern at which
 * a running total from the largest w reaches what is wanted: a count (the top k) or a mass
 * (top-p). Each pass makes a histogram, over the GPU_RADIX digits at its shift, of the w
 * that match the prefix so far (a count, or their sum), then descends into one digit. */
#define GPU_RADIX_BITS 8
#define GPU_RADIX (1 << GPU_RADIX_BITS)
/* Vocabularies up to this size: counts kept in floats stay exact. */
#define GPU_SAMPLE_MAX_N (1 << 24)

/* The digit to descend into: scanning from the largest, the first at which the running total
 * reaches want, with *above the total of the digits above it (the next pass wants
 * want - *above). When the total falls short of want (a mass summed in another order), the
 * smallest non-empty digit, so that the selection keeps everything there is. */
GPU_HD static inline int gpu_radix_digit(const float *hist, float want, float *above)
{
    float acc = 0.f;
    int last = -1;
    for (int d = GPU_RADIX - 1; d >= 0; d--) {
        if (hist[d] == 0.f) continue;
        if (acc + hist[d] >= want) {
            *above = acc;
            return d;
        }
        acc += hist[d];
        last = d;
    }
    if (last < 0) {
        *above = 0.f;
        return 0;
    }
    *above = acc - hist[last];
    return last;
}

/* Elements (bf16) of one page for a model's shape. */
static inline size_t gpu_page_elems(int n_layer, int n_kv_head, int head_dim)
{
    return (size_t)n_layer * 2 * n_kv_head * GPU_PAGE * head_dim;
}

#endif
