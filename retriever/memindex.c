/* The in-memory index: a term dictionary (TermBag) over plain posting arrays, one per term,
 * fed to bm25_top_k through a cursor whose single "block" is the whole list. */
#include "retriever/memindex.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/status.h"

struct MemChunk {
    uint32_t doc, chunk, n_terms;
    uint64_t start, end;
    size_t head_off, head_len;
    uint32_t page_first, page_last;
};
struct PostList { struct Posting *p; size_t n, cap; };

struct MemIndex {
    const struct StoreDoc *docs;
    size_t n_docs;
    struct IndexOptions opt;
    struct MemChunk *chunks;
    size_t n_chunks;
    uint32_t *doc_first;    /* first chunk id of each document; doc_first[n_docs] = n_chunks */
    struct TermBag dict;    /* aux = index into lists */
    struct PostList *lists;
    size_t n_lists, cap_lists;
    uint64_t total_terms;
    struct Analyzer *an;
    struct TermBag query;
    char *heads;            /* the chunks' heading paths, end to end */
    size_t heads_len, heads_cap;
};

void memidx_destroy(struct MemIndex **pm)
{
    struct MemIndex *m = pm ? *pm : NULL;
    if (!m)
        return;
    for (size_t i = 0; i < m->n_lists; i++)
        free(m->lists[i].p);
    free(m->lists);
    free(m->chunks);
    free(m->heads);
    free(m->doc_first);
    termbag_free(&m->dict);
    termbag_free(&m->query);
    analyzer_destroy(&m->an);
    free(m);
    *pm = NULL;
}

size_t memidx_n_chunks(const struct MemIndex *m) { return m->n_chunks; }

static int add_chunk_postings(struct MemIndex *m, uint32_t cid, const struct TermBag *bag)
{
    for (size_t i = 0; i < bag->n; i++) {
        size_t idx;
        if (termbag_add(&m->dict, termbag_term(bag, i), bag->items[i].len, 1, &idx))
            return RET_ENOMEM;
        if (m->dict.items[idx].count == 1) {
            if (m->n_lists == m->cap_lists) {
                size_t c = m->cap_lists ? m->cap_lists * 2 : 256;
                struct PostList *p = realloc(m->lists, c * sizeof *p);
                if (!p)
                    return RET_ENOMEM;
                m->lists = p;
                m->cap_lists = c;
            }
            memset(&m->lists[m->n_lists], 0, sizeof m->lists[0]);
            m->dict.items[idx].aux = (uint32_t)m->n_lists++;
        }
        struct PostList *l = &m->lists[m->dict.items[idx].aux];
        if (l->n == l->cap) {
            size_t c = l->cap ? l->cap * 2 : 4;
            struct Posting *p = realloc(l->p, c * sizeof *p);
            if (!p)
                return RET_ENOMEM;
            l->p = p;
            l->cap = c;
        }
        l->p[l->n++] = (struct Posting){ cid, bag->items[i].count, (uint32_t)bag->total };
    }
    return RET_OK;
}

