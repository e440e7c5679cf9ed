/* Checksums of document and chunk records (retriever/store_sum.c, docs/retriever.md):
 * - a document whose text is changed under the store (one letter, or a byte that is not
 *   UTF-8) is never handed out: get and list fail with RET_ECORRUPT naming it, a search hit in
 *   the changed chunk likewise, verify finds it; the other documents are served;
 * - a chunk record changed (its length in terms) fails the search hit and verify;
 * - a store of schema 2 (records without checksums) is upgraded when opened: its documents
 *   are served and verify passes, counting them as older than checksums; one whose text is
 *   not UTF-8 is refused all the same; a document written since carries a checksum; in a
 *   store created with checksums, a record without one is damage;
 * - a schema 3 or 4 store is upgraded as it is; the pages of a chunk record are covered by its
 *   checksum. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <lmdb.h>

#include "retriever/status.h"
#include "retriever/store.h"
#include "retriever/store_internal.h"
#include "text/tokcount.h"
#include "tests/check.h"
#include "tests/store_util.h"

#define COLL "c"

static const char *const TEXTS[] = {
    "The Danube flows through ten countries. It reaches the Black Sea in Romania.",
    "Mont Blanc is the highest peak of the Alps. The Matterhorn is famous for its shape.",
    "Paris is the capital of France. The Seine crosses it on its way to the sea.",
};
#define N_DOCS 3

static int put_all(struct Store *s, char *err, size_t errlen)
{
    struct StoreDoc d[N_DOCS] = { mkdoc("danube", "Rivers", TEXTS[0]),
                                  mkdoc("alps", "Mountains", TEXTS[1]),
                                  mkdoc("paris", NULL, TEXTS[2]) };
    struct TokenCounter tc;
    tokcount_simple(&tc);
    return store_put_docs(s, COLL, d, N_DOCS, NULL, &tc, err, errlen);
}

/* Opens the environment of dir with LMDB alone, for changing records under the store. */
static int raw_open(const char *dir, MDB_env **env, MDB_txn **txn, MDB_dbi *docs, MDB_dbi *chunks,
                    MDB_dbi *meta)
{
    int rc = mdb_env_create(env);
    if (!rc) rc = mdb_env_set_maxdbs(*env, 8);
    if (!rc) rc = mdb_env_open(*env, dir, 0, 0644);
    if (!rc) rc = mdb_txn_begin(*env, NULL, 0, txn);
    if (!rc) rc = mdb_dbi_open(*txn, "docs", 0, docs);
    if (!rc) rc = mdb_dbi_open(*txn, "chunks", 0, chunks);
    if (!rc) rc = mdb_dbi_open(*txn, "meta", 0, meta);
    return rc;
}

static int raw_close(MDB_env *env, MDB_txn *txn, int rc)
{
    rc = rc ? rc : mdb_txn_commit(txn);
    if (rc && txn)
        mdb_txn_abort(txn);
    mdb_env_close(env);
    return rc;
}

/* The document `id` of collection 1 rewritten: the byte at `at` of its text set to `byte`. */
static int change_text(const char *dir, const char *id, size_t at, uint8_t byte)
{
    MDB_env *env;
    MDB_txn *txn = NULL;
    MDB_dbi docs, chunks, meta;
    int rc = raw_open(dir, &env, &txn, &docs, &chunks, &meta);
    uint8_t kb[KEY_MAX];
    MDB_val k = { key_doc(kb, 1, id, strlen(id)), kb }, v;
    rc = rc ? rc : mdb_get(txn, docs, &k, &v);
    if (!rc) {
        uint8_t *copy = malloc(v.mv_size);
        memcpy(copy, v.mv_data, v.mv_size);
        uint32_t title = get_le32(copy + 8) & ~DOC_SUMMED;
        uint32_t meta_len = get_le32(copy + 12) & ~DOC_STRUCTURED;
        copy[DOC_HEADER_SIZE + title + meta_len + at] = byte;
        MDB_val nv = { v.mv_size, copy };
        rc = mdb_put(txn, docs, &k, &nv, 0);
        free(copy);
    }
    return raw_close(env, txn, rc);
}

