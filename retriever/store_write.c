/* Writes to the store: upserts and deletes of documents, each batch one LMDB transaction.
 * Chunking (the token counting) happens before the transaction opens; inside it, the batch's
 * posting changes are gathered per term and applied term by term, deletions first, so each
 * posting block is rewritten at most once or twice per batch. A full map aborts the
 * transaction, grows the map and replays the batch. */
#include "retriever/store_internal.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/postings.h"
#include "retriever/status.h"

#define NEED_RECHUNK 1   /* internal: the collection's options differ from the ones chunked with */
#define NEED_PREP 2      /* internal: a document taken as unchanged was not, and needs chunking */

struct TermOp { uint32_t term, id, tf, len; uint8_t del; };

struct Batch {
    struct Store *s;
    const char *coll;      /* the collection's name, for messages */
    MDB_txn *txn;
    struct CollRecord rec;
    struct Analyzer *an;
    struct TermBag terms;  /* every term the batch touches; aux = insertion index */
    struct TermBag chunk;  /* scratch: one chunk's terms */
    struct TermOp *ops;
    size_t n_ops, cap_ops;
    struct Posting *pbuf;  /* scratch for decoding/merging blocks */
    size_t pcap;
    uint8_t *ebuf;         /* scratch for encoding */
    size_t ecap;
    uint32_t *chunk_ids;   /* scratch: chunk ids of a removed document */
    size_t cap_ids;
};

/* LMDB failures, except a full map or transaction, which the write loop handles by growing
 * the map or reporting the batch as too large. */
static int wfail(char *err, size_t errlen, int rc, const char *what)
{
    if (rc == MDB_MAP_FULL || rc == MDB_TXN_FULL)
        return rc;
    return store_mdb_fail(err, errlen, rc, what);
}

static void batch_free(struct Batch *b)
{
    analyzer_destroy(&b->an);
    termbag_free(&b->terms);
    termbag_free(&b->chunk);
    free(b->ops);
    free(b->pbuf);
    free(b->ebuf);
    free(b->chunk_ids);
}

static int grow_buf(void **buf, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return RET_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *p = realloc(*buf, c * elem);
    if (!p)
        return RET_ENOMEM;
    *buf = p;
    *cap = c;
    return RET_OK;
}

static int add_op(struct Batch *b, const char *term, size_t len, uint32_t id, uint32_t tf, uint32_t clen, int del)
{
    if (b->n_ops == b->cap_ops && grow_buf((void **)&b->ops, &b->cap_ops, b->n_ops + 1, sizeof *b->ops))
        return RET_ENOMEM;
    size_t idx;
    if (termbag_add(&b->terms, term, len, 1, &idx))
        return RET_ENOMEM;
    if (b->terms.items[idx].count == 1)
        b->terms.items[idx].aux = (uint32_t)idx;
    b->ops[b->n_ops++] = (struct TermOp){ (uint32_t)idx, id, tf, clen, (uint8_t)del };
    return RET_OK;
}

/* Record the terms of the chunk in b->chunk as posting removals for chunk `id`. */
static int add_bag_ops(struct Batch *b, uint32_t id, int del)
{
    struct TermBag *cb = &b->chunk;
    for (size_t i = 0; i < cb->n; i++)
        if (add_op(b, termbag_term(cb, i), cb->items[i].len, id, cb->items[i].count, (uint32_t)cb->total, del))
            return RET_ENOMEM;
    return RET_OK;
}

/* Gather removal ops for an existing document (key dk, record docv) and delete its chunk
 * records. Its postings are found by analysing its text again, so a damaged text would remove
 * the wrong ones: the record must pass its checksum first. */
