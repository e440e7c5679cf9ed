/* The context-length policy: the usable context of a model (training context, or the length
 * its RoPE scaling extends it to), the load-time RoPE override, the refusal message, and a
 * reader of the context keys of a GGUF file for processes that load no weights. */
#include "model/model_ctx.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "model/engine.h"
#include "model/gguf.h"
#include "text/errmsg.h"

static int train_ctx(const struct ModelConfig *c)
{
    return c->ctx_train > 0 ? c->ctx_train : MODEL_CTX_UNKNOWN_TRAIN;
}

static int scaled(const struct RopeConfig *r)
{
    return r->scaling != ROPE_SCALING_NONE && r->factor > 1.f && r->orig_ctx > 0;
}

int model_ctx_usable(const struct ModelConfig *c)
{
    double n = train_ctx(c);
    if (scaled(&c->rope)) {
        double ext = floor((double)c->rope.factor * c->rope.orig_ctx);
        if (ext > n) n = ext;
    }
    return n > ENGINE_MAX_CTX ? ENGINE_MAX_CTX : (int)n;
}

int model_usable_ctx(const struct Model *m) { return model_ctx_usable(&m->cfg); }

static const char *scaling_name(enum RopeScaling s)
{
    return s == ROPE_SCALING_YARN ? "yarn" : s == ROPE_SCALING_LINEAR ? "linear" : "none";
}

void model_ctx_describe(const struct ModelConfig *c, char *out, size_t len)
{
    char train[64];
    if (c->ctx_train > 0) snprintf(train, sizeof train, "context_length %d", c->ctx_train);
    else snprintf(train, sizeof train, "no context_length: taken as %d", MODEL_CTX_UNKNOWN_TRAIN);
    if (!scaled(&c->rope)) {
        snprintf(out, len, "%s", train);
        return;
    }
    char cap[64] = "";
    if ((double)c->rope.factor * c->rope.orig_ctx > ENGINE_MAX_CTX)
        snprintf(cap, sizeof cap, ", capped at the engine's %d", ENGINE_MAX_CTX);
    snprintf(out, len, "%s x%g of %d (%s%s)", scaling_name(c->rope.scaling), c->rope.factor,
             c->rope.orig_ctx, train, cap);
}

int model_ctx_override(struct ModelConfig *c, const char *scaling, float factor, int orig_ctx,
                       char *err, size_t errlen)
{
    if (!scaling || !*scaling) return 0;
    enum RopeScaling s;
    if (!strcmp(scaling, "none")) s = ROPE_SCALING_NONE;
    else if (!strcmp(scaling, "linear")) s = ROPE_SCALING_LINEAR;
    else if (!strcmp(scaling, "yarn")) s = ROPE_SCALING_YARN;
    else
        return errmsg_set(err, errlen, MODEL_EFORMAT,
                    "rope scaling \"%.32s\" is not none, linear or yarn", scaling);
    if (orig_ctx < 0 || orig_ctx > ENGINE_MAX_CTX)
        return errmsg_set(err, errlen, MODEL_EFORMAT, "rope original context %d is outside 1..%d",
                    orig_ctx, ENGINE_MAX_CTX);
    struct RopeConfig *r = &c->rope;
    if (s == ROPE_SCALING_NONE) {
        if (!(factor == 0.f || factor == 1.f) || orig_ctx)
            return errmsg_set(err, errlen, MODEL_EFORMAT,
                        "rope scaling none takes no factor (%g) or original context (%d)",
                        factor, orig_ctx);
        r->scaling = ROPE_SCALING_NONE;
        r->factor = 1.f;
        r->attn_factor = 1.f;
        return 0;
    }
    if (!isfinite(factor) || !(factor > 1.f) || factor > MODEL_ROPE_MAX_FACTOR)
        return errmsg_set(err, errlen, MODEL_EFORMAT,
                    "rope scaling %s needs a factor above 1 and at most %g (got %g)", scaling,
                    MODEL_ROPE_MAX_FACTOR, factor);
    r->scaling = s;
    r->factor = factor;
    r->orig_ctx = orig_ctx ? orig_ctx : train_ctx(c);
    r->attn_factor = s == ROPE_SCALING_YARN ? 0.1f * logf(factor) + 1.f : 1.f;
    return 0;
}