/* Chunk `cid` of collection 1: its length in terms changed by one. */
static int change_chunk(const char *dir, uint32_t cid)
{
    MDB_env *env;
    MDB_txn *txn = NULL;
    MDB_dbi docs, chunks, meta;
    int rc = raw_open(dir, &env, &txn, &docs, &chunks, &meta);
    uint8_t kb[8], copy[CHUNK_RECORD_MAX];
    MDB_val k = { key_chunk(kb, 1, cid), kb }, v;
    rc = rc ? rc : mdb_get(txn, chunks, &k, &v);
    if (!rc) {
        memcpy(copy, v.mv_data, v.mv_size);
        put_le32(copy + 4, get_le32(copy + 4) + 1);
        MDB_val nv = { v.mv_size, copy };
        rc = mdb_put(txn, chunks, &k, &nv, 0);
    }
    return raw_close(env, txn, rc);
}

/* Every document and chunk record rewritten as schema 2 wrote them (no checksums), and the
 * schema set to `version`, "unsummed" removed: a store as an earlier build left it. */
static int make_old(const char *dir, uint32_t version)
{
    MDB_env *env;
    MDB_txn *txn = NULL;
    MDB_dbi docs, chunks, meta;
    int rc = raw_open(dir, &env, &txn, &docs, &chunks, &meta);
    MDB_dbi dbs[2] = { docs, chunks };
    for (int d = 0; d < 2 && !rc; d++) {
        /* the records first, then the writes: a cursor does not walk on over records that
         * change size under it */
        MDB_val keys[16], vals[16];
        size_t n = 0;
        MDB_cursor *cur;
        if ((rc = mdb_cursor_open(txn, dbs[d], &cur)))
            break;
        MDB_val k, v;
        for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == 0 && n < 16;
             rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
            keys[n] = (MDB_val){ k.mv_size, malloc(k.mv_size) };
            vals[n] = (MDB_val){ v.mv_size, malloc(v.mv_size) };
            memcpy(keys[n].mv_data, k.mv_data, k.mv_size);
            memcpy(vals[n].mv_data, v.mv_data, v.mv_size);
            n++;
        }
        mdb_cursor_close(cur);
        if (rc == MDB_NOTFOUND)
            rc = 0;
        for (size_t i = 0; i < n; i++) {
            uint8_t *copy = vals[i].mv_data;
            if (d == 0) {
                put_le32(copy + 8, get_le32(copy + 8) & ~DOC_SUMMED);
                put_le32(copy + 12, get_le32(copy + 12) & ~DOC_STRUCTURED);
                vals[i].mv_size -= DOC_SUM_SIZE;
            } else {
                put_le32(copy + CHUNK_SUM_OFFSET, 0);
            }
            rc = rc ? rc : mdb_put(txn, dbs[d], &keys[i], &vals[i], 0);
            free(keys[i].mv_data);
            free(vals[i].mv_data);
        }
    }
    uint8_t vb[4];
    put_le32(vb, version);
    MDB_val sk = { 6, "schema" }, sv = { 4, vb }, uk = { 8, "unsummed" };
    rc = rc ? rc : mdb_put(txn, meta, &sk, &sv, 0);
    if (!rc && (rc = mdb_del(txn, meta, &uk, NULL)) == MDB_NOTFOUND)
        rc = 0;
    return raw_close(env, txn, rc);
}

static int get(struct Store *s, const char *id, struct StoreDocView *dv, char *err, size_t errlen)
{
    struct StoreReader *r;
    int st = store_read_begin(s, &r, err, errlen);
    if (!st)
        st = store_get_doc(r, COLL, id, strlen(id), dv, err, errlen);
    if (!st)
        st = strlen(dv->id) == dv->id_len ? RET_OK : RET_EIO;
    store_read_end(&r);
    return st;
}

static int list(struct Store *s, size_t *n, char *err, size_t errlen)
{
    struct StoreReader *r;
    struct StoreDocView page[8];
    int st = store_read_begin(s, &r, err, errlen);
    if (!st)
        st = store_list_docs(r, COLL, NULL, 0, page, 8, n, err, errlen);
    store_read_end(&r);
    return st;
}

/* The top hit's document for query q (RET_OK), or the search's status. */
static int search(struct Store *s, const char *q, char *doc, size_t cap, char *err, size_t errlen)
{
    struct StoreReader *r;
    struct SearchOptions so;
    search_options_default(&so);
    struct SearchHit hits[10];
    size_t n = 0;
    int st = store_read_begin(s, &r, err, errlen);
    if (!st)
        st = store_search(r, COLL, q, strlen(q), &so, hits, 10, &n, NULL, err, errlen);
    if (!st && n == 0)
        st = RET_ENOTFOUND;
    if (!st)
        snprintf(doc, cap, "%.*s", (int)hits[0].doc_id_len, hits[0].doc_id);
    store_read_end(&r);
    return st;
}

