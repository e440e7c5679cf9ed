/* Types and helpers shared by the persistent store and the in-memory index of inline
 * documents: documents as given by clients, index options, search options and hits, input
 * validation, and the analysis of one chunk into its term frequencies. */
#ifndef DIFFRAG_INDEX_H
#define DIFFRAG_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "retriever/chunker.h"
#include "retriever/termbag.h"
#include "retriever/text.h"

#define INDEX_MAX_ID_BYTES 256
#define INDEX_MAX_TITLE_BYTES 4096
#define INDEX_MAX_META_BYTES (1u << 20)
#define INDEX_MAX_COLLECTION_BYTES 128
#define INDEX_DEFAULT_MAX_DOC_BYTES (64u << 20)

/* A document as a client gives it; every pointer is borrowed for the duration of the call. */
struct StoreDoc {
    const char *id; size_t id_len;          /* UTF-8, 1..INDEX_MAX_ID_BYTES, no NUL */
    const char *text; size_t text_len;      /* UTF-8, not empty or all whitespace */
    const char *title; size_t title_len;    /* optional (len 0), UTF-8 */
    const void *meta; size_t meta_len;      /* optional opaque bytes (msgpack map) */
};

enum IndexFlags { INDEX_TITLE = 1u << 0 }; /* index the title's terms with every chunk */

/* How a collection is chunked and analysed. Fixed when the collection is created (on first
 * ingest): later ingests use the collection's own options. */
struct IndexOptions {
    struct ChunkOptions chunk;
    unsigned analyzer_flags; /* enum AnalyzeFlags */
    unsigned index_flags;    /* enum IndexFlags */
};

/* Defaults: 256-token chunks, 32-token overlap, stemming on, no stop words, titles indexed. */
void index_options_default(struct IndexOptions *o);

struct SearchOptions {
    size_t k;                       /* hits wanted */
    double k1, b;                   /* BM25 parameters */
    const char *const *doc_ids;     /* optional filter: only chunks of these documents */
    const size_t *doc_id_lens;
    size_t n_doc_ids;
    int exhaustive;                 /* score every matching chunk (no pruning); for tests */
};
void search_options_default(struct SearchOptions *o); /* k = 10, k1 = 0.9, b = 0.4 */

/* A ranked chunk. Pointers borrow the source: for the store, valid until store_read_end; for
 * an in-memory index, while the index and the documents it was built from live. */
struct SearchHit {
    double score;
    uint32_t chunk_id;     /* collection-wide chunk id */
    uint32_t chunk;        /* index of the chunk within its document */
    uint64_t byte_start, byte_end; /* the chunk's bytes in its document's text */
    const char *doc_id; size_t doc_id_len;
    const char *title; size_t title_len;
    const char *heading; size_t heading_len; /* the chunk's heading path (chunker.h; 0: none) */
    uint32_t page_first, page_last;    /* the pages it starts and ends on (chunker.h; 0: none) */
    const char *text; size_t text_len; /* the chunk's text */
};

/* Check one document: RET_OK or RET_EINPUT with a message naming the document (by position
 * and id) and the problem. max_doc_bytes bounds the text. */
int index_validate_doc(const struct StoreDoc *d, size_t pos, size_t max_doc_bytes, char *err,
                       size_t errlen);
/* Check a batch, including duplicate ids. RET_OK, RET_EINPUT or RET_ENOMEM. */
int index_validate_docs(const struct StoreDoc *docs, size_t n, size_t max_doc_bytes, char *err,
                        size_t errlen);
/* Check a collection name: UTF-8, 1..INDEX_MAX_COLLECTION_BYTES, no control characters. */
int index_validate_collection(const char *name, char *err, size_t errlen);
/* Check options (RET_EINPUT on an unknown flag or a bad chunk size). */
int index_validate_options(const struct IndexOptions *o, char *err, size_t errlen);

/* Terms of one chunk (with INDEX_TITLE, the title's and then its heading path's first) into
 * bag (cleared first). bag->total is the chunk's length in terms. RET_OK or RET_ENOMEM. */
int index_chunk_terms(struct Analyzer *a, unsigned index_flags, const char *title, size_t title_len,
                      const char *heading, size_t heading_len, const char *text, size_t text_len,
                      struct TermBag *bag);

/* Query terms with their multiplicity into bag (cleared first): a question's words, less its
 * interrogatives, auxiliaries and pronouns (analyzer_run_question) unless those are all it
 * has. */
int index_query_terms(struct Analyzer *a, const char *query, size_t len, struct TermBag *bag);

#endif
