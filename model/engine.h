/* The engine: one sequence context over a shared, read-only Model. Open a context with a
 * token budget (refused up front when its memory would exceed the configured budget), prefill
 * tokens in chunks, decode one token at a time, read the last position's logits, cancel
 * between chunks and steps. One context is used by one thread at a time; engine_cancel may be
 * called from any thread. */
#ifndef DIFFRAG_ENGINE_H
#define DIFFRAG_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "model/model.h"
#include "model/sampler.h"

#define ENGINE_MAX_CTX 131072

enum EngineStatus {
    ENGINE_OK = 0,
    ENGINE_EINPUT = -1,     /* bad argument or token id out of range */
    ENGINE_EBUDGET = -2,    /* the context would need more memory than the budget allows */
    ENGINE_ENOMEM = -3,
    ENGINE_ECTX = -4,       /* the sequence would pass n_ctx */
    ENGINE_ECANCELLED = -5, /* engine_cancel was called; the cache holds the chunks done */
    ENGINE_EDEVICE = -6,    /* the GPU reported an error (the message says which) */
};
const char *engine_strerror(int status);

/* The arithmetic of this process's CPU contexts: its instruction-set path and prefill products'
 * path (e.g. "avx512 q8"); what a CPU context computes under another name rounds differently.
 * Decided once per process. */
const char *engine_numerics(void);

/* Where a context computes. ENGINE_CUDA needs the model on a GPU first (model_gpu_load in
 * model/engine_gpu.h); its KV cache comes from the model's shared page pool. */
enum EngineDevice { ENGINE_CPU = 0, ENGINE_CUDA = 1 };

struct KvPool;

struct EngineOpts {
    int n_ctx;              /* tokens the KV cache holds (1..ENGINE_MAX_CTX) */
    int chunk;              /* prefill chunk size in tokens (>= 1) */
    enum KvType kv_type;    /* KV_F16 (default), KV_F32 or KV_Q8 (int8, CPU only) */
    size_t mem_budget;      /* bytes a context may use (KV + activations); 0 = unlimited */
    int n_threads;          /* >= 1 (CPU) */
    enum EngineDevice device; /* ENGINE_CPU (default) or ENGINE_CUDA */
    /* CPU: the page pool (model/kvpool.h) the context takes its KV pages from, shared with
     * other contexts of the same model and KV type; NULL (default): a pool of its own, of
     * the pages n_ctx positions need, with prefix caching on. */
    struct KvPool *kv_pool;
};
void engine_opts_default(struct EngineOpts *o);

struct EngineMemory {
    size_t kv_bytes;        /* K and V caches for n_ctx tokens (GPU: its pool pages) */
    size_t scratch_bytes;   /* activations for one chunk, logits, attention tiles (GPU: device
                               activations plus the host tables) */
    size_t context_bytes;   /* kv + scratch: what engine_new allocates */
    size_t weight_bytes;    /* the shared model weights (not part of the context) */
};
/* The memory a context with these options needs; pure arithmetic, allocates nothing. */
void engine_estimate(const struct Model *m, const struct EngineOpts *o, struct EngineMemory *out);

struct Engine;

/* Opens a context. ENGINE_EBUDGET (with both figures in `err`) before any large allocation
 * when the estimate exceeds o->mem_budget. The Model must outlive the context. */
int engine_new(const struct Model *m, const struct EngineOpts *o, struct Engine **out,
               char *err, size_t errlen);
void engine_destroy(struct Engine **e);

/* Appends n tokens to the sequence in chunks of opts.chunk; afterwards engine_logits holds the
 * logits of the last token. Checks for cancellation before each chunk.
 *
 * Contexts cache prefixes exactly (model/kvpool.h; a GPU context in the GPU's pool, when the
 * model went to the GPU with prefix_cache): a prefill into an empty sequence first takes the
 * longest run of cached full pages that starts the prompt (leaving at least its last token to
 * compute), and every full page a prefill writes is published for later prompts. On the CPU,
 * prefill chunks run each row through the many-row products and the unsplit attention,
 * whatever the chunk's length, so a position's keys, values and logits do not depend on how
 * the prompt was cut into chunks, or on which part of it came from the cache; on a GPU, the
 * products may round a row differently with another number of rows (docs/cuda.md).
 * ENGINE_EBUDGET when the pool has no page left (every page referenced by a sequence). */
