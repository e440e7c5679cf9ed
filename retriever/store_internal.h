/* Internals shared by store.c (environment, reads), store_write.c (puts and deletes),
 * store_search.c and store_verify.c: the handle, key layouts and record codecs. Not a public
 * header. All multi-byte integers in records are little-endian; in keys, big-endian so that
 * keys sort by number. */
#ifndef DIFFRAG_STORE_INTERNAL_H
#define DIFFRAG_STORE_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <lmdb.h>

#include "retriever/store.h"

struct Store {
    MDB_env *env;
    MDB_dbi db_meta, db_stats, db_docs, db_chunks, db_postings, db_kv, db_kvuse;
    struct StoreOptions opt;
    char *dir;
    /* Held shared by every transaction, exclusively to change the map size (LMDB requires that
     * no transaction of this process is open then). Writer-preferring, so growth is not starved. */
    pthread_rwlock_t resize_lock;
    /* store_mark_damaged (store_check.c): 0 sound, 1 being marked, 2 marked (damage is set) */
    int damaged;
    char damage[256];
    /* 1 when the store was upgraded from schema 1 or 2 (meta "unsummed"): it may hold document
     * and chunk records written without checksums. 0: every record must carry one. */
    int unsummed;
};

struct StoreReader {
    struct Store *s;
    MDB_txn *txn;
};

/* Collection record (value in db_stats), 56 bytes. */
struct CollRecord {
    uint32_t id, analyzer_flags, chunk_tokens, chunk_overlap, index_flags, next_chunk_id;
    uint64_t n_docs, n_chunks, total_terms, text_bytes;
};
#define COLL_RECORD_SIZE 56

/* Doc record (value in db_docs): the header (24 bytes: u32 first chunk, u32 chunk count, u32
 * title length, u32 meta length, u64 text length), title, meta, text, then, when the title
 * length's top bit (DOC_SUMMED) is set, as in every record schema 3 writes, a u64 checksum:
 * doc_sum of the record's key and of every byte before it (store_sum.c). The meta length's
 * top bit (DOC_STRUCTURED, schema 5) says the document's chunks were made at its structure
 * (headings, pages); a document stored before is re-chunked when it is ingested again, even
 * unchanged. */
struct DocHeader {
    uint32_t first_chunk, n_chunks, title_len, meta_len;
    uint64_t text_len;
    int summed;      /* the record ends with its checksum */
    int structured;  /* its chunks follow its headings and pages */
    uint64_t sum;
};
#define DOC_HEADER_SIZE 24
#define DOC_SUM_SIZE 8
#define DOC_SUMMED 0x80000000u
#define DOC_STRUCTURED 0x80000000u   /* in the meta length */

/* Chunk record (value in db_chunks), 32 bytes followed by the doc id: u32 index in the
 * document, u32 length in terms, u32 tokens, u32 checksum (chunk_sum; 0 in records written
 * before schema 3), u64 byte start, u64 byte end. When the tokens field's top bit
 * (CHUNK_HEADED, schema 4) is set, the 32 bytes are followed by a u16 length and the chunk's
 * heading path (chunk_heading_path, never empty), then the doc id; records without it have no
 * heading path. When the tokens field's next bit (CHUNK_PAGED, schema 5) is set, the pages the
 * chunk starts and ends on (u32 first, u32 last; 1 <= first <= last) follow the heading path
 * (or the 32 bytes); records without it have no pages. */
struct ChunkRecord {
    uint32_t chunk, n_terms, n_tokens, sum;
    uint64_t byte_start, byte_end;
    const char *heading; size_t heading_len;   /* borrowing the record; 0: none */
    uint32_t page_first, page_last;            /* 0, 0: none */
};
#define CHUNK_RECORD_SIZE 32
#define CHUNK_SUM_OFFSET 12
#define CHUNK_HEADED 0x80000000u
#define CHUNK_HEADING_LEN_SIZE 2
#define CHUNK_PAGED 0x40000000u
#define CHUNK_PAGES_SIZE 8
/* The largest chunk record */
#define CHUNK_RECORD_MAX (CHUNK_RECORD_SIZE + CHUNK_HEADING_LEN_SIZE + CHUNK_MAX_PATH_BYTES + \
                          CHUNK_PAGES_SIZE + INDEX_MAX_ID_BYTES)

/* Term header (value of a postings key without a block suffix). */
struct TermHeader { uint32_t df, max_tf, min_len; };
#define TERM_HEADER_SIZE 12

/* Chunk ids stay below this, so BM25_END (UINT32_MAX) never names a chunk. */
#define BM25_CHUNK_LIMIT 0xFFFFFFFEu

#define KEY_MAX (4 + INDEX_MAX_ID_BYTES + 8)

static inline void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static inline uint32_t get_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline void put_le32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static inline void put_le64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static inline uint32_t get_le32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static inline uint64_t get_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

void coll_record_encode(const struct CollRecord *c, uint8_t *out); /* COLL_RECORD_SIZE bytes */
int coll_record_decode(const MDB_val *v, struct CollRecord *c);     /* RET_OK / RET_ECORRUPT */
void coll_record_options(const struct CollRecord *c, struct IndexOptions *o);

/* Parse a doc record; pointers borrow v. RET_OK or RET_ECORRUPT (sizes that do not add up). The
 * checksum is not checked: doc_record_check does that. */
