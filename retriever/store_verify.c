/* Full consistency check of the store from one read snapshot: documents, chunks and postings
 * must describe each other exactly. Each chunk is re-analysed and its (term, tf) pairs are
 * folded into a 64-bit sum; the postings pass folds what the index holds for that chunk the
 * same way, so one sequential pass over each database proves the index matches the text. */
#include "retriever/store_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/postings.h"
#include "retriever/status.h"
#include "text/hash.h"
#include "text/utf8.h"

struct ChunkCheck {
    uint32_t id, n_terms;
    uint32_t uniq_expected, uniq_seen;
    uint64_t sig_expected, sig_seen;
};

struct Verify {
    struct Store *s;
    MDB_txn *txn;
    struct StoreVerifyReport *rep;
    struct ChunkCheck *chunks;
    size_t n_chunks, cap_chunks;
    uint64_t seen_docs, seen_chunks, seen_postings_keys; /* entries visited, all collections */
    uint64_t seen_kv, seen_kvuse;
};

static void problem(struct Verify *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(struct Verify *v, const char *fmt, ...)
{
    if (v->rep->problems++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(v->rep->first_problem, sizeof v->rep->first_problem, fmt, ap);
        va_end(ap);
    }
}

/* A (term, tf) pair's share of a chunk's signature: the sums over the chunk's bag and over its
 * postings must agree. */
static uint64_t pair_hash(const char *term, size_t len, uint32_t tf)
{
    return hash_u64(hash_bytes(term, len) ^ hash_u64(tf));
}

static struct ChunkCheck *find_chunk(struct Verify *v, uint32_t id)
{
    size_t lo = 0, hi = v->n_chunks;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (v->chunks[mid].id < id) lo = mid + 1;
        else if (v->chunks[mid].id > id) hi = mid;
        else return &v->chunks[mid];
    }
    return NULL;
}

static int has_prefix(const MDB_val *k, uint32_t coll)
{
    return k->mv_size >= 4 && get_be32(k->mv_data) == coll;
}

