/* The backend interface: the small table of operations the engine's forward pass calls.
 * model/ decides what to compute and calls through this table; kernels/cpu implements it
 * now (kernels/cuda will implement it a second time). All tensors are row-major f32 unless
 * stated; "rows" are tokens. */
#ifndef DIFFRAG_BACKEND_H
#define DIFFRAG_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/threadpool.h"

enum KvType { KV_F32 = 0, KV_F16 = 1 };

/* Causal attention of a chunk of n_tok query tokens at positions pos0..pos0+n_tok-1 against a
 * cache that already holds keys/values for positions 0..pos0+n_tok-1. */
struct AttnArgs {
    const float *q;            /* (n_tok, n_q_head*head_dim), rows q_stride floats apart */
    size_t q_stride;
    float *out;                /* (n_tok, n_q_head*head_dim): one output per query head */
    size_t out_stride;
    const void *k, *v;         /* cache: (n_kv_head, kv_head_stride) of kv_type elements,
                                  position t of head g at g*kv_head_stride + t*head_dim */
    size_t kv_head_stride;
    enum KvType kv_type;
    int n_tok, pos0;
    int n_q_head, n_kv_head, head_dim;
    float scale;               /* 1/sqrt(head_dim) */
};

struct Backend {
    const char *name;
    /* y (n, m) = x (n, k) . w^T, w (m, k). */
    void (*matmul)(struct ThreadPool *pool, float *y, const float *x, const float *w, int n,
                   int k, int m);
    /* y (n, d) = x / rms(x) * w, row by row; y may equal x. */
    void (*rmsnorm)(struct ThreadPool *pool, float *y, const float *x, const float *w, int n,
                    int d, float eps);
    /* Rotates the first n_rot dims of each of n_heads heads of n_tok rows (stride floats
     * apart) with per-row tables cos/sin (n_tok, n_rot/2); layout 0 adjacent, 1 neox. */
    void (*rope)(float *x, int n_tok, size_t stride, int n_heads, int head_dim, int n_rot,
                 int layout, const float *cos, const float *sin);
    /* gate = silu(gate) * up, n elements. */
    void (*swiglu)(float *gate, const float *up, size_t n);
    /* y += x, n elements. */
    void (*add)(float *y, const float *x, size_t n);
    /* Writes the chunk's keys/values (n_tok, n_kv_head*head_dim) into the cache at pos0. */
    void (*kv_store)(void *kcache, void *vcache, enum KvType type, size_t kv_head_stride,
                     const float *k, const float *v, size_t stride, int n_tok, int pos0,
                     int n_kv_head, int head_dim);
    void (*attention)(struct ThreadPool *pool, const struct AttnArgs *a, float *scratch);
    /* Floats of `scratch` that attention needs for `threads` threads. */
    size_t (*attention_scratch)(int head_dim, int group, int threads);
};

extern const struct Backend backend_cpu;

#endif