static int remove_doc(struct Batch *b, const MDB_val *dk, const MDB_val *docv, char *err,
                      size_t errlen)
{
    struct Store *s = b->s;
    struct DocHeader h;
    const char *title, *text;
    const void *meta;
    if (doc_record_decode(docv, &h, &title, &meta, &text))
        return ret_fail(err, errlen, RET_ECORRUPT, "malformed document record");
    int st = doc_record_check(s, b->coll, dk, docv, &h, err, errlen);
    if (st)
        return st;
    if (grow_buf((void **)&b->chunk_ids, &b->cap_ids, h.n_chunks, sizeof *b->chunk_ids))
        return RET_ENOMEM;
    /* Analyse every old chunk before changing anything: text borrows the doc's pages. */
    uint64_t terms_removed = 0;
    for (uint32_t j = 0; j < h.n_chunks; j++) {
        uint32_t cid = h.first_chunk + j;
        uint8_t kb[8];
        MDB_val k = { key_chunk(kb, b->rec.id, cid), kb }, v;
        int rc = mdb_get(b->txn, s->db_chunks, &k, &v);
        if (rc)
            return rc == MDB_NOTFOUND
                ? ret_fail(err, errlen, RET_ECORRUPT, "chunk %u of a document is missing", cid)
                : wfail(err, errlen, rc, "read chunk");
        struct ChunkRecord cr;
        const char *did;
        size_t did_len;
        if (chunk_record_decode(&v, &cr, &did, &did_len) || cr.byte_end > h.text_len)
            return ret_fail(err, errlen, RET_ECORRUPT, "chunk %u: malformed record", cid);
        st = index_chunk_terms(b->an, b->rec.index_flags, title, h.title_len, cr.heading,
                               cr.heading_len, text + cr.byte_start, cr.byte_end - cr.byte_start,
                               &b->chunk);
        if (st)
            return ret_fail(err, errlen, st, "out of memory analysing a chunk");
        if (b->chunk.total != cr.n_terms)
            return ret_fail(err, errlen, RET_ECORRUPT, "chunk %u: stored length %u, analysed %llu",
                            cid, cr.n_terms, (unsigned long long)b->chunk.total);
        if ((st = add_bag_ops(b, cid, 1)))
            return ret_fail(err, errlen, st, "out of memory");
        terms_removed += cr.n_terms;
        b->chunk_ids[j] = cid;
    }
    for (uint32_t j = 0; j < h.n_chunks; j++) {
        uint8_t kb[8];
        MDB_val k = { key_chunk(kb, b->rec.id, b->chunk_ids[j]), kb };
        int rc = mdb_del(b->txn, s->db_chunks, &k, NULL);
        if (rc)
            return wfail(err, errlen, rc, "delete chunk");
    }
    /* the chunks' KV records go with them */
    int rc = store_kv_drop(s, b->txn, b->rec.id, h.first_chunk, h.first_chunk + h.n_chunks);
    if (rc)
        return wfail(err, errlen, rc, "delete chunk KV");
    b->rec.n_docs--;
    b->rec.n_chunks -= h.n_chunks;
    b->rec.total_terms -= terms_removed;
    b->rec.text_bytes -= h.text_len;
    return RET_OK;
}

/* 1 when the stored record (key k, value v) holds exactly d's title, metadata and text and
 * passes its checksum: storing d again would change nothing. A record without a checksum
 * (written before schema 3), or one that fails its check, is never the same: it is rewritten,
 * or the write fails on it as any replace of it does; nor is one chunked before chunks followed
 * the structure (schema 5): ingesting it again re-chunks it. */
static int doc_same(const struct Store *s, const char *coll, const MDB_val *k, const MDB_val *v,
                    const struct StoreDoc *d)
{
    struct DocHeader h;
    const char *title, *text;
    const void *meta;
    if (doc_record_decode(v, &h, &title, &meta, &text) || !h.summed || !h.structured ||
        h.title_len != d->title_len || h.meta_len != d->meta_len || h.text_len != d->text_len ||
        doc_record_check(s, coll, k, v, &h, NULL, 0))
        return 0;
    return (!d->title_len || memcmp(title, d->title, d->title_len) == 0) &&
           (!d->meta_len || memcmp(meta, d->meta, d->meta_len) == 0) &&
           memcmp(text, d->text, d->text_len) == 0;
}

