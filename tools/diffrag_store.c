/* diffrag-store: the admin tool for the document store. Parses its options (getopt_long: the
 * global ones, then the subcommand's), ingests files and folders through clients/ingest/docsrc,
 * deletes documents, drops collections, verifies and backs up a store in a data directory; the
 * reading subcommands (get, list, export, stats, collections, search) are tools/store_read.c. */
#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clients/ingest/docsrc.h"
#include "clients/ingest/docsync.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "retriever/bm25.h"
#include "retriever/status.h"
#include "retriever/store.h"
#include "model/tokcount_model.h"
#include "text/tokcount.h"
#include "text/json.h"
#include "tools/store_tool.h"

#define DEFAULT_MODEL "models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"  /* diffragd's default */

static void usage(FILE *f)
{
    fprintf(f,
        "usage: diffrag-store [--data-dir DIR] [-c COLLECTION] [options] SUBCOMMAND [ARGS]\n"
        "  --data-dir DIR        store directory (default ./var)\n"
        "  -c, --collection NAME collection (default \"default\")\n"
        "  --map-size MB         initial LMDB map size (default 64; it grows as needed)\n"
        "  -h, --help            this help\n"
        "A subcommand's options may come before or after it.\n"
        "subcommands:\n"
        "  ingest PATH...        add or replace .txt, .md and .jsonl ({id,title,text}) files,\n"
        "                        and PDF, DOCX and HTML files (by content; their Markdown\n"
        "                        from diffrag-extract, beside this program or on PATH);\n"
        "                        folders are walked (hidden files skipped, symbolic links to\n"
        "                        folders not followed; only regular files are read). A text\n"
        "                        file's id is the name of the folder it was found from, then its\n"
        "                        path inside it (\"notes/sub/a.md\" for notes/sub/a.md, however\n"
        "                        the folder is written: notes, ./notes, /abs/notes, or \".\"\n"
        "                        inside it); a file given directly: its folder's name and its\n"
        "                        own (\"notes/a.txt\"). Options (a new collection takes them):\n"
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
        "      --sync            PATHs are folders; then remove the collection's documents\n"
        "                        whose ids lie under a folder's name (\"notes/...\") and\n"
        "                        whose files are gone from it. A document stored exactly so\n"
        "                        already is left as it is (unchanged); the summary counts\n"
        "                        added, changed, unchanged, removed and skipped\n"
        "  delete ID...          remove documents\n"
        "  drop                  remove the collection given with -c and all its documents\n"
        "  get ID                print a document as JSON\n"
        "  list [--after ID] [--limit N] [--json]   document ids, a page at a time\n"
        "  export [--after ID]   every document as JSON lines {id,title,text}\n"
        "  stats [--json]        collection statistics\n"
        "  collections           collection names\n"
        "  search [-k N] [--json] [--k1 X] [--b X] [--doc ID]... [--exhaustive] QUERY...\n"
        "  search-batch [-k N] [--k1 X] [--b X] [--doc ID]...   one query per stdin line,\n"
        "                        one JSON line out\n"
        "  verify                check the whole store, or with -c one collection (exit\n"
        "                        status 1 on a problem)\n"
        "  backup DEST           compacting copy into directory DEST\n"
        "exit status: 0 ok, 1 the store or a file failed, 2 usage error.\n");
}

/* ---- options ---- */

enum Sub { SUB_INGEST, SUB_DELETE, SUB_DROP, SUB_GET, SUB_LIST, SUB_EXPORT, SUB_STATS,
           SUB_COLLECTIONS, SUB_SEARCH, SUB_SEARCH_BATCH, SUB_VERIFY, SUB_BACKUP, N_SUB };
static const char *const SUBS[N_SUB] = { "ingest", "delete", "drop", "get", "list", "export",
                                         "stats", "collections", "search", "search-batch",
                                         "verify", "backup" };

enum {
    O_DATA_DIR = 256, O_MAP_SIZE, O_CHUNK_TOKENS, O_OVERLAP, O_NO_STEM, O_STOPWORDS, O_NO_TITLE,
    O_MODEL, O_APPROX, O_BATCH_DOCS, O_BATCH_BYTES, O_ACK, O_AFTER, O_LIMIT, O_JSON, O_K1, O_B,
    O_DOC, O_EXHAUSTIVE, O_SYNC,
};

#define ANY (~0u)
#define ONLY(s) (1u << (s))
#define SEARCHES (ONLY(SUB_SEARCH) | ONLY(SUB_SEARCH_BATCH))

