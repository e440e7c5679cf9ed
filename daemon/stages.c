/* The I/O stage of each op that has one (the op table, ops.c, points at these): for queries
 * the searches and the reading of candidate documents, handed to the context planner
 * (retriever/planner.h), which decides the prompt; the store reads and writes with their
 * replies. They run on an I/O thread. Borrowed LMDB memory never outlives the read snapshot:
 * everything a reply needs is copied into it before store_read_end. */
#include "daemon/stages.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "daemon/extract.h"
#include "daemon/log.h"
#include "daemon/zutil.h"
#include "retriever/bm25.h"
#include "retriever/memindex.h"
#include "retriever/planner.h"
#include "retriever/status.h"
#include "text/docformat.h"
#include "text/utf8.h"

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

/* A store write failed. A full disk (RET_EFULL: the store's message names the data directory,
 * its free space and what to do) is logged too, once a write, so an operator sees it without a
 * client to report it. */
static void fail_write(const struct PrepShared *sh, struct Request *r, int st, const char *err)
{
    if (st == RET_EFULL) {
        char q[600];
        dlog(LL_ERROR, "msg=\"data directory full\" error=%s", dlog_quote(q, sizeof q, err,
             strlen(err)));
    }
    fail(sh, r, st, err);
}

static void coll_name(const struct Request *r, char *out)
{
    memcpy(out, r->p.collection.p, r->p.collection.len);
    out[r->p.collection.len] = 0;
}

/* The candidate documents a query could read whole (struct PlanDoc), each once. */
struct DocList {
    struct PlanDoc *v;
    size_t n, cap;
    size_t stored_bytes;       /* text of the stored documents among them */
};

static int same_id(const char *a, size_t al, const char *b, size_t bl)
{
    return al == bl && (al == 0 || !memcmp(a, b, al));
}

static int docs_add(struct DocList *l, const struct PlanDoc *d)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        struct PlanDoc *v = realloc(l->v, cap * sizeof *v);
        if (!v)
            return RET_ENOMEM;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = *d;
    return RET_OK;
}

/* Reads the stored documents a query could read whole: those ids names, else those with a
 * hit, each once, until their text passes what the planner would count (plan_read_bytes).
 * They borrow rd's snapshot. */
static int docs_from_store(struct DocList *l, struct StoreReader *rd, const char *coll,
                           uint32_t coll_id, const struct RequestParams *p,
                           const struct SearchHit *hits, size_t n_hits, char *err, size_t errlen)
{
    size_t n = p->n_ids ? p->n_ids : n_hits;
    size_t max_bytes = plan_read_bytes((size_t)p->max_context_tokens);
    for (size_t i = 0; i < n; i++) {
        const char *id = p->n_ids ? p->ids[i].p : hits[i].doc_id;
        size_t id_len = p->n_ids ? p->ids[i].len : hits[i].doc_id_len;
        int seen = 0;
        for (size_t j = 0; j < l->n && !seen; j++)
            seen = same_id(l->v[j].id, l->v[j].id_len, id, id_len);
        if (seen)
            continue;
        if (l->stored_bytes > max_bytes)
            break;
        struct StoreDocView dv;
        int st = store_get_doc(rd, coll, id, id_len, &dv, err, errlen);
        if (st == RET_ENOTFOUND)
            continue;  /* an id the collection does not hold matches nothing, as in the search */
        if (st)
            return st;
        struct PlanDoc d = { id, id_len, dv.title, dv.title_len, dv.text, dv.text_len,
                             p->n_ids ? PLAN_DOC_NAMED : PLAN_DOC_FOUND,
                             (uint64_t)coll_id << 32 | dv.first_chunk };
        if ((st = docs_add(l, &d)))
            return ret_fail(err, errlen, st, "out of memory");
        l->stored_bytes += dv.text_len;
    }
    return RET_OK;
}

/* What the search looks for: the question, and after a conversation's earlier turns the most
 * recent user turn too, so that a follow-up ("how many people live there?") finds what the
 * conversation is about. The prompt's question stays the question alone. Returns a malloc'ed
 * text (*len its length), or NULL (out of memory). */
