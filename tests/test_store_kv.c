/* Tests for the store's chunk KV records (retriever/store_kv.c): a record round-trips; it is
 * written only while its chunk exists; a document's delete or replace and a collection's drop
 * take its chunks' records in the same transaction; the byte budget evicts the least recently
 * used records (a touch renews one); verify counts the records and finds a damaged payload, a
 * record whose chunk is gone and a wrong total; a version 1 store is upgraded when opened. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <lmdb.h>

#include "retriever/status.h"
#include "retriever/store.h"
#include "retriever/store_internal.h"
#include "text/tokcount.h"
#include "tests/check.h"
#include "tests/store_util.h"

/* Documents put into a collection chunked by 16 tokens (the smallest chunk size), so short
 * texts make several chunks. */
static int put_docs(struct Store *s, const char *coll, const struct StoreDoc *docs, size_t n,
                    char *err, size_t errlen)
{
    struct TokenCounter tc;
    tokcount_simple(&tc);
    struct IndexOptions io;
    index_options_default(&io);
    io.chunk.target_tokens = 16;
    io.chunk.overlap_tokens = 0;
    return store_put_docs(s, coll, docs, n, &io, &tc, err, errlen);
}

/* A payload of n bytes that names its ref. */
static void fill(uint8_t *p, size_t n, uint32_t chunk, uint64_t key)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(chunk * 31 + key * 7 + i);
}

static int put(struct Store *s, uint32_t coll, uint32_t chunk, uint64_t key, size_t n,
               uint64_t budget, struct StoreKvReport *rep)
{
    uint8_t *p = malloc(n);
    fill(p, n, chunk, key);
    /* two pieces, laid end to end */
    const void *parts[2] = { p, p + n / 2 };
    size_t lens[2] = { n / 2, n - n / 2 };
    struct StoreKvPut kp = { { coll, chunk, key }, parts, lens, 2 };
    char err[256];
    int st = store_kv_write(s, &kp, 1, NULL, 0, budget, rep, err, sizeof err);
    if (st) fprintf(stderr, "kv write: %s\n", err);
    free(p);
    return st;
}

/* 1 when the record of (coll, chunk, key) holds the payload put wrote for it. */
static int has(struct Store *s, uint32_t coll, uint32_t chunk, uint64_t key, size_t n)
{
    struct StoreReader *r;
    char err[256];
    if (store_read_begin(s, &r, err, sizeof err)) return 0;
    const void *data;
    size_t len;
    int ok = store_kv_get(r, &(struct StoreKvRef){ coll, chunk, key }, &data, &len, err,
                          sizeof err) == RET_OK;
    if (ok) {
        uint8_t *want = malloc(n);
        fill(want, n, chunk, key);
        ok = len == n && !memcmp(data, want, n);
        free(want);
    }
    store_read_end(&r);
    return ok;
}

static int verify(struct Store *s, struct StoreVerifyReport *rep, char *err, size_t errlen)
{
    return store_verify(s, NULL, rep, err, errlen);
}

/* The collection's id and its document's first chunk. */
static void ids(struct Store *s, const char *coll, const char *doc, uint32_t *cid,
                uint32_t *first, uint32_t *n)
{
    struct StoreReader *r;
    char err[256];
    struct StoreCollStats cs;
    struct StoreDocView dv;
    CHECK(store_read_begin(s, &r, err, sizeof err) == RET_OK, "read: %s", err);
    CHECK(store_collection_stats(r, coll, &cs, err, sizeof err) == RET_OK, "stats: %s", err);
    CHECK(store_get_doc(r, coll, doc, strlen(doc), &dv, err, sizeof err) == RET_OK, "doc: %s", err);
    *cid = cs.id;
    *first = dv.first_chunk;
    *n = dv.n_chunks;
    store_read_end(&r);
}