/* Every option, with the subcommands it applies to (ANY: the global ones). */
static const struct Opt {
    const char *name; /* long name; NULL: short only */
    int has_arg, code;
    unsigned subs;
} OPTS[] = {
    { "data-dir", 1, O_DATA_DIR, ANY }, { "collection", 1, 'c', ANY },
    { "map-size", 1, O_MAP_SIZE, ANY }, { "help", 0, 'h', ANY },
    { "chunk-tokens", 1, O_CHUNK_TOKENS, ONLY(SUB_INGEST) },
    { "overlap", 1, O_OVERLAP, ONLY(SUB_INGEST) },
    { "no-stem", 0, O_NO_STEM, ONLY(SUB_INGEST) },
    { "stopwords", 0, O_STOPWORDS, ONLY(SUB_INGEST) },
    { "no-title", 0, O_NO_TITLE, ONLY(SUB_INGEST) },
    { "model", 1, O_MODEL, ONLY(SUB_INGEST) },
    { "approx-tokens", 0, O_APPROX, ONLY(SUB_INGEST) },
    { "batch-docs", 1, O_BATCH_DOCS, ONLY(SUB_INGEST) },
    { "batch-bytes", 1, O_BATCH_BYTES, ONLY(SUB_INGEST) },
    { "ack", 0, O_ACK, ONLY(SUB_INGEST) },
    { "sync", 0, O_SYNC, ONLY(SUB_INGEST) },
    { "after", 1, O_AFTER, ONLY(SUB_LIST) | ONLY(SUB_EXPORT) },
    { "limit", 1, O_LIMIT, ONLY(SUB_LIST) },
    { "json", 0, O_JSON, ONLY(SUB_LIST) | ONLY(SUB_STATS) | ONLY(SUB_SEARCH) },
    { NULL, 1, 'k', SEARCHES }, { "k1", 1, O_K1, SEARCHES }, { "b", 1, O_B, SEARCHES },
    { "doc", 1, O_DOC, SEARCHES }, { "exhaustive", 0, O_EXHAUSTIVE, SEARCHES },
};
#define N_OPTS (sizeof OPTS / sizeof OPTS[0])

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

static const struct Opt *opt_of(int code)
{
    for (size_t i = 0; i < N_OPTS; i++)
        if (OPTS[i].code == code)
            return &OPTS[i];
    return NULL;
}

static const char *opt_name(const struct Opt *o, char *buf, size_t cap)
{
    if (o->name)
        snprintf(buf, cap, "--%s", o->name);
    else
        snprintf(buf, cap, "-%c", (char)o->code);
    return buf;
}

/* Applies option code with value v; returns 0, or 2 after printing why a value is bad. */
static int take(struct StoreArgs *a, int code, const char *v)
{
    char name[32];
    size_t n = 0;
    switch (code) {
    case O_CHUNK_TOKENS: case O_OVERLAP: case 'k': case O_BATCH_DOCS: case O_BATCH_BYTES:
    case O_LIMIT: case O_MAP_SIZE:
        if (parse_size(v, &n) || n > UINT32_MAX) {
            fprintf(stderr, "diffrag-store: %s: not a count: %s\n",
                    opt_name(opt_of(code), name, sizeof name), v);
            return 2;
        }
        break;
    case O_K1: case O_B:
        if (parse_double(v, code == O_K1 ? &a->k1 : &a->b)) {
            fprintf(stderr, "diffrag-store: %s: not a number: %s\n",
                    code == O_K1 ? "--k1" : "--b", v);
            return 2;
        }
        return 0;
    }
    switch (code) {
    case O_DATA_DIR: a->data_dir = v; break;
    case 'c': a->collection = v; a->collection_given = 1; break;
    case O_MODEL: a->model = v; break;
    case O_APPROX: a->approx_tokens = 1; break;
    case O_CHUNK_TOKENS: a->iopt.chunk.target_tokens = (uint32_t)n; break;
    case O_OVERLAP: a->iopt.chunk.overlap_tokens = (uint32_t)n; break;
    case 'k': a->k = n; break;
    case O_BATCH_DOCS: a->batch_docs = n ? n : 1; break;
    case O_BATCH_BYTES: a->batch_bytes = n; break;
    case O_MAP_SIZE: a->map_mb = n ? n : 1; break;
    case O_LIMIT: a->limit = n; break;
    case O_NO_STEM: a->iopt.analyzer_flags &= ~(unsigned)ANALYZE_STEM; break;
    case O_STOPWORDS: a->iopt.analyzer_flags |= ANALYZE_STOPWORDS; break;
    case O_NO_TITLE: a->iopt.index_flags &= ~(unsigned)INDEX_TITLE; break;
    case O_JSON: a->json = 1; break;
    case O_ACK: a->ack = 1; break;
    case O_SYNC: a->sync = 1; break;
    case O_EXHAUSTIVE: a->exhaustive = 1; break;
    case O_AFTER: a->after = v; break;
    case O_DOC: a->docs[a->n_docs_filter++] = v; break;
    }
    return 0;
}