/* Insert one document, chunked and analysed beforehand. */
static int insert_doc(struct Batch *b, const struct StoreDoc *d, const struct PreDoc *p, char *err, size_t errlen)
{
    struct Store *s = b->s;
    size_t nsp = p->n_spans;
    if ((uint64_t)b->rec.next_chunk_id + nsp >= BM25_CHUNK_LIMIT)
        return ret_fail(err, errlen, RET_ELIMIT, "collection has used all %u chunk ids",
                        (unsigned)BM25_CHUNK_LIMIT);
    uint32_t first = b->rec.next_chunk_id;
    for (size_t j = 0; j < nsp; j++) {
        uint32_t cid = first + (uint32_t)j;
        for (uint32_t t = p->term_first[j]; t < p->term_first[j + 1]; t++) {
            const struct PreTerm *pt = &p->terms[t];
            if (add_op(b, p->arena + pt->off, pt->len, cid, pt->tf, p->chunk_len[j], 0))
                return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
        }
        uint8_t kb[8], vb[CHUNK_RECORD_MAX];
        char heading[CHUNK_MAX_PATH_BYTES + 1];
        size_t hl = chunk_heading_path(d->text, &p->spans[j], d->title, d->title_len, heading,
                                       sizeof heading), at = CHUNK_RECORD_SIZE;
        memset(vb, 0, CHUNK_RECORD_SIZE);
        put_le32(vb, (uint32_t)j);
        put_le32(vb + 4, p->chunk_len[j]);
        const struct ChunkSpan *sp = &p->spans[j];
        put_le32(vb + 8, sp->n_tokens | (hl ? CHUNK_HEADED : 0) | (sp->page_first ? CHUNK_PAGED : 0));
        put_le64(vb + 16, p->spans[j].start);
        put_le64(vb + 24, p->spans[j].end);
        if (hl) {
            vb[at] = (uint8_t)hl;
            vb[at + 1] = (uint8_t)(hl >> 8);
            memcpy(vb + at + CHUNK_HEADING_LEN_SIZE, heading, hl);
            at += CHUNK_HEADING_LEN_SIZE + hl;
        }
        if (sp->page_first) {
            put_le32(vb + at, sp->page_first);
            put_le32(vb + at + 4, sp->page_last);
            at += CHUNK_PAGES_SIZE;
        }
        memcpy(vb + at, d->id, d->id_len);
        put_le32(vb + CHUNK_SUM_OFFSET, chunk_sum(vb, at + d->id_len, d->title,
                                                  d->title_len, d->text + p->spans[j].start,
                                                  p->spans[j].end - p->spans[j].start));
        MDB_val k = { key_chunk(kb, b->rec.id, cid), kb }, v = { at + d->id_len, vb };
        int rc = mdb_put(b->txn, s->db_chunks, &k, &v, MDB_NOOVERWRITE);
        if (rc)
            return wfail(err, errlen, rc, "write chunk");
        b->rec.total_terms += p->chunk_len[j];
    }
    uint8_t kb[KEY_MAX];
    MDB_val k = { key_doc(kb, b->rec.id, d->id, d->id_len), kb };
    size_t body = DOC_HEADER_SIZE + d->title_len + d->meta_len + d->text_len;
    MDB_val v = { body + DOC_SUM_SIZE, NULL };
    int rc = mdb_put(b->txn, s->db_docs, &k, &v, MDB_RESERVE);
    if (rc)
        return wfail(err, errlen, rc, "write document");
    uint8_t *rec = v.mv_data, *o = rec;
    put_le32(o, first);
    put_le32(o + 4, (uint32_t)nsp);
    put_le32(o + 8, (uint32_t)d->title_len | DOC_SUMMED);
    put_le32(o + 12, (uint32_t)d->meta_len | DOC_STRUCTURED);
    put_le64(o + 16, d->text_len);
    o += DOC_HEADER_SIZE;
    if (d->title_len) memcpy(o, d->title, d->title_len);
    o += d->title_len;
    if (d->meta_len) memcpy(o, d->meta, d->meta_len);
    o += d->meta_len;
    memcpy(o, d->text, d->text_len);
    put_le64(rec + body, doc_sum(&k, rec, body));
    b->rec.next_chunk_id = first + (uint32_t)nsp;
    b->rec.n_docs++;
    b->rec.n_chunks += nsp;
    b->rec.text_bytes += d->text_len;
    return RET_OK;
}

static int is_block_of(const MDB_val *k, const uint8_t *tkey, size_t tlen)
{
    return k->mv_size == tlen + 4 && memcmp(k->mv_data, tkey, tlen) == 0;
}

static int put_block(struct Batch *b, const uint8_t *tkey, size_t tlen, uint32_t base,
                     const struct Posting *p, size_t n, char *err, size_t errlen)
{
    if (grow_buf((void **)&b->ebuf, &b->ecap, postings_bound(n), 1))
        return RET_ENOMEM;
    size_t size;
    if (postings_encode(base, p, n, b->ebuf, &size))
        return ret_fail(err, errlen, RET_ECORRUPT, "posting order violated while writing a block");
    uint8_t kb[4 + ANALYZE_MAX_TERM + 5];
    memcpy(kb, tkey, tlen);
    put_be32(kb + tlen, base);
    MDB_val k = { tlen + 4, kb }, v = { size, b->ebuf };
    int rc = mdb_put(b->txn, b->s->db_postings, &k, &v, 0);
    return rc ? (wfail(err, errlen, rc, "write postings")) : RET_OK;
}

