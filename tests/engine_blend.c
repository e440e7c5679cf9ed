/* Chunk KV reuse (engine_blend) against full prefills, on a given model (run by
 * tests/test_engine_blend.py on tiny llama, qwen2 and DIFF V2 models, with and without YaRN,
 * and on the default one), for every KV type:
 *  - recompute share 1: the question's logits equal a full prefill's (1e-4 relative; the
 *    rowwise form makes them bit for bit), with the chunks' stored KV computed elsewhere;
 *    parts without stored KV are computed whatever the share;
 *  - share 0 on a one-chunk prompt, the chunk stored after the same frame: the logits equal
 *    the prefix-cached prefill's;
 *  - RoPE re-rotation: a chunk's KV computed alone at position p, moved to q, equals the KV
 *    computed alone at q: layer 0 (the rotation alone) within two f16 roundings (int8: two
 *    steps), and every layer, with an f32 cache and f32 products, within f32 rounding;
 *    forwards and backwards;
 *  - a share in between recomputes the stated count and gives finite logits, the same again,
 *    with the question as the probe that weighs the choice and without; a probe that does
 *    not fit the context is left out;
 *  - bad parts are refused with a message and leave the sequence as it was;
 *  - the blend in steps computes the one-call blend bit for bit, and the runner's other
 *    sequences step in between with the same results.
 * Usage: engine_blend MODEL.gguf */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/f16.h"
#include "model/chunkkv.h"
#include "model/engine.h"
#include "tests/check.h"

enum { N_FRAME = 37, N_Q = 19, N_CHUNKS = 3 };
static const int CHUNK_LEN[N_CHUNKS] = {150, 97, 70};

static uint32_t rng = 12345;
static int32_t rand_tok(int vocab)
{
    rng = rng * 1664525u + 1013904223u;
    return (int32_t)((rng >> 8) % (uint32_t)vocab);
}

static struct Engine *open_ctx(const struct Model *m, enum KvType kv, int chunk)
{
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = 1024;
    o.chunk = chunk;
    o.kv_type = kv;
    o.n_threads = 2;
    struct Engine *e = NULL;
    char err[256];
    if (engine_new(m, &o, &e, err, sizeof err)) {
        printf("engine_new: %s\n", err);
        return NULL;
    }
    return e;
}

static int prefill(struct Engine *e, const int32_t *t, int n)
{
    char err[256];
    int rc = engine_prefill(e, t, (size_t)n, err, sizeof err);
    if (rc) printf("prefill: %s\n", err);
    return rc;
}

/* The logits of prompt t[0..n) prefilled whole on ref (reset first) into want. */
static int full_logits(struct Engine *ref, const int32_t *t, int n, float *want, int vocab)
{
    engine_reset(ref);
    if (prefill(ref, t, n)) return -1;
    memcpy(want, engine_logits(ref), sizeof(float) * (size_t)vocab);
    return 0;
}

/* The stored KV of a chunk placed after the frame: frame + chunk prefilled, the chunk's
 * positions exported. */
static void *chunk_kv(struct Engine *e, const int32_t *frame, const int32_t *chunk, int n)
{
    int32_t buf[N_FRAME + 200];
    memcpy(buf, frame, sizeof *frame * N_FRAME);
    memcpy(buf + N_FRAME, chunk, sizeof *chunk * (size_t)n);
    engine_reset(e);
    if (prefill(e, buf, N_FRAME + n)) return NULL;
    void *kv = malloc(engine_kv_bytes(e, n));
    char err[256];
    if (kv && engine_kv_export(e, N_FRAME, n, kv, err, sizeof err)) {
        printf("export: %s\n", err);
        free(kv);
        return NULL;
    }
    return kv;
}

/* The logits after frame, a blend of the parts (with probe[0..n_probe)) and the question. */
static int blend_logits(struct Engine *e, const int32_t *frame, const struct EngineKvPart *parts,
                        int np, double share, const int32_t *probe, int n_probe,
                        const int32_t *q, float *out, struct EngineBlendStats *st)
{
    char err[256];
    engine_reset(e);
    if (prefill(e, frame, N_FRAME)) return -1;
    if (engine_blend(e, parts, np, share, probe, n_probe, st, err, sizeof err)) {
        printf("blend: %s\n", err);
        return -1;
    }
    if (prefill(e, q, N_Q)) return -1;
    memcpy(out, engine_logits(e), sizeof *out * (size_t)engine_model(e)->cfg.vocab);
    return 0;
}

/* The largest difference of two exported copies over the first n_layers layers, in units of
 * the f16 rounding step of each head's largest magnitude (int8: of its quantisation step),
 * keys and values apart. */
static void kv_compare(const struct Model *m, enum KvType kv, const void *a, const void *b, int n,
                       int n_layers, double *key_ulps, double *val_ulps)
{
    const struct ModelConfig *c = &m->cfg;
    int hd = c->head_dim;
    size_t eb = kv_elem_bytes(kv), hb = (size_t)hd * eb + (kv == KV_Q8 ? 4 : 0);
    *key_ulps = *val_ulps = 0;
    for (size_t r = 0; r < (size_t)n_layers * n * c->n_kv_head * 2; r++) {
        const unsigned char *pa = (const unsigned char *)a + r * hb;
        const unsigned char *pb = (const unsigned char *)b + r * hb;
        float xa[512], xb[512], big = 0, sa = 1, sb = 1;
        if (kv == KV_Q8) {
            memcpy(&sa, pa + hd, 4);
            memcpy(&sb, pb + hd, 4);
        }
        for (int d = 0; d < hd && d < 512; d++) {
            if (kv == KV_F32) {
                memcpy(&xa[d], pa + 4 * d, 4);
                memcpy(&xb[d], pb + 4 * d, 4);
            } else if (kv == KV_F16) {
                uint16_t ha, hb2;
                memcpy(&ha, pa + 2 * d, 2);
                memcpy(&hb2, pb + 2 * d, 2);
                xa[d] = f16_to_f32(ha);
                xb[d] = f16_to_f32(hb2);
            } else {
                xa[d] = (float)(signed char)pa[d] * sa;
                xb[d] = (float)(signed char)pb[d] * sb;
            }
            big = fabsf(xb[d]) > big ? fabsf(xb[d]) : big;
        }
        double step = kv == KV_Q8 ? big / 127.0 : big * 0x1p-11;
        for (int d = 0; d < hd && d < 512; d++) {
            double u = step > 0 ? fabs((double)xa[d] - xb[d]) / step : 0;
            double *w = r % 2 ? val_ulps : key_ulps;
            if (u > *w) *w = u;
        }
    }
}

