/* Dropping a whole collection: one write transaction removes its record from `stats` and every
 * key under its id in `docs`, `chunks`, `postings` and the chunk KV databases. The id stays
 * allocated in `meta`, so a later collection of the same name gets a fresh id and never meets
 * a stale key. */
#include "retriever/store_internal.h"

#include <string.h>

#include "retriever/status.h"

/* Delete every key of `dbi` that starts with the collection id `coll` (4 bytes, big-endian).
 * Returns 0 or an LMDB error code. */
static int drop_prefix(MDB_txn *txn, MDB_dbi dbi, uint32_t coll)
{
    MDB_cursor *cur;
    int rc = mdb_cursor_open(txn, dbi, &cur);
    if (rc)
        return rc;
    uint8_t prefix[4];
    put_be32(prefix, coll);
    for (;;) {
        /* Seek again after each delete rather than trusting the cursor's position after it. */
        MDB_val k = { sizeof prefix, prefix }, v;
        rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
        if (rc == MDB_NOTFOUND) {
            rc = 0;
            break;
        }
        if (rc)
            break;
        if (k.mv_size < 4 || memcmp(k.mv_data, prefix, 4) != 0)
            break;
        if ((rc = mdb_cursor_del(cur, 0)))
            break;
    }
    mdb_cursor_close(cur);
    return rc;
}

/* One attempt. Returns RET_OK, a RET_E* status, or MDB_MAP_FULL / MDB_TXN_FULL untouched. */
static int drop_attempt(struct Store *s, const char *collection, uint64_t *n_docs, char *err,
                        size_t errlen)
{
    MDB_txn *txn;
    int st = store_txn_begin(s, 0, &txn, err, errlen);
    if (st)
        return st;
    struct CollRecord rec;
    if ((st = store_coll_get(s, txn, collection, &rec, err, errlen)))
        goto out;
    const MDB_dbi dbis[] = { s->db_docs, s->db_chunks, s->db_postings };
    const char *const what[] = { "delete documents", "delete chunks", "delete postings" };
    for (size_t i = 0; i < sizeof dbis / sizeof dbis[0]; i++) {
        int rc = drop_prefix(txn, dbis[i], rec.id);
        if (rc) {
            st = rc == MDB_MAP_FULL || rc == MDB_TXN_FULL ? rc : store_mdb_fail(err, errlen, rc, what[i]);
            goto out;
        }
    }
    int rc = store_kv_drop(s, txn, rec.id, 0, UINT32_MAX);
    if (rc) {
        st = rc == MDB_MAP_FULL || rc == MDB_TXN_FULL ? rc : store_mdb_fail(err, errlen, rc, "delete chunk KV");
        goto out;
    }
    MDB_val k = { strlen(collection), (void *)collection };
    rc = mdb_del(txn, s->db_stats, &k, NULL);
    if (rc) {
        st = rc == MDB_MAP_FULL || rc == MDB_TXN_FULL ? rc
                                                      : store_mdb_fail(err, errlen, rc, "delete collection record");
        goto out;
    }
    st = store_txn_commit(s, txn, err, errlen);
    txn = NULL;
    if (st == RET_OK)
        *n_docs = rec.n_docs;
out:
    if (txn)
        store_txn_abort(s, txn);
    return st;
}

int store_drop_collection(struct Store *s, const char *collection, uint64_t *n_docs, char *err,
                          size_t errlen)
{
    uint64_t n = 0;
    if (n_docs)
        *n_docs = 0;
    for (int attempt = 0; attempt < 64; attempt++) {
        int st = drop_attempt(s, collection, &n, err, errlen);
        if (st == MDB_MAP_FULL) {
            /* Deleting copies pages too: grow like a put does, then replay. */
            if ((st = store_grow(s, err, errlen)))
                return st;
            continue;
        }
        if (st == MDB_TXN_FULL)
            return ret_fail(err, errlen, RET_ELIMIT,
                            "collection \"%s\" is too large to drop in one transaction", collection);
        if (st == RET_OK && n_docs)
            *n_docs = n;
        return st;
    }
    return ret_fail(err, errlen, RET_EIO, "drop kept failing to fit the map");
}