/* Apply one term's ops: ops[0..n) all for the same term, deletions first, ids ascending. */
static int apply_term(struct Batch *b, MDB_cursor *cur, const char *term, size_t term_len,
                      const struct TermOp *ops, size_t n, char *err, size_t errlen)
{
    struct Store *s = b->s;
    uint8_t tkey[4 + ANALYZE_MAX_TERM + 5];
    size_t tlen = key_term(tkey, b->rec.id, term, term_len);
    MDB_val hk = { tlen, tkey }, hv;
    struct TermHeader th = { 0, 0, UINT32_MAX };
    int rc = mdb_get(b->txn, s->db_postings, &hk, &hv);
    if (rc == 0 && term_header_decode(&hv, &th))
        return ret_fail(err, errlen, RET_ECORRUPT, "malformed term header");
    if (rc && rc != MDB_NOTFOUND)
        return wfail(err, errlen, rc, "read term header");
    uint64_t df = rc == 0 ? th.df : 0;
    if (rc == MDB_NOTFOUND) { th.max_tf = 0; th.min_len = UINT32_MAX; }
    if (grow_buf((void **)&b->pbuf, &b->pcap, POSTINGS_BLOCK + n, sizeof *b->pbuf))
        return RET_ENOMEM;
    size_t i = 0;
    /* Deletions: find the block holding each id, drop every deleted id it holds. */
    while (i < n && ops[i].del) {
        uint8_t kb[4 + ANALYZE_MAX_TERM + 5];
        memcpy(kb, tkey, tlen);
        put_be32(kb + tlen, ops[i].id);
        MDB_val k = { tlen + 4, kb }, v;
        rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
        if (rc == 0 && is_block_of(&k, tkey, tlen) && get_be32((uint8_t *)k.mv_data + tlen) == ops[i].id) {
            /* exact block start */
        } else {
            rc = rc == MDB_NOTFOUND ? mdb_cursor_get(cur, &k, &v, MDB_LAST)
                                    : mdb_cursor_get(cur, &k, &v, MDB_PREV);
            if (rc == 0 && !is_block_of(&k, tkey, tlen))
                rc = MDB_NOTFOUND;
        }
        if (rc)
            return rc == MDB_NOTFOUND
                ? ret_fail(err, errlen, RET_ECORRUPT, "posting of chunk %u for a term is missing", ops[i].id)
                : wfail(err, errlen, rc, "find posting block");
        uint32_t base = get_be32((uint8_t *)k.mv_data + tlen);
        size_t np;
        if (postings_decode(base, v.mv_data, v.mv_size, b->pbuf, b->pcap, &np))
            return ret_fail(err, errlen, RET_ECORRUPT, "malformed posting block");
        size_t w = 0, removed = 0;
        for (size_t r = 0; r < np; r++) {
            while (i < n && ops[i].del && ops[i].id < b->pbuf[r].id)
                return ret_fail(err, errlen, RET_ECORRUPT, "posting of chunk %u for a term is missing", ops[i].id);
            if (i < n && ops[i].del && ops[i].id == b->pbuf[r].id) {
                i++;
                removed++;
                continue;
            }
            b->pbuf[w++] = b->pbuf[r];
        }
        if (removed == 0)
            return ret_fail(err, errlen, RET_ECORRUPT, "posting of chunk %u for a term is missing", ops[i].id);
        df -= removed;
        if (w == 0) {
            MDB_val dk = { tlen + 4, kb };
            put_be32(kb + tlen, base);
            rc = mdb_del(b->txn, s->db_postings, &dk, NULL);
            if (rc)
                return wfail(err, errlen, rc, "delete posting block");
        } else if ((rc = put_block(b, tkey, tlen, base, b->pbuf, w, err, errlen))) {
            return rc;
        }
    }
    /* Additions: ids exceed every stored id, so they extend the last block, then new blocks. */
    if (i < n) {
        size_t n_add = n - i, np = 0;
        uint32_t base = ops[i].id;
        uint8_t kb[4 + ANALYZE_MAX_TERM + 5];
        memcpy(kb, tkey, tlen);
        put_be32(kb + tlen, UINT32_MAX);
        MDB_val k = { tlen + 4, kb }, v;
        rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
        rc = rc == MDB_NOTFOUND ? mdb_cursor_get(cur, &k, &v, MDB_LAST) : mdb_cursor_get(cur, &k, &v, MDB_PREV);
        if (rc && rc != MDB_NOTFOUND)
            return wfail(err, errlen, rc, "find last posting block");
        if (rc == 0 && is_block_of(&k, tkey, tlen)) {
            struct PostingsHeader ph;
            uint32_t last_base = get_be32((uint8_t *)k.mv_data + tlen);
            if (postings_header(last_base, v.mv_data, v.mv_size, &ph))
                return ret_fail(err, errlen, RET_ECORRUPT, "malformed posting block");
            if (ph.count < POSTINGS_BLOCK) {
                if (postings_decode(last_base, v.mv_data, v.mv_size, b->pbuf, b->pcap, &np))
                    return ret_fail(err, errlen, RET_ECORRUPT, "malformed posting block");
                base = last_base;
            }
        }
        for (; i < n; i++) {
            struct Posting p = { ops[i].id, ops[i].tf, ops[i].len };
            if (p.tf > th.max_tf) th.max_tf = p.tf;
            if (p.len < th.min_len) th.min_len = p.len;
            if (np == POSTINGS_BLOCK) {
                if ((rc = put_block(b, tkey, tlen, base, b->pbuf, np, err, errlen)))
                    return rc;
                np = 0;
                base = p.id;
            }
            b->pbuf[np++] = p;
        }
        if ((rc = put_block(b, tkey, tlen, base, b->pbuf, np, err, errlen)))
            return rc;
        df += n_add;
    }
    if (df == 0) {
        rc = mdb_del(b->txn, s->db_postings, &hk, NULL);
        if (rc && rc != MDB_NOTFOUND)
            return wfail(err, errlen, rc, "delete term header");
        return RET_OK;
    }
    if (df > UINT32_MAX)
        return ret_fail(err, errlen, RET_ELIMIT, "document frequency overflow");
    uint8_t vb[TERM_HEADER_SIZE];
    put_le32(vb, (uint32_t)df);
    put_le32(vb + 4, th.max_tf);
    put_le32(vb + 8, th.min_len);
    MDB_val v = { TERM_HEADER_SIZE, vb };
    rc = mdb_put(b->txn, s->db_postings, &hk, &v, 0);
    return rc ? (wfail(err, errlen, rc, "write term header")) : RET_OK;
}

