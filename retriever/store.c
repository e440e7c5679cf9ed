/* The LMDB environment: opening and schema check, transactions under the resize lock, map
 * growth, record codecs, and the read calls (collections, documents, chunks) and backup.
 * Writes are in store_write.c, search in store_search.c, verification in store_verify.c. */
#include "retriever/store_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <unistd.h>

#include "retriever/status.h"

void store_options_default(struct StoreOptions *o)
{
    o->map_size = (size_t)64 << 20;
    o->max_map_size = (size_t)1 << 40;
    o->max_doc_bytes = INDEX_DEFAULT_MAX_DOC_BYTES;
    o->no_sync = 0;
}

int store_mdb_fail(char *err, size_t errlen, int mdb_rc, const char *what)
{
    int st = RET_EIO;
    if (mdb_rc == MDB_CORRUPTED || mdb_rc == MDB_PAGE_NOTFOUND || mdb_rc == MDB_INVALID)
        st = RET_ECORRUPT;
    else if (mdb_rc == MDB_VERSION_MISMATCH)
        st = RET_EVERSION;
    else if (mdb_rc == ENOMEM)
        st = RET_ENOMEM;
    return ret_fail(err, errlen, st, "%s: %s", what, mdb_strerror(mdb_rc));
}

/* ---- record codecs ---- */

void coll_record_encode(const struct CollRecord *c, uint8_t *o)
{
    put_le32(o + 0, c->id);
    put_le32(o + 4, c->analyzer_flags);
    put_le32(o + 8, c->chunk_tokens);
    put_le32(o + 12, c->chunk_overlap);
    put_le32(o + 16, c->index_flags);
    put_le32(o + 20, c->next_chunk_id);
    put_le64(o + 24, c->n_docs);
    put_le64(o + 32, c->n_chunks);
    put_le64(o + 40, c->total_terms);
    put_le64(o + 48, c->text_bytes);
}

int coll_record_decode(const MDB_val *v, struct CollRecord *c)
{
    if (v->mv_size != COLL_RECORD_SIZE)
        return RET_ECORRUPT;
    const uint8_t *p = v->mv_data;
    c->id = get_le32(p + 0);
    c->analyzer_flags = get_le32(p + 4);
    c->chunk_tokens = get_le32(p + 8);
    c->chunk_overlap = get_le32(p + 12);
    c->index_flags = get_le32(p + 16);
    c->next_chunk_id = get_le32(p + 20);
    c->n_docs = get_le64(p + 24);
    c->n_chunks = get_le64(p + 32);
    c->total_terms = get_le64(p + 40);
    c->text_bytes = get_le64(p + 48);
    struct IndexOptions o;
    coll_record_options(c, &o);
    return index_validate_options(&o, NULL, 0) ? RET_ECORRUPT : RET_OK;
}

void coll_record_options(const struct CollRecord *c, struct IndexOptions *o)
{
    o->chunk.target_tokens = c->chunk_tokens;
    o->chunk.overlap_tokens = c->chunk_overlap;
    o->analyzer_flags = c->analyzer_flags;
    o->index_flags = c->index_flags;
}

int doc_record_decode(const MDB_val *v, struct DocHeader *h, const char **title, const void **meta,
                      const char **text)
{
    if (v->mv_size < DOC_HEADER_SIZE)
        return RET_ECORRUPT;
    const uint8_t *p = v->mv_data;
    h->first_chunk = get_le32(p);
    h->n_chunks = get_le32(p + 4);
    h->title_len = get_le32(p + 8);
    h->meta_len = get_le32(p + 12);
    h->text_len = get_le64(p + 16);
    h->summed = (h->title_len & DOC_SUMMED) != 0;
    h->title_len &= ~DOC_SUMMED;
    h->structured = (h->meta_len & DOC_STRUCTURED) != 0;
    h->meta_len &= ~DOC_STRUCTURED;
    uint64_t size = (uint64_t)DOC_HEADER_SIZE + h->title_len + h->meta_len + h->text_len +
                    (h->summed ? DOC_SUM_SIZE : 0);
    if (h->text_len > v->mv_size || size != v->mv_size)
        return RET_ECORRUPT;
    if ((uint64_t)h->first_chunk + h->n_chunks > UINT32_MAX)
        return RET_ECORRUPT;
    h->sum = h->summed ? get_le64(p + v->mv_size - DOC_SUM_SIZE) : 0;
    *title = (const char *)p + DOC_HEADER_SIZE;
    *meta = p + DOC_HEADER_SIZE + h->title_len;
    *text = (const char *)p + DOC_HEADER_SIZE + h->title_len + h->meta_len;
    return RET_OK;
}