/* A chunk computed alone at position `at` (RoPE offset), exported. */
static void *alone_kv(struct Engine *e, const int32_t *chunk, int n, int at)
{
    char err[256];
    engine_reset(e);
    if (engine_set_rope_offset(e, at, err, sizeof err)) {
        printf("offset: %s\n", err);
        return NULL;
    }
    if (prefill(e, chunk, n)) return NULL;
    void *kv = malloc(engine_kv_bytes(e, n));
    if (kv && engine_kv_export(e, 0, n, kv, err, sizeof err)) {
        free(kv);
        return NULL;
    }
    return kv;
}

static void check_kv_type(const struct Model *m, enum KvType kv, const char *name)
{
    const struct ModelConfig *c = &m->cfg;
    int V = c->vocab;
    struct Engine *src = open_ctx(m, kv, 512), *ref = open_ctx(m, kv, 512);
    struct Engine *bl = open_ctx(m, kv, 48); /* a small chunk: blocks of several runs */
    CHECK(src && ref && bl, "%s", name);
    if (!src || !ref || !bl) return;
    int32_t frame[N_FRAME], q[N_Q], chunks[N_CHUNKS][200];
    for (int i = 0; i < N_FRAME; i++) frame[i] = rand_tok(V);
    for (int i = 0; i < N_Q; i++) q[i] = rand_tok(V);
    for (int k = 0; k < N_CHUNKS; k++)
        for (int i = 0; i < CHUNK_LEN[k]; i++) chunks[k][i] = rand_tok(V);
    void *kvs[N_CHUNKS];
    for (int k = 0; k < N_CHUNKS; k++) {
        kvs[k] = chunk_kv(src, frame, chunks[k], CHUNK_LEN[k]);
        CHECK(kvs[k] != NULL, "%s", name);
        if (!kvs[k]) return;
    }
    float *want = malloc(sizeof(float) * V), *got = malloc(sizeof(float) * V);

    /* full prefill of frame, chunks 2, 0, 1 (each away from where it was stored), question */
    static const int order[N_CHUNKS] = {2, 0, 1};
    int32_t full[N_FRAME + 400 + N_Q];
    int n = 0;
    memcpy(full, frame, sizeof frame);
    n += N_FRAME;
    struct EngineKvPart parts[N_CHUNKS];
    for (int j = 0; j < N_CHUNKS; j++) {
        int k = order[j];
        memcpy(full + n, chunks[k], sizeof(int32_t) * CHUNK_LEN[k]);
        parts[j] = (struct EngineKvPart){chunks[k], CHUNK_LEN[k], kvs[k], 0, N_FRAME, 0};
        n += CHUNK_LEN[k];
    }
    memcpy(full + n, q, sizeof q);
    n += N_Q;
    CHECK(full_logits(ref, full, n, want, V) == 0, "%s", name);

    struct EngineBlendStats st;
    CHECK(blend_logits(bl, frame, parts, N_CHUNKS, 1.0, q, N_Q, q, got, &st) == 0, "%s", name);
    double d1 = check_rel_diff(got, want, V);
    printf("%s: share 1, chunks moved: logits within %.2e of the full prefill (%s)\n", name, d1,
           memcmp(got, want, sizeof(float) * V) ? "not bit for bit" : "bit for bit");
    CHECK(d1 <= 1e-4, "%s", name);
    CHECK(st.recomputed == 317 && st.reused == 0 && st.forced == 0, "%s", name);

    /* parts without stored KV are computed, whatever the share */
    struct EngineKvPart bare[N_CHUNKS];
    for (int j = 0; j < N_CHUNKS; j++)
        bare[j] = (struct EngineKvPart){parts[j].tokens, parts[j].n, NULL, 0, 0, 0};
    CHECK(blend_logits(bl, frame, bare, N_CHUNKS, 0.0, q, N_Q, q, got, &st) == 0, "%s", name);
    double d2 = check_rel_diff(got, want, V);
    printf("%s: parts without KV at share 0: within %.2e of the full prefill\n", name, d2);
    CHECK(d2 <= 1e-4 && st.forced == 317 && st.recomputed == 317, "%s", name);

    /* share 0 on a one-chunk prompt stored after the same frame: the prefix-cached logits */
    int32_t one[N_FRAME + 200 + N_Q];
    memcpy(one, frame, sizeof frame);
    memcpy(one + N_FRAME, chunks[0], sizeof(int32_t) * CHUNK_LEN[0]);
    memcpy(one + N_FRAME + CHUNK_LEN[0], q, sizeof q);
    int n1 = N_FRAME + CHUNK_LEN[0] + N_Q;
    engine_reset(src); /* frame + chunk 0 was prefilled on src: its pages are cached there */
    CHECK(prefill(src, one, n1) == 0, "%s", name);
    int cached = engine_cached(src);
    memcpy(want, engine_logits(src), sizeof(float) * V);
    struct EngineKvPart p0 = {chunks[0], CHUNK_LEN[0], kvs[0], 0, N_FRAME, 0};
    CHECK(blend_logits(bl, frame, &p0, 1, 0.0, q, N_Q, q, got, &st) == 0, "%s", name);
    double d3 = check_rel_diff(got, want, V);
    printf("%s: share 0, one chunk: within %.2e of the prefix-cached prefill (%d positions "
           "cached; %s)\n", name, d3, cached,
           memcmp(got, want, sizeof(float) * V) ? "not bit for bit" : "bit for bit");
    CHECK(cached > 0 && d3 <= 1e-4, "%s", name);
    CHECK(st.reused == CHUNK_LEN[0] && st.recomputed == 0 && st.fresh == 0 &&
          st.imported_bytes == engine_kv_bytes(bl, CHUNK_LEN[0]), "%s", name);
    /* the same copy marked as made for this prompt: its kept tokens are counted as fresh */
    p0.fresh = 1;
    CHECK(blend_logits(bl, frame, &p0, 1, 0.0, q, N_Q, q, got, &st) == 0, "%s", name);
    CHECK(st.reused == CHUNK_LEN[0] && st.fresh == CHUNK_LEN[0], "%s", name);

    /* a prefix of a stored chunk (a truncated chunk) takes the copy's first positions */
    int np0 = 100;
    memcpy(one + N_FRAME + np0, q, sizeof q);
    engine_reset(src);
    CHECK(prefill(src, one, N_FRAME + np0 + N_Q) == 0, "%s", name);
    memcpy(want, engine_logits(src), sizeof(float) * V);
    struct EngineKvPart pre = {chunks[0], np0, kvs[0], CHUNK_LEN[0], N_FRAME, 0};
    CHECK(blend_logits(bl, frame, &pre, 1, 0.0, q, N_Q, q, got, &st) == 0, "%s", name);
    double d5 = check_rel_diff(got, want, V);
    printf("%s: share 0, the first %d tokens of a stored chunk: within %.2e of the prefix-cached "
           "prefill\n", name, np0, d5);
    CHECK(d5 <= 1e-4 && st.reused == np0, "%s", name);

    /* a share in between, without a probe and with the question as one, the chunks with
     * two-token labels before them (parts without KV): the count, finite logits, and the same
     * logits again after other tokens have filled the context's pages (nothing read from a
     * page the blend did not write: the probe runs before the labels' upper layers are
     * computed); the probe runs (and at shares 0 and 1 above it did not change a bit) */
    float *alt = malloc(sizeof(float) * V);
    int32_t labels[N_CHUNKS][2], dirt[600];
    for (int i = 0; i < 600; i++) dirt[i] = rand_tok(V);
    struct EngineKvPart lparts[2 * N_CHUNKS];
    for (int j = 0; j < N_CHUNKS; j++) {
        labels[j][0] = rand_tok(V);
        labels[j][1] = rand_tok(V);
        lparts[2 * j] = (struct EngineKvPart){labels[j], 2, NULL, 0, 0, 0};
        lparts[2 * j + 1] = parts[j];
    }
    lparts[1].fresh = 1; /* the first chunk's copy counts as made for this prompt */
    CHECK(alt != NULL, "%s", name);
    if (!alt) return;
    for (int with = 0; with < 2; with++) {
        CHECK(blend_logits(bl, frame, lparts, 2 * N_CHUNKS, 0.15, with ? q : NULL,
                           with ? N_Q : 0, q, got, &st) == 0, "%s", name);
        int fin = 1;
        for (int i = 0; i < V; i++) fin &= isfinite(got[i]);
        printf("%s: share 0.15%s: %d recomputed, %d reused, %d probe tokens\n", name,
               with ? ", the question as probe" : "", st.recomputed, st.reused, st.probed);
        CHECK(fin && st.forced == 2 * N_CHUNKS &&
              st.recomputed == 2 * N_CHUNKS + (int)ceil(0.15 * 317) &&
              st.reused == 317 - (st.recomputed - st.forced) && st.probed == (with ? N_Q : 0),
              "%s", name);
        /* the fresh count is the first chunk's tokens that kept their copy */
        CHECK(st.fresh <= lparts[1].n && st.fresh >= lparts[1].n - (st.recomputed - st.forced),
              "%s", name);
        CHECK(engine_n_past(bl) == N_FRAME + 317 + 2 * N_CHUNKS + N_Q, "%s", name);
        engine_reset(bl);
        CHECK(prefill(bl, dirt, 600) == 0, "%s", name);
        struct EngineBlendStats st2;
        CHECK(blend_logits(bl, frame, lparts, 2 * N_CHUNKS, 0.15, with ? q : NULL,
                           with ? N_Q : 0, q, alt, &st2) == 0 &&
              !memcmp(alt, got, sizeof(float) * V), "%s", name);
    }
    /* a probe that does not fit the context after the region is left out: the blend is the one
     * without a probe */
    CHECK(blend_logits(bl, frame, parts, N_CHUNKS, 0.15, NULL, 0, q, alt, &st) == 0, "%s", name);
    int32_t *long_probe = calloc(1024, sizeof *long_probe);
    CHECK(long_probe && blend_logits(bl, frame, parts, N_CHUNKS, 0.15, long_probe, 1024 - 317 -
                                     N_FRAME + 1, q, got, &st) == 0, "%s", name);
    CHECK(st.probed == 0 && !memcmp(alt, got, sizeof(float) * V), "%s", name);
    free(long_probe);
    free(alt);

    /* RoPE re-rotation: alone at p, moved to q, against alone at q */
    static const int moves[][2] = {{5, 3000}, {1234, 64}, {0, 1}, {700, 765}};
    for (size_t i = 0; i < sizeof moves / sizeof moves[0]; i++) {
        int p = moves[i][0], at = moves[i][1], nc = CHUNK_LEN[1];
        void *kp = alone_kv(src, chunks[1], nc, p), *kq = alone_kv(src, chunks[1], nc, at);
        CHECK(kp && kq, "%s", name);
        if (!kp || !kq) break;
        char err[256];
        engine_reset(bl);
        CHECK(engine_set_rope_offset(bl, at, err, sizeof err) == 0, "%s", name);
        struct EngineKvPart mv = {chunks[1], nc, kp, 0, p, 0};
        CHECK(engine_blend(bl, &mv, 1, 0.0, NULL, 0, NULL, err, sizeof err) == 0, "%s", name);
        void *km = malloc(engine_kv_bytes(bl, nc));
        CHECK(km && engine_kv_export(bl, 0, nc, km, err, sizeof err) == 0, "%s", name);
        /* Layer 0 holds the rotation alone: its inputs do not depend on the position. The
         * later layers see the earlier ones' stored keys, rounded apart at p and at q, so
         * with a rounded cache they differ by more than one rounding (printed); with an f32
         * cache every layer agrees to f32 rounding. */
        double ku, vu, ka, va, ku0, vu0;
        kv_compare(m, kv, km, kq, nc, 1, &ku, &vu);
        kv_compare(m, kv, km, kq, nc, c->n_layer, &ka, &va);
        kv_compare(m, kv, kp, kq, nc, 1, &ku0, &vu0);
        const char *unit = kv == KV_Q8 ? "int8 steps" : "f16 steps";
        printf("%s: KV moved %d -> %d against the KV computed there: layer 0 keys within %.3f "
               "%s (unmoved: %.0f), values %.3f; every layer: keys %.3f, values %.3f\n", name,
               p, at, ku, unit, ku0, vu, ka, va);
        CHECK(ku <= 2.0 && vu == 0 && ku0 > 10 * (ku + 1), "%s", name);
        /* every layer with an f32 cache, f32 products (DIFFRAG_GEMM=native) and f32 attention
         * (DIFFRAG_ATTN=f32): f32 rounding; the int8 products round activations to 8 bits
         * and the AMX attention multiplies in bf16, and a rounding that falls the other way
         * at one layer moves the next ones further */
        const char *gemm = getenv("DIFFRAG_GEMM"), *attn = getenv("DIFFRAG_ATTN");
        if (kv == KV_F32 && gemm && !strcmp(gemm, "native") && attn && !strcmp(attn, "f32"))
            CHECK(ka <= 0.05 && va <= 0.05, "%s", name);
        free(kp);
        free(kq);
        free(km);
    }

    /* refusals leave the sequence as it was */
    char err[256];
    engine_reset(bl);
    CHECK(prefill(bl, frame, N_FRAME) == 0, "%s", name);
    struct EngineKvPart badp = {chunks[0], CHUNK_LEN[0], kvs[0], 0, -1, 0};
    struct EngineKvPart badl = {chunks[0], CHUNK_LEN[0], kvs[0], 3, 0, 0};
    CHECK(engine_blend(bl, &badp, 1, 0.5, NULL, 0, NULL, err, sizeof err) == ENGINE_EINPUT, "%s",
          name);
    printf("%s: refused: %s\n", name, err);
    CHECK(engine_blend(bl, &badl, 1, 0.5, NULL, 0, NULL, err, sizeof err) == ENGINE_EINPUT, "%s",
          name);
    CHECK(engine_blend(bl, parts, N_CHUNKS, 1.5, NULL, 0, NULL, err, sizeof err) ==
          ENGINE_EINPUT, "%s", name);
    int32_t oob[2] = {0, V};
    struct EngineKvPart badt = {oob, 2, NULL, 0, 0, 0};
    CHECK(engine_blend(bl, &badt, 1, 0.5, NULL, 0, NULL, err, sizeof err) == ENGINE_EINPUT, "%s",
          name);
    int32_t *zeros = calloc(1000, sizeof *zeros);
    struct EngineKvPart huge = {zeros, 1000, NULL, 0, 0, 0};
    CHECK(zeros && engine_blend(bl, &huge, 1, 0.5, NULL, 0, NULL, err, sizeof err) ==
          ENGINE_ECTX, "%s", name);
    free(zeros);
    int32_t badq[2] = {0, -1};
    CHECK(engine_blend(bl, parts, N_CHUNKS, 0.5, badq, 2, NULL, err, sizeof err) ==
          ENGINE_EINPUT, "%s", name);
    printf("%s: refused: %s\n", name, err);
    CHECK(engine_blend(bl, parts, N_CHUNKS, 0.5, NULL, 3, NULL, err, sizeof err) ==
          ENGINE_EINPUT, "%s", name);
    CHECK(engine_kv_export(bl, 10, N_FRAME, got, err, sizeof err) == ENGINE_EINPUT, "%s", name);
    CHECK(engine_set_rope_offset(bl, 3, err, sizeof err) == ENGINE_EINPUT, "%s", name);
    CHECK(engine_n_past(bl) == N_FRAME, "%s", name);

    for (int k = 0; k < N_CHUNKS; k++) free(kvs[k]);
    free(want);
    free(got);
    engine_destroy(&src);
    engine_destroy(&ref);
    engine_destroy(&bl);
}