int memidx_build(const struct StoreDoc *docs, size_t n, const struct IndexOptions *opts,
                 size_t max_doc_bytes, const struct TokenCounter *tc, struct MemIndex **out,
                 char *err, size_t errlen)
{
    *out = NULL;
    int st;
    struct IndexOptions o;
    if (opts)
        o = *opts;
    else
        index_options_default(&o);
    if ((st = index_validate_options(&o, err, errlen)) ||
        (st = index_validate_docs(docs, n, max_doc_bytes ? max_doc_bytes : INDEX_DEFAULT_MAX_DOC_BYTES,
                                  err, errlen)))
        return st;
    struct MemIndex *m = calloc(1, sizeof *m);
    struct TermBag bag;
    termbag_init(&bag);
    struct ChunkSpan *sp = NULL;
    if (!m)
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory");
    m->docs = docs;
    m->n_docs = n;
    m->opt = o;
    termbag_init(&m->dict);
    termbag_init(&m->query);
    m->doc_first = malloc((n + 1) * sizeof *m->doc_first);
    if (!m->doc_first || (st = analyzer_new(o.analyzer_flags, &m->an, err, errlen))) {
        st = st ? st : ret_fail(err, errlen, RET_ENOMEM, "out of memory");
        goto err;
    }
    size_t cap_chunks = 0;
    for (size_t d = 0; d < n; d++) {
        size_t nsp;
        if ((st = chunk_text(docs[d].text, docs[d].text_len, &o.chunk, tc, &sp, &nsp, err, errlen)))
            goto err;
        m->doc_first[d] = (uint32_t)m->n_chunks;
        if (m->n_chunks + nsp >= BM25_END) {
            st = ret_fail(err, errlen, RET_ELIMIT, "too many chunks");
            goto err;
        }
        if (m->n_chunks + nsp > cap_chunks) {
            size_t c = cap_chunks ? cap_chunks * 2 : 64;
            while (c < m->n_chunks + nsp)
                c *= 2;
            struct MemChunk *p = realloc(m->chunks, c * sizeof *p);
            if (!p) {
                st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
                goto err;
            }
            m->chunks = p;
            cap_chunks = c;
        }
        for (size_t j = 0; j < nsp; j++) {
            uint32_t cid = (uint32_t)m->n_chunks;
            if (m->heads_cap - m->heads_len < CHUNK_MAX_PATH_BYTES + 1) {
                size_t c = m->heads_cap ? m->heads_cap * 2 : 4 * (CHUNK_MAX_PATH_BYTES + 1);
                char *p = realloc(m->heads, c);
                if (!p) {
                    st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
                    goto err;
                }
                m->heads = p;
                m->heads_cap = c;
            }
            size_t hl = chunk_heading_path(docs[d].text, &sp[j], docs[d].title, docs[d].title_len,
                                           m->heads + m->heads_len, CHUNK_MAX_PATH_BYTES + 1);
            if ((st = index_chunk_terms(m->an, o.index_flags, docs[d].title, docs[d].title_len,
                                        m->heads + m->heads_len, hl, docs[d].text + sp[j].start,
                                        sp[j].end - sp[j].start, &bag)) ||
                (st = add_chunk_postings(m, cid, &bag))) {
                st = ret_fail(err, errlen, RET_ENOMEM, "out of memory indexing");
                goto err;
            }
            m->chunks[m->n_chunks++] = (struct MemChunk){ (uint32_t)d, (uint32_t)j,
                                                          (uint32_t)bag.total, sp[j].start, sp[j].end,
                                                          m->heads_len, hl, sp[j].page_first,
                                                          sp[j].page_last };
            m->heads_len += hl;
            m->total_terms += bag.total;
        }
        free(sp);
        sp = NULL;
    }
    m->doc_first[n] = (uint32_t)m->n_chunks;
    termbag_free(&bag);
    *out = m;
    return RET_OK;
err:
    free(sp);
    termbag_free(&bag);
    memidx_destroy(&m);
    return st;
}

struct MemSource { const struct PostList *list; int loaded; };

static int mem_refill(struct PostingCursor *c, uint32_t target)
{
    (void)target;
    struct MemSource *src = c->src;
    if (src->loaded) {
        c->n = 0;
        return 0;
    }
    src->loaded = 1;
    c->buf = src->list->p;
    c->n = src->list->n;
    return 0;
}

