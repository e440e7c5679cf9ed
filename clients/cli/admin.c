/* The short diffrag commands: delete, drop (which asks first on a terminal), get, ls, stats,
 * ping, and keygen (a CurveZMQ key pair written as Z85 text files, the secret one readable by
 * its owner only). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clients/cli/cli.h"
#include "text/json.h"

/* Connects, or returns the exit code from the calling command. */
#define CONNECT(a, c)                   \
    do {                                \
        int rc_ = cli_connect((a), &(c)); \
        if (rc_)                        \
            return rc_;                 \
    } while (0)

int cmd_delete(const struct CliArgs *a)
{
    DiffragClient *c = NULL;
    DiffragDeleteResult *r = NULL;
    CONNECT(a, c);
    int st = diffrag_delete(c, a->collection, (const char *const *)a->pos, a->n_pos, &r);
    int rc = st ? cli_fail(a, c, st) : CLI_EXIT_OK;
    if (!st && a->json)
        printf("%s\n", r->json);
    else if (!st)
        printf("deleted %lld of %zu ids from \"%s\"; it holds %lld document%s, %lld chunk%s\n",
               (long long)r->deleted, a->n_pos, a->collection, (long long)r->docs,
               cli_s((long long)r->docs), (long long)r->chunks, cli_s((long long)r->chunks));
    diffrag_delete_result_free(&r);
    cli_disconnect(&c);
    return rc;
}

/* Asks on the terminal whether to drop the collection, which holds docs documents: 1 yes,
 * 0 no (anything but y or yes, end of input, Ctrl-C). */
static int confirm_drop(const char *name, long long docs)
{
    char line[64];
    fprintf(stderr, "Drop the collection \"%s\" and its %lld document%s? This cannot be undone. "
            "[y/N] ", name, docs, docs == 1 ? "" : "s");
    fflush(stderr);
    if (!fgets(line, sizeof line, stdin))
        return 0;
    line[strcspn(line, " \t\r\n")] = 0;
    return !strcasecmp(line, "y") || !strcasecmp(line, "yes");
}

int cmd_drop(const struct CliArgs *a)
{
    const char *name = a->pos[0];
    DiffragClient *c = NULL;
    DiffragDropResult *r = NULL;
    int st, rc = CLI_EXIT_OK;
    if (a->collection_given)
        return cli_usage_error("drop", "name the collection as the argument, not with -c");
    if (!*name)
        return cli_usage_error("drop", "the collection name is empty");
    if (!a->yes && !isatty(STDIN_FILENO))
        return cli_usage_error("drop", "stdin is not a terminal to ask on: give --yes to drop "
                               "\"%s\"", name);
    CONNECT(a, c);
    if (!a->yes) {
        DiffragStats *s = NULL;
        st = diffrag_stats(c, name, &s);
        if (st) {
            rc = cli_fail(a, c, st);
            cli_disconnect(&c);
            return rc;
        }
        int yes = confirm_drop(name, (long long)s->docs);
        diffrag_stats_free(&s);
        if (!yes) {
            fprintf(stderr, "%sdiffrag drop: \"%s\" kept\n", cli_interrupted ? "\n" : "", name);
            cli_disconnect(&c);
            return cli_interrupted ? CLI_EXIT_INTERRUPTED : CLI_EXIT_OK;
        }
    }
    st = diffrag_drop(c, name, &r);
    if (st)
        rc = cli_fail(a, c, st);
    else if (a->json)
        printf("%s\n", r->json);
    else
        printf("dropped \"%s\": %lld document%s\n", r->collection, (long long)r->dropped,
               r->dropped == 1 ? "" : "s");
    diffrag_drop_result_free(&r);
    cli_disconnect(&c);
    return rc;
}

int cmd_get(const struct CliArgs *a)
{
    DiffragClient *c = NULL;
    DiffragDocument *d = NULL;
    CONNECT(a, c);
    int st = diffrag_get(c, a->collection, a->pos[0], &d);
    int rc = st ? cli_fail(a, c, st) : CLI_EXIT_OK;
    if (!st && a->json) {
        printf("%s\n", d->json);
    } else if (!st) {
        cli_print_safe(d->text, d->text_len, 1);
        if (d->text_len && d->text[d->text_len - 1] != '\n')
            putchar('\n');
    }
    diffrag_document_free(&d);
    cli_disconnect(&c);
    return rc;
}