int doc_record_decode(const MDB_val *v, struct DocHeader *h, const char **title, const void **meta,
                      const char **text);

/* ---- checksums (store_sum.c) ---- */

/* The checksum of a doc record under key k: its first len bytes (all but the checksum). */
uint64_t doc_sum(const MDB_val *k, const void *rec, size_t len);
/* The checksum of a chunk record: its bytes rec[0..rec_len) (the checksum field read as 0), its
 * document's title and the chunk's text. Never 0 (0 marks a record written without one). */
uint32_t chunk_sum(const void *rec, size_t rec_len, const char *title, size_t title_len,
                   const char *text, size_t text_len);
/* A decoded doc record (k, v, h as doc_record_decode gave them) against its checksum; one
 * written without a checksum, which only a store upgraded from schema 2 may hold, must have a
 * UTF-8 title and text. RET_OK, or RET_ECORRUPT with a message naming the document and the
 * collection (coll) and saying what to do. */
int doc_record_check(const struct Store *s, const char *coll, const MDB_val *k, const MDB_val *v,
                     const struct DocHeader *h, char *err, size_t errlen);
/* The same for a chunk record v (decoded into cr) of document doc_id, whose title and whole
 * text are given. */
int chunk_record_check(const struct Store *s, const char *coll, uint32_t chunk_id,
                       const MDB_val *v, const struct ChunkRecord *cr, const char *doc_id,
                       size_t doc_id_len, const char *title, size_t title_len, const char *text,
                       char *err, size_t errlen);
int chunk_record_decode(const MDB_val *v, struct ChunkRecord *c, const char **doc_id, size_t *doc_id_len);
int term_header_decode(const MDB_val *v, struct TermHeader *h);

/* Key builders; return the key length. `out` must hold KEY_MAX bytes (or 4 + term + 5). */
size_t key_doc(uint8_t *out, uint32_t coll, const char *id, size_t len);
size_t key_chunk(uint8_t *out, uint32_t coll, uint32_t chunk_id);
size_t key_term(uint8_t *out, uint32_t coll, const char *term, size_t len);          /* header */
size_t key_block(uint8_t *out, uint32_t coll, const char *term, size_t len, uint32_t base);

/* Chunk KV records (store_kv.c): key coll (BE) | chunk (BE) | key (BE u64); record = u32
 * magic, u32 0, u64 hash of the payload, payload; use entry = u64 tick, u64 record bytes. */
#define KV_KEY_SIZE 16
#define KV_HEADER_SIZE 16
#define KV_MAGIC 0x31564b44u      /* "DKV1" */
size_t kv_key(uint8_t *out, uint32_t coll, uint32_t chunk, uint64_t key);
/* RET_OK with the payload (borrowing v), or RET_ECORRUPT (header, size or checksum). */
int kv_record_check(const MDB_val *v, const void **payload, size_t *len);
/* Delete the KV records of chunks [first, end) of collection coll, in txn. 0 or an LMDB
 * error. */
int store_kv_drop(struct Store *s, MDB_txn *txn, uint32_t coll, uint32_t first, uint32_t end);

/* Look up a collection record in txn: RET_OK, RET_ENOTFOUND (message "unknown collection"),
 * RET_ECORRUPT, RET_EIO. */
int store_coll_get(struct Store *s, MDB_txn *txn, const char *name, struct CollRecord *c,
                   char *err, size_t errlen);

/* A document chunked and analysed ahead of its write transaction (store_prep.c). */
struct PreTerm { uint32_t off, len, tf; };     /* term bytes at arena + off */
struct PreDoc {
    struct ChunkSpan *spans; size_t n_spans;
    uint32_t *term_first;   /* n_spans + 1: chunk j's terms are terms[term_first[j] .. term_first[j + 1]) */
    uint32_t *chunk_len;    /* chunk j's length in terms */
    struct PreTerm *terms; size_t n_terms, cap_terms;
    char *arena; size_t arena_len, arena_cap;
};
/* Prepare docs[0..n) into pre[0..n) (zeroed by the caller), with worker threads when the batch
 * is large. tc must be safe to call from several threads. On failure everything is freed. */
int store_prep_docs(const struct StoreDoc *docs, size_t n, const struct IndexOptions *o,
                    const struct TokenCounter *tc, struct PreDoc *pre, char *err, size_t errlen);
void store_prep_free(struct PreDoc *pre, size_t n);

/* Map an LMDB error to a status and message. */
int store_mdb_fail(char *err, size_t errlen, int mdb_rc, const char *what);

/* Begin a transaction under the resize lock (shared); handles MDB_MAP_RESIZED. On success the
 * caller must end it with store_txn_end (commit or abort), which releases the lock. */
int store_txn_begin(struct Store *s, unsigned flags, MDB_txn **txn, char *err, size_t errlen);
/* Commit; returns RET_OK, a RET_E* status (RET_EFULL when the disk is full), or MDB_MAP_FULL
 * untouched (writers retry). */
int store_txn_commit(struct Store *s, MDB_txn *txn, char *err, size_t errlen);
void store_txn_abort(struct Store *s, MDB_txn *txn);
/* Grow the map (at least doubling). RET_OK, RET_EFULL at the ceiling, RET_ELIMIT while this
 * thread holds a snapshot, RET_EIO. */
int store_grow(struct Store *s, char *err, size_t errlen);

#endif
