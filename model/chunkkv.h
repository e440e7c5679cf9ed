/* Chunk KV copies kept in memory for reuse across prompts, and the blend of a prompt's
 * documents from them (docs/kv-reuse.md). A copy is a chunk's KV computed once, at its first
 * use, after the prompt's fixed frame and the chunk's lead (a label that does not depend on
 * where the chunk lands), and kept under a byte budget (least recently used first out); it is
 * keyed by the frame's, the lead's and the chunk's tokens, so a chunk that comes back in
 * another prompt after the same frame finds its copy wherever it lands. One cache serves
 * one model and KV type (a worker's); one thread uses it at a time. */
#ifndef DIFFRAG_CHUNKKV_H
#define DIFFRAG_CHUNKKV_H

#include <stddef.h>
#include <stdint.h>

#include "model/engine.h"

struct ChunkKv;

/* A cache of at most budget bytes of copies (> 0). ENGINE_OK or ENGINE_ENOMEM. */
int chunkkv_new(size_t budget, struct ChunkKv **out);
void chunkkv_destroy(struct ChunkKv **c);

struct ChunkKvStats {
    uint64_t hits, misses;     /* chunks found, chunks computed (or left to compute) */
    uint64_t evictions;
    size_t bytes, entries;     /* what the cache holds now */
};
void chunkkv_stats(const struct ChunkKv *c, struct ChunkKvStats *out);

/* What one blend did. */
struct ChunkKvBlend {
    int reused, recomputed;    /* document tokens whose stored KV stayed; computed in the blend */
    int fresh;                 /* document tokens that kept the KV of a copy made for this
                                  blend: computed for this prompt, so not counted as reused */
    int chunks, computed;      /* chunks of the documents; of them, copies made now */
    int full;                  /* chunks computed in full as asked (ChunkKvSpans.n_full) */
    int probed;                /* question tokens run to choose the recomputed ones */
    double probe_s;            /* and the seconds that took */
    size_t bytes_read;         /* stored KV bytes placed */
};

/* What a blend knows of each chunk span besides its tokens (docs/kv-reuse.md):
 *  - its lead, lead_tokens[leads[2i]..leads[2i+1]) for span i, laid between the frame and the
 *    chunk when its copy is made (a label that is the same wherever the chunk lands, so the
 *    copy has seen its title); a copy's key names the frame and the lead. An empty range, or
 *    no leads (lead_tokens NULL), makes the copy after the frame alone;
 *  - its retrieval rank among the prompt's chunks, ranks[i] (0: the best); the n_full best
 *    ranked are computed in the blend in full, as the labels are, and neither use nor make a
 *    copy: the chunks likeliest to hold the answer keep exactly the keys and values a prefill
 *    gives them. ranks NULL or n_full 0: none. */
struct ChunkKvSpans {
    const int32_t *lead_tokens;
    size_t n_lead_tokens;
    const uint32_t *leads;     /* two per span, inside lead_tokens[0..n_lead_tokens) */
    const uint32_t *ranks;     /* one per span */
    int n_full;
};

/* 1 when span i is one a blend computes in full (ChunkKvSpans.n_full). */
int chunkkv_span_full(const struct ChunkKvSpans *s, int i);

/* Brings sequence e, which holds prompt[0..n_past) with n_past < docs_end (nothing, or a
 * cached prefix of the frame, or of the frame and the first documents), to prompt[0..
 * docs_end): the rest of the frame prompt[0..docs_start) prefilled, then the rest of the
 * documents prompt[max(docs_start, n_past)..docs_end) blended (engine_blend, recompute share
 * `share`, the rest of the prompt prompt[docs_end..n_prompt), the question, as its probe):
 * each chunk span (spans[2i]..spans[2i+1], inside the documents, in order, not overlapping)
 * from its copy, made after the frame and the span's lead on `helper` (an empty sequence of
 * the same runner, or another context of the same model and KV type; it is reset) when the
 * cache lacks it; computed in the blend: the tokens between spans (labels, separators), the
 * rest of a span whose start the sequence holds, the spans `info` (NULL: none) says to
 * compute in full, and a chunk whose copy cannot be made (no free page, the budget full of
 * copies this blend uses). ENGINE_OK, or an engine error with err (e may then hold part of
 * the frame). */
