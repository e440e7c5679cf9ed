/* The I/O threads: everything a request needs that could stall the socket loop, namely
 * retrieval (BM25 over a stored collection or the inline documents), context assembly, and
 * the store operations (ingest, delete, drop, get, list, collection stats): the stage the op
 * table (ops.c) names, run from stages.c. The broker hands a struct Request to an idle thread
 * over inproc and gets it back when the stage is done.
 *
 *   thread -> broker: "R" (ready, once) | the Request pointer (stage done)
 *   broker -> thread: the Request pointer (run it) | an empty frame (exit) */
#ifndef DIFFRAG_PREP_H
#define DIFFRAG_PREP_H

#include <stddef.h>

#include "daemon/request.h"
#include "retriever/store.h"
#include "text/tokcount.h"

struct PrepShared {
    struct Store *store;          /* shared by the threads (LMDB: many readers, one writer) */
    const char *data_dir;         /* the store's directory, to explain failed writes */
    struct TokenCounter tc;       /* the model's tokenizer; thread-safe */
    size_t max_doc_bytes;         /* the store's largest document text */
    const char *extract_helper;   /* diffrag-extract as configured; "": the default */
};

struct PrepPool;

/* Starts n threads that connect to `endpoint` (the broker's inproc ROUTER). sh must outlive
 * the pool. 0, or -1 with err. */
int prep_start(void *zctx, const char *endpoint, int n, const struct PrepShared *sh,
               struct PrepPool **out, char *err, size_t errlen);
/* Joins the threads (the broker has sent each an empty frame) and frees the pool. */
void prep_join(struct PrepPool **p);

/* Runs r's stage (its op table row's handler) on the calling thread: for a query, r->ctx
 * (or r->code and r->message); for store operations, r->reply/r->reply_fields (or the
 * error). An op without one is a bad_request. */
void prep_run(const struct PrepShared *sh, struct Request *r);

#endif