int engine_prefill(struct Engine *e, const int32_t *tokens, size_t n, char *err, size_t errlen);
/* Positions of the current sequence taken from the prefix cache. */
int engine_cached(const struct Engine *e);
/* The prefix-cache lookup engine_prefill starts with, alone: on an empty sequence, takes
 * the longest cached run of full pages that starts `prompt` (n tokens), leaving at least the
 * last token to compute, and returns the positions taken (0 otherwise). */
int engine_take_cached(struct Engine *e, const int32_t *prompt, size_t n);
/* What engine_take_cached would take now, without taking it: the positions (0 on sequences
 * that are not empty), and in *idle_pages how many of their pages no sequence holds
 * (engine_pages_available counts those until they are taken). */
int engine_peek_cached(const struct Engine *e, const int32_t *prompt, size_t n, int *idle_pages);
/* Pages the sequence would take to append n more tokens; pages n positions fill in its pool
 * (a page holds 64 positions on the CPU, GPU_PAGE on a GPU); pages its pool could give now
 * (free or cached: nobody uses them); and the pool's pages in all. */
int engine_pages_needed(const struct Engine *e, int n);
int engine_pages_for(const struct Engine *e, int n_positions);
long engine_pages_available(const struct Engine *e);
long engine_pages_total(const struct Engine *e);

/* ---- Batches: several sequences computed together ----
 * A sequence of a batch computes with its runner's threads and scratch (GPU: the runner's
 * device context and activations) and has its own pages, tokens, spans, watched heads, masses
 * and logits; every single-sequence call above works on it too, as long as one thread at a
 * time uses the runner and its sequences. */
int engine_new_seq(struct Engine *runner, struct Engine **out, char *err, size_t errlen);

struct EngineBatchItem {
    struct Engine *seq;        /* a sequence of the runner (or the runner itself) */
    const int32_t *tokens;
    int n;
    int prefill;               /* 1: n prompt tokens (the prefill form, pages published); 0: one
                                  decode token, or n with verify */
    int logits;                /* 1: compute the last token's logits (engine_logits) */
    int verify;                /* 1 (CPU, prefill 0): n decode tokens, each computed as
                                  engine_decode would after the ones before it, every row's
                                  logits, masses and captured rows kept (engine_verify) */
};
/* One step over the items, whose tokens together are at most the runner's chunk: their
 * products run as one product over the step's tokens (CPU: the prefill tokens through the
 * many-row products, the decode tokens each as its own one-row product) and attention runs per
 * sequence over its own pages. On the CPU each sequence computes exactly, bit for bit, what it
 * would alone; on a GPU the products' rounding may depend on how many rows they have (the
 * library picks its kernels by shape). No item's sequence is advanced when an error is returned: ENGINE_EINPUT (bad item),
 * ENGINE_ECTX (an item passes its context), ENGINE_EBUDGET (the pool has no free page for an
 * item: the caller may free another sequence's pages and retry), ENGINE_ENOMEM; *failed (when
 * non-NULL) is then the index of the item at fault, or -1. */
int engine_step(struct Engine *runner, const struct EngineBatchItem *items, int n_items,
                int *failed, char *err, size_t errlen);
/* One decode step: appends `token` and computes its logits (= prefill of one token). */
int engine_decode(struct Engine *e, int32_t token, char *err, size_t errlen);

/* ---- Verify steps (speculative decoding: model/lookup.h, docs/configuration.md) ----
 * engine_verify appends n tokens (1..chunk) in one step and computes each exactly, bit for
 * bit, as engine_decode would if they were decoded one after another: each row through the
 * one-row products (the weights are streamed once for several rows) and attention of its own;
 * it keeps every row's logits, watched-head masses and captured rows. Afterwards the sequence
 * holds all n, with the last row's outputs current. engine_verify_keep(e, i) then ends the
 * sequence after row i (n_past = the count before the step + i + 1) with row i's logits,
 * masses and captured rows current, as if tokens[0..i] alone had been decoded; it may be called
 * again with a larger i until the sequence next computes or is reset. The rows past the
 * kept one stay in the sequence's pages until later tokens overwrite them. engine_verify:
 * ENGINE_EINPUT (bad token, n outside 1..chunk, a GPU context), ENGINE_ECTX, ENGINE_EBUDGET,
 * ENGINE_ENOMEM, ENGINE_ECANCELLED (before the step; the sequence is unchanged).
 * engine_verify_keep: ENGINE_EINPUT when i is not a row of the last verify step. */
