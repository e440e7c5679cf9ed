/* The GPU backend's host-side logic, checked without a GPU: the attention kernels' launch
 * plans (the Hopper kernel's row mapping and swizzled layout against its wgmma descriptors; its
 * TMA form's register split, stages and tensor-map view of the pool),
 * the decode split plan, the KV page pool (also under two threads), the device memory
 * estimate, bf16 conversion, loading the CUDA library (clear errors when it or a GPU is
 * missing) and the device setting. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/gpu.h"
#include "kernels/gpu_plan.h"
#include "model/engine.h"
#include "model/engine_gpu.h"
#include "model/kvpool.h"
#include "tests/check.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static void test_attn_plan(void)
{
    struct GpuAttnPlan p;
    /* the default model: 9 query heads over 3 KV heads of 64; its DIFF V2 form has 18 */
    CHECK(gpu_attn_plan(8192, 9, 3, 64, 0, &p) == 0 && p.heads == 3 && p.warps == 12 &&
          p.blocks_x == 128 && p.blocks_y == 3, "GQA 9/3: heads %d warps %d grid %dx%d", p.heads,
          p.warps, p.blocks_x, p.blocks_y);
    CHECK(gpu_attn_plan(8192, 18, 3, 64, 1, &p) == 0 && p.heads % 2 == 0 && 6 % p.heads == 0 &&
          p.blocks_y == 3 * (6 / p.heads), "DIFF V2 18/3: pairs stay in a block (heads %d)", p.heads);
    CHECK(gpu_attn_plan(1, 16, 2, 128, 1, &p) == 0 && p.blocks_x == 1 && p.heads == 2,
          "hd 128: %d heads a block", p.heads);
    CHECK(gpu_attn_plan(65, 8, 8, 64, 0, &p) == 0 && p.blocks_x == 2 && p.heads == 1 &&
          p.blocks_y == 8, "MHA: one head a block, two tiles for 65 tokens");
    CHECK(gpu_attn_plan(10, 9, 3, 96, 0, &p) == -1, "head dimension 96 refused");
    CHECK(gpu_attn_plan(10, 9, 3, 64, 1, &p) == -1, "DIFF V2 with an odd group refused");
    CHECK(gpu_attn_plan(10, 10, 3, 64, 0, &p) == -1, "query heads not a multiple of KV heads");
    CHECK(gpu_attn_plan(0, 9, 3, 64, 0, &p) == -1, "no tokens refused");
    /* every accepted plan fits a block's limits on sm_90 (1024 threads, 227 KiB shared) */
    int shapes = 0;
    for (int hd = 64; hd <= 128; hd += 64)
        for (int kv = 1; kv <= 8; kv++)
            for (int g = 1; g <= 16; g++)
                for (int diff = 0; diff < 2; diff++)
                    if (gpu_attn_plan(4096, kv * g, kv, hd, diff, &p) == 0) {
                        shapes++;
                        CHECK(p.warps * 32 <= 1024 && p.smem <= 227 * 1024 &&
                              p.warps <= gpu_attn_max_warps(hd) && g % p.heads == 0 &&
                              (!diff || p.heads % 2 == 0),
                              "hd %d kv %d group %d diff %d: %d warps, %zu bytes", hd, kv, g, diff,
                              p.warps, p.smem);
                    }
    CHECK(shapes == 2 * 8 * (16 + 8), "every group size planned (%d shapes)", shapes);
}

/* The Hopper kernel's plan: every (token, query head) of a chunk is computed by exactly one
 * accumulator row, DIFF V2 pairs share a thread (even head in row gid, odd in gid + 8), and
 * blocks fit the kernel's register cap and shared memory. */
