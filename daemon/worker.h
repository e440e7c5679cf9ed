/* A worker: one engine context (KV cache + scratch) over a shared, read-only Model, joined to
 * a broker over the wire protocol of daemon/wire.h. The same code serves in-process worker
 * threads (inproc://) and `diffragd --worker` processes on other machines (tcp://).
 *
 * Each worker runs two threads: an I/O thread that owns the broker socket (heartbeats,
 * reconnection with back-off, cancel requests) and a compute thread that prefills and decodes.
 * So a long prefill never silences the heartbeats, and a CANCEL reaches the engine between
 * two chunks or two decode steps. */
#ifndef DIFFRAG_WORKER_H
#define DIFFRAG_WORKER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "model/engine.h"
#include "model/model.h"

/* The batch schedulers' figures of a process's in-process workers, for /metrics: preemptions,
 * and tokens per engine step (bucket b counts steps of at most 2^b tokens; the last, more). */
#define WORKER_STEP_BUCKETS 15
struct WorkerStats {
    _Atomic uint64_t preemptions;
    /* prompt lookup: tokens drafted for verify steps, and those the model kept */
    _Atomic uint64_t lookup_drafted, lookup_accepted;
    _Atomic uint64_t steps, step_tokens;
    _Atomic uint64_t step_bucket[WORKER_STEP_BUCKETS];
    /* chunk KV reuse (docs/kv-reuse.md): document tokens whose stored KV stayed, tokens
     * recomputed in blends, tokens kept from copies made for their prompt, stored KV bytes
     * placed, chunks found and made, and the bytes and
     * chunks the workers' chunk stores hold now */
    _Atomic uint64_t kv_reused, kv_recomputed, kv_fresh, kv_bytes_read, kv_hits, kv_misses;
    _Atomic uint64_t kv_store_bytes, kv_store_chunks;
    /* chunk copies taken from the document store's KV records, records written, and writes
     * or reads that failed (logged) */
    _Atomic uint64_t kv_loaded, kv_written, kv_store_errors;
    /* KV pages the workers' schedulers have promised their running requests and not yet
     * given them (the pool is shared by the process's workers, as these figures are): each
     * admits a request only with pages that nobody, here or in another worker, is promised */
    _Atomic int64_t kv_promised;
};

struct WorkerOpts {
    const char *endpoint;      /* the broker's worker endpoint; copied */
    const char *model_name;    /* the name READY gives the broker (the model file's, as
                                  startup.h's ServedModel); copied; NULL: general.name */
    int max_running;           /* sequences batched at once */
    int step_tokens;           /* a step's tokens while a sequence is decoding (at most the
                                  context's chunk, which bounds the other steps) */
    int step_ms;               /* and no more than fit this long at the measured speed; 0: off */
    int lookup;                /* prompt lookup (GenParams.lookup): tokens drafted a decode
                                  step at most; 0: off */
    struct WorkerStats *stats; /* shared counters, or NULL */
    /* chunk KV reuse (CPU workers): 1 = a prompt's documents are blended from stored chunk
     * KV (docs/kv-reuse.md), recomputing this share of their tokens; the worker's chunk store
     * holds at most kv_reuse_bytes */
    int kv_reuse;
    double kv_reuse_recompute;
    int kv_reuse_full;          /* the best-ranked chunks of a prompt computed in full */
    size_t kv_reuse_bytes;
    /* and the copies of stored chunks are kept as records in this document store (in-process
     * workers; NULL: memory only), at most kv_store_bytes of them, named with kv_identity
     * (chunkkv_identity of the model, the engine's KV type and its arithmetic: computed once
     * for all workers) */
    struct Store *kv_store;
    uint64_t kv_store_bytes;
    uint64_t kv_identity;
    int heartbeat_ms;          /* interval of heartbeats both ways */
    int liveness;              /* silent intervals after which the broker is presumed dead */
    struct EngineOpts engine;  /* n_ctx, chunk (the step's token budget), kv type, memory
                                  budget, threads */
    int index;                 /* for log lines */
    /* CurveZMQ toward the broker (Z85 keys, copied); curve_server NULL: plain */
    const char *curve_server, *curve_public, *curve_secret;
};

struct Worker;
struct Store;

/* Opens the engine context (ENGINE_EBUDGET and the figures in err when it would not fit the
 * budget) and starts the worker's threads, which connect and announce READY. zctx is the
 * ZeroMQ context (shared with the broker for inproc://). The Model must outlive the worker.
 * Returns 0 or a negative status with err. */
int worker_start(void *zctx, const struct Model *m, const struct WorkerOpts *o,
                 struct Worker **out, char *err, size_t errlen);

/* Cancels a running job, tells the broker it leaves, joins the threads and frees the engine.
 * NULL or *w == NULL is a no-op; *w is set to NULL. */
void worker_stop(struct Worker **w);

/* Bytes of the worker's KV cache (for metrics). */
size_t worker_kv_bytes(const struct Worker *w);

#endif