int engine_verify(struct Engine *e, const int32_t *tokens, int n, char *err, size_t errlen);
int engine_verify_keep(struct Engine *e, int i);

/* Appends n tokens like engine_prefill and scores them (CPU contexts only: ENGINE_EINPUT on a
 * GPU context): *nll_sum receives the summed negative
 * log-likelihood of tokens[1..n-1], each given its prefix, over *n_scored positions
 * (perplexity = exp(nll_sum / n_scored)). */
int engine_score(struct Engine *e, const int32_t *tokens, size_t n, double *nll_sum,
                 size_t *n_scored, char *err, size_t errlen);
/* Appends n tokens like engine_score and scores each position: for i in 0..n-2,
 * nll[i] = -log p(tokens[i+1] | tokens[0..i]) (natural log, under softmax of the logits) and
 * top[i] = the token with the largest logit at position i (the lowest id on ties), gap[i] =
 * its logit less the second largest. Any array may be NULL; each holds at least n-1 entries. CPU contexts only (ENGINE_EINPUT on a
 * GPU context), with engine_score's errors (ENGINE_EINPUT, ENGINE_ECTX, ENGINE_ENOMEM,
 * ENGINE_ECANCELLED: the arrays hold the positions done). */
int engine_score_positions(struct Engine *e, const int32_t *tokens, size_t n, float *nll,
                           int32_t *top, float *gap, char *err, size_t errlen);

/* Logits (vocab) of the last token evaluated; borrowed, valid until the next call. A GPU
 * context keeps them on the device until asked: NULL when copying them fails (a device
 * error). */
const float *engine_logits(struct Engine *e);
/* Draws the next token from the last logits (sampler_sample: the token, and *sig when
 * non-NULL). A GPU context makes the pass over the vocabulary on the device and brings back
 * only the candidates (model/engine_gpu.h). ENGINE_OK, or ENGINE_EDEVICE with err. */
int engine_sample(struct Engine *e, struct Sampler *s, int32_t *token, struct TokenSignal *sig,
                  char *err, size_t errlen);
int engine_n_past(const struct Engine *e);
const struct Model *engine_model(const struct Engine *e);
const struct EngineOpts *engine_opts(const struct Engine *e);
/* Forget the sequence (and any pending cancel), giving its pages back to the pool (its full
 * prefill pages stay cached there). */
void engine_reset(struct Engine *e);
/* Asks the running (or next) prefill/decode call to stop at its next chunk or step boundary;
 * that call returns ENGINE_ECANCELLED and consumes the request. Async-signal and thread safe. */
void engine_cancel(struct Engine *e);

/* Where a context's time went since it was opened (or since engine_stats_reset): seconds and
 * floating-point operations of the matrix products and of attention, and the whole forward
 * passes. For benchmarks and metrics; the counters cost two clock reads per product. */
struct EngineStats {
    double matmul_s, matmul_flop;
    double attention_s, attention_flop;
    double total_s;           /* forward passes, everything included */
    double device_s;          /* GPU contexts: the span between events recorded on the stream
                                 before and after each forward pass's work (the kernels and any
                                 idle gaps between their launches); total_s - device_s is host
                                 time outside it (the RoPE tables, the final wait) */
    long tokens;              /* positions evaluated */
};
void engine_stats(const struct Engine *e, struct EngineStats *out);
void engine_stats_reset(struct Engine *e);

/* ---- Chunk KV reuse (CacheBlend: arXiv 2405.16444; docs/kv-reuse.md) ----
 * A span's keys and values, computed once, placed again in a later prompt at another position:
 * each key rotated to its new position (RoPE rotations compose), and a share of the span's
 * tokens recomputed to restore the attention across spans that the stored KV never saw.
 * CPU contexts only. */

