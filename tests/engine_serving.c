/* The serving engine's exactness (run by tests/test_engine_serving.py on tiny llama, qwen2 and
 * DIFF V2 models and the default one). The prefix cache against cold prefills: prompts of 63, 64, 65 and 1,000 tokens and prompts that share only part of a
 * cached one, for every KV type; logits within 1e-5 relative (and whether bit for bit), the
 * watched heads' masses, greedy answers token for token, the cached counts; then a pool of a
 * few pages: eviction, a peek at the cached prefix that takes nothing, the refusal when every
 * page is referenced, and the pool back at idle.
 * Batches (engine_step) against sequences alone: 16 prompts of different lengths, prefilled in
 * steps of a small token budget beside the others' decode tokens, every logit bit for bit.
 * Usage: engine_serving MODEL.gguf */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/engine.h"
#include "model/generate.h"
#include "model/kvpool.h"
#include "tests/check.h"

enum { N_BASE = 1000, ANSWER = 12 };

struct Run {
    float *logits;
    struct AttnMass mass[ENGINE_MAX_WATCH];
    int n_mass;
    int32_t answer[ANSWER];
    int n_answer;
    int cached;
};

static int collect(void *user, const struct GenToken *t)
{
    struct Run *r = user;
    if (t->id >= 0 && r->n_answer < ANSWER) r->answer[r->n_answer++] = t->id;
    return 0;
}

/* Prefills `p` into e (reset first) and records logits, masses, cached count and a greedy
 * answer. */
static int run(struct Engine *e, const int32_t *p, int n, struct Run *r, int vocab)
{
    char err[256];
    engine_reset(e);
    uint8_t cls[N_BASE + 64];
    for (int i = 0; i < n; i++) cls[i] = i >= 8 && i < n - 8 ? ATTN_DOC : ATTN_OTHER;
    if (engine_set_spans(e, cls, (size_t)n, err, sizeof err)) return -1;
    if (engine_prefill(e, p, (size_t)n, err, sizeof err)) {
        printf("prefill: %s\n", err);
        return -1;
    }
    r->cached = engine_cached(e);
    memcpy(r->logits, engine_logits(e), (size_t)vocab * sizeof(float));
    const struct AttnMass *ms = engine_attn_mass(e, &r->n_mass);
    if (ms) memcpy(r->mass, ms, (size_t)r->n_mass * sizeof *ms);
    struct GenParams gp = {.max_tokens = ANSWER, .prefilled = 1};
    sampler_params_default(&gp.sampler);
    gp.sampler.temperature = 0;
    struct GenResult g;
    r->n_answer = 0;
    if (generate(e, p, (size_t)n, &gp, collect, r, &g, err, sizeof err)) {
        printf("generate: %s\n", err);
        return -1;
    }
    free(g.text);
    return 0;
}

static const char *kv_name(enum KvType t) { return t == KV_F32 ? "f32" : t == KV_F16 ? "f16" : "q8"; }