static void json_doc_info(struct JsonBuf *b, const DiffragDocInfo *d)
{
    char tmp[96];
    json_buf_puts(b, "{\"id\": ");
    json_buf_string(b, d->id, strlen(d->id));
    json_buf_puts(b, ", \"title\": ");
    if (d->title)
        json_buf_string(b, d->title, strlen(d->title));
    else
        json_buf_puts(b, "null");
    snprintf(tmp, sizeof tmp, ", \"bytes\": %lld, \"chunks\": %lld}", (long long)d->bytes,
             (long long)d->chunks);
    json_buf_puts(b, tmp);
}

int cmd_ls(const struct CliArgs *a)
{
    DiffragClient *c = NULL;
    DiffragList *l = NULL;
    int st, rc = CLI_EXIT_OK;
    if (!a->collection_given && (a->limit || a->after))
        return cli_usage_error("ls", "--limit and --after page through a collection: give -c");
    CONNECT(a, c);
    if (!a->collection_given) {
        st = diffrag_list(c, NULL, NULL, 0, &l);
        if (st) {
            rc = cli_fail(a, c, st);
        } else if (a->json) {
            printf("%s\n", l->json);
        } else {
            for (size_t i = 0; i < l->n_collections; i++) {
                cli_print_safe(l->collections[i], strlen(l->collections[i]), 0);
                putchar('\n');
            }
        }
        diffrag_list_free(&l);
        cli_disconnect(&c);
        return rc;
    }
    /* every page (or --limit documents), printed as they come; JSON gathers them */
    struct JsonBuf b = { 0 };
    char *after = a->after ? strdup(a->after) : NULL;
    size_t shown = 0;
    if (a->json)
        json_buf_puts(&b, "{\"ok\": true, \"docs\": [");
    for (;;) {
        int want = 1000;
        if (a->limit && (size_t)a->limit - shown < (size_t)want)
            want = (int)((size_t)a->limit - shown);
        st = diffrag_list(c, a->collection, after, want, &l);
        if (st) {
            rc = cli_fail(a, c, st);
            break;
        }
        for (size_t i = 0; i < l->n_docs; i++, shown++) {
            const DiffragDocInfo *d = &l->docs[i];
            if (a->json) {
                if (shown)
                    json_buf_puts(&b, ", ");
                json_doc_info(&b, d);
            } else {
                cli_print_padded(d->id, 40);
                printf(" %10lld bytes %6lld chunks  ", (long long)d->bytes, (long long)d->chunks);
                if (d->title)
                    cli_print_safe(d->title, strlen(d->title), 0);
                putchar('\n');
            }
        }
        free(after);
        after = l->next ? strdup(l->next) : NULL;
        diffrag_list_free(&l);
        if (!after || (a->limit && shown >= (size_t)a->limit))
            break;
    }
    if (!rc && a->json) {
        json_buf_puts(&b, "], \"next\": ");
        if (after)
            json_buf_string(&b, after, strlen(after));
        else
            json_buf_puts(&b, "null");
        json_buf_puts(&b, "}\n");
        if (!b.oom)
            fputs(b.p, stdout);
    }
    json_buf_free(&b);
    free(after);
    cli_disconnect(&c);
    return rc;
}

int cmd_stats(const struct CliArgs *a)
{
    DiffragClient *c = NULL;
    DiffragStats *s = NULL;
    CONNECT(a, c);
    int st = diffrag_stats(c, a->collection_given ? a->collection : NULL, &s);
    int rc = st ? cli_fail(a, c, st) : CLI_EXIT_OK;
    if (!st && a->json) {
        printf("%s\n", s->json);
    } else if (!st && s->collection) {
        printf("collection:      ");
        cli_print_safe(s->collection, strlen(s->collection), 0);
        printf("\ndocuments:       %lld\nchunks:          %lld\n"
               "terms:           %lld\ntext bytes:      %lld\nterms per chunk: %.1f\n"
               "chunk tokens:    %lld\n", (long long)s->docs,
               (long long)s->chunks, (long long)s->terms, (long long)s->text_bytes,
               s->avg_chunk_terms, (long long)s->chunk_tokens);
    } else if (!st) {
        const char *version = s->version ? s->version : "", *model = s->model ? s->model : "?";
        printf("diffragd:        ");
        cli_print_safe(version, strlen(version), 0);
        printf("\nmodel:           ");
        cli_print_safe(model, strlen(model), 0);
        printf("\nuptime:          %.0f s\n"
               "workers:         %lld idle, %lld busy\nqueued:          %lld\n"
               "in flight:       %lld\nKV cache:        %.1f MB\ndraining:        %s\n",
               s->uptime_s, (long long)s->workers_idle,
               (long long)s->workers_busy, (long long)s->queue_depth, (long long)s->inflight,
               s->kv_cache_bytes / 1e6, s->draining ? "yes" : "no");
    }
    diffrag_stats_free(&s);
    cli_disconnect(&c);
    return rc;
}

