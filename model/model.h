/* A loaded model: hyper-parameters, weights and the tokenizer. Weight matrices keep the file's
 * encoding (Q4_1, Q8_0, F16, ...; struct Weights in kernels/backend.h) and are decoded inside
 * the products; norm vectors are f32. Everything lives in one arena. Read-only after
 * model_load, so any number of engine contexts share one Model. */
#ifndef DIFFRAG_MODEL_H
#define DIFFRAG_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "model/tokenizer.h"

enum ModelArch { ARCH_LLAMA = 0, ARCH_DIFFV2 = 1, ARCH_QWEN2 = 2 };
enum RopeLayout { ROPE_ADJACENT = 0, ROPE_NEOX = 1 };
enum RopeScaling { ROPE_SCALING_NONE = 0, ROPE_SCALING_LINEAR = 1, ROPE_SCALING_YARN = 2 };

struct RopeConfig {
    float base;
    int n_rot;                 /* rotated dimensions per head (even, <= head_dim) */
    enum RopeLayout layout;    /* {arch}.rope.layout, else adjacent (llama, diffv2) or neox
                                  (qwen2: its GGUF rows are not permuted for adjacent pairs) */
    enum RopeScaling scaling;
    float factor;              /* s */
    int orig_ctx;              /* YaRN n_orig */
    float attn_factor;         /* YaRN magnitude (cos/sin multiplier) */
    float beta_fast, beta_slow;
};

struct ModelConfig {
    enum ModelArch arch;
    int n_layer;
    int dim;                   /* d */
    int n_head;                /* output heads h (llama, qwen2: = n_q_head) */
    int n_q_head;              /* query heads: h (llama, qwen2) or 2h (diffv2) */
    int n_kv_head;             /* h_kv */
    int head_dim;              /* hd */
    int ffn_dim;
    int vocab;
    int ctx_train;
    float norm_eps;
    struct RopeConfig rope;
};

struct LayerWeights {
    float *attn_norm;          /* (dim) */
    struct Weights wq;         /* (n_q_head*head_dim, dim) */
    struct Weights wk;         /* (n_kv_head*head_dim, dim) */
    struct Weights wv;         /* (n_kv_head*head_dim, dim) */
    float *bq;                 /* (n_q_head*head_dim) added to q before RoPE, or NULL */
    float *bk;                 /* (n_kv_head*head_dim) added to k before RoPE, or NULL */
    float *bv;                 /* (n_kv_head*head_dim) added to v, or NULL */
    struct Weights wo;         /* (dim, n_head*head_dim) */
    struct Weights wlambda;    /* (n_head, dim); diffv2 only, else data == NULL */
    float *ffn_norm;           /* (dim) */
    struct Weights w_gate;     /* (ffn_dim, dim) */
    struct Weights w_up;       /* (ffn_dim, dim) */
    struct Weights w_down;     /* (dim, ffn_dim) */
};

struct GpuModel;

struct Model {
    struct ModelConfig cfg;
    struct Weights tok_embd;   /* (vocab, dim) */
    float *output_norm;        /* (dim) */
    struct Weights output;     /* (vocab, dim); the same data as tok_embd when tied */
    struct LayerWeights *layers; /* (n_layer) */
    void *arena;               /* every weight above lives here (64-byte aligned pieces) */
    size_t arena_bytes;
    struct Tokenizer *tok;
    char *path;
    char name[128];            /* general.name, or the file's base name */
    struct GpuModel *gpu;      /* the weights on a GPU (model/engine_gpu.h), or NULL */
};

enum ModelStatus {
    MODEL_OK = 0,
    MODEL_EIO = -1,
    MODEL_EFORMAT = -2,        /* missing/inconsistent keys or tensors, bad shapes */
    MODEL_EUNSUPPORTED = -3,   /* architecture or tensor type not handled */
    MODEL_ENOMEM = -4,
};

/* Load a GGUF model. On failure *out = NULL and `err` names the file and the problem. */
int model_load(const char *path, struct Model **out, char *err, size_t errlen);
void model_destroy(struct Model **m);
const char *model_arch_name(enum ModelArch a);

/* Bytes of weights held in memory (for memory estimates and metrics). */
size_t model_weight_bytes(const struct Model *m);

#endif