static int verify_docs(struct Verify *v, const struct CollRecord *rec, const char *name,
                       uint64_t *n_docs, uint64_t *text_bytes, uint64_t *chunks_claimed)
{
    MDB_cursor *cur;
    int rc = mdb_cursor_open(v->txn, v->s->db_docs, &cur);
    if (rc)
        return rc;
    uint8_t kb[4];
    put_be32(kb, rec->id);
    MDB_val k = { 4, kb }, d;
    for (rc = mdb_cursor_get(cur, &k, &d, MDB_SET_RANGE); rc == 0 && has_prefix(&k, rec->id);
         rc = mdb_cursor_get(cur, &k, &d, MDB_NEXT)) {
        v->seen_docs++;
        struct DocHeader h;
        const char *title, *text;
        const void *meta;
        size_t id_len = k.mv_size - 4;
        if (doc_record_decode(&d, &h, &title, &meta, &text)) {
            problem(v, "collection \"%s\": malformed document record", name);
            continue;
        }
        if (id_len == 0 || id_len > INDEX_MAX_ID_BYTES || !utf8_valid((const char *)k.mv_data + 4, id_len, NULL))
            problem(v, "collection \"%s\": document with an invalid id", name);
        if (!utf8_valid(text, h.text_len, NULL) || !utf8_valid(title, h.title_len, NULL))
            problem(v, "collection \"%s\": document \"%.*s\" has invalid UTF-8", name, (int)id_len,
                    (const char *)k.mv_data + 4);
        char why[512];
        if (doc_record_check(v->s, name, &k, &d, &h, why, sizeof why))
            problem(v, "%s", why);
        v->rep->docs_unsummed += !h.summed;
        if ((uint64_t)h.first_chunk + h.n_chunks > rec->next_chunk_id)
            problem(v, "collection \"%s\": document \"%.*s\" claims chunk ids beyond the allocator",
                    name, (int)id_len, (const char *)k.mv_data + 4);
        (*n_docs)++;
        *text_bytes += h.text_len;
        *chunks_claimed += h.n_chunks;
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND || rc == 0 ? 0 : rc;
}

static int verify_chunks(struct Verify *v, const struct CollRecord *rec, const char *name,
                         struct Analyzer *an, struct TermBag *bag, uint64_t *total_terms)
{
    MDB_cursor *cur;
    int rc = mdb_cursor_open(v->txn, v->s->db_chunks, &cur);
    if (rc)
        return rc;
    uint8_t kb[4];
    put_be32(kb, rec->id);
    MDB_val k = { 4, kb }, d;
    v->n_chunks = 0;
    for (rc = mdb_cursor_get(cur, &k, &d, MDB_SET_RANGE); rc == 0 && has_prefix(&k, rec->id);
         rc = mdb_cursor_get(cur, &k, &d, MDB_NEXT)) {
        v->seen_chunks++;
        if (k.mv_size != 8) {
            problem(v, "collection \"%s\": malformed chunk key", name);
            continue;
        }
        uint32_t cid = get_be32((const uint8_t *)k.mv_data + 4);
        struct ChunkRecord cr;
        const char *did;
        size_t did_len;
        if (chunk_record_decode(&d, &cr, &did, &did_len)) {
            problem(v, "collection \"%s\": chunk %u: malformed record", name, cid);
            continue;
        }
        uint8_t dkb[KEY_MAX];
        MDB_val dk = { key_doc(dkb, rec->id, did, did_len), dkb }, dv;
        struct DocHeader h;
        const char *title, *text;
        const void *meta;
        int grc = mdb_get(v->txn, v->s->db_docs, &dk, &dv);
        if (grc == MDB_NOTFOUND) {
            problem(v, "collection \"%s\": orphan chunk %u (document \"%.*s\" is gone)", name, cid,
                    (int)did_len, did);
            continue;
        }
        if (grc)
            return grc;
        if (doc_record_decode(&dv, &h, &title, &meta, &text))
            continue; /* reported by the documents pass */
        if (cid < h.first_chunk || cid - h.first_chunk >= h.n_chunks || cr.chunk != cid - h.first_chunk) {
            problem(v, "collection \"%s\": chunk %u is not one of document \"%.*s\"'s chunks", name,
                    cid, (int)did_len, did);
            continue;
        }
        if (cr.byte_end > h.text_len) {
            problem(v, "collection \"%s\": chunk %u lies outside its document", name, cid);
            continue;
        }
        char why[512];
        if (chunk_record_check(v->s, name, cid, &d, &cr, did, did_len, title, h.title_len, text,
                               why, sizeof why))
            problem(v, "%s", why);
        if (index_chunk_terms(an, rec->index_flags, title, h.title_len, cr.heading, cr.heading_len,
                              text + cr.byte_start, cr.byte_end - cr.byte_start, bag))
            return ENOMEM;
        if (bag->total != cr.n_terms)
            problem(v, "collection \"%s\": chunk %u length %u, analysed %llu", name, cid, cr.n_terms,
                    (unsigned long long)bag->total);
        if (v->n_chunks == v->cap_chunks) {
            size_t c = v->cap_chunks ? v->cap_chunks * 2 : 1024;
            struct ChunkCheck *p = realloc(v->chunks, c * sizeof *p);
            if (!p)
                return ENOMEM;
            v->chunks = p;
            v->cap_chunks = c;
        }
        struct ChunkCheck *cc = &v->chunks[v->n_chunks++];
        memset(cc, 0, sizeof *cc);
        cc->id = cid;
        cc->n_terms = cr.n_terms;
        cc->uniq_expected = (uint32_t)bag->n;
        for (size_t i = 0; i < bag->n; i++)
            cc->sig_expected += pair_hash(termbag_term(bag, i), bag->items[i].len, bag->items[i].count);
        *total_terms += cr.n_terms;
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND || rc == 0 ? 0 : rc;
}

struct TermState {
    char term[ANALYZE_MAX_TERM + 1];
    size_t len;
    int have_header;
    struct TermHeader th;
    uint64_t count;
    uint32_t max_tf, min_len;
    int64_t last_id;
};

static void finish_term(struct Verify *v, const char *name, struct TermState *t)
{
    if (!t->len)
        return;
    if (!t->have_header)
        problem(v, "collection \"%s\": term \"%.*s\" has postings but no header", name, (int)t->len, t->term);
    else if (t->count != t->th.df)
        problem(v, "collection \"%s\": term \"%.*s\" df %u but %llu postings", name, (int)t->len,
                t->term, t->th.df, (unsigned long long)t->count);
    else if (t->max_tf > t->th.max_tf || t->min_len < t->th.min_len)
        problem(v, "collection \"%s\": term \"%.*s\" header bounds do not cover its postings", name,
                (int)t->len, t->term);
    v->rep->terms++;
    t->len = 0;
}

static int verify_postings(struct Verify *v, const struct CollRecord *rec, const char *name)
{
    MDB_cursor *cur;
    int rc = mdb_cursor_open(v->txn, v->s->db_postings, &cur);
    if (rc)
        return rc;
    struct Posting *buf = malloc(POSTINGS_BLOCK * 4 * sizeof *buf);
    if (!buf) {
        mdb_cursor_close(cur);
        return ENOMEM;
    }
    uint8_t kb[4];
    put_be32(kb, rec->id);
    MDB_val k = { 4, kb }, d;
    struct TermState t;
    memset(&t, 0, sizeof t);
    for (rc = mdb_cursor_get(cur, &k, &d, MDB_SET_RANGE); rc == 0 && has_prefix(&k, rec->id);
         rc = mdb_cursor_get(cur, &k, &d, MDB_NEXT)) {
        v->seen_postings_keys++;
        const char *kp = (const char *)k.mv_data + 4;
        const char *z = memchr(kp, 0, k.mv_size - 4);
        size_t tlen = z ? (size_t)(z - kp) : 0;
        size_t rest = z ? k.mv_size - 4 - tlen - 1 : 1;
        if (!z || tlen == 0 || tlen > ANALYZE_MAX_TERM || (rest != 0 && rest != 4)) {
            problem(v, "collection \"%s\": malformed postings key", name);
            continue;
        }
        if (t.len != tlen || memcmp(t.term, kp, tlen) != 0) {
            finish_term(v, name, &t);
            memcpy(t.term, kp, tlen);
            t.len = tlen;
            t.have_header = 0;
            t.count = 0;
            t.max_tf = 0;
            t.min_len = UINT32_MAX;
            t.last_id = -1;
        }
        if (rest == 0) {
            if (term_header_decode(&d, &t.th))
                problem(v, "collection \"%s\": term \"%.*s\": malformed header", name, (int)tlen, kp);
            else
                t.have_header = 1;
            continue;
        }
        uint32_t base = get_be32((const uint8_t *)z + 1);
        size_t n;
        if (postings_decode(base, d.mv_data, d.mv_size, buf, POSTINGS_BLOCK * 4, &n) || n == 0) {
            problem(v, "collection \"%s\": term \"%.*s\": malformed or empty block at %u", name,
                    (int)tlen, kp, base);
            continue;
        }
        if ((int64_t)buf[0].id <= t.last_id)
            problem(v, "collection \"%s\": term \"%.*s\": blocks overlap at %u", name, (int)tlen, kp, base);
        for (size_t i = 0; i < n; i++) {
            struct ChunkCheck *cc = find_chunk(v, buf[i].id);
            v->rep->postings++;
            if (!cc) {
                problem(v, "collection \"%s\": term \"%.*s\" posting points at dead chunk %u", name,
                        (int)tlen, kp, buf[i].id);
                continue;
            }
            if (buf[i].len != cc->n_terms)
                problem(v, "collection \"%s\": term \"%.*s\" posting for chunk %u has length %u, chunk has %u",
                        name, (int)tlen, kp, buf[i].id, buf[i].len, cc->n_terms);
            cc->uniq_seen++;
            cc->sig_seen += pair_hash(kp, tlen, buf[i].tf);
            if (buf[i].tf > t.max_tf) t.max_tf = buf[i].tf;
            if (buf[i].len < t.min_len) t.min_len = buf[i].len;
        }
        t.count += n;
        t.last_id = buf[n - 1].id;
    }
    finish_term(v, name, &t);
    free(buf);
    mdb_cursor_close(cur);
    if (rc != MDB_NOTFOUND && rc != 0)
        return rc;
    for (size_t i = 0; i < v->n_chunks; i++) {
        const struct ChunkCheck *cc = &v->chunks[i];
        if (cc->uniq_seen != cc->uniq_expected || cc->sig_seen != cc->sig_expected)
            problem(v, "collection \"%s\": chunk %u: the index holds %u terms, the text has %u%s", name,
                    cc->id, cc->uniq_seen, cc->uniq_expected,
                    cc->uniq_seen == cc->uniq_expected ? " (different terms or frequencies)" : "");
    }
    return 0;
}

/* The collection's chunk KV records: each under a live chunk, whole (header and checksum),
 * with a use entry of its size; each use entry with its record. */
static int verify_kv(struct Verify *v, const struct CollRecord *rec, const char *name)
{
    MDB_cursor *cur;
    int rc = mdb_cursor_open(v->txn, v->s->db_kv, &cur);
    if (rc)
        return rc;
    uint8_t from[KV_KEY_SIZE];
    MDB_val k = { kv_key(from, rec->id, 0, 0), from }, d;
    for (rc = mdb_cursor_get(cur, &k, &d, MDB_SET_RANGE); rc == 0 && has_prefix(&k, rec->id);
         rc = mdb_cursor_get(cur, &k, &d, MDB_NEXT)) {
        v->seen_kv++;
        v->rep->kv_records++;
        v->rep->kv_bytes += d.mv_size;
        if (k.mv_size != KV_KEY_SIZE) {
            problem(v, "collection \"%s\": malformed chunk KV key", name);
            continue;
        }
        uint32_t cid = get_be32((const uint8_t *)k.mv_data + 4);
        const void *payload;
        size_t len;
        if (!find_chunk(v, cid))
            problem(v, "collection \"%s\": KV record of chunk %u, which is not stored", name, cid);
        if (kv_record_check(&d, &payload, &len))
            problem(v, "collection \"%s\": the KV record of chunk %u is damaged (header or "
                    "checksum)", name, cid);
        MDB_val uk = k, ud;
        int r2 = mdb_get(v->txn, v->s->db_kvuse, &uk, &ud);
        if (r2 == MDB_NOTFOUND || (r2 == 0 && (ud.mv_size != 16 ||
                                               get_le64((const uint8_t *)ud.mv_data + 8) != d.mv_size)))
            problem(v, "collection \"%s\": the KV record of chunk %u has no use entry of its "
                    "size", name, cid);
        else if (r2)
            rc = r2;
        if (rc)
            break;
    }
    mdb_cursor_close(cur);
    if (rc && rc != MDB_NOTFOUND)
        return rc;
    if ((rc = mdb_cursor_open(v->txn, v->s->db_kvuse, &cur)))
        return rc;
    k = (MDB_val){ KV_KEY_SIZE, from };
    for (rc = mdb_cursor_get(cur, &k, &d, MDB_SET_RANGE); rc == 0 && has_prefix(&k, rec->id);
         rc = mdb_cursor_get(cur, &k, &d, MDB_NEXT)) {
        v->seen_kvuse++;
        MDB_val rk = k, rd;
        int r2 = mdb_get(v->txn, v->s->db_kv, &rk, &rd);
        if (r2 == MDB_NOTFOUND)
            problem(v, "collection \"%s\": a KV use entry without its record", name);
        else if (r2) {
            rc = r2;
            break;
        }
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

static int verify_collection(struct Verify *v, const char *name, size_t name_len, const MDB_val *val)
{
    char nm[INDEX_MAX_COLLECTION_BYTES + 1];
    size_t nl = name_len < sizeof nm - 1 ? name_len : sizeof nm - 1;
    memcpy(nm, name, nl);
    nm[nl] = 0;
    struct CollRecord rec;
    if (coll_record_decode(val, &rec)) {
        problem(v, "collection \"%s\": malformed record", nm);
        return 0;
    }
    v->rep->collections++;
    struct Analyzer *an = NULL;
    struct TermBag bag;
    termbag_init(&bag);
    if (analyzer_new(rec.analyzer_flags, &an, NULL, 0))
        return ENOMEM;
    uint64_t n_docs = 0, text_bytes = 0, claimed = 0, total_terms = 0;
    int rc = verify_docs(v, &rec, nm, &n_docs, &text_bytes, &claimed);
    if (!rc)
        rc = verify_chunks(v, &rec, nm, an, &bag, &total_terms);
    if (!rc)
        rc = verify_postings(v, &rec, nm);
    if (!rc)
        rc = verify_kv(v, &rec, nm);
    analyzer_destroy(&an);
    termbag_free(&bag);
    if (rc)
        return rc;
    if (claimed != v->n_chunks)
        problem(v, "collection \"%s\": documents list %llu chunks, %zu chunk records match them", nm,
                (unsigned long long)claimed, v->n_chunks);
    if (n_docs != rec.n_docs || v->n_chunks != rec.n_chunks || total_terms != rec.total_terms ||
        text_bytes != rec.text_bytes)
        problem(v, "collection \"%s\": statistics say %llu docs, %llu chunks, %llu terms, %llu bytes; "
                   "recomputed %llu, %zu, %llu, %llu", nm,
                (unsigned long long)rec.n_docs, (unsigned long long)rec.n_chunks,
                (unsigned long long)rec.total_terms, (unsigned long long)rec.text_bytes,
                (unsigned long long)n_docs, v->n_chunks, (unsigned long long)total_terms,
                (unsigned long long)text_bytes);
    v->rep->docs += n_docs;
    v->rep->chunks += v->n_chunks;
    return 0;
}

int store_verify(struct Store *s, const char *collection, struct StoreVerifyReport *rep,
                 char *err, size_t errlen)
{
    memset(rep, 0, sizeof *rep);
    struct Verify v;
    memset(&v, 0, sizeof v);
    v.s = s;
    v.rep = rep;
    int st = store_txn_begin(s, MDB_RDONLY, &v.txn, err, errlen);
    if (st)
        return st;
    int rc = 0;
    if (collection) {
        if ((st = index_validate_collection(collection, err, errlen)))
            goto out;
        MDB_val k = { strlen(collection), (void *)collection }, d;
        rc = mdb_get(v.txn, s->db_stats, &k, &d);
        if (rc == MDB_NOTFOUND) {
            st = ret_fail(err, errlen, RET_ENOTFOUND, "unknown collection \"%s\"", collection);
            goto out;
        }
        if (!rc)
            rc = verify_collection(&v, collection, strlen(collection), &d);
    } else {
        MDB_cursor *cur;
        rc = mdb_cursor_open(v.txn, s->db_stats, &cur);
        MDB_val k, d;
        if (!rc) {
            for (rc = mdb_cursor_get(cur, &k, &d, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &k, &d, MDB_NEXT))
                if ((rc = verify_collection(&v, k.mv_data, k.mv_size, &d)))
                    break;
            mdb_cursor_close(cur);
            if (rc == MDB_NOTFOUND)
                rc = 0;
        }
        /* Records under no collection are orphans too. */
        MDB_stat sd, sc, sp;
        if (!rc) rc = mdb_stat(v.txn, s->db_docs, &sd);
        if (!rc) rc = mdb_stat(v.txn, s->db_chunks, &sc);
        if (!rc) rc = mdb_stat(v.txn, s->db_postings, &sp);
        if (!rc && (sd.ms_entries != v.seen_docs || sc.ms_entries != v.seen_chunks ||
                    sp.ms_entries != v.seen_postings_keys))
            problem(&v, "records outside every collection: %zu docs, %zu chunks, %zu postings keys",
                    sd.ms_entries - v.seen_docs, sc.ms_entries - v.seen_chunks,
                    sp.ms_entries - v.seen_postings_keys);
        MDB_stat skv, sku;
        if (!rc) rc = mdb_stat(v.txn, s->db_kv, &skv);
        if (!rc) rc = mdb_stat(v.txn, s->db_kvuse, &sku);
        if (!rc && (skv.ms_entries != v.seen_kv || sku.ms_entries != v.seen_kvuse))
            problem(&v, "chunk KV records outside every collection: %zu records, %zu use entries",
                    skv.ms_entries - v.seen_kv, sku.ms_entries - v.seen_kvuse);
        MDB_val tk = { 8, "kv_bytes" }, tv;
        int r2 = rc ? rc : mdb_get(v.txn, s->db_meta, &tk, &tv);
        uint64_t total = r2 == 0 && tv.mv_size == 8 ? get_le64(tv.mv_data) : 0;
        if (!rc && r2 != 0 && r2 != MDB_NOTFOUND)
            rc = r2;
        else if (!rc && ((r2 == 0 && tv.mv_size != 8) || total != rep->kv_bytes))
            problem(&v, "the chunk KV total says %llu bytes; the records hold %llu",
                    (unsigned long long)total, (unsigned long long)rep->kv_bytes);
    }
    if (rc == ENOMEM)
        st = ret_fail(err, errlen, RET_ENOMEM, "out of memory while verifying");
    else if (rc && (rc == MDB_CORRUPTED || rc == MDB_PAGE_NOTFOUND)) {
        /* a damaged page stops the walk: a finding, with those met before it */
        problem(&v, "LMDB: %s (the walk stopped there)", mdb_strerror(rc));
        st = ret_fail(err, errlen, RET_ECORRUPT, "%llu problem(s); first: %s%s%s",
                      (unsigned long long)rep->problems, rep->first_problem,
                      rep->problems > 1 ? "; the walk stopped at " : "",
                      rep->problems > 1 ? mdb_strerror(rc) : "");
    } else if (rc)
        st = store_mdb_fail(err, errlen, rc, "verify");
    else if (rep->problems)
        st = ret_fail(err, errlen, RET_ECORRUPT, "%llu problem(s); first: %s",
                      (unsigned long long)rep->problems, rep->first_problem);
out:
    store_txn_abort(s, v.txn);
    free(v.chunks);
    return st;
}
