/* The document store: one LMDB environment in a data directory with named databases
 *
 *   meta      "schema" -> u32 schema version, "next_coll" -> u32 next collection id
 *   stats     collection name -> collection record (id, options, statistics for BM25)
 *   docs      coll id (u32 BE) | doc id -> doc record (chunk range, title, metadata, text,
 *             checksum)
 *   chunks    coll id | chunk id (u32 BE) -> chunk record (index in doc, byte offsets,
 *             length in terms, tokens, checksum, heading path, pages, doc id)
 *   postings  coll id | term | 0x00 -> term header (df, max tf, min length)
 *             coll id | term | 0x00 | first chunk id (u32 BE) -> posting block (postings.h)
 *   kv        coll id | chunk id | key (u64 BE) -> a chunk's KV record (checksummed payload)
 *   kvuse     the same key -> u64 use tick, u64 record bytes (least recently used goes first)
 *   meta      "kv_bytes" -> u64 the KV records' total bytes, "kv_tick" -> u64 the last tick,
 *             "unsummed" -> u32 1 in a store upgraded from schema 1 or 2 (records without
 *             checksums may be there)
 *
 * Chunk ids are allocated in increasing order and never reused, so new postings always append.
 * A write (a batch of puts or deletes) is one LMDB transaction: it is acknowledged (the call
 * returns RET_OK) only after the commit reached the disk, and a reader sees all of it or none.
 * Readers never block the writer. When the map fills, the store grows it and retries.
 *
 * Thread safety: a Store may be shared by threads. A StoreReader must be ended by the thread
 * that began it; a thread may hold several. Writes from several threads serialise on LMDB's
 * writer lock. Growing the map waits until other threads' snapshots end (LMDB requires that no
 * transaction is open then), and a write from a thread that holds a snapshot of the same store
 * gets RET_ELIMIT instead of growing. */
#ifndef DIFFRAG_STORE_H
#define DIFFRAG_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "retriever/index.h"
#include "text/tokcount.h"

/* Version 2 added the chunk KV databases, version 3 checksums in document and chunk records,
 * version 4 heading paths in chunk records, version 5 pages in chunk records. A version 1 to 4
 * store is upgraded in place when opened: the KV databases are created empty where missing,
 * and its records stay as they are: without pages, before version 4 without heading paths, and
 * from versions 1 and 2 without checksums (meta "unsummed" says it may hold such records;
 * their text is checked as UTF-8 instead), while every record written from then on carries one
 * (and its chunk's heading path and pages, when it has them). */
#define STORE_SCHEMA_VERSION 5

struct StoreOptions {
    size_t map_size;        /* initial map size in bytes (default 64 MiB); grows on demand */
    size_t max_map_size;    /* ceiling for growth (default 1 TiB) */
    size_t max_doc_bytes;   /* largest document text accepted (default 64 MiB) */
    int no_sync;            /* 1 = MDB_NOSYNC: commits are not durable (benchmarks only) */
};
void store_options_default(struct StoreOptions *o);

struct Store;
struct StoreReader;

/* Open (creating the directory and an empty store if needed) the store in `dir`.
 * Returns RET_OK; RET_EVERSION when the store has another schema version (the message names
 * both versions; the store is left untouched); RET_EIO; RET_ECORRUPT; RET_ENOMEM. */
int store_open(const char *dir, const struct StoreOptions *opt, struct Store **out, char *err,
               size_t errlen);
void store_close(struct Store **s);

/* Current map size in bytes (it grows as the store fills). */
size_t store_map_size(struct Store *s);

/* Insert or replace documents in `collection` (created on first ingest with `create_opts`, or
 * the defaults when NULL; an existing collection keeps its own options). A replaced
 * document's chunks and postings go in the same transaction; a document stored already exactly
 * as given is left as it is (store_put_docs_report below). The whole batch is validated
 * first (UTF-8, sizes, empty text, duplicate ids): any bad document rejects the batch and
 * leaves the store unchanged. `tc` counts tokens for chunking (borrowed for the call).
 * Returns RET_OK (committed durably), RET_EINPUT, RET_ELIMIT, RET_ETOKEN, RET_EFULL (the disk
 * or the map at its ceiling is full; the message says which and what to do), RET_ECORRUPT,
 * RET_EIO, RET_ENOMEM. */