int chunk_record_decode(const MDB_val *v, struct ChunkRecord *c, const char **doc_id, size_t *doc_id_len)
{
    if (v->mv_size <= CHUNK_RECORD_SIZE || v->mv_size > CHUNK_RECORD_MAX)
        return RET_ECORRUPT;
    const uint8_t *p = v->mv_data;
    c->chunk = get_le32(p);
    c->n_terms = get_le32(p + 4);
    c->n_tokens = get_le32(p + 8);
    c->sum = get_le32(p + CHUNK_SUM_OFFSET);
    c->byte_start = get_le64(p + 16);
    c->byte_end = get_le64(p + 24);
    if (c->byte_start > c->byte_end)
        return RET_ECORRUPT;
    size_t at = CHUNK_RECORD_SIZE;
    c->heading = NULL;
    c->heading_len = 0;
    c->page_first = c->page_last = 0;
    int headed = (c->n_tokens & CHUNK_HEADED) != 0, paged = (c->n_tokens & CHUNK_PAGED) != 0;
    c->n_tokens &= ~(CHUNK_HEADED | CHUNK_PAGED);
    if (headed) {
        if (v->mv_size < at + CHUNK_HEADING_LEN_SIZE)
            return RET_ECORRUPT;
        c->heading_len = (size_t)p[at] | (size_t)p[at + 1] << 8;
        at += CHUNK_HEADING_LEN_SIZE;
        c->heading = (const char *)p + at;
        at += c->heading_len;
        if (c->heading_len == 0 || c->heading_len > CHUNK_MAX_PATH_BYTES || v->mv_size <= at)
            return RET_ECORRUPT;
    }
    if (paged) {
        if (v->mv_size <= at + CHUNK_PAGES_SIZE)
            return RET_ECORRUPT;
        c->page_first = get_le32(p + at);
        c->page_last = get_le32(p + at + 4);
        at += CHUNK_PAGES_SIZE;
        if (c->page_first == 0 || c->page_last < c->page_first)
            return RET_ECORRUPT;
    }
    if (v->mv_size - at > INDEX_MAX_ID_BYTES)
        return RET_ECORRUPT;
    *doc_id = (const char *)p + at;
    *doc_id_len = v->mv_size - at;
    return RET_OK;
}

int term_header_decode(const MDB_val *v, struct TermHeader *h)
{
    if (v->mv_size != TERM_HEADER_SIZE)
        return RET_ECORRUPT;
    const uint8_t *p = v->mv_data;
    h->df = get_le32(p);
    h->max_tf = get_le32(p + 4);
    h->min_len = get_le32(p + 8);
    return h->df ? RET_OK : RET_ECORRUPT;
}

size_t key_doc(uint8_t *out, uint32_t coll, const char *id, size_t len)
{
    put_be32(out, coll);
    memcpy(out + 4, id, len);
    return 4 + len;
}

size_t key_chunk(uint8_t *out, uint32_t coll, uint32_t chunk_id)
{
    put_be32(out, coll);
    put_be32(out + 4, chunk_id);
    return 8;
}

size_t key_term(uint8_t *out, uint32_t coll, const char *term, size_t len)
{
    put_be32(out, coll);
    memcpy(out + 4, term, len);
    out[4 + len] = 0;
    return 5 + len;
}

size_t key_block(uint8_t *out, uint32_t coll, const char *term, size_t len, uint32_t base)
{
    size_t n = key_term(out, coll, term, len);
    put_be32(out + n, base);
    return n + 4;
}

/* ---- transactions and map growth ---- */

