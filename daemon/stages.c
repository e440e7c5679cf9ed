/* The I/O stage of each op that has one (the op table, ops.c, points at these): retrieval and
 * context assembly for queries, and the store reads and writes with their replies. They run on
 * an I/O thread. Borrowed LMDB memory never outlives the read snapshot: everything a reply
 * needs is copied into it before store_read_end. */
#include "daemon/stages.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

#include "daemon/log.h"
#include "retriever/bm25.h"
#include "retriever/memindex.h"
#include "retriever/status.h"

static enum ErrCode ret_code(int st)
{
    switch (st) {
    case RET_OK: return EC_OK;
    case RET_EINPUT: return EC_BAD_REQUEST;
    case RET_ENOTFOUND: return EC_NOT_FOUND;
    case RET_ELIMIT: case RET_EBUDGET: return EC_TOO_LARGE;
    default: return EC_INTERNAL;
    }
}

/* A store call reported damage (RET_ECORRUPT: LMDB's MDB_CORRUPTED or MDB_PAGE_NOTFOUND, or a
 * malformed record): the store turns read-only (store_txn_begin refuses writes from then on,
 * /readyz and diffrag_store_damaged show it), logged once with the way out. */
static void note_damage(const struct PrepShared *sh, int st, const char *msg)
{
    if (st != RET_ECORRUPT || !store_mark_damaged(sh->store, msg))
        return;
    char q[600], dir[600], hint[700], qhint[800];
    const char *d = sh->data_dir ? sh->data_dir : "DIR";
    snprintf(hint, sizeof hint, "stop diffragd, run diffrag-store --data-dir %s verify, then "
             "restore a backup or rebuild the store", d);
    dlog(LL_ERROR, "msg=\"the store is damaged: serving it read-only from now on\" data_dir=%s "
         "error=%s hint=%s", dlog_quote(dir, sizeof dir, d, strlen(d)),
         dlog_quote(q, sizeof q, msg, strlen(msg)), dlog_quote(qhint, sizeof qhint, hint, strlen(hint)));
}

static void fail(const struct PrepShared *sh, struct Request *r, int st, const char *msg)
{
    note_damage(sh, st, msg);
    r->code = ret_code(st);
    if (r->code == EC_OK)
        r->code = EC_INTERNAL;
    snprintf(r->message, sizeof r->message, "%s", msg);
}

/* A store write failed. LMDB reports a full filesystem as an I/O error (a short write), which
 * tells an operator nothing: when the data directory's filesystem has no room for the batch,
 * say so. */
static void fail_write(const struct PrepShared *sh, struct Request *r, int st, const char *err,
                       size_t batch_bytes)
{
    struct statvfs fs;
    if (st == RET_EIO && sh->data_dir && statvfs(sh->data_dir, &fs) == 0) {
        unsigned long long avail = (unsigned long long)fs.f_bavail * fs.f_frsize;
        if (avail < 4ull * batch_bytes + (1ull << 20)) {
            char msg[sizeof r->message];
            snprintf(msg, sizeof msg, "no space left in the data directory (%llu KiB free on its "
                     "filesystem); nothing was written (%s)", avail >> 10, err);
            fail(sh, r, st, msg);
            dlog(LL_ERROR, "msg=\"data directory full\" data_dir=\"%s\" free_bytes=%llu", sh->data_dir,
                 avail);
            return;
        }
    }
    fail(sh, r, st, err);
}

static void coll_name(const struct Request *r, char *out)
{
    memcpy(out, r->p.collection.p, r->p.collection.len);
    out[r->p.collection.len] = 0;
}

static int by_score(const void *a, const void *b)
{
    const struct CtxChunk *x = a, *y = b;
    return x->score < y->score ? 1 : x->score > y->score ? -1 : 0;
}

static void hit_to_chunk(const struct SearchHit *h, struct CtxChunk *c)
{
    c->doc_id = h->doc_id;
    c->doc_id_len = h->doc_id_len;
    c->title = h->title;
    c->title_len = h->title_len;
    c->text = h->text;
    c->text_len = h->text_len;
    c->chunk = h->chunk;
    c->byte_start = h->byte_start;
    c->byte_end = h->byte_end;
    c->score = h->score;
}

