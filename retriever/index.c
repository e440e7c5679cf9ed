/* Validation of client documents, option defaults, and chunk/query analysis shared by the
 * store and the in-memory index, so both rank with exactly the same terms. */
#include "retriever/index.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/bm25.h"
#include "retriever/status.h"
#include "text/utf8.h"

void index_options_default(struct IndexOptions *o)
{
    o->chunk.target_tokens = CHUNK_DEFAULT_TOKENS;
    o->chunk.overlap_tokens = CHUNK_DEFAULT_OVERLAP;
    o->analyzer_flags = ANALYZE_STEM;
    o->index_flags = INDEX_TITLE;
}

void search_options_default(struct SearchOptions *o)
{
    memset(o, 0, sizeof *o);
    o->k = 10;
    o->k1 = BM25_DEFAULT_K1;
    o->b = BM25_DEFAULT_B;
}

static void id_preview(const char *id, size_t len, char *out, size_t cap)
{
    size_t n = len < cap - 4 ? len : cap - 4;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)id[i];
        out[k++] = (c >= 0x20 && c < 0x7F) ? (char)c : '?';
    }
    if (n < len) { out[k++] = '.'; out[k++] = '.'; out[k++] = '.'; }
    out[k] = 0;
}

int index_validate_doc(const struct StoreDoc *d, size_t pos, size_t max_doc_bytes, char *err,
                       size_t errlen)
{
    char idp[48];
    size_t bad;
    if (!d->id || d->id_len == 0)
        return ret_fail(err, errlen, RET_EINPUT, "document %zu: empty id", pos);
    id_preview(d->id, d->id_len, idp, sizeof idp);
    if (d->id_len > INDEX_MAX_ID_BYTES)
        return ret_fail(err, errlen, RET_EINPUT, "document %zu: id \"%s\" is %zu bytes (limit %d)",
                        pos, idp, d->id_len, INDEX_MAX_ID_BYTES);
    if (!utf8_valid(d->id, d->id_len, &bad) || memchr(d->id, 0, d->id_len))
        return ret_fail(err, errlen, RET_EINPUT, "document %zu: id \"%s\" is not valid UTF-8 text",
                        pos, idp);
    if (d->text_len > max_doc_bytes)
        return ret_fail(err, errlen, RET_EINPUT,
                        "document %zu (\"%s\"): text is %zu bytes (limit %zu)", pos, idp,
                        d->text_len, max_doc_bytes);
    if (d->text_len && !d->text)
        return ret_fail(err, errlen, RET_EINPUT, "document %zu (\"%s\"): no text", pos, idp);
    if (!utf8_valid(d->text, d->text_len, &bad))
        return ret_fail(err, errlen, RET_EINPUT,
                        "document %zu (\"%s\"): text is not valid UTF-8 (byte %zu)", pos, idp, bad);
    size_t i = 0;
    while (i < d->text_len && strchr(" \t\r\n\f\v", d->text[i]) && d->text[i])
        i++;
    if (i == d->text_len)
        return ret_fail(err, errlen, RET_EINPUT, "document %zu (\"%s\"): empty text", pos, idp);
    if (d->title_len > INDEX_MAX_TITLE_BYTES || (d->title_len && !d->title))
        return ret_fail(err, errlen, RET_EINPUT, "document %zu (\"%s\"): title too long (%zu bytes, limit %d)",
                        pos, idp, d->title_len, INDEX_MAX_TITLE_BYTES);
    if (!utf8_valid(d->title, d->title_len, &bad))
        return ret_fail(err, errlen, RET_EINPUT,
                        "document %zu (\"%s\"): title is not valid UTF-8 (byte %zu)", pos, idp, bad);
    if (d->meta_len > INDEX_MAX_META_BYTES || (d->meta_len && !d->meta))
        return ret_fail(err, errlen, RET_EINPUT, "document %zu (\"%s\"): metadata too large (%zu bytes, limit %u)",
                        pos, idp, d->meta_len, INDEX_MAX_META_BYTES);
    return RET_OK;
}

