/* The engine's state, shared by the files that implement model/engine.h: contexts and their
 * memory (engine.c), the forward pass (engine_step.c), the groundedness signals
 * (engine_signals.c) and chunk KV reuse (engine_blend.c). Not for use outside them. The
 * functions named eng_* are those that one of these files defines and another calls. */
#ifndef DIFFRAG_ENGINE_INTERNAL_H
#define DIFFRAG_ENGINE_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "model/engine.h"
#include "model/kvpool.h"

struct Scratch {
    float *x;      /* (chunk, dim) residual stream */
    float *xb;     /* (chunk, dim) normed input */
    float *q;      /* (chunk, n_q_head*hd) */
    float *k, *v;  /* (chunk, n_kv_head*hd) */
    float *att;    /* (chunk, n_head*hd) attention output (diffv2 heads already combined) */
    float *lam;    /* (chunk, n_head) diffv2 lambda logits */
    float *h;      /* (chunk, ffn) SwiGLU activations */
    float *cos, *sin; /* (chunk, n_rot/2) */
    float *logits; /* (vocab) */
    void *mm;      /* matrix-product panels for every thread */
    void *attn;    /* attention tiles and partial states for every thread */
};

struct Engine {
    struct Engine *runner;    /* whose threads and scratch compute this sequence (itself, or
                                 the context engine_new_seq was given) */
    float *logits;            /* (vocab) the last logits: s.logits, or a sequence's own */
    float *step_logits;       /* runner: the logits rows of a step with several sequences */
    int step_logits_rows;
    const struct Model *m;
    const struct Backend *be;
    struct EngineOpts opts;
    struct ThreadPool *pool;
    /* CPU: the sequence's KV pages (model/kvpool.h) */
    struct KvPool *kv;
    int own_kv;               /* the pool is this context's own */
    struct KvPoolLayout lay;
    int32_t *pages;           /* (pages for n_ctx) page of each tile; n_pages taken */
    uint64_t *page_hash;      /* names of the pages published or taken from the cache */
    int n_pages;
    int n_named;              /* pages [0, n_named) are named (cached or published) */
    int named_ok;             /* 0 once a page could not be published: later ones cannot be */
    int prefill_end;          /* positions [0, prefill_end) were written by prefills */
    int n_cached;             /* positions taken from the prefix cache */
    int32_t *tok;             /* (n_ctx) the sequence's tokens */
    float *block;             /* all scratch */
    struct Scratch s;
    double *inv_freq;         /* (n_rot/2) RoPE frequencies after scaling */
    float rope_mscale;
    int n_past;
    int rope_offset;          /* RoPE positions are the cache's plus this
                                 (engine_set_rope_offset) */
    struct EngineStats stats;
    atomic_int cancel;
    /* a blend's probe (engine_blend): the attention its rows give the region, summed */
    struct BlendProbe *probe;
    struct Blend *blend;      /* a blend in progress (engine_blend_begin) */
    /* groundedness signals: watched heads, position classes, masses of the last position */
    struct AttnWatch *watch;  /* (n_watch) in the caller's order */
    int n_watch;
    int *wq;                  /* query heads to measure, grouped by layer: wq[wq_off[l]..] */
    int *wq_watch;            /* for each, the watch it belongs to */
    int *wq_off;              /* (n_layer + 1) */
    float *wq_mass;           /* (total query heads, 2) */
    struct AttnMass *mass;    /* (n_watch) */
    int mass_valid;
    uint8_t *cls;             /* (n_ctx) position classes */
    int n_marked;
    void *mass_scratch;
    /* residual-stream capture (engine_capture): layers, and their rows at the last position */
    int cap_layer[ENGINE_MAX_CAPTURE];
    int n_cap;
    float *hidden;            /* (n_cap, dim) */
    int hidden_valid;
    /* engine_verify: each row's logits, masses and captured rows from the last verify step,
     * so that engine_verify_keep can end the sequence after any of them */
    float *vfy_logits;        /* (vfy_cap, vocab) */
    struct AttnMass *vfy_mass; /* (vfy_cap, vfy_watch) */
    float *vfy_hidden;        /* (vfy_cap, vfy_ncap, dim) */
    int vfy_cap, vfy_watch, vfy_ncap;
    int vfy_rows, vfy_base;   /* rows of the last verify step (0: none since), and n_past
                                 before it */
    /* GPU contexts: the device sequence, and the host side of its masses */
    struct GpuSeq *gpu;
    float *gpu_mass;          /* (n_layer, n_q_head, 2) */
    float *gpu_lam;           /* (n_layer, n_head) */
    uint8_t *gpu_watch;       /* (n_layer) layers with watched heads */
    struct SampleCand *gpu_cand; /* (vocab) sampling candidates from the device */
    int logits_on_host;       /* GPU: s.logits holds the last logits (else only the device) */
    char gpu_err[256];        /* the last device error */
};