static char *search_text(const struct RequestParams *p, size_t *len)
{
    const struct CtxTurn *prev = NULL;
    for (size_t i = p->n_history; i-- > 0 && !prev;)
        if (!p->history[i].assistant)
            prev = &p->history[i];
    size_t n = p->question.len + (prev ? 1 + prev->len : 0);
    char *t = malloc(n + 1);
    if (!t)
        return NULL;
    memcpy(t, p->question.p, p->question.len);
    if (prev) {
        t[p->question.len] = '\n';
        memcpy(t + p->question.len + 1, prev->text, prev->len);
    }
    t[n] = 0;
    *len = n;
    return t;
}

/* Searches the inline documents and the collection, reads the candidate documents, and asks
 * the planner (retriever/planner.h) what the prompt holds. */
void stage_query(const struct PrepShared *sh, struct Request *r)
{
    const struct RequestParams *p = &r->p;
    char err[512] = "";
    struct MemIndex *mi = NULL;
    struct StoreReader *rd = NULL;
    size_t k = plan_search_hits((size_t)p->top_k, (size_t)p->max_context_tokens);
    struct SearchHit *hits = calloc(2 * k, sizeof *hits);
    struct CtxChunk *chunks = calloc(2 * k, sizeof *chunks);
    struct DocList docs = {0};
    const char **ids = NULL;
    size_t *id_lens = NULL;
    size_t n_hits = 0, n_inline = 0;
    uint32_t coll_id = 0;
    char coll[INDEX_MAX_COLLECTION_BYTES + 1];
    int st;
    size_t search_len = 0;
    char *search = search_text(p, &search_len);
    if (!hits || !chunks || !search) {
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
        st = memidx_build(p->docs, p->n_docs, &io, 0, &sh->tc, &mi, err, sizeof err);
        if (!st)
            st = memidx_search(mi, search, search_len, &so, hits, k, &n_inline, NULL, err,
                               sizeof err);
        if (st) {
            fail(sh, r, st, err);
            goto done;
        }
        for (size_t i = 0; !st && i < p->n_docs; i++) {
            const struct StoreDoc *d = &p->docs[i];
            st = docs_add(&docs, &(struct PlanDoc){ d->id, d->id_len, d->title, d->title_len,
                                                    d->text, d->text_len, PLAN_DOC_INLINE, 0 });
        }
        if (st) {
            fail(sh, r, st, "out of memory");
            goto done;
        }
        n_hits += n_inline;
    }
    if (p->collection.len) {
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
        struct StoreCollStats cs = {0};
        st = store_read_begin(sh->store, &rd, err, sizeof err);
        if (!st)
            st = store_search(rd, coll, search, search_len, &so, hits + n_hits, k, &n, NULL, err,
                              sizeof err);
        if (!st)
            st = store_collection_stats(rd, coll, &cs, err, sizeof err);
        if (!st)
            st = docs_from_store(&docs, rd, coll, cs.id, p, hits + n_hits, n, err, sizeof err);
        /* the stored chunks' names, for the worker's chunk KV records (docs/kv-reuse.md) */
        coll_id = cs.id;
        if (st) {
            fail(sh, r, st, err);
            goto done;
        }
        n_hits += n;
    }
    ctx_chunks_from_hits(hits, n_hits, chunks);
    for (size_t i = n_inline; coll_id && i < n_hits; i++)
        chunks[i].ref = (uint64_t)coll_id << 32 | hits[i].chunk_id;
    struct PlanRequest pr = {
        .tc = &sh->tc, .question = p->question.p, .question_len = p->question.len,
        .system = p->system.p, .system_len = p->system.len,
        .history = p->history, .n_history = p->n_history,
        .budget = (size_t)p->max_context_tokens, .top_k = (size_t)p->top_k,
        .relevance_floor = p->relevance_floor, .order = (enum CtxOrder)p->order,
        .window = p->window,
        .chunks = chunks, .n_chunks = n_hits,
        .n_searches = (p->n_docs > 0) + (p->collection.len > 0),
        .docs = docs.v, .n_docs = docs.n,
    };
    struct Plan plan;
    if ((st = plan_context(&pr, &plan, err, sizeof err))) {
        fail(sh, r, st, err);
        goto done;
    }
    r->ctx = plan.ctx;
    r->read = plan.read;
    /* the words of the documents the model is given, for the answer's lexical support (the
     * earlier turns of a conversation are not documents: their words support nothing) */
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
    free(docs.v);
    free(search);
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

/* The title of a text file: a Markdown file's first "# " heading, else the name without its
 * folders and extension. Borrows name or text (the message's, which outlive the write). */
static struct Slice text_title(const char *name, size_t name_len, const char *text, size_t len)
{
    const char *dot = memrchr(name, '.', name_len);
    size_t ext = dot ? name_len - (size_t)(dot - name) : 0;
    if ((ext == 3 && !strncasecmp(dot, ".md", 3)) || (ext == 9 && !strncasecmp(dot, ".markdown", 9)))
        for (size_t i = 0; i + 2 <= len; i++)
            if ((i == 0 || text[i - 1] == '\n') && text[i] == '#' && text[i + 1] == ' ') {
                const char *h = text + i + 2, *end = memchr(h, '\n', len - i - 2);
                size_t hl = end ? (size_t)(end - h) : len - i - 2;
                while (hl && (h[hl - 1] == '\r' || h[hl - 1] == ' '))
                    hl--;
                if (hl)
                    return (struct Slice){ h, utf8_cut(h, hl, INDEX_MAX_TITLE_BYTES) };
            }
    const char *slash = memrchr(name, '/', name_len);
    const char *base = slash ? slash + 1 : name;
    size_t bl = name_len - (size_t)(base - name);
    if (dot && dot > base)
        bl = (size_t)(dot - base);
    return (struct Slice){ base, utf8_cut(base, bl, INDEX_MAX_TITLE_BYTES) };
}

/* The documents given as files (bytes and a name): text files stored as they are (the store
 * checks them as it checks any text), PDF, DOCX and HTML files (by content, or by a .pdf,
 * .docx or .html name for the helper to judge) through diffrag-extract. The texts and titles
 * made are added to held[] (freed by the caller). 0; or -1 with the error set, naming the
 * document: the batch is then refused whole, as a batch with an invalid document is. */
static int ingest_files(const struct PrepShared *sh, struct Request *r, char **held)
{
    /* the batch's files together: at most the store's document limit of text and
     * extract_timeout_ms of wall clock, so one request holds neither memory nor an I/O thread
     * without bound */
    struct DextractOpts o = { sh->extract_helper, 0, 0, r->extract_timeout_ms };
    size_t used = 0;
    double end = 0; /* set at the first extraction */
    for (size_t i = 0; i < r->p.n_docs && r->p.files; i++) {
        const struct DocFile *f = &r->p.files[i];
        struct StoreDoc *d = &r->p.docs[i];
        if (!f->bytes)
            continue;
        char name[INDEX_MAX_ID_BYTES + 1];
        memcpy(name, f->name.p, f->name.len);
        name[f->name.len] = 0;
        enum DocFormat fmt = docformat_sniff(f->bytes, f->len), by_name = docformat_of_name(name);
        if (fmt == DOCFMT_TEXT && by_name == DOCFMT_TEXT) {
            d->text = (const char *)f->bytes;
            d->text_len = f->len;
            if (!d->title) {
                struct Slice t = text_title(f->name.p, f->name.len, d->text, d->text_len);
                d->title = t.p;
                d->title_len = t.len;
            }
            continue;
        }
        enum DocFormat what = fmt != DOCFMT_TEXT ? fmt : by_name;
        char *title = NULL, *text = NULL, why[768];
        size_t text_len = 0;
        enum DextractFail st = DEXTRACT_EDOC;
        o.max_text = sh->max_doc_bytes - used;
        /* the first file extracted gets the whole of it; one after others what they left */
        if (end == 0) {
            end = zu_now_ms() + (double)r->extract_timeout_ms;
            o.timeout_ms = r->extract_timeout_ms;
        } else {
            o.timeout_ms = (long)(end - zu_now_ms());
        }
        if (used >= sh->max_doc_bytes)
            snprintf(why, sizeof why, "the text of the request's files before it reached %.1f "
                     "MiB, the most a request's files may have together; send it in another "
                     "request", sh->max_doc_bytes / 1048576.0);
        else if (o.timeout_ms <= 0)
            snprintf(why, sizeof why, "the request's files before it took its %ld ms "
                     "(extract_timeout_ms, for its files together); send it in another request",
                     o.limit_ms);
        else
            st = dextract_run(&o, f->bytes, f->len, name, &title, &text, &text_len, why,
                              sizeof why);
        if (st != DEXTRACT_OK) {
            r->code = st == DEXTRACT_EDOC ? EC_BAD_REQUEST : EC_INTERNAL;
            snprintf(r->message, sizeof r->message, "document %zu (\"%.100s\"): %s %s: %.300s", i, name,
                     what == DOCFMT_HTML ? "an" : "a", docformat_name(what), why);
            if (st != DEXTRACT_EDOC)
                dlog(LL_ERROR, "msg=\"cannot extract a document\" error=\"%s\"", why);
            return -1;
        }
        held[2 * i] = text;
        held[2 * i + 1] = title;
        used += text_len;
        d->text = text;
        d->text_len = text_len;
        if (!d->title) {
            d->title = title;
            d->title_len = utf8_cut(title, strlen(title), INDEX_MAX_TITLE_BYTES);
        }
    }
    return 0;
}

void stage_ingest(const struct PrepShared *sh, struct Request *r)
{
    char **held = NULL;
    if (r->p.files) {
        if (!(held = calloc(2 * r->p.n_docs, sizeof *held))) {
            fail(sh, r, RET_ENOMEM, "out of memory");
            return;
        }
        if (ingest_files(sh, r, held))
            goto done;
    }
    char coll[INDEX_MAX_COLLECTION_BYTES + 1], err[512];
    coll_name(r, coll);
    struct IndexOptions io;
    index_options_default(&io);
    io.chunk.target_tokens = (uint32_t)r->chunk_tokens;
    io.chunk.overlap_tokens = (uint32_t)r->chunk_overlap;
    size_t bytes = 0;
    for (size_t i = 0; i < r->p.n_docs; i++)
        bytes += r->p.docs[i].text_len;
    struct StorePutReport rep;
    int st = store_put_docs_report(sh->store, coll, r->p.docs, r->p.n_docs, &io, &sh->tc, &rep,
                                   err, sizeof err);
    if (st) {
        fail_write(sh, r, st, err);
        goto done;
    }
    mpw_kv_str(&r->reply, "collection", coll, strlen(coll));
    mpw_kv_uint(&r->reply, "ingested", r->p.n_docs);
    mpw_kv_uint(&r->reply, "bytes", bytes);
    mpw_kv_uint(&r->reply, "added", rep.added);
    mpw_kv_uint(&r->reply, "changed", rep.changed);
    mpw_kv_uint(&r->reply, "unchanged", rep.unchanged);
    coll_counts(sh, coll, &r->reply);
    r->reply_fields = 8;
done:
    if (held) {
        /* the documents no longer point at what is freed */
        for (size_t i = 0; i < r->p.n_docs; i++)
            if (held[2 * i]) {
                if (r->p.docs[i].title == held[2 * i + 1])
                    r->p.docs[i].title = NULL, r->p.docs[i].title_len = 0;
                r->p.docs[i].text = NULL, r->p.docs[i].text_len = 0;
            }
        for (size_t i = 0; i < 2 * r->p.n_docs; i++)
            free(held[i]);
        free(held);
    }
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
        fail_write(sh, r, st, err);
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
        fail_write(sh, r, st, err);
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
