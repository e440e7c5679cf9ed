/* Model loading: reads the hyper-parameters of a llama, qwen2 or diffv2 GGUF (docs/model-format.md),
 * checks every tensor's shape and type against them, and copies the weight matrices in their
 * file encoding (norm vectors decoded to f32) into one arena. */
#include "model/model.h"
#include "model/engine_gpu.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/dequant.h"
#include "model/gguf.h"
#include "text/errmsg.h"

const char *model_arch_name(enum ModelArch a)
{
    switch (a) {
    case ARCH_LLAMA: return "llama";
    case ARCH_DIFFV2: return "diffv2";
    case ARCH_QWEN2: return "qwen2";
    }
    return "unknown";
}

/* Reads "{arch}.suffix" as u32; `def` < 0 means required. */
static int key_u32(const struct GgufFile *g, const char *arch, const char *suffix, long def,
                   int *out, char *err, size_t errlen)
{
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    uint32_t v;
    int rc = gguf_get_u32(g, key, &v);
    if (rc == GGUF_ENOTFOUND && def >= 0) { *out = (int)def; return 0; }
    if (rc != GGUF_OK)
        return errmsg_set(err, errlen, MODEL_EFORMAT, "%s: key %s: %s", gguf_path(g), key,
                    rc == GGUF_ENOTFOUND ? "missing" : "wrong type or out of range");
    if (v > (1u << 30))
        return errmsg_set(err, errlen, MODEL_EFORMAT, "%s: key %s = %u is implausibly large",
                    gguf_path(g), key, v);
    *out = (int)v;
    return 0;
}

static int key_f32(const struct GgufFile *g, const char *arch, const char *suffix, float def,
                   float *out, char *err, size_t errlen)
{
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = gguf_get_f32(g, key, out);
    if (rc == GGUF_ENOTFOUND) { *out = def; return 0; }
    if (rc != GGUF_OK || !isfinite(*out))
        return errmsg_set(err, errlen, MODEL_EFORMAT, "%s: key %s has a wrong type or value",
                    gguf_path(g), key);
    return 0;
}

static int key_str_eq(const struct GgufFile *g, const char *key, const char *want)
{
    struct GgufString s;
    if (gguf_get_str(g, key, &s) != GGUF_OK) return 0;
    return s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0;
}

