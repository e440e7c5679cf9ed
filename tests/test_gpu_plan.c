/* The GPU backend's host-side logic, checked without a GPU: the attention kernels' launch
 * plans, the decode split plan, the KV page pool (also under two threads), the device memory
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

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static int passed, failed;
#define CHECK(cond, ...) do { if (cond) passed++; else { failed++; \
    fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); \
    fprintf(stderr, "\n"); } } while (0)

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
    struct GpuKvPool *p;
    int ok;
};

static void *pool_churn(void *arg)
{
    struct PoolJob *j = arg;
    int32_t pages[7];
    for (int i = 0; i < 20000; i++) {
        if (gpu_pool_take(j->p, 7, pages) == 0) {
            for (int k = 0; k < 7; k++)
                if (pages[k] < 0 || pages[k] >= j->p->n_pages) j->ok = 0;
            gpu_pool_give(j->p, 7, pages);
        }
    }
    return NULL;
}

static void test_pool(void)
{
    struct GpuKvPool p;
    CHECK(gpu_pool_init(&p, NULL, 4096, 20) == 0, "pool init");
    int32_t a[20], b[20];
    CHECK(gpu_pool_take(&p, 12, a) == 0 && gpu_pool_free_pages(&p) == 8, "take 12 of 20");
    CHECK(gpu_pool_take(&p, 9, b) == -1 && gpu_pool_free_pages(&p) == 8,
          "a request beyond the free pages takes nothing");
    CHECK(gpu_pool_take(&p, 8, b) == 0 && gpu_pool_free_pages(&p) == 0, "take the rest");
    int seen[20] = {0}, dup = 0;
    for (int i = 0; i < 12; i++) dup |= seen[a[i]]++;
    for (int i = 0; i < 8; i++) dup |= seen[b[i]]++;
    CHECK(!dup, "no page handed out twice");
    CHECK(a[0] == 0 && a[1] == 1, "a lone sequence gets pages in address order");
    gpu_pool_give(&p, 12, a);
    gpu_pool_give(&p, 8, b);
    CHECK(gpu_pool_free_pages(&p) == 20, "all pages back");
    pthread_t th[2];
    struct PoolJob j[2] = {{&p, 1}, {&p, 1}};
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, pool_churn, &j[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    CHECK(j[0].ok && j[1].ok && gpu_pool_free_pages(&p) == 20, "two threads churning: %d free",
          gpu_pool_free_pages(&p));
    CHECK(gpu_pool_take(&p, 20, a) == 0, "then the whole pool again");
    memset(seen, 0, sizeof seen);
    dup = 0;
    for (int i = 0; i < 20; i++) dup |= seen[a[i]]++;
    CHECK(!dup, "still no duplicate page after the churn");
    gpu_pool_fini(&p);
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
    CHECK(engine_device_select(m, "cpu", 4096, &d, note, sizeof note) == 0 && d == ENGINE_CPU,
          "device cpu");
    CHECK(engine_device_select(m, "gpu", 4096, &d, note, sizeof note) == -1 &&
          strstr(note, "auto, cpu or cuda"), "an unknown device is refused: %s", note);
    CHECK(engine_device_select(m, "cuda", 4096, &d, note, sizeof note) == -1 &&
          strstr(note, "no CUDA backend") && !m->gpu,
          "cuda without the backend fails with the reason: %s", note);
    CHECK(engine_device_select(m, "auto", 4096, &d, note, sizeof note) == 0 && d == ENGINE_CPU &&
          note[0], "auto falls back to the CPU and says why: %s", note);
    /* a GPU context on a model that is not on a GPU: an error, not a crash */
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = 256;
    o.device = ENGINE_CUDA;
    struct Engine *e = NULL;
    int rc = engine_new(m, &o, &e, err, sizeof err);
    CHECK(rc == ENGINE_EDEVICE && !e && strstr(err, "not on a GPU"), "engine_new: %d %s", rc, err);
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

int main(void)
{
    test_attn_plan();
    test_decode_plan();
    test_pool();
    test_estimate();
    test_bf16();
    test_loading();
    printf("test_gpu_plan: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