static void test_wg_plan(void)
{
    struct GpuWgPlan p;
    CHECK(gpu_wg_plan(8192, 9, 3, 64, 0, &p) == 0 && p.per_wg == 1 && p.qt == 64 && p.wgs == 3 &&
          p.blocks_x == 128 && p.blocks_y == 3, "GQA 9/3: %d warpgroups, grid %dx%d", p.wgs,
          p.blocks_x, p.blocks_y);
    CHECK(gpu_wg_plan(8192, 18, 3, 64, 1, &p) == 0 && p.per_wg == 2 && p.qt == 32 && p.wgs == 3 &&
          p.blocks_x == 256 && p.blocks_y == 3, "DIFF V2 18/3: %d warpgroups, grid %dx%d", p.wgs,
          p.blocks_x, p.blocks_y);
    CHECK(gpu_wg_plan(100, 16, 2, 128, 1, &p) == 0 && p.wgs == 2 && p.blocks_y == 4 &&
          p.smem <= 227 * 1024, "hd 128 DIFF V2 16/2: %d warpgroups, %zu bytes", p.wgs, p.smem);
    CHECK(gpu_wg_plan(10, 9, 3, 96, 0, &p) == -1 && gpu_wg_plan(10, 9, 3, 64, 1, &p) == -1 &&
          gpu_wg_plan(0, 9, 3, 64, 0, &p) == -1 && gpu_wg_plan(5, 10, 3, 64, 0, &p) == -1,
          "unplanned shapes refused");
    int shapes[][5] = {{9, 3, 64, 0, 0}, {18, 3, 64, 1, 0}, {16, 2, 128, 1, 0}, {4, 4, 128, 0, 0},
                       {12, 2, 64, 1, 0}, {8, 1, 64, 0, 0}, {32, 4, 128, 1, 0}};
    int lens[] = {1, 31, 32, 33, 64, 333, 450};
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
        for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
            int nq = shapes[si][0], nkv = shapes[si][1], hd = shapes[si][2], diff = shapes[si][3];
            int n = lens[li], group = nq / nkv, bad = 0;
            if (gpu_wg_plan(n, nq, nkv, hd, diff, &p)) {
                CHECK(0, "no plan for %d/%d hd %d", nq, nkv, hd);
                continue;
            }
            unsigned char *seen = calloc((size_t)n * nq, 1);
            for (int bx = 0; bx < p.blocks_x; bx++)
                for (int by = 0; by < p.blocks_y; by++)
                    for (int wg = 0; wg < p.wgs; wg++) {
                        int kv, h0 = gpu_wg_head0(group, p.per_wg, p.wgs, by, wg, &kv);
                        for (int warp = 0; warp < 4; warp++)
                            for (int gid = 0; gid < 8; gid++) {
                                int r[2], ho[2];
                                for (int up = 0; up < 2; up++)
                                    gpu_wg_row(p.per_wg, bx, warp, gid, up, &r[up], &ho[up]);
                                if (diff && (r[0] != r[1] || ho[0] != 0 || ho[1] != 1 || h0 % 2))
                                    bad++;
                                for (int up = 0; up < 2; up++) {
                                    int h = h0 + ho[up];
                                    if (h / group != kv || h >= nq || r[up] >= p.blocks_x * p.qt) bad++;
                                    else if (r[up] < n) seen[(size_t)r[up] * nq + h]++;
                                }
                            }
                    }
            for (size_t i = 0; i < (size_t)n * nq; i++) bad += seen[i] != 1;
            free(seen);
            CHECK(!bad && p.wgs <= gpu_wg_max(hd) && p.smem <= 227 * 1024,
                  "%d/%d hd %d diff %d, %d tokens: %d rows missed, repeated or misplaced", nq, nkv,
                  hd, diff, n, bad);
        }
}

/* Applies the 128-byte swizzle the hardware applies to a shared-memory byte address: the
 * 16-byte chunk bits (4-6) XOR the 128-byte row bits (7-9). */
static uint32_t sw128(uint32_t addr) { return addr ^ (((addr >> 7) & 7) << 4); }

/* The shared-memory layout the Hopper kernel writes (gpu_sw128_offset) against the addresses
 * its descriptors name, read with the PTX ISA's canonical layouts for 128-byte swizzle:
 *   K-major (S = Q K^T, B = keys, 16 deep in head dimensions): element (n, k) at
 *     start + (n % 8) * 128 + (n / 8) * SBO + k * 2;
 *   MN-major (O = P V, B = values, 16 deep in keys, N = head dimensions): element (n, k) at
 *     start + (n % 64) * 2 + (n / 64) * LBO + (k % 8) * 128 + (k / 8) * SBO;
 * each then swizzled. The fields are decoded from the 64-bit descriptors themselves. */
