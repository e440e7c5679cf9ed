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
#include "clients/ingest/docsync.h"
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
    struct Docsync *sync;   /* --sync: the folders, and the ids stored */
    /* figures */
    size_t files_total, files_done, skipped, docs_sent, bytes_sent, requests;
    size_t added, changed, unchanged, removed;
    int counts_known;       /* every reply said what it did with its documents */
    char skip_why[3][256];  /* the first files skipped when read, and why */
    size_t n_skip_why;
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
    if (r->added + r->changed + r->unchanged != r->ingested)
        in->counts_known = 0;
    in->added += (size_t)r->added;
    in->changed += (size_t)r->changed;
    in->unchanged += (size_t)r->unchanged;
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
    if (in->sync && docsync_seen(in->sync, d->id, strlen(d->id)))
        return in->rc = CLI_EXIT_LOCAL;
    in->rc = add_doc(in, d->id, d->title, d->text, d->text_len, d->meta_json);
    d->id = d->title = d->text = d->meta_json = NULL;
    return in->rc;
}

/* --sync: pages through the collection's ids under each folder's prefix and deletes, a batch
 * at a time, those docsync_gone names (docsync.h). */
static int sync_remove(struct Ingest *in)
{
    struct Docsync *s = in->sync;
    char **gone = NULL;
    size_t n_gone = 0, cap = 0;
    int rc = 0;
    for (size_t i = 0; i < s->n_roots && !rc; i++) {
        if (!s->roots[i].first)
            continue;
        const char *prefix = s->roots[i].prefix;
        char *after = strdup(prefix);
        while (after && !rc) {
            DiffragList *l = NULL;
            int st = diffrag_list(in->c, in->a->collection, after, 1000, &l);
            free(after);
            after = NULL;
            if (st == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(in->c), "not_found"))
                break; /* no collection (nothing was stored): nothing to remove */
            if (st) {
                rc = cli_fail(in->a, in->c, st);
                break;
            }
            int past = 0;
            for (size_t j = 0; j < l->n_docs && !rc; j++) {
                const char *id = l->docs[j].id;
                if (!docsync_under(prefix, id, strlen(id))) {
                    past = 1;
                    break;
                }
                if (!docsync_gone(s, id, strlen(id)))
                    continue;
                if (n_gone == cap) {
                    size_t c = cap ? 2 * cap : 64;
                    char **p = realloc(gone, c * sizeof *p);
                    if (!p) {
                        rc = CLI_EXIT_LOCAL;
                        break;
                    }
                    gone = p;
                    cap = c;
                }
                if (!(gone[n_gone] = strdup(id)))
                    rc = CLI_EXIT_LOCAL;
                else
                    n_gone++;
            }
            if (!rc && !past && l->next && !(after = strdup(l->next)))
                rc = CLI_EXIT_LOCAL;
            diffrag_list_free(&l);
        }
    }
    for (size_t i = 0; i < n_gone && !rc; i += (size_t)in->a->batch) {
        size_t n = n_gone - i < (size_t)in->a->batch ? n_gone - i : (size_t)in->a->batch;
        DiffragDeleteResult *r = NULL;
        int st = diffrag_delete(in->c, in->a->collection, (const char *const *)gone + i, n, &r);
        if (st) {
            rc = cli_fail(in->a, in->c, st);
            break;
        }
        in->removed += (size_t)r->deleted;
        in->coll_docs = r->docs;
        in->coll_chunks = r->chunks;
        diffrag_delete_result_free(&r);
    }
    if (rc == CLI_EXIT_LOCAL)
        fprintf(stderr, "diffrag ingest: out of memory\n");
    for (size_t i = 0; i < n_gone; i++)
        free(gone[i]);
    free(gone);
    return rc;
}

/* "2 added, 1 changed, 9 unchanged, 1 removed, 1 skipped (notes/bad.pdf: ...)" into b. */
static void counts_line(const struct Ingest *in, char *b, size_t cap)
{
    size_t o = 0;
    if (in->counts_known)
        o += (size_t)snprintf(b, cap, "%zu added, %zu changed, %zu unchanged, ", in->added,
                              in->changed, in->unchanged);
    if (o < cap)
        o += (size_t)snprintf(b + o, cap - o, "%zu removed, %zu skipped", in->removed,
                              in->skipped);
    for (size_t i = 0; i < in->n_skip_why && o < cap; i++)
        o += (size_t)snprintf(b + o, cap - o, "%s%s", i ? "; " : " (", in->skip_why[i]);
    if (in->n_skip_why && o < cap)
        o += (size_t)snprintf(b + o, cap - o, "%s)", in->skipped > in->n_skip_why ? "; ..." : "");
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
    struct Docsync sync;
    memset(&in, 0, sizeof in);
    memset(&sync, 0, sizeof sync);
    in.a = a;
    in.tty = isatty(2);
    in.counts_known = 1;
    if (a->sync) {
        if (docsync_init(&sync, (const char *const *)a->pos, a->n_pos, err, sizeof err)) {
            fprintf(stderr, "diffrag ingest: %s\n", err);
            return CLI_EXIT_USAGE;
        }
        in.sync = &sync;
    }
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
            if (in.n_skip_why < 3)
                snprintf(in.skip_why[in.n_skip_why++], sizeof in.skip_why[0], "%.255s", err);
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
    /* only after every file was read and stored: a failed or interrupted ingest removes nothing */
    if (!rc && in.sync)
        rc = sync_remove(&in);
    if (in.c)
        progress(&in, 1);
    if (!rc && a->json) {
        struct JsonBuf b = { 0 };
        char tmp[256];
        json_buf_puts(&b, "{\"ok\": true, \"collection\": ");
        json_buf_string(&b, a->collection, strlen(a->collection));
        snprintf(tmp, sizeof tmp, ", \"ingested\": %zu, \"bytes\": %zu, \"docs\": %lld, "
                 "\"chunks\": %lld, \"files\": %zu, \"skipped\": %zu, \"requests\": %zu, "
                 "\"removed\": %zu", in.docs_sent, in.bytes_sent, (long long)in.coll_docs,
                 (long long)in.coll_chunks, f.n, in.skipped, in.requests, in.removed);
        json_buf_puts(&b, tmp);
        if (in.counts_known) {
            snprintf(tmp, sizeof tmp, ", \"added\": %zu, \"changed\": %zu, \"unchanged\": %zu",
                     in.added, in.changed, in.unchanged);
            json_buf_puts(&b, tmp);
        }
        json_buf_puts(&b, "}\n");
        if (!b.oom)
            fputs(b.p, stdout);
        json_buf_free(&b);
    } else if (!rc && !a->quiet) {
        char counts[1024];
        counts_line(&in, counts, sizeof counts);
        printf("ingested %zu document%s (%.1f kB) from %zu file%s into \"%s\" in %.1f s: %s; "
               "it holds %lld document%s, %lld chunk%s\n", in.docs_sent,
               cli_s((long long)in.docs_sent), in.bytes_sent / 1e3, f.n, cli_s((long long)f.n),
               a->collection, now_s() - in.t0, counts, (long long)in.coll_docs,
               cli_s(in.coll_docs), (long long)in.coll_chunks, cli_s(in.coll_chunks));
        char why[160];
        if (in.skipped)
            printf("%s\n", docsrc_skip_summary(in.skipped, f.other_kind, why, sizeof why));
    }
    batch_clear(&in);
    free(in.docs);
    docsrc_list_free(&f);
    docsync_free(&sync);
    cli_disconnect(&in.c);
    return rc;
}
