/* diffrag-store's reading subcommands: get, list and export, stats, collections, search and
 * search-batch, each printing what it read (as text or JSON lines). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "retriever/bm25.h"
#include "retriever/status.h"
#include "retriever/store.h"
#include "text/json.h"
#include "text/termsafe.h"
#include "tools/store_tool.h"

/* Prints s[0..len) on stdout: as it is, or with control characters escaped when stdout is a
 * terminal (text/termsafe.h), so that a stored id, title or text cannot drive the terminal. */
static void print_safe(const char *s, size_t len, unsigned flags)
{
    static int tty = -1;
    if (tty < 0)
        tty = isatty(STDOUT_FILENO);
    if (len == 0)
        return;
    if (tty)
        term_write_escaped(stdout, s, len, flags);
    else
        printf("%.*s", (int)len, s);
}

double tool_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void print_doc_json(const struct StoreDocView *d, int with_text)
{
    fputs("{\"id\":", stdout);
    json_write_string(stdout, d->id, d->id_len);
    fputs(",\"title\":", stdout);
    json_write_string(stdout, d->title, d->title_len);
    if (with_text) {
        fputs(",\"text\":", stdout);
        json_write_string(stdout, d->text, d->text_len);
    }
    printf(",\"chunks\":%u}\n", d->n_chunks);
}

int tool_get(struct Store *s, const struct StoreArgs *a)
{
    if (a->n_pos != 2) {
        fprintf(stderr, "diffrag-store: get needs one id\n");
        return 2;
    }
    struct StoreReader *r;
    char err[512];
    if (store_read_begin(s, &r, err, sizeof err)) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        return 1;
    }
    struct StoreDocView d;
    int st = store_get_doc(r, a->collection, a->pos[1], strlen(a->pos[1]), &d, err, sizeof err);
    if (st == RET_OK)
        print_doc_json(&d, 1);
    else
        fprintf(stderr, "diffrag-store: %s\n", err);
    store_read_end(&r);
    return st ? 1 : 0;
}

/* list (ids, one page) and export (every document with its text). */
int tool_list(struct Store *s, const struct StoreArgs *a, int export)
{
    struct StoreReader *r;
    char err[512];
    if (store_read_begin(s, &r, err, sizeof err)) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        return 1;
    }
    enum { PAGE = 256 };
    struct StoreDocView page[PAGE];
    char after[INDEX_MAX_ID_BYTES];
    size_t after_len = 0, left = export ? SIZE_MAX : a->limit;
    if (a->after) {
        after_len = strlen(a->after) < sizeof after ? strlen(a->after) : sizeof after;
        memcpy(after, a->after, after_len);
    }
    int st = RET_OK;
    while (left > 0) {
        size_t n, want = left < PAGE ? left : PAGE;
        st = store_list_docs(r, a->collection, after_len ? after : NULL, after_len, page, want, &n,
                             err, sizeof err);
        if (st)
            break;
        for (size_t i = 0; i < n; i++) {
            if (export)
                print_doc_json(&page[i], 1);
            else if (a->json)
                print_doc_json(&page[i], 0);
            else {
                print_safe(page[i].id, page[i].id_len, 0);
                putchar('\n');
            }
        }
        left -= n;
        if (n < want)
            break;
        after_len = page[n - 1].id_len;
        memcpy(after, page[n - 1].id, after_len);
    }
    if (st)
        fprintf(stderr, "diffrag-store: %s\n", err);
    store_read_end(&r);
    return st ? 1 : 0;
}