static void test_lifecycle(void)
{
    char *dir = temp_dir(), err[512];
    struct Store *s;
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    struct StoreDoc docs[2] = {
        mkdoc("a", NULL, "Apples grow on trees in orchards across the cool hills of the north. They are "
                   "red or green or yellow, sweet or sour. Bakers use them in pies and tarts, and "
                   "presses turn them into juice and cider every autumn after the harvest ends."),
        mkdoc("b", NULL, "Bananas grow in large bunches on tall plants in warm and wet places. They are "
                   "green at first and yellow when ripe, sweet and soft to eat, and travel far in "
                   "ships that keep them cool until they reach the markets of the world."),
    };
    CHECK(put_docs(s, "fruit", docs, 2, err, sizeof err) == RET_OK, "put: %s", err);
    uint32_t coll, a0, an, b0, bn;
    ids(s, "fruit", "a", &coll, &a0, &an);
    ids(s, "fruit", "b", &coll, &b0, &bn);
    CHECK(an >= 2 && bn >= 2, "several chunks each (%u, %u)", an, bn);

    struct StoreKvReport rep;
    CHECK(put(s, coll, a0, 11, 1000, 1 << 20, &rep) == RET_OK && rep.written == 1, "put a0");
    CHECK(put(s, coll, a0 + 1, 11, 1500, 1 << 20, &rep) == RET_OK, "put a1");
    CHECK(put(s, coll, a0 + 1, 12, 700, 1 << 20, &rep) == RET_OK, "a1 under a second key");
    CHECK(put(s, coll, b0, 11, 900, 1 << 20, &rep) == RET_OK && rep.records == 4, "put b0: %llu",
          (unsigned long long)rep.records);
    CHECK(rep.bytes == 4 * KV_HEADER_SIZE + 1000 + 1500 + 700 + 900, "total %llu",
          (unsigned long long)rep.bytes);
    CHECK(has(s, coll, a0, 11, 1000) && has(s, coll, a0 + 1, 12, 700) && has(s, coll, b0, 11, 900),
          "records round-trip");
    CHECK(!has(s, coll, a0, 12, 1000), "another key finds nothing");
    /* a chunk that is not stored takes no record */
    CHECK(put(s, coll, b0 + bn + 50, 11, 100, 1 << 20, &rep) == RET_OK && rep.written == 0 &&
          rep.skipped == 1, "no record for a chunk that is not stored");
    CHECK(put(s, coll + 1, 0, 11, 100, 1 << 20, &rep) == RET_OK && rep.skipped == 1,
          "no record in a collection that does not exist");
    struct StoreVerifyReport vr;
    CHECK(verify(s, &vr, err, sizeof err) == RET_OK && vr.kv_records == 4 &&
          vr.kv_bytes == rep.bytes, "verify counts the records: %s (%llu)", err,
          (unsigned long long)vr.kv_records);

    /* replacing "a" drops its chunks' records in the same transaction; "b" keeps its own */
    docs[0] = mkdoc("a", NULL, "Apples, replaced: a different text about apple trees and cider.");
    CHECK(put_docs(s, "fruit", docs, 1, err, sizeof err) == RET_OK, "replace: %s", err);
    CHECK(!has(s, coll, a0, 11, 1000) && !has(s, coll, a0 + 1, 11, 1500), "replaced: records gone");
    CHECK(has(s, coll, b0, 11, 900), "the other document's record stays");
    CHECK(verify(s, &vr, err, sizeof err) == RET_OK && vr.kv_records == 1 &&
          vr.kv_bytes == KV_HEADER_SIZE + 900, "verify after replace: %s", err);
    /* a put for the old chunk, late (its document was replaced meanwhile), is refused */
    CHECK(put(s, coll, a0, 11, 1000, 1 << 20, &rep) == RET_OK && rep.skipped == 1, "late put refused");
    /* deleting "b" takes its record */
    const char *del[] = { "b" };
    size_t del_len[] = { 1 };
    CHECK(store_delete_docs(s, "fruit", del, del_len, 1, NULL, err, sizeof err) == RET_OK, "delete");
    CHECK(!has(s, coll, b0, 11, 900), "deleted: record gone");
    CHECK(verify(s, &vr, err, sizeof err) == RET_OK && vr.kv_records == 0 && vr.kv_bytes == 0,
          "verify after delete: %s", err);
    /* dropping the collection takes every record */
    uint32_t c2, x0, xn;
    ids(s, "fruit", "a", &c2, &x0, &xn);
    CHECK(put(s, coll, x0, 3, 500, 1 << 20, &rep) == RET_OK && rep.written == 1, "put new a0");
    CHECK(store_drop_collection(s, "fruit", NULL, err, sizeof err) == RET_OK, "drop: %s", err);
    CHECK(verify(s, &vr, err, sizeof err) == RET_OK && vr.kv_records == 0, "verify after drop: %s",
          err);
    struct StoreReader *r;
    uint64_t bytes = 1, records = 1;
    CHECK(store_read_begin(s, &r, err, sizeof err) == RET_OK &&
          store_kv_usage(r, &bytes, &records, err, sizeof err) == RET_OK && bytes == 0 &&
          records == 0, "usage after drop: %llu bytes", (unsigned long long)bytes);
    store_read_end(&r);
    store_close(&s);
    rm_store(dir);
    free(dir);
}