/* Transactions this thread holds open, per store. The first one takes the resize lock shared
 * and the last one releases it: taking a shared lock again while a grower waits would deadlock
 * (the lock prefers writers), and a thread holding it must not try to grow the map. */
#define TLS_HELD_SLOTS 4
static _Thread_local struct { const struct Store *s; int n; } tls_held[TLS_HELD_SLOTS];

static int *held_count(const struct Store *s, int create)
{
    for (int i = 0; i < TLS_HELD_SLOTS; i++)
        if (tls_held[i].n > 0 && tls_held[i].s == s)
            return &tls_held[i].n;
    if (!create)
        return NULL;
    for (int i = 0; i < TLS_HELD_SLOTS; i++)
        if (tls_held[i].n == 0) {
            tls_held[i].s = s;
            return &tls_held[i].n;
        }
    return NULL;
}

/* Hold the resize lock shared for a call that is not a transaction (it counts as one). */
static int hold_shared(struct Store *s)
{
    int *h = held_count(s, 1);
    if (!h)
        return -1;
    if ((*h)++ == 0)
        pthread_rwlock_rdlock(&s->resize_lock);
    return 0;
}

static void txn_release(struct Store *s)
{
    int *h = held_count(s, 0);
    if (h && --*h == 0)
        pthread_rwlock_unlock(&s->resize_lock);
}

int store_txn_begin(struct Store *s, unsigned flags, MDB_txn **txn, char *err, size_t errlen)
{
    char why[sizeof s->damage];
    if (!(flags & MDB_RDONLY) && store_damaged(s, why, sizeof why))
        return ret_fail(err, errlen, RET_ECORRUPT, "the store is read-only because it is damaged "
                        "(%s); nothing was written: run `diffrag-store --data-dir %s verify`, then "
                        "restore a backup or rebuild the store", why, s->dir);
    int *h = held_count(s, 1);
    if (!h)
        return ret_fail(err, errlen, RET_ELIMIT, "one thread holds transactions on more than %d stores",
                        TLS_HELD_SLOTS);
    for (int attempt = 0; attempt < 8; attempt++) {
        if (*h == 0)
            pthread_rwlock_rdlock(&s->resize_lock);
        (*h)++;
        int rc = mdb_txn_begin(s->env, NULL, flags, txn);
        if (rc == 0)
            return RET_OK;
        txn_release(s);
        if (rc != MDB_MAP_RESIZED)
            return store_mdb_fail(err, errlen, rc, "begin transaction");
        if (*h > 0)
            return ret_fail(err, errlen, RET_EIO, "another process grew the store while this thread "
                            "holds a snapshot; end it and retry");
        /* Another process grew the map: adopt its size. */
        pthread_rwlock_wrlock(&s->resize_lock);
        rc = mdb_env_set_mapsize(s->env, 0);
        pthread_rwlock_unlock(&s->resize_lock);
        if (rc)
            return store_mdb_fail(err, errlen, rc, "adopt the grown map size");
    }
    return ret_fail(err, errlen, RET_EIO, "begin transaction: the map keeps being resized");
}

/* Free space below this after a write failed with EIO means the write failed for want of it. */
#define STORE_FULL_BYTES (1ull << 20)

/* A commit that failed writing its pages. LMDB returns a write's errno (ENOSPC, EDQUOT), or
 * EIO when the write came up short, which is how a filesystem that fills during the write
 * shows: "commit: Input/output error" tells an operator nothing, so when the data directory's
 * filesystem has (next to) no room left, say that the disk is full and what to do. */