static int cmp_doc_ptr(const void *a, const void *b)
{
    const struct StoreDoc *x = *(const struct StoreDoc *const *)a;
    const struct StoreDoc *y = *(const struct StoreDoc *const *)b;
    size_t n = x->id_len < y->id_len ? x->id_len : y->id_len;
    int c = memcmp(x->id, y->id, n);
    return c ? c : (x->id_len > y->id_len) - (x->id_len < y->id_len);
}

int index_validate_docs(const struct StoreDoc *docs, size_t n, size_t max_doc_bytes, char *err,
                        size_t errlen)
{
    int rc;
    for (size_t i = 0; i < n; i++)
        if ((rc = index_validate_doc(&docs[i], i, max_doc_bytes, err, errlen)))
            return rc;
    if (n < 2)
        return RET_OK;
    const struct StoreDoc **sorted = malloc(n * sizeof *sorted);
    if (!sorted)
        return ret_fail(err, errlen, RET_ENOMEM, "out of memory checking ids");
    for (size_t i = 0; i < n; i++)
        sorted[i] = &docs[i];
    qsort(sorted, n, sizeof *sorted, cmp_doc_ptr);
    rc = RET_OK;
    for (size_t i = 1; i < n; i++) {
        if (cmp_doc_ptr(&sorted[i - 1], &sorted[i]) == 0) {
            char idp[48];
            id_preview(sorted[i]->id, sorted[i]->id_len, idp, sizeof idp);
            rc = ret_fail(err, errlen, RET_EINPUT, "duplicate document id \"%s\" in one batch", idp);
            break;
        }
    }
    free(sorted);
    return rc;
}

int index_validate_collection(const char *name, char *err, size_t errlen)
{
    size_t len = name ? strlen(name) : 0;
    if (len == 0 || len > INDEX_MAX_COLLECTION_BYTES)
        return ret_fail(err, errlen, RET_EINPUT, "collection name must be 1..%d bytes",
                        INDEX_MAX_COLLECTION_BYTES);
    if (!utf8_valid(name, len, NULL))
        return ret_fail(err, errlen, RET_EINPUT, "collection name is not valid UTF-8");
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)name[i] < 0x20 || name[i] == 0x7F)
            return ret_fail(err, errlen, RET_EINPUT, "collection name has a control character");
    return RET_OK;
}

int index_validate_options(const struct IndexOptions *o, char *err, size_t errlen)
{
    if (o->analyzer_flags & ~(unsigned)ANALYZE_KNOWN_FLAGS)
        return ret_fail(err, errlen, RET_EINPUT, "unknown analyzer flags 0x%x", o->analyzer_flags);
    if (o->index_flags & ~(unsigned)INDEX_TITLE)
        return ret_fail(err, errlen, RET_EINPUT, "unknown index flags 0x%x", o->index_flags);
    const struct ChunkOptions *c = &o->chunk;
    if (c->target_tokens < CHUNK_MIN_TOKENS || c->target_tokens > CHUNK_MAX_TOKENS ||
        c->overlap_tokens >= c->target_tokens)
        return ret_fail(err, errlen, RET_EINPUT,
                        "chunk size %u must be in %d..%d and overlap %u below it",
                        c->target_tokens, CHUNK_MIN_TOKENS, CHUNK_MAX_TOKENS, c->overlap_tokens);
    return RET_OK;
}

int index_chunk_terms(struct Analyzer *a, unsigned index_flags, const char *title, size_t title_len,
                      const char *heading, size_t heading_len, const char *text, size_t text_len,
                      struct TermBag *bag)
{
    termbag_clear(bag);
    int rc;
    if ((index_flags & INDEX_TITLE) && title_len &&
        (rc = analyzer_run(a, title, title_len, termbag_emit, bag)))
        return rc;
    if ((index_flags & INDEX_TITLE) && heading_len &&
        (rc = analyzer_run(a, heading, heading_len, termbag_emit, bag)))
        return rc;
    return analyzer_run(a, text, text_len, termbag_emit, bag);
}

int index_query_terms(struct Analyzer *a, const char *query, size_t len, struct TermBag *bag)
{
    termbag_clear(bag);
    int rc = analyzer_run_question(a, query, len, termbag_emit, bag);
    if (rc || bag->n)
        return rc;
    /* a query of question words only ("Who is it?") keeps them: they are all it says */
    termbag_clear(bag);
    return analyzer_run(a, query, len, termbag_emit, bag);
}