/* One getopt_long pass over argv[0..argc) (argv[0] is skipped). Returns 0, 2 (a usage error,
 * printed) or -1 (--help, printed). seen[i] marks the options of OPTS met. */
static int parse_pass(int argc, char **argv, const char *shorts, const struct option *longs,
                      struct StoreArgs *a, unsigned char *seen)
{
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, shorts, longs, NULL)) != -1) {
        if (c == '?' || c == ':') {
            const char *arg = argv[optind - 1];
            if (c == ':')
                fprintf(stderr, "diffrag-store: %s needs a value\n", arg);
            else if (optopt > 0 && optopt < 256)
                fprintf(stderr, "diffrag-store: unknown option -%c\n", optopt);
            else
                fprintf(stderr, "diffrag-store: unknown option %s\n", arg);
            usage(stderr);
            return 2;
        }
        if (c == 'h') {
            usage(stdout);
            return -1;
        }
        const struct Opt *o = opt_of(c);
        if (o)
            seen[o - OPTS] = 1;
        if (take(a, c, optarg)) {
            usage(stderr);
            return 2;
        }
    }
    return 0;
}

/* Returns 0 with *sub set, -1 after --help, 1 out of memory, 2 a usage error (printed). */
static int parse_args(int argc, char **argv, struct StoreArgs *a, enum Sub *sub)
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
    a->pos = calloc((size_t)argc + 1, sizeof *a->pos);
    a->docs = calloc((size_t)argc + 1, sizeof *a->docs);
    if (!a->pos || !a->docs)
        return 1;
    struct option longs[N_OPTS + 1];
    size_t nl = 0;
    for (size_t i = 0; i < N_OPTS; i++)
        if (OPTS[i].name)
            longs[nl++] = (struct option){ OPTS[i].name, OPTS[i].has_arg ? required_argument
                                                                         : no_argument, NULL,
                                           OPTS[i].code };
    longs[nl] = (struct option){ 0 };
    unsigned char seen[N_OPTS] = { 0 };
    /* The options before the subcommand ("+": stop at its name), then the subcommand's own,
     * anywhere among its arguments. Both passes know every option; which apply to the
     * subcommand is checked once it is known. */
    int rc = parse_pass(argc, argv, "+:c:k:h", longs, a, seen);
    if (rc)
        return rc;
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    int first = optind;
    size_t s = 0;
    while (s < N_SUB && strcmp(argv[first], SUBS[s]))
        s++;
    if (s == N_SUB) {
        fprintf(stderr, "diffrag-store: unknown subcommand %s\n", argv[first]);
        usage(stderr);
        return 2;
    }
    *sub = (enum Sub)s;
    optind = 0; /* a fresh scan of the subcommand's arguments */
    rc = parse_pass(argc - first, argv + first, ":c:k:h", longs, a, seen);
    if (rc)
        return rc;
    a->pos[a->n_pos++] = argv[first];
    for (int i = first + optind; i < argc; i++)
        a->pos[a->n_pos++] = argv[i];
    for (size_t i = 0; i < N_OPTS; i++) {
        char name[32];
        if (seen[i] && !(OPTS[i].subs & ONLY(s))) {
            fprintf(stderr, "diffrag-store: %s does not apply to %s (see --help)\n",
                    opt_name(&OPTS[i], name, sizeof name), SUBS[s]);
            usage(stderr);
            return 2;
        }
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

static int counter_open(const struct StoreArgs *a, struct Counter *c)
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

_Static_assert(DOCSRC_MAX_ID_BYTES == INDEX_MAX_ID_BYTES,
               "the ingest's id limit is the store's: a longer id would refuse a whole batch");

/* Text file and .jsonl line limits: the store's own (64 MiB a document by default). A .jsonl
 * line may hold escapes, so it gets four times that. */
#define LIMIT_HINT "split it into smaller documents"

struct Pending {
    char *id, *title, *text;
    size_t id_len, title_len, text_len;
};

struct Ingest {
    struct Store *store;
    const struct StoreArgs *a;
    struct Counter counter;
    struct Pending *docs;
    size_t n, cap, bytes;
    size_t total_docs, total_bytes, skipped_files;
    size_t added, changed, unchanged, removed;
    struct Docsync *sync;  /* --sync: the folders, and the ids stored */
    char skip_why[3][256]; /* the first files skipped when read, and why */
    size_t n_skip_why;
    double started;
};

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
    struct StorePutReport rep;
    int st = store_put_docs_report(in->store, in->a->collection, sd, in->n, &in->a->iopt,
                                   &in->counter.tc, &rep, err, sizeof err);
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
    in->added += rep.added;
    in->changed += rep.changed;
    in->unchanged += rep.unchanged;
    pending_clear(in);
    return 0;
}

