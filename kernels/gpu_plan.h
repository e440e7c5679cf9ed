/* Host-side planning for the GPU backend, in plain C so the CPU unit tests check it without a
 * GPU (tests/test_gpu_plan.c): the attention kernels' launch shapes, the KV page pool's
 * bookkeeping, and the memory a GPU context needs. */
#ifndef DIFFRAG_GPU_PLAN_H
#define DIFFRAG_GPU_PLAN_H

#include <pthread.h>
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

/* The KV page pool: n_pages pages of page_bytes in one device allocation, handed out to
 * sequences and taken back. Host bookkeeping only; thread safe. */
struct GpuKvPool {
    pthread_mutex_t mu;
    void *base;                /* device memory */
    size_t page_bytes;
    int n_pages;
    int n_free;
    int32_t *free_list;        /* (n_pages) stack of free page ids */
};

/* Elements (bf16) of one page for a model's shape. */
static inline size_t gpu_page_elems(int n_layer, int n_kv_head, int head_dim)
{
    return (size_t)n_layer * 2 * n_kv_head * GPU_PAGE * head_dim;
}

int gpu_pool_init(struct GpuKvPool *p, void *base, size_t page_bytes, int n_pages);
void gpu_pool_fini(struct GpuKvPool *p);
/* Takes n pages into out[]: 0, or -1 (nothing taken) when fewer than n are free. */
int gpu_pool_take(struct GpuKvPool *p, int n, int32_t *out);
void gpu_pool_give(struct GpuKvPool *p, int n, const int32_t *pages);
int gpu_pool_free_pages(struct GpuKvPool *p);

#endif