static int commit_fail(struct Store *s, int rc, char *err, size_t errlen)
{
    if (rc != ENOSPC && rc != EDQUOT && rc != EIO)
        return store_mdb_fail(err, errlen, rc, "commit");
    struct statvfs fs;
    int known = statvfs(s->dir, &fs) == 0;
    /* root may write into the blocks a filesystem keeps back from other users */
    unsigned long long avail = known ? (unsigned long long)(geteuid() == 0 ? fs.f_bfree : fs.f_bavail)
                                       * fs.f_frsize : 0;
    if (rc == EIO && (!known || avail >= STORE_FULL_BYTES))
        return store_mdb_fail(err, errlen, rc, "commit");
    /* what to do first: a caller's buffer may cut the tail (the directory, LMDB's words) */
    if (rc == EDQUOT)
        return ret_fail(err, errlen, RET_EFULL, "no space left in the data directory (this user's "
                        "disk quota is used up): nothing was written; free space there or raise "
                        "the quota (%s; LMDB: %s)", s->dir, mdb_strerror(rc));
    return ret_fail(err, errlen, RET_EFULL, "no space left in the data directory (the disk is full, "
                    "%llu KiB free): nothing was written; free space on it, or move the store to a "
                    "larger filesystem (%s; LMDB: %s)", avail >> 10, s->dir, mdb_strerror(rc));
}

int store_txn_commit(struct Store *s, MDB_txn *txn, char *err, size_t errlen)
{
    int rc = mdb_txn_commit(txn);
    txn_release(s);
    if (rc == MDB_MAP_FULL)
        return rc; /* the write loop grows the map and replays the batch */
    return rc ? commit_fail(s, rc, err, errlen) : RET_OK;
}

void store_txn_abort(struct Store *s, MDB_txn *txn)
{
    mdb_txn_abort(txn);
    txn_release(s);
}

int store_grow(struct Store *s, char *err, size_t errlen)
{
    if (held_count(s, 0))
        return ret_fail(err, errlen, RET_ELIMIT,
                        "the store map is full and cannot grow while this thread holds a read "
                        "snapshot; end it (store_read_end) and retry");
    pthread_rwlock_wrlock(&s->resize_lock);
    MDB_envinfo info;
    int rc = mdb_env_info(s->env, &info);
    size_t cur = rc ? 0 : info.me_mapsize;
    size_t next = cur < ((size_t)1 << 30) ? cur * 2 : cur + ((size_t)1 << 30);
    if (next > s->opt.max_map_size)
        next = s->opt.max_map_size;
    if (rc == 0 && next <= cur) {
        pthread_rwlock_unlock(&s->resize_lock);
        return ret_fail(err, errlen, RET_EFULL, "the store's map is full: it is at its ceiling of "
                        "%zu bytes (max_map_size); nothing was written: delete documents or drop "
                        "collections (their pages are reused), or keep more in another data "
                        "directory", s->opt.max_map_size);
    }
    if (rc == 0)
        rc = mdb_env_set_mapsize(s->env, next);
    pthread_rwlock_unlock(&s->resize_lock);
    return rc ? store_mdb_fail(err, errlen, rc, "grow the map") : RET_OK;
}

size_t store_map_size(struct Store *s)
{
    MDB_envinfo info;
    if (hold_shared(s))
        return 0;
    int rc = mdb_env_info(s->env, &info);
    txn_release(s);
    return rc ? 0 : info.me_mapsize;
}

/* ---- open / close ---- */

static int mkdir_p(const char *dir)
{
    char buf[4096];
    size_t len = strlen(dir);
    if (len == 0 || len >= sizeof buf)
        return -1;
    memcpy(buf, dir, len + 1);
    for (size_t i = 1; i <= len; i++) {
        if (buf[i] == '/' || buf[i] == 0) {
            char c = buf[i];
            buf[i] = 0;
            if (mkdir(buf, 0755) && errno != EEXIST)
                return -1;
            buf[i] = c;
        }
    }
    return 0;
}

static const char *const DB_NAMES[] = { "meta", "stats", "docs", "chunks", "postings", "kv",
                                        "kvuse" };

static int open_dbs(struct Store *s, MDB_txn *txn, unsigned flags)
{
    MDB_dbi *dbis[] = { &s->db_meta, &s->db_stats, &s->db_docs, &s->db_chunks, &s->db_postings,
                        &s->db_kv, &s->db_kvuse };
    for (size_t i = 0; i < sizeof dbis / sizeof dbis[0]; i++) {
        int rc = mdb_dbi_open(txn, DB_NAMES[i], flags, dbis[i]);
        if (rc)
            return rc;
    }
    return 0;
}