/* Queues a document read by docsrc, taking its strings (a .jsonl "meta" is not stored here);
 * a repeated id first flushes the batch, so a later record with the same id replaces the
 * earlier one. */
static int on_doc(void *ctx, struct DocsrcDoc *d)
{
    struct Ingest *in = ctx;
    if (in->sync && docsync_seen(in->sync, d->id, d->id_len)) {
        fprintf(stderr, "diffrag-store: out of memory\n");
        return -1;
    }
    for (size_t i = 0; i < in->n; i++)
        if (in->docs[i].id_len == d->id_len && memcmp(in->docs[i].id, d->id, d->id_len) == 0) {
            if (flush(in))
                return -1;
            break;
        }
    if (in->n == in->cap) {
        size_t c = in->cap ? in->cap * 2 : 64;
        struct Pending *p = realloc(in->docs, c * sizeof *p);
        if (!p) {
            fprintf(stderr, "diffrag-store: out of memory\n");
            return -1;
        }
        in->docs = p;
        in->cap = c;
    }
    in->docs[in->n++] = (struct Pending){ d->id, d->title, d->text, d->id_len, d->title_len,
                                          d->text_len };
    d->id = d->title = d->text = NULL;
    in->bytes += d->text_len;
    if (in->n >= in->a->batch_docs || in->bytes >= in->a->batch_bytes)
        return flush(in);
    return 0;
}

/* --sync: the collection's documents under each folder's prefix whose files are gone
 * (docsync.h), deleted in one transaction. */
static int sync_remove(struct Ingest *in)
{
    struct Docsync *sy = in->sync;
    char err[512];
    char **gone = NULL;
    size_t *lens = NULL, n_gone = 0, cap = 0;
    int st = RET_OK;
    struct StoreDocView page[256];
    for (size_t i = 0; i < sy->n_roots && !st; i++) {
        if (!sy->roots[i].first)
            continue;
        const char *prefix = sy->roots[i].prefix;
        char *after = strdup(prefix);
        size_t after_len = after ? strlen(after) : 0;
        while (after && !st) {
            struct StoreReader *r;
            size_t n = 0;
            if ((st = store_read_begin(in->store, &r, err, sizeof err)))
                break;
            st = store_list_docs(r, in->a->collection, after, after_len, page, 256, &n, err,
                                 sizeof err);
            free(after);
            after = NULL;
            if (st == RET_ENOTFOUND)
                st = RET_OK, n = 0; /* no collection: nothing to remove */
            int past = 0;
            for (size_t j = 0; j < n && !st; j++) {
                if (!docsync_under(prefix, page[j].id, page[j].id_len)) {
                    past = 1;
                    break;
                }
                if (!docsync_gone(sy, page[j].id, page[j].id_len))
                    continue;
                if (n_gone == cap) {
                    cap = cap ? 2 * cap : 64;
                    char **g = realloc(gone, cap * sizeof *g);
                    size_t *l = g ? realloc(lens, cap * sizeof *l) : NULL;
                    gone = g ? g : gone;
                    lens = l ? l : lens;
                    if (!g || !l) {
                        st = ret_fail(err, sizeof err, RET_ENOMEM, "out of memory");
                        break;
                    }
                }
                if (!(gone[n_gone] = strndup(page[j].id, page[j].id_len)))
                    st = ret_fail(err, sizeof err, RET_ENOMEM, "out of memory");
                else
                    lens[n_gone++] = page[j].id_len;
            }
            if (!st && !past && n == 256) {
                after = strndup(page[n - 1].id, page[n - 1].id_len);
                after_len = page[n - 1].id_len;
                if (!after)
                    st = ret_fail(err, sizeof err, RET_ENOMEM, "out of memory");
            }
            store_read_end(&r);
        }
    }
    if (!st && n_gone)
        st = store_delete_docs(in->store, in->a->collection, (const char *const *)gone, lens,
                               n_gone, &in->removed, err, sizeof err);
    if (st)
        fprintf(stderr, "diffrag-store: --sync failed (%s): %s\n", ret_strerror(st), err);
    for (size_t i = 0; i < n_gone; i++)
        free(gone[i]);
    free(gone);
    free(lens);
    return st ? -1 : 0;
}

