/* The backend interface: the small table of operations the engine's forward pass calls.
 * model/ decides what to compute and calls through this table; kernels/cpu implements it
 * now (kernels/cuda will implement it a second time). Activations are row-major f32; "rows"
 * are tokens. Weight matrices stay in their file encoding (struct Weights) and are decoded
 * inside the products, so a Q4_1 model costs 5 bits per weight in memory, not 32.
 *
 * KV cache layout (chosen by the backend, sized by kv_head_stride): per layer and KV head a
 * run of kv_head_stride elements holding tiles of KV_TILE positions, kv_tile_elems apart; in
 * tile T (positions T*KV_TILE ..) the keys are stored transposed, K[d][pos % KV_TILE], so a
 * tile of scores is a plain matrix product, and the values as rows, V[pos % KV_TILE][d].
 * Elements are f32, f16 or, for KV_Q8, int8: each position's key (and value) of a head is
 * scaled by its largest magnitude to -127..127, and the tile's int8 block is followed by
 * KV_TILE f32 scales, one per position (value = q * scale). KV_Q8 keys pair their dimensions,
 * K[d/2][pos % KV_TILE][d % 2], so that integer multiply-adds of two dimensions per lane
 * score 16 (AVX-512) keys at once; head_dim is then even and at most 256.
 *
 * Paged caches: a cache may instead be a pool of pages, each holding one tile of every KV
 * head (and layer), kv_head_stride elements apart within the page. A page table maps tile T of
 * a sequence to its page, page_stride elements apart. A contiguous cache is the case
 * pages = NULL (tile T is "page" T) with page_stride = 0 (one head's tiles back to back). */
#ifndef DIFFRAG_BACKEND_H
#define DIFFRAG_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/threadpool.h"

enum KvType { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2 };

#define KV_TILE 64

/* Bytes of one cache element, and elements of one tile of KV_TILE positions. */
static inline size_t kv_elem_bytes(enum KvType t) { return t == KV_F32 ? 4 : t == KV_F16 ? 2 : 1; }
static inline size_t kv_tile_elems(enum KvType t, int head_dim)
{
    return (size_t)head_dim * KV_TILE + (t == KV_Q8 ? KV_TILE * sizeof(float) : 0);
}
/* The position of query row t of an attention call (AttnArgs below). */
#define ATTN_ROW_POS(a, t) ((a)->qpos ? (a)->qpos[t] : (a)->pos0 + (t))

/* Elements from a KV head's start to the tile that holds position pos (contiguous caches). */
static inline size_t kv_tile_at(enum KvType t, int head_dim, int pos)
{
    return (size_t)(pos / KV_TILE) * kv_tile_elems(t, head_dim);
}

/* Elements from the cache's start to the tile of KV head g that holds position pos, contiguous
 * (pages NULL, page_stride 0) or paged (layout above). */
static inline size_t kv_tile_addr(const int32_t *pages, size_t page_stride, size_t head_stride,
                                  enum KvType t, int head_dim, int g, int pos)
{
    size_t tile = (size_t)(pos / KV_TILE);
    size_t page = pages ? (size_t)pages[tile] : tile;
    return (size_t)g * head_stride + page * (page_stride ? page_stride : kv_tile_elems(t, head_dim));
}

/* A weight matrix (rows, cols): row r holds the weights of output r, `cols` inputs wide,
 * encoded as ggml type `type` (GGML_TYPE_* numbers of model/gguf.h: F32, F16, BF16, Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K; see kernels/dequant.h for the block layouts), in one of
 * two layouts:
 *   WEIGHTS_ROWS  the file's: row after row, row_bytes apart (F32, F16, BF16, K-quants);
 *   WEIGHTS_X16   (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) rows interleaved by groups of 16, so that one
 *                 vector holds the same input of 16 outputs: for group G (rows 16G..16G+15, the
 *                 last group padded with zero rows) and block b (columns 32b..32b+31) a tile at
 *                 (G * cols/32 + b) * 16 * block_bytes holds the 16 rows' f16 scales d[16],
 *                 then (Q4_1, Q5_1) the f16 offsets m[16], then (Q5_0, Q5_1) the fifth bits
 *                 as u16 hmask[32], bit j of hmask[c] = row j's fifth bit of column c, then the
 *                 quants: Q4/Q5 16 x 16 bytes, byte 16i + j = byte i of row j's qs (columns i
 *                 and i + 16 as low and high nibble); Q8_0 32 x 16 bytes, byte 16c + j = row
 *                 j's column c.
 * Either way every weight decodes to exactly the value the file's block gives. */
enum WeightsLayout { WEIGHTS_ROWS = 0, WEIGHTS_X16 = 1 };

struct Weights {
    uint32_t type;
    enum WeightsLayout layout;
    int rows, cols;
    size_t row_bytes;          /* bytes of one row's blocks (either layout) */
    const void *data;          /* borrowed from the model's arena (64-byte aligned) */
};

/* One product of a MatmulArgs: y (n, w->rows) = x . w^T, or y += x . w^T. */
struct MatOut {
    const struct Weights *w;   /* (m, k); w->cols == k */
    float *y;                  /* rows y_stride floats apart */
    size_t y_stride;
    int accumulate;            /* 1: add into y (fuses a residual add) */
};

