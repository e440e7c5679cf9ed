/* diffrag-store: the admin tool for the document store. Ingests files and folders (.txt, .md,
 * .jsonl of {id,title,text}), deletes, gets, lists, exports, prints statistics, searches
 * (also in batch for evaluations), verifies and backs up a store in a data directory. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "retriever/bm25.h"
#include "retriever/json.h"
#include "retriever/status.h"
#include "retriever/store.h"
#include "retriever/tokcount.h"

#define DEFAULT_MODEL "models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"  /* diffragd's default */

static void usage(FILE *f)
{
    fprintf(f,
        "usage: diffrag-store [--data-dir DIR] [-c COLLECTION] [options] SUBCOMMAND [ARGS]\n"
        "  --data-dir DIR        store directory (default ./var)\n"
        "  -c, --collection NAME collection (default \"default\")\n"
        "  --map-size MB         initial LMDB map size (default 64; it grows as needed)\n"
        "subcommands:\n"
        "  ingest PATH...        add or replace .txt, .md and .jsonl ({id,title,text}) files;\n"
        "                        folders are walked. Options (a new collection takes them):\n"
        "      --chunk-tokens N  chunk size in model tokens (default 256)\n"
        "      --overlap N       overlap in tokens (default 32)\n"
        "      --no-stem         no Snowball stemming      --stopwords  drop English stop words\n"
        "      --no-title        do not index titles with each chunk\n"
        "      --model FILE      tokenizer for chunk sizes: the model diffragd serves\n"
        "                        (default " DEFAULT_MODEL ")\n"
        "      --approx-tokens   count tokens with a built-in approximation (no model file)\n"
        "      --batch-docs N    documents per transaction (default 10000)\n"
        "      --batch-bytes N   text bytes per transaction (default 4 MiB)\n"
        "      --ack             after each commit print one line per document: ack \"ID\"\n"
        "  delete ID...          remove documents\n"
        "  get ID                print a document as JSON\n"
        "  list [--after ID] [--limit N]   document ids, a page at a time\n"
        "  export                every document as JSON lines {id,title,text}\n"
        "  stats [--json]        collection statistics\n"
        "  collections           collection names\n"
        "  search [-k N] [--json] [--k1 X] [--b X] [--doc ID]... QUERY...\n"
        "  search-batch [-k N] [--k1 X] [--b X]   one query per stdin line, one JSON line out\n"
        "  verify                check the whole store (exit status 1 on a problem)\n"
        "  backup DEST           compacting copy into directory DEST\n");
}

struct Args {
    const char *data_dir, *collection, *model;
    int approx_tokens, json, ack, exhaustive;
    struct IndexOptions iopt;
    size_t k, batch_docs, batch_bytes, limit, map_mb;
    double k1, b;
    const char *after;
    const char **docs;
    size_t n_docs_filter;
    const char **pos;
    size_t n_pos;
};

static int parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-')
        return -1;
    *out = (size_t)v;
    return 0;
}

static int parse_double(const char *s, double *out)
{
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    return (errno || end == s || *end) ? -1 : 0;
}

