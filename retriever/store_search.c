/* BM25 search over the store: the query's terms become posting cursors that read blocks
 * straight from LMDB (seeking by block key to skip), MaxScore picks the top k, and the hits
 * are filled from the chunk and document records of the same snapshot. */
#include "retriever/store_internal.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/bm25.h"
#include "retriever/postings.h"
#include "retriever/status.h"

#define SEARCH_MAX_K 100000

struct LmdbSource {
    MDB_cursor *cur;
    uint8_t tkey[4 + ANALYZE_MAX_TERM + 5];
    size_t tlen;
    int positioned;          /* cursor sits on the block currently decoded */
    int corrupt;
    struct Posting buf[POSTINGS_BLOCK];
};

static int is_block(const struct LmdbSource *src, const MDB_val *k)
{
    return k->mv_size == src->tlen + 4 && memcmp(k->mv_data, src->tkey, src->tlen) == 0;
}

static int load(struct PostingCursor *c, struct LmdbSource *src, const MDB_val *k, const MDB_val *v)
{
    uint32_t base = get_be32((const uint8_t *)k->mv_data + src->tlen);
    size_t n;
    if (postings_decode(base, v->mv_data, v->mv_size, src->buf, POSTINGS_BLOCK, &n) || n == 0)
        return RET_ECORRUPT;
    c->buf = src->buf;
    c->n = n;
    src->positioned = 1;
    return 0;
}

/* Last id of the block at k/v, or -1 when malformed. */
static int64_t block_last(const struct LmdbSource *src, const MDB_val *k, const MDB_val *v)
{
    struct PostingsHeader h;
    uint32_t base = get_be32((const uint8_t *)k->mv_data + src->tlen);
    if (postings_header(base, v->mv_data, v->mv_size, &h))
        return -1;
    return h.last_id;
}

static int lmdb_refill(struct PostingCursor *c, uint32_t target)
{
    struct LmdbSource *src = c->src;
    MDB_val k, v;
    int rc;
    c->n = 0;
    if (src->positioned) {
        /* Sequential case: the next block usually holds the target. */
        rc = mdb_cursor_get(src->cur, &k, &v, MDB_NEXT);
        if (rc == MDB_NOTFOUND || (rc == 0 && !is_block(src, &k)))
            return 0;
        if (rc)
            return RET_EIO;
        int64_t last = block_last(src, &k, &v);
        if (last < 0)
            return RET_ECORRUPT;
        if (last >= target)
            return load(c, src, &k, &v);
    }
    uint8_t kb[sizeof src->tkey + 4];
    memcpy(kb, src->tkey, src->tlen);
    put_be32(kb + src->tlen, target);
    k.mv_size = src->tlen + 4;
    k.mv_data = kb;
    rc = mdb_cursor_get(src->cur, &k, &v, MDB_SET_RANGE);
    if (rc && rc != MDB_NOTFOUND)
        return RET_EIO;
    if (rc == 0 && is_block(src, &k) && get_be32((const uint8_t *)k.mv_data + src->tlen) == target)
        return load(c, src, &k, &v);
    /* The block before may still reach target. */
    rc = rc == MDB_NOTFOUND ? mdb_cursor_get(src->cur, &k, &v, MDB_LAST)
                            : mdb_cursor_get(src->cur, &k, &v, MDB_PREV);
    if (rc == 0 && is_block(src, &k)) {
        int64_t last = block_last(src, &k, &v);
        if (last < 0)
            return RET_ECORRUPT;
        if (last >= target)
            return load(c, src, &k, &v);
    }
    if (rc && rc != MDB_NOTFOUND)
        return RET_EIO;
    /* Otherwise the first block starting after target. */
    k.mv_size = src->tlen + 4;
    k.mv_data = kb;
    rc = mdb_cursor_get(src->cur, &k, &v, MDB_SET_RANGE);
    if (rc == 0 && is_block(src, &k))
        return load(c, src, &k, &v);
    return rc == 0 || rc == MDB_NOTFOUND ? 0 : RET_EIO;
}

