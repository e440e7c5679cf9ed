/* In-memory index for documents sent inline with a question: chunked, analysed and ranked by
 * the same code as the store (chunker, analyzer, BM25 with MaxScore), without touching LMDB. */
#ifndef DIFFRAG_MEMINDEX_H
#define DIFFRAG_MEMINDEX_H

#include <stddef.h>

#include "retriever/bm25.h"
#include "retriever/index.h"
#include "text/tokcount.h"

struct MemIndex;

/* Build over docs[0..n) (validated like a store batch: bad input gives RET_EINPUT). The index
 * borrows docs and their strings: they must outlive it. opts NULL = defaults.
 * max_doc_bytes 0 = INDEX_DEFAULT_MAX_DOC_BYTES. Returns RET_OK, RET_EINPUT, RET_ETOKEN,
 * RET_ENOMEM. */
int memidx_build(const struct StoreDoc *docs, size_t n, const struct IndexOptions *opts,
                 size_t max_doc_bytes, const struct TokenCounter *tc, struct MemIndex **out,
                 char *err, size_t errlen);
void memidx_destroy(struct MemIndex **m);

size_t memidx_n_chunks(const struct MemIndex *m);

/* Same contract as store_search; hits borrow the index and the documents. Not thread-safe
 * per index (it holds an analyzer). */
int memidx_search(struct MemIndex *m, const char *query, size_t qlen, const struct SearchOptions *o,
                  struct SearchHit *hits, size_t cap, size_t *n_hits, struct Bm25Stats *stats,
                  char *err, size_t errlen);

#endif
