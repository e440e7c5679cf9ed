/* The forward pass on a GPU (kernels/gpu.h): the model's weights uploaded once as bf16 with a
 * paged KV pool beside them (model_gpu_load), and per engine context a sequence (struct
 * GpuSeq) with its own GPU context (stream, cuBLAS handle), page table and activations; the
 * sequences of a batch are members of such a context, computed in its steps. The engine
 * (model/engine.c, model/engine_step.c) calls this when its options ask for a GPU. */
#ifndef DIFFRAG_ENGINE_GPU_H
#define DIFFRAG_ENGINE_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "model/engine.h"
#include "model/model.h"
#include "model/sampler.h"

struct KvPool;

struct GpuModelOpts {
    int device;                /* CUDA device index */
    long kv_tokens;            /* KV pool capacity in positions, shared by all contexts */
    int prefix_cache;          /* 1: full prompt pages are published and matched as a CPU
                                  pool's are (model/kvpool.h); 0: every page is private */
};

/* Uploads the weights (dequantised to bf16) and allocates the KV pool. Idempotent: a second
 * call with the model already on a GPU is a no-op returning 0. -1 with `err` on failure. */
int model_gpu_load(struct Model *m, const struct GpuModelOpts *o, char *err, size_t errlen);
void model_gpu_free(struct Model *m);
/* Device line, weight bytes on the device, pool pages (total; free: no sequence holds them,
 * cached prefixes among them); NULL when not loaded. */
const char *model_gpu_info(const struct Model *m, size_t *weight_bytes, int *pages, int *free_pages);
/* The names and references of the GPU pool's pages (kvpool_stats, kvpool_peek,
 * kvpool_publish; model/kvpool.h), or NULL when not loaded. Valid until model_gpu_free. */
struct KvPool *model_gpu_pool(const struct Model *m);

/* Device bytes a sequence of n_ctx positions in chunks of `chunk` needs: KV pages and
 * activations (pure arithmetic). */
void gpu_seq_estimate(const struct ModelConfig *c, int n_ctx, int chunk, size_t *kv_bytes,
                      size_t *scratch_bytes);

struct GpuSeq;
/* The attention kernels DIFFRAG_GPU_ATTENTION names, by their GpuAttnArgs.kernel number. */
#define GPU_ATTENTION_KERNELS 6
extern const char *const gpu_attention_kernels[GPU_ATTENTION_KERNELS];
/* The arithmetic of this process's GPU contexts, as engine_numerics names the CPU's: bf16
 * inputs of products and attention, and the attention kernel DIFFRAG_GPU_ATTENTION chooses
 * (e.g. "cuda bf16 mma"); an unknown kernel name is said as such (a sequence then refuses). */
const char *gpu_numerics(void);

/* A sequence of up to n_ctx positions with its own GPU context (stream, cuBLAS handle) and
 * activations for steps of up to `chunk` tokens. 0, or -1 (err) on a device failure. */
int gpu_seq_new(const struct Model *m, int n_ctx, int chunk, struct GpuSeq **out, char *err,
                size_t errlen);
/* A batch member of `runner`: its pages, page table, spans, logits, masses and sampling
 * buffers, on the runner's context and without activations; its tokens are computed in the
 * runner's steps (gpu_seq_step), and it is freed before the runner. */
int gpu_seq_new_member(struct GpuSeq *runner, struct GpuSeq **out, char *err, size_t errlen);
void gpu_seq_free(struct GpuSeq **s);
int gpu_seq_set_spans(struct GpuSeq *s, const uint8_t *cls, size_t n, char *err, size_t errlen);

/* A sequence takes KV pages from the model's pool as its positions grow. gpu_seq_reserve makes
 * room for positions 0..n_pos-1: 0; -2 (err, nothing taken) when the pool lacks the pages;
 * -1 (err) past the context. gpu_seq_release gives every page back (the sequence starts
 * over); gpu_seq_pages_needed says how many more pages n_pos positions take. */