static void test_budget_and_damage(void)
{
    char *dir = temp_dir(), err[512];
    struct Store *s;
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    char text[2048] = "";
    for (int i = 0; i < 100; i++)
        snprintf(text + strlen(text), sizeof text - strlen(text), "word%d ", i);
    struct StoreDoc d = mkdoc("d", NULL, text);
    CHECK(put_docs(s, "c", &d, 1, err, sizeof err) == RET_OK, "put: %s", err);
    uint32_t coll, c0, n;
    ids(s, "c", "d", &coll, &c0, &n);
    CHECK(n >= 4, "four chunks at least (%u)", n);
    const uint64_t rec = KV_HEADER_SIZE + 1000, budget = 3 * rec;
    struct StoreKvReport rep;
    for (uint32_t i = 0; i < 3; i++)
        CHECK(put(s, coll, c0 + i, 5, 1000, budget, &rep) == RET_OK && rep.evicted == 0, "fill %u", i);
    /* chunk 0 used again: chunk 1 is now the least recently used */
    CHECK(store_kv_write(s, NULL, 0, &(struct StoreKvRef){ coll, c0, 5 }, 1, budget, &rep, err,
                         sizeof err) == RET_OK && rep.touched == 1, "touch: %s", err);
    CHECK(put(s, coll, c0 + 3, 5, 1000, budget, &rep) == RET_OK && rep.evicted == 1 &&
          rep.bytes == budget, "over budget: one evicted (%zu), total %llu", rep.evicted,
          (unsigned long long)rep.bytes);
    CHECK(has(s, coll, c0, 5, 1000) && !has(s, coll, c0 + 1, 5, 1000) && has(s, coll, c0 + 2, 5, 1000)
          && has(s, coll, c0 + 3, 5, 1000), "the least recently used record went");
    CHECK(put(s, coll, c0, 6, 4000, budget, &rep) == RET_OK && rep.skipped == 1 && rep.written == 0,
          "a record larger than the budget is not written");
    struct StoreVerifyReport vr;
    CHECK(verify(s, &vr, err, sizeof err) == RET_OK && vr.kv_records == 3, "verify: %s", err);
    store_close(&s);

    /* damage, behind the store's back: a payload byte, then a record without its chunk */
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi kv;
    mdb_env_create(&env);
    mdb_env_set_maxdbs(env, 8);
    int rc = mdb_env_open(env, dir, 0, 0644);
    rc = rc ? rc : mdb_txn_begin(env, NULL, 0, &txn);
    rc = rc ? rc : mdb_dbi_open(txn, "kv", 0, &kv);
    uint8_t kb[KV_KEY_SIZE];
    MDB_val k = { kv_key(kb, coll, c0 + 2, 5), kb }, v;
    rc = rc ? rc : mdb_get(txn, kv, &k, &v);
    uint8_t *copy = rc ? NULL : malloc(v.mv_size);
    if (copy) {
        memcpy(copy, v.mv_data, v.mv_size);
        copy[KV_HEADER_SIZE + 10] ^= 1;
        v.mv_data = copy;
        rc = mdb_put(txn, kv, &k, &v, 0);
    }
    rc = rc ? rc : mdb_txn_commit(txn);
    free(copy);
    CHECK(rc == 0, "damage a payload: %s", mdb_strerror(rc));
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "reopen: %s", err);
    CHECK(!has(s, coll, c0 + 2, 5, 1000), "a damaged record is not served");
    struct StoreReader *r;
    const void *data;
    size_t len;
    CHECK(store_read_begin(s, &r, err, sizeof err) == RET_OK &&
          store_kv_get(r, &(struct StoreKvRef){ coll, c0 + 2, 5 }, &data, &len, err, sizeof err) ==
              RET_ECORRUPT && strstr(err, "damaged"), "get says damaged: %s", err);
    store_read_end(&r);
    CHECK(verify(s, &vr, err, sizeof err) == RET_ECORRUPT && vr.problems == 1 &&
          strstr(vr.first_problem, "damaged"), "verify finds the damaged record: %s", err);
    store_close(&s);
    /* the damaged record replaced by one (with its use entry, of the same size) under a chunk
     * id the collection never had */
    MDB_dbi kvuse;
    rc = mdb_txn_begin(env, NULL, 0, &txn);
    rc = rc ? rc : mdb_dbi_open(txn, "kv", 0, &kv);
    rc = rc ? rc : mdb_dbi_open(txn, "kvuse", 0, &kvuse);
    k = (MDB_val){ kv_key(kb, coll, c0 + 1000, 5), kb };
    uint8_t okb[KV_KEY_SIZE];
    MDB_val ok_k = { kv_key(okb, coll, c0, 5), okb }, ov, ou;
    rc = rc ? rc : mdb_get(txn, kv, &ok_k, &ov);
    rc = rc ? rc : mdb_put(txn, kv, &k, &ov, 0);
    rc = rc ? rc : mdb_get(txn, kvuse, &ok_k, &ou);
    rc = rc ? rc : mdb_put(txn, kvuse, &k, &ou, 0);
    rc = rc ? rc : mdb_del(txn, kv, &(MDB_val){ kv_key(kb, coll, c0 + 2, 5), kb }, NULL);
    rc = rc ? rc : mdb_del(txn, kvuse, &(MDB_val){ KV_KEY_SIZE, kb }, NULL);
    rc = rc ? rc : mdb_txn_commit(txn);
    mdb_env_close(env);
    CHECK(rc == 0, "plant a record without a chunk: %s", mdb_strerror(rc));
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "reopen: %s", err);
    CHECK(verify(s, &vr, err, sizeof err) == RET_ECORRUPT && vr.problems == 1 &&
          strstr(vr.first_problem, "which is not stored"),
          "verify finds the record without a chunk: %s", err);
    store_close(&s);
    rm_store(dir);
    free(dir);
}