/* The chunk store (model/chunkkv.h): a prompt of frame, three chunks with two-token labels
 * before each, and a question, blended through the store at share 1, equals its full prefill;
 * the same chunks in another order and with other labels are found, not made again; a budget
 * that holds one chunk evicts and still blends correctly (what does not fit is computed). */
static void check_store(const struct Model *m)
{
    const char *name = "chunk store";
    int V = m->cfg.vocab;
    struct Engine *e = open_ctx(m, KV_F16, 48), *ref = open_ctx(m, KV_F16, 512);
    struct Engine *helper = NULL;
    char err[256];
    CHECK(e && ref && engine_new_seq(e, &helper, err, sizeof err) == 0, "%s", name);
    if (!e || !ref || !helper) return;
    int32_t chunks[N_CHUNKS][200], frame[N_FRAME], q[N_Q];
    for (int i = 0; i < N_FRAME; i++) frame[i] = rand_tok(V);
    for (int i = 0; i < N_Q; i++) q[i] = rand_tok(V);
    for (int k = 0; k < N_CHUNKS; k++)
        for (int i = 0; i < CHUNK_LEN[k]; i++) chunks[k][i] = rand_tok(V);
    float *want = malloc(sizeof(float) * V), *got = malloc(sizeof(float) * V);
    for (int budget_small = 0; budget_small < 2; budget_small++) {
        struct ChunkKv *c = NULL;
        size_t one = engine_kv_bytes(e, CHUNK_LEN[0]) + CHUNK_LEN[0] * sizeof(int32_t);
        CHECK(chunkkv_new(budget_small ? one : (size_t)64 << 20, &c) == 0, "%s", name);
        for (int round = 0; round < 2; round++) {
            int32_t prompt[N_FRAME + 3 * 202 + N_Q];
            uint32_t spans[2 * N_CHUNKS];
            int n = N_FRAME;
            memcpy(prompt, frame, sizeof frame);
            for (int j = 0; j < N_CHUNKS; j++) {
                int k = round ? N_CHUNKS - 1 - j : j;
                prompt[n++] = rand_tok(V); /* a label of two tokens */
                prompt[n++] = rand_tok(V);
                spans[2 * j] = (uint32_t)n;
                memcpy(prompt + n, chunks[k], sizeof(int32_t) * CHUNK_LEN[k]);
                n += CHUNK_LEN[k];
                spans[2 * j + 1] = (uint32_t)n;
            }
            int docs_end = n;
            memcpy(prompt + n, q, sizeof q);
            n += N_Q;
            CHECK(full_logits(ref, prompt, n, want, V) == 0, "%s", name);
            engine_reset(e);
            struct ChunkKvBlend b;
            int rc = chunkkv_blend(c, e, helper, prompt, N_FRAME, docs_end, n, spans, N_CHUNKS,
                                   NULL, 1.0, &b, err, sizeof err);
            CHECK(rc == 0, "%s: %s", name, err);
            CHECK(prefill(e, prompt + docs_end, n - docs_end) == 0, "%s", name);
            memcpy(got, engine_logits(e), sizeof(float) * V);
            double d = check_rel_diff(got, want, V);
            struct ChunkKvStats st;
            chunkkv_stats(c, &st);
            printf("%s, budget %s, round %d: %d chunks, %d made; logits within %.2e of the full "
                   "prefill; store: %zu chunks, %zu bytes, %llu hits, %llu misses, %llu "
                   "evicted\n", name, budget_small ? "of one chunk" : "64 MiB", round, b.chunks,
                   b.computed, d, st.entries, st.bytes, (unsigned long long)st.hits,
                   (unsigned long long)st.misses, (unsigned long long)st.evictions);
            CHECK(d <= 1e-4 && b.chunks == N_CHUNKS, "%s", name);
            CHECK(st.bytes <= (budget_small ? one : (size_t)64 << 20), "%s", name);
            if (!budget_small)
                CHECK(b.computed == (round ? 0 : N_CHUNKS) &&
                      st.hits == (round ? N_CHUNKS : 0), "%s", name);
            else
                CHECK(st.entries <= 1 && b.computed <= 1, "%s", name);
        }
        /* spans out of order or outside the documents are refused */
        int32_t p2[N_FRAME + 10];
        memcpy(p2, frame, sizeof frame);
        for (int i = 0; i < 10; i++) p2[N_FRAME + i] = rand_tok(V);
        uint32_t bad[4] = {N_FRAME + 5, N_FRAME + 8, N_FRAME + 1, N_FRAME + 3};
        engine_reset(e);
        struct ChunkKvBlend b;
        CHECK(chunkkv_blend(c, e, helper, p2, N_FRAME, N_FRAME + 9, N_FRAME + 10, bad, 2, NULL,
                            0.5, &b, err, sizeof err) == ENGINE_EINPUT, "%s", name);
        chunkkv_destroy(&c);
    }
    free(want);
    free(got);
    engine_destroy(&helper);
    engine_destroy(&e);
    engine_destroy(&ref);
}