int cmd_ping(const struct CliArgs *a)
{
    DiffragClient *c = NULL;
    DiffragPong *p = NULL;
    CONNECT(a, c);
    int st = diffrag_ping(c, &p);
    int rc = st ? cli_fail(a, c, st) : CLI_EXIT_OK;
    if (!st && a->json)
        printf("%s\n", p->json);
    else if (!st)
        printf("pong from %s: diffragd %s, model %s, %.1f ms\n", a->endpoint,
               p->version ? p->version : "?", p->model ? p->model : "?", p->rtt_ms);
    diffrag_pong_free(&p);
    cli_disconnect(&c);
    return rc;
}

/* Writes text to path with mode, refusing to replace a file unless force. */
static int write_key_file(const char *path, const char *text, mode_t mode, int force)
{
    if (force && unlink(path) && errno != ENOENT)
        return -1;
    /* O_EXCL: a new file always gets our mode, never an old file's wider one */
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0)
        return -1;
    size_t len = strlen(text);
    int ok = fchmod(fd, mode) == 0 && write(fd, text, len) == (ssize_t)len && fsync(fd) == 0;
    int e = errno;
    if (close(fd) && ok) {
        ok = 0;
        e = errno;
    }
    if (!ok) {
        unlink(path);
        errno = e;
        return -1;
    }
    return 0;
}

int cmd_keygen(const struct CliArgs *a)
{
    char pub[41], sec[41], line[64];
    const char *prefix = a->out ? a->out : "diffrag";
    size_t pl = strlen(prefix);
    char *pub_path = malloc(pl + 5), *sec_path = malloc(pl + 5);
    int rc = CLI_EXIT_LOCAL;
    if (!pub_path || !sec_path)
        goto out;
    sprintf(pub_path, "%s.pub", prefix);
    sprintf(sec_path, "%s.key", prefix);
    if (!a->force && (access(pub_path, F_OK) == 0 || access(sec_path, F_OK) == 0)) {
        fprintf(stderr, "diffrag keygen: %s or %s exists; --force replaces them\n", pub_path,
                sec_path);
        goto out;
    }
    if (diffrag_keygen(pub, sec)) {
        fprintf(stderr, "diffrag keygen: this libzmq has no CurveZMQ\n");
        goto out;
    }
    snprintf(line, sizeof line, "%s\n", sec);
    if (write_key_file(sec_path, line, 0600, a->force)) {
        fprintf(stderr, "diffrag keygen: %s: %s\n", sec_path, strerror(errno));
        goto out;
    }
    snprintf(line, sizeof line, "%s\n", pub);
    if (write_key_file(pub_path, line, 0644, a->force)) {
        fprintf(stderr, "diffrag keygen: %s: %s\n", pub_path, strerror(errno));
        unlink(sec_path);
        goto out;
    }
    if (a->json) {
        struct JsonBuf b = { 0 };
        json_buf_puts(&b, "{\"public_key\": ");
        json_buf_string(&b, pub, strlen(pub));
        json_buf_puts(&b, ", \"public_file\": ");
        json_buf_string(&b, pub_path, strlen(pub_path));
        json_buf_puts(&b, ", \"secret_file\": ");
        json_buf_string(&b, sec_path, strlen(sec_path));
        json_buf_puts(&b, "}\n");
        if (!b.oom)
            fputs(b.p, stdout);
        json_buf_free(&b);
    } else {
        printf("public key: %s\nwrote %s (public) and %s (secret, mode 0600)\n", pub, pub_path,
               sec_path);
    }
    rc = CLI_EXIT_OK;
out:
    memset(sec, 0, sizeof sec);
    memset(line, 0, sizeof line);
    free(pub_path);
    free(sec_path);
    return rc;
}