static int cmp_op_id(const void *pa, const void *pb)
{
    const struct TermOp *a = pa, *b = pb;
    return (a->id > b->id) - (a->id < b->id);
}

static int apply_ops(struct Batch *b, char *err, size_t errlen)
{
    if (b->n_ops == 0)
        return RET_OK;
    /* Group the ops by term in byte order, removals before additions: sort the dictionary, then
     * a counting sort of the ops by (term rank, addition?). Additions are already in ascending
     * id order (ids were allocated in processing order); removals get sorted per term. */
    size_t nt = b->terms.n, nk = 2 * nt + 1;
    uint32_t *rank = malloc(nt * sizeof *rank);
    size_t *start = calloc(nk, sizeof *start);
    struct TermOp *sorted = malloc(b->n_ops * sizeof *sorted);
    if (!rank || !start || !sorted || termbag_sort(&b->terms)) {
        free(rank);
        free(start);
        free(sorted);
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < nt; i++)
        rank[b->terms.items[i].aux] = (uint32_t)i;
    for (size_t i = 0; i < b->n_ops; i++) {
        b->ops[i].term = rank[b->ops[i].term];
        start[2 * b->ops[i].term + !b->ops[i].del + 1]++;
    }
    for (size_t k = 1; k < nk; k++)
        start[k] += start[k - 1];
    for (size_t i = 0; i < b->n_ops; i++)
        sorted[start[2 * b->ops[i].term + !b->ops[i].del]++] = b->ops[i];
    free(rank);
    free(start);
    free(b->ops);
    b->ops = sorted;
    b->cap_ops = b->n_ops;
    MDB_cursor *cur;
    int rc = mdb_cursor_open(b->txn, b->s->db_postings, &cur);
    if (rc)
        return wfail(err, errlen, rc, "open postings cursor");
    size_t i = 0;
    while (i < b->n_ops) {
        size_t j = i, d = i;
        while (j < b->n_ops && b->ops[j].term == b->ops[i].term) {
            if (b->ops[j].del)
                d = j + 1;
            j++;
        }
        if (d - i > 1)
            qsort(b->ops + i, d - i, sizeof *b->ops, cmp_op_id);
        const struct TermBagItem *it = &b->terms.items[b->ops[i].term];
        rc = apply_term(b, cur, b->terms.arena + it->off, it->len, b->ops + i, j - i, err, errlen);
        if (rc)
            break;
        i = j;
    }
    mdb_cursor_close(cur);
    return rc;
}