static int cmp_range(const void *a, const void *b)
{
    const struct IdRange *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

int store_search(struct StoreReader *r, const char *collection, const char *query, size_t qlen,
                 const struct SearchOptions *o, struct SearchHit *hits, size_t cap, size_t *n_hits,
                 struct Bm25Stats *stats, char *err, size_t errlen)
{
    *n_hits = 0;
    if (stats)
        memset(stats, 0, sizeof *stats);
    struct Store *s = r->s;
    struct CollRecord rec;
    int st = store_coll_get(s, r->txn, collection, &rec, err, errlen);
    if (st)
        return st;
    size_t k = o->k < cap ? o->k : cap;
    if (k > SEARCH_MAX_K)
        k = SEARCH_MAX_K;
    if (!(o->k1 >= 0) || !(o->b >= 0 && o->b <= 1))
        return ret_fail(err, errlen, RET_EINPUT, "BM25 parameters out of range (k1 >= 0, 0 <= b <= 1)");
    if (k == 0 || rec.n_chunks == 0)
        return RET_OK;

    struct Analyzer *an = NULL;
    struct TermBag qt;
    termbag_init(&qt);
    struct LmdbSource *srcs = NULL;
    struct PostingCursor *curs = NULL, **cps = NULL;
    struct IdRange *ranges = NULL;
    struct ScoredId *top = NULL;
    size_t n_cur = 0, n_ranges = 0, n_top = 0;
    if ((st = analyzer_new(rec.analyzer_flags, &an, err, errlen)))
        goto out;
    if ((st = index_query_terms(an, query, qlen, &qt))) {
        st = ret_fail(err, errlen, st, "out of memory analysing the query");
        goto out;
    }
    srcs = calloc(qt.n ? qt.n : 1, sizeof *srcs);
    curs = calloc(qt.n ? qt.n : 1, sizeof *curs);
    cps = calloc(qt.n ? qt.n : 1, sizeof *cps);
    top = malloc(k * sizeof *top);
    if (!srcs || !curs || !cps || !top) {
        st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
        goto out;
    }
    struct Bm25Params bp = { o->k1, o->b, (double)rec.total_terms / (double)rec.n_chunks };
    for (size_t i = 0; i < qt.n; i++) {
        struct LmdbSource *src = &srcs[n_cur];
        src->tlen = key_term(src->tkey, rec.id, termbag_term(&qt, i), qt.items[i].len);
        MDB_val hk = { src->tlen, src->tkey }, hv;
        int rc = mdb_get(r->txn, s->db_postings, &hk, &hv);
        if (rc == MDB_NOTFOUND)
            continue;
        struct TermHeader th;
        if (rc || term_header_decode(&hv, &th)) {
            st = rc ? store_mdb_fail(err, errlen, rc, "read term") : ret_fail(err, errlen, RET_ECORRUPT, "malformed term header");
            goto out;
        }
        if ((rc = mdb_cursor_open(r->txn, s->db_postings, &src->cur))) {
            st = store_mdb_fail(err, errlen, rc, "open cursor");
            goto out;
        }
        struct PostingCursor *c = &curs[n_cur];
        c->weight = bm25_idf(rec.n_chunks, th.df) * qt.items[i].count;
        c->ub = c->weight * bm25_tf_part(th.max_tf, th.min_len, &bp);
        c->refill = lmdb_refill;
        c->src = src;
        cps[n_cur] = c;
        n_cur++;
        if (cursor_start(c)) {
            st = ret_fail(err, errlen, RET_ECORRUPT, "malformed posting block");
            goto out;
        }
    }
    if (o->n_doc_ids) {
        ranges = malloc(o->n_doc_ids * sizeof *ranges);
        if (!ranges) {
            st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
            goto out;
        }
        for (size_t i = 0; i < o->n_doc_ids; i++) {
            size_t len = o->doc_id_lens[i];
            if (len == 0 || len > INDEX_MAX_ID_BYTES)
                continue;
            uint8_t kb[KEY_MAX];
            MDB_val dk = { key_doc(kb, rec.id, o->doc_ids[i], len), kb }, dv;
            int rc = mdb_get(r->txn, s->db_docs, &dk, &dv);
            if (rc == MDB_NOTFOUND)
                continue;
            struct DocHeader h;
            const char *t1, *t2;
            const void *m;
            if (rc || doc_record_decode(&dv, &h, &t1, &m, &t2)) {
                st = rc ? store_mdb_fail(err, errlen, rc, "read document") : ret_fail(err, errlen, RET_ECORRUPT, "malformed document record");
                goto out;
            }
            if (h.n_chunks)
                ranges[n_ranges++] = (struct IdRange){ h.first_chunk, h.first_chunk + h.n_chunks };
        }
        if (n_ranges == 0)
            goto out; /* the filter names no stored document: nothing matches */
        qsort(ranges, n_ranges, sizeof *ranges, cmp_range);
    }
    st = bm25_top_k(cps, n_cur, &bp, ranges, n_ranges, k, o->exhaustive, top, &n_top, stats);
    if (st) {
        st = ret_fail(err, errlen, st, "reading postings failed (%s)", ret_strerror(st));
        goto out;
    }
    for (size_t i = 0; i < n_top; i++) {
        uint8_t kb[KEY_MAX];
        MDB_val ck = { key_chunk(kb, rec.id, top[i].id), kb }, cv;
        int rc = mdb_get(r->txn, s->db_chunks, &ck, &cv);
        struct ChunkRecord cr;
        const char *did;
        size_t did_len;
        if (rc || chunk_record_decode(&cv, &cr, &did, &did_len)) {
            st = ret_fail(err, errlen, RET_ECORRUPT, "posting points at missing chunk %u", top[i].id);
            goto out;
        }
        MDB_val dk = { key_doc(kb, rec.id, did, did_len), kb }, dv;
        rc = mdb_get(r->txn, s->db_docs, &dk, &dv);
        struct DocHeader h;
        const char *title, *text;
        const void *meta;
        if (rc || doc_record_decode(&dv, &h, &title, &meta, &text) || cr.byte_end > h.text_len) {
            st = ret_fail(err, errlen, RET_ECORRUPT, "chunk %u points at a missing document", top[i].id);
            goto out;
        }
        if ((st = chunk_record_check(s, collection, top[i].id, &cv, &cr, did, did_len, title,
                                     h.title_len, text, err, errlen)))
            goto out;
        struct SearchHit *hit = &hits[i];
        hit->score = top[i].score;
        hit->chunk_id = top[i].id;
        hit->chunk = cr.chunk;
        hit->byte_start = cr.byte_start;
        hit->byte_end = cr.byte_end;
        hit->doc_id = did;
        hit->doc_id_len = did_len;
        hit->title = title;
        hit->title_len = h.title_len;
        hit->heading = cr.heading;
        hit->heading_len = cr.heading_len;
        hit->page_first = cr.page_first;
        hit->page_last = cr.page_last;
        hit->text = text + cr.byte_start;
        hit->text_len = cr.byte_end - cr.byte_start;
    }
    *n_hits = n_top;
out:
    for (size_t i = 0; srcs && i < n_cur; i++)
        if (srcs[i].cur)
            mdb_cursor_close(srcs[i].cur);
    free(srcs);
    free(curs);
    free(cps);
    free(ranges);
    free(top);
    termbag_free(&qt);
    analyzer_destroy(&an);
    return st;
}
