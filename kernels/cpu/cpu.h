/* Internal to kernels/cpu (and its tests and benchmarks): the instruction-set paths, chosen
 * at run time, and the entry points of each kernel with the path made explicit so every path
 * the machine supports can be checked against the portable one. */
#ifndef DIFFRAG_KERNELS_CPU_H
#define DIFFRAG_KERNELS_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "kernels/f16.h"

enum CpuIsa {
    CPU_ISA_SCALAR = 0, /* portable C */
    CPU_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
    CPU_ISA_AVX512 = 2, /* AVX-512 F/BW/VL/DQ */
    CPU_ISA_COUNT
};

const char *cpu_isa_name(enum CpuIsa isa);
int cpu_isa_supported(enum CpuIsa isa);
/* The best supported path, or the one named by the environment variable DIFFRAG_CPU_ISA
 * (scalar, avx2, avx512) when it is supported; decided once per process. */
enum CpuIsa cpu_isa_best(void);

/* How prefill products are computed: this backend's f32 microkernels on decoded weights
 * (native), OpenBLAS sgemm on decoded weight panels (single-threaded inside the pool's tasks,
 * so the two never compete for cores), or int8 products of quantised weights with inputs
 * rounded to 8 bits as GGML rounds them (q8; other weight types as native). The default is q8
 * where the processor has AVX-512 VNNI, else native where a vector path exists, else
 * OpenBLAS; DIFFRAG_GEMM=native|openblas|q8 overrides (q8 only where supported). */
enum CpuGemm { CPU_GEMM_NATIVE = 0, CPU_GEMM_OPENBLAS = 1, CPU_GEMM_Q8 = 2 };
enum CpuGemm cpu_gemm_default(void);
const char *cpu_gemm_name(enum CpuGemm g);   /* "native", "openblas", "q8" */

/* Matrix products with an explicit path (the table's matmul uses the defaults). */
void cpu_matmul_with(enum CpuIsa isa, enum CpuGemm gemm, struct ThreadPool *pool,
                     const struct MatmulArgs *a, void *scratch);
size_t cpu_matmul_scratch(int n_max, int k_max, int threads);

/* Attention with an explicit path; amx = 1 lets prefill chunks use the AMX tile path
 * (attention_amx.c) where cpu_attn_amx_handles says it applies. */
void cpu_attention_with(enum CpuIsa isa, int amx, struct ThreadPool *pool,
                        const struct AttnArgs *a, void *scratch);
/* The AMX path: whether this processor and kernel run it (AMX-TILE, AMX-BF16, AVX512-BF16,
 * and the tile state granted to the process; asked of the kernel once), whether it applies
 * to a path, cache type and head size (f16 or f32 caches, head_dim a multiple of 32), and the
 * default: on where usable, off with DIFFRAG_ATTN=f32 or a narrower DIFFRAG_CPU_ISA. */
int cpu_amx_usable(void);
int cpu_amx_usable_once(void);
int cpu_attn_amx_handles(enum CpuIsa isa, enum KvType kv_type, int hd);
int cpu_attn_amx_default(void);
size_t cpu_attention_scratch(int n_tok_max, int n_ctx, int head_dim, int n_q_head,
                             int n_kv_head, int threads);
size_t cpu_kv_head_stride(int n_ctx, int head_dim, enum KvType type);
void cpu_attention_mass(struct ThreadPool *pool, const struct MassArgs *a, void *scratch);
void cpu_attention_weights(struct ThreadPool *pool, const struct WeightsArgs *a, void *scratch);
size_t cpu_attention_weights_scratch(int n_keys, int head_dim, int n_q_head, int n_kv_head,
                                     int n_rows, int threads);
size_t cpu_attention_mass_scratch(int n_ctx, int head_dim, int n_q_head, int n_kv_head,
                                  int threads);

/* --- pieces shared between the files of kernels/cpu --- */

/* Weights (weights.c): which types are interleaved, bytes, packing, decoding. */
int cpu_weights_x16(uint32_t type);
/* Bytes of an X16 tile before its 16 x 16 (or, Q8_0, 32 x 16) quant bytes. */
int cpu_x16_header(uint32_t type);
size_t cpu_weights_bytes(uint32_t type, int rows, int cols);
void cpu_weights_pack(uint32_t type, int rows, int cols, const void *src, void *dst,
                      struct Weights *out);