int chunkkv_blend(struct ChunkKv *c, struct Engine *e, struct Engine *helper,
                  const int32_t *prompt, int docs_start, int docs_end, int n_prompt,
                  const uint32_t *spans, int n_spans, const struct ChunkKvSpans *info,
                  double share, struct ChunkKvBlend *out, char *err, size_t errlen);

/* The same blend in steps, so that the runner's other sequences take theirs in between (a
 * server's decode tokens keep coming while a prompt's documents blend): chunkkv_blend_begin
 * checks the arguments (prompt and spans are borrowed until the end); each chunkkv_blend_step
 * does about `tokens` tokens' worth of the work (the frame's prefill, the copies the cache
 * lacks, each a prefill on the helper, then engine_blend_step) and sets *done, with *out, when
 * the blend has ended. Whatever the steps' sizes, it computes what chunkkv_blend does, bit for
 * bit. Between steps nothing else may use the cache, the helper or e; after an error the blend
 * is over (e may hold part of it: reset it). chunkkv_blend_end frees a blend, ended or not
 * (the helper is reset when a copy was under way; e is the caller's). */
struct ChunkKvJob;
int chunkkv_blend_begin(struct ChunkKv *c, struct Engine *e, struct Engine *helper,
                        const int32_t *prompt, int docs_start, int docs_end, int n_prompt,
                        const uint32_t *spans, int n_spans, const struct ChunkKvSpans *info,
                        double share, struct ChunkKvJob **out, char *err, size_t errlen);
int chunkkv_blend_step(struct ChunkKvJob *j, int tokens, int *done, struct ChunkKvBlend *out,
                       char *err, size_t errlen);
void chunkkv_blend_end(struct ChunkKvJob **j);

/* ---- a tier below memory (docs/kv-reuse.md): copies kept as records elsewhere ----
 * A caller that keeps copies beyond the cache (the daemon: in the document store, under each
 * chunk) brings a record into the cache before a blend (chunkkv_insert) and keeps the copies
 * a blend made (chunkkv_record). */

/* A hash naming what a copy's numbers depend on besides the tokens: the model's weights and
 * configuration (RoPE settings included), the KV type and the arithmetic that computes it
 * (engine_numerics). Reads every weight: once per model and KV type, not per request or per
 * context. */
uint64_t chunkkv_identity(const struct Model *m, enum KvType kv_type, const char *numerics);

/* The hash of the frame prompt[0..docs_start) (everything before the documents), which the
 * calls below take: computed once a prompt. */
uint64_t chunkkv_frame(const int32_t *prompt, int docs_start);

/* The hash of what a chunk's copy is made after: the frame whose hash is `frame`, then the
 * lead t[0..n) (the frame's own hash when n is 0). The calls below name a copy by it. */
uint64_t chunkkv_after(uint64_t frame, const int32_t *lead, int n);

/* The key of chunk t[0..n) after what `frame` names (as the blend uses it). */
uint64_t chunkkv_key(uint64_t frame, const int32_t *t, int n);

/* 1 when the cache holds the copy of chunk t[0..n) after what `frame` names. */
int chunkkv_has(struct ChunkKv *c, uint64_t frame, const int32_t *t, int n);

/* A copy as a record, in three pieces laid end to end: a header (format, tokens, position,
 * the hash of what it was made after, KV bytes), the tokens, the KV (engine_kv_export's layout). They borrow the
 * cache until its next change. */
struct ChunkKvRecord {
    const void *parts[3];
    size_t lens[3];
};
/* 1 and *out when the cache holds the copy, else 0. */
int chunkkv_record(struct ChunkKv *c, uint64_t frame, const int32_t *t, int n,
                   struct ChunkKvRecord *out);

/* Takes a record (the pieces chunkkv_record gave, concatenated) as the copy of chunk t[0..n)
 * after what `frame` names, for contexts like e: the record must say the same tokens, frame and KV
 * size (e's encoding). ENGINE_OK; ENGINE_EINPUT with err when the record does not match or is
 * malformed; ENGINE_ENOMEM when it does not fit the budget or memory. */
int chunkkv_insert(struct ChunkKv *c, const struct Engine *e, uint64_t frame, const int32_t *t,
                   int n, const void *rec, size_t len, char *err, size_t errlen);

#endif