/* A version 1 store (no KV databases) opens, is upgraded to version 2, and takes records. */
static void test_upgrade(void)
{
    char *dir = temp_dir(), err[512];
    struct Store *s;
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    struct StoreDoc d = mkdoc("d", NULL, "A short document about upgrades.");
    CHECK(put_docs(s, "c", &d, 1, err, sizeof err) == RET_OK, "put: %s", err);
    store_close(&s);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi meta, kv, kvuse;
    mdb_env_create(&env);
    mdb_env_set_maxdbs(env, 8);
    int rc = mdb_env_open(env, dir, 0, 0644);
    rc = rc ? rc : mdb_txn_begin(env, NULL, 0, &txn);
    rc = rc ? rc : mdb_dbi_open(txn, "meta", 0, &meta);
    rc = rc ? rc : mdb_dbi_open(txn, "kv", 0, &kv);
    rc = rc ? rc : mdb_dbi_open(txn, "kvuse", 0, &kvuse);
    rc = rc ? rc : mdb_drop(txn, kv, 1);
    rc = rc ? rc : mdb_drop(txn, kvuse, 1);
    uint8_t v1[4] = { 1, 0, 0, 0 };
    MDB_val k = { 6, "schema" }, v = { 4, v1 };
    rc = rc ? rc : mdb_put(txn, meta, &k, &v, 0);
    rc = rc ? rc : mdb_txn_commit(txn);
    mdb_env_close(env);
    CHECK(rc == 0, "make a version 1 store: %s", mdb_strerror(rc));
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "a version 1 store opens: %s", err);
    uint32_t coll, c0, n;
    ids(s, "c", "d", &coll, &c0, &n);
    struct StoreKvReport rep;
    CHECK(put(s, coll, c0, 1, 64, 1 << 20, &rep) == RET_OK && rep.written == 1, "takes a record");
    struct StoreVerifyReport vr;
    CHECK(verify(s, &vr, err, sizeof err) == RET_OK && vr.kv_records == 1, "verify: %s", err);
    store_close(&s);
    mdb_env_create(&env);
    mdb_env_set_maxdbs(env, 8);
    rc = mdb_env_open(env, dir, MDB_RDONLY, 0644);
    rc = rc ? rc : mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    rc = rc ? rc : mdb_dbi_open(txn, "meta", 0, &meta);
    rc = rc ? rc : mdb_get(txn, meta, &k, &v);
    CHECK(rc == 0 && v.mv_size == 4 && ((uint8_t *)v.mv_data)[0] == STORE_SCHEMA_VERSION,
          "the store says version %d now", STORE_SCHEMA_VERSION);
    if (rc == 0) mdb_txn_abort(txn);
    mdb_env_close(env);
    rm_store(dir);
    free(dir);
}

int main(void)
{
    test_lifecycle();
    test_budget_and_damage();
    test_upgrade();
    return check_report("test_store_kv");
}
