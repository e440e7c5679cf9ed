/* diffrag ingest: walks files and folders, turns text files and .jsonl lines into documents,
 * sends them in batches bounded by count and bytes, and shows a progress line on stderr while
 * a long ingest runs. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clients/c/json.h"
#include "clients/cli/cli.h"

/* Text per request: well under the daemon's default max_message_bytes (16 MiB). */
#define BATCH_BYTES (4u << 20)
#define META_MAX_DEPTH 16

struct OwnedDoc {
    char *id, *title, *text, *meta;
    size_t text_len;
};

struct Ingest {
    const struct CliArgs *a;
    DiffragClient *c;
    struct OwnedDoc *docs;
    size_t n, cap, bytes;
    /* figures */
    size_t files_total, files_done, skipped, docs_sent, bytes_sent, requests;
    int64_t coll_docs, coll_chunks;
    double t0, last_progress;
    int tty, progress_shown;
};

struct Files {
    char **paths;
    unsigned char *top; /* named on the command line (not found by walking a folder) */
    size_t n, cap;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static int files_add(struct Files *f, char *path, int top)
{
    if (f->n == f->cap) {
        size_t cap = f->cap ? 2 * f->cap : 64;
        char **p = realloc(f->paths, cap * sizeof *p);
        if (!p)
            return -1;
        f->paths = p;
        unsigned char *t = realloc(f->top, cap);
        if (!t)
            return -1;
        f->top = t;
        f->cap = cap;
    }
    f->paths[f->n] = path;
    f->top[f->n++] = (unsigned char)top;
    return 0;
}

static int cmp_str(const void *x, const void *y)
{
    return strcmp(*(char *const *)x, *(char *const *)y);
}

/* Collects the files under path, in name order; returns 0 or an exit code. */
static int collect(struct Ingest *in, struct Files *f, const char *path, int top)
{
    struct stat sb;
    if (stat(path, &sb)) {
        fprintf(stderr, "diffrag ingest: %s: %s\n", path, strerror(errno));
        return CLI_EXIT_LOCAL;
    }
    if (!S_ISDIR(sb.st_mode)) {
        if (!top && !ends_with(path, ".txt") && !ends_with(path, ".md") &&
            !ends_with(path, ".jsonl")) {
            in->skipped++;
            return 0;
        }
        char *p = strdup(path);
        if (!p || files_add(f, p, top)) {
            free(p);
            return CLI_EXIT_LOCAL;
        }
        return 0;
    }
    DIR *d = opendir(path);
    if (!d) {
        fprintf(stderr, "diffrag ingest: %s: %s\n", path, strerror(errno));
        return CLI_EXIT_LOCAL;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    struct dirent *e;
    size_t pl = strlen(path);
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            char **nn = realloc(names, cap * sizeof *nn);
            if (!nn) {
                rc = CLI_EXIT_LOCAL;
                break;
            }
            names = nn;
        }
        names[n] = malloc(pl + strlen(e->d_name) + 2);
        if (!names[n]) {
            rc = CLI_EXIT_LOCAL;
            break;
        }
        sprintf(names[n], "%s%s%s", path, pl && path[pl - 1] == '/' ? "" : "/", e->d_name);
        n++;
    }
    closedir(d);
    if (n)
        qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n && !rc; i++)
        rc = collect(in, f, names[i], 0);
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    return rc;
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

static char *title_of(const char *path, const char *text)
{
    if (ends_with(path, ".md")) {
        for (const char *p = text; p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
            if (p[0] == '#' && p[1] == ' ')
                return strndup(p + 2, strcspn(p + 2, "\r\n"));
        }
    }
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    const char *dot = strrchr(base, '.');
    return strndup(base, dot && dot != base ? (size_t)(dot - base) : strlen(base));
}

static int ingest_text(struct Ingest *in, const char *path, int top)
{
    char *text;
    size_t len;
    if (cli_read_file(path, &text, &len)) {
        fprintf(stderr, "diffrag ingest: %s: %s\n", path, strerror(errno));
        return CLI_EXIT_LOCAL;
    }
    if (len == 0 || !cli_utf8_ok(text, len)) {
        free(text);
        fprintf(stderr, "diffrag ingest: %s: %s%s\n", path, len ? "not UTF-8 text" : "empty",
                top ? "" : "; skipped");
        if (top)
            return CLI_EXIT_LOCAL;
        in->skipped++;
        return 0;
    }
    char *id = strdup(path), *title = title_of(path, text);
    if (!id || !title) {
        free(id); free(title); free(text);
        return CLI_EXIT_LOCAL;
    }
    return add_doc(in, id, title, text, len, NULL);
}

