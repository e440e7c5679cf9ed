/* Chunk KV records beside the chunks (store.h, docs/kv-reuse.md): opaque payloads under
 * coll | chunk | key in `kv`, their use ticks and sizes in `kvuse`, the total in meta. A
 * record is written only while its chunk exists, checked in the writing transaction, and
 * leaves with the chunk (store_kv_drop in the delete, replace and drop transactions), so no
 * record outlives its document whatever is killed when. */
#include "retriever/store_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/status.h"
#include "text/hash.h"

static const MDB_val KV_BYTES = { 8, "kv_bytes" };
static const MDB_val KV_TICK = { 7, "kv_tick" };

size_t kv_key(uint8_t *out, uint32_t coll, uint32_t chunk, uint64_t key)
{
    put_be32(out, coll);
    put_be32(out + 4, chunk);
    put_be32(out + 8, (uint32_t)(key >> 32));
    put_be32(out + 12, (uint32_t)key);
    return KV_KEY_SIZE;
}

int kv_record_check(const MDB_val *v, const void **payload, size_t *len)
{
    if (v->mv_size < KV_HEADER_SIZE) return RET_ECORRUPT;
    const uint8_t *p = v->mv_data;
    if (get_le32(p) != KV_MAGIC || get_le32(p + 4) != 0) return RET_ECORRUPT;
    size_t n = v->mv_size - KV_HEADER_SIZE;
    if (get_le64(p + 8) != hash_bytes(p + KV_HEADER_SIZE, n)) return RET_ECORRUPT;
    *payload = p + KV_HEADER_SIZE;
    *len = n;
    return RET_OK;
}

/* A meta counter (absent: 0). 0 or an LMDB error. */
static int meta_u64(MDB_txn *txn, MDB_dbi meta, const MDB_val *name, uint64_t *out)
{
    MDB_val k = *name, v;
    int rc = mdb_get(txn, meta, &k, &v);
    *out = 0;
    if (rc == MDB_NOTFOUND) return 0;
    if (rc) return rc;
    if (v.mv_size != 8) return MDB_CORRUPTED;
    *out = get_le64(v.mv_data);
    return 0;
}

static int meta_put_u64(MDB_txn *txn, MDB_dbi meta, const MDB_val *name, uint64_t x)
{
    uint8_t b[8];
    put_le64(b, x);
    MDB_val k = *name, v = { 8, b };
    return mdb_put(txn, meta, &k, &v, 0);
}

/* Delete the record under key k (16 bytes) and its use entry; *freed gets its size (0 when
 * there was none). 0 or an LMDB error. */