static int read_config(const struct GgufFile *g, struct ModelConfig *c, char *err, size_t errlen)
{
    struct GgufString a;
    if (gguf_get_str(g, "general.architecture", &a) != GGUF_OK)
        return errmsg_set(err, errlen, MODEL_EFORMAT, "%s: general.architecture missing", gguf_path(g));
    char arch[32];
    if (a.len == 5 && !memcmp(a.ptr, "llama", 5)) c->arch = ARCH_LLAMA;
    else if (a.len == 6 && !memcmp(a.ptr, "diffv2", 6)) c->arch = ARCH_DIFFV2;
    else if (a.len == 5 && !memcmp(a.ptr, "qwen2", 5)) c->arch = ARCH_QWEN2;
    else
        return errmsg_set(err, errlen, MODEL_EUNSUPPORTED,
                    "%s: architecture '%.*s' is not supported (llama, qwen2, diffv2)", gguf_path(g),
                    (int)(a.len > 64 ? 64 : a.len), a.ptr);
    snprintf(arch, sizeof arch, "%s", model_arch_name(c->arch));

    int rc;
    if ((rc = key_u32(g, arch, "block_count", -1, &c->n_layer, err, errlen)) ||
        (rc = key_u32(g, arch, "embedding_length", -1, &c->dim, err, errlen)) ||
        (rc = key_u32(g, arch, "feed_forward_length", -1, &c->ffn_dim, err, errlen)) ||
        (rc = key_u32(g, arch, "attention.head_count", -1, &c->n_head, err, errlen)) ||
        (rc = key_u32(g, arch, "context_length", 0, &c->ctx_train, err, errlen)))
        return rc;
    if (c->n_layer < 1 || c->dim < 1 || c->ffn_dim < 1 || c->n_head < 1)
        return errmsg_set(err, errlen, MODEL_EFORMAT, "%s: zero layers, width or heads", gguf_path(g));
    if ((rc = key_u32(g, arch, "attention.head_count_kv", c->n_head, &c->n_kv_head, err, errlen)) ||
        (rc = key_u32(g, arch, "attention.key_length", c->dim / c->n_head, &c->head_dim, err, errlen)))
        return rc;
    c->n_q_head = c->arch == ARCH_DIFFV2 ? 2 * c->n_head : c->n_head;
    if (c->n_kv_head < 1 || c->head_dim < 2 || c->n_head % c->n_kv_head != 0)
        return errmsg_set(err, errlen, MODEL_EFORMAT,
                    "%s: head_count %d is not a multiple of head_count_kv %d (or head_dim %d < 2)",
                    gguf_path(g), c->n_head, c->n_kv_head, c->head_dim);
    if ((rc = key_f32(g, arch, "attention.layer_norm_rms_epsilon", 1e-5f, &c->norm_eps, err, errlen)))
        return rc;

    struct RopeConfig *r = &c->rope;
    if ((rc = key_f32(g, arch, "rope.freq_base", 10000.f, &r->base, err, errlen)) ||
        (rc = key_u32(g, arch, "rope.dimension_count", c->head_dim, &r->n_rot, err, errlen)))
        return rc;
    if (r->n_rot % 2 || r->n_rot > c->head_dim || r->base <= 1.f)
        return errmsg_set(err, errlen, MODEL_EFORMAT, "%s: rope dimension_count %d / base %g invalid",
                    gguf_path(g), r->n_rot, r->base);
    char key[160];
    snprintf(key, sizeof key, "%s.rope.layout", arch);
    /* llama.cpp's converter permutes llama's q and k rows so that rotated pairs are adjacent;
     * qwen2's rows stay in the trained order, which rotates the two halves of a head. */
    r->layout = c->arch == ARCH_QWEN2 ? ROPE_NEOX : ROPE_ADJACENT;
    if (gguf_has_key(g, key)) {
        if (key_str_eq(g, key, "neox")) r->layout = ROPE_NEOX;
        else if (key_str_eq(g, key, "adjacent")) r->layout = ROPE_ADJACENT;
        else
            return errmsg_set(err, errlen, MODEL_EUNSUPPORTED, "%s: %s must be adjacent or neox",
                        gguf_path(g), key);
    }
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    r->scaling = ROPE_SCALING_NONE;
    if (gguf_has_key(g, key)) {
        if (key_str_eq(g, key, "linear")) r->scaling = ROPE_SCALING_LINEAR;
        else if (key_str_eq(g, key, "yarn")) r->scaling = ROPE_SCALING_YARN;
        else if (!key_str_eq(g, key, "none"))
            return errmsg_set(err, errlen, MODEL_EUNSUPPORTED, "%s: %s must be none, linear or yarn",
                        gguf_path(g), key);
    }
    if ((rc = key_f32(g, arch, "rope.scaling.factor", 1.f, &r->factor, err, errlen)) ||
        (rc = key_u32(g, arch, "rope.scaling.original_context_length",
                      c->ctx_train > 0 ? c->ctx_train : 4096, &r->orig_ctx, err, errlen)) ||
        (rc = key_f32(g, arch, "rope.scaling.attn_factor", 0.f, &r->attn_factor, err, errlen)) ||
        (rc = key_f32(g, arch, "rope.scaling.yarn_beta_fast", 32.f, &r->beta_fast, err, errlen)) ||
        (rc = key_f32(g, arch, "rope.scaling.yarn_beta_slow", 1.f, &r->beta_slow, err, errlen)))
        return rc;
    if (r->scaling != ROPE_SCALING_NONE && !(r->factor > 0.f))
        return errmsg_set(err, errlen, MODEL_EFORMAT, "%s: rope scaling factor %g must be > 0",
                    gguf_path(g), r->factor);
    if (r->attn_factor == 0.f)
        r->attn_factor = r->scaling == ROPE_SCALING_YARN && r->factor > 1.f
                             ? 0.1f * logf(r->factor) + 1.f : 1.f;
    return 0;
}

/* One tensor to load: a matrix (rows > 0) kept in its encoding, or a vector decoded to f32. */
struct TensorSpec {
    char name[96];
    int64_t cols, rows;
    struct Weights *mat;
    float **vec;
    const struct GgufTensor *t;
};

static size_t align64(size_t v) { return (v + 63) & ~(size_t)63; }