static void test_wg_layout(void)
{
    uint32_t base = 3 * 1024 + 0x10000;        /* any 1024-byte aligned page */
    for (int hd = 64; hd <= 128; hd += 64) {
        int bad = 0, seen_bytes = 0;
        unsigned char *used = calloc((size_t)GPU_PAGE * hd * 2, 1);
        for (int row = 0; row < GPU_PAGE; row++) {
            int banks = 0;
            for (int d = 0; d < hd; d += 8) {
                uint32_t off = gpu_sw128_offset(row, d);
                if (off % 16 || off >= (uint32_t)GPU_PAGE * hd * 2 || used[off]) bad++;
                else used[off] = 1, seen_bytes++;
                if (d < 64) banks |= 1 << ((off / 16) % 8);
                for (int e = 1; e < 8; e++) bad += gpu_sw128_offset(row, d + e) != off + 2 * (uint32_t)e;
            }
            bad += banks != 0xff;              /* a row's eight chunks: eight distinct 16-byte banks */
        }
        free(used);
        CHECK(!bad && seen_bytes == GPU_PAGE * hd / 8, "hd %d: the swizzled page is a permutation "
              "of 16-byte chunks, conflict free along a row (%d faults)", hd, bad);

        int bad_k = 0, bad_v = 0, bad_f = 0;
        for (int step = 0; step < hd / 16; step++) {
            uint64_t desc = gpu_wg_desc_k(base, step);
            uint32_t start = (uint32_t)(desc & 0x3FFF) << 4, sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
            bad_f += (desc >> 62) != 1 || ((desc >> 49) & 7) != 0 || start % 16;
            for (int n = 0; n < GPU_PAGE; n++)
                for (int k = 0; k < 16; k++) {
                    uint32_t hw = sw128(start + (n % 8) * 128 + (n / 8) * sbo + k * 2);
                    bad_k += hw != base + gpu_sw128_offset(n, step * 16 + k);
                }
        }
        for (int step = 0; step < GPU_PAGE / 16; step++) {
            uint64_t desc = gpu_wg_desc_v(base, step);
            uint32_t start = (uint32_t)(desc & 0x3FFF) << 4;
            uint32_t lbo = (uint32_t)((desc >> 16) & 0x3FFF) << 4, sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
            bad_f += (desc >> 62) != 1 || ((desc >> 49) & 7) != 0 || start % 16;
            for (int n = 0; n < hd; n++)
                for (int k = 0; k < 16; k++) {
                    uint32_t hw = sw128(start + (n % 64) * 2 + (n / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo);
                    bad_v += hw != base + gpu_sw128_offset(step * 16 + k, n);
                }
        }
        CHECK(!bad_k && !bad_v && !bad_f, "hd %d: the wgmma descriptors address what the loader "
              "wrote (keys %d, values %d, fields %d wrong)", hd, bad_k, bad_v, bad_f);
    }
    /* the descriptor's fields where the ISA puts them */
    uint64_t d = gpu_wgmma_desc(0x12340, 0x2000, 0x400);
    CHECK((d & 0x3FFF) == (0x12340 >> 4) && ((d >> 16) & 0x3FFF) == 0x200 && ((d >> 32) & 0x3FFF) == 0x40 &&
          (d >> 62) == 1 && (d & 0x3FFFC000C000C000ull) == 0,
          "descriptor fields: start, LBO, SBO, 128-byte swizzle (%016llx)", (unsigned long long)d);
}

/* The TMA form: what setmaxnreg may move between the producer and the consumers, the stages'
 * shared memory, the launch shapes, and the tensor map's view of the pool: each box, copied
 * with the 128-byte swizzle (the same address XOR as above, given a 1024-byte aligned
 * destination), puts every element of a page where gpu_sw128_offset says and takes it from
 * where kernels/gpu.h says the page holds it. */
static void test_tma_plan(void)
{
    for (int wgs = 1; wgs <= 3; wgs++) {
        int threads = GPU_TMA_THREADS(wgs), blocks = GPU_TMA_MIN_BLOCKS(wgs);
        int entry = 65536 / (threads * blocks);
        entry = (entry > 255 ? 255 : entry) & ~7;
        int dec = GPU_TMA_REGS_PRODUCER, inc = GPU_TMA_REGS_CONSUMER(wgs);
        CHECK(dec % 8 == 0 && inc % 8 == 0 && dec >= 24 && inc <= 256 && dec <= entry && inc >= entry &&
              128 * dec + wgs * 128 * inc <= entry * threads && threads * blocks <= 2048,
              "%d consumer warpgroups: %d threads start with %d registers; producer %d, consumers %d",
              wgs, threads, entry, dec, inc);
        /* head_dim 64 fits the blocks the register split assumes; 128 (four 32 KiB stages) one */
        for (int hd = 64; hd <= 128; hd += 64)
            CHECK(gpu_tma_smem(hd) * (hd == 64 ? blocks : 1) <= 227 * 1024 &&
                  gpu_tma_smem(hd) >= (size_t)GPU_TMA_STAGES * 4 * GPU_PAGE * hd + 2 * GPU_TMA_STAGES * 8 + 1023,
                  "hd %d: %d blocks of %zu bytes of shared memory", hd, blocks, gpu_tma_smem(hd));
    }
    struct GpuWgPlan p;
    CHECK(gpu_tma_plan(8192, 18, 3, 64, 1, 0, &p) == 0 && p.wgs == 3 && p.blocks_x == 256 &&
          p.blocks_y == 3 && p.smem == gpu_tma_smem(64), "DIFF V2 18/3: %d consumer warpgroups", p.wgs);
    CHECK(gpu_tma_plan(8192, 18, 3, 64, 1, 1, &p) == 0 && p.wgs == 1 && p.blocks_y == 9,
          "DIFF V2 18/3 pipelined: %d consumer warpgroup (240 registers do not fit three)", p.wgs);
    CHECK(gpu_tma_plan(100, 16, 2, 128, 1, 0, &p) == 0 && p.wgs == 2 && p.blocks_y == 4 &&
          gpu_tma_plan(0, 9, 3, 64, 0, 0, &p) == -1 && gpu_tma_plan(9, 9, 3, 96, 0, 1, &p) == -1,
          "hd 128 DIFF V2 16/2: %d warpgroups; unplanned shapes refused", p.wgs);
    int shapes = 0, over = 0;
    for (int hd = 64; hd <= 128; hd += 64)
        for (int pipe = 0; pipe < 2; pipe++)
            for (int kv = 1; kv <= 4; kv++)
                for (int g = 1; g <= 16; g++)
                    for (int diff = 0; diff < 2; diff++) {
                        struct GpuWgPlan w;
                        if (gpu_tma_plan(1000, kv * g, kv, hd, diff, pipe, &p)) continue;
                        shapes++;
                        /* the same shape as the cp.async form's, short of the warpgroup cap */
                        gpu_wg_shape(1000, kv * g, kv, hd, diff, p.wgs, &w);
                        over += p.wgs > gpu_tma_max_wgs(hd, pipe) || w.wgs != p.wgs ||
                                p.blocks_y * p.wgs * p.per_wg != kv * g || w.blocks_x != p.blocks_x;
                    }
    CHECK(shapes == 2 * 2 * 4 * (16 + 8) && !over, "%d TMA plans, %d off their cap or shape",
          shapes, over);

    struct GpuTmaGeom g;
    CHECK(gpu_tma_geom(10, gpu_page_elems(2, 3, 64), 96, &g) == -1 &&
          gpu_tma_geom(0, gpu_page_elems(2, 3, 64), 64, &g) == -1 &&
          gpu_tma_geom(1 << 24, gpu_page_elems(80, 8, 128), 128, &g) == -1 &&
          gpu_tma_geom(1 << 16, gpu_page_elems(30, 3, 64), 64, &g) == 0,
          "tensor map: other head dimensions, an empty pool and rows past 2^31 refused");
    uint32_t base = 5 * 1024 + 0x20000;
    for (int hd = 64; hd <= 128; hd += 64) {
        int n_layer = 3, n_kv = 2, pool_pages = 9, bad = 0;
        size_t pe = gpu_page_elems(n_layer, n_kv, hd);
        if (gpu_tma_geom(pool_pages, pe, hd, &g)) {
            CHECK(0, "hd %d: no tensor map", hd);
            continue;
        }
        bad += g.dims[0] != (uint64_t)hd || g.dims[1] * g.dims[0] != pool_pages * pe ||
               g.row_bytes != (uint64_t)hd * 2 || g.box[0] * 2 != 128 || g.box[1] != GPU_PAGE ||
               g.boxes * g.box[0] != (uint32_t)hd;
        /* the bytes one stage's copies deliver (the full barrier's count): a K and a V page */
        bad += 2u * g.boxes * g.box[0] * g.box[1] * 2 != 2u * GPU_PAGE * hd * 2;
        for (int32_t pg = 0; pg < pool_pages; pg += 4)
            for (int l = 0; l < n_layer; l++)
                for (int kind = 0; kind < 2; kind++)
                    for (int kvh = 0; kvh < n_kv; kvh++) {
                        int64_t row0 = gpu_kv_row(pg, pe, l, kind, n_kv, kvh, hd);
                        bad += row0 < 0 || (uint64_t)row0 + GPU_PAGE > g.dims[1];
                        for (int b = 0; b < g.boxes; b++)
                            for (uint32_t r = 0; r < g.box[1]; r++)
                                for (uint32_t j = 0; j < g.box[0]; j += 3) {
                                    uint64_t src = ((uint64_t)row0 + r) * g.dims[0] + b * g.box[0] + j;
                                    uint64_t page = (uint64_t)pg * pe +
                                                    ((uint64_t)(l * 2 + kind) * n_kv + kvh) * GPU_PAGE * hd +
                                                    r * hd + b * 64 + j;
                                    uint32_t dst = base + b * (GPU_PAGE * 128);
                                    uint32_t hw = sw128(dst + r * 128 + j * 2);
                                    bad += src != page || hw != base + gpu_sw128_offset((int)r, b * 64 + (int)j);
                                }
                    }
        CHECK(!bad, "hd %d: the TMA boxes copy each page where the kernel reads it (%d faults)", hd, bad);
    }
}

static void test_decode_plan(void)
{
    for (int n = 1; n <= 131072; n = n * 3 + 7) {
        struct GpuDecodePlan p;
        gpu_decode_plan(n, 18, 3, 64, 132, &p);
        int pages = (n + GPU_PAGE - 1) / GPU_PAGE;
        CHECK(p.pages_per_split >= 4 && (long)p.splits * p.pages_per_split >= pages &&
              (long)(p.splits - 1) * p.pages_per_split < pages &&
              p.work_floats == (size_t)18 * p.splits * 68,
              "decode plan for %d keys: %d splits of %d pages", n, p.splits, p.pages_per_split);
        CHECK(p.splits <= gpu_decode_max_splits(3, 132),
              "workspace bound holds at %d keys", n);
    }
}

struct PoolJob {
    struct KvPool *p;
    int ok;
};

static void *pool_churn(void *arg)
{
    struct PoolJob *j = arg;
    int32_t pages[7];
    for (int i = 0; i < 20000; i++) {
        if (kvpool_alloc_n(j->p, 7, pages) == 0) {
            for (int k = 0; k < 7; k++)
                if (pages[k] < 0 || pages[k] >= 20) j->ok = 0;
            kvpool_release(j->p, pages, 7);
        }
    }
    return NULL;
}

static size_t pool_free(struct KvPool *p)
{
    struct KvPoolStats st;
    kvpool_stats(p, &st);
    return st.pages_used + st.pages_cached + st.pages_free == st.pages ? st.pages_free
                                                                         : (size_t)-1;
}

/* The GPU pool's bookkeeping (model/kvpool.h, kvpool_new_names): whole requests of pages or
 * none, no page twice, pages back, and its prefix cache: published pages stay cached, are
 * matched by their tokens, and are evicted when the free ones run out. */
static void test_pool(void)
{
    static struct Model fake;
    fake.cfg = (struct ModelConfig){.arch = ARCH_DIFFV2, .n_layer = 2, .dim = 128, .n_head = 2,
                                    .n_q_head = 4, .n_kv_head = 1, .head_dim = 64,
                                    .ffn_dim = 256, .vocab = 512, .rope = {.n_rot = 64}};
    struct KvPool *p;
    char err[256];
    CHECK(kvpool_new_names(&fake, 4096, 20, 1, &p, err, sizeof err) == 0, "pool: %s", err);
    int32_t a[20], b[20];
    CHECK(kvpool_alloc_n(p, 12, a) == 0 && pool_free(p) == 8, "take 12 of 20");
    CHECK(kvpool_alloc_n(p, 9, b) == -1 && pool_free(p) == 8,
          "a request beyond the free pages takes nothing");
    CHECK(kvpool_alloc_n(p, 8, b) == 0 && pool_free(p) == 0, "take the rest");
    int seen[20] = {0}, dup = 0;
    for (int i = 0; i < 12; i++) dup |= seen[a[i]]++;
    for (int i = 0; i < 8; i++) dup |= seen[b[i]]++;
    CHECK(!dup, "no page handed out twice");
    CHECK(a[0] == 0 && a[1] == 1, "a lone sequence gets pages in address order");
    kvpool_release(p, a, 12);
    kvpool_release(p, b, 8);
    CHECK(pool_free(p) == 20, "all pages back");
    pthread_t th[2];
    struct PoolJob j[2] = {{p, 1}, {p, 1}};
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, pool_churn, &j[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    CHECK(j[0].ok && j[1].ok && pool_free(p) == 20, "two threads churning: %zu free",
          pool_free(p));

    /* a prompt of 3 full pages published, its pages given back: cached, then matched */
    int32_t tok[3 * KV_TILE], got[3];
    uint64_t h[3], hm[3];
    for (int i = 0; i < 3 * KV_TILE; i++) tok[i] = (i * 7) % 512;
    CHECK(kvpool_alloc_n(p, 3, a) == 0, "a prompt's pages");
    for (int i = 0; i < 3; i++) {
        h[i] = kvpool_chain_hash(p, i ? h[i - 1] : 0, tok + i * KV_TILE);
        kvpool_publish(p, a[i], i ? a[i - 1] : -1, h[i], tok + i * KV_TILE);
    }
    kvpool_release(p, a, 3);
    struct KvPoolStats st;
    kvpool_stats(p, &st);
    CHECK(st.pages_cached == 3 && st.pages_used == 0 && st.pages_free == 17,
          "published pages stay cached when given back: %zu cached, %zu free", st.pages_cached,
          st.pages_free);
    int idle = 0;
    CHECK(kvpool_peek(p, tok, sizeof tok / sizeof *tok, 3, &idle) == 3 && idle == 3,
          "peek: 3 pages, all idle");
    int m = kvpool_match(p, tok, sizeof tok / sizeof *tok, 3, got, hm);
    CHECK(m == 3 && !memcmp(got, a, sizeof got) && !memcmp(hm, h, sizeof h),
          "match: the same pages and names");
    /* while they are held, the other 17 are all a request can take */
    CHECK(kvpool_alloc_n(p, 18, b) == -1 && kvpool_alloc_n(p, 17, b) == 0, "held pages are not "
          "handed out");
    memset(seen, 0, sizeof seen);
    dup = 0;
    for (int i = 0; i < 3; i++) dup |= seen[got[i]]++;
    for (int i = 0; i < 17; i++) dup |= seen[b[i]]++;
    CHECK(!dup, "no page twice beside matched pages");
    kvpool_release(p, b, 17);
    kvpool_release(p, got, 3);
    /* a request for every page evicts the cached ones */
    CHECK(kvpool_alloc_n(p, 20, a) == 0, "then the whole pool again");
    kvpool_stats(p, &st);
    CHECK(st.evicted_pages == 3 && st.pages_cached == 0 && st.pages_used == 20,
          "the cached pages evicted for it: %llu", (unsigned long long)st.evicted_pages);
    memset(seen, 0, sizeof seen);
    dup = 0;
    for (int i = 0; i < 20; i++) dup |= seen[a[i]]++;
    CHECK(!dup, "still no duplicate page after the churn");
    kvpool_release(p, a, 20);
    CHECK(kvpool_match(p, tok, sizeof tok / sizeof *tok, 3, got, hm) == 0 && pool_free(p) == 20,
          "evicted pages are not matched");
    /* the same chain as the CPU pool's, over a seed of their own */
    struct KvPool *cpu, *again;
    CHECK(kvpool_new(&fake, KV_F16, 1, 1, &cpu, err, sizeof err) == 0 &&
          kvpool_new_names(&fake, 4096, 1, 1, &again, err, sizeof err) == 0, "pools: %s", err);
    CHECK(kvpool_chain_hash(again, 0, tok) == h[0] && kvpool_chain_hash(cpu, 0, tok) != h[0],
          "a GPU page's name is the same in every GPU pool of the model, never a CPU page's");
    kvpool_destroy(&cpu);
    kvpool_destroy(&again);
    kvpool_destroy(&p);
}

static void test_estimate(void)
{
    struct ModelConfig c = {.arch = ARCH_DIFFV2, .n_layer = 30, .dim = 576, .n_head = 9,
                            .n_q_head = 18, .n_kv_head = 3, .head_dim = 64, .ffn_dim = 1536,
                            .vocab = 49152, .rope = {.n_rot = 64}};
    size_t kv, scratch, kv2, scratch2;
    gpu_seq_estimate(&c, 131072, 8192, &kv, &scratch);
    CHECK(kv == (size_t)2048 * 30 * 2 * 3 * 64 * 64 * 2, "128K positions of KV: %zu bytes", kv);
    /* the q buffer alone is 8192 rows of 18 heads of 64 bf16 */
    CHECK(scratch > (size_t)8192 * 18 * 64 * 2 && scratch < (size_t)400 << 20,
          "activations of an 8192-token chunk: %.1f MiB", scratch / 1048576.0);
    gpu_seq_estimate(&c, 100, 8192, &kv2, &scratch2);
    CHECK(kv2 == (size_t)2 * 30 * 2 * 3 * 64 * 64 * 2 && scratch2 < scratch,
          "a 100-token context: 2 pages, the chunk clamped to the context");
}

static void test_bf16(void)
{
    CHECK(gpu_f32_to_bf16(1.0f) == 0x3f80 && gpu_bf16_to_f32(0x3f80) == 1.0f, "1.0");
    /* 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0) */
    CHECK(gpu_f32_to_bf16(1.00390625f) == 0x3f80, "tie to even, down");
    CHECK(gpu_f32_to_bf16(1.01171875f) == 0x3f82, "tie to even, up");
    CHECK(gpu_f32_to_bf16(1.0f + 1.0f / 128 + 1.0f / 512) == 0x3f81, "round to nearest");
    CHECK(isnan(gpu_bf16_to_f32(gpu_f32_to_bf16(NAN))), "NaN stays NaN");
    CHECK(gpu_f32_to_bf16(INFINITY) == 0x7f80 && gpu_f32_to_bf16(-0.0f) == 0x8000, "inf, -0");
    double worst = 0;
    for (int i = 0; i < 100000; i++) {
        float x = (float)((i * 2654435761u) % 2000003) / 1000.0f - 1000.0f;
        if (x == 0) continue;
        double r = fabs(gpu_bf16_to_f32(gpu_f32_to_bf16(x)) - x) / fabs(x);
        if (r > worst) worst = r;
    }
    CHECK(worst <= 1.0 / 256, "relative rounding error at most 2^-8 (%.2e)", worst);
}

static void test_loading(void)
{
    char err[512];
    /* the library is loaded once per process: the failure path first, so it is the one cached */
    setenv("DIFFRAG_CUDA_LIB", "/nonexistent/libdiffrag_cuda.so", 1);
    const struct GpuApi *a = gpu_api_load(err, sizeof err);
    CHECK(!a && strstr(err, "no CUDA backend") && strstr(err, "/nonexistent/libdiffrag_cuda.so"),
          "a missing library is named: %s", err);
    struct Model *m;
    if (access(MODEL_PATH, R_OK) != 0) {
        CHECK(0, "%s is missing (make model)", MODEL_PATH);
        return;
    }
    CHECK(model_load(MODEL_PATH, &m, err, sizeof err) == MODEL_OK, "load: %s", err);
    enum EngineDevice d = ENGINE_CUDA;
    char note[512];
    CHECK(engine_device_select(m, "cpu", 4096, 1, &d, note, sizeof note) == 0 && d == ENGINE_CPU,
          "device cpu");
    CHECK(engine_device_select(m, "gpu", 4096, 1, &d, note, sizeof note) == -1 &&
          strstr(note, "auto, cpu or cuda"), "an unknown device is refused: %s", note);
    CHECK(engine_device_select(m, "cuda", 4096, 1, &d, note, sizeof note) == -1 &&
          strstr(note, "no CUDA backend") && !m->gpu,
          "cuda without the backend fails with the reason: %s", note);
    CHECK(engine_device_select(m, "auto", 4096, 1, &d, note, sizeof note) == 0 && d == ENGINE_CPU &&
          note[0], "auto falls back to the CPU and says why: %s", note);
    /* a GPU context on a model that is not on a GPU: an error, not a crash */
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = 256;
    o.device = ENGINE_CUDA;
    struct Engine *e = NULL;
    int rc = engine_new(m, &o, &e, err, sizeof err);
    CHECK(rc == ENGINE_EDEVICE && !e && strstr(err, "not on a GPU"), "engine_new: %d %s", rc, err);
    /* the kernel choice is checked before anything else */
    setenv("DIFFRAG_GPU_ATTENTION", "fast", 1);
    rc = engine_new(m, &o, &e, err, sizeof err);
    CHECK(rc != 0 && !e && strstr(err, "DIFFRAG_GPU_ATTENTION=fast: expected mma, wgmma, wgmma-pipe, "
                                           "wgmma-tma, wgmma-tma-pipe or reference"),
          "an unknown attention kernel is refused: %d %s", rc, err);
    unsetenv("DIFFRAG_GPU_ATTENTION");
    o.device = (enum EngineDevice)7;
    CHECK(engine_new(m, &o, &e, err, sizeof err) == ENGINE_EINPUT && !e, "unknown device value");
    struct EngineMemory mem, cpu;
    o.device = ENGINE_CUDA;
    o.n_ctx = 8192;
    o.chunk = 1024;
    engine_estimate(m, &o, &mem);
    o.device = ENGINE_CPU;
    engine_estimate(m, &o, &cpu);
    CHECK(mem.kv_bytes == (size_t)128 * 30 * 2 * 3 * 64 * 64 * 2 && cpu.kv_bytes > 0 &&
          mem.context_bytes == mem.kv_bytes + mem.scratch_bytes,
          "the GPU estimate counts its pages (%zu bytes) and activations", mem.kv_bytes);
    model_destroy(&m);
}

/* The sampling kernel's radix-select step (its use over whole vocabularies is checked in
 * tests/test_sampler.c): the digit where the running total from the top reaches what is
 * wanted, and the shortfall and empty cases. */
static void test_radix_digit(void)
{
    float h[GPU_RADIX] = {0}, above = -1.f;
    CHECK(gpu_radix_digit(h, 1.f, &above) == 0 && above == 0.f, "empty histogram: digit 0");
    h[200] = 3.f;
    h[100] = 5.f;
    h[7] = 2.f;
    CHECK(gpu_radix_digit(h, 1.f, &above) == 200 && above == 0.f, "want 1: the top digit");
    CHECK(gpu_radix_digit(h, 3.f, &above) == 200 && above == 0.f, "want 3: reached exactly");
    CHECK(gpu_radix_digit(h, 4.f, &above) == 100 && above == 3.f, "want 4: the next, 3 above");
    CHECK(gpu_radix_digit(h, 8.f, &above) == 100 && above == 3.f, "want 8: reached exactly");
    CHECK(gpu_radix_digit(h, 9.f, &above) == 7 && above == 8.f, "want 9: the last digit");
    CHECK(gpu_radix_digit(h, 11.f, &above) == 7 && above == 8.f,
          "want more than there is: the smallest non-empty digit, everything above it");
}

int main(void)
{
    test_radix_digit();
    test_attn_plan();
    test_wg_plan();
    test_wg_layout();
    test_tma_plan();
    test_decode_plan();
    test_pool();
    test_estimate();
    test_bf16();
    test_loading();
    return check_report("test_gpu_plan");
}