static int verify(struct Store *s, struct StoreVerifyReport *rep)
{
    char err[512];
    memset(rep, 0, sizeof *rep);
    return store_verify(s, NULL, rep, err, sizeof err);
}

/* A fresh store: records carry checksums; changed text and chunk records are caught. */
static void test_damage(void)
{
    char *dir = temp_dir(), err[512], doc[64];
    struct Store *s;
    struct StoreDocView dv;
    struct StoreVerifyReport rep;
    size_t n;
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(put_all(s, err, sizeof err) == RET_OK, "put: %s", err);
    CHECK(verify(s, &rep) == RET_OK && rep.problems == 0 && rep.docs == N_DOCS &&
          rep.docs_unsummed == 0, "a fresh store verifies: %s", rep.first_problem);
    store_close(&s);

    /* one letter of the Danube's text, inside its only chunk: still UTF-8, not what was stored */
    CHECK(change_text(dir, "danube", 4, 'X') == 0, "change a letter");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "reopen: %s", err);
    int st = get(s, "danube", &dv, err, sizeof err);
    CHECK(st == RET_ECORRUPT && strstr(err, "document \"danube\" in collection \"c\" is damaged") &&
          strstr(err, "checksum") && strstr(err, "verify"), "get refuses it: %d %s", st, err);
    printf("get: %s\n", err);
    CHECK(get(s, "alps", &dv, err, sizeof err) == RET_OK && dv.text_len == strlen(TEXTS[1]) &&
          !memcmp(dv.text, TEXTS[1], dv.text_len), "the others are served: %s", err);
    CHECK(list(s, &n, err, sizeof err) == RET_ECORRUPT && strstr(err, "\"danube\""),
          "list refuses the page: %s", err);
    st = search(s, "Romania Black Sea", doc, sizeof doc, err, sizeof err);
    CHECK(st == RET_ECORRUPT && strstr(err, "\"danube\"") && strstr(err, "chunk"),
          "a search hit in the changed chunk is refused: %d %s", st, err);
    printf("search: %s\n", err);
    CHECK(search(s, "Matterhorn", doc, sizeof doc, err, sizeof err) == RET_OK &&
          !strcmp(doc, "alps"), "a search that finds only sound chunks is answered: %s", err);
    CHECK(verify(s, &rep) == RET_ECORRUPT && rep.problems >= 2 &&
          strstr(rep.first_problem, "danube"), "verify finds it: %llu %s",
          (unsigned long long)rep.problems, rep.first_problem);
    printf("verify: %llu problems, first: %s\n", (unsigned long long)rep.problems,
           rep.first_problem);
    /* replacing a damaged document is refused too: its old postings come from its text */
    struct StoreDoc d = mkdoc("danube", NULL, "A new text.");
    struct TokenCounter tc;
    tokcount_simple(&tc);
    CHECK(store_put_docs(s, COLL, &d, 1, NULL, &tc, err, sizeof err) == RET_ECORRUPT &&
          strstr(err, "\"danube\""), "replace refused: %s", err);
    store_close(&s);

    /* a byte that is not UTF-8 in Paris's text */
    CHECK(change_text(dir, "danube", 4, 'D') == 0, "put the letter back");
    CHECK(change_text(dir, "paris", 6, 0xFF) == 0, "an invalid byte");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "reopen: %s", err);
    CHECK(get(s, "danube", &dv, err, sizeof err) == RET_OK, "the letter restored: %s", err);
    CHECK(get(s, "paris", &dv, err, sizeof err) == RET_ECORRUPT && strstr(err, "\"paris\""),
          "get refuses invalid UTF-8: %s", err);
    store_close(&s);

    /* a chunk record: its length in terms */
    CHECK(change_text(dir, "paris", 6, 'i') == 0, "put the byte back");
    CHECK(change_chunk(dir, 1) == 0, "change chunk 1");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "reopen: %s", err);
    CHECK(get(s, "alps", &dv, err, sizeof err) == RET_OK, "the document itself is sound: %s", err);
    st = search(s, "Matterhorn", doc, sizeof doc, err, sizeof err);
    CHECK(st == RET_ECORRUPT && strstr(err, "chunk 1"), "the hit is refused: %d %s", st, err);
    CHECK(verify(s, &rep) == RET_ECORRUPT && rep.problems >= 1, "verify finds it");
    store_close(&s);
    rm_store(dir);
    free(dir);
}