void cpu_weights_row(const struct Weights *w, int r, float *dst);
/* Rows r0..r0+nr-1 of w decoded into dst (nr, cols); _with uses the path's vector decoders
 * where it has them (the values are the same on every path). */
void cpu_decode_rows(const struct Weights *w, int r0, int nr, float *dst);
void cpu_decode_rows_with(enum CpuIsa isa, const struct Weights *w, int r0, int nr, float *dst);
/* Input rows one sweep of a weight matrix serves in the one-token products (a batch of decode
 * tokens): the weights are unpacked once for up to this many inputs, and every input's
 * arithmetic is the one it has alone, so each result is that of its own one-row product. */
enum { CPU_MV_ROWS = 4 };

/* K-quant rows (row layout, nb super-blocks): the product with x (xsum: x's 32-element block
 * sums), and the exact decoding, per path. The AVX-512 product takes nr (1..CPU_MV_ROWS)
 * inputs x[i] (block sums xsum[i]) and writes out[i]. */
void cpu_dot_k_avx512(uint32_t type, const uint8_t *row, const float *const *x,
                      const float *const *xsum, int nb, int nr, float *out);
float cpu_dot_k_avx2(uint32_t type, const uint8_t *row, const float *x, const float *xsum, int nb);
void cpu_decode_k_avx512(uint32_t type, const uint8_t *src, float *dst, int nb);
void cpu_decode_k_avx2(uint32_t type, const uint8_t *src, float *dst, int nb);
/* Rows r0..r0+width-1 (r0 a multiple of 16, width 16 or 32) of an X16 matrix decoded into a
 * k-major panel: panel[c * width + j] = w[r0 + j][c]; rows past the matrix give zeros. */
void cpu_panel_x16(const struct Weights *w, int r0, int width, float *panel);
void cpu_panel_x16_avx512(const struct Weights *w, int r0, int width, float *panel);
void cpu_panel_x16_avx2(const struct Weights *w, int r0, int width, float *panel);
/* One-token products of an X16 matrix: groups g0..g1-1, y[16 * (g - g0) + j] = row 16g+j . x.
 * `xsum` (cols/32) holds the sums of x over each 32-element block. */
void cpu_matvec_x16_portable(const struct Weights *w, int g0, int g1, const float *x, float *y);
/* The AVX-512 path takes nr (1..CPU_MV_ROWS) inputs x[i] (block sums xsum[i]) and writes
 * y[i], each as its own one-input product would. */
void cpu_matvec_x16_avx512(const struct Weights *w, int g0, int g1, const float *const *x,
                           const float *const *xsum, float *const *y, int nr);
void cpu_matvec_x16_avx2(const struct Weights *w, int g0, int g1, const float *x,
                         const float *xsum, float *y);
/* One-token products of a row-layout matrix: y[r - r0] = row r . x. */
void cpu_matvec_avx512(const struct Weights *w, int r0, int r1, const float *x,
                       const float *xsum, float *y);
int cpu_matvec_avx512_handles(uint32_t type);

/* Microkernel-level products of one column block, per path. `panel` holds the block's
 * weights k-major, NR floats per k (NR = 32 for AVX-512, 16 for AVX2):
 * y[i][j] (= or +=) sum_k x[i][k] panel[k][j] for i < n, j < m_blk. */
struct GemmBlock {
    const float *x;
    size_t x_stride;
    int n, k;
    const float *panel;
    int m_blk;                 /* outputs in this block (<= NR) */
    float *y;
    size_t y_stride;
    int accumulate;
};
void cpu_gemm_block_avx512(const struct GemmBlock *b);
void cpu_gemm_block_avx2(const struct GemmBlock *b);
/* g[i] = silu(g[i]) * u[i] for i < n. */
void cpu_silu_mul_avx512(float *g, const float *u, int n);
/* rows (nr, k) row-major, nr <= NR, into a panel (k, NR) with zero columns past nr. */
void cpu_pack_panel_avx512(const float *rows, int nr, int k, float *panel);
void cpu_pack_panel_avx2(const float *rows, int nr, int k, float *panel);