/* Finds the tensor, checks its shape and type; returns the arena bytes it needs. */
static int check_tensor(const struct GgufFile *g, struct TensorSpec *sp, size_t *bytes,
                        char *err, size_t errlen)
{
    const struct GgufTensor *t = gguf_find_tensor(g, sp->name);
    if (!t) return errmsg_set(err, errlen, MODEL_EFORMAT, "%s: tensor %s missing", gguf_path(g), sp->name);
    int64_t cols = sp->cols, rows = sp->rows;
    int ok = rows == 0 ? (t->n_elements == (uint64_t)cols && t->ne[0] == (uint64_t)cols)
                       : (t->ne[0] == (uint64_t)cols && t->ne[1] == (uint64_t)rows &&
                          t->n_elements == (uint64_t)(cols * rows));
    if (!ok)
        return errmsg_set(err, errlen, MODEL_EFORMAT,
                    "%s: tensor %s has shape [%llu, %llu], expected [%lld, %lld]", gguf_path(g),
                    sp->name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                    (long long)cols, (long long)(rows ? rows : 1));
    int be = dequant_block_elems(t->type);
    if (be == 0 || cols % be != 0)
        return errmsg_set(err, errlen, MODEL_EUNSUPPORTED, "%s: tensor %s has unsupported type %s",
                    gguf_path(g), sp->name, ggml_type_name(t->type));
    sp->t = t;
    *bytes = rows == 0 ? align64((size_t)cols * sizeof(float))
                       : align64(backend_cpu.weights_bytes(t->type, (int)rows, (int)cols));
    return 0;
}

/* Copies (matrix, in the backend's layout) or decodes (vector) a checked tensor to dst. */
static void place_tensor(struct TensorSpec *sp, void *dst)
{
    const struct GgufTensor *t = sp->t;
    if (sp->rows == 0) {
        dequant_row(t->type, t->data, dst, (size_t)sp->cols);
        *sp->vec = dst;
        return;
    }
    backend_cpu.weights_pack(t->type, (int)sp->rows, (int)sp->cols, t->data, dst, sp->mat);
}

int model_load(const char *path, struct Model **out, char *err, size_t errlen)
{
    *out = NULL;
    struct GgufFile *g = NULL;
    struct Model *m = NULL;
    struct TensorSpec *specs = NULL;
    int rc = gguf_open(path, &g, err, errlen);
    if (rc != GGUF_OK) return rc == GGUF_EIO ? MODEL_EIO : rc == GGUF_EUNSUPPORTED
                                                 ? MODEL_EUNSUPPORTED : MODEL_EFORMAT;
    m = calloc(1, sizeof *m);
    if (!m) { rc = errmsg_set(err, errlen, MODEL_ENOMEM, "out of memory"); goto err; }
    m->path = strdup(path);
    if (!m->path) { rc = errmsg_set(err, errlen, MODEL_ENOMEM, "out of memory"); goto err; }
    struct ModelConfig *c = &m->cfg;
    if ((rc = read_config(g, c, err, errlen))) goto err;

    const struct GgufTensor *emb = gguf_find_tensor(g, "token_embd.weight");
    if (!emb || emb->ne[0] != (uint64_t)c->dim || emb->ne[1] < 1 || emb->ne[1] > (1u << 24)) {
        rc = errmsg_set(err, errlen, MODEL_EFORMAT, "%s: token_embd.weight missing or not [%d, vocab]",
                  path, c->dim);
        goto err;
    }
    c->vocab = (int)emb->ne[1];
    int tied = gguf_find_tensor(g, "output.weight") == NULL;
    m->layers = calloc((size_t)c->n_layer, sizeof *m->layers);
    size_t max_specs = 3 + 13 * (size_t)c->n_layer;
    specs = calloc(max_specs, sizeof *specs);
    if (!m->layers || !specs) { rc = errmsg_set(err, errlen, MODEL_ENOMEM, "out of memory"); goto err; }

    int64_t d = c->dim, hd = c->head_dim, nq = c->n_q_head * hd, nkv = c->n_kv_head * hd;
    int64_t no = c->n_head * hd, F = c->ffn_dim;
    size_t n_specs = 0;
#define SPEC(nm, cols_, rows_, matp, vecp) do { \
        struct TensorSpec *sp_ = &specs[n_specs++]; \
        snprintf(sp_->name, sizeof sp_->name, "%s", (nm)); \
        sp_->cols = (cols_); sp_->rows = (rows_); sp_->mat = (matp); sp_->vec = (vecp); \
    } while (0)
    SPEC("token_embd.weight", d, c->vocab, &m->tok_embd, NULL);
    SPEC("output_norm.weight", d, 0, NULL, &m->output_norm);
    if (!tied) SPEC("output.weight", d, c->vocab, &m->output, NULL);
    for (int l = 0; l < c->n_layer; l++) {
        struct LayerWeights *w = &m->layers[l];
        char n[96];
#define LAYER(suffix, cols_, rows_, matp, vecp) \
        snprintf(n, sizeof n, "blk.%d." suffix ".weight", l); SPEC(n, cols_, rows_, matp, vecp);
        LAYER("attn_norm", d, 0, NULL, &w->attn_norm);
        LAYER("attn_q", d, nq, &w->wq, NULL);
        LAYER("attn_k", d, nkv, &w->wk, NULL);
        LAYER("attn_v", d, nkv, &w->wv, NULL);
        LAYER("attn_output", no, d, &w->wo, NULL);
        LAYER("ffn_norm", d, 0, NULL, &w->ffn_norm);
        LAYER("ffn_gate", d, F, &w->w_gate, NULL);
        LAYER("ffn_up", d, F, &w->w_up, NULL);
        LAYER("ffn_down", F, d, &w->w_down, NULL);
        if (c->arch == ARCH_DIFFV2) { LAYER("attn_lambda", d, c->n_head, &w->wlambda, NULL); }
#undef LAYER
        /* Optional biases of the q, k and v products (qwen2 has them; so may a llama or a
         * diffv2 file). A bias the engine does not apply is refused, never ignored. */
        static const char *const unsupported[] = {"attn_output", "ffn_gate", "ffn_up",
                                                  "ffn_down", "attn_lambda"};
        for (size_t u = 0; u < sizeof unsupported / sizeof *unsupported; u++) {
            snprintf(n, sizeof n, "blk.%d.%s.bias", l, unsupported[u]);
            if (gguf_find_tensor(g, n)) {
                rc = errmsg_set(err, errlen, MODEL_EUNSUPPORTED, "%s: tensor %s: a bias on %s is "
                          "not supported (only attn_q, attn_k and attn_v take one)", path, n,
                          unsupported[u]);
                goto err;
            }
        }
        struct { const char *name; int64_t len; float **vec; } bias[3] = {
            {"attn_q", nq, &w->bq}, {"attn_k", nkv, &w->bk}, {"attn_v", nkv, &w->bv}};
        for (int b = 0; b < 3; b++) {
            snprintf(n, sizeof n, "blk.%d.%s.bias", l, bias[b].name);
            if (gguf_find_tensor(g, n)) SPEC(n, bias[b].len, 0, NULL, bias[b].vec);
        }
    }
