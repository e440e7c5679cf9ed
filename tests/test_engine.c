/* Engine API unit tests: cancellation between chunks and decode steps, context and budget
 * limits, bad token ids, stop strings, sampler behaviour and the per-token signals. Run from
 * the repository root, on the default model (models/SmolLM2-135M-Instruct.Q4_1.gguf) or on
 * the model DIFFRAG_TEST_MODEL names: tests/test_valgrind_units.py gives it a tiny random one,
 * as a decode step of the default model takes valgrind about 15 s (it emulates each FMA
 * instruction). Every figure checked is computed from the model's configuration. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/cpu/cpu.h"
#include "model/engine.h"
#include "model/generate.h"
#include "tests/check.h"

static const char *DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

struct CancelAt { struct Engine *e; int after_tokens; int seen; };

static int cancel_cb(void *user, const struct GenToken *t)
{
    struct CancelAt *c = user;
    if (t->id >= 0) c->seen++;
    if (c->seen == c->after_tokens) engine_cancel(c->e);
    return 0;
}

static int stop_cb(void *user, const struct GenToken *t)
{
    (void)t;
    return ++*(int *)user >= 3;
}

struct Streamed { char buf[4096]; size_t len; };

static int stream_cb(void *user, const struct GenToken *t)
{
    struct Streamed *s = user;
    if (s->len + t->text_len < sizeof s->buf) {
        memcpy(s->buf + s->len, t->text, t->text_len);
        s->len += t->text_len;
    }
    return 0;
}

static void *cancel_later(void *arg)
{
    usleep(20000);
    engine_cancel(arg);
    return NULL;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* f32 prefill products: the checks below hold prefill, decode and scoring to each other
     * within f32 rounding, and decode's one-token products are f32. The int8 prefill products
     * (the default with AVX-512 VNNI or AVX2) round the activations to 8 bits first; test_kernels and
     * test_qwen_oracle.py check those. */
    setenv("DIFFRAG_GEMM", "native", 1);
    const char *path = getenv("DIFFRAG_TEST_MODEL");
    if (!path || !*path) path = DEFAULT_MODEL;
    char err[512];
    struct Model *m = NULL;
    if (model_load(path, &m, err, sizeof err) != MODEL_OK) {
        printf("FAIL cannot load %s: %s\n", path, err);
        return 1;
    }
    printf("model %s: %d layers, %d KV heads of %d\n", path, m->cfg.n_layer, m->cfg.n_kv_head,
           m->cfg.head_dim);
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_ctx = 1024;
    o.chunk = 16;
    struct Engine *e = NULL;
    CHECK(engine_new(m, &o, &e, err, sizeof err) == ENGINE_OK, "engine_new: %s", err);

    int32_t toks[600];
    int V = m->cfg.vocab;
    for (int i = 0; i < 600; i++) toks[i] = (100 + (i * 37) % 5000) % V;

    /* A cancel requested before a prefill stops it at the first chunk boundary. */
    engine_cancel(e);
    CHECK(engine_prefill(e, toks, 64, err, sizeof err) == ENGINE_ECANCELLED, "pre-cancel");
    CHECK(engine_n_past(e) == 0, "nothing evaluated after a pre-cancel (n_past %d)", engine_n_past(e));
    CHECK(engine_prefill(e, toks, 16, err, sizeof err) == ENGINE_OK, "cancel is consumed: %s", err);
    CHECK(engine_n_past(e) == 16, "n_past 16");

    /* Cancel from another thread during a long prefill: stops at a chunk boundary. */
    engine_reset(e);
    pthread_t th;
    pthread_create(&th, NULL, cancel_later, e);
    int rc = engine_prefill(e, toks, 600, err, sizeof err);
    pthread_join(th, NULL);
    CHECK(rc == ENGINE_ECANCELLED || rc == ENGINE_OK, "threaded cancel rc %d", rc);
    if (rc == ENGINE_ECANCELLED)
        CHECK(engine_n_past(e) % 16 == 0 && engine_n_past(e) < 600,
              "stopped on a chunk boundary (n_past %d)", engine_n_past(e));
    printf("threaded cancel: %s after %d of 600 tokens\n", rc ? "stopped" : "finished first",
           engine_n_past(e));

    /* Bad inputs. */
    engine_reset(e);
    int32_t bad[2] = {5, m->cfg.vocab};
    CHECK(engine_prefill(e, bad, 2, err, sizeof err) == ENGINE_EINPUT && strstr(err, "vocabulary"),
          "out-of-vocabulary id refused: %s", err);
    CHECK(engine_n_past(e) == 0, "refused input leaves the sequence empty");
    int32_t *many = calloc(1100, sizeof *many);
    CHECK(engine_prefill(e, many, 1100, err, sizeof err) == ENGINE_ECTX, "context overflow refused");
    free(many);

    /* Budget: refused with both figures, before allocating. */
    struct EngineOpts big = o;
    big.n_ctx = 131072;
    big.mem_budget = 64u << 20;
    struct Engine *e2 = NULL;
    CHECK(engine_new(m, &big, &e2, err, sizeof err) == ENGINE_EBUDGET && !e2, "budget refused");
    CHECK(strstr(err, "67108864") != NULL && strstr(err, "needs") != NULL, "message: %s", err);
    struct EngineMemory mem;
    engine_estimate(m, &big, &mem);
    CHECK(mem.kv_bytes == 2ull * m->cfg.n_layer * m->cfg.n_kv_head * 131072 * m->cfg.head_dim * 2,
          "KV estimate %zu", mem.kv_bytes);

    /* Decode-step cancellation: stops within one step, reason cancelled. */
    struct GenParams gp = {.max_tokens = 40};
    sampler_params_default(&gp.sampler);
    struct GenResult res;
    struct TokenSignal sig_tmp;
    struct CancelAt ca = {.e = e, .after_tokens = 5};
    int32_t prompt[4] = {504 % V, 3458 % V, 282 % V, 4649 % V};
    rc = generate(e, prompt, 4, &gp, cancel_cb, &ca, &res, err, sizeof err);
    CHECK(rc == ENGINE_OK && res.finish == FINISH_CANCELLED, "cancel mid-decode: rc %d finish %s",
          rc, finish_reason_name(res.finish));
    CHECK(res.n_generated == 5, "stopped right after the step it was requested in (%d)", res.n_generated);
    free(res.text);

    /* Callback asks to stop. */
    int count = 0;
    rc = generate(e, prompt, 4, &gp, stop_cb, &count, &res, err, sizeof err);
    CHECK(rc == 0 && res.finish == FINISH_CANCELLED && res.n_generated == 3, "callback stop");
    free(res.text);

    /* Greedy: deterministic, length-limited, streamed text equals the final text. */
    struct Streamed st1 = {0}, st2 = {0};
    gp.max_tokens = 20;
    rc = generate(e, prompt, 4, &gp, stream_cb, &st1, &res, err, sizeof err);
    CHECK(rc == 0 && res.finish == FINISH_LENGTH && res.n_generated == 20, "length finish");
    CHECK(st1.len == res.text_len && !memcmp(st1.buf, res.text, res.text_len),
          "stream == final text");
    char first[4096];
    snprintf(first, sizeof first, "%s", res.text);
    free(res.text);
    rc = generate(e, prompt, 4, &gp, stream_cb, &st2, &res, err, sizeof err);
    CHECK(rc == 0 && !strcmp(first, res.text), "greedy is deterministic");
    free(res.text);

    /* Stop string taken from the greedy output: the output ends right before it. */
    CHECK(strlen(first) > 8, "greedy text long enough to take a stop string from: '%s'", first);
    if (strlen(first) > 8) {
        char stop[5];
        memcpy(stop, first + 6, 4);
        stop[4] = 0;
        const char *stops[1] = {stop};
        struct GenParams gs = gp;
        gs.stop = stops;
        gs.n_stop = 1;
        struct Streamed st3 = {0};
        rc = generate(e, prompt, 4, &gs, stream_cb, &st3, &res, err, sizeof err);
        const char *hit = strstr(first, stop);
        CHECK(rc == 0 && res.finish == FINISH_STOP && hit &&
              res.text_len == (size_t)(hit - first) && !memcmp(res.text, first, res.text_len),
              "stop string '%s': got '%s'", stop, res.text);
        CHECK(st3.len == res.text_len, "streamed text never included the stop string");
        free(res.text);
    }

    /* Sampling: same seed, same text; temperature with top-k 1 equals greedy; signals sane. */
    struct GenParams gt = gp;
    gt.sampler.temperature = 0.9f;
    gt.sampler.seed = 42;
    char a[4096], b[4096];
    generate(e, prompt, 4, &gt, NULL, NULL, &res, err, sizeof err);
    snprintf(a, sizeof a, "%s", res.text);
    free(res.text);
    generate(e, prompt, 4, &gt, NULL, NULL, &res, err, sizeof err);
    snprintf(b, sizeof b, "%s", res.text);
    free(res.text);
    CHECK(!strcmp(a, b), "seeded sampling is reproducible");
    gt.sampler.top_k = 1;
    generate(e, prompt, 4, &gt, NULL, NULL, &res, err, sizeof err);
    CHECK(!strcmp(res.text, first), "top-k 1 equals greedy");
    free(res.text);

    /* Per-position scores: each position's NLL and argmax equal those of the logits a
     * token-by-token decode leaves (its chunks of 16 cross boundaries), and their sum is
     * engine_score's. */
    enum { NS = 40 };
    float nll[NS - 1];
    int32_t top[NS - 1];
    engine_reset(e);
    rc = engine_score_positions(e, toks, NS, nll, top, NULL, err, sizeof err);
    CHECK(rc == ENGINE_OK && engine_n_past(e) == NS, "score_positions: %s", err);
    double nll_sum = 0, max_nll_diff = 0, pos_sum = 0;
    size_t n_scored = 0;
    engine_reset(e);
    CHECK(engine_score(e, toks, NS, &nll_sum, &n_scored, err, sizeof err) == ENGINE_OK &&
          n_scored == NS - 1, "engine_score: %s", err);
    engine_reset(e);
    int top_ok = 1;
    /* Scoring runs the prefill's attention, decoding the f32 flash-decoding path: where the
     * prefill's is the AMX path (bf16 products) the two differ by its rounding, not f32's. */
    int amx = cpu_attn_amx_default();
    double nll_tol = amx ? 1e-2 : 5e-4;
    float tie = amx ? 5e-2f : 1e-3f;
    for (int i = 0; i < NS - 1; i++) {
        pos_sum += nll[i];
        CHECK(engine_decode(e, toks[i], err, sizeof err) == ENGINE_OK, "decode %d: %s", i, err);
        const float *lg = engine_logits(e);
        sampler_signal(lg, V, toks[i + 1], &sig_tmp);
        /* relative: a chunk's products and a single row's round differently */
        double dn = fabs(nll[i] + sig_tmp.logprob) / (1 + fabs(sig_tmp.logprob));
        if (dn > max_nll_diff) max_nll_diff = dn;
        int best = 0;
        for (int j = 1; j < V; j++) if (lg[j] > lg[best]) best = j;
        /* a different argmax only where the two logits tie within rounding */
        if (top[i] < 0 || top[i] >= V || (top[i] != best && fabsf(lg[top[i]] - lg[best]) > tie))
            top_ok = 0;
    }
    printf("score_positions: max |nll - decode nll| / (1 + nll) %.2e (prefill attention %s), "
           "sum %.6f vs engine_score %.6f\n", max_nll_diff, amx ? "amx" : "f32", pos_sum, nll_sum);
    CHECK(max_nll_diff < nll_tol, "per-position NLL matches decode (max relative diff %g)",
          max_nll_diff);
    CHECK(top_ok, "per-position argmax matches decode");
    CHECK(fabs(pos_sum - nll_sum) < 1e-3 * (1 + nll_sum), "sum %f vs engine_score %f", pos_sum,
          nll_sum);
    float nll_only[NS - 1];
    engine_reset(e);
    CHECK(engine_score_positions(e, toks, NS, nll_only, NULL, NULL, err, sizeof err) == ENGINE_OK &&
          !memcmp(nll_only, nll, sizeof nll), "NULL top: same NLLs, deterministic");
    CHECK(engine_score_positions(e, toks, 1, nll, top, NULL, err, sizeof err) == ENGINE_EINPUT,
          "one token refused");

    float logits[5] = {1.f, 3.f, 2.f, -INFINITY, 0.f};
    struct TokenSignal sig;
    sampler_signal(logits, 5, 1, &sig);
    double z = exp(1) + exp(3) + exp(2) + exp(0);
    CHECK(fabs(sig.logprob - (3 - log(z))) < 1e-5, "logprob %f", sig.logprob);
    double ent = 0;
    double ls[4] = {1, 3, 2, 0};
    for (int i = 0; i < 4; i++) ent -= exp(ls[i]) / z * (ls[i] - log(z));
    CHECK(fabs(sig.entropy - ent) < 1e-5, "entropy %f vs %f", sig.entropy, ent);
    CHECK(fabs(sig.margin - (exp(3) - exp(2)) / z) < 1e-5, "margin %f", sig.margin);

    engine_destroy(&e);
    model_destroy(&m);
    return check_report("test_engine");
}
