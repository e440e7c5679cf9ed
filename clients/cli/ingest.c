/* diffrag ingest: turns the documents docsrc reads from files, folders and .jsonl lines into
 * requests bounded by count and bytes, and shows a progress line on stderr while a long ingest
 * runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clients/cli/cli.h"
#include "clients/ingest/docsrc.h"
#include "text/json.h"

/* Text per request: well under the daemon's default max_message_bytes (16 MiB). */
#define BATCH_BYTES (4u << 20)
/* One document travels in one request: a text file (or .jsonl line) over this is refused
 * before it is read, leaving room under the 16 MiB for the id, title, meta and framing. */
#define MAX_DOC_BYTES (15u << 20)
/* The daemon's default max_depth for meta; the line's object adds one level. */
#define META_MAX_DEPTH 16
#define LIMIT_HINT "the daemon takes at most 16 MiB a request (max_message_bytes); split it " \
                   "into smaller files, or ingest it on the daemon's host with diffrag-store"

struct OwnedDoc {
    char *id, *title, *text, *meta;
    size_t text_len;
};

struct Ingest {
    const struct CliArgs *a;
    DiffragClient *c;
    struct OwnedDoc *docs;
    size_t n, cap, bytes;
    int rc; /* why on_doc stopped */
    /* figures */
    size_t files_total, files_done, skipped, docs_sent, bytes_sent, requests;
    int64_t coll_docs, coll_chunks;
    double t0, last_progress;
    int tty, progress_shown;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void progress(struct Ingest *in, int final)
{
    const struct CliArgs *a = in->a;
    double now = now_s();
    if (a->quiet)
        return;
    if (final) {
        if (in->progress_shown && in->tty)
            fputc('\n', stderr);
        return;
    }
    /* A short ingest prints nothing; a long one a line a second (every request with a
     * terminal, where the line is rewritten in place, or with --progress). */
    if (!a->progress && (now - in->t0 < 1.0 || (!in->tty && now - in->last_progress < 1.0)))
        return;
    in->last_progress = now;
    in->progress_shown = 1;
    fprintf(stderr, "%singest: %zu/%zu files, %zu documents, %.1f MB sent, %.1f s%s",
            in->tty ? "\r" : "", in->files_done, in->files_total, in->docs_sent,
            in->bytes_sent / 1e6, now - in->t0, in->tty ? "\033[K" : "\n");
    fflush(stderr);
}

static void batch_clear(struct Ingest *in)
{
    for (size_t i = 0; i < in->n; i++) {
        free(in->docs[i].id);
        free(in->docs[i].title);
        free(in->docs[i].text);
        free(in->docs[i].meta);
    }
    in->n = 0;
    in->bytes = 0;
}

static int flush(struct Ingest *in)
{
    if (in->n == 0)
        return 0;
    DiffragDoc *docs = calloc(in->n, sizeof *docs);
    if (!docs)
        return CLI_EXIT_LOCAL;
    for (size_t i = 0; i < in->n; i++) {
        docs[i].id = in->docs[i].id;
        docs[i].title = in->docs[i].title;
        docs[i].text = in->docs[i].text;
        docs[i].text_len = in->docs[i].text_len;
        docs[i].meta_json = in->docs[i].meta;
    }
    DiffragIngestResult *r = NULL;
    int st = diffrag_ingest(in->c, in->a->collection, docs, in->n, &r);
    free(docs);
    if (st) {
        if (in->progress_shown && in->tty)
            fputc('\n', stderr);
        int rc = cli_fail(in->a, in->c, st);
        fprintf(stderr, "diffrag ingest: the batch of %zu documents from \"%s\" to \"%s\" was %s\n",
                in->n, in->docs[0].id, in->docs[in->n - 1].id,
                st == DIFFRAG_ESERVER ? "refused (nothing of it is stored)"
                                      : "perhaps not stored");
        return rc;
    }
    in->docs_sent += (size_t)r->ingested;
    in->bytes_sent += in->bytes;
    in->requests++;
    in->coll_docs = r->docs;
    in->coll_chunks = r->chunks;
    diffrag_ingest_result_free(&r);
    batch_clear(in);
    progress(in, 0);
    return 0;
}

/* Takes ownership of the strings (freed on failure too). */
static int add_doc(struct Ingest *in, char *id, char *title, char *text, size_t len, char *meta)
{
    int rc = 0;
    if (in->n && (in->n >= (size_t)in->a->batch || in->bytes + len > BATCH_BYTES))
        rc = flush(in);
    if (!rc && in->n == in->cap) {
        size_t cap = in->cap ? 2 * in->cap : 64;
        struct OwnedDoc *p = realloc(in->docs, cap * sizeof *p);
        if (!p)
            rc = CLI_EXIT_LOCAL;
        else {
            in->docs = p;
            in->cap = cap;
        }
    }
    if (rc) {
        free(id); free(title); free(text); free(meta);
        return rc;
    }
    in->docs[in->n++] = (struct OwnedDoc){ id, title, text, meta, len };
    in->bytes += len;
    return 0;
}

/* Queues a document read by docsrc (taking its strings); a failed request stops the file. */
static int on_doc(void *ctx, struct DocsrcDoc *d)
{
    struct Ingest *in = ctx;
    in->rc = add_doc(in, d->id, d->title, d->text, d->text_len, d->meta_json);
    d->id = d->title = d->text = d->meta_json = NULL;
    return in->rc;
}

int cmd_ingest(const struct CliArgs *a)
{
    struct Ingest in;
    struct DocsrcList f = { 0 };
    struct DocsrcOptions opt = { .max_file_bytes = MAX_DOC_BYTES, .max_line_bytes = MAX_DOC_BYTES,
                                 .limit_hint = LIMIT_HINT, .max_depth = META_MAX_DEPTH + 1,
                                 .any_named_file = 1, .notes = stderr,
                                 .prog = "diffrag ingest" };
    char err[1024];
    memset(&in, 0, sizeof in);
    in.a = a;
    in.tty = isatty(2);
    int rc = docsrc_collect(&opt, (const char *const *)a->pos, a->n_pos, &f, err, sizeof err);
    if (rc) {
        fprintf(stderr, "diffrag ingest: %s\n", err);
        rc = CLI_EXIT_LOCAL;
    }
    in.skipped = f.skipped;
    if (!rc && f.n == 0) {
        fprintf(stderr, "diffrag ingest: no " DOCSRC_KINDS " files found\n");
        rc = CLI_EXIT_USAGE;
    }
    if (!rc)
        rc = cli_connect(a, &in.c);
    in.files_total = f.n;
    in.t0 = now_s();
    for (size_t i = 0; i < f.n && !rc; i++) {
        if (cli_interrupted) {
            fprintf(stderr, "diffrag ingest: interrupted after %zu of %zu files\n", i, f.n);
            rc = CLI_EXIT_INTERRUPTED;
            break;
        }
        int st = docsrc_read(&opt, &f.files[i], on_doc, &in, &cli_interrupted, err, sizeof err);
        if (st == DOCSRC_ESTOP) {
            rc = in.rc;
        } else if (st == DOCSRC_EFILE && !f.files[i].named) {
            fprintf(stderr, "diffrag ingest: %s; skipped\n", err);
            in.skipped++;
        } else if (st) {
            fprintf(stderr, "diffrag ingest: %s\n", err);
            rc = CLI_EXIT_LOCAL;
        }
        in.files_done = i + 1;
    }
    if (!rc && cli_interrupted) {
        fprintf(stderr, "diffrag ingest: interrupted in file %zu of %zu\n", in.files_done, f.n);
        rc = CLI_EXIT_INTERRUPTED;
    }
    if (!rc)
        rc = flush(&in);
    if (in.c)
        progress(&in, 1);
    if (!rc && a->json) {
        struct JsonBuf b = { 0 };
        char tmp[256];
        json_buf_puts(&b, "{\"ok\": true, \"collection\": ");
        json_buf_string(&b, a->collection, strlen(a->collection));
        snprintf(tmp, sizeof tmp, ", \"ingested\": %zu, \"bytes\": %zu, \"docs\": %lld, "
                 "\"chunks\": %lld, \"files\": %zu, \"skipped\": %zu, \"requests\": %zu}\n",
                 in.docs_sent, in.bytes_sent, (long long)in.coll_docs, (long long)in.coll_chunks,
                 f.n, in.skipped, in.requests);
        json_buf_puts(&b, tmp);
        if (!b.oom)
            fputs(b.p, stdout);
        json_buf_free(&b);
    } else if (!rc && !a->quiet) {
        printf("ingested %zu documents (%.1f kB) from %zu files into \"%s\" in %.1f s; it holds "
               "%lld documents, %lld chunks\n", in.docs_sent, in.bytes_sent / 1e3, f.n,
               a->collection, now_s() - in.t0, (long long)in.coll_docs,
               (long long)in.coll_chunks);
        char why[160];
        if (in.skipped)
            printf("%s\n", docsrc_skip_summary(in.skipped, f.other_kind, why, sizeof why));
    }
    batch_clear(&in);
    free(in.docs);
    docsrc_list_free(&f);
    cli_disconnect(&in.c);
    return rc;
}