/* A chunk placed twice in one prompt over an empty store: its copy is made at the first span
 * and serves the second, and both spans' kept tokens count as made for this prompt (fresh),
 * none as reused; the same prompt blended again reuses both. Share 0: every token is kept. */
static void check_twice(const struct Model *m)
{
    const char *name = "chunk placed twice";
    int V = m->cfg.vocab, len = CHUNK_LEN[0];
    struct Engine *e = open_ctx(m, KV_F16, 48), *helper = NULL;
    struct ChunkKv *c = NULL;
    char err[256];
    CHECK(e && engine_new_seq(e, &helper, err, sizeof err) == 0 &&
          chunkkv_new((size_t)64 << 20, &c) == 0, "%s", name);
    if (!e || !helper || !c) {
        chunkkv_destroy(&c);
        engine_destroy(&helper);
        engine_destroy(&e);
        return;
    }
    int32_t prompt[N_FRAME + 2 * 202 + N_Q];
    uint32_t spans[4];
    int n = 0;
    for (int i = 0; i < N_FRAME; i++) prompt[n++] = rand_tok(V);
    int32_t chunk[200];
    for (int i = 0; i < len; i++) chunk[i] = rand_tok(V);
    for (int j = 0; j < 2; j++) {
        prompt[n++] = rand_tok(V);   /* a label of two tokens */
        prompt[n++] = rand_tok(V);
        spans[2 * j] = (uint32_t)n;
        memcpy(prompt + n, chunk, sizeof(int32_t) * len);
        n += len;
        spans[2 * j + 1] = (uint32_t)n;
    }
    int docs_end = n;
    for (int i = 0; i < N_Q; i++) prompt[n++] = rand_tok(V);
    for (int round = 0; round < 2; round++) {
        struct ChunkKvBlend b;
        engine_reset(e);
        int rc = chunkkv_blend(c, e, helper, prompt, N_FRAME, docs_end, n, spans, 2, NULL, 0.0,
                               &b, err, sizeof err);
        CHECK(rc == 0, "%s: %s", name, err);
        printf("%s, round %d: %d chunks, %d made, %d reused, %d fresh\n", name, round, b.chunks,
               b.computed, b.reused, b.fresh);
        if (round == 0)
            CHECK(b.chunks == 2 && b.computed == 1 && b.reused == 0 && b.fresh == 2 * len,
                  "%s: the first blend reused %d tokens, %d fresh", name, b.reused, b.fresh);
        else
            CHECK(b.computed == 0 && b.reused == 2 * len && b.fresh == 0,
                  "%s: the second blend reused %d tokens, %d fresh", name, b.reused, b.fresh);
    }
    chunkkv_destroy(&c);
    engine_destroy(&helper);
    engine_destroy(&e);
}