/* A store of schema 2 (no checksums) and one of schema 3 holding a record without one. */
static void test_old_store(void)
{
    char *dir = temp_dir(), err[512], doc[64];
    struct Store *s;
    struct StoreDocView dv;
    struct StoreVerifyReport rep;
    size_t n;
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(put_all(s, err, sizeof err) == RET_OK, "put: %s", err);
    store_close(&s);
    CHECK(make_old(dir, 2) == 0, "make a schema 2 store");

    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "a schema 2 store opens: %s", err);
    CHECK(get(s, "danube", &dv, err, sizeof err) == RET_OK && dv.text_len == strlen(TEXTS[0]) &&
          !memcmp(dv.text, TEXTS[0], dv.text_len), "its documents are served: %s", err);
    CHECK(list(s, &n, err, sizeof err) == RET_OK && n == N_DOCS, "listed: %s", err);
    CHECK(search(s, "Matterhorn", doc, sizeof doc, err, sizeof err) == RET_OK &&
          !strcmp(doc, "alps"), "searched: %s", err);
    CHECK(verify(s, &rep) == RET_OK && rep.problems == 0 && rep.docs_unsummed == N_DOCS,
          "verify passes, %llu documents without checksums: %s",
          (unsigned long long)rep.docs_unsummed, rep.first_problem);
    /* a document written now carries one; replacing an old one works */
    struct StoreDoc d[2] = { mkdoc("danube", NULL, "The Danube, again, in a new version."),
                             mkdoc("rhine", NULL, "The Rhine starts in the Swiss Alps.") };
    struct TokenCounter tc;
    tokcount_simple(&tc);
    CHECK(store_put_docs(s, COLL, d, 2, NULL, &tc, err, sizeof err) == RET_OK, "put: %s", err);
    CHECK(verify(s, &rep) == RET_OK && rep.problems == 0 && rep.docs == N_DOCS + 1 &&
          rep.docs_unsummed == N_DOCS - 1, "two old documents left: %llu",
          (unsigned long long)rep.docs_unsummed);
    store_close(&s);

    /* an old record whose text is not UTF-8 is refused, though it has no checksum */
    CHECK(change_text(dir, "paris", 6, 0xC3) == 0, "an invalid byte in an old record");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "reopen: %s", err);
    CHECK(get(s, "paris", &dv, err, sizeof err) == RET_ECORRUPT && strstr(err, "\"paris\"") &&
          strstr(err, "not valid UTF-8"), "get refuses it: %s", err);
    CHECK(verify(s, &rep) == RET_ECORRUPT, "verify finds it");
    store_close(&s);
    rm_store(dir);
    free(dir);

    /* created with checksums: a record without one is damage, not an old record */
    dir = temp_dir();
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(put_all(s, err, sizeof err) == RET_OK, "put: %s", err);
    store_close(&s);
    CHECK(make_old(dir, STORE_SCHEMA_VERSION) == 0, "strip the checksums, keep the version");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(get(s, "alps", &dv, err, sizeof err) == RET_ECORRUPT && strstr(err, "no checksum"),
          "a record without a checksum in a store that always wrote them: %s", err);
    CHECK(verify(s, &rep) == RET_ECORRUPT, "verify finds it");
    store_close(&s);
    rm_store(dir);
    free(dir);
}

/* The meta records "schema" (its value into *version) and "unsummed" (whether present) of dir;
 * with set, the schema is first set to *version. */
static int meta_of(const char *dir, uint32_t *version, int *unsummed, int set)
{
    MDB_env *env;
    MDB_txn *txn = NULL;
    MDB_dbi docs, chunks, meta;
    int rc = raw_open(dir, &env, &txn, &docs, &chunks, &meta);
    uint8_t vb[4];
    put_le32(vb, *version);
    MDB_val sk = { 6, "schema" }, sv = { 4, vb }, uk = { 8, "unsummed" }, uv;
    if (!rc && set)
        rc = mdb_put(txn, meta, &sk, &sv, 0);
    if (!rc)
        rc = mdb_get(txn, meta, &sk, &sv);
    if (!rc)
        *version = get_le32(sv.mv_data);
    int got = rc ? rc : mdb_get(txn, meta, &uk, &uv);
    *unsummed = got == 0;
    if (!rc && got && got != MDB_NOTFOUND)
        rc = got;
    return raw_close(env, txn, rc);
}