/* Up to 4 products that share one input, run as one parallel job so the input is swept
 * together and the threads meet once. With swiglu = 1, out[0] is the gate and out[1] the up
 * projection (same shape): out[0].y receives silu(x.wg^T) * (x.wu^T) and out[1].y is unused. */
struct MatmulArgs {
    const float *x;            /* (n, k), rows x_stride floats apart */
    size_t x_stride;
    int n, k;
    struct MatOut out[4];
    int n_out;
    int swiglu;
    int rowwise;               /* 1: a single row takes the many-row path too, so every row's
                                  arithmetic is the same however many rows come with it */
    int onerow;                /* 1: every row as its own one-row product (a batch of decode
                                  tokens: each equals its one-token product bit for bit) */
};

/* Causal attention of a chunk of n_tok query tokens at positions pos0..pos0+n_tok-1 against a
 * cache that already holds keys/values for positions 0..pos0+n_tok-1. */
struct AttnArgs {
    const float *q;            /* (n_tok, n_q_head*head_dim), rows q_stride floats apart */
    size_t q_stride;
    float *out;                /* (n_tok, n_q_head*head_dim), or (n_tok, n_q_head/2*head_dim)
                                  when lambda != NULL; rows out_stride floats apart */
    size_t out_stride;
    const void *k, *v;         /* this layer's caches, layout above */
    size_t kv_head_stride;     /* elements per KV head: kv_head_stride(n_ctx, head_dim, type);
                                  paged: between the heads' tiles in a page */
    const int32_t *pages;      /* paged caches: the sequence's page table; NULL: contiguous */
    size_t page_stride;        /* paged: elements between pages; 0: contiguous */
    enum KvType kv_type;
    int n_tok, pos0;
    /* When non-NULL, query row t is at position qpos[t] (increasing; the cache holds keys up
     * to the last) instead of pos0 + t: rows scattered over a sequence in one call (chunk KV
     * reuse recomputes such rows). A row's arithmetic is the same either way. */
    const int32_t *qpos;
    int rowwise;               /* 1: each row's arithmetic is that of a long chunk's, however
                                  few the tokens: the keys are never split (flash-decoding)
                                  and the tiles are always staged in f32 */
    int n_q_head, n_kv_head, head_dim;
    float scale;               /* 1/sqrt(head_dim) */
    /* DIFF V2: when non-NULL, query heads 2i and 2i+1 are combined as
     * out_i = o_2i - sigmoid(lambda[t][i]) * o_2i+1; lambda is (n_tok, n_q_head/2), rows
     * lambda_stride floats apart. */
    const float *lambda;
    size_t lambda_stride;
};

/* RoPE on the chunk's queries and keys, then the keys and values into the cache at pos0. */
struct RopeStoreArgs {
    float *q;                  /* (n_tok, n_q_head*head_dim), rows q_stride apart */
    size_t q_stride;
    float *k;                  /* (n_tok, n_kv_head*head_dim), rows kv_stride apart */
    const float *v;
    size_t kv_stride;
    int n_tok, pos0, n_q_head, n_kv_head, head_dim;
    const int32_t *pos;        /* when non-NULL, row t is stored at position pos[t], not pos0 + t */
    int n_rot, layout;         /* rotated dims per head; 0 adjacent pairs, 1 neox halves */
    const float *cos, *sin;    /* (n_tok, n_rot/2) */
    void *kcache, *vcache;
    enum KvType kv_type;
    size_t kv_head_stride;
    const int32_t *pages;      /* as in AttnArgs */
    size_t page_stride;
};

/* One layer's keys and values at positions pos0..pos0+n_tok-1 copied out of a cache or into
 * one (chunk KV reuse). Packed rows hold, per KV head, the key and then the value, each
 * head_dim elements in the cache's encoding followed, for KV_Q8, by its f32 scale:
 * kv_row_bytes bytes a position, keys as stored (after RoPE). */
struct KvCopyArgs {
    void *kcache, *vcache;     /* this layer's caches, layout above */
    enum KvType kv_type;
    size_t kv_head_stride;
    const int32_t *pages;      /* as in AttnArgs */
    size_t page_stride;
    int n_tok, pos0, n_kv_head, head_dim;
    void *rows;                /* (n_tok) packed rows, row_stride bytes apart */
    size_t row_stride;
    /* kv_read: when k or v is non-NULL, the keys into k and the values into v (either may be
     * NULL: not read) decoded to f32 rows of n_kv_head*head_dim floats (kv_stride apart)
     * instead of packed rows. kv_write with a rotation: one such row each, as scratch. */
    float *k, *v;
    size_t kv_stride;
    /* kv_write: when cos is non-NULL, every key is rotated by the one angle these n_rot/2
     * cosines and sines give (layout as in RopeStoreArgs) on its way in; RoPE rotations
     * compose, so a key stored at position p and rotated by q - p is the key at q. NULL: the
     * rows are copied bit for bit. */
    const float *cos, *sin;
    int n_rot, layout;
};