/* Bytes of n positions' KV, every layer, in the context's cache encoding (KV_F16: 2 bytes an
 * element; KV_Q8: 1, and an f32 scale per head and position; KV_F32: 4). */
size_t engine_kv_bytes(const struct Engine *e, int n);
/* Copies positions pos0..pos0+n-1 of the sequence's cache, every layer, into out
 * (engine_kv_bytes(e, n) bytes): layer after layer, position after position, per KV head its
 * key (after RoPE) and then its value. ENGINE_EINPUT for positions outside the sequence or a
 * GPU context. */
int engine_kv_export(struct Engine *e, int pos0, int n, void *out, char *err, size_t errlen);
/* An empty CPU sequence whose RoPE positions run from `offset`: its tokens compute as they
 * would at positions offset.. with nothing before them (the attention is over its own cache).
 * Nothing it writes is published to the prefix cache, nor taken from it. Until
 * engine_reset. */
int engine_set_rope_offset(struct Engine *e, int offset, char *err, size_t errlen);

struct EngineKvPart {
    const int32_t *tokens;
    int n;
    const void *kv;           /* engine_kv_export's copy of kv_len >= n positions, whose first n
                                 are these tokens, from a context of the same model and KV type
                                 (a copy of a whole chunk serves its prefixes); NULL: the part
                                 is computed */
    int kv_len;               /* positions the copy holds; 0: n */
    int kv_pos;               /* the RoPE position its first token had there */
    int fresh;                /* the copy was made for this prompt: its kept tokens are
                                 counted in EngineBlendStats.fresh as well */
};

struct EngineBlendStats {
    int reused;               /* tokens whose stored KV stays */
    int fresh;                /* of them, those of parts marked fresh */
    int recomputed;           /* tokens computed at every layer (forced ones included) */
    int forced;               /* tokens of parts without stored KV */
    int probed;               /* probe tokens run to choose them (0: none) */
    double probe_s;           /* seconds the probe took (part of the blend's) */
    size_t imported_bytes;    /* stored KV bytes read */
};

/* The probe rows whose attention weighs a blend's choice: the last ones, nearest the answer. */
#define ENGINE_BLEND_PROBE_ROWS 8

/* Appends the parts' tokens to the sequence. The stored KV of each part is copied in with its
 * keys rotated to their new positions; then, unless recompute is 0, layer 0 runs over every
 * token of the region with attention over the whole sequence, each token's value at layer 1 is
 * computed again and compared with the stored one, and the ceil(recompute * reusable) tokens
 * that matter most, with every token of a part without KV, run through the remaining layers
 * (their keys and values replace the stored ones). Without a probe the tokens that matter most
 * are those whose values moved most. With a probe (probe[0..n_probe): the tokens that will
 * follow the region, the question), it runs once after the region through every layer, over
 * the KV as it stands then, and a token's weight is the attention the probe's last
 * ENGINE_BLEND_PROBE_ROWS rows give it (summed over heads and layers) times how far its value
 * moved; the probe's KV is then left beyond the sequence's end, where the next prefill writes
 * over it before anything reads it. A probe that does not fit the context or the pool is left
 * out. recompute = 1 computes what a prefill of the region would, bit for bit; recompute = 0
 * only copies (no probe runs at either). No logits: prefill at least one token after it (the
 * question) for them. The region's pages are never published to the prefix cache, and no
 * masses are measured inside it. ENGINE_EINPUT (bad part or probe token, GPU context),
 * ENGINE_ECTX, ENGINE_EBUDGET, ENGINE_ENOMEM, ENGINE_ECANCELLED (the sequence then ends before
 * the region). */
int engine_blend(struct Engine *e, const struct EngineKvPart *parts, int n_parts, double recompute,
                 const int32_t *probe, int n_probe, struct EngineBlendStats *st, char *err,
                 size_t errlen);

/* The same blend in steps, so that other sequences of the runner can take their steps between
 * them (a server's decode tokens keep coming while a long region blends): engine_blend_begin
 * checks the parts (the same errors as engine_blend), takes the region's pages and places the
 * stored copies; each engine_blend_step then computes about `tokens` tokens' worth (a row
 * through one layer is 1/n_layer of a token; at least one row, or one layer of the probe) and
 * sets *done, with *st, when the blend has ended. Whatever the steps' sizes, a blend computes what engine_blend
 * does, bit for bit. Until it ends the sequence takes no tokens (engine_prefill and engine_step
 * refuse it); engine_reset drops a blend in progress, and ENGINE_ECANCELLED from a step ends
 * it (the sequence then ends before the region). */