/* A step's share of one sequence: n tokens at its positions n_past.., rows row0.. of the
 * step's activations. prefill: prompt tokens (the rowwise form, published pages); else one
 * decode token. */
struct StepSeg {
    struct Engine *e;
    const int32_t *tokens;
    int n, prefill, want_logits, row0;
    int pos0;                 /* CPU: the first token's position (forward_step: n_past) */
    const int32_t *qpos;      /* CPU: when non-NULL, row t's position (increasing), not pos0 + t */
    int quiet;                /* CPU: 1 = no masses measured (a blend's recomputed rows) */
    int probe;                /* CPU: 1 = the rows are a blend's probe (e->probe) */
    int verify;               /* CPU: 1 = n decode tokens, each row computed as engine_decode
                                 would compute it after the rows before it, every row's logits,
                                 masses and captured rows kept (engine_verify) */
};

/* ---- engine_step.c ---- */

/* RoPE's cos and sin of n positions from pos0 into cs and sn (n_rot/2 a position). */
void eng_rope_rows(const struct Engine *e, int n, int pos0, float *cs, float *sn);
/* The monotonic clock, in seconds. */
double eng_now_s(void);
/* A product with e's threads and scratch, counted in e's stats. */
void eng_run_matmul(struct Engine *e, const struct MatmulArgs *a);
/* rows[t][0..len) += bias for n rows; nothing when bias is NULL. */
void eng_add_bias(float *rows, size_t len, int n, const float *bias);
/* The sequence's pages for positions up to end - 1; ENGINE_EBUDGET (GPU: or ENGINE_ECTX) with
 * err when there are none left. */
int eng_take_pages(struct Engine *e, int end, char *err, size_t errlen);
/* Layer l of a CPU step over rows [0, n) of runner r's scratch (rows [0, np) prefill ones). */
void eng_layer_step(struct Engine *r, int l, struct StepSeg *segs, int ns, int n, int np,
                    double attn_flop);

/* ---- engine_signals.c ---- */

/* The watched heads of layer l at step row `row`, the last of the sequence's n tokens. */
void eng_measure_layer(struct Engine *e, int l, int row, int n, const void *kc);
/* The AttnMass entries of layer l's watched heads from wq_mass and the lambda logits. */
void eng_fill_masses(struct Engine *e, int l, const float *lam_row);
/* The residual rows of the segments that capture layer l. */
void eng_capture_rows(struct Engine *r, int l, const struct StepSeg *segs, int ns);

/* ---- engine_verify.c ---- */

/* Sizes e's verify buffers for n rows of its current watch and capture sets. ENGINE_ENOMEM. */
int eng_verify_reserve(struct Engine *e, int n);
/* Layer l's masses of verify row t, copied from e->mass after the row was measured. */
void eng_verify_keep_masses(struct Engine *e, int l, int t);
/* The logits of every row of the verify segment g, each through the final norm and the LM
 * head as its own one-row product, with runner r's threads and scratch. */
void eng_verify_logits(struct Engine *r, const struct StepSeg *g);
/* Frees the verify buffers. */
void eng_verify_free(struct Engine *e);

/* ---- engine_blend.c ---- */

/* Layer l's share of a blend's probe (e->probe): the attention its rows give the region. */
void eng_probe_layer(struct Engine *e, int r0, int sn, const int32_t *qpos, int pos0,
                     const void *kc);
/* Drops a blend in progress, if any. */
void eng_blend_free(struct Engine *e);

#endif
