/* `ingest --sync`: the documents of the folders given whose files are gone (docsync.h). */
#include "clients/ingest/docsync.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "clients/ingest/docsrc.h"
#include "text/errmsg.h"

int docsync_init(struct Docsync *s, const char *const *paths, size_t n, char *err,
                 size_t errlen)
{
    memset(s, 0, sizeof *s);
    s->roots = calloc(n ? n : 1, sizeof *s->roots);
    if (!s->roots)
        return errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        struct stat sb;
        int missing = stat(paths[i], &sb) != 0;
        if (missing || !S_ISDIR(sb.st_mode)) {
            docsync_free(s);
            return errmsg_set(err, errlen, DOCSRC_EINPUT, "--sync takes folders only; %s is %s",
                              paths[i], missing ? strerror(errno) : "not a folder");
        }
        struct DocsyncRoot *r = &s->roots[s->n_roots++];
        int rc = docsrc_folder_prefix(paths[i], &r->prefix, err, errlen);
        if (!rc && !r->prefix[0])
            rc = errmsg_set(err, errlen, DOCSRC_EINPUT, "--sync cannot take the root folder "
                            "\"%s\": every id would lie under it", paths[i]);
        if (!rc && !(r->dir = strdup(paths[i])))
            rc = errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
        if (rc) {
            docsync_free(s);
            return rc;
        }
        r->first = 1;
        for (size_t j = 0; j + 1 < s->n_roots; j++)
            if (strcmp(s->roots[j].prefix, r->prefix) == 0)
                r->first = 0;
    }
    return DOCSRC_OK;
}

void docsync_free(struct Docsync *s)
{
    for (size_t i = 0; i < s->n_roots; i++) {
        free(s->roots[i].dir);
        free(s->roots[i].prefix);
    }
    for (size_t i = 0; i < s->n_seen; i++)
        free(s->seen[i]);
    free(s->roots);
    free(s->seen);
    memset(s, 0, sizeof *s);
}

int docsync_seen(struct Docsync *s, const char *id, size_t len)
{
    if (s->n_seen == s->cap_seen) {
        size_t cap = s->cap_seen ? 2 * s->cap_seen : 256;
        char **p = realloc(s->seen, cap * sizeof *p);
        if (!p)
            return DOCSRC_ENOMEM;
        s->seen = p;
        s->cap_seen = cap;
    }
    char *c = strndup(id, len);
    if (!c)
        return DOCSRC_ENOMEM;
    s->seen[s->n_seen++] = c;
    s->sorted = 0;
    return DOCSRC_OK;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int docsync_under(const char *prefix, const char *id, size_t len)
{
    size_t n = strlen(prefix);
    return len > n && memcmp(id, prefix, n) == 0;
}

/* 1 when nothing is at dir/rest (lstat: ENOENT or ENOTDIR). */
static int file_gone(const char *dir, const char *rest, size_t len)
{
    size_t dl = strlen(dir);
    char *p = malloc(dl + 1 + len + 1);
    if (!p)
        return 0;
    memcpy(p, dir, dl);
    p[dl] = '/';
    memcpy(p + dl + 1, rest, len);
    p[dl + 1 + len] = 0;
    struct stat sb;
    int gone = lstat(p, &sb) != 0 && (errno == ENOENT || errno == ENOTDIR);
    free(p);
    return gone;
}

int docsync_gone(struct Docsync *s, const char *id, size_t len)
{
    if (memchr(id, 0, len))
        return 0; /* not a path */
    char *copy = strndup(id, len);
    if (!copy)
        return 0;
    int takes = 0;
    for (size_t i = 0; i < s->n_roots && !takes; i++)
        if (docsync_under(s->roots[i].prefix, id, len))
            takes = docsrc_walk_takes(copy + strlen(s->roots[i].prefix));
    free(copy);
    if (!takes)
        return 0; /* no file a walk of the folder reads has this id */
    int under = 0;
    for (size_t i = 0; i < s->n_roots; i++) {
        const struct DocsyncRoot *r = &s->roots[i];
        if (!docsync_under(r->prefix, id, len))
            continue;
        under = 1;
        size_t pl = strlen(r->prefix);
        if (!file_gone(r->dir, id + pl, len - pl))
            return 0;
    }
    if (!under)
        return 0;
    if (!s->sorted) {
        qsort(s->seen, s->n_seen, sizeof *s->seen, cmp_str);
        s->sorted = 1;
    }
    char *key = strndup(id, len);
    if (!key)
        return 0;
    int seen = bsearch(&key, s->seen, s->n_seen, sizeof *s->seen, cmp_str) != NULL;
    free(key);
    return !seen;
}