static int read_version(struct Store *s, MDB_txn *txn, uint32_t *version, int *present)
{
    MDB_val k = { 6, "schema" }, v;
    int rc = mdb_get(txn, s->db_meta, &k, &v);
    *present = rc == 0;
    if (rc == MDB_NOTFOUND)
        return 0;
    if (rc)
        return rc;
    if (v.mv_size != 4)
        return MDB_CORRUPTED;
    *version = get_le32(v.mv_data);
    return 0;
}

static const MDB_val UNSUMMED = { 8, "unsummed" };

/* Upgrades a version 1 to 4 store in place, in one transaction: version 1 lacks the chunk KV
 * databases (created empty); versions 1 and 2 hold document and chunk records without
 * checksums, which meta "unsummed" allows from then on; the chunk records of versions 1 to 3
 * have no heading paths and those of all four no pages, which records need not have. Nothing
 * else changes. */
static int upgrade(struct Store *s, uint32_t from, char *err, size_t errlen)
{
    MDB_txn *txn;
    int rc = mdb_txn_begin(s->env, NULL, 0, &txn);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "upgrade the store");
    uint8_t vb[4], one[4];
    put_le32(vb, STORE_SCHEMA_VERSION);
    put_le32(one, 1);
    MDB_val k = { 6, "schema" }, v = { 4, vb }, uk = UNSUMMED, uv = { 4, one };
    int unsummed = from < 3;
    rc = open_dbs(s, txn, MDB_CREATE);
    if (!rc) rc = mdb_put(txn, s->db_meta, &k, &v, 0);
    if (!rc && unsummed) rc = mdb_put(txn, s->db_meta, &uk, &uv, 0);
    if (!rc && !unsummed) { /* a version 3 store upgraded from version 1 or 2 says so already */
        rc = mdb_get(txn, s->db_meta, &uk, &uv);
        unsummed = rc == 0;
        rc = rc == MDB_NOTFOUND ? 0 : rc;
    }
    if (rc) {
        mdb_txn_abort(txn);
        return store_mdb_fail(err, errlen, rc, "upgrade the store");
    }
    rc = mdb_txn_commit(txn);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "upgrade the store");
    s->unsummed = unsummed;
    return RET_OK;
}

/* Existing store: check the version before touching anything else. Empty environment: create
 * the databases and write the version. */
static int open_schema(struct Store *s, char *err, size_t errlen)
{
    MDB_txn *txn;
    int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "open store");
    MDB_dbi meta;
    rc = mdb_dbi_open(txn, "meta", 0, &meta);
    if (rc == 0) {
        s->db_meta = meta;
        uint32_t version = 0;
        int present = 0;
        rc = read_version(s, txn, &version, &present);
        if (rc) {
            mdb_txn_abort(txn);
            return store_mdb_fail(err, errlen, rc, "read the store's schema version");
        }
        if (!present) {
            mdb_txn_abort(txn);
            return ret_fail(err, errlen, RET_ECORRUPT,
                            "store at %s has no schema version record; refusing to read it", s->dir);
        }
        if (version >= 1 && version < STORE_SCHEMA_VERSION) {
            mdb_txn_abort(txn);
            return upgrade(s, version, err, errlen);
        }
        if (version != STORE_SCHEMA_VERSION) {
            mdb_txn_abort(txn);
            return ret_fail(err, errlen, RET_EVERSION,
                            "store at %s has schema version %u; this build reads versions 1 to %u "
                            "(upgraded when opened) and %u only: rebuild the store or use a "
                            "matching build", s->dir, version, STORE_SCHEMA_VERSION - 1,
                            STORE_SCHEMA_VERSION);
        }
        rc = open_dbs(s, txn, 0);
        MDB_val uk = UNSUMMED, uv;
        int got = rc ? rc : mdb_get(txn, s->db_meta, &uk, &uv);
        if (got == 0)
            s->unsummed = 1;
        else if (got != MDB_NOTFOUND)
            rc = got;
        if (rc) {
            mdb_txn_abort(txn);
            return store_mdb_fail(err, errlen, rc, "open the store's databases");
        }
        rc = mdb_txn_commit(txn); /* makes the dbi handles usable by later transactions */
        return rc ? store_mdb_fail(err, errlen, rc, "open store") : RET_OK;
    }
    mdb_txn_abort(txn);
    if (rc != MDB_NOTFOUND)
        return store_mdb_fail(err, errlen, rc, "open the meta database");
    /* A new store. */
    rc = mdb_txn_begin(s->env, NULL, 0, &txn);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "create store");
    rc = open_dbs(s, txn, MDB_CREATE);
    uint32_t version = 0;
    int present = 0;
    if (rc == 0)
        rc = read_version(s, txn, &version, &present);
    if (rc == 0 && !present) {
        uint8_t vb[4];
        put_le32(vb, STORE_SCHEMA_VERSION);
        MDB_val k = { 6, "schema" }, v = { 4, vb };
        rc = mdb_put(txn, s->db_meta, &k, &v, 0);
    } else if (rc == 0 && version != STORE_SCHEMA_VERSION) {
        mdb_txn_abort(txn);
        return ret_fail(err, errlen, RET_EVERSION, "store at %s has schema version %u; this build reads %u",
                        s->dir, version, STORE_SCHEMA_VERSION);
    }
    if (rc) {
        mdb_txn_abort(txn);
        return store_mdb_fail(err, errlen, rc, "create store");
    }
    rc = mdb_txn_commit(txn);
    return rc ? store_mdb_fail(err, errlen, rc, "create store") : RET_OK;
}