static int cmp_range(const void *a, const void *b)
{
    const struct IdRange *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

int memidx_search(struct MemIndex *m, const char *query, size_t qlen, const struct SearchOptions *o,
                  struct SearchHit *hits, size_t cap, size_t *n_hits, struct Bm25Stats *stats,
                  char *err, size_t errlen)
{
    *n_hits = 0;
    if (stats)
        memset(stats, 0, sizeof *stats);
    size_t k = o->k < cap ? o->k : cap;
    if (!(o->k1 >= 0) || !(o->b >= 0 && o->b <= 1))
        return ret_fail(err, errlen, RET_EINPUT, "BM25 parameters out of range (k1 >= 0, 0 <= b <= 1)");
    if (k == 0 || m->n_chunks == 0)
        return RET_OK;
    int st = index_query_terms(m->an, query, qlen, &m->query);
    if (st)
        return ret_fail(err, errlen, st, "out of memory analysing the query");
    size_t nq = m->query.n ? m->query.n : 1;
    struct MemSource *srcs = calloc(nq, sizeof *srcs);
    struct PostingCursor *curs = calloc(nq, sizeof *curs), **cps = calloc(nq, sizeof *cps);
    struct IdRange *ranges = calloc(o->n_doc_ids ? o->n_doc_ids : 1, sizeof *ranges);
    struct ScoredId *top = malloc(k * sizeof *top);
    size_t n_cur = 0, n_ranges = 0, n_top = 0;
    if (!srcs || !curs || !cps || !ranges || !top) {
        st = ret_fail(err, errlen, RET_ENOMEM, "out of memory");
        goto out;
    }
    struct Bm25Params bp = { o->k1, o->b, (double)m->total_terms / (double)m->n_chunks };
    for (size_t i = 0; i < m->query.n; i++) {
        long t = termbag_find(&m->dict, termbag_term(&m->query, i), m->query.items[i].len);
        if (t < 0)
            continue;
        const struct PostList *l = &m->lists[m->dict.items[t].aux];
        uint32_t max_tf = 0, min_len = UINT32_MAX;
        for (size_t j = 0; j < l->n; j++) {
            if (l->p[j].tf > max_tf) max_tf = l->p[j].tf;
            if (l->p[j].len < min_len) min_len = l->p[j].len;
        }
        struct PostingCursor *c = &curs[n_cur];
        srcs[n_cur].list = l;
        c->src = &srcs[n_cur];
        c->refill = mem_refill;
        c->weight = bm25_idf(m->n_chunks, l->n) * m->query.items[i].count;
        c->ub = c->weight * bm25_tf_part(max_tf, min_len, &bp);
        cursor_start(c);
        cps[n_cur++] = c;
    }
    if (o->n_doc_ids) {
        for (size_t i = 0; i < o->n_doc_ids; i++)
            for (size_t d = 0; d < m->n_docs; d++)
                if (m->docs[d].id_len == o->doc_id_lens[i] &&
                    memcmp(m->docs[d].id, o->doc_ids[i], o->doc_id_lens[i]) == 0 &&
                    m->doc_first[d + 1] > m->doc_first[d]) {
                    ranges[n_ranges++] = (struct IdRange){ m->doc_first[d], m->doc_first[d + 1] };
                    break;
                }
        if (n_ranges == 0)
            goto out;
        qsort(ranges, n_ranges, sizeof *ranges, cmp_range);
    }
    if ((st = bm25_top_k(cps, n_cur, &bp, ranges, n_ranges, k, o->exhaustive, top, &n_top, stats))) {
        st = ret_fail(err, errlen, st, "search failed");
        goto out;
    }
    for (size_t i = 0; i < n_top; i++) {
        const struct MemChunk *c = &m->chunks[top[i].id];
        const struct StoreDoc *d = &m->docs[c->doc];
        hits[i] = (struct SearchHit){
            .score = top[i].score, .chunk_id = top[i].id, .chunk = c->chunk,
            .byte_start = c->start, .byte_end = c->end,
            .doc_id = d->id, .doc_id_len = d->id_len, .title = d->title, .title_len = d->title_len,
            .heading = m->heads ? m->heads + c->head_off : NULL, .heading_len = c->head_len,
            .page_first = c->page_first, .page_last = c->page_last,
            .text = d->text + c->start, .text_len = c->end - c->start,
        };
    }
    *n_hits = n_top;
out:
    free(srcs);
    free(curs);
    free(cps);
    free(ranges);
    free(top);
    return st;
}