/* A string field of a .jsonl object, copied; NULL when absent. */
static int jsonl_str(const msgpack_object *map, const char *key, char **out, size_t *len)
{
    *out = NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object_kv *kv = &map->via.map.ptr[i];
        if (kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == strlen(key) &&
            !memcmp(kv->key.via.str.ptr, key, kv->key.via.str.size)) {
            if (kv->val.type != MSGPACK_OBJECT_STR)
                return -1;
            *out = strndup(kv->val.via.str.ptr, kv->val.via.str.size);
            if (len)
                *len = kv->val.via.str.size;
            return *out ? 0 : -2;
        }
    }
    return 0;
}

static int jsonl_line(struct Ingest *in, const char *path, size_t lineno, const char *line,
                      size_t len)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_unpacked up;
    char err[256];
    char *id = NULL, *title = NULL, *text = NULL, *meta = NULL;
    size_t text_len = 0;
    int rc = CLI_EXIT_LOCAL;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_unpacked_init(&up);
    int jr = json_to_msgpack(line, len, &pk, META_MAX_DEPTH + 1, err, sizeof err);
    if (jr) {
        fprintf(stderr, "diffrag ingest: %s:%zu: %s\n", path, lineno, err);
        goto out;
    }
    size_t off = 0;
    if (msgpack_unpack_next(&up, sb.data, sb.size, &off) != MSGPACK_UNPACK_SUCCESS)
        goto out;
    const msgpack_object *o = &up.data;
    if (o->type != MSGPACK_OBJECT_MAP) {
        fprintf(stderr, "diffrag ingest: %s:%zu: each line must be a JSON object\n", path, lineno);
        goto out;
    }
    if (jsonl_str(o, "id", &id, NULL) || jsonl_str(o, "title", &title, NULL) ||
        jsonl_str(o, "text", &text, &text_len) || !id || !text || !*id || !text_len) {
        fprintf(stderr, "diffrag ingest: %s:%zu: each line needs non-empty strings \"id\" and "
                "\"text\" (and \"title\", when present, a string)\n", path, lineno);
        goto out;
    }
    for (uint32_t i = 0; i < o->via.map.size; i++) {
        const msgpack_object_kv *kv = &o->via.map.ptr[i];
        if (kv->key.via.str.size == 4 && !memcmp(kv->key.via.str.ptr, "meta", 4)) {
            if (kv->val.type != MSGPACK_OBJECT_MAP) {
                fprintf(stderr, "diffrag ingest: %s:%zu: \"meta\" must be an object\n", path, lineno);
                goto out;
            }
            meta = json_from_msgpack(&kv->val);
            if (!meta)
                goto out;
        }
    }
    rc = add_doc(in, id, title, text, text_len, meta);
    id = title = text = meta = NULL;
out:
    free(id); free(title); free(text); free(meta);
    msgpack_unpacked_destroy(&up);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

static int ingest_jsonl(struct Ingest *in, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "diffrag ingest: %s: %s\n", path, strerror(errno));
        return CLI_EXIT_LOCAL;
    }
    char *line = NULL;
    size_t cap = 0, lineno = 0;
    ssize_t len;
    int rc = 0;
    while (!rc && !cli_interrupted && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        size_t l = (size_t)len;
        while (l && (line[l - 1] == '\n' || line[l - 1] == '\r' || line[l - 1] == ' '))
            l--;
        size_t k = 0;
        while (k < l && (line[k] == ' ' || line[k] == '\t'))
            k++;
        if (k < l)
            rc = jsonl_line(in, path, lineno, line + k, l - k);
    }
    free(line);
    fclose(f);
    return rc;
}

int cmd_ingest(const struct CliArgs *a)
{
    struct Ingest in;
    struct Files f = { 0 };
    memset(&in, 0, sizeof in);
    in.a = a;
    in.tty = isatty(2);
    int rc = 0;
    for (size_t i = 0; i < a->n_pos && !rc; i++)
        rc = collect(&in, &f, a->pos[i], 1);
    if (!rc && f.n == 0) {
        fprintf(stderr, "diffrag ingest: no .txt, .md or .jsonl files found\n");
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
        rc = ends_with(f.paths[i], ".jsonl") ? ingest_jsonl(&in, f.paths[i])
                                             : ingest_text(&in, f.paths[i], f.top[i]);
        in.files_done = i + 1;
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
        if (in.skipped)
            printf("skipped %zu files (not .txt, .md or .jsonl, empty, or not UTF-8)\n", in.skipped);
    }
    batch_clear(&in);
    free(in.docs);
    for (size_t i = 0; i < f.n; i++)
        free(f.paths[i]);
    free(f.paths);
    free(f.top);
    cli_disconnect(&in.c);
    return rc;
}