static int put_coll(struct Batch *b, const char *collection, char *err, size_t errlen)
{
    uint8_t vb[COLL_RECORD_SIZE];
    coll_record_encode(&b->rec, vb);
    MDB_val k = { strlen(collection), (void *)collection }, v = { COLL_RECORD_SIZE, vb };
    int rc = mdb_put(b->txn, b->s->db_stats, &k, &v, 0);
    return rc ? (wfail(err, errlen, rc, "write collection record")) : RET_OK;
}

/* Find the collection or create it (new id from meta). *created is set when it was new. */
static int get_or_create_coll(struct Batch *b, const char *collection, const struct IndexOptions *o,
                              int create, char *err, size_t errlen)
{
    int st = store_coll_get(b->s, b->txn, collection, &b->rec, err, errlen);
    if (st != RET_ENOTFOUND || !create)
        return st;
    MDB_val k = { 9, "next_coll" }, v;
    uint32_t id = 1;
    int rc = mdb_get(b->txn, b->s->db_meta, &k, &v);
    if (rc == 0 && v.mv_size == 4)
        id = get_le32(v.mv_data);
    else if (rc != MDB_NOTFOUND)
        return wfail(err, errlen, rc ? rc : MDB_CORRUPTED, "read next collection id");
    if (id == UINT32_MAX)
        return ret_fail(err, errlen, RET_ELIMIT, "no collection ids left");
    uint8_t nb[4];
    put_le32(nb, id + 1);
    v.mv_size = 4;
    v.mv_data = nb;
    rc = mdb_put(b->txn, b->s->db_meta, &k, &v, 0);
    if (rc)
        return wfail(err, errlen, rc, "write next collection id");
    memset(&b->rec, 0, sizeof b->rec);
    b->rec.id = id;
    b->rec.analyzer_flags = o->analyzer_flags;
    b->rec.chunk_tokens = o->chunk.target_tokens;
    b->rec.chunk_overlap = o->chunk.overlap_tokens;
    b->rec.index_flags = o->index_flags;
    return RET_OK;
}

static int same_options(const struct IndexOptions *a, const struct IndexOptions *b)
{
    return a->chunk.target_tokens == b->chunk.target_tokens &&
           a->chunk.overlap_tokens == b->chunk.overlap_tokens &&
           a->analyzer_flags == b->analyzer_flags && a->index_flags == b->index_flags;
}

/* Per document of a put (state[i]): */
#define DOC_TODO 1       /* to be stored: needs chunking */
#define DOC_PREPARED 2   /* chunked and analysed (pre[i] holds it) */

/* One attempt at a write transaction. Returns RET_OK, a RET_E* status, MDB_MAP_FULL (caller
 * grows and retries), NEED_RECHUNK (*opts then holds the collection's options) or NEED_PREP (a
 * document found changed was not prepared: its state is now DOC_TODO). A put whose documents
 * are all unchanged, stored exactly as given, writes nothing and commits nothing. */
static int write_attempt(struct Store *s, const char *collection, const struct StoreDoc *docs, size_t n,
                         const struct PreDoc *pre, uint8_t *state, struct IndexOptions *opts,
                         const char *const *del_ids, const size_t *del_lens, size_t n_del,
                         size_t *n_deleted, struct StorePutReport *rep, char *err, size_t errlen)
{
    struct Batch b;
    memset(&b, 0, sizeof b);
    b.s = s;
    b.coll = collection;
    termbag_init(&b.terms);
    termbag_init(&b.chunk);
    int st = store_txn_begin(s, 0, &b.txn, err, errlen);
    if (st)
        return st;
    int creating = docs != NULL;
    if ((st = get_or_create_coll(&b, collection, opts, creating, err, errlen)))
        goto out;
    struct IndexOptions have;
    coll_record_options(&b.rec, &have);
    if (creating && !same_options(&have, opts)) {
        *opts = have;
        st = NEED_RECHUNK;
        goto out;
    }
    if ((st = analyzer_new(b.rec.analyzer_flags, &b.an, err, errlen)))
        goto out;
    size_t deleted = 0;
    struct StorePutReport got = { 0, 0, 0 };
    for (size_t i = 0; i < n + n_del; i++) {
        const char *id = i < n ? docs[i].id : del_ids[i - n];
        size_t id_len = i < n ? docs[i].id_len : del_lens[i - n];
        if (id_len == 0 || id_len > INDEX_MAX_ID_BYTES)
            continue; /* deletes of impossible ids find nothing */
        uint8_t kb[KEY_MAX];
        MDB_val k = { key_doc(kb, b.rec.id, id, id_len), kb }, v;
        int rc = mdb_get(b.txn, s->db_docs, &k, &v);
        if (i < n && rc == 0 && doc_same(s, collection, &k, &v, &docs[i])) {
            got.unchanged++;
            continue;
        }
        if (i < n && (rc == 0 || rc == MDB_NOTFOUND)) {
            if (rc == 0)
                got.changed++;
            else
                got.added++;
            if (state[i] != DOC_PREPARED) {
                state[i] = DOC_TODO;
                st = NEED_PREP;
            }
        }
        if (st == NEED_PREP)
            continue; /* find every document that needs chunking before trying again */
        if (rc == 0) {
            if ((st = remove_doc(&b, &k, &v, err, errlen)))
                goto out;
            deleted++;
            if (i >= n && (rc = mdb_del(b.txn, s->db_docs, &k, NULL))) {
                st = wfail(err, errlen, rc, "delete document");
                goto out;
            }
        } else if (rc != MDB_NOTFOUND) {
            st = wfail(err, errlen, rc, "read document");
            goto out;
        }
        if (i < n && (st = insert_doc(&b, &docs[i], &pre[i], err, errlen)))
            goto out;
    }
    if (st == NEED_PREP)
        goto out;
    if (rep)
        *rep = got;
    if (n_deleted)
        *n_deleted = deleted;
    if (docs && got.added + got.changed == 0)
        goto out; /* nothing to write: the transaction is given up, not committed */
    if ((st = apply_ops(&b, err, errlen)) || (st = put_coll(&b, collection, err, errlen)))
        goto out;
    st = store_txn_commit(s, b.txn, err, errlen);
    b.txn = NULL;
out:
    if (b.txn)
        store_txn_abort(s, b.txn);
    batch_free(&b);
    return st;
}