static int parse_args(int argc, char **argv, struct Args *a)
{
    memset(a, 0, sizeof *a);
    a->data_dir = "var";
    a->collection = "default";
    a->model = DEFAULT_MODEL;
    index_options_default(&a->iopt);
    a->k = 10;
    a->batch_docs = 10000;
    a->batch_bytes = 4u << 20;
    a->limit = 100;
    a->k1 = BM25_DEFAULT_K1;
    a->b = BM25_DEFAULT_B;
    a->pos = calloc((size_t)argc, sizeof *a->pos);
    a->docs = calloc((size_t)argc, sizeof *a->docs);
    if (!a->pos || !a->docs)
        return -1;
    int only_pos = 0;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        size_t n;
#define NEED_VALUE() do { if (!v) { fprintf(stderr, "diffrag-store: %s needs a value\n", o); return -1; } i++; } while (0)
        if (only_pos || o[0] != '-' || o[1] == 0) {
            a->pos[a->n_pos++] = o;
        } else if (!strcmp(o, "--")) {
            only_pos = 1;
        } else if (!strcmp(o, "--data-dir")) {
            NEED_VALUE(); a->data_dir = v;
        } else if (!strcmp(o, "-c") || !strcmp(o, "--collection")) {
            NEED_VALUE(); a->collection = v;
        } else if (!strcmp(o, "--model")) {
            NEED_VALUE(); a->model = v;
        } else if (!strcmp(o, "--approx-tokens")) {
            a->approx_tokens = 1;
        } else if (!strcmp(o, "--chunk-tokens") || !strcmp(o, "--overlap") || !strcmp(o, "-k") ||
                   !strcmp(o, "--batch-docs") || !strcmp(o, "--batch-bytes") || !strcmp(o, "--limit") ||
                   !strcmp(o, "--map-size")) {
            NEED_VALUE();
            if (parse_size(v, &n) || n > UINT32_MAX) {
                fprintf(stderr, "diffrag-store: %s: not a count: %s\n", o, v);
                return -1;
            }
            if (!strcmp(o, "--chunk-tokens")) a->iopt.chunk.target_tokens = (uint32_t)n;
            else if (!strcmp(o, "--overlap")) a->iopt.chunk.overlap_tokens = (uint32_t)n;
            else if (!strcmp(o, "-k")) a->k = n;
            else if (!strcmp(o, "--batch-docs")) a->batch_docs = n ? n : 1;
            else if (!strcmp(o, "--batch-bytes")) a->batch_bytes = n;
            else if (!strcmp(o, "--map-size")) a->map_mb = n ? n : 1;
            else a->limit = n;
        } else if (!strcmp(o, "--k1") || !strcmp(o, "--b")) {
            NEED_VALUE();
            if (parse_double(v, !strcmp(o, "--k1") ? &a->k1 : &a->b)) {
                fprintf(stderr, "diffrag-store: %s: not a number: %s\n", o, v);
                return -1;
            }
        } else if (!strcmp(o, "--no-stem")) {
            a->iopt.analyzer_flags &= ~(unsigned)ANALYZE_STEM;
        } else if (!strcmp(o, "--stopwords")) {
            a->iopt.analyzer_flags |= ANALYZE_STOPWORDS;
        } else if (!strcmp(o, "--no-title")) {
            a->iopt.index_flags &= ~(unsigned)INDEX_TITLE;
        } else if (!strcmp(o, "--json")) {
            a->json = 1;
        } else if (!strcmp(o, "--ack")) {
            a->ack = 1;
        } else if (!strcmp(o, "--exhaustive")) {
            a->exhaustive = 1;
        } else if (!strcmp(o, "--after")) {
            NEED_VALUE(); a->after = v;
        } else if (!strcmp(o, "--doc")) {
            NEED_VALUE(); a->docs[a->n_docs_filter++] = v;
        } else if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            usage(stdout);
            exit(0);
        } else {
            fprintf(stderr, "diffrag-store: unknown option %s\n", o);
            return -1;
        }
#undef NEED_VALUE
    }
    return 0;
}

/* ---- token counter ---- */

struct Counter {
    struct GgufFile *gguf;
    struct Tokenizer *tok;
    struct TokCountModel *cache;
    struct TokenCounter tc;
};