int gpu_seq_reserve(struct GpuSeq *s, int n_pos, char *err, size_t errlen);
void gpu_seq_release(struct GpuSeq *s);
int gpu_seq_pages_needed(const struct GpuSeq *s, int n_pos);
/* The prefix cache on a sequence holding no page: takes the longest run of published pages,
 * at most max_pages, that starts `prompt` (n tokens) into its page table, their names into
 * hashes[]; returns the pages taken (their positions then hold the prompt's keys and values).
 * 0 when the sequence holds pages or the pool does not cache. */
int gpu_seq_take_cached(struct GpuSeq *s, const int32_t *prompt, size_t n, int max_pages,
                        uint64_t *hashes);
/* The pages the sequence holds, in position order, and their number in *n (borrowed: valid
 * until its next reserve, step or release). */
const int32_t *gpu_seq_pages(const struct GpuSeq *s, int *n);

/* One sequence's share of a step: n tokens at positions pos0..; with want_logits its last
 * position's logits are computed (they stay on the device: see gpu_seq_logits and
 * gpu_seq_sample); for each layer with watch[l] != 0, mass[l * n_q_head * 2 ..] receives the
 * last position's masses per query head (doc, generated) and lam[l * n_head ..] its DIFF V2
 * lambda logits. */
struct GpuStepSeg {
    struct GpuSeq *seq;
    const int32_t *tokens;
    int n, pos0;
    const uint8_t *watch;
    int n_marked, want_logits;
    float *mass, *lam;
    /* the residual stream entering each layer cap[j] (n_layer: after the last layer) at the
     * last position, into hidden[j * dim ..] on the host; n_cap = 0: none */
    const int *cap;
    int n_cap;
    float *hidden;
};
/* One forward pass over the segments on the runner's context: the products over all the
 * step's rows at once, RoPE and attention per sequence over its own pages, the LM head over
 * the rows that want logits. Each segment's sequence is the runner or one of its members; cos
 * and sin are the host RoPE tables of all the rows (n, n_rot/2), segment by segment. Takes the
 * pages each sequence needs first. 0; -2 (err) when the pool lacks pages; -1 (err). */
int gpu_seq_step(struct GpuSeq *runner, const struct GpuStepSeg *segs, int ns, const float *cos,
                 const float *sin, char *err, size_t errlen);
/* gpu_seq_step of one segment of sequence s itself. */
int gpu_seq_forward(struct GpuSeq *s, const int32_t *tokens, int n, int pos0, const float *cos,
                    const float *sin, const uint8_t *watch, int n_marked, int want_logits,
                    float *mass, float *lam, char *err, size_t errlen);
/* Copies the last logits (vocab floats) to the host. 0, or -1 with err. */
int gpu_seq_logits(struct GpuSeq *s, float *logits, char *err, size_t errlen);
/* Sampling's pass over the last logits on the device, for the candidates k asks for: fills
 * *p (p->cand must hold vocab entries) for sampler_finish. 0, or -1 with err. */
int gpu_seq_sample(struct GpuSeq *s, const struct SampleKeep *k, struct SamplePass *p, char *err,
                   size_t errlen);
/* Seconds the device spent in the last forward (device events). */
double gpu_seq_last_seconds(const struct GpuSeq *s);

#endif

/* Chooses where contexts of model m compute from a user's setting: "cpu"; "cuda" (the model
 * goes to GPU 0 with a KV pool of kv_tokens positions, caching prefixes when prefix_cache is
 * 1, or -1 with the reason); "auto" (CUDA when an NVIDIA driver shows a device and the backend
 * loads, else the CPU, with the reason in `note`). 0 and *out set, or -1 with err. */
int engine_device_select(struct Model *m, const char *setting, long kv_tokens,
                         int prefix_cache, enum EngineDevice *out, char *note, size_t note_len);