static int cmd_ingest(struct Store *s, const struct StoreArgs *a)
{
    if (a->n_pos < 2) {
        fprintf(stderr, "diffrag-store: ingest needs at least one path\n");
        return 2;
    }
    struct StoreOptions so;
    store_options_default(&so);
    struct DocsrcOptions opt = { .max_file_bytes = so.max_doc_bytes,
                                 .max_line_bytes = 4 * so.max_doc_bytes, .limit_hint = LIMIT_HINT,
                                 .notes = stderr, .prog = "diffrag-store" };
    struct DocsrcList files = { 0 };
    struct Ingest in;
    char err[1024];
    struct Docsync sync;
    memset(&in, 0, sizeof in);
    memset(&sync, 0, sizeof sync);
    in.store = s;
    in.a = a;
    if (a->sync) {
        if (docsync_init(&sync, a->pos + 1, a->n_pos - 1, err, sizeof err)) {
            fprintf(stderr, "diffrag-store: %s\n", err);
            return 2;
        }
        in.sync = &sync;
    }
    if (docsrc_collect(&opt, a->pos + 1, a->n_pos - 1, &files, err, sizeof err)) {
        docsync_free(&sync);
        fprintf(stderr, "diffrag-store: %s\n", err);
        docsrc_list_free(&files);
        return 1;
    }
    if (counter_open(a, &in.counter)) {
        docsync_free(&sync);
        docsrc_list_free(&files);
        return 1;
    }
    int rc = 0;
    in.skipped_files = files.skipped;
    size_t other_kind = files.other_kind;
    in.started = tool_now();
    for (size_t i = 0; i < files.n && rc == 0; i++) {
        rc = docsrc_read(&opt, &files.files[i], on_doc, &in, NULL, err, sizeof err);
        if (rc == DOCSRC_EFILE && !files.files[i].named) {
            fprintf(stderr, "diffrag-store: %s; skipped\n", err);
            if (in.n_skip_why < 3)
                snprintf(in.skip_why[in.n_skip_why++], sizeof in.skip_why[0], "%.255s", err);
            in.skipped_files++;
            rc = 0;
        } else if (rc && rc != DOCSRC_ESTOP) {
            fprintf(stderr, "diffrag-store: %s\n", err); /* ESTOP: flush said why */
        }
    }
    if (rc == 0)
        rc = flush(&in);
    /* only after every file was read and stored: a failed ingest removes nothing */
    if (rc == 0 && in.sync)
        rc = sync_remove(&in);
    double dt = tool_now() - in.started;
    pending_clear(&in);
    free(in.docs);
    counter_close(&in.counter);
    docsrc_list_free(&files);
    docsync_free(&sync);
    fprintf(stderr, "diffrag-store: ingested %zu document%s (%.2f MB) into \"%s\" in %.2f s "
                    "(%.2f MB/s, %.0f docs/s): %zu added, %zu changed, %zu unchanged, %zu "
                    "removed, %zu skipped",
            in.total_docs, in.total_docs == 1 ? "" : "s", in.total_bytes / 1e6, a->collection, dt,
            dt > 0 ? in.total_bytes / 1e6 / dt : 0.0, dt > 0 ? in.total_docs / dt : 0.0,
            in.added, in.changed, in.unchanged, in.removed, in.skipped_files);
    for (size_t i = 0; i < in.n_skip_why; i++)
        fprintf(stderr, "%s%s", i ? "; " : " (", in.skip_why[i]);
    if (in.n_skip_why)
        fprintf(stderr, "%s)", in.skipped_files > in.n_skip_why ? "; ..." : "");
    char why[160];
    if (in.skipped_files)
        fprintf(stderr, "; %s", docsrc_skip_summary(in.skipped_files, other_kind, why, sizeof why));
    fputc('\n', stderr);
    return rc ? 1 : 0;
}

/* ---- writes and checks ---- */

static int cmd_delete(struct Store *s, const struct StoreArgs *a)
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