int store_open(const char *dir, const struct StoreOptions *opt, struct Store **out, char *err,
               size_t errlen)
{
    *out = NULL;
    struct Store *s = calloc(1, sizeof *s);
    if (!s)
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
    if (opt)
        s->opt = *opt;
    else
        store_options_default(&s->opt);
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&s->resize_lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    int st;
    s->dir = strdup(dir);
    if (!s->dir) {
        st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
        goto err;
    }
    if (mkdir_p(dir)) {
        st = ret_fail(err, errlen, RET_EIO, "cannot create data directory %s: %s", dir, strerror(errno));
        goto err;
    }
    /* before LMDB maps the file: a page past its end would be a SIGBUS when read */
    if ((st = store_check_file(dir, err, errlen)))
        goto err;
    int rc = mdb_env_create(&s->env);
    if (!rc) rc = mdb_env_set_maxdbs(s->env, 8);
    if (!rc) rc = mdb_env_set_mapsize(s->env, s->opt.map_size);
    if (!rc) rc = mdb_env_set_maxreaders(s->env, 512);
    if (rc) {
        st = store_mdb_fail(err, errlen, rc, "create LMDB environment");
        goto err;
    }
    unsigned flags = MDB_NOTLS | (s->opt.no_sync ? MDB_NOSYNC : 0);
    rc = mdb_env_open(s->env, dir, flags, 0644);
    if (rc) {
        char what[512];
        snprintf(what, sizeof what, "open store at %s", dir);
        st = store_mdb_fail(err, errlen, rc, what);
        goto err;
    }
    /* Reader slots left by processes that died (kill -9) would pin old pages forever. */
    int dead = 0;
    mdb_reader_check(s->env, &dead);
    if ((st = open_schema(s, err, errlen)))
        goto err;
    *out = s;
    return RET_OK;
err:
    store_close(&s);
    return st;
}

void store_close(struct Store **ps)
{
    struct Store *s = ps ? *ps : NULL;
    if (!s)
        return;
    if (s->env)
        mdb_env_close(s->env);
    pthread_rwlock_destroy(&s->resize_lock);
    free(s->dir);
    free(s);
    *ps = NULL;
}

/* ---- reads ---- */

int store_read_begin(struct Store *s, struct StoreReader **out, char *err, size_t errlen)
{
    *out = NULL;
    struct StoreReader *r = calloc(1, sizeof *r);
    if (!r)
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
    int st = store_txn_begin(s, MDB_RDONLY, &r->txn, err, errlen);
    if (st) {
        free(r);
        return st;
    }
    r->s = s;
    *out = r;
    return RET_OK;
}