/* Chunks and analyses the documents whose state is DOC_TODO (a batch of them, spread over
 * threads as store_prep_docs does) into pre; they become DOC_PREPARED. */
static int prep_todo(const struct StoreDoc *docs, size_t n, uint8_t *state, struct PreDoc *pre,
                     const struct IndexOptions *opts, const struct TokenCounter *tc, char *err,
                     size_t errlen)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        m += state[i] == DOC_TODO;
    if (m == 0)
        return RET_OK;
    struct StoreDoc *sub = malloc(m * sizeof *sub);
    struct PreDoc *sub_pre = calloc(m, sizeof *sub_pre);
    size_t *at = malloc(m * sizeof *at);
    int st = RET_OK;
    if (!sub || !sub_pre || !at) {
        st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0, j = 0; i < n; i++)
        if (state[i] == DOC_TODO) {
            sub[j] = docs[i];
            at[j++] = i;
        }
    if ((st = store_prep_docs(sub, m, opts, tc, sub_pre, err, errlen)))
        goto out;
    for (size_t j = 0; j < m; j++) {
        pre[at[j]] = sub_pre[j];
        state[at[j]] = DOC_PREPARED;
    }
out:
    free(sub);
    free(sub_pre);
    free(at);
    return st;
}

/* Forgets every prepared document (chunked with other options): each is DOC_TODO again. */
static void prep_forget(uint8_t *state, struct PreDoc *pre, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (state[i] == DOC_PREPARED) {
            store_prep_free(&pre[i], 1);
            state[i] = DOC_TODO;
        }
}

/* In a read snapshot (outside the write lock): the collection's options, and which documents
 * are new or differ from their stored records (DOC_TODO; the rest are left 0 and, once the
 * write transaction finds them still the same, not written at all). */
static int put_survey(struct Store *s, const char *collection, const struct StoreDoc *docs,
                      size_t n, struct IndexOptions *opts, uint8_t *state, char *err,
                      size_t errlen)
{
    struct StoreReader *r;
    int st = store_read_begin(s, &r, err, errlen);
    if (st)
        return st;
    struct CollRecord rec;
    st = store_coll_get(s, r->txn, collection, &rec, NULL, 0);
    if (st == RET_OK)
        coll_record_options(&rec, opts);
    for (size_t i = 0; i < n; i++) {
        state[i] = DOC_TODO;
        if (st != RET_OK)
            continue;
        uint8_t kb[KEY_MAX];
        MDB_val k = { key_doc(kb, rec.id, docs[i].id, docs[i].id_len), kb }, v;
        if (mdb_get(r->txn, s->db_docs, &k, &v) == 0 && doc_same(s, collection, &k, &v, &docs[i]))
            state[i] = 0;
    }
    store_read_end(&r);
    if (st != RET_OK && st != RET_ENOTFOUND)
        return ret_fail(err, errlen, st, "collection \"%s\": cannot read its record", collection);
    return RET_OK;
}