static int counter_open(const struct Args *a, struct Counter *c)
{
    memset(c, 0, sizeof *c);
    if (a->approx_tokens) {
        tokcount_simple(&c->tc);
        return 0;
    }
    char err[512];
    if (gguf_open(a->model, &c->gguf, err, sizeof err)) {
        fprintf(stderr, "diffrag-store: cannot load the tokenizer: %s\n"
                        "  (chunk sizes are counted in model tokens: pass --model FILE, or "
                        "--approx-tokens to use an approximation)\n", err);
        return -1;
    }
    if (tok_load_gguf(c->gguf, &c->tok, err, sizeof err)) {
        fprintf(stderr, "diffrag-store: %s: %s\n", a->model, err);
        gguf_close(&c->gguf);
        return -1;
    }
    if (tokcount_model_new(c->tok, &c->cache)) {
        fprintf(stderr, "diffrag-store: out of memory\n");
        tok_destroy(&c->tok);
        gguf_close(&c->gguf);
        return -1;
    }
    tokcount_model_counter(c->cache, &c->tc);
    return 0;
}

static void counter_close(struct Counter *c)
{
    tokcount_model_destroy(&c->cache);
    tok_destroy(&c->tok);
    gguf_close(&c->gguf);
}

/* ---- ingest ---- */

struct Pending {
    char *id, *title, *text;
    size_t id_len, title_len, text_len;
};

struct Ingest {
    struct Store *store;
    const struct Args *a;
    struct Counter counter;
    struct Pending *docs;
    size_t n, cap, bytes;
    size_t total_docs, total_bytes, skipped_files;
    double started;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void pending_clear(struct Ingest *in)
{
    for (size_t i = 0; i < in->n; i++) {
        free(in->docs[i].id);
        free(in->docs[i].title);
        free(in->docs[i].text);
    }
    in->n = 0;
    in->bytes = 0;
}

static int flush(struct Ingest *in)
{
    if (in->n == 0)
        return 0;
    struct StoreDoc *sd = calloc(in->n, sizeof *sd);
    if (!sd)
        return -1;
    for (size_t i = 0; i < in->n; i++) {
        struct Pending *p = &in->docs[i];
        sd[i] = (struct StoreDoc){ p->id, p->id_len, p->text, p->text_len, p->title, p->title_len, NULL, 0 };
    }
    char err[512];
    int st = store_put_docs(in->store, in->a->collection, sd, in->n, &in->a->iopt, &in->counter.tc,
                            err, sizeof err);
    free(sd);
    if (st) {
        fprintf(stderr, "diffrag-store: ingest failed (%s): %s\n", ret_strerror(st), err);
        return -1;
    }
    if (in->a->ack) {
        for (size_t i = 0; i < in->n; i++) {
            fputs("ack ", stdout);
            json_write_string(stdout, in->docs[i].id, in->docs[i].id_len);
            putchar('\n');
        }
        fflush(stdout);
    }
    in->total_docs += in->n;
    in->total_bytes += in->bytes;
    pending_clear(in);
    return 0;
}

/* Queue a document (taking ownership of the strings); a repeated id first flushes the batch,
 * so a later record with the same id replaces the earlier one. */
static int add_doc(struct Ingest *in, char *id, size_t id_len, char *title, size_t title_len,
                   char *text, size_t text_len)
{
    for (size_t i = 0; i < in->n; i++)
        if (in->docs[i].id_len == id_len && memcmp(in->docs[i].id, id, id_len) == 0) {
            if (flush(in))
                goto fail;
            break;
        }
    if (in->n == in->cap) {
        size_t c = in->cap ? in->cap * 2 : 64;
        struct Pending *p = realloc(in->docs, c * sizeof *p);
        if (!p)
            goto fail;
        in->docs = p;
        in->cap = c;
    }
    in->docs[in->n++] = (struct Pending){ id, title, text, id_len, title_len, text_len };
    in->bytes += text_len;
    if (in->n >= in->a->batch_docs || in->bytes >= in->a->batch_bytes)
        return flush(in);
    return 0;
fail:
    free(id);
    free(title);
    free(text);
    return -1;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap + 1);
    size_t r;
    while (b && (r = fread(b + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) {
            char *nb = realloc(b, 2 * cap + 1);
            if (!nb) {
                free(b);
                b = NULL;
                break;
            }
            b = nb;
            cap *= 2;
        }
    }
    if (b && ferror(f)) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[n] = 0;
        *len = n;
    }
    return b;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static int ingest_jsonl(struct Ingest *in, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "diffrag-store: %s: %s\n", path, strerror(errno));
        return -1;
    }
    static const char *const keys[] = { "id", "title", "text" };
    char *line = NULL;
    size_t cap = 0, lineno = 0;
    ssize_t len;
    int rc = 0;
    while ((len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        size_t l = (size_t)len;
        while (l && (line[l - 1] == '\n' || line[l - 1] == '\r'))
            l--;
        size_t k = 0;
        while (k < l && (line[k] == ' ' || line[k] == '\t'))
            k++;
        if (k == l)
            continue;
        char *v[3];
        size_t vl[3];
        char err[256];
        if (json_object_strings(line, l, keys, 3, v, vl, err, sizeof err)) {
            fprintf(stderr, "diffrag-store: %s:%zu: %s\n", path, lineno, err);
            rc = -1;
            break;
        }
        if (!v[0] || !v[2]) {
            fprintf(stderr, "diffrag-store: %s:%zu: each line needs string fields \"id\" and \"text\"\n",
                    path, lineno);
            free(v[0]); free(v[1]); free(v[2]);
            rc = -1;
            break;
        }
        if (add_doc(in, v[0], vl[0], v[1], v[1] ? vl[1] : 0, v[2], vl[2])) {
            rc = -1;
            break;
        }
    }
    free(line);
    fclose(f);
    return rc;
}