/* A schema 3 store (checksums, no heading paths) is upgraded to 4 as it is: its records still
 * pass their checksums and it does not become "unsummed"; one that was upgraded from schema 2
 * to 3 stays "unsummed". */
static void test_schema_3(void)
{
    char *dir = temp_dir(), err[512], doc[64];
    struct Store *s;
    struct StoreVerifyReport rep;
    uint32_t version = 3;
    int unsummed = 1;
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(put_all(s, err, sizeof err) == RET_OK, "put: %s", err);
    store_close(&s);
    CHECK(meta_of(dir, &version, &unsummed, 1) == 0 && version == 3, "set schema 3");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "a schema 3 store opens: %s", err);
    CHECK(search(s, "Matterhorn", doc, sizeof doc, err, sizeof err) == RET_OK &&
          !strcmp(doc, "alps"), "searched: %s", err);
    CHECK(verify(s, &rep) == RET_OK && rep.problems == 0 && rep.docs_unsummed == 0,
          "verify passes, every record summed: %s", rep.first_problem);
    store_close(&s);
    CHECK(meta_of(dir, &version, &unsummed, 0) == 0 && version == STORE_SCHEMA_VERSION && !unsummed,
          "upgraded to %u (%u), not unsummed (%d)", STORE_SCHEMA_VERSION, version, unsummed);
    /* from schema 2 to 4, then set back to 3 as a build of schema 3 would have left it */
    CHECK(make_old(dir, 2) == 0, "make a schema 2 store");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    store_close(&s);
    version = 3;
    CHECK(meta_of(dir, &version, &unsummed, 1) == 0 && unsummed, "schema 3, unsummed");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(verify(s, &rep) == RET_OK && rep.problems == 0 && rep.docs_unsummed == N_DOCS,
          "its old records are still allowed: %s", rep.first_problem);
    store_close(&s);
    CHECK(meta_of(dir, &version, &unsummed, 0) == 0 && version == STORE_SCHEMA_VERSION && unsummed,
          "still unsummed");
    rm_store(dir);
    free(dir);
}

/* A document stored before chunks followed the structure (a summed record without
 * DOC_STRUCTURED, as schemas 3 and 4 wrote them) is re-chunked when it is ingested again
 * unchanged: counted as changed once, then unchanged. */
static void test_rechunked_when_old(void)
{
    char *dir = temp_dir(), err[512];
    struct Store *s;
    struct StoreVerifyReport rep;
    struct TokenCounter tc;
    tokcount_simple(&tc);
    struct StoreDoc d = mkdoc("guide", "Guide", "# Guide\n\nIntro text.\n\n## Cancel\n\nSend cancel.\n");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(store_put_docs(s, COLL, &d, 1, NULL, &tc, err, sizeof err) == RET_OK, "put: %s", err);
    store_close(&s);
    /* the record as a schema 4 build wrote it: the flag cleared, the checksum made again */
    MDB_env *env;
    MDB_txn *txn = NULL;
    MDB_dbi docs, chunks, meta;
    int rc = raw_open(dir, &env, &txn, &docs, &chunks, &meta);
    uint8_t kb[KEY_MAX];
    MDB_val k = { key_doc(kb, 1, "guide", 5), kb }, v;
    rc = rc ? rc : mdb_get(txn, docs, &k, &v);
    if (!rc) {
        uint8_t *copy = malloc(v.mv_size);
        memcpy(copy, v.mv_data, v.mv_size);
        put_le32(copy + 12, get_le32(copy + 12) & ~DOC_STRUCTURED);
        size_t body = v.mv_size - DOC_SUM_SIZE;
        put_le64(copy + body, doc_sum(&k, copy, body));
        MDB_val nv = { v.mv_size, copy };
        rc = mdb_put(txn, docs, &k, &nv, 0);
        free(copy);
    }
    CHECK(raw_close(env, txn, rc) == 0, "rewrite the record");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(verify(s, &rep) == RET_OK && rep.problems == 0, "the old record verifies: %s",
          rep.first_problem);
    struct StorePutReport pr;
    CHECK(store_put_docs_report(s, COLL, &d, 1, NULL, &tc, &pr, err, sizeof err) == RET_OK &&
          pr.changed == 1 && pr.unchanged == 0, "re-chunked (%zu changed, %zu unchanged): %s",
          pr.changed, pr.unchanged, err);
    CHECK(store_put_docs_report(s, COLL, &d, 1, NULL, &tc, &pr, err, sizeof err) == RET_OK &&
          pr.changed == 0 && pr.unchanged == 1, "then unchanged (%zu, %zu)", pr.changed,
          pr.unchanged);
    CHECK(verify(s, &rep) == RET_OK && rep.problems == 0, "verify: %s", rep.first_problem);
    store_close(&s);
    rm_store(dir);
    free(dir);
}