/* Leads (ChunkKvSpans): a one-chunk prompt frame + label + chunk + question, whose chunk's
 * copy is made after the frame and a lead equal to the label, blends at share 0 to the full
 * prefill's logits (the copy is the prompt's own KV), and without the lead it does not (the
 * copy never saw the label), nor when the chunk is computed in full instead (ChunkKvSpans.
 * n_full, no copy used or made); a sequence that already holds part of the chunk (a cached prefix
 * reaching into the documents) blends the rest, to the same logits; the copy is named by frame
 * and lead (chunkkv_after), not by the frame alone; the chunk placed second, after another
 * label, with the same lead, is found, not made again; leads outside their tokens are refused. */
static void check_leads(const struct Model *m)
{
    const char *name = "copies after a lead";
    enum { NL = 4 };
    int V = m->cfg.vocab, len = CHUNK_LEN[1];
    struct Engine *e = open_ctx(m, KV_F16, 48), *ref = open_ctx(m, KV_F16, 512), *helper = NULL;
    struct ChunkKv *c = NULL;
    char err[256];
    CHECK(e && ref && engine_new_seq(e, &helper, err, sizeof err) == 0 &&
          chunkkv_new((size_t)64 << 20, &c) == 0, "%s", name);
    float *want = malloc(sizeof(float) * V), *got = malloc(sizeof(float) * V);
    if (!e || !ref || !helper || !c || !want || !got) goto out;
    int32_t frame[N_FRAME], label[NL], other[NL], chunk[200], q[N_Q];
    int32_t prompt[N_FRAME + 2 * (NL + 200) + N_Q];
    for (int i = 0; i < N_FRAME; i++) frame[i] = rand_tok(V);
    for (int i = 0; i < NL; i++) label[i] = rand_tok(V);
    for (int i = 0; i < NL; i++) other[i] = rand_tok(V);
    for (int i = 0; i < len; i++) chunk[i] = rand_tok(V);
    for (int i = 0; i < N_Q; i++) q[i] = rand_tok(V);
    int n = 0;
    memcpy(prompt, frame, sizeof frame);
    n += N_FRAME;
    memcpy(prompt + n, label, sizeof label);
    n += NL;
    uint32_t spans[4] = {(uint32_t)n, (uint32_t)(n + len)};
    memcpy(prompt + n, chunk, sizeof(int32_t) * len);
    n += len;
    int docs_end = n;
    memcpy(prompt + n, q, sizeof q);
    n += N_Q;
    CHECK(full_logits(ref, prompt, n, want, V) == 0, "%s", name);
    uint32_t rng2[4] = {0, NL, 0, NL};
    struct ChunkKvSpans lv = {.lead_tokens = label, .n_lead_tokens = NL, .leads = rng2};
    double d[2];
    for (int with = 1; with >= 0; with--) {
        struct ChunkKvBlend b;
        engine_reset(e);
        CHECK(chunkkv_blend(c, e, helper, prompt, N_FRAME, docs_end, n, spans, 1,
                            with ? &lv : NULL, 0.0, &b, err, sizeof err) == 0 &&
              prefill(e, prompt + docs_end, n - docs_end) == 0, "%s: %s", name, err);
        memcpy(got, engine_logits(e), sizeof(float) * V);
        d[with] = check_rel_diff(got, want, V);
        CHECK(b.computed == 1 && b.recomputed == NL, "%s", name);   /* the label: computed */
    }
    uint64_t frame_h = chunkkv_frame(prompt, N_FRAME), after = chunkkv_after(frame_h, label, NL);
    printf("%s: share 0, one chunk: with the label as its lead within %.2e of the full prefill, "
           "without a lead %.2e\n", name, d[1], d[0]);
    CHECK(d[1] <= 1e-4 && d[0] > 1e-3, "%s", name);
    /* the chunk ranked best and computed in full (n_full 1), no lead: no copy is used or
     * made, and at share 0 the logits are the full prefill's */
    uint32_t rank0[2] = {0, 1};
    struct ChunkKvSpans full = {.ranks = rank0, .n_full = 1};
    struct ChunkKvBlend bf;
    struct ChunkKvStats s0, s1;
    chunkkv_stats(c, &s0);
    engine_reset(e);
    CHECK(chunkkv_blend(c, e, helper, prompt, N_FRAME, docs_end, n, spans, 1, &full, 0.0, &bf,
                        err, sizeof err) == 0 &&
          prefill(e, prompt + docs_end, n - docs_end) == 0, "%s: %s", name, err);
    chunkkv_stats(c, &s1);
    memcpy(got, engine_logits(e), sizeof(float) * V);
    double dfull = check_rel_diff(got, want, V);
    printf("%s: share 0, the chunk computed in full: %d recomputed, within %.2e of the full "
           "prefill\n", name, bf.recomputed, dfull);
    CHECK(dfull <= 1e-4 && bf.full == 1 && bf.chunks == 1 && bf.computed == 0 &&
          bf.recomputed == NL + len && s1.hits == s0.hits && s1.misses == s0.misses, "%s", name);

    /* a sequence that holds the frame, the label and part of the chunk (a cached prefix
     * reaching into the documents) blends the rest: the rest of the chunk is computed, and
     * at share 0 the logits are still the full prefill's; one that holds all the documents
     * has nothing to blend */
    struct ChunkKvBlend bp;
    engine_reset(e);
    CHECK(prefill(e, prompt, N_FRAME + NL + 20) == 0 &&
          chunkkv_blend(c, e, helper, prompt, N_FRAME, docs_end, n, spans, 1, &lv, 0.0, &bp,
                        err, sizeof err) == 0 &&
          prefill(e, prompt + docs_end, n - docs_end) == 0, "%s: %s", name, err);
    memcpy(got, engine_logits(e), sizeof(float) * V);
    double dp = check_rel_diff(got, want, V);
    printf("%s: share 0 after a prefix that holds 20 of the chunk's tokens: %d recomputed, "
           "within %.2e of the full prefill\n", name, bp.recomputed, dp);
    CHECK(dp <= 1e-4 && bp.recomputed == len - 20 && bp.chunks == 0, "%s", name);
    engine_reset(e);
    CHECK(prefill(e, prompt, docs_end) == 0 &&
          chunkkv_blend(c, e, helper, prompt, N_FRAME, docs_end, n, spans, 1, &lv, 0.0, &bp,
                        err, sizeof err) == ENGINE_EINPUT, "%s: nothing to blend", name);
    CHECK(after != frame_h && chunkkv_after(frame_h, label, 0) == frame_h &&
          chunkkv_has(c, after, chunk, len) && chunkkv_has(c, frame_h, chunk, len) &&
          !chunkkv_has(c, chunkkv_after(frame_h, other, NL), chunk, len), "%s", name);

    /* the same chunk second, after another label and a first chunk, with the same lead */
    int m2 = N_FRAME;
    memcpy(prompt + m2, other, sizeof other);
    m2 += NL;
    spans[0] = (uint32_t)m2;
    for (int i = 0; i < 20; i++) prompt[m2++] = rand_tok(V);
    spans[1] = (uint32_t)m2;
    memcpy(prompt + m2, other, sizeof other);
    m2 += NL;
    spans[2] = (uint32_t)m2;
    memcpy(prompt + m2, chunk, sizeof(int32_t) * len);
    m2 += len;
    spans[3] = (uint32_t)m2;
    int docs_end2 = m2;
    memcpy(prompt + m2, q, sizeof q);
    m2 += N_Q;
    uint32_t two[4] = {0, 0, 0, NL};   /* the first chunk after the frame alone */
    lv.leads = two;
    struct ChunkKvBlend b;
    engine_reset(e);
    CHECK(chunkkv_blend(c, e, helper, prompt, N_FRAME, docs_end2, m2, spans, 2, &lv, 0.15, &b,
                        err, sizeof err) == 0, "%s: %s", name, err);
    printf("%s: the chunk again after another label: %d chunks, %d made, %d reused\n", name,
           b.chunks, b.computed, b.reused);
    CHECK(b.chunks == 2 && b.computed == 1, "%s: %d copies made", name, b.computed);
    uint32_t bad[4] = {0, NL, 2, NL + 1};
    lv.leads = bad;
    engine_reset(e);
    CHECK(chunkkv_blend(c, e, helper, prompt, N_FRAME, docs_end2, m2, spans, 2, &lv, 0.15, &b,
                        err, sizeof err) == ENGINE_EINPUT, "%s: a lead outside its tokens", name);
out:
    free(want);
    free(got);
    chunkkv_destroy(&c);
    engine_destroy(&helper);
    engine_destroy(&ref);
    engine_destroy(&e);
}