static int del_record(struct Store *s, MDB_txn *txn, const uint8_t *kb, uint64_t *freed)
{
    MDB_val k = { KV_KEY_SIZE, (void *)kb }, v;
    *freed = 0;
    int rc = mdb_get(txn, s->db_kvuse, &k, &v);
    if (rc == 0 && v.mv_size == 16) *freed = get_le64((const uint8_t *)v.mv_data + 8);
    if (rc == 0) rc = mdb_del(txn, s->db_kvuse, &k, NULL);
    if (rc && rc != MDB_NOTFOUND) return rc;
    rc = mdb_del(txn, s->db_kv, &k, NULL);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

int store_kv_drop(struct Store *s, MDB_txn *txn, uint32_t coll, uint32_t first, uint32_t end)
{
    if (first >= end) return 0;
    uint64_t total, freed_all = 0;
    int rc = meta_u64(txn, s->db_meta, &KV_BYTES, &total);
    MDB_cursor *cur;
    if (rc || (rc = mdb_cursor_open(txn, s->db_kv, &cur))) return rc;
    uint8_t from[KV_KEY_SIZE];
    kv_key(from, coll, first, 0);
    for (;;) {
        /* seek again after each delete rather than trusting the cursor's place after it */
        MDB_val k = { KV_KEY_SIZE, from }, v;
        rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
        if (rc == MDB_NOTFOUND) { rc = 0; break; }
        if (rc) break;
        if (k.mv_size != KV_KEY_SIZE || get_be32(k.mv_data) != coll ||
            get_be32((const uint8_t *)k.mv_data + 4) >= end)
            break;
        uint8_t kb[KV_KEY_SIZE];
        memcpy(kb, k.mv_data, KV_KEY_SIZE);
        uint64_t freed;
        if ((rc = del_record(s, txn, kb, &freed))) break;
        freed_all += freed;
    }
    mdb_cursor_close(cur);
    if (rc || freed_all == 0) return rc;
    return meta_put_u64(txn, s->db_meta, &KV_BYTES, total > freed_all ? total - freed_all : 0);
}

int store_kv_get(struct StoreReader *r, const struct StoreKvRef *ref, const void **data,
                 size_t *len, char *err, size_t errlen)
{
    uint8_t kb[KV_KEY_SIZE];
    MDB_val k = { kv_key(kb, ref->coll, ref->chunk, ref->key), kb }, v;
    int rc = mdb_get(r->txn, r->s->db_kv, &k, &v);
    if (rc == MDB_NOTFOUND)
        return ret_fail(err, errlen, RET_ENOTFOUND, "no KV record for chunk %u", ref->chunk);
    if (rc) return store_mdb_fail(err, errlen, rc, "read a chunk KV record");
    if (kv_record_check(&v, data, len))
        return ret_fail(err, errlen, RET_ECORRUPT, "the KV record of chunk %u is damaged "
                        "(header or checksum)", ref->chunk);
    return RET_OK;
}

int store_kv_usage(struct StoreReader *r, uint64_t *bytes, uint64_t *records, char *err,
                   size_t errlen)
{
    MDB_stat st;
    int rc = meta_u64(r->txn, r->s->db_meta, &KV_BYTES, bytes);
    if (!rc) rc = mdb_stat(r->txn, r->s->db_kv, &st);
    if (rc) return store_mdb_fail(err, errlen, rc, "read the chunk KV totals");
    *records = st.ms_entries;
    return RET_OK;
}

struct Aged { uint64_t tick, bytes; uint8_t key[KV_KEY_SIZE]; };

static int by_tick(const void *a, const void *b)
{
    const struct Aged *x = a, *y = b;
    return (x->tick > y->tick) - (x->tick < y->tick);
}

/* Evict least recently used records until the total is at most budget. 0 or an LMDB error
 * (ENOMEM when the list of records cannot be held). */
static int evict(struct Store *s, MDB_txn *txn, uint64_t *total, uint64_t budget,
                 struct StoreKvReport *rep)
{
    MDB_stat st;
    int rc = mdb_stat(txn, s->db_kvuse, &st);
    if (rc || st.ms_entries == 0) return rc;
    struct Aged *a = malloc(st.ms_entries * sizeof *a);
    if (!a) return ENOMEM;
    size_t n = 0;
    MDB_cursor *cur;
    if ((rc = mdb_cursor_open(txn, s->db_kvuse, &cur))) {
        free(a);
        return rc;
    }
    MDB_val k, v;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == 0 && n < st.ms_entries;
         rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        if (k.mv_size != KV_KEY_SIZE || v.mv_size != 16) { rc = MDB_CORRUPTED; break; }
        a[n].tick = get_le64(v.mv_data);
        a[n].bytes = get_le64((const uint8_t *)v.mv_data + 8);
        memcpy(a[n++].key, k.mv_data, KV_KEY_SIZE);
    }
    mdb_cursor_close(cur);
    if (rc == MDB_NOTFOUND) rc = 0;
    qsort(a, n, sizeof *a, by_tick);
    for (size_t i = 0; !rc && i < n && *total > budget; i++) {
        uint64_t freed;
        if ((rc = del_record(s, txn, a[i].key, &freed))) break;
        *total = *total > freed ? *total - freed : 0;
        rep->evicted++;
    }
    free(a);
    return rc;
}