int store_put_docs(struct Store *s, const char *collection, const struct StoreDoc *docs, size_t n,
                   const struct IndexOptions *create_opts, const struct TokenCounter *tc,
                   char *err, size_t errlen);

/* What a put did with its documents: stored new (no document had the id), replaced one that
 * differed, or left one as it was. A document is unchanged when the stored one under its id has
 * the same text, title and metadata, byte for byte, and passes its checksum; it is not written
 * again (no chunking, no index change; a batch of only such documents commits nothing). A
 * changed title or metadata with the same text is a change: the document is replaced. A record
 * from before checksums (schema 1 or 2) is always replaced. */
struct StorePutReport { size_t added, changed, unchanged; };

/* store_put_docs, and *rep (optional) says what it did (zeros unless RET_OK). */
int store_put_docs_report(struct Store *s, const char *collection, const struct StoreDoc *docs,
                          size_t n, const struct IndexOptions *create_opts,
                          const struct TokenCounter *tc, struct StorePutReport *rep, char *err,
                          size_t errlen);

/* Delete documents by id in one transaction; ids that are not present are skipped.
 * *n_deleted (optional) receives how many existed. RET_OK, RET_ENOTFOUND (unknown
 * collection), RET_EINPUT, RET_EFULL, RET_ECORRUPT, RET_EIO, RET_ENOMEM. */
int store_delete_docs(struct Store *s, const char *collection, const char *const *ids,
                      const size_t *id_lens, size_t n, size_t *n_deleted, char *err, size_t errlen);

/* Remove the collection whole, in one transaction: its record, documents, chunks and
 * postings. Its id is not reused: ingesting into the same name later creates a fresh,
 * empty collection. *n_docs (optional) receives how many documents it held. RET_OK
 * (committed durably), RET_ENOTFOUND ("unknown collection"), RET_EINPUT (invalid name),
 * RET_ELIMIT (too large for one transaction), RET_EFULL (the disk, or the map at its ceiling),
 * RET_ECORRUPT, RET_EIO, RET_ENOMEM. */
int store_drop_collection(struct Store *s, const char *collection, uint64_t *n_docs, char *err,
                          size_t errlen);

/* Read snapshots. Everything a reader returns is borrowed LMDB memory, valid until
 * store_read_end. A reader holds its snapshot; keep it short so the file can reuse pages. */
int store_read_begin(struct Store *s, struct StoreReader **out, char *err, size_t errlen);
void store_read_end(struct StoreReader **r);

struct StoreCollStats {
    uint32_t id;
    struct IndexOptions options;
    uint64_t n_docs, n_chunks, total_terms, text_bytes;
    uint32_t next_chunk_id;
    double avg_chunk_terms;
};

/* RET_OK or RET_ENOTFOUND ("unknown collection"), RET_ECORRUPT, RET_EIO. */
int store_collection_stats(struct StoreReader *r, const char *collection, struct StoreCollStats *out,
                           char *err, size_t errlen);

/* Calls fn for each collection name (borrowed, NUL-free, not NUL-terminated) in byte order.
 * A non-zero return from fn stops the walk and is returned. */
int store_list_collections(struct StoreReader *r,
                           int (*fn)(void *ctx, const char *name, size_t len), void *ctx,
                           char *err, size_t errlen);

struct StoreDocView {
    const char *id; size_t id_len;
    const char *title; size_t title_len;
    const void *meta; size_t meta_len;
    const char *text; size_t text_len;
    uint32_t first_chunk, n_chunks;      /* chunk ids first_chunk .. first_chunk+n_chunks-1 */
};

/* The document `id` of a collection. out->title, meta and text borrow the reader's snapshot;
 * out->id is the caller's `id` (the stored key equals it byte for byte), valid as long as that
 * is. The record is checked against its checksum first (one written before checksums: its
 * title and text as UTF-8), so the text handed out is what was stored; this reads it whole.
 * RET_OK, RET_ENOTFOUND (collection or document), RET_ECORRUPT (a malformed or damaged
 * record: the message names the document and the verify command), RET_EIO. */
int store_get_doc(struct StoreReader *r, const char *collection, const char *id, size_t id_len,
                  struct StoreDocView *out, char *err, size_t errlen);