static inline size_t kv_row_bytes(enum KvType t, int n_kv_head, int head_dim)
{
    return (size_t)n_kv_head * 2 *
           ((size_t)head_dim * kv_elem_bytes(t) + (t == KV_Q8 ? sizeof(float) : 0));
}

/* Attention probability mass per position class for one query token (the groundedness
 * signals): for each listed query head h, the softmax of scale * q_h . k_j over keys
 * j < n_keys, summed over the marked positions j < n_marked with cls[j] == 1 (mass[2i]) and
 * over the positions j >= n_marked (mass[2i+1], the generated ones). */
struct MassArgs {
    const float *q;            /* one token's queries (n_q_head*head_dim), after RoPE */
    const void *k;             /* this layer's key cache, layout above */
    size_t kv_head_stride;
    const int32_t *pages;      /* as in AttnArgs */
    size_t page_stride;
    enum KvType kv_type;
    int n_keys, n_q_head, n_kv_head, head_dim;
    float scale;
    const uint8_t *cls;        /* (n_marked) position classes */
    int n_marked;
    const int *heads;          /* (n_heads) query heads */
    int n_heads;
    float *mass;               /* (n_heads, 2) out */
};

/* The attention that some query rows give a range of keys (a blend's probe, engine_blend): for
 * each row t (its queries at q + t * q_stride, after RoPE, at position pos[t]) and each query
 * head, the softmax of scale * q_h . k_j over the keys j <= pos[t]; the weights of the keys
 * j in [k0, k1) summed over rows and heads and added to out[j - k0]. */
struct WeightsArgs {
    const float *q;
    size_t q_stride;
    const int32_t *pos;        /* (n_rows) increasing */
    int n_rows;
    const void *k;             /* this layer's key cache, layout above */
    size_t kv_head_stride;
    const int32_t *pages;      /* as in AttnArgs */
    size_t page_stride;
    enum KvType kv_type;
    int n_q_head, n_kv_head, head_dim;
    float scale;
    int k0, k1;
    float *out;                /* (k1 - k0) sums, added to */
};

struct Backend {
    const char *name;
    /* The arithmetic this process's products and attention run with (e.g. "avx512 q8"):
     * results computed under another name round differently. */
    const char *(*numerics)(void);
    /* Weights as this backend wants them: bytes needed for a (rows, cols) matrix of `type`
     * (0 when the type is not handled), and the copy of a file-layout matrix `src` into `dst`
     * (64-byte aligned, that many bytes), describing the result in *out. */
    size_t (*weights_bytes)(uint32_t type, int rows, int cols);
    void (*weights_pack)(uint32_t type, int rows, int cols, const void *src, void *dst,
                         struct Weights *out);
    /* Row r of w decoded to f32 (cols floats): the embedding lookup. */
    void (*weights_row)(const struct Weights *w, int r, float *dst);
    /* The products of `a`; `scratch` holds matmul_scratch(a->n, max k, threads) bytes. */
    void (*matmul)(struct ThreadPool *pool, const struct MatmulArgs *a, void *scratch);
    size_t (*matmul_scratch)(int n_max, int k_max, int threads);
    /* y (n, d) = x / rms(x) * w, row by row; y may equal x. */
    void (*rmsnorm)(struct ThreadPool *pool, float *y, const float *x, const float *w, int n,
                    int d, float eps);
    void (*rope_store)(struct ThreadPool *pool, const struct RopeStoreArgs *a);
    void (*attention)(struct ThreadPool *pool, const struct AttnArgs *a, void *scratch);
    /* Bytes of `scratch` attention needs for chunks of up to n_tok_max tokens over a cache of
     * n_ctx positions with `threads` threads. */
    size_t (*attention_scratch)(int n_tok_max, int n_ctx, int head_dim, int n_q_head,
                                int n_kv_head, int threads);
    /* Elements of one KV head's cache for n_ctx positions (whole tiles). */
    size_t (*kv_head_stride)(int n_ctx, int head_dim, enum KvType type);
    /* The masses of `a`; `scratch` holds attention_mass_scratch(n_ctx, head_dim, n_q_head,
     * n_kv_head, threads) bytes. */
    void (*attention_mass)(struct ThreadPool *pool, const struct MassArgs *a, void *scratch);
    /* The copies of KvCopyArgs, out of the cache and into it. */
    void (*kv_read)(const struct KvCopyArgs *a);
    void (*kv_write)(const struct KvCopyArgs *a);
    size_t (*attention_mass_scratch)(int n_ctx, int head_dim, int n_q_head, int n_kv_head,
                                     int threads);
    /* The weights of `a`, the same whatever the thread count; `scratch` holds
     * attention_weights_scratch(n_keys, head_dim, n_q_head, n_kv_head, n_rows, threads)
     * bytes, n_keys > every pos[t], n_rows >= a->n_rows. */
    void (*attention_weights)(struct ThreadPool *pool, const struct WeightsArgs *a,
                              void *scratch);
    size_t (*attention_weights_scratch)(int n_keys, int head_dim, int n_q_head, int n_kv_head,
                                        int n_rows, int threads);
};

extern const struct Backend backend_cpu;

#endif