static void compare_prompts(struct Model *m, enum KvType kv)
{
    char err[256];
    int V = m->cfg.vocab;
    int32_t base[N_BASE], other[N_BASE];
    for (int i = 0; i < N_BASE; i++) {
        base[i] = (int32_t)((7 + (unsigned)i * 2654435761u % 100003u) % (unsigned)V);
        other[i] = (int32_t)((3 + (unsigned)i * 40503u % 65521u) % (unsigned)V);
    }
    struct KvPool *pool = NULL, *cold_pool = NULL;
    CHECK(kvpool_new(m, kv, 64, 1, &pool, err, sizeof err) == 0, "pool: %s", err);
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = N_BASE + 64;
    o.kv_type = kv;
    o.n_threads = 2;
    o.chunk = 100;                        /* the warm engine cuts prompts at 100s */
    o.kv_pool = pool;
    struct Engine *warm = NULL, *cold = NULL;
    CHECK(engine_new(m, &o, &warm, err, sizeof err) == ENGINE_OK, "warm engine: %s", err);
    CHECK(kvpool_new(m, kv, kvpool_pages_for(o.n_ctx), 0, &cold_pool, err, sizeof err) == 0,
          "cold pool: %s", err);
    o.kv_pool = cold_pool;              /* caching off */
    o.chunk = 48;                         /* the cold one at 48s, across the page boundaries */
    CHECK(engine_new(m, &o, &cold, err, sizeof err) == ENGINE_OK, "cold engine: %s", err);
    if (!warm || !cold) goto out;
    struct AttnWatch w[ENGINE_MAX_WATCH];
    int nw = engine_default_watch(m, w, ENGINE_MAX_WATCH);
    CHECK(engine_watch(warm, w, nw, err, sizeof err) == 0 &&
          engine_watch(cold, w, nw, err, sizeof err) == 0, "watch: %s", err);

    struct Run a = {.logits = malloc((size_t)V * sizeof(float))};
    struct Run b = {.logits = malloc((size_t)V * sizeof(float))};
    /* The cache is filled by the whole base prompt once. */
    CHECK(run(warm, base, N_BASE, &a, V) == 0 && a.cached == 0, "filling run (cached %d)", a.cached);
    /* A prompt sharing the first 700 tokens, then other tokens. */
    int32_t mixed[N_BASE];
    memcpy(mixed, base, 700 * sizeof *mixed);
    memcpy(mixed + 700, other, (N_BASE - 700) * sizeof *mixed);
    struct { const int32_t *p; int n, want_cached; const char *what; } cases[] = {
        {base, 63, 0, "63 tokens (inside the first page)"},
        {base, 64, 0, "64 tokens (one full page: its last token is computed)"},
        {base, 65, 64, "65 tokens"},
        {base, N_BASE, 960, "1,000 tokens"},
        {mixed, N_BASE, 640, "700 shared tokens, then others"},
        {other, 200, 0, "no shared prefix"},
    };
    double worst = 0;
    int bitwise = 1;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        if (run(warm, cases[c].p, cases[c].n, &a, V) || run(cold, cases[c].p, cases[c].n, &b, V)) {
            CHECK(0, "%s: run failed", cases[c].what);
            continue;
        }
        CHECK(a.cached == cases[c].want_cached && b.cached == 0, "%s kv %s: cached %d (want %d), "
              "cold %d", cases[c].what, kv_name(kv), a.cached, cases[c].want_cached, b.cached);
        double d = check_rel_diff(a.logits, b.logits, V);
        worst = d > worst ? d : worst;
        if (memcmp(a.logits, b.logits, (size_t)V * sizeof(float))) bitwise = 0;
        CHECK(d <= 1e-5, "%s kv %s: logits differ by %.3g relative", cases[c].what, kv_name(kv), d);
        CHECK(a.n_mass == b.n_mass && a.n_mass == nw, "%s: %d and %d masses", cases[c].what,
              a.n_mass, b.n_mass);
        for (int i = 0; i < a.n_mass && i < b.n_mass; i++)
            CHECK(fabsf(a.mass[i].doc - b.mass[i].doc) <= 1e-5f &&
                  fabsf(a.mass[i].gen - b.mass[i].gen) <= 1e-5f &&
                  fabsf(a.mass[i].diff_doc - b.mass[i].diff_doc) <= 1e-4f,
                  "%s: mass %d differs (%g vs %g)", cases[c].what, i, a.mass[i].doc, b.mass[i].doc);
        CHECK(a.n_answer == b.n_answer && !memcmp(a.answer, b.answer, (size_t)a.n_answer * 4),
              "%s kv %s: greedy answers differ", cases[c].what, kv_name(kv));
    }
    printf("kv %s: cached and cold prefills: logits within %.3g relative (%s), masses and "
           "greedy answers equal\n", kv_name(kv), worst, bitwise ? "bit for bit" : "not bit for bit");
    free(a.logits);
    free(b.logits);
    engine_reset(warm);
    struct KvPoolStats st;
    kvpool_stats(pool, &st);
    CHECK(st.pages_used == 0 && st.hit_tokens == 64 + 960 + 640 && st.pages_cached > 0,
          "pool after the runs: %zu used, %zu cached, %llu hit tokens", st.pages_used,
          st.pages_cached, (unsigned long long)st.hit_tokens);