void stage_query(const struct PrepShared *sh, struct Request *r)
{
    const struct RequestParams *p = &r->p;
    char err[512];
    struct MemIndex *mi = NULL;
    struct StoreReader *rd = NULL;
    size_t k = (size_t)p->top_k;
    struct SearchHit *hits = calloc(2 * k, sizeof *hits);
    struct CtxChunk *chunks = calloc(2 * k, sizeof *chunks);
    const char **ids = NULL;
    size_t *id_lens = NULL;
    size_t n_hits = 0;
    int st;
    if (!hits || !chunks) {
        fail(sh, r, RET_ENOMEM, "out of memory");
        goto done;
    }
    struct SearchOptions so;
    search_options_default(&so);
    so.k = k;
    if (p->n_docs) {
        struct IndexOptions io;
        index_options_default(&io);
        io.chunk.target_tokens = (uint32_t)r->chunk_tokens;
        io.chunk.overlap_tokens = (uint32_t)r->chunk_overlap;
        size_t n = 0;
        st = memidx_build(p->docs, p->n_docs, &io, 0, &sh->tc, &mi, err, sizeof err);
        if (!st)
            st = memidx_search(mi, p->question.p, p->question.len, &so, hits, k, &n, NULL, err,
                               sizeof err);
        if (st) {
            fail(sh, r, st, err);
            goto done;
        }
        n_hits += n;
    }
    if (p->collection.len) {
        char coll[INDEX_MAX_COLLECTION_BYTES + 1];
        coll_name(r, coll);
        if (p->n_ids) {
            ids = calloc(p->n_ids, sizeof *ids);
            id_lens = calloc(p->n_ids, sizeof *id_lens);
            if (!ids || !id_lens) {
                fail(sh, r, RET_ENOMEM, "out of memory");
                goto done;
            }
            for (size_t i = 0; i < p->n_ids; i++) {
                ids[i] = p->ids[i].p;
                id_lens[i] = p->ids[i].len;
            }
            so.doc_ids = ids;
            so.doc_id_lens = id_lens;
            so.n_doc_ids = p->n_ids;
        }
        size_t n = 0;
        st = store_read_begin(sh->store, &rd, err, sizeof err);
        if (!st)
            st = store_search(rd, coll, p->question.p, p->question.len, &so, hits + n_hits, k, &n,
                              NULL, err, sizeof err);
        if (st) {
            fail(sh, r, st, err);
            goto done;
        }
        n_hits += n;
    }
    for (size_t i = 0; i < n_hits; i++)
        hit_to_chunk(&hits[i], &chunks[i]);
    /* Inline and stored hits come from two indexes: BM25 scores of one query, merged by score. */
    if (p->n_docs && p->collection.len)
        qsort(chunks, n_hits, sizeof *chunks, by_score);
    if (n_hits > k)
        n_hits = k;
    struct CtxOptions co = { .budget = (size_t)p->max_context_tokens,
                             .order = p->order_document ? CTX_ORDER_DOCUMENT : CTX_ORDER_RANK };
    st = ctx_assemble(&sh->tc, p->question.p, p->question.len, chunks, n_hits, &co, &r->ctx, err,
                      sizeof err);
    if (st) {
        fail(sh, r, st, err);
        goto done;
    }
    /* the words of the text the model is given, for the answer's lexical support */
    if (words_set_new(&r->doc_words)) {
        fail(sh, r, RET_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < r->ctx->n_cites; i++) {
        const struct CtxSpan *b = &r->ctx->cites[i].bytes;
        if (words_set_add_text(r->doc_words, r->ctx->text + b->start, b->end - b->start)) {
            fail(sh, r, RET_ENOMEM, "out of memory");
            goto done;
        }
    }
done:
    store_read_end(&rd);
    memidx_destroy(&mi);
    free(hits);
    free(chunks);
    free(ids);
    free(id_lens);
}

static void coll_counts(const struct PrepShared *sh, const char *coll, struct MpWriter *w)
{
    struct StoreReader *rd = NULL;
    struct StoreCollStats cs;
    char err[256];
    memset(&cs, 0, sizeof cs);
    if (store_read_begin(sh->store, &rd, err, sizeof err) == 0) {
        store_collection_stats(rd, coll, &cs, err, sizeof err);
        store_read_end(&rd);
    }
    mpw_kv_uint(w, "docs", cs.n_docs);
    mpw_kv_uint(w, "chunks", cs.n_chunks);
}

void stage_ingest(const struct PrepShared *sh, struct Request *r)
{
    char coll[INDEX_MAX_COLLECTION_BYTES + 1], err[512];
    coll_name(r, coll);
    struct IndexOptions io;
    index_options_default(&io);
    io.chunk.target_tokens = (uint32_t)r->chunk_tokens;
    io.chunk.overlap_tokens = (uint32_t)r->chunk_overlap;
    size_t bytes = 0;
    for (size_t i = 0; i < r->p.n_docs; i++)
        bytes += r->p.docs[i].text_len;
    int st = store_put_docs(sh->store, coll, r->p.docs, r->p.n_docs, &io, &sh->tc, err, sizeof err);
    if (st) {
        fail_write(sh, r, st, err, bytes);
        return;
    }
    mpw_kv_str(&r->reply, "collection", coll, strlen(coll));
    mpw_kv_uint(&r->reply, "ingested", r->p.n_docs);
    mpw_kv_uint(&r->reply, "bytes", bytes);
    coll_counts(sh, coll, &r->reply);
    r->reply_fields = 5;
}

void stage_delete(const struct PrepShared *sh, struct Request *r)
{
    char coll[INDEX_MAX_COLLECTION_BYTES + 1], err[512];
    coll_name(r, coll);
    const char **ids = calloc(r->p.n_ids, sizeof *ids);
    size_t *lens = calloc(r->p.n_ids, sizeof *lens);
    if (!ids || !lens) {
        fail(sh, r, RET_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < r->p.n_ids; i++) {
        ids[i] = r->p.ids[i].p;
        lens[i] = r->p.ids[i].len;
    }
    size_t n = 0;
    int st = store_delete_docs(sh->store, coll, ids, lens, r->p.n_ids, &n, err, sizeof err);
    if (st) {
        fail_write(sh, r, st, err, 0);
        goto done;
    }
    mpw_kv_uint(&r->reply, "deleted", n);
    coll_counts(sh, coll, &r->reply);
    r->reply_fields = 3;
done:
    free(ids);
    free(lens);
}

void stage_drop(const struct PrepShared *sh, struct Request *r)
{
    char coll[INDEX_MAX_COLLECTION_BYTES + 1], err[512];
    coll_name(r, coll);
    uint64_t n = 0;
    int st = store_drop_collection(sh->store, coll, &n, err, sizeof err);
    if (st) {
        fail_write(sh, r, st, err, 0);
        return;
    }
    mpw_kv_str(&r->reply, "collection", coll, strlen(coll));
    mpw_kv_uint(&r->reply, "dropped", n);
    r->reply_fields = 2;
}

void stage_get(const struct PrepShared *sh, struct Request *r)
{
    char coll[INDEX_MAX_COLLECTION_BYTES + 1], err[512];
    coll_name(r, coll);
    struct StoreReader *rd = NULL;
    struct StoreDocView v;
    int st = store_read_begin(sh->store, &rd, err, sizeof err);
    if (!st)
        st = store_get_doc(rd, coll, r->p.doc_id.p, r->p.doc_id.len, &v, err, sizeof err);
    if (st) {
        fail(sh, r, st, err);
        store_read_end(&rd);
        return;
    }
    struct MpWriter *w = &r->reply;
    mpw_cstr(w, "doc");
    mpw_map(w, 4 + (v.meta_len ? 1 : 0));
    mpw_kv_str(w, "id", v.id, v.id_len);
    mpw_kv_str(w, "title", v.title, v.title_len);
    mpw_kv_str(w, "text", v.text, v.text_len);
    mpw_kv_uint(w, "chunks", v.n_chunks);
    if (v.meta_len) {
        /* stored as the client sent it: one msgpack map */
        mpw_cstr(w, "meta");
        if (mp_check(v.meta, v.meta_len, MP_MAX_DEPTH, err, sizeof err) == 0)
            mpw_raw(w, v.meta, v.meta_len);
        else
            mpw_nil(w);
    }
    r->reply_fields = 1;
    store_read_end(&rd);
}

static int list_coll_cb(void *ctx, const char *name, size_t len)
{
    struct MpWriter *w = ((void **)ctx)[0];
    size_t *n = ((void **)ctx)[1];
    if (w)
        mpw_str(w, name, len);
    (*n)++;
    return 0;
}

void stage_list(const struct PrepShared *sh, struct Request *r)
{
    char err[512];
    struct StoreReader *rd = NULL;
    struct MpWriter *w = &r->reply;
    int st = store_read_begin(sh->store, &rd, err, sizeof err);
    if (st) {
        fail(sh, r, st, err);
        return;
    }
    if (!r->p.collection.len) {
        /* count first: msgpack arrays carry their length up front */
        size_t n = 0;
        void *count_ctx[2] = { NULL, &n };
        st = store_list_collections(rd, list_coll_cb, count_ctx, err, sizeof err);
        if (!st) {
            size_t m = 0;
            void *write_ctx[2] = { w, &m };
            mpw_cstr(w, "collections");
            mpw_array(w, n);
            st = store_list_collections(rd, list_coll_cb, write_ctx, err, sizeof err);
            if (!st && m != n)
                st = RET_EIO;
        }
        if (st)
            fail(sh, r, st, err);
        else
            r->reply_fields = 1;
        store_read_end(&rd);
        return;
    }
    char coll[INDEX_MAX_COLLECTION_BYTES + 1];
    coll_name(r, coll);
    size_t cap = (size_t)r->p.limit, n = 0;
    struct StoreDocView *v = calloc(cap, sizeof *v);
    if (!v) {
        fail(sh, r, RET_ENOMEM, "out of memory");
        store_read_end(&rd);
        return;
    }
    st = store_list_docs(rd, coll, r->p.after.len ? r->p.after.p : NULL, r->p.after.len, v, cap, &n,
                         err, sizeof err);
    if (st) {
        fail(sh, r, st, err);
    } else {
        mpw_cstr(w, "docs");
        mpw_array(w, n);
        for (size_t i = 0; i < n; i++) {
            mpw_map(w, 4);
            mpw_kv_str(w, "id", v[i].id, v[i].id_len);
            mpw_kv_str(w, "title", v[i].title, v[i].title_len);
            mpw_kv_uint(w, "bytes", v[i].text_len);
            mpw_kv_uint(w, "chunks", v[i].n_chunks);
        }
        mpw_cstr(w, "next");
        if (n == cap && n > 0)
            mpw_str(w, v[n - 1].id, v[n - 1].id_len);
        else
            mpw_nil(w);
        r->reply_fields = 2;
    }
    free(v);
    store_read_end(&rd);
}

void stage_stats(const struct PrepShared *sh, struct Request *r)
{
    char coll[INDEX_MAX_COLLECTION_BYTES + 1], err[512];
    coll_name(r, coll);
    struct StoreReader *rd = NULL;
    struct StoreCollStats cs;
    int st = store_read_begin(sh->store, &rd, err, sizeof err);
    if (!st)
        st = store_collection_stats(rd, coll, &cs, err, sizeof err);
    store_read_end(&rd);
    if (st) {
        fail(sh, r, st, err);
        return;
    }
    struct MpWriter *w = &r->reply;
    mpw_kv_str(w, "collection", coll, strlen(coll));
    mpw_kv_uint(w, "docs", cs.n_docs);
    mpw_kv_uint(w, "chunks", cs.n_chunks);
    mpw_kv_uint(w, "terms", cs.total_terms);
    mpw_kv_uint(w, "text_bytes", cs.text_bytes);
    mpw_kv_double(w, "avg_chunk_terms", cs.avg_chunk_terms);
    mpw_kv_uint(w, "chunk_tokens", cs.options.chunk.target_tokens);
    r->reply_fields = 7;
}
