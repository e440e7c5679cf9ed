/* model_ctx unit tests: the usable context of configurations (native, scaled by the file's or an
 * override's linear/YaRN keys, capped, without context_length), the override's validation and
 * the values it sets, and the refusal message. Pure arithmetic on ModelConfig structs; the
 * files and programs around it are tested by tests/test_context_policy.py. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/engine.h"
#include "model/model_ctx.h"
#include "tests/check.h"

/* A configuration as model_load leaves a file without rope.scaling keys. */
static struct ModelConfig plain(int ctx_train)
{
    struct ModelConfig c;
    memset(&c, 0, sizeof c);
    c.ctx_train = ctx_train;
    c.head_dim = 64;
    c.rope.base = 1e6f;
    c.rope.n_rot = 64;
    c.rope.scaling = ROPE_SCALING_NONE;
    c.rope.factor = 1.f;
    c.rope.orig_ctx = ctx_train > 0 ? ctx_train : MODEL_CTX_UNKNOWN_TRAIN;
    c.rope.attn_factor = 1.f;
    c.rope.beta_fast = 32.f;
    c.rope.beta_slow = 1.f;
    return c;
}

int main(void)
{
    char err[512], why[192];

    /* native: the training context */
    struct ModelConfig qwen = plain(32768), smol = plain(8192);
    CHECK(model_ctx_usable(&qwen) == 32768, "qwen native %d", model_ctx_usable(&qwen));
    CHECK(model_ctx_usable(&smol) == 8192, "smollm2 native %d", model_ctx_usable(&smol));
    model_ctx_describe(&qwen, why, sizeof why);
    CHECK(!strcmp(why, "context_length 32768"), "describe: %s", why);

    /* no context_length: MODEL_CTX_UNKNOWN_TRAIN, and the message says so */
    struct ModelConfig unknown = plain(0);
    CHECK(model_ctx_usable(&unknown) == MODEL_CTX_UNKNOWN_TRAIN, "unknown %d",
          model_ctx_usable(&unknown));
    model_ctx_describe(&unknown, why, sizeof why);
    CHECK(strstr(why, "no context_length") && strstr(why, "4096"), "describe: %s", why);

    /* the override: YaRN x4 of Qwen's 32768 = 131072, magnitude 0.1 ln 4 + 1, betas kept */
    struct ModelConfig q = qwen;
    q.rope.beta_fast = 16.f;
    CHECK(model_ctx_override(&q, "yarn", 4.f, 32768, err, sizeof err) == 0, "yarn: %s", err);
    CHECK(q.rope.scaling == ROPE_SCALING_YARN && q.rope.factor == 4.f && q.rope.orig_ctx == 32768,
          "yarn config %d %g %d", q.rope.scaling, q.rope.factor, q.rope.orig_ctx);
    CHECK(fabsf(q.rope.attn_factor - (0.1f * logf(4.f) + 1.f)) < 1e-7f, "attn_factor %g",
          q.rope.attn_factor);
    CHECK(q.rope.beta_fast == 16.f && q.rope.beta_slow == 1.f, "betas kept");
    CHECK(model_ctx_usable(&q) == 131072, "yarn x4 usable %d", model_ctx_usable(&q));
    model_ctx_describe(&q, why, sizeof why);
    CHECK(!strcmp(why, "yarn x4 of 32768 (context_length 32768)"), "describe: %s", why);

    /* orig_ctx 0: the file's context_length; linear keeps the magnitude at 1 */
    struct ModelConfig s = smol;
    CHECK(model_ctx_override(&s, "linear", 2.5f, 0, err, sizeof err) == 0, "linear: %s", err);
    CHECK(s.rope.orig_ctx == 8192 && s.rope.attn_factor == 1.f && model_ctx_usable(&s) == 20480,
          "linear x2.5 of 8192: orig %d attn %g usable %d", s.rope.orig_ctx, s.rope.attn_factor,
          model_ctx_usable(&s));
    /* a factor x original context below the training context leaves the training context */
    s = smol;
    CHECK(model_ctx_override(&s, "yarn", 2.f, 1024, err, sizeof err) == 0 &&
          model_ctx_usable(&s) == 8192, "yarn x2 of 1024 on 8192: %d", model_ctx_usable(&s));
    /* capped at the engine's limit, and the description says so */
    s = smol;
    CHECK(model_ctx_override(&s, "yarn", 32.f, 8192, err, sizeof err) == 0 &&
          model_ctx_usable(&s) == ENGINE_MAX_CTX, "cap: %d", model_ctx_usable(&s));
    model_ctx_describe(&s, why, sizeof why);
    CHECK(strstr(why, "capped at the engine's 131072") != NULL, "describe: %s", why);
    /* none turns a file's scaling off */
    CHECK(model_ctx_override(&s, "none", 0.f, 0, err, sizeof err) == 0 &&
          s.rope.scaling == ROPE_SCALING_NONE && s.rope.attn_factor == 1.f &&
          model_ctx_usable(&s) == 8192, "none: %d", model_ctx_usable(&s));
    /* NULL or "": unchanged */
    s = smol;
    CHECK(model_ctx_override(&s, NULL, 7.f, 3, err, sizeof err) == 0 &&
          model_ctx_override(&s, "", 7.f, 3, err, sizeof err) == 0 && !memcmp(&s, &smol, sizeof s),
          "no override leaves the configuration");

    /* invalid overrides: an error naming the value, the configuration unchanged */
    static const struct { const char *scaling; float factor; int orig; const char *want; } bad[] = {
        {"ntk", 2.f, 0, "\"ntk\" is not none, linear or yarn"},
        {"yarn", 1.f, 0, "a factor above 1"},
        {"yarn", 0.f, 0, "(got 0)"},
        {"linear", -2.f, 0, "(got -2)"},
        {"yarn", 65.f, 0, "at most 64"},
        {"yarn", NAN, 0, "(got nan)"},
        {"yarn", 4.f, -1, "outside 1..131072"},
        {"yarn", 4.f, 131073, "outside 1..131072"},
        {"none", 2.f, 0, "takes no factor"},
        {"none", 0.f, 4096, "takes no factor"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        s = smol;
        err[0] = 0;
        int rc = model_ctx_override(&s, bad[i].scaling, bad[i].factor, bad[i].orig, err, sizeof err);
        CHECK(rc == MODEL_EFORMAT && strstr(err, bad[i].want) && !memcmp(&s, &smol, sizeof s),
              "bad override %zu: rc %d err \"%s\" (want \"%s\")", i, rc, err, bad[i].want);
    }

    /* the file's own scaling keys count the same way (model_load sets these fields) */
    struct ModelConfig f = plain(4096);
    f.rope.scaling = ROPE_SCALING_YARN;
    f.rope.factor = 8.f;
    f.rope.orig_ctx = 4096;
    CHECK(model_ctx_usable(&f) == 32768, "file yarn x8 of 4096: %d", model_ctx_usable(&f));
    f.rope.factor = 0.5f;     /* a factor below 1 shortens nothing */
    CHECK(model_ctx_usable(&f) == 4096, "factor 0.5: %d", model_ctx_usable(&f));

    /* the refusal: both numbers and the way out */
    CHECK(model_ctx_check(&qwen, 32768, err, sizeof err) == 0, "32768 fits");
    CHECK(model_ctx_check(&qwen, 40000, err, sizeof err) == MODEL_EFORMAT &&
          strstr(err, "40000-token context") && strstr(err, "32768 tokens this model serves") &&
          strstr(err, "--rope-scaling yarn") && strstr(err, "rope_scaling"), "refusal: %s", err);
    CHECK(model_ctx_check(&q, 131072, err, sizeof err) == 0, "yarn x4 fits 131072");
    CHECK(model_ctx_check(&q, 131073, err, sizeof err) == MODEL_EFORMAT &&
          strstr(err, "131072 tokens the engine serves") && !strstr(err, "--rope-scaling"),
          "past the engine's limit no override helps: %s", err);

    return check_report("test_model_ctx");
}