/* --- int8 prefill products (gemm_q8.c, gemm_q8_avx512.c, gemm_q8_avx2.c) ---
 * With CPU_GEMM_Q8, products of quantised weights with more than one input row run on 8-bit
 * integers, as GGML's CPU backend computes them: each input row is rounded to 8 bits per
 * element (GGML's Q8_0 blocks of 32 for Q4_0..Q8_0 weights, Q8_K super-blocks of 256 for the
 * K-quants, with GGML's scales and rounding), the weights are decoded to their integer quants
 * with one factor and offset per sub-block of g elements, and each sub-block's integer dot
 * product is scaled in f32. */
enum Q8Act { Q8_ACT_32 = 0, Q8_ACT_K = 1, Q8_ACT_COUNT };

/* How weights of `type` enter the int8 products; 0 when they do not. Weight element c of a
 * sub-block is a * u[c] + off (u unsigned 8-bit); symmetric types have off = -a * 2^shift
 * (folded into the integer sum), the others shift = -1 and their own offset per sub-block. */
struct Q8Type {
    enum Q8Act act;
    int g;       /* sub-block: 16 or 32 elements */
    int shift;
    int umax;    /* the largest unsigned quant u (255: Q8_0, whose u is its signed quant + 128) */
};
int cpu_q8_type(uint32_t type, struct Q8Type *t);

/* Rounded input rows: q (n, k) int8, rows q_stride bytes apart; per row and sub-block of g
 * elements (rows s_stride elements apart) the scale d, minus the sum of the sub-block's
 * integers (nx) and d times that sum (dx). */
struct Q8Rows {
    int8_t *q;
    size_t q_stride;
    float *d;
    int32_t *nx;
    float *dx;
    size_t s_stride;
    int g;
};
/* Row i of x (k elements) into row i of r, rounded as `act` rounds; r->g is 32 for Q8_ACT_32
 * and 16 or 32 for Q8_ACT_K. The portable form is GGML's reference arithmetic; the AVX-512
 * form gives the same integers and scales. */
void cpu_q8_quantize_row(enum Q8Act act, const float *x, int k, const struct Q8Rows *r, int i);
void cpu_q8_quantize_row_avx512(enum Q8Act act, const float *x, int k, const struct Q8Rows *r,
                                int i);

/* The int8 panel of 32 outputs r0..r0+31 (rows from r0 + mb on give zeros): per sub-block s
 * of g inputs, g/4 steps of two 64-byte vectors (outputs 0-15, 16-31; output j's four bytes
 * at 4j are inputs 4t..4t+3 of the step), then the 32 factors a and the 32 offsets (f32). */
size_t cpu_q8_panel_bytes(int k, int g);
/* Bytes of the work area the panel builders need for rows of k elements. */
size_t cpu_q8_panel_work(int k);
void cpu_q8_panel(const struct Weights *w, int r0, int mb, uint8_t *panel, uint8_t *work);
void cpu_q8_panel_avx512(const struct Weights *w, int r0, int mb, uint8_t *panel,
                         uint8_t *work);
void cpu_q8_panel_avx2(const struct Weights *w, int r0, int mb, uint8_t *panel, uint8_t *work);
/* Row r of w (r >= w->rows: zeros) as unsigned quants u[w->cols] with a factor a and offset
 * off per sub-block, in element order (the portable decoding both panel builders share). */
void cpu_q8_decode_row(const struct Weights *w, int r, uint8_t *u, float *a, float *off);

/* y[i][j] (= or +=) sum over sub-blocks s of d_is * a_sj * S_isj + dx_is * off_sj, S the
 * integer dot product (symmetric types: sum of u * q minus 2^shift times the sum of q), for
 * the n rows of x from row i0 and the m_blk outputs of the panel; the f32 steps are one
 * product then fused multiply-adds in the same order on every path, so paths agree exactly. */
