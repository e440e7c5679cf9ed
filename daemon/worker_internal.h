/* The worker's insides, shared by daemon/worker.c (its threads), daemon/sched.c (the batch
 * scheduler) and daemon/sched_records.c (its chunk KV records). Not a public header. */
#ifndef DIFFRAG_WORKER_INTERNAL_H
#define DIFFRAG_WORKER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "daemon/wire.h"
#include "daemon/worker.h"
#include "model/chunkkv.h"
#include "model/generate.h"

#define WORKER_CHECK_MAX 256

struct Worker {
    void *zctx;
    const struct Model *m;
    struct Engine *e;           /* the context: the runner of the batch's sequences */
    struct Engine *seq_e[WIRE_MAX_RUNNING]; /* idle sequence contexts, made as needed */
    int n_seq_e;
    struct WorkerOpts o;
    char endpoint[512];
    char model_name[128];       /* READY's model */
    char curve_server[41], curve_public[41], curve_secret[41];   /* empty: plain */
    char pair_ep[96], ctl_ep[96];
    int generation;             /* compute threads started so far (names each PAIR endpoint) */
    void *pair_io;              /* the I/O thread's end of the PAIR */
    void *ctl;                  /* PULL: worker_stop's wake-up */
    pthread_t io_thread, compute_thread;
    int io_started, compute_started;
    size_t kv_bytes;
    int max_running;              /* jobs it takes at once */
    /* the self-check (docs/groundedness.md): its tokens, and the ids of the verdict words'
     * first tokens (n_check = 0: the vocabulary cannot tell the words apart, or the check
     * does not fit WORKER_CHECK_MAX tokens; no check runs) */
    int32_t check[WORKER_CHECK_MAX];
    int n_check;
    int32_t yes_id[4], no_id[4];
    int n_yes, n_no;
    /* chunk KV reuse: the chunk store and the sequence that makes its copies (NULL: off) */
    struct ChunkKv *ckv;
    struct Engine *ckv_helper;
    struct ChunkKvStats ckv_last;   /* the store's figures at the last update of the stats */
    /* use ticks of chunk KV records read since the last write (renewed with the next one) */
    struct StoreKvRef *kv_touch;
    size_t n_kv_touch, cap_kv_touch;
};

/* The answer tokens' signals as they are generated (struct of arrays, grown by doubling). */
struct SigBuf {
    struct WireSignals s;
    size_t cap;
    int oom;
    int quoting;              /* the job quotes: s.quote_removed is kept too */
    /* the captured residual stream (WireResult.hidden): per layer, the first answer token's
     * row, the sum of every answer token's, and the last row seen (the one that gave the
     * end-of-turn token when the model ended its turn), rows of dim */
    int hid_rows, hid_dim;
    float *hid_first;         /* (hid_rows, dim) */
    double *hid_sum;          /* (hid_rows, dim) */
    float *hid_last;          /* (hid_rows, dim) */
};

struct RunCtx {
    struct Worker *w;
    void *pair;
    uint64_t job;
    const int *cancelled;       /* a batched sequence's flag; NULL: the worker's atomic */
    int stream;
    double t0, ttft_ms;
    int got_first;
    uint32_t released;          /* answer bytes released so far */
    struct SigBuf sig;
};

void worker_sigbuf_free(struct SigBuf *b);
/* The answer's captured rows as WireResult.hidden wants them (malloc'd, *n floats), or NULL
 * (*n = 0) when none were captured, the answer has no token, or memory ran out. */
float *worker_sigbuf_hidden(const struct SigBuf *b, size_t *n);
/* The generator's callback: streams the token's text and records its signals; non-zero when
 * the request is to stop. */
int worker_on_token(void *user, const struct GenToken *t);
void worker_send_result(void *pair, const struct WireResult *r);
/* The quoted spans of an answer of text_len bytes as WireResult.quotes wants them: for each,
 * its doc span and the bytes [start, end) of that span's text (the pieces of its tokens from
 * the span's first), clipped to the answer's bytes (a stop string may have cut it); empty
 * ones are left out. Writes at most 3 * n triples' words into out; returns their count. */
size_t worker_quote_bytes(const struct Tokenizer *tok, const struct WireJob *job,
                          const struct QuoteSpan *spans, int n, size_t text_len, uint32_t *out);
void worker_send_error(void *pair, uint64_t job, const char *code, const char *msg);
/* Points context e at a job's grounding: the heads it asks to watch (the model's default set
 * when it names none) and its prompt's document positions (everything after the prompt counts
 * as generated). 0, or -1 with err. */
int worker_ground(const struct Model *m, struct Engine *e, const struct WireJob *job, char *err,
                  size_t errlen);

/* The signals measured after an answer that ended with stop or length and has a token
 * (docs/groundedness.md), each when the job asks for it: the self-check, appended to context
 * e (which holds the prompt and the answer), then context reliance, which resets e (its
 * sequence is over) and rescores the answer's first k tokens `ans` (at most r->sig.n; none on
 * a GPU context) after the prompt without its documents. Sets r->has_check/check and
 * r->has_reliance/reliance; a signal that cannot run (no room, a device error) is left out,
 * and the answer is not affected. */
void worker_after_answer(struct Worker *w, const struct WireJob *job, struct Engine *e,
                         const int32_t *ans, size_t k, struct WireResult *r);

/* The compute thread: runs the jobs that arrive on `pair` in batches until DISCONNECT
 * (every running request is then answered as cancelled) or a failure (its requests are lost
 * with it; the I/O thread answers them). */
void sched_run(struct Worker *w, void *pair);

/* ---- the document store's chunk KV records of a job's stored chunks (sched_records.c) ---- */

/* Before a blend: brings the records of the job's stored chunks (its prompt is `hist`, the
 * blend's frame hashes to `frame`) that the chunk store lacks into it; to_write[i] = 1 (for
 * each of job->n_spans spans) for those that have none, whose copies are to be written. */
void records_load(struct Worker *w, const struct WireJob *job, const int32_t *hist,
                  uint64_t frame, unsigned char *to_write);
/* After a blend (or when one ends unfinished): writes the copies made for the spans marked in
 * to_write; the uses of the others are kept for the next write. */
void records_save(struct Worker *w, const struct WireJob *job, const int32_t *hist,
                  uint64_t frame, const unsigned char *to_write);
/* Writes the chunk KV records puts[0..n_put) and the record uses kept since the last write,
 * in one transaction (none when there is nothing to write). */
struct StoreKvPut;
void records_flush(struct Worker *w, const struct StoreKvPut *puts, size_t n_put);

#endif