static int ingest_text_file(struct Ingest *in, const char *path)
{
    size_t len;
    char *text = read_file(path, &len);
    if (!text) {
        fprintf(stderr, "diffrag-store: %s: %s\n", path, strerror(errno));
        return -1;
    }
    /* Title: a Markdown file's first "# " heading, else the file name without extension. */
    const char *t = NULL;
    size_t tl = 0;
    if (ends_with(path, ".md")) {
        for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
            if (p[0] == '#' && p[1] == ' ') {
                t = p + 2;
                tl = strcspn(t, "\r\n");
                break;
            }
        }
    }
    if (!t) {
        const char *base = strrchr(path, '/');
        t = base ? base + 1 : path;
        const char *dot = strrchr(t, '.');
        tl = dot ? (size_t)(dot - t) : strlen(t);
    }
    char *title = strndup(t, tl), *id = strdup(path);
    if (!title || !id) {
        free(title); free(id); free(text);
        return -1;
    }
    return add_doc(in, id, strlen(id), title, tl, text, len);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int ingest_path(struct Ingest *in, const char *path, int top)
{
    struct stat sb;
    if (stat(path, &sb)) {
        fprintf(stderr, "diffrag-store: %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        if (!d) {
            fprintf(stderr, "diffrag-store: %s: %s\n", path, strerror(errno));
            return -1;
        }
        char **names = NULL;
        size_t n = 0, cap = 0;
        struct dirent *e;
        int rc = 0;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.')
                continue;
            if (n == cap) {
                cap = cap ? cap * 2 : 64;
                char **nn = realloc(names, cap * sizeof *nn);
                if (!nn) { rc = -1; break; }
                names = nn;
            }
            size_t pl = strlen(path);
            names[n] = malloc(pl + strlen(e->d_name) + 2);
            if (!names[n]) { rc = -1; break; }
            sprintf(names[n], "%s%s%s", path, (pl && path[pl - 1] == '/') ? "" : "/", e->d_name);
            n++;
        }
        closedir(d);
        qsort(names, n, sizeof *names, cmp_str);
        for (size_t i = 0; i < n && rc == 0; i++)
            rc = ingest_path(in, names[i], 0);
        for (size_t i = 0; i < n; i++)
            free(names[i]);
        free(names);
        return rc;
    }
    if (ends_with(path, ".jsonl"))
        return ingest_jsonl(in, path);
    if (ends_with(path, ".txt") || ends_with(path, ".md"))
        return ingest_text_file(in, path);
    if (top) {
        fprintf(stderr, "diffrag-store: %s: not a .txt, .md or .jsonl file\n", path);
        return -1;
    }
    in->skipped_files++;
    return 0;
}