static int write_loop(struct Store *s, const char *collection, const struct StoreDoc *docs, size_t n,
                      const struct IndexOptions *create_opts, const struct TokenCounter *tc,
                      const char *const *del_ids, const size_t *del_lens, size_t n_del,
                      size_t *n_deleted, struct StorePutReport *rep, char *err, size_t errlen)
{
    struct IndexOptions opts;
    if (create_opts)
        opts = *create_opts;
    else
        index_options_default(&opts);
    struct PreDoc *pre = NULL;
    uint8_t *state = NULL;
    int st = RET_OK;
    if (docs) {
        pre = calloc(n, sizeof *pre);
        state = calloc(n, 1);
        if (!pre || !state) {
            st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
            goto out;
        }
        /* Chunk with the collection's options when it exists. */
        if ((st = put_survey(s, collection, docs, n, &opts, state, err, errlen)))
            goto out;
    }
    for (int attempt = 0; attempt < 64; attempt++) {
        if (docs && (st = prep_todo(docs, n, state, pre, &opts, tc, err, errlen)))
            goto out;
        st = write_attempt(s, collection, docs, n, pre, state, &opts, del_ids, del_lens, n_del,
                           n_deleted, rep, err, errlen);
        if (st == MDB_MAP_FULL) {
            if ((st = store_grow(s, err, errlen)))
                goto out;
            continue;
        }
        if (st == NEED_RECHUNK) {
            prep_forget(state, pre, n);
            continue;
        }
        if (st == NEED_PREP)
            continue;
        if (st == MDB_TXN_FULL)
            st = ret_fail(err, errlen, RET_ELIMIT, "batch too large for one transaction; split it");
        goto out;
    }
    st = ret_fail(err, errlen, RET_EIO, "write kept failing to fit the map");
out:
    if (pre)
        store_prep_free(pre, n);
    free(pre);
    free(state);
    return st;
}

int store_put_docs(struct Store *s, const char *collection, const struct StoreDoc *docs, size_t n,
                   const struct IndexOptions *create_opts, const struct TokenCounter *tc,
                   char *err, size_t errlen)
{
    return store_put_docs_report(s, collection, docs, n, create_opts, tc, NULL, err, errlen);
}

int store_put_docs_report(struct Store *s, const char *collection, const struct StoreDoc *docs,
                          size_t n, const struct IndexOptions *create_opts,
                          const struct TokenCounter *tc, struct StorePutReport *rep, char *err,
                          size_t errlen)
{
    int st;
    if (rep)
        memset(rep, 0, sizeof *rep);
    if ((st = index_validate_collection(collection, err, errlen)))
        return st;
    if (create_opts && (st = index_validate_options(create_opts, err, errlen)))
        return st;
    if ((st = index_validate_docs(docs, n, s->opt.max_doc_bytes, err, errlen)))
        return st;
    if (n == 0)
        return RET_OK;
    return write_loop(s, collection, docs, n, create_opts, tc, NULL, NULL, 0, NULL, rep, err,
                      errlen);
}

static int cmp_id(const void *pa, const void *pb, void *lens_v)
{
    (void)lens_v;
    const struct StoreDoc *a = pa, *b = pb;
    size_t n = a->id_len < b->id_len ? a->id_len : b->id_len;
    int c = n ? memcmp(a->id, b->id, n) : 0;
    return c ? c : (a->id_len > b->id_len) - (a->id_len < b->id_len);
}

int store_delete_docs(struct Store *s, const char *collection, const char *const *ids,
                      const size_t *id_lens, size_t n, size_t *n_deleted, char *err, size_t errlen)
{
    if (n_deleted)
        *n_deleted = 0;
    int st = index_validate_collection(collection, err, errlen);
    if (st)
        return st;
    /* The same id twice would remove its postings twice: refuse like a put batch does. */
    struct StoreDoc *tmp = calloc(n ? n : 1, sizeof *tmp);
    if (!tmp)
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        tmp[i].id = ids[i];
        tmp[i].id_len = id_lens[i];
    }
    qsort_r(tmp, n, sizeof *tmp, cmp_id, NULL);
    int dup = 0;
    for (size_t i = 1; i < n && !dup; i++)
        dup = cmp_id(&tmp[i - 1], &tmp[i], NULL) == 0;
    free(tmp);
    if (dup)
        return ret_fail(err, errlen, RET_EINPUT, "duplicate document id in one delete batch");
    return write_loop(s, collection, NULL, 0, NULL, NULL, ids, id_lens, n, n_deleted, NULL, err,
                      errlen);
}