#undef SPEC
    size_t total = 0;
    for (size_t i = 0; i < n_specs; i++) {
        size_t b;
        if ((rc = check_tensor(g, &specs[i], &b, err, errlen))) goto err;
        total += b;
    }
    m->arena_bytes = total;
    m->arena = aligned_alloc(64, total ? total : 64);
    if (!m->arena) {
        rc = errmsg_set(err, errlen, MODEL_ENOMEM, "%s: cannot allocate %zu MiB for weights", path,
                  total >> 20);
        goto err;
    }
    char *p = m->arena;
    for (size_t i = 0; i < n_specs; i++) {
        size_t b;
        check_tensor(g, &specs[i], &b, err, errlen);
        place_tensor(&specs[i], p);
        p += b;
    }
    if (tied) m->output = m->tok_embd;

    if ((rc = tok_load_gguf(g, &m->tok, err, errlen)) != 0) { rc = MODEL_EFORMAT; goto err; }
    if (tok_n_vocab(m->tok) > c->vocab) {
        rc = errmsg_set(err, errlen, MODEL_EFORMAT, "%s: tokenizer has %d tokens but the embedding %d",
                  path, tok_n_vocab(m->tok), c->vocab);
        goto err;
    }
    struct GgufString nm;
    if (gguf_get_str(g, "general.name", &nm) == GGUF_OK && nm.len > 0)
        snprintf(m->name, sizeof m->name, "%.*s", (int)(nm.len > 120 ? 120 : nm.len), nm.ptr);
    else {
        const char *base = strrchr(path, '/');
        snprintf(m->name, sizeof m->name, "%s", base ? base + 1 : path);
    }
    free(specs);
    gguf_close(&g);
    *out = m;
    return MODEL_OK;
err:
    free(specs);
    gguf_close(&g);
    model_destroy(&m);
    return rc;
}

void model_destroy(struct Model **pm)
{
    struct Model *m = *pm;
    if (!m) return;
    model_gpu_free(m);
    tok_destroy(&m->tok);
    free(m->arena);
    free(m->layers);
    free(m->path);
    free(m);
    *pm = NULL;
}

size_t model_weight_bytes(const struct Model *m) { return m->arena_bytes; }