/* Page through documents in id byte order: up to cap documents whose id sorts after
 * `after` (NULL or after_len 0 = from the start). *n receives the count; fewer than cap means
 * the end was reached. Each is checked as store_get_doc checks it (so a listing reads the
 * documents whole); the first damaged one fails the page. RET_OK, RET_ENOTFOUND, RET_ECORRUPT,
 * RET_EIO. */
int store_list_docs(struct StoreReader *r, const char *collection, const char *after,
                    size_t after_len, struct StoreDocView *out, size_t cap, size_t *n,
                    char *err, size_t errlen);

struct StoreChunkView {
    uint32_t chunk_id, chunk;            /* collection-wide id, index within the document */
    uint64_t byte_start, byte_end;
    uint32_t n_terms, n_tokens;
    const char *doc_id; size_t doc_id_len;
    const char *heading; size_t heading_len; /* its heading path (0: none) */
    uint32_t page_first, page_last;          /* the pages it starts and ends on (0: none) */
};
int store_get_chunk(struct StoreReader *r, const char *collection, uint32_t chunk_id,
                    struct StoreChunkView *out, char *err, size_t errlen);

/* BM25 top-k over the collection (query analysed with the collection's analyzer). hits holds
 * cap entries (k is clamped to cap); *n_hits receives the count, best first. Hits borrow the
 * reader's snapshot. Each hit's chunk is checked against its checksum (its record, title and
 * text; not the rest of the document). RET_OK, RET_ENOTFOUND (collection; unknown filter ids
 * simply match nothing), RET_ECORRUPT (a damaged hit: the message names its document),
 * RET_EIO, RET_ENOMEM. `stats` (optional) reports the work done. */
struct Bm25Stats;
int store_search(struct StoreReader *r, const char *collection, const char *query, size_t qlen,
                 const struct SearchOptions *o, struct SearchHit *hits, size_t cap, size_t *n_hits,
                 struct Bm25Stats *stats, char *err, size_t errlen);

struct StoreVerifyReport {
    uint64_t collections, docs, chunks, postings, terms;
    uint64_t kv_records, kv_bytes;  /* chunk KV records checked, and their bytes */
    uint64_t docs_unsummed;     /* documents written before checksums (schema 1 or 2): their
                                 * text was checked as UTF-8 and against their chunks only */
    uint64_t problems;          /* 0 when the store is consistent */
    char first_problem[256];
};

/* Recompute every collection's statistics from its documents and chunks and check them
 * against the stored ones; check every document and chunk record against its checksum;
 * re-analyse every chunk and check the postings hold exactly its
 * terms with their frequencies and length; check every posting points at a live chunk, every
 * chunk at a live document, every block decodes; every chunk KV record belongs to a live chunk,
 * has its use entry and checksum, and (all collections) their sizes add up to the total.
 * `collection` NULL checks all.
 * RET_OK (consistent), RET_ECORRUPT (report says what), RET_ENOTFOUND, RET_EIO, RET_ENOMEM. */
int store_verify(struct Store *s, const char *collection, struct StoreVerifyReport *rep,
                 char *err, size_t errlen);

/* ---- chunk KV (store_kv.c; docs/kv-reuse.md) ----
 * A stored chunk's KV, kept beside it: an opaque payload (model/chunkkv.h's record) under
 * (collection id, chunk id, key), where key names the model, KV format, RoPE settings and
 * the prompt frame the KV was computed after (the caller's hash). A record is written only
 * while its chunk exists (checked in the writing transaction) and is deleted with it: a
 * document's delete or replace, or the collection's drop, takes its chunks' records in the
 * same transaction. The records' total is kept under a budget, least recently used first. */
struct StoreKvRef { uint32_t coll, chunk; uint64_t key; };

/* The record of ref: its payload, borrowing the reader's snapshot. RET_OK, RET_ENOTFOUND,
 * RET_ECORRUPT (header or checksum wrong), RET_EIO. */
int store_kv_get(struct StoreReader *r, const struct StoreKvRef *ref, const void **data,
                 size_t *len, char *err, size_t errlen);

struct StoreKvPut {
    struct StoreKvRef ref;
    const void *const *parts;       /* the payload, in pieces laid end to end */
    const size_t *lens;
    int n_parts;
};
struct StoreKvReport {
    size_t written, skipped;        /* records written; skipped: chunk gone, or over budget */
    size_t touched, evicted;        /* use ticks renewed; records evicted for the budget */
    uint64_t bytes, records;        /* the store's KV total afterwards */
};