/* One attempt of store_kv_write: RET_OK, a RET_E* status, or MDB_MAP_FULL untouched. */
static int kv_write_attempt(struct Store *s, const struct StoreKvPut *puts, size_t n_puts,
                            const struct StoreKvRef *touch, size_t n_touch, uint64_t budget,
                            struct StoreKvReport *rep, char *err, size_t errlen)
{
    memset(rep, 0, sizeof *rep);
    MDB_txn *txn;
    int st = store_txn_begin(s, 0, &txn, err, errlen);
    if (st) return st;
    uint64_t total, tick;
    int rc = meta_u64(txn, s->db_meta, &KV_BYTES, &total);
    if (!rc) rc = meta_u64(txn, s->db_meta, &KV_TICK, &tick);
    for (size_t i = 0; !rc && i < n_puts; i++) {
        const struct StoreKvPut *p = &puts[i];
        size_t len = 0;
        for (int j = 0; j < p->n_parts; j++) len += p->lens[j];
        uint64_t bytes = KV_HEADER_SIZE + (uint64_t)len;
        uint8_t kb[KV_KEY_SIZE];
        MDB_val ck = { key_chunk(kb, p->ref.coll, p->ref.chunk), kb }, cv;
        /* the chunk must exist now, in this transaction: else its document went meanwhile */
        rc = mdb_get(txn, s->db_chunks, &ck, &cv);
        if (rc == MDB_NOTFOUND || bytes > budget) {
            rc = 0;
            rep->skipped++;
            continue;
        }
        if (rc) break;
        uint64_t freed;
        kv_key(kb, p->ref.coll, p->ref.chunk, p->ref.key);
        if ((rc = del_record(s, txn, kb, &freed))) break;
        total = total > freed ? total - freed : 0;
        MDB_val k = { KV_KEY_SIZE, kb }, v = { bytes, NULL };
        if ((rc = mdb_put(txn, s->db_kv, &k, &v, MDB_RESERVE))) break;
        uint8_t *out = v.mv_data;
        size_t at = KV_HEADER_SIZE;
        for (int j = 0; j < p->n_parts; j++) {
            memcpy(out + at, p->parts[j], p->lens[j]);
            at += p->lens[j];
        }
        put_le32(out, KV_MAGIC);
        put_le32(out + 4, 0);
        put_le64(out + 8, hash_bytes(out + KV_HEADER_SIZE, len));
        uint8_t ub[16];
        put_le64(ub, ++tick);
        put_le64(ub + 8, bytes);
        MDB_val uv = { 16, ub };
        if ((rc = mdb_put(txn, s->db_kvuse, &k, &uv, 0))) break;
        total += bytes;
        rep->written++;
    }
    for (size_t i = 0; !rc && i < n_touch; i++) {
        uint8_t kb[KV_KEY_SIZE];
        MDB_val k = { kv_key(kb, touch[i].coll, touch[i].chunk, touch[i].key), kb }, v;
        rc = mdb_get(txn, s->db_kvuse, &k, &v);
        if (rc == MDB_NOTFOUND) { rc = 0; continue; }
        if (rc) break;
        if (v.mv_size != 16) { rc = MDB_CORRUPTED; break; }
        uint8_t ub[16];
        memcpy(ub, v.mv_data, 16);
        put_le64(ub, ++tick);
        MDB_val uv = { 16, ub };
        if ((rc = mdb_put(txn, s->db_kvuse, &k, &uv, 0))) break;
        rep->touched++;
    }
    if (!rc && total > budget) rc = evict(s, txn, &total, budget, rep);
    if (!rc) rc = meta_put_u64(txn, s->db_meta, &KV_BYTES, total);
    if (!rc) rc = meta_put_u64(txn, s->db_meta, &KV_TICK, tick);
    if (!rc) {
        MDB_stat ms;
        if (!(rc = mdb_stat(txn, s->db_kv, &ms))) rep->records = ms.ms_entries;
        rep->bytes = total;
    }
    if (rc) {
        store_txn_abort(s, txn);
        if (rc == MDB_MAP_FULL) return rc;
        if (rc == ENOMEM) return ret_fail(err, errlen, RET_ENOMEM, "out of memory evicting KV");
        return store_mdb_fail(err, errlen, rc, "write chunk KV");
    }
    return store_txn_commit(s, txn, err, errlen);
}

int store_kv_write(struct Store *s, const struct StoreKvPut *puts, size_t n_puts,
                   const struct StoreKvRef *touch, size_t n_touch, uint64_t budget,
                   struct StoreKvReport *rep, char *err, size_t errlen)
{
    struct StoreKvReport local;
    if (!rep) rep = &local;
    for (int attempt = 0; attempt < 64; attempt++) {
        int st = kv_write_attempt(s, puts, n_puts, touch, n_touch, budget, rep, err, errlen);
        if (st != MDB_MAP_FULL) return st;
        if ((st = store_grow(s, err, errlen))) return st;
    }
    return ret_fail(err, errlen, RET_EIO, "the chunk KV write kept failing to fit the map");
}