int tool_stats(struct Store *s, const struct StoreArgs *a)
{
    struct StoreReader *r;
    char err[512];
    if (store_read_begin(s, &r, err, sizeof err)) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        return 1;
    }
    struct StoreCollStats cs;
    int st = store_collection_stats(r, a->collection, &cs, err, sizeof err);
    store_read_end(&r);
    if (st) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        return 1;
    }
    const struct IndexOptions *o = &cs.options;
    if (a->json) {
        fputs("{\"collection\":", stdout);
        json_write_string(stdout, a->collection, strlen(a->collection));
        printf(",\"docs\":%llu,\"chunks\":%llu,\"terms\":%llu,\"avg_chunk_terms\":%.3f,"
               "\"text_bytes\":%llu,\"chunk_tokens\":%u,\"overlap\":%u,\"stem\":%s,"
               "\"stopwords\":%s,\"index_title\":%s,\"map_bytes\":%zu}\n",
               (unsigned long long)cs.n_docs, (unsigned long long)cs.n_chunks,
               (unsigned long long)cs.total_terms, cs.avg_chunk_terms,
               (unsigned long long)cs.text_bytes, o->chunk.target_tokens, o->chunk.overlap_tokens,
               (o->analyzer_flags & ANALYZE_STEM) ? "true" : "false",
               (o->analyzer_flags & ANALYZE_STOPWORDS) ? "true" : "false",
               (o->index_flags & INDEX_TITLE) ? "true" : "false", store_map_size(s));
    } else {
        printf("collection      %s\ndocuments       %llu\nchunks          %llu\n"
               "terms           %llu (%.1f per chunk)\ntext            %llu bytes\n"
               "chunking        %u tokens, overlap %u\nanalyzer       %s%s%s\nmap size        %zu bytes\n",
               a->collection, (unsigned long long)cs.n_docs, (unsigned long long)cs.n_chunks,
               (unsigned long long)cs.total_terms, cs.avg_chunk_terms,
               (unsigned long long)cs.text_bytes, o->chunk.target_tokens, o->chunk.overlap_tokens,
               (o->analyzer_flags & ANALYZE_STEM) ? " stemming" : " no-stemming",
               (o->analyzer_flags & ANALYZE_STOPWORDS) ? ", stop words" : "",
               (o->index_flags & INDEX_TITLE) ? ", titles indexed" : "", store_map_size(s));
    }
    return 0;
}

static int print_collection(void *ctx, const char *name, size_t len)
{
    (void)ctx;
    print_safe(name, len, 0);
    putchar('\n');
    return 0;
}

int tool_collections(struct Store *s)
{
    struct StoreReader *r;
    char err[512];
    if (store_read_begin(s, &r, err, sizeof err)) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        return 1;
    }
    int st = store_list_collections(r, print_collection, NULL, err, sizeof err);
    store_read_end(&r);
    if (st)
        fprintf(stderr, "diffrag-store: %s\n", err);
    return st ? 1 : 0;
}

static void search_opts(const struct StoreArgs *a, struct SearchOptions *o, size_t *lens)
{
    search_options_default(o);
    o->k = a->k;
    o->k1 = a->k1;
    o->b = a->b;
    o->exhaustive = a->exhaustive;
    for (size_t i = 0; i < a->n_docs_filter; i++)
        lens[i] = strlen(a->docs[i]);
    o->doc_ids = a->docs;
    o->doc_id_lens = lens;
    o->n_doc_ids = a->n_docs_filter;
}

static void print_hit_json(const struct SearchHit *h, size_t rank, int with_text)
{
    printf("{\"rank\":%zu,\"doc_id\":", rank);
    json_write_string(stdout, h->doc_id, h->doc_id_len);
    printf(",\"chunk\":%u,\"score\":%.6f", h->chunk, h->score);
    if (with_text) {
        printf(",\"chunk_id\":%u,\"byte_start\":%llu,\"byte_end\":%llu,\"title\":", h->chunk_id,
               (unsigned long long)h->byte_start, (unsigned long long)h->byte_end);
        json_write_string(stdout, h->title, h->title_len);
        fputs(",\"heading\":", stdout);
        json_write_string(stdout, h->heading ? h->heading : "", h->heading_len);
        if (h->page_first)
            printf(",\"page\":[%u,%u]", h->page_first, h->page_last);
        else
            fputs(",\"page\":null", stdout);
        fputs(",\"text\":", stdout);
        json_write_string(stdout, h->text, h->text_len);
    }
    putchar('}');
}