/* The blend in steps (chunkkv_blend_begin/step): a prompt of frame, three labelled chunks and
 * the question, over an empty store (every copy made on the helper, a few tokens a step) and
 * then over the filled one, at share 0.15 with the question as the probe, gives the logits of
 * the blend in one call, bit for bit, whatever the steps' sizes; another sequence of the same
 * runner decodes a token between every two steps, and its logits equal those of the same
 * decodes without a blend in between; the blending sequence refuses tokens until the blend
 * ends; a blend dropped halfway (engine_reset, chunkkv_blend_end while a copy is under way)
 * leaves the sequence, the helper and the store to blend again. */
static void check_steps(const struct Model *m)
{
    const char *name = "blend in steps";
    int V = m->cfg.vocab;
    struct Engine *e = open_ctx(m, KV_F16, 48), *helper = NULL, *other = NULL;
    char err[256];
    CHECK(e && engine_new_seq(e, &helper, err, sizeof err) == 0 &&
          engine_new_seq(e, &other, err, sizeof err) == 0, "%s", name);
    if (!e || !helper || !other) {
        engine_destroy(&other);
        engine_destroy(&helper);
        engine_destroy(&e);
        return;
    }
    struct Engine *seq = NULL;
    CHECK(engine_new_seq(e, &seq, err, sizeof err) == 0, "%s", name);
    int32_t prompt[N_FRAME + 3 * 202 + N_Q], ctx[40];
    uint32_t spans[2 * N_CHUNKS];
    int n = 0;
    for (int i = 0; i < N_FRAME; i++) prompt[n++] = rand_tok(V);
    for (int j = 0; j < N_CHUNKS; j++) {
        prompt[n++] = rand_tok(V);
        prompt[n++] = rand_tok(V);
        spans[2 * j] = (uint32_t)n;
        for (int i = 0; i < CHUNK_LEN[j]; i++) prompt[n++] = rand_tok(V);
        spans[2 * j + 1] = (uint32_t)n;
    }
    int docs_end = n;
    for (int i = 0; i < N_Q; i++) prompt[n++] = rand_tok(V);
    for (int i = 0; i < 40; i++) ctx[i] = rand_tok(V);
    /* each chunk's copy is made after a lead of its own: 3, 0 and 5 tokens */
    int32_t lead_tok[8];
    uint32_t lead_rng[2 * N_CHUNKS] = {0, 3, 3, 3, 3, 8};
    for (int i = 0; i < 8; i++) lead_tok[i] = rand_tok(V);
    struct ChunkKvSpans lv = {.lead_tokens = lead_tok, .n_lead_tokens = 8, .leads = lead_rng};
    float *want = malloc(sizeof(float) * V), *got = malloc(sizeof(float) * V);
    float *dec_want = malloc(sizeof(float) * V * 64), *dec_got = malloc(sizeof(float) * V * 64);
    CHECK(want && got && dec_want && dec_got, "%s", name);
    if (!want || !got || !dec_want || !dec_got || !seq) goto out;

    /* the other sequence's decodes alone: 64 tokens after its 40 */
    engine_reset(other);
    CHECK(prefill(other, ctx, 40) == 0, "%s", name);
    for (int t = 0; t < 64; t++) {
        int32_t tok = ctx[t % 40];
        struct EngineBatchItem it = {other, &tok, 1, 0, 1, 0};
        CHECK(engine_step(e, &it, 1, NULL, err, sizeof err) == 0, "%s: %s", name, err);
        memcpy(dec_want + (size_t)t * V, engine_logits(other), sizeof(float) * V);
    }

    for (int filled = 0; filled < 2; filled++) {
        struct ChunkKv *c = NULL;
        struct ChunkKvBlend one, b;
        CHECK(chunkkv_new((size_t)64 << 20, &c) == 0, "%s", name);
        engine_reset(seq);
        CHECK(chunkkv_blend(c, seq, helper, prompt, N_FRAME, docs_end, n, spans, N_CHUNKS,
                            &lv, 0.15, &one, err, sizeof err) == 0 &&
              prefill(seq, prompt + docs_end, n - docs_end) == 0, "%s: %s", name, err);
        memcpy(want, engine_logits(seq), sizeof(float) * V);
        static const int sizes[] = {1, 7, 64};
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            if (!filled) {
                /* an empty store: every copy is made in this blend's steps */
                chunkkv_destroy(&c);
                CHECK(chunkkv_new((size_t)64 << 20, &c) == 0, "%s", name);
            }
            engine_reset(seq);
            engine_reset(other);
            CHECK(prefill(other, ctx, 40) == 0, "%s", name);
            struct ChunkKvJob *j = NULL;
            CHECK(chunkkv_blend_begin(c, seq, helper, prompt, N_FRAME, docs_end, n, spans,
                                      N_CHUNKS, &lv, 0.15, &j, err, sizeof err) == 0, "%s",
                  name);
            int done = 0, steps = 0, decoded = 0, rc = 0;
            while (j && !done && rc == 0) {
                rc = chunkkv_blend_step(j, sizes[k], &done, &b, err, sizeof err);
                steps++;
                if (decoded < 64 && rc == 0) {
                    int32_t tok = ctx[decoded % 40];
                    struct EngineBatchItem it = {other, &tok, 1, 0, 1, 0};
                    CHECK(engine_step(e, &it, 1, NULL, err, sizeof err) == 0, "%s: %s", name, err);
                    memcpy(dec_got + (size_t)decoded * V, engine_logits(other), sizeof(float) * V);
                    decoded++;
                }
                if (!done && engine_blending(seq))
                    CHECK(engine_prefill(seq, prompt, 1, err, sizeof err) == ENGINE_EINPUT,
                          "%s", name);
            }
            CHECK(rc == 0 && done, "%s: %s", name, err);
            chunkkv_blend_end(&j);
            CHECK(prefill(seq, prompt + docs_end, n - docs_end) == 0, "%s", name);
            memcpy(got, engine_logits(seq), sizeof(float) * V);
            int same = !memcmp(got, want, sizeof(float) * V);
            int dec_same = !memcmp(dec_got, dec_want, sizeof(float) * V * (size_t)decoded);
            printf("%s, %s store, %d-token steps: %d steps, %d made, %d reused, %d recomputed; "
                   "logits %s the one-call blend's; %d decodes between steps %s alone\n", name,
                   filled ? "a filled" : "an empty", sizes[k], steps, b.computed, b.reused,
                   b.recomputed, same ? "equal" : "DIFFER from", decoded,
                   dec_same ? "equal to" : "DIFFER from");
            CHECK(same && dec_same && b.recomputed == one.recomputed && b.probed == N_Q &&
                  b.computed == (filled ? 0 : N_CHUNKS) && b.chunks == N_CHUNKS, "%s", name);
            CHECK(sizes[k] == 64 || steps > 10, "%s: %d steps", name, steps);
        }
        /* dropped halfway, while the helper makes a copy (empty store) or the engine blends */
        chunkkv_destroy(&c);
        CHECK(chunkkv_new((size_t)64 << 20, &c) == 0, "%s", name);
        engine_reset(seq);
        if (filled)
            CHECK(chunkkv_blend(c, seq, helper, prompt, N_FRAME, docs_end, n, spans, N_CHUNKS,
                                &lv, 0.15, &b, err, sizeof err) == 0, "%s", name);
        engine_reset(seq);
        struct ChunkKvJob *j = NULL;
        int done = 0;
        CHECK(chunkkv_blend_begin(c, seq, helper, prompt, N_FRAME, docs_end, n, spans, N_CHUNKS,
                                  &lv, 0.15, &j, err, sizeof err) == 0, "%s", name);
        /* a filled store: steps until the engine blends, then one more; an empty one: until
         * the helper holds part of the first copy */
        for (int i = 0; i < 200 && j && !done &&
                        (filled ? !engine_blending(seq) : engine_n_past(helper) <= N_FRAME); i++)
            CHECK(chunkkv_blend_step(j, 1, &done, &b, err, sizeof err) == 0, "%s", name);
        if (j && !done && filled)
            CHECK(chunkkv_blend_step(j, 1, &done, &b, err, sizeof err) == 0, "%s", name);
        CHECK(!done && (filled ? engine_blending(seq) : engine_n_past(helper) > N_FRAME), "%s",
              name);
        chunkkv_blend_end(&j);
        engine_reset(seq);
        CHECK(!engine_blending(seq) && engine_n_past(helper) == 0, "%s", name);
        CHECK(chunkkv_blend(c, seq, helper, prompt, N_FRAME, docs_end, n, spans, N_CHUNKS,
                            &lv, 0.15, &b, err, sizeof err) == 0 &&
              prefill(seq, prompt + docs_end, n - docs_end) == 0 &&
              !memcmp(engine_logits(seq), want, sizeof(float) * V), "%s: after a dropped blend: "
              "%s", name, err);
        chunkkv_destroy(&c);
    }
out:
    free(want);
    free(got);
    free(dec_want);
    free(dec_got);
    engine_destroy(&seq);
    engine_destroy(&other);
    engine_destroy(&helper);
    engine_destroy(&e);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
        return 2;
    }
    struct Model *m = NULL;
    char err[512];
    if (model_load(argv[1], &m, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    /* DIFFRAG_TEST_SCALE=small (slower machines, the sanitizer pass): the f16 cache only */
    int small = check_small_scale();
    if (small) printf("small scale: the f16 cache only\n");
    check_kv_type(m, KV_F16, "f16");
    if (!small) check_kv_type(m, KV_F32, "f32");
    if (!small && m->cfg.head_dim % 2 == 0 && m->cfg.head_dim <= 256) check_kv_type(m, KV_Q8, "int8");
    check_store(m);
    check_twice(m);
    check_leads(m);
    check_steps(m);
    model_destroy(&m);
    return check_report("chunk KV reuse against full prefills");
}