/* The walk runs in a child process on its own handle of the store: LMDB aborts on some
 * damaged pages (an assertion), and that must be a finding, not the end of the tool. */
static int cmd_verify(const struct StoreArgs *a, const struct StoreOptions *so, int all)
{
    struct StoreVerifyReport rep;
    char err[1024];
    double t0 = tool_now();
    int st = store_check_isolated(a->data_dir, so, STORE_CHECK_FULL, all ? NULL : a->collection, 0,
                                  &rep, err, sizeof err);
    if (st && !rep.problems && !rep.collections) {
        fprintf(stderr, "diffrag-store: %s\n", err);   /* the store did not open */
        return 1;
    }
    printf("verify: %llu collections, %llu documents, %llu chunks, %llu terms, %llu postings, "
           "%llu KV records (%llu bytes), %llu problems (%.2f s)\n",
           (unsigned long long)rep.collections, (unsigned long long)rep.docs,
           (unsigned long long)rep.chunks, (unsigned long long)rep.terms,
           (unsigned long long)rep.postings, (unsigned long long)rep.kv_records,
           (unsigned long long)rep.kv_bytes, (unsigned long long)rep.problems, tool_now() - t0);
    if (rep.docs_unsummed)
        printf("verify: %llu documents predate checksums (written before schema 3): their text "
               "was checked as UTF-8 and against their chunks; ingest them again to give them "
               "checksums\n", (unsigned long long)rep.docs_unsummed);
    if (st) {
        fprintf(stderr, "diffrag-store: verify: %s\n", err);
        return 1;
    }
    printf("ok\n");
    return 0;
}

static int cmd_drop(struct Store *s, const struct StoreArgs *a)
{
    if (!a->collection_given || a->n_pos != 1) {
        fprintf(stderr, "diffrag-store: drop takes no arguments; name the collection with -c\n");
        return 2;
    }
    uint64_t n = 0;
    char err[512];
    if (store_drop_collection(s, a->collection, &n, err, sizeof err)) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        return 1;
    }
    printf("dropped collection \"%s\" (%llu documents)\n", a->collection, (unsigned long long)n);
    return 0;
}

static int cmd_backup(struct Store *s, const struct StoreArgs *a)
{
    char err[1024];
    if (a->n_pos != 2) {
        fprintf(stderr, "diffrag-store: backup needs a destination directory\n");
        return 2;
    }
    if (store_backup(s, a->pos[1], err, sizeof err)) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        return 1;
    }
    printf("backed up to %s\n", a->pos[1]);
    return 0;
}

static void args_free(struct StoreArgs *a)
{
    free(a->pos);
    free(a->docs);
    a->pos = NULL;
    a->docs = NULL;
}

int main(int argc, char **argv)
{
    struct StoreArgs a;
    enum Sub sub = SUB_INGEST;
    int rc = parse_args(argc, argv, &a, &sub);
    if (rc) {
        if (rc == 1)
            fprintf(stderr, "diffrag-store: out of memory\n");
        args_free(&a);
        return rc < 0 ? 0 : rc;
    }
    struct Store *s;
    char err[1024];
    struct StoreOptions so;
    store_options_default(&so);
    if (a.map_mb)
        so.map_size = a.map_mb << 20;
    /* -c given restricts the check to one collection; otherwise every collection. */
    if (sub == SUB_VERIFY) {
        rc = cmd_verify(&a, &so, !a.collection_given);
        args_free(&a);
        return rc;
    }
    if (store_open(a.data_dir, &so, &s, err, sizeof err)) {
        fprintf(stderr, "diffrag-store: %s\n", err);
        args_free(&a);
        return 1;
    }
    switch (sub) {
    case SUB_INGEST: rc = cmd_ingest(s, &a); break;
    case SUB_DELETE: rc = cmd_delete(s, &a); break;
    case SUB_DROP: rc = cmd_drop(s, &a); break;
    case SUB_GET: rc = tool_get(s, &a); break;
    case SUB_LIST: rc = tool_list(s, &a, 0); break;
    case SUB_EXPORT: rc = tool_list(s, &a, 1); break;
    case SUB_STATS: rc = tool_stats(s, &a); break;
    case SUB_COLLECTIONS: rc = tool_collections(s); break;
    case SUB_SEARCH: rc = tool_search(s, &a); break;
    case SUB_SEARCH_BATCH: rc = tool_search_batch(s, &a); break;
    case SUB_BACKUP: default: rc = cmd_backup(s, &a); break;
    }
    store_close(&s);
    args_free(&a);
    return rc;
}