struct Q8Block {
    const struct Q8Rows *x;
    int i0, n, k;
    const uint8_t *panel;
    int m_blk, shift;
    int umax;    /* the weight type's Q8Type.umax (the AVX2 kernel's 16-bit sums depend on it) */
    float *y;
    size_t y_stride;
    int accumulate;
};
void cpu_q8_gemm_block(const struct Q8Block *b);
void cpu_q8_gemm_block_avx512(const struct Q8Block *b);
void cpu_q8_gemm_block_avx2(const struct Q8Block *b);
/* Whether this processor runs the AVX-512 int8 products (AVX-512 VNNI). */
int cpu_q8_vnni(void);
/* Which int8 microkernel the path `isa` runs: CPU_ISA_AVX512 (VNNI), CPU_ISA_AVX2 (also on
 * AVX-512 without VNNI), or CPU_ISA_SCALAR where the products stay f32 (no int8 path). */
enum CpuIsa cpu_q8_kernel(enum CpuIsa isa);
/* x16 tile (group, block) of an X16 matrix. */
const uint8_t *cpu_x16_tile(const struct Weights *w, int group, int block);

/* The attention inner loop per path (attention.c documents the contract). */
void cpu_attend_avx512(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke,
                       float *ws, float *O, float *M, float *L);
void cpu_attend_avx2(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke,
                     float *ws, float *O, float *M, float *L);
/* The AMX path (attention_amx.c): the tile of keys k0.. (of k_end) of KV head g packed for the
 * tile unit into dst (CPU_AMX_TILE_ELEMS(hd) bf16), and the attention of a task over tiles
 * packed so, the head's tiles one after another from `packed`. */
#define CPU_AMX_TILE_ELEMS(hd) ((size_t)3 * (hd) * KV_TILE)
void cpu_amx_pack_tile(const struct AttnArgs *a, int g, int k0, int k_end, uint16_t *dst);
void cpu_attend_amx(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke,
                    const uint16_t *packed, float *ws, float *O, float *M, float *L);
/* Floats of workspace cpu_attend_amx needs for R rows of head_dim hd. */
size_t cpu_attend_amx_ws_floats(int R, int hd);
/* Rows t0..t1-1 of the chunk's keys and values into the cache (layout in backend.h). */
void cpu_kv_store_rows(const struct RopeStoreArgs *a, int t0, int t1);
/* kv_read; kv_write without a rotation (bit for bit); packed row t decoded to f32 keys and
 * values (n_kv_head*head_dim each). */
void cpu_kv_read(const struct KvCopyArgs *a);
void cpu_kv_write_packed(const struct KvCopyArgs *a);
void cpu_kv_unpack(const struct KvCopyArgs *a, int t, float *k, float *v);

/* The scales of a KV_Q8 tile that starts at `tile` (int8 elements). */
static inline const float *cpu_kv_q8_scales(const void *tile, int head_dim)
{
    return (const float *)(const void *)((const int8_t *)tile + (size_t)head_dim * KV_TILE);
}

/* Where dimension d of the key at position j of a tile is, in elements from the tile's start. */
static inline size_t cpu_kv_key_index(enum KvType t, int d, int j)
{
    if (t == KV_Q8) return (size_t)(d >> 1) * 2 * KV_TILE + 2 * (size_t)j + (d & 1);
    return (size_t)d * KV_TILE + j;
}

/* Element i of the tile that starts at element `tile` of cache c, as f32; j is the element's
 * position in the tile. */
static inline float cpu_kv_get(const void *c, enum KvType t, size_t tile, size_t i, int j,
                               int head_dim)
{
    if (t == KV_F32) return ((const float *)c)[tile + i];
    if (t == KV_F16) return f16_to_f32(((const uint16_t *)c)[tile + i]);
    const int8_t *q = (const int8_t *)c + tile;
    return (float)q[i] * cpu_kv_q8_scales(q, head_dim)[j];
}

/* Dimension d of the key at position j of the tile at `tile`, and the value's. */
static inline float cpu_kv_key(const void *c, enum KvType t, size_t tile, int d, int j, int head_dim)
{
    return cpu_kv_get(c, t, tile, cpu_kv_key_index(t, d, j), j, head_dim);
}
static inline float cpu_kv_value(const void *c, enum KvType t, size_t tile, int d, int j, int head_dim)
{
    return cpu_kv_get(c, t, tile, (size_t)j * head_dim + d, j, head_dim);
}

#endif