out:
    engine_destroy(&warm);
    engine_destroy(&cold);
    kvpool_destroy(&pool);
    kvpool_destroy(&cold_pool);
}

/* The residual stream kept by engine_capture: the row entering layer 0 is the last token's
 * embedding; the row after the last layer, through the final norm and the LM head, gives the
 * engine's logits; a decode step's rows are its token's; a cached prefix leaves them as a cold
 * prefill computes them; bad layers are refused; a reset forgets them. */
static void capture(struct Model *m)
{
    char err[256];
    const struct ModelConfig *c = &m->cfg;
    int d = c->dim, V = c->vocab, L = c->n_layer;
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = 256;
    o.chunk = 48;
    o.n_threads = 2;
    struct Engine *e = NULL, *e2 = NULL;
    CHECK(engine_new(m, &o, &e, err, sizeof err) == ENGINE_OK &&
          engine_new(m, &o, &e2, err, sizeof err) == ENGINE_OK, "engines: %s", err);
    if (!e || !e2) goto out;
    int bad[2] = {0, L + 1}, dup[2] = {1, 1}, layers[3] = {0, L / 2, L};
    CHECK(engine_capture(e, bad, 2, err, sizeof err) == ENGINE_EINPUT, "layer %d accepted", L + 1);
    CHECK(engine_capture(e, dup, 2, err, sizeof err) == ENGINE_EINPUT, "a layer twice accepted");
    CHECK(engine_capture(e, layers, ENGINE_MAX_CAPTURE + 1, err, sizeof err) == ENGINE_EINPUT,
          "%d layers accepted", ENGINE_MAX_CAPTURE + 1);
    CHECK(engine_capture(e, layers, 3, err, sizeof err) == ENGINE_OK &&
          engine_capture(e2, layers, 3, err, sizeof err) == ENGINE_OK, "capture: %s", err);
    int32_t p[100];
    for (int i = 0; i < 100; i++) p[i] = (int32_t)((11 + (unsigned)i * 2654435761u % 9973u) % (unsigned)V);
    int n = 0;
    CHECK(engine_hidden(e, &n) == NULL && n == 0, "rows before any evaluation");
    CHECK(engine_prefill(e, p, 100, err, sizeof err) == ENGINE_OK, "prefill: %s", err);
    const float *h = engine_hidden(e, &n);
    CHECK(h && n == 3, "%d rows after a prefill", n);
    float *emb = malloc((size_t)d * sizeof *emb), *x = malloc((size_t)d * sizeof *x);
    float *row = malloc((size_t)d * sizeof *row), *keep = malloc((size_t)3 * d * sizeof *keep);
    if (!h || n != 3 || !emb || !x || !row || !keep) goto done;
    memcpy(keep, h, (size_t)3 * d * sizeof *keep);
    backend_cpu.weights_row(&m->tok_embd, p[99], emb);
    CHECK(!memcmp(emb, keep, (size_t)d * sizeof *emb), "layer 0's row is not the last token's embedding");
    /* the final norm and the LM head over the last row, against the engine's logits */
    const float *hl = keep + (size_t)2 * d;
    double ss = 0;
    for (int i = 0; i < d; i++) ss += (double)hl[i] * hl[i];
    double inv = 1.0 / sqrt(ss / d + c->norm_eps);
    for (int i = 0; i < d; i++) x[i] = (float)(hl[i] * inv) * m->output_norm[i];
    const float *lg = engine_logits(e);
    double worst = 0, big = 0;
    for (int v = 0; v < V; v++) {
        backend_cpu.weights_row(&m->output, v, row);
        double z = 0;
        for (int i = 0; i < d; i++) z += (double)row[i] * x[i];
        worst = fmax(worst, fabs(z - lg[v]));
        big = fmax(big, fabs(lg[v]));
    }
    CHECK(worst <= 2e-2 * big, "the last layer's row gives logits %.3g away from the engine's "
          "(largest %.3g)", worst, big);
    /* the same prompt with its prefix from the cache gives the same rows */
    CHECK(engine_prefill(e2, p, 100, err, sizeof err) == ENGINE_OK, "prefill: %s", err);
    engine_reset(e2);
    CHECK(engine_hidden(e2, &n) == NULL, "rows survive a reset");
    CHECK(engine_prefill(e2, p, 100, err, sizeof err) == ENGINE_OK && engine_cached(e2) > 0,
          "cached prefill: %s (cached %d)", err, engine_cached(e2));
    h = engine_hidden(e2, &n);
    double dh = h ? check_rel_diff(keep, h, 3 * d) : 1;
    CHECK(h && n == 3 && dh <= 1e-5, "rows after a cached prefix differ by %.3g", dh);
    /* a decode step: its token's rows */
    CHECK(engine_decode(e, p[5], err, sizeof err) == ENGINE_OK, "decode: %s", err);
    h = engine_hidden(e, &n);
    backend_cpu.weights_row(&m->tok_embd, p[5], emb);
    CHECK(h && n == 3 && !memcmp(emb, h, (size_t)d * sizeof *emb), "a decode step's layer-0 row");
    printf("capture: layer 0 = the embedding, the last layer's row gives the logits within %.3g "
           "of %.3g, cached prefix within %.3g\n", worst, big, dh);
done:
    free(emb);
    free(x);
    free(row);
    free(keep);
out:
    engine_destroy(&e);
    engine_destroy(&e2);
}