/* A schema 4 store (heading paths, no pages) is upgraded to 5 as it is; a document with page
 * markers written then has pages, and a changed page number in its chunk record is damage. */
static void test_schema_4(void)
{
    char *dir = temp_dir(), err[512], doc[64];
    struct Store *s;
    struct StoreVerifyReport rep;
    uint32_t version = 4;
    int unsummed = 1;
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "open: %s", err);
    CHECK(put_all(s, err, sizeof err) == RET_OK, "put: %s", err);
    store_close(&s);
    CHECK(meta_of(dir, &version, &unsummed, 1) == 0 && version == 4, "set schema 4");
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "a schema 4 store opens: %s", err);
    CHECK(search(s, "Matterhorn", doc, sizeof doc, err, sizeof err) == RET_OK &&
          !strcmp(doc, "alps"), "searched: %s", err);
    struct TokenCounter tc;
    tokcount_simple(&tc);
    struct StoreDoc pd = mkdoc("scan", "Scan", "<!-- page 7 -->\n\nThe glacier retreats.\n\n"
                                               "<!-- page 8 -->\n\nIts lake grows.\n");
    CHECK(store_put_docs(s, COLL, &pd, 1, NULL, &tc, err, sizeof err) == RET_OK, "put: %s", err);
    CHECK(verify(s, &rep) == RET_OK && rep.problems == 0 && rep.docs_unsummed == 0,
          "verify passes: %s", rep.first_problem);
    struct StoreReader *r;
    struct StoreChunkView cv;
    uint32_t cid = 0;
    int found = 0;
    CHECK(store_read_begin(s, &r, err, sizeof err) == RET_OK, "read");
    for (cid = 0; cid < 16 && !found; cid++)
        found = store_get_chunk(r, COLL, cid, &cv, err, sizeof err) == RET_OK && cv.doc_id_len == 4 &&
                !memcmp(cv.doc_id, "scan", 4);
    cid--;
    CHECK(found && cv.page_first == 7 && cv.page_last == 8, "pages 7-8 (%u-%u)", cv.page_first,
          cv.page_last);
    store_read_end(&r);
    store_close(&s);
    CHECK(meta_of(dir, &version, &unsummed, 0) == 0 && version == STORE_SCHEMA_VERSION && !unsummed,
          "upgraded to %u (%u), not unsummed (%d)", STORE_SCHEMA_VERSION, version, unsummed);
    /* the last page, 8, made 9 in the record: the checksum catches it */
    MDB_env *env;
    MDB_txn *txn = NULL;
    MDB_dbi docs, chunks, meta;
    int rc = raw_open(dir, &env, &txn, &docs, &chunks, &meta);
    uint8_t kb[8], copy[CHUNK_RECORD_MAX];
    MDB_val k = { key_chunk(kb, 1, cid), kb }, v;
    rc = rc ? rc : mdb_get(txn, chunks, &k, &v);
    if (!rc) {
        memcpy(copy, v.mv_data, v.mv_size);
        size_t at = v.mv_size - 4 - 4; /* no heading path: the pages end just before "scan" */
        CHECK(get_le32(copy + at) == 8, "the last page in the record");
        put_le32(copy + at, 9);
        MDB_val nv = { v.mv_size, copy };
        rc = mdb_put(txn, chunks, &k, &nv, 0);
    }
    CHECK(raw_close(env, txn, rc) == 0, "change the page: %s", mdb_strerror(rc));
    CHECK(store_open(dir, NULL, &s, err, sizeof err) == RET_OK, "reopen: %s", err);
    CHECK(verify(s, &rep) == RET_ECORRUPT && rep.problems == 1, "verify finds the changed page (%zu)",
          (size_t)rep.problems);
    store_close(&s);
    rm_store(dir);
    free(dir);
}

int main(void)
{
    test_damage();
    test_old_store();
    test_schema_3();
    test_schema_4();
    test_rechunked_when_old();
    return check_report("test_store_checksum");
}
