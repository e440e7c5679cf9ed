/* diffrag-store's parts: its parsed arguments, and the reading subcommands of
 * tools/store_read.c (tools/diffrag_store.c parses, ingests, deletes, drops and verifies). */
#ifndef DIFFRAG_STORE_TOOL_H
#define DIFFRAG_STORE_TOOL_H

#include <stddef.h>

#include "retriever/index.h"
#include "retriever/store.h"

struct StoreArgs {
    const char *data_dir, *collection, *model;
    int collection_given;
    int approx_tokens, json, ack, exhaustive, sync;
    struct IndexOptions iopt;
    size_t k, batch_docs, batch_bytes, limit, map_mb;
    double k1, b;
    const char *after;
    const char **docs; /* --doc filters */
    size_t n_docs_filter;
    const char **pos;  /* the subcommand, then its arguments */
    size_t n_pos;
};

/* Each returns the exit status: 0, 1 (the store failed; the message is on stderr) or 2 (a
 * usage error). */
int tool_get(struct Store *s, const struct StoreArgs *a);
/* export: every document with its text; otherwise one page of ids (--json: with titles). */
int tool_list(struct Store *s, const struct StoreArgs *a, int export);
int tool_stats(struct Store *s, const struct StoreArgs *a);
int tool_collections(struct Store *s);
int tool_search(struct Store *s, const struct StoreArgs *a);
int tool_search_batch(struct Store *s, const struct StoreArgs *a);

/* Seconds on the monotonic clock. */
double tool_now(void);

#endif