/* A pool of 6 pages shared by two 256-token contexts. */
static void small_pool(struct Model *m)
{
    char err[256];
    struct KvPool *pool = NULL;
    CHECK(kvpool_new(m, KV_F16, 6, 1, &pool, err, sizeof err) == 0, "pool: %s", err);
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = 256;
    o.chunk = 64;
    o.kv_pool = pool;
    struct Engine *e1 = NULL, *e2 = NULL;
    CHECK(engine_new(m, &o, &e1, err, sizeof err) == 0 && engine_new(m, &o, &e2, err, sizeof err) == 0,
          "engines: %s", err);
    if (!e1 || !e2) goto out;
    int V = m->cfg.vocab;
    int32_t p[256];
    /* Ten different prompts of 3 pages through one context: each completes, evicting. */
    for (int k = 0; k < 10; k++) {
        for (int i = 0; i < 192; i++) p[i] = (int32_t)((k * 131 + i * 17 + 1) % V);
        engine_reset(e1);
        CHECK(engine_prefill(e1, p, 192, err, sizeof err) == ENGINE_OK, "prompt %d: %s", k, err);
    }
    engine_reset(e1);
    struct KvPoolStats st;
    kvpool_stats(pool, &st);
    CHECK(st.pages_used == 0 && st.evicted_pages > 0 && st.pages_cached <= 6,
          "after ten prompts: %zu used, %zu cached, %llu evicted", st.pages_used, st.pages_cached,
          (unsigned long long)st.evicted_pages);
    /* The last prompt is still cached: a peek says what its prefill takes (2 pages that
     * nobody holds) and takes nothing; once e1 holds them, they are no longer idle. */
    int idle = -1;
    long avail = engine_pages_available(e1);
    int peeked = engine_peek_cached(e1, p, 192, &idle);
    CHECK(peeked == 128 && idle == 2 && engine_pages_available(e1) == avail,
          "peek: %d positions, %d idle pages, %ld then %ld available", peeked, idle, avail,
          engine_pages_available(e1));
    CHECK(engine_prefill(e1, p, 192, err, sizeof err) == ENGINE_OK && engine_cached(e1) == 128,
          "the last prompt hits (%d cached)", engine_cached(e1));
    peeked = engine_peek_cached(e2, p, 192, &idle);
    CHECK(peeked == 128 && idle == 0, "peek beside e1: %d positions, %d idle", peeked, idle);
    CHECK(engine_pages_total(e1) == 6 && engine_pages_for(e1, 64) == 1 &&
          engine_pages_for(e1, 65) == 2 && engine_pages_for(e1, 0) == 0,
          "pages: %ld in all, %d for 65 positions", engine_pages_total(e1),
          engine_pages_for(e1, 65));
    engine_reset(e1);
    /* e1 holds 4 pages; e2 can get 2 and is refused the third with a clear error. */
    for (int i = 0; i < 256; i++) p[i] = (int32_t)((i * 7 + 3) % V);
    CHECK(engine_prefill(e1, p, 256, err, sizeof err) == ENGINE_OK, "e1 fills 4 pages: %s", err);
    for (int i = 0; i < 256; i++) p[i] = (int32_t)((i * 11 + 5) % V);
    int rc = engine_prefill(e2, p, 192, err, sizeof err);
    CHECK(rc == ENGINE_EBUDGET && strstr(err, "no free page"), "e2 refused: %d %s", rc, err);
    engine_reset(e2);
    engine_reset(e1);
    CHECK(engine_prefill(e2, p, 192, err, sizeof err) == ENGINE_OK, "e2 after e1 let go: %s", err);
    engine_reset(e2);
    kvpool_stats(pool, &st);
    CHECK(st.pages_used == 0, "the pool is back at idle (%zu pages used)", st.pages_used);
    printf("small pool: %llu pages evicted, refusal when all are in use, idle at the end\n",
           (unsigned long long)st.evicted_pages);
out:
    engine_destroy(&e1);
    engine_destroy(&e2);
    kvpool_destroy(&pool);
}