void store_read_end(struct StoreReader **pr)
{
    struct StoreReader *r = pr ? *pr : NULL;
    if (!r)
        return;
    store_txn_abort(r->s, r->txn);
    free(r);
    *pr = NULL;
}

int store_coll_get(struct Store *s, MDB_txn *txn, const char *name, struct CollRecord *c,
                   char *err, size_t errlen)
{
    int st = index_validate_collection(name, err, errlen);
    if (st)
        return st;
    MDB_val k = { strlen(name), (void *)name }, v;
    int rc = mdb_get(txn, s->db_stats, &k, &v);
    if (rc == MDB_NOTFOUND)
        return ret_fail(err, errlen, RET_ENOTFOUND, "unknown collection \"%s\"", name);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "read collection record");
    if (coll_record_decode(&v, c))
        return ret_fail(err, errlen, RET_ECORRUPT, "collection \"%s\": malformed record", name);
    return RET_OK;
}

int store_collection_stats(struct StoreReader *r, const char *collection, struct StoreCollStats *out,
                           char *err, size_t errlen)
{
    struct CollRecord c;
    int st = store_coll_get(r->s, r->txn, collection, &c, err, errlen);
    if (st)
        return st;
    out->id = c.id;
    coll_record_options(&c, &out->options);
    out->n_docs = c.n_docs;
    out->n_chunks = c.n_chunks;
    out->total_terms = c.total_terms;
    out->text_bytes = c.text_bytes;
    out->next_chunk_id = c.next_chunk_id;
    out->avg_chunk_terms = c.n_chunks ? (double)c.total_terms / (double)c.n_chunks : 0.0;
    return RET_OK;
}

int store_list_collections(struct StoreReader *r,
                           int (*fn)(void *ctx, const char *name, size_t len), void *ctx,
                           char *err, size_t errlen)
{
    MDB_cursor *cur;
    int rc = mdb_cursor_open(r->txn, r->s->db_stats, &cur);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "list collections");
    MDB_val k, v;
    int st = RET_OK;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT))
        if ((st = fn(ctx, k.mv_data, k.mv_size)))
            break;
    mdb_cursor_close(cur);
    if (st == RET_OK && rc != MDB_NOTFOUND)
        return store_mdb_fail(err, errlen, rc, "list collections");
    return st;
}

/* A document record as a view, once it passed its checksum: no read hands out a damaged
 * document. RET_OK or RET_ECORRUPT with the message. */
static int doc_view(const struct Store *s, const char *coll, const MDB_val *k, const MDB_val *v,
                    struct StoreDocView *out, char *err, size_t errlen)
{
    struct DocHeader h;
    const char *title, *text;
    const void *meta;
    if (doc_record_decode(v, &h, &title, &meta, &text))
        return ret_fail(err, errlen, RET_ECORRUPT, "document record is malformed");
    int st = doc_record_check(s, coll, k, v, &h, err, errlen);
    if (st)
        return st;
    out->id = (const char *)k->mv_data + 4;
    out->id_len = k->mv_size - 4;
    out->title = title;
    out->title_len = h.title_len;
    out->meta = meta;
    out->meta_len = h.meta_len;
    out->text = text;
    out->text_len = h.text_len;
    out->first_chunk = h.first_chunk;
    out->n_chunks = h.n_chunks;
    return RET_OK;
}

int store_get_doc(struct StoreReader *r, const char *collection, const char *id, size_t id_len,
                  struct StoreDocView *out, char *err, size_t errlen)
{
    struct CollRecord c;
    int st = store_coll_get(r->s, r->txn, collection, &c, err, errlen);
    if (st)
        return st;
    if (id_len == 0 || id_len > INDEX_MAX_ID_BYTES)
        return ret_fail(err, errlen, RET_ENOTFOUND, "no document with that id (ids are 1..%d bytes)",
                        INDEX_MAX_ID_BYTES);
    uint8_t kb[KEY_MAX];
    MDB_val k = { key_doc(kb, c.id, id, id_len), kb }, v;
    int rc = mdb_get(r->txn, r->s->db_docs, &k, &v);
    if (rc == MDB_NOTFOUND)
        return ret_fail(err, errlen, RET_ENOTFOUND, "no document \"%.*s\" in collection \"%s\"",
                        (int)(id_len > 64 ? 64 : id_len), id, collection);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "read document");
    if ((st = doc_view(r->s, collection, &k, &v, out, err, errlen)))
        return st;
    /* mdb_get leaves k pointing at kb, on this stack: hand back the caller's id instead */
    out->id = id;
    return RET_OK;
}