int tool_search(struct Store *s, const struct StoreArgs *a)
{
    if (a->n_pos < 2) {
        fprintf(stderr, "diffrag-store: search needs a query\n");
        return 2;
    }
    size_t qlen = 0;
    for (size_t i = 1; i < a->n_pos; i++)
        qlen += strlen(a->pos[i]) + 1;
    char *q = calloc(qlen + 1, 1);
    size_t *lens = calloc(a->n_docs_filter + 1, sizeof *lens);
    struct SearchHit *hits = calloc(a->k ? a->k : 1, sizeof *hits);
    if (!q || !lens || !hits) {
        free(q); free(lens); free(hits);
        return 1;
    }
    for (size_t i = 1; i < a->n_pos; i++) {
        if (i > 1) strcat(q, " ");
        strcat(q, a->pos[i]);
    }
    struct SearchOptions o;
    search_opts(a, &o, lens);
    struct StoreReader *r = NULL;
    char err[512];
    size_t n = 0;
    struct Bm25Stats bs;
    double t0 = tool_now();
    int st = store_read_begin(s, &r, err, sizeof err);
    if (!st)
        st = store_search(r, a->collection, q, strlen(q), &o, hits, a->k, &n, &bs, err, sizeof err);
    double dt = tool_now() - t0;
    if (st) {
        fprintf(stderr, "diffrag-store: %s\n", err);
    } else {
        for (size_t i = 0; i < n; i++) {
            const struct SearchHit *h = &hits[i];
            if (a->json) {
                print_hit_json(h, i + 1, 1);
                putchar('\n');
            } else {
                printf("%2zu. %8.4f  ", i + 1, h->score);
                print_safe(h->doc_id, h->doc_id_len, 0);
                printf(" #%u  ", h->chunk);
                print_safe(h->title, h->title_len, 0);
                if (h->heading_len) {
                    fputs(" \xE2\x80\xBA ", stdout);
                    print_safe(h->heading, h->heading_len, 0);
                }
                if (h->page_first && h->page_last > h->page_first)
                    printf(", pp. %u\xE2\x80\x93%u", h->page_first, h->page_last);
                else if (h->page_first)
                    printf(", p. %u", h->page_first);
                putchar('\n');
                size_t show = h->text_len < 240 ? h->text_len : 240;
                while (show < h->text_len && show > 0 && ((unsigned char)h->text[show] & 0xC0) == 0x80)
                    show--;
                fputs("    ", stdout);
                print_safe(h->text, show, TERM_KEEP_LAYOUT);
                printf("%s\n", show < h->text_len ? " ..." : "");
            }
        }
        if (!a->json)
            fprintf(stderr, "%zu hits in %.2f ms (%llu candidates, %llu postings scored)\n", n, dt * 1e3,
                    (unsigned long long)bs.candidates, (unsigned long long)bs.postings);
    }
    store_read_end(&r);
    free(q);
    free(lens);
    free(hits);
    return st ? 1 : 0;
}

int tool_search_batch(struct Store *s, const struct StoreArgs *a)
{
    size_t *lens = calloc(a->n_docs_filter + 1, sizeof *lens);
    struct SearchHit *hits = calloc(a->k ? a->k : 1, sizeof *hits);
    if (!lens || !hits) {
        free(lens); free(hits);
        return 1;
    }
    struct SearchOptions o;
    search_opts(a, &o, lens);
    struct StoreReader *r = NULL;
    char err[512];
    int st = store_read_begin(s, &r, err, sizeof err);
    char *line = NULL;
    size_t cap = 0, qi = 0;
    ssize_t len;
    while (!st && (len = getline(&line, &cap, stdin)) >= 0) {
        size_t l = (size_t)len;
        while (l && (line[l - 1] == '\n' || line[l - 1] == '\r'))
            l--;
        size_t n;
        st = store_search(r, a->collection, line, l, &o, hits, a->k, &n, NULL, err, sizeof err);
        if (st)
            break;
        printf("{\"query\":%zu,\"hits\":[", qi++);
        for (size_t i = 0; i < n; i++) {
            if (i) putchar(',');
            print_hit_json(&hits[i], i + 1, 0);
        }
        fputs("]}\n", stdout);
    }
    if (st)
        fprintf(stderr, "diffrag-store: %s\n", err);
    store_read_end(&r);
    free(line);
    free(lens);
    free(hits);
    return st ? 1 : 0;
}