int engine_blend_begin(struct Engine *e, const struct EngineKvPart *parts, int n_parts,
                       double recompute, const int32_t *probe, int n_probe, char *err,
                       size_t errlen);
int engine_blend_step(struct Engine *e, int tokens, int *done, struct EngineBlendStats *st,
                      char *err, size_t errlen);
/* 1 while a blend of the sequence is in progress. */
int engine_blending(const struct Engine *e);

/* ---- Attention signals for groundedness (docs/groundedness.md) ----
 * For a set of watched (layer, head) pairs the engine measures, at the last position of
 * every prefill chunk and decode step, the attention probability mass on the positions
 * marked ATTN_DOC and on the generated positions (those at or after the end of the marked
 * range), from the same post-RoPE queries and cached keys as the attention itself. */
enum AttnClass { ATTN_OTHER = 0, ATTN_DOC = 1 };

struct AttnWatch {
    int layer;
    int head;   /* GQA: a query head (0..n_q_head-1); DIFF V2: an output head i (0..n_head-1),
                   the pair of query heads 2i and 2i+1 */
};

struct AttnMass {
    float doc, gen;            /* GQA: the head's masses; DIFF V2: those of query head 2i */
    float doc2, gen2;          /* DIFF V2: those of query head 2i+1; GQA: 0 */
    float sig;                 /* DIFF V2: sigmoid(lambda_i) at this position; GQA: 0 */
    float diff_doc, diff_gen;  /* DIFF V2: (doc - sig*doc2) / (1 - sig), likewise gen (can be
                                  negative); GQA: doc and gen */
};

#define ENGINE_MAX_WATCH 1024

/* Sets the watched heads (n = 0 turns the measurement off; at most ENGINE_MAX_WATCH, no
 * duplicates). ENGINE_EINPUT with a message for a layer or head out of range. */
int engine_watch(struct Engine *e, const struct AttnWatch *w, int n, char *err, size_t errlen);
/* Marks positions 0..n-1 with their AttnClass (copied); positions >= n count as generated.
 * ENGINE_EINPUT when n > n_ctx. Kept across engine_reset; call again for a new prompt. */
int engine_set_spans(struct Engine *e, const uint8_t *cls, size_t n, char *err, size_t errlen);
/* The masses of the watched heads (in engine_watch order) at the last position evaluated;
 * *n receives their count. NULL when nothing is watched or nothing was evaluated since the
 * sequence was reset. Borrowed, valid until the next prefill/decode/reset. */
const struct AttnMass *engine_attn_mass(const struct Engine *e, int *n);
/* ---- The residual stream, for probes of the hidden state (docs/groundedness.md) ---- */
#define ENGINE_MAX_CAPTURE 8

/* Sets the layers whose residual stream the sequence keeps at the last position of every
 * prefill chunk and decode step: layer l's row is the stream as it enters layer l (0: the
 * token's embedding; n_layer: after the last layer, before the final norm). n = 0 turns the
 * capture off. ENGINE_EINPUT for a layer outside 0..n_layer or given twice; ENGINE_ENOMEM. Kept
 * across engine_reset. A GPU context downloads the rows in its step (from the GPU's arithmetic:
 * close to the CPU's rows, not equal). */
int engine_capture(struct Engine *e, const int *layers, int n, char *err, size_t errlen);
/* The captured rows (*n of them, dim floats each, in engine_capture's order) of the last
 * position evaluated; NULL (and *n = 0) when nothing is captured or nothing was evaluated
 * since the sequence was reset. Borrowed, valid until the next prefill/decode/reset. A blend's
 * region leaves it as it was. */
const float *engine_hidden(const struct Engine *e, int *n);

/* The default watch set: every head of the layers at 1/2 and 3/4 depth. Fills out (at most
 * cap entries) and returns the count. */
int engine_default_watch(const struct Model *m, struct AttnWatch *out, int cap);

#endif