int model_rope_override(struct Model *m, const char *scaling, float factor, int orig_ctx,
                        char *err, size_t errlen)
{
    return model_ctx_override(&m->cfg, scaling, factor, orig_ctx, err, errlen);
}

int model_ctx_check(const struct ModelConfig *c, long n_ctx, char *err, size_t errlen)
{
    int usable = model_ctx_usable(c);
    if (n_ctx <= usable) return 0;
    char why[160];
    model_ctx_describe(c, why, sizeof why);
    if (usable >= ENGINE_MAX_CTX)
        return errmsg_set(err, errlen, MODEL_EFORMAT,
                    "a %ld-token context is longer than the %d tokens the engine serves (%s)",
                    n_ctx, usable, why);
    return errmsg_set(err, errlen, MODEL_EFORMAT,
                "a %ld-token context is longer than the %d tokens this model serves (%s); to run "
                "past it on purpose, extend it with --rope-scaling yarn --rope-factor F "
                "(diffragd: rope_scaling, rope_factor)", n_ctx, usable, why);
}

int model_ctx_read(const char *path, struct ModelConfig *c, char *err, size_t errlen)
{
    struct GgufFile *g = NULL;
    memset(c, 0, sizeof *c);
    int rc = gguf_open(path, &g, err, errlen);
    if (rc != GGUF_OK)
        return rc == GGUF_EIO ? MODEL_EIO : rc == GGUF_EUNSUPPORTED ? MODEL_EUNSUPPORTED
                                                                   : MODEL_EFORMAT;
    struct GgufString a, s;
    char key[160];
    uint32_t v;
    rc = MODEL_EFORMAT;
    if (gguf_get_str(g, "general.architecture", &a) != GGUF_OK || a.len == 0 || a.len > 64) {
        errmsg_set(err, errlen, rc, "%s: general.architecture missing", path);
        goto out;
    }
    int al = (int)a.len;
    snprintf(key, sizeof key, "%.*s.context_length", al, a.ptr);
    int krc = gguf_get_u32(g, key, &v);
    if (krc == GGUF_OK && v <= (uint32_t)1 << 30) c->ctx_train = (int)v;
    else if (krc != GGUF_ENOTFOUND) { errmsg_set(err, errlen, rc, "%s: key %s: bad value", path, key); goto out; }
    struct RopeConfig *r = &c->rope;
    r->scaling = ROPE_SCALING_NONE;
    r->factor = 1.f;
    r->attn_factor = 1.f;
    snprintf(key, sizeof key, "%.*s.rope.scaling.type", al, a.ptr);
    if (gguf_get_str(g, key, &s) == GGUF_OK) {
        if (s.len == 6 && !memcmp(s.ptr, "linear", 6)) r->scaling = ROPE_SCALING_LINEAR;
        else if (s.len == 4 && !memcmp(s.ptr, "yarn", 4)) r->scaling = ROPE_SCALING_YARN;
        else if (!(s.len == 4 && !memcmp(s.ptr, "none", 4))) {
            errmsg_set(err, errlen, MODEL_EUNSUPPORTED, "%s: %s must be none, linear or yarn", path, key);
            goto out;
        }
    }
    snprintf(key, sizeof key, "%.*s.rope.scaling.factor", al, a.ptr);
    krc = gguf_get_f32(g, key, &r->factor);
    if (krc == GGUF_ENOTFOUND) r->factor = 1.f;
    else if (krc != GGUF_OK || !isfinite(r->factor)) {
        errmsg_set(err, errlen, rc, "%s: key %s has a wrong type or value", path, key);
        goto out;
    }
    snprintf(key, sizeof key, "%.*s.rope.scaling.original_context_length", al, a.ptr);
    krc = gguf_get_u32(g, key, &v);
    if (krc == GGUF_OK && v <= (uint32_t)1 << 30) r->orig_ctx = (int)v;
    else if (krc == GGUF_ENOTFOUND) r->orig_ctx = train_ctx(c);
    else { errmsg_set(err, errlen, rc, "%s: key %s: bad value", path, key); goto out; }
    rc = MODEL_OK;
out:
    gguf_close(&g);
    return rc;
}