int store_list_docs(struct StoreReader *r, const char *collection, const char *after,
                    size_t after_len, struct StoreDocView *out, size_t cap, size_t *n,
                    char *err, size_t errlen)
{
    *n = 0;
    struct CollRecord c;
    int st = store_coll_get(r->s, r->txn, collection, &c, err, errlen);
    if (st)
        return st;
    if (after_len > INDEX_MAX_ID_BYTES)
        after_len = INDEX_MAX_ID_BYTES;
    MDB_cursor *cur;
    int rc = mdb_cursor_open(r->txn, r->s->db_docs, &cur);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "list documents");
    uint8_t kb[KEY_MAX];
    MDB_val k = { key_doc(kb, c.id, after ? after : "", after ? after_len : 0), kb }, v;
    rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
    size_t got = 0;
    while (rc == 0 && got < cap) {
        if (k.mv_size < 4 || get_be32(k.mv_data) != c.id)
            break;
        int skip = after && after_len && k.mv_size - 4 == after_len &&
                   memcmp((const char *)k.mv_data + 4, after, after_len) == 0;
        if (!skip) {
            if ((st = doc_view(r->s, collection, &k, &v, &out[got], err, errlen))) {
                mdb_cursor_close(cur);
                return st;
            }
            got++;
        }
        rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
    }
    mdb_cursor_close(cur);
    if (rc && rc != MDB_NOTFOUND)
        return store_mdb_fail(err, errlen, rc, "list documents");
    *n = got;
    return RET_OK;
}

int store_get_chunk(struct StoreReader *r, const char *collection, uint32_t chunk_id,
                    struct StoreChunkView *out, char *err, size_t errlen)
{
    struct CollRecord c;
    int st = store_coll_get(r->s, r->txn, collection, &c, err, errlen);
    if (st)
        return st;
    uint8_t kb[8];
    MDB_val k = { key_chunk(kb, c.id, chunk_id), kb }, v;
    int rc = mdb_get(r->txn, r->s->db_chunks, &k, &v);
    if (rc == MDB_NOTFOUND)
        return ret_fail(err, errlen, RET_ENOTFOUND, "no chunk %u in collection \"%s\"", chunk_id, collection);
    if (rc)
        return store_mdb_fail(err, errlen, rc, "read chunk");
    struct ChunkRecord cr;
    if (chunk_record_decode(&v, &cr, &out->doc_id, &out->doc_id_len))
        return ret_fail(err, errlen, RET_ECORRUPT, "chunk record %u is malformed", chunk_id);
    out->chunk_id = chunk_id;
    out->chunk = cr.chunk;
    out->byte_start = cr.byte_start;
    out->byte_end = cr.byte_end;
    out->n_terms = cr.n_terms;
    out->n_tokens = cr.n_tokens;
    out->heading = cr.heading;
    out->heading_len = cr.heading_len;
    out->page_first = cr.page_first;
    out->page_last = cr.page_last;
    return RET_OK;
}

int store_backup(struct Store *s, const char *dest, char *err, size_t errlen)
{
    if (mkdir_p(dest))
        return ret_fail(err, errlen, RET_EIO, "cannot create backup directory %s: %s", dest, strerror(errno));
    if (hold_shared(s))
        return ret_fail(err, errlen, RET_ELIMIT, "this thread holds transactions on too many stores");
    int rc = mdb_env_copy2(s->env, dest, MDB_CP_COMPACT);
    txn_release(s);
    if (rc) {
        char what[512];
        snprintf(what, sizeof what, "backup to %s", dest);
        return store_mdb_fail(err, errlen, rc, what);
    }
    return RET_OK;
}