enum { N_SEQ = 16, GEN = 10, BUDGET = 96 };

static int32_t argmax(const float *lg, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (lg[i] > lg[best]) best = i;
    return best;
}

/* Each sequence alone (prefill, then greedy decode), then all together in steps of BUDGET
 * tokens: every decode token of the running sequences, then prefill chunks of the waiting ones
 * in order (Sarathi-Serve's stall-free batching). */
static void batch_equals_alone(struct Model *m, enum KvType kv)
{
    char err[256];
    int V = m->cfg.vocab;
    struct KvPool *pool = NULL;
    CHECK(kvpool_new(m, kv, (N_SEQ + 1) * 8, 0, &pool, err, sizeof err) == 0, "pool: %s", err);
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = 512;
    o.chunk = BUDGET;
    o.kv_type = kv;
    o.n_threads = 2;
    o.kv_pool = pool;
    struct Engine *runner = NULL, *seq[N_SEQ] = {0};
    CHECK(engine_new(m, &o, &runner, err, sizeof err) == 0, "runner: %s", err);
    for (int i = 0; i < N_SEQ && runner; i++)
        CHECK(engine_new_seq(runner, &seq[i], err, sizeof err) == 0, "sequence %d: %s", i, err);
    if (!runner || !seq[N_SEQ - 1]) goto out;
    static int32_t prompt[N_SEQ][300];
    int len[N_SEQ];
    for (int i = 0; i < N_SEQ; i++) {
        len[i] = 3 + (i * 53) % 290;
        for (int t = 0; t < len[i]; t++)
            prompt[i][t] = (int32_t)((11 + (unsigned)(i * 7919 + t * 104729)) % (unsigned)V);
    }
    static float alone[N_SEQ][GEN][8];   /* a few logits of each step, and the chosen token */
    int32_t alone_tok[N_SEQ][GEN];
    float *full_alone = malloc((size_t)N_SEQ * GEN * V * sizeof(float));
    if (!full_alone) goto out;
    for (int i = 0; i < N_SEQ; i++) {
        engine_reset(runner);
        int rc = engine_prefill(runner, prompt[i], (size_t)len[i], err, sizeof err);
        CHECK(rc == 0, "alone %d: %s", i, err);
        for (int g = 0; g < GEN && rc == 0; g++) {
            const float *lg = engine_logits(runner);
            memcpy(full_alone + ((size_t)i * GEN + g) * V, lg, (size_t)V * sizeof(float));
            memcpy(alone[i][g], lg, sizeof alone[i][g]);
            alone_tok[i][g] = argmax(lg, V);
            if (g + 1 < GEN) rc = engine_decode(runner, alone_tok[i][g], err, sizeof err);
        }
    }
    engine_reset(runner);
    /* together */
    int done_prefill[N_SEQ] = {0}, n_gen[N_SEQ] = {0}, steps = 0, max_batch = 0, differ = 0;
    int32_t last[N_SEQ];
    int finished = 0;
    while (finished < N_SEQ && steps < 10000) {
        struct EngineBatchItem it[N_SEQ];
        int k = 0, budget = BUDGET;
        for (int i = 0; i < N_SEQ; i++)
            if (done_prefill[i] == len[i] && n_gen[i] > 0 && n_gen[i] < GEN) {
                it[k++] = (struct EngineBatchItem){seq[i], &last[i], 1, 0, 1, 0};
                budget--;
            }
        for (int i = 0; i < N_SEQ && budget > 0; i++)
            if (done_prefill[i] < len[i]) {
                int n = len[i] - done_prefill[i] < budget ? len[i] - done_prefill[i] : budget;
                it[k++] = (struct EngineBatchItem){seq[i], prompt[i] + done_prefill[i], n, 1,
                                                   done_prefill[i] + n == len[i], 0};
                budget -= n;
            }
        int failed;
        if (engine_step(runner, it, k, &failed, err, sizeof err)) {
            CHECK(0, "step %d: %s (item %d)", steps, err, failed);
            break;
        }
        steps++;
        max_batch = k > max_batch ? k : max_batch;
        for (int j = 0; j < k; j++) {
            int i = (int)(it[j].seq == seq[0] ? 0 : -1);
            for (int q = 0; q < N_SEQ; q++)
                if (it[j].seq == seq[q]) i = q;
            if (it[j].prefill) {
                done_prefill[i] += it[j].n;
                if (done_prefill[i] < len[i]) continue;
            }
            const float *lg = engine_logits(seq[i]);
            int g = n_gen[i];
            if (memcmp(lg, full_alone + ((size_t)i * GEN + g) * V, (size_t)V * sizeof(float)))
                differ++;
            last[i] = argmax(lg, V);
            CHECK(last[i] == alone_tok[i][g], "sequence %d token %d: %d batched, %d alone", i, g,
                  last[i], alone_tok[i][g]);
            if (++n_gen[i] == GEN) finished++;
        }
    }
    CHECK(finished == N_SEQ, "%d of %d sequences finished", finished, N_SEQ);
    CHECK(differ == 0, "%d steps' logits differ from the sequence alone", differ);
    CHECK(max_batch >= 8, "batches were small (%d sequences at most)", max_batch);
    printf("kv %s: batched and alone: %d sequences in %d steps (up to %d per step), logits bit for "
           "bit, greedy answers equal\n", kv_name(kv), N_SEQ, steps, max_batch);
    free(full_alone);
out:
    for (int i = 0; i < N_SEQ; i++) engine_destroy(&seq[i]);
    engine_destroy(&runner);
    kvpool_destroy(&pool);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc != 2) {
        fprintf(stderr, "usage: engine_serving MODEL.gguf\n");
        return 2;
    }
    char err[512];
    struct Model *m = NULL;
    if (model_load(argv[1], &m, err, sizeof err) != MODEL_OK) {
        printf("FAIL cannot load %s: %s\n", argv[1], err);
        return 1;
    }
    /* DIFFRAG_TEST_SCALE=small (slower machines, the sanitizer pass): the f16 cache only */
    int small = check_small_scale();
    enum KvType kinds[] = {KV_F16, KV_F32, KV_Q8};
    int n_kinds = small ? 1 : 3;
    if (small) printf("small scale: the f16 cache only\n");
    for (int k = 0; k < n_kinds; k++) compare_prompts(m, kinds[k]);
    for (int k = 0; k < n_kinds; k++) batch_equals_alone(m, kinds[k]);
    small_pool(m);
    capture(m);
    model_destroy(&m);
    return check_report("engine_serving");
}
