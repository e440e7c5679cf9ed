/* How long a context a model can serve, and the load-time RoPE override that extends it.
 *
 * The usable context of a model is
 *   - its training context ({arch}.context_length), or MODEL_CTX_UNKNOWN_TRAIN when the file
 *     does not say (the same length the YaRN original context defaults to in model_load);
 *   - with linear or YaRN scaling and a factor s > 1 (from the file's rope.scaling.* keys or
 *     from model_rope_override): the larger of that and s x the original context
 *     (rope.scaling.original_context_length);
 * capped at ENGINE_MAX_CTX. engine_new refuses a longer context; the tools and the daemon check
 * it up front so the refusal names both numbers and how to extend the context. */
#ifndef DIFFRAG_MODEL_CTX_H
#define DIFFRAG_MODEL_CTX_H

#include <stddef.h>

#include "model/model.h"

#define MODEL_CTX_UNKNOWN_TRAIN 4096
#define MODEL_ROPE_MAX_FACTOR 64.f

/* The usable context of a configuration / of a loaded model, in tokens (1..ENGINE_MAX_CTX). */
int model_ctx_usable(const struct ModelConfig *c);
int model_usable_ctx(const struct Model *m);

/* Where the usable context comes from, for messages and logs, e.g. "context_length 32768" or
 * "yarn x4 of 32768 (context_length 32768)". Always NUL-terminated. */
void model_ctx_describe(const struct ModelConfig *c, char *out, size_t len);

/* A load-time RoPE override, set as the GGUF keys would set it: scaling "none", "linear" or
 * "yarn" (NULL or "" changes nothing and returns 0); factor s > 1 and at most
 * MODEL_ROPE_MAX_FACTOR for linear and yarn (0 or 1 for none); orig_ctx the original context
 * (0: the file's context_length, or MODEL_CTX_UNKNOWN_TRAIN); YaRN's magnitude becomes
 * 0.1 ln s + 1 and its betas stay the file's. Call it right after model_load, before any
 * context is opened or the weights go to a GPU. 0, or MODEL_EFORMAT with err naming the bad
 * value (the configuration is then unchanged). */
int model_rope_override(struct Model *m, const char *scaling, float factor, int orig_ctx,
                        char *err, size_t errlen);
int model_ctx_override(struct ModelConfig *c, const char *scaling, float factor, int orig_ctx,
                       char *err, size_t errlen);

/* 0 when an n_ctx-token context fits the model's usable context; else MODEL_EFORMAT with a
 * message naming both numbers and how to extend the context (--rope-scaling in diffrag-run,
 * rope_scaling in diffragd). */
int model_ctx_check(const struct ModelConfig *c, long n_ctx, char *err, size_t errlen);

/* The context keys of a GGUF file without loading its weights (a broker that only counts
 * tokens): ctx_train and rope scaling into *c (the rest zeroed). 0, or a MODEL_E* code with
 * err. */
int model_ctx_read(const char *path, struct ModelConfig *c, char *err, size_t errlen);

#endif