static int cmd_ingest(struct Store *s, const struct Args *a)
{
    if (a->n_pos < 2) {
        fprintf(stderr, "diffrag-store: ingest needs at least one path\n");
        return 2;
    }
    struct Ingest in;
    memset(&in, 0, sizeof in);
    in.store = s;
    in.a = a;
    if (counter_open(a, &in.counter))
        return 1;
    in.started = now_s();
    int rc = 0;
    for (size_t i = 1; i < a->n_pos && rc == 0; i++)
        rc = ingest_path(&in, a->pos[i], 1);
    if (rc == 0)
        rc = flush(&in);
    double dt = now_s() - in.started;
    pending_clear(&in);
    free(in.docs);
    counter_close(&in.counter);
    fprintf(stderr, "diffrag-store: ingested %zu documents (%.2f MB) into \"%s\" in %.2f s "
                    "(%.2f MB/s, %.0f docs/s)%s\n",
            in.total_docs, in.total_bytes / 1e6, a->collection, dt,
            dt > 0 ? in.total_bytes / 1e6 / dt : 0.0, dt > 0 ? in.total_docs / dt : 0.0,
            in.skipped_files ? "; skipped files with other extensions" : "");
    return rc ? 1 : 0;
}

/* ---- reads ---- */

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

static int cmd_get(struct Store *s, const struct Args *a)
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
static int cmd_list(struct Store *s, const struct Args *a, int export)
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
            else
                printf("%.*s\n", (int)page[i].id_len, page[i].id);
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

static int cmd_stats(struct Store *s, const struct Args *a)
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
    printf("%.*s\n", (int)len, name);
    return 0;
}

static int cmd_collections(struct Store *s)
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

static void search_opts(const struct Args *a, struct SearchOptions *o, size_t *lens)
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
        fputs(",\"text\":", stdout);
        json_write_string(stdout, h->text, h->text_len);
    }
    putchar('}');
}

