/* The document store's chunk KV records, for a worker's blends (docs/kv-reuse.md): the
 * records of a prompt's stored chunks read before its blend, and the copies the blend made
 * written after it, with the uses of the records read since the last write. */
#include "daemon/worker_internal.h"

#include <stdlib.h>

#include "daemon/log.h"
#include "retriever/status.h"
#include "retriever/store.h"

/* Before a blend, each stored chunk of the prompt whose copy the chunk store lacks is looked
 * up among the records; after it, the copies it made are written as records, in one durable
 * transaction that also renews the use of the records read since the last write (a blend that
 * made no copy writes nothing: its uses wait for the next write, or for KV_TOUCH_BATCH of
 * them; a use lost in a crash only ages a record). A record that does not match (another
 * frame, tokens or encoding) or cannot be read is passed over: the blend makes the copy. */

enum { KV_TOUCH_BATCH = 256 };

/* What span i's copy is made after: the frame whose hash is `frame`, then the span's lead. */
static uint64_t span_after(const struct WireJob *job, uint64_t frame, size_t i)
{
    const uint32_t *l = job->doc_leads;
    if (!l)
        return frame;
    return chunkkv_after(frame, job->lead_tokens + l[2 * i], (int)(l[2 * i + 1] - l[2 * i]));
}

/* The record name of span i of the job made after what `after` names (span_after), or 0 when
 * it is not a stored chunk. */
static int span_ref(const struct Worker *w, const struct WireJob *job, const int32_t *hist,
                    uint64_t after, size_t i, struct StoreKvRef *ref)
{
    const uint32_t *r = job->chunk_refs;
    if (!w->o.kv_store || !r || r[2 * i] == 0 ||
        job->doc_spans[2 * i + 1] == job->doc_spans[2 * i])
        return 0;
    const int32_t *t = hist + job->doc_spans[2 * i];
    int n = (int)(job->doc_spans[2 * i + 1] - job->doc_spans[2 * i]);
    ref->coll = r[2 * i];
    ref->chunk = r[2 * i + 1];
    ref->key = w->o.kv_identity ^ chunkkv_key(after, t, n);
    return 1;
}

/* Brings the records of the job's stored chunks into the chunk store; to_write[i] = 1 for those
 * that have none (their copies, once the blend made them, are written). */
void records_load(struct Worker *w, const struct WireJob *job, const int32_t *hist,
                  uint64_t frame, unsigned char *to_write)
{
    struct StoreReader *rd = NULL;
    char err[256];
    struct WorkerStats *st = w->o.stats;
    for (size_t i = 0; i < job->n_spans; i++) {
        struct StoreKvRef ref;
        to_write[i] = 0;
        uint64_t after = span_after(job, frame, i);
        if (!span_ref(w, job, hist, after, i, &ref))
            continue;
        const int32_t *t = hist + job->doc_spans[2 * i];
        int n = (int)(job->doc_spans[2 * i + 1] - job->doc_spans[2 * i]);
        struct ChunkKvSpans full = { .ranks = job->doc_ranks, .n_full = w->o.kv_reuse_full };
        if (chunkkv_has(w->ckv, after, t, n) || chunkkv_span_full(&full, (int)i))
            continue;
        if (!rd && store_read_begin(w->o.kv_store, &rd, err, sizeof err)) {
            dlog(LL_WARN, "msg=\"cannot read chunk KV records\" worker=%d error=\"%s\"",
                 w->o.index, err);
            if (st) atomic_fetch_add(&st->kv_store_errors, 1);
            return;
        }
        const void *data;
        size_t len;
        int rc = store_kv_get(rd, &ref, &data, &len, err, sizeof err);
        to_write[i] = 1;
        if (rc == RET_ENOTFOUND)
            continue;
        if (rc == RET_OK &&
            chunkkv_insert(w->ckv, w->e, after, t, n, data, len, err, sizeof err) == ENGINE_OK) {
            to_write[i] = 0;
            if (st) atomic_fetch_add(&st->kv_loaded, 1);
            continue;
        }
        dlog(LL_WARN, "msg=\"a chunk KV record was passed over\" worker=%d chunk=%u "
             "error=\"%s\"", w->o.index, ref.chunk, err);
        if (st) atomic_fetch_add(&st->kv_store_errors, 1);
    }
    store_read_end(&rd);
}

/* Keeps the use of a record for the next write; 0, or -1 out of memory (the use is lost). */
static int touch_later(struct Worker *w, const struct StoreKvRef *ref)
{
    if (w->n_kv_touch == w->cap_kv_touch) {
        size_t cap = w->cap_kv_touch ? 2 * w->cap_kv_touch : 64;
        struct StoreKvRef *v = realloc(w->kv_touch, cap * sizeof *v);
        if (!v) return -1;
        w->kv_touch = v;
        w->cap_kv_touch = cap;
    }
    w->kv_touch[w->n_kv_touch++] = *ref;
    return 0;
}

/* Writes the records in puts[0..n_put) with the uses kept so far, in one transaction (none
 * when there is nothing to write). */
void records_flush(struct Worker *w, const struct StoreKvPut *puts, size_t n_put)
{
    struct WorkerStats *st = w->o.stats;
    struct StoreKvReport rep;
    char err[256];
    if (!w->o.kv_store || (!n_put && !w->n_kv_touch))
        return;
    if (store_kv_write(w->o.kv_store, puts, n_put, w->kv_touch, w->n_kv_touch,
                       w->o.kv_store_bytes, &rep, err, sizeof err)) {
        dlog(LL_WARN, "msg=\"cannot write chunk KV records\" worker=%d error=\"%s\"",
             w->o.index, err);
        if (st) atomic_fetch_add(&st->kv_store_errors, 1);
    } else if (n_put && st) {
        atomic_fetch_add(&st->kv_written, rep.written);
    }
    w->n_kv_touch = 0;
}

/* Writes the copies made for spans marked in to_write; the uses of the others are kept for
 * the next write. */
void records_save(struct Worker *w, const struct WireJob *job, const int32_t *hist,
                  uint64_t frame, const unsigned char *to_write)
{
    size_t n_spans = job->n_spans, n_put = 0;
    struct StoreKvPut *puts = calloc(n_spans + 1, sizeof *puts);
    struct ChunkKvRecord *recs = calloc(n_spans + 1, sizeof *recs);
    struct WorkerStats *st = w->o.stats;
    if (!puts || !recs) {
        dlog(LL_WARN, "msg=\"out of memory writing chunk KV records\" worker=%d", w->o.index);
        if (st) atomic_fetch_add(&st->kv_store_errors, 1);
        free(puts);
        free(recs);
        return;
    }
    for (size_t i = 0; i < n_spans; i++) {
        struct StoreKvRef ref;
        uint64_t after = span_after(job, frame, i);
        if (!span_ref(w, job, hist, after, i, &ref))
            continue;
        const int32_t *t = hist + job->doc_spans[2 * i];
        int n = (int)(job->doc_spans[2 * i + 1] - job->doc_spans[2 * i]);
        if (!to_write[i]) {
            touch_later(w, &ref);
        } else if (chunkkv_record(w->ckv, after, t, n, &recs[n_put])) {
            puts[n_put] = (struct StoreKvPut){ ref, recs[n_put].parts, recs[n_put].lens, 3 };
            n_put++;
        }
    }
    if (n_put || w->n_kv_touch >= KV_TOUCH_BATCH)
        records_flush(w, puts, n_put);
    free(puts);
    free(recs);
}