/* One durable transaction: puts[0..n_puts) written (replacing a record under the same ref)
 * where their chunks exist, the use ticks of touch[0..n_touch) renewed where they exist, then
 * least recently used records evicted until the total is at most `budget` bytes. rep is
 * optional. RET_OK, RET_EFULL (the disk, or the map at its ceiling), RET_ECORRUPT (damaged
 * store), RET_EIO, RET_ENOMEM. */
int store_kv_write(struct Store *s, const struct StoreKvPut *puts, size_t n_puts,
                   const struct StoreKvRef *touch, size_t n_touch, uint64_t budget,
                   struct StoreKvReport *rep, char *err, size_t errlen);

/* The KV records' total bytes and count. RET_OK, RET_EIO. */
int store_kv_usage(struct StoreReader *r, uint64_t *bytes, uint64_t *records, char *err,
                   size_t errlen);

/* Compacting copy of the environment into directory `dest` (created; must be empty).
 * RET_OK, RET_EIO. */
int store_backup(struct Store *s, const char *dest, char *err, size_t errlen);

/* ---- damaged stores (store_check.c; docs/retriever.md#damaged-stores) ---- */

/* The data file of the store in `dir` against LMDB's meta pages: the newer valid meta page's
 * last used page, plus one, times the page size is the least the file must hold. LMDB maps the
 * pages the meta pages name, and reading one the file no longer holds is a SIGBUS, so
 * store_open calls this before LMDB reads anything. RET_OK (also when there is no data file
 * yet, or it is empty), RET_ECORRUPT (a short file: the message gives both sizes; or a meta
 * page that is not LMDB's), RET_EIO. */
int store_check_file(const char *dir, char *err, size_t errlen);

/* A bounded check for start-up: the collection records, then, in each collection, chunks at
 * evenly spread ids against their documents, documents against their chunks, and postings
 * (headers, blocks) against chunks, a short run of records after each of many seeks (the
 * documents' and the terms' seek keys taken from the chunks sampled), reading at most about
 * `budget` records in all (0: 100,000) and for at most about half a second. A small store is
 * read whole. LMDB errors met on the way
 * (MDB_CORRUPTED, MDB_PAGE_NOTFOUND) are findings. rep->docs, chunks and postings count the
 * records read. RET_OK, RET_ECORRUPT (rep says what), RET_EIO, RET_ENOMEM. */
int store_check_sample(struct Store *s, size_t budget, struct StoreVerifyReport *rep, char *err,
                       size_t errlen);

enum StoreCheckDepth { STORE_CHECK_SAMPLE, STORE_CHECK_FULL };

/* Opens the store in `dir` (with `opt`, NULL: the defaults) in a child process and checks it
 * there: store_check_sample, or store_verify of `collection` (NULL: all) for
 * STORE_CHECK_FULL. LMDB aborts on some damaged pages (an assertion) and a damaged store can
 * fault the reader; either ends only the child, and its death is a finding ("the store's
 * B-tree is damaged: LMDB aborted while reading it (signal 6)"). timeout_s > 0: a child still
 * running then is killed, and that is a finding too. Call it with no transaction of this
 * process open on the store. Returns what the check returned (RET_OK, RET_ECORRUPT with rep,
 * RET_ENOTFOUND, RET_EVERSION, RET_EIO, RET_ENOMEM), RET_ECORRUPT for a child's death, or
 * RET_EIO when no child could be started. */
int store_check_isolated(const char *dir, const struct StoreOptions *opt,
                         enum StoreCheckDepth depth, const char *collection, double timeout_s,
                         struct StoreVerifyReport *rep, char *err, size_t errlen);

/* Marks the store damaged (a check failed, or a read met MDB_CORRUPTED or MDB_PAGE_NOTFOUND):
 * from then on every write transaction is refused with RET_ECORRUPT and a message naming
 * `why` (copied; the first one kept) and the verify command. Reads go on. Thread-safe.
 * Returns 1 for the call that marked it, 0 when it was marked already. */
int store_mark_damaged(struct Store *s, const char *why);
/* 1 when the store is marked damaged (why, optional, receives the first reason), else 0. */
int store_damaged(struct Store *s, char *why, size_t cap);

#endif