static int cmd_search(struct Store *s, const struct Args *a)
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
    double t0 = now_s();
    int st = store_read_begin(s, &r, err, sizeof err);
    if (!st)
        st = store_search(r, a->collection, q, strlen(q), &o, hits, a->k, &n, &bs, err, sizeof err);
    double dt = now_s() - t0;
    if (st) {
        fprintf(stderr, "diffrag-store: %s\n", err);
    } else {
        for (size_t i = 0; i < n; i++) {
            const struct SearchHit *h = &hits[i];
            if (a->json) {
                print_hit_json(h, i + 1, 1);
                putchar('\n');
            } else {
                printf("%2zu. %8.4f  %.*s #%u  %.*s\n", i + 1, h->score, (int)h->doc_id_len, h->doc_id,
                       h->chunk, (int)h->title_len, h->title);
                size_t show = h->text_len < 240 ? h->text_len : 240;
                while (show < h->text_len && show > 0 && ((unsigned char)h->text[show] & 0xC0) == 0x80)
                    show--;
                printf("    %.*s%s\n", (int)show, h->text, show < h->text_len ? " ..." : "");
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

static int cmd_search_batch(struct Store *s, const struct Args *a)
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

static int cmd_delete(struct Store *s, const struct Args *a)
{
    if (a->n_pos < 2) {
        fprintf(stderr, "diffrag-store: delete needs ids\n");
        return 2;
    }
    size_t n = a->n_pos - 1, *lens = calloc(n, sizeof *lens), deleted = 0;
    if (!lens)
        return 1;
    for (size_t i = 0; i < n; i++)
        lens[i] = strlen(a->pos[i + 1]);
    char err[512];
    int st = store_delete_docs(s, a->collection, a->pos + 1, lens, n, &deleted, err, sizeof err);
    free(lens);
    if (st) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        return 1;
    }
    printf("deleted %zu of %zu\n", deleted, n);
    return 0;
}

static int cmd_verify(struct Store *s, const struct Args *a, int all)
{
    struct StoreVerifyReport rep;
    char err[512];
    double t0 = now_s();
    int st = store_verify(s, all ? NULL : a->collection, &rep, err, sizeof err);
    printf("verify: %llu collections, %llu documents, %llu chunks, %llu terms, %llu postings, "
           "%llu problems (%.2f s)\n",
           (unsigned long long)rep.collections, (unsigned long long)rep.docs,
           (unsigned long long)rep.chunks, (unsigned long long)rep.terms,
           (unsigned long long)rep.postings, (unsigned long long)rep.problems, now_s() - t0);
    if (st) {
        fprintf(stderr, "diffrag-store: verify: %s\n", err);
        return 1;
    }
    printf("ok\n");
    return 0;
}

static void args_free(struct Args *a)
{
    free(a->pos);
    free(a->docs);
    a->pos = NULL;
    a->docs = NULL;
}

int main(int argc, char **argv)
{
    struct Args a;
    if (parse_args(argc, argv, &a) || a.n_pos == 0) {
        usage(stderr);
        args_free(&a);
        return 2;
    }
    const char *cmd = a.pos[0];
    static const char *const known[] = { "ingest", "delete", "get", "list", "export", "stats",
                                         "collections", "search", "search-batch", "verify", "backup" };
    int ok = 0;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        ok |= !strcmp(cmd, known[i]);
    if (!ok) {
        fprintf(stderr, "diffrag-store: unknown subcommand %s\n", cmd);
        usage(stderr);
        args_free(&a);
        return 2;
    }
    struct Store *s;
    char err[1024];
    struct StoreOptions so;
    store_options_default(&so);
    if (a.map_mb)
        so.map_size = a.map_mb << 20;
    int st = store_open(a.data_dir, &so, &s, err, sizeof err);
    if (st) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        args_free(&a);
        return 1;
    }
    int rc;
    if (!strcmp(cmd, "ingest")) rc = cmd_ingest(s, &a);
    else if (!strcmp(cmd, "delete")) rc = cmd_delete(s, &a);
    else if (!strcmp(cmd, "get")) rc = cmd_get(s, &a);
    else if (!strcmp(cmd, "list")) rc = cmd_list(s, &a, 0);
    else if (!strcmp(cmd, "export")) rc = cmd_list(s, &a, 1);
    else if (!strcmp(cmd, "stats")) rc = cmd_stats(s, &a);
    else if (!strcmp(cmd, "collections")) rc = cmd_collections(s);
    else if (!strcmp(cmd, "search")) rc = cmd_search(s, &a);
    else if (!strcmp(cmd, "search-batch")) rc = cmd_search_batch(s, &a);
    else if (!strcmp(cmd, "verify")) {
        /* -c given explicitly restricts the check; otherwise every collection. */
        int all = 1;
        for (int i = 1; i < argc; i++)
            if (!strcmp(argv[i], "-c") || !strcmp(argv[i], "--collection"))
                all = 0;
        rc = cmd_verify(s, &a, all);
    } else {
        if (a.n_pos != 2) {
            fprintf(stderr, "diffrag-store: backup needs a destination directory\n");
            rc = 2;
        } else if ((st = store_backup(s, a.pos[1], err, sizeof err))) {
            fprintf(stderr, "diffrag-store: %s\n", err);
            rc = 1;
        } else {
            printf("backed up to %s\n", a.pos[1]);
            rc = 0;
        }
    }
    store_close(&s);
    args_free(&a);
    return rc;
}
