/* Documents from local files (docsrc.h): the folder walk with its id and link rules, and the
 * readers of text files, .jsonl lines and (through diffrag-extract) PDF, DOCX and HTML files.
 * Only regular files are read, sizes are checked before reading, and a file that is not UTF-8
 * text is refused with the byte where it stops being text. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "text/docformat.h"
#include "clients/ingest/docsrc.h"
#include "clients/ingest/extract_run.h"
#include "text/errmsg.h"
#include "text/json.h"
#include "text/utf8.h"

/* The offset of the first byte of s[0..n) that is not part of valid UTF-8, or n. */
static size_t utf8_bad_offset(const char *s, size_t n)
{
    size_t bad = n;
    return utf8_valid(s, n, &bad) ? n : bad;
}

static int utf8_ok(const char *s) { size_t n = strlen(s); return utf8_bad_offset(s, n) == n; }

/* s printable in a message: bytes that are not UTF-8 as \xNN. */
static const char *printable(const char *s, char *buf, size_t cap)
{
    size_t n = strlen(s), o = 0;
    for (size_t i = 0; i < n && o + 5 < cap;) {
        size_t bad = utf8_bad_offset(s + i, n - i) + i;
        size_t take = bad - i < cap - o - 5 ? bad - i : cap - o - 5;
        memcpy(buf + o, s + i, take);
        o += take;
        i += take;
        if (i == bad && i < n) {
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02X", (unsigned char)s[i]);
            i++;
        }
    }
    buf[o] = 0;
    return buf;
}

static void note(const struct DocsrcOptions *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void note(const struct DocsrcOptions *o, const char *fmt, ...)
{
    if (!o->notes)
        return;
    va_list ap;
    fprintf(o->notes, "%s: ", o->prog ? o->prog : "ingest");
    va_start(ap, fmt);
    vfprintf(o->notes, fmt, ap);
    va_end(ap);
    fputc('\n', o->notes);
}

static const char *file_type(mode_t m)
{
    return S_ISFIFO(m) ? "a FIFO" : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device"
         : S_ISSOCK(m) ? "a socket" : S_ISDIR(m) ? "a folder" : "not a plain file";
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* 1 and the kind for the extensions a walk takes, else 0. */
static int kind_of(const char *name, enum DocsrcKind *kind)
{
    if (ends_with(name, ".jsonl")) *kind = DOCSRC_JSONL;
    else if (ends_with(name, ".md")) *kind = DOCSRC_MARKDOWN;
    else if (ends_with(name, ".txt")) *kind = DOCSRC_TEXT;
    else if (docformat_of_name(name) != DOCFMT_TEXT) *kind = DOCSRC_DOCUMENT;
    else return 0;
    return 1;
}

static char *join(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    int slash = la && a[la - 1] != '/';
    char *s = malloc(la + slash + lb + 1);
    if (s) {
        memcpy(s, a, la);
        if (slash)
            s[la] = '/';
        memcpy(s + la + slash, b, lb + 1);
    }
    return s;
}

/* The name a folder gives its files' ids: the last component of its real path ("" for "/").
 * real_out (optional) receives the real path (malloc'd). */
static int folder_name(const char *dir, char **out, char **real_out, char *err, size_t errlen)
{
    char *real = realpath(dir, NULL);
    if (!real)
        return errmsg_set(err, errlen, errno == ENOMEM ? DOCSRC_ENOMEM : DOCSRC_EINPUT, "%s: %s", dir,
                    strerror(errno));
    const char *base = strrchr(real, '/');
    base = base ? base + 1 : real;
    *out = strdup(base);
    int rc = *out ? DOCSRC_OK : DOCSRC_ENOMEM;
    if (*out && !utf8_ok(*out)) {
        char buf[512];
        rc = errmsg_set(err, errlen, DOCSRC_EFILE, "%s: the folder's name (%s) is not valid UTF-8, and "
                  "document ids start with it: rename the folder", dir,
                  printable(*out, buf, sizeof buf));
        free(*out);
        *out = NULL;
    }
    if (rc == DOCSRC_OK && real_out) {
        *real_out = real;
        return rc;
    }
    free(real);
    return rc;
}

/* 1 when the real path `target` lies inside the folder whose real path is `root`. */
static int inside(const char *root, const char *target)
{
    size_t n = strlen(root);
    if (n == 1 && root[0] == '/')
        return 1;
    return strncmp(target, root, n) == 0 && target[n] == '/';
}

static int list_add(struct DocsrcList *l, const char *path, const char *id, int named,
                    enum DocsrcKind kind, const struct stat *sb)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        struct DocsrcFile *p = realloc(l->files, cap * sizeof *p);
        if (!p)
            return DOCSRC_ENOMEM;
        l->files = p;
        l->cap = cap;
    }
    struct DocsrcFile *f = &l->files[l->n];
    f->path = strdup(path);
    f->id = strdup(id);
    f->named = named;
    f->kind = kind;
    f->dev = sb->st_dev;
    f->ino = sb->st_ino;
    if (!f->path || !f->id) {
        free(f->path);
        free(f->id);
        return DOCSRC_ENOMEM;
    }
    l->n++;
    return DOCSRC_OK;
}

static int cmp_str(const void *x, const void *y)
{
    return strcmp(*(char *const *)x, *(char *const *)y);
}

/* The entries of dir (hidden ones left out), sorted by name. */
static int read_names(const char *dir, char ***out, size_t *n_out)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            char **p = realloc(names, cap * sizeof *p);
            if (!p) { rc = -1; errno = ENOMEM; break; }
            names = p;
        }
        if (!(names[n] = strdup(e->d_name))) { rc = -1; errno = ENOMEM; break; }
        n++;
    }
    closedir(d);
    if (n)
        qsort(names, n, sizeof *names, cmp_str);
    *out = names;
    *n_out = n;
    return rc;
}

static void free_names(char **names, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

/* Adds the files below dir, whose ids start with prefix; root is the real path of the folder
 * given, which links must not lead out of. */
static int walk(const struct DocsrcOptions *o, struct DocsrcList *l, const char *dir,
                const char *prefix, const char *root, char *err, size_t errlen)
{
    char **names = NULL, buf[512];
    size_t n = 0;
    if (read_names(dir, &names, &n)) {
        int e = errno;
        free_names(names, n);
        if (e == ENOMEM)
            return errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
        note(o, "%s: %s; skipped", printable(dir, buf, sizeof buf), strerror(e));
        l->skipped++;
        return DOCSRC_OK;
    }
    int rc = DOCSRC_OK;
    for (size_t i = 0; i < n && rc == DOCSRC_OK; i++) {
        char *path = join(dir, names[i]), *id = prefix[0] ? join(prefix, names[i]) : strdup(names[i]);
        struct stat sb;
        enum DocsrcKind kind;
        int link = 0;
        char *target = NULL;
        if (!path || !id) {
            rc = errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
        } else if (!utf8_ok(names[i])) {
            note(o, "%s: the name is not valid UTF-8; skipped (rename it to ingest it)",
                 printable(path, buf, sizeof buf));
            l->skipped++;
        } else if (lstat(path, &sb)) {
            note(o, "%s: %s; skipped", path, strerror(errno));
            l->skipped++;
        } else if (S_ISDIR(sb.st_mode)) {
            rc = walk(o, l, path, id, root, err, errlen);
        } else if ((link = S_ISLNK(sb.st_mode)) && stat(path, &sb)) {
            note(o, "%s: a symbolic link to nothing readable (%s); skipped", path, strerror(errno));
            l->skipped++;
        } else if (S_ISDIR(sb.st_mode)) { /* sb is now the link's target */
            note(o, "%s: a symbolic link to a folder; not followed (give the folder itself)", path);
            l->skipped++;
        } else if (!kind_of(names[i], &kind)) {
            /* named, up to a bound: a folder of a thousand source files says so in one line */
            if (l->other_kind < DOCSRC_NAMED_OTHER)
                note(o, "%s: not " DOCSRC_KINDS "; skipped", path);
            else if (l->other_kind == DOCSRC_NAMED_OTHER)
                note(o, "more files that are not " DOCSRC_KINDS "; skipped without a note each");
            l->skipped++;
            l->other_kind++;
        } else if (!S_ISREG(sb.st_mode)) {
            note(o, "%s: not a regular file (%s); skipped", path, file_type(sb.st_mode));
            l->skipped++;
        } else if (link && !(target = realpath(path, NULL))) {
            note(o, "%s: a symbolic link that cannot be resolved (%s); skipped", path,
                 strerror(errno));
            l->skipped++;
        } else if (link && !inside(root, target)) {
            /* a folder is not a way to read files from elsewhere: naming the file is */
            note(o, "%s: a symbolic link to a file outside the folder (%s); not followed (give "
                 "that file itself to ingest it)", path, printable(target, buf, sizeof buf));
            l->skipped++;
        } else if (kind != DOCSRC_JSONL && strlen(id) > DOCSRC_MAX_ID_BYTES) {
            note(o, "%s: its document id would be %zu bytes, over the %d a document id may "
                 "have; skipped (shorten its name, or ingest the folder it is in)", path,
                 strlen(id), DOCSRC_MAX_ID_BYTES);
            l->skipped++;
        } else {
            rc = list_add(l, path, id, 0, kind, &sb);
            if (rc)
                errmsg_set(err, errlen, rc, "out of memory");
        }
        free(target);
        free(path);
        free(id);
    }
    free_names(names, n);
    return rc;
}

int docsrc_collect(const struct DocsrcOptions *o, const char *const *paths, size_t n_paths,
                   struct DocsrcList *l, char *err, size_t errlen)
{
    char buf[512];
    for (size_t i = 0; i < n_paths; i++) {
        const char *p = paths[i];
        struct stat sb;
        if (stat(p, &sb))
            return errmsg_set(err, errlen, DOCSRC_EINPUT, "%s: %s", printable(p, buf, sizeof buf),
                        strerror(errno));
        char *name = NULL, *real = NULL;
        int rc;
        if (S_ISDIR(sb.st_mode)) {
            rc = folder_name(p, &name, &real, err, errlen);
            if (!rc)
                rc = walk(o, l, p, name, real, err, errlen);
            free(name);
            free(real);
            if (rc)
                return rc;
            continue;
        }
        enum DocsrcKind kind;
        if (!kind_of(p, &kind)) {
            if (!o->any_named_file)
                return errmsg_set(err, errlen, DOCSRC_EINPUT, "%s: not a " DOCSRC_KINDS " file",
                            printable(p, buf, sizeof buf));
            kind = DOCSRC_TEXT;
        }
        if (!S_ISREG(sb.st_mode))
            return errmsg_set(err, errlen, DOCSRC_EFILE, "%s: not a regular file (%s)",
                        printable(p, buf, sizeof buf), file_type(sb.st_mode));
        /* A file given directly: its folder's name, then its own. */
        const char *slash = strrchr(p, '/');
        const char *base = slash ? slash + 1 : p;
        if (kind != DOCSRC_JSONL && !utf8_ok(base))
            return errmsg_set(err, errlen, DOCSRC_EFILE, "%s: the name is not valid UTF-8, and the "
                        "document's id would be: rename it", printable(p, buf, sizeof buf));
        char *dir = slash ? strndup(p, slash == p ? 1 : (size_t)(slash - p)) : strdup(".");
        if (!dir)
            return errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
        rc = folder_name(dir, &name, NULL, err, errlen);
        free(dir);
        if (rc)
            return rc;
        char *id = name[0] ? join(name, base) : strdup(base);
        free(name);
        if (id && kind != DOCSRC_JSONL && strlen(id) > DOCSRC_MAX_ID_BYTES) {
            rc = errmsg_set(err, errlen, DOCSRC_EFILE, "%s: its document id would be %zu bytes, "
                            "over the %d a document id may have: shorten its name",
                            printable(p, buf, sizeof buf), strlen(id), DOCSRC_MAX_ID_BYTES);
            free(id);
            return rc;
        }
        rc = id ? list_add(l, p, id, 1, kind, &sb) : DOCSRC_ENOMEM;
        free(id);
        if (rc)
            return errmsg_set(err, errlen, rc, "out of memory");
    }
    return DOCSRC_OK;
}

int docsrc_walk_takes(const char *path)
{
    enum DocsrcKind kind;
    for (const char *c = path; c; c = strchr(c, '/'), c = c ? c + 1 : NULL)
        if (c[0] == '.' || c[0] == '/' || c[0] == 0)
            return 0; /* hidden, empty or "." / ".." components: never a walk's */
    return kind_of(path, &kind) && kind != DOCSRC_JSONL;
}

int docsrc_folder_prefix(const char *dir, char **prefix, char *err, size_t errlen)
{
    char *name = NULL;
    *prefix = NULL;
    int rc = folder_name(dir, &name, NULL, err, errlen);
    if (rc)
        return rc;
    *prefix = name[0] ? join(name, "") : strdup("");
    free(name);
    return *prefix ? DOCSRC_OK : errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
}

void docsrc_list_free(struct DocsrcList *l)
{
    for (size_t i = 0; i < l->n; i++) {
        free(l->files[i].path);
        free(l->files[i].id);
    }
    free(l->files);
    memset(l, 0, sizeof *l);
}

void docsrc_doc_free(struct DocsrcDoc *d)
{
    free(d->id);
    free(d->title);
    free(d->text);
    free(d->meta_json);
    memset(d, 0, sizeof *d);
}

/* ---- reading ---- */

static void mib(char *buf, size_t cap, size_t bytes)
{
    snprintf(buf, cap, "%.1f MiB", bytes / 1048576.0);
}

/* Opens the regular file the walk saw, without blocking on a FIFO put in its place since; a
 * file or link put in its place (a link out of the folder, say) is not read either. */
static int open_regular(const struct DocsrcFile *f, int *fd_out, struct stat *sb, char *err,
                        size_t errlen)
{
    int fd = open(f->path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return errmsg_set(err, errlen, DOCSRC_EIO, "%s: %s", f->path, strerror(errno));
    if (fstat(fd, sb) || !S_ISREG(sb->st_mode)) {
        int e = errno;
        close(fd);
        return !S_ISREG(sb->st_mode)
                   ? errmsg_set(err, errlen, DOCSRC_EFILE, "%s: not a regular file (%s)", f->path,
                          file_type(sb->st_mode))
                   : errmsg_set(err, errlen, DOCSRC_EIO, "%s: %s", f->path, strerror(e));
    }
    if (sb->st_dev != f->dev || sb->st_ino != f->ino) {
        close(fd);
        return errmsg_set(err, errlen, DOCSRC_EFILE, "%s: replaced by another file since the "
                          "folder was read; not read (ingest again)", f->path);
    }
    *fd_out = fd;
    return DOCSRC_OK;
}

static char *title_of(const struct DocsrcFile *f, const char *text)
{
    if (f->kind == DOCSRC_MARKDOWN) {
        for (const char *p = text; p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
            if (p[0] == '#' && p[1] == ' ')
                return strndup(p + 2, strcspn(p + 2, "\r\n"));
    }
    const char *base = strrchr(f->path, '/');
    base = base ? base + 1 : f->path;
    const char *dot = strrchr(base, '.');
    return strndup(base, dot && dot != base ? (size_t)(dot - base) : strlen(base));
}

int docsrc_extract(const struct DocsrcOptions *o, const char *path, int fd, uint64_t size,
                   enum DocFormat fmt, struct DocsrcDoc *d, char *err, size_t errlen)
{
    const char *what = fmt != DOCFMT_TEXT ? docformat_name(fmt)
                                          : docformat_name(docformat_of_name(path));
    const char *article = fmt == DOCFMT_HTML || (fmt == DOCFMT_TEXT &&
                          docformat_of_name(path) == DOCFMT_HTML) ? "an" : "a";
    char a[32], b[32], why[1024];
    memset(d, 0, sizeof *d);
    if (size > DOCSRC_MAX_EXTRACT_INPUT) {
        mib(a, sizeof a, (size_t)size);
        mib(b, sizeof b, DOCSRC_MAX_EXTRACT_INPUT);
        return errmsg_set(err, errlen, DOCSRC_EFILE, "%s: %s %s of %s, over the %s a document "
                          "file may have", path, article, what, a, b);
    }
    int oom = 0;
    int st = extract_run(fd, path, o->max_file_bytes,
                         o->extract_timeout_s > 0 ? o->extract_timeout_s : DOCSRC_EXTRACT_TIMEOUT_S,
                         &d->title, &d->text, &d->text_len, &oom, why, sizeof why);
    if (st)
        return errmsg_set(err, errlen, oom ? DOCSRC_ENOMEM : DOCSRC_EFILE, "%s: %s %s: %s",
                          path, article, what, why);
    const char *nul = memchr(d->text, 0, d->text_len);
    size_t bad = utf8_bad_offset(d->text, nul ? (size_t)(nul - d->text) : d->text_len);
    if (nul || bad < d->text_len || !utf8_ok(d->title)) {
        docsrc_doc_free(d);
        return errmsg_set(err, errlen, DOCSRC_EFILE, "%s: %s %s: " EXTRACT_PROGRAM " wrote text "
                          "that is not UTF-8: a mismatched version?", path, article, what);
    }
    d->title_len = strlen(d->title);
    return DOCSRC_OK;
}

/* A PDF, DOCX or HTML file (by content, or by name for the helper to judge): one document of
 * the Markdown diffrag-extract writes. Closes fd. */
static int read_extracted(const struct DocsrcOptions *o, const struct DocsrcFile *f, int fd,
                          const struct stat *sb, enum DocFormat fmt, docsrc_doc_fn fn, void *ctx,
                          char *err, size_t errlen)
{
    struct DocsrcDoc d;
    int st = docsrc_extract(o, f->path, fd, (uint64_t)sb->st_size, fmt, &d, err, errlen);
    close(fd);
    if (st)
        return st;
    d.id = strdup(f->id);
    if (!d.id) {
        docsrc_doc_free(&d);
        return errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
    }
    d.id_len = strlen(d.id);
    st = fn(ctx, &d) ? DOCSRC_ESTOP : DOCSRC_OK;
    docsrc_doc_free(&d);
    return st;
}

static int read_text(const struct DocsrcOptions *o, const struct DocsrcFile *f, docsrc_doc_fn fn,
                     void *ctx, char *err, size_t errlen)
{
    struct stat sb;
    int fd;
    int rc = open_regular(f, &fd, &sb, err, errlen);
    if (rc)
        return rc;
    size_t size = (size_t)sb.st_size, n = 0;
    char a[32], b[32];
    unsigned char head[DOCFORMAT_SNIFF_BYTES];
    ssize_t hn = pread(fd, head, sizeof head, 0);
    enum DocFormat fmt = hn > 0 ? docformat_sniff(head, (size_t)hn) : DOCFMT_TEXT;
    if (fmt != DOCFMT_TEXT || f->kind == DOCSRC_DOCUMENT)
        return read_extracted(o, f, fd, &sb, fmt, fn, ctx, err, errlen);
    if ((uint64_t)sb.st_size > o->max_file_bytes) {
        close(fd);
        mib(a, sizeof a, size);
        mib(b, sizeof b, o->max_file_bytes);
        return errmsg_set(err, errlen, DOCSRC_EFILE, "%s: %s, over the %s a document may have%s%s",
                    f->path, a, b, o->limit_hint ? ": " : "", o->limit_hint ? o->limit_hint : "");
    }
    char *text = malloc(size + 1);
    if (!text) {
        close(fd);
        return errmsg_set(err, errlen, DOCSRC_ENOMEM, "%s: out of memory", f->path);
    }
    while (n < size) {
        ssize_t r = read(fd, text + n, size - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int e = errno;
            close(fd);
            free(text);
            return errmsg_set(err, errlen, DOCSRC_EIO, "%s: %s", f->path, strerror(e));
        }
        if (r == 0)
            break; /* it shrank since fstat */
        n += (size_t)r;
    }
    close(fd);
    text[n] = 0;
    const char *nul = memchr(text, 0, n);
    size_t bad = utf8_bad_offset(text, nul ? (size_t)(nul - text) : n);
    if (n == 0)
        rc = errmsg_set(err, errlen, DOCSRC_EFILE, "%s: empty", f->path);
    else if (nul && bad == (size_t)(nul - text))
        rc = errmsg_set(err, errlen, DOCSRC_EFILE, "%s: a NUL byte at byte %zu: not a text file",
                  f->path, bad);
    else if (bad < n)
        rc = errmsg_set(err, errlen, DOCSRC_EFILE, "%s: not valid UTF-8 at byte %zu: convert it from "
                  "the encoding it is in, e.g. iconv -f LATIN1 -t UTF-8", f->path, bad);
    if (rc) {
        free(text);
        return rc;
    }
    struct DocsrcDoc d = { .id = strdup(f->id), .title = title_of(f, text), .text = text,
                           .text_len = n };
    if (!d.id || !d.title) {
        docsrc_doc_free(&d);
        return errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
    }
    d.id_len = strlen(d.id);
    d.title_len = strlen(d.title);
    rc = fn(ctx, &d) ? DOCSRC_ESTOP : DOCSRC_OK;
    docsrc_doc_free(&d);
    return rc;
}

/* A string field of a .jsonl object: absent (NULL), or a copy; -1 when it is not a string
 * or holds a NUL character. */
static int field(json_t *obj, const char *key, char **out, size_t *len, const char **why)
{
    json_t *v = json_object_get(obj, key);
    *out = NULL;
    *len = 0;
    if (!v)
        return 0;
    if (!json_is_string(v)) {
        *why = "must be a string";
        return -1;
    }
    *len = json_string_length(v);
    if (memchr(json_string_value(v), 0, *len)) {
        *why = "holds a NUL character (\\u0000)";
        return -1;
    }
    *out = strndup(json_string_value(v), *len);
    if (!*out) {
        *why = "out of memory";
        return -1;
    }
    return 0;
}

static int jsonl_line(const struct DocsrcOptions *o, const struct DocsrcFile *f, size_t lineno,
                      const char *line, size_t len, docsrc_doc_fn fn, void *ctx, char *err,
                      size_t errlen)
{
    static const char *const keys[] = { "id", "title", "text" };
    char why[256];
    json_t *obj = NULL;
    int st = json_parse(line, len, o->max_depth > 0 ? o->max_depth : JSON_MAX_DEPTH, &obj, why,
                        sizeof why);
    if (st)
        return errmsg_set(err, errlen, st == JSON_ENOMEM ? DOCSRC_ENOMEM : DOCSRC_EINPUT, "%s:%zu: %s",
                    f->path, lineno, why);
    struct DocsrcDoc d = { .line = lineno };
    char **dst[3] = { &d.id, &d.title, &d.text };
    size_t *lens[3] = { &d.id_len, &d.title_len, &d.text_len };
    int rc = DOCSRC_EINPUT;
    if (!json_is_object(obj)) {
        errmsg_set(err, errlen, rc, "%s:%zu: each line must be a JSON object", f->path, lineno);
        goto out;
    }
    for (int i = 0; i < 3; i++) {
        const char *bad = NULL;
        if (field(obj, keys[i], dst[i], lens[i], &bad)) {
            errmsg_set(err, errlen, rc, "%s:%zu: \"%s\" %s", f->path, lineno, keys[i], bad);
            goto out;
        }
    }
    if (!d.id || !d.text) {
        errmsg_set(err, errlen, rc, "%s:%zu: each line needs string fields \"id\" and \"text\" (and "
             "\"title\", when present, a string)", f->path, lineno);
        goto out;
    }
    if (!d.id_len || !d.text_len) {
        errmsg_set(err, errlen, rc, "%s:%zu: %s", f->path, lineno,
             !d.id_len ? "empty id" : "empty text: a document needs some text");
        goto out;
    }
    if (d.id_len > DOCSRC_MAX_ID_BYTES) {
        errmsg_set(err, errlen, rc, "%s:%zu: the id is %zu bytes, over the %d a document id may "
                   "have", f->path, lineno, d.id_len, DOCSRC_MAX_ID_BYTES);
        goto out;
    }
    json_t *meta = json_object_get(obj, "meta");
    if (meta && !json_is_object(meta)) {
        errmsg_set(err, errlen, rc, "%s:%zu: \"meta\" must be an object", f->path, lineno);
        goto out;
    }
    if (meta && !(d.meta_json = json_dumps(meta, JSON_COMPACT | JSON_PRESERVE_ORDER))) {
        rc = errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
        goto out;
    }
    rc = fn(ctx, &d) ? DOCSRC_ESTOP : DOCSRC_OK;
out:
    docsrc_doc_free(&d);
    json_decref(obj);
    return rc;
}

/* Reads the next line of fp into *line (without its '\n'), at most max bytes: 1 a line, 0 the
 * end, -1 a read error, -2 a line over max (the rest of it is not read), -3 out of memory. */
static int next_line(FILE *fp, char **line, size_t *cap, size_t *len, size_t max)
{
    size_t n = 0;
    int c = EOF;
    while ((c = getc_unlocked(fp)) != EOF && c != '\n') {
        if (n == max)
            return -2;
        if (n + 1 >= *cap) {
            size_t nc = *cap ? 2 * *cap : 4096;
            char *p = realloc(*line, nc);
            if (!p)
                return -3;
            *line = p;
            *cap = nc;
        }
        (*line)[n++] = (char)c;
    }
    if (ferror(fp))
        return -1;
    *len = n;
    return c == EOF && n == 0 ? 0 : 1;
}

static int read_jsonl(const struct DocsrcOptions *o, const struct DocsrcFile *f, docsrc_doc_fn fn,
                      void *ctx, volatile int *stop, char *err, size_t errlen)
{
    struct stat sb;
    int fd;
    int rc = open_regular(f, &fd, &sb, err, errlen);
    if (rc)
        return rc;
    FILE *fp = fdopen(fd, "rb");
    if (!fp) {
        close(fd);
        return errmsg_set(err, errlen, DOCSRC_ENOMEM, "%s: %s", f->path, strerror(errno));
    }
    char *line = NULL, a[32];
    size_t cap = 0, len = 0, lineno = 0;
    int got;
    while (rc == DOCSRC_OK && !(stop && *stop) &&
           (got = next_line(fp, &line, &cap, &len, o->max_line_bytes)) != 0) {
        lineno++;
        if (got == -1) {
            rc = errmsg_set(err, errlen, DOCSRC_EIO, "%s: %s", f->path, strerror(errno));
        } else if (got == -2) {
            mib(a, sizeof a, o->max_line_bytes);
            rc = errmsg_set(err, errlen, DOCSRC_EINPUT, "%s:%zu: a line over %s, the most a document "
                      "may take%s%s", f->path, lineno, a, o->limit_hint ? ": " : "",
                      o->limit_hint ? o->limit_hint : "");
        } else if (got == -3) {
            rc = errmsg_set(err, errlen, DOCSRC_ENOMEM, "out of memory");
        } else {
            size_t l = len, k = 0;
            while (l && (line[l - 1] == '\r' || line[l - 1] == ' ' || line[l - 1] == '\t'))
                l--;
            while (k < l && (line[k] == ' ' || line[k] == '\t'))
                k++;
            if (k < l)
                rc = jsonl_line(o, f, lineno, line + k, l - k, fn, ctx, err, errlen);
        }
    }
    free(line);
    fclose(fp);
    return rc;
}

int docsrc_read(const struct DocsrcOptions *o, const struct DocsrcFile *f, docsrc_doc_fn fn,
                void *ctx, volatile int *stop, char *err, size_t errlen)
{
    return f->kind == DOCSRC_JSONL ? read_jsonl(o, f, fn, ctx, stop, err, errlen)
                                   : read_text(o, f, fn, ctx, err, errlen);
}

const char *docsrc_skip_summary(size_t skipped, size_t other_kind, char *buf, size_t cap)
{
    size_t noted = skipped - (other_kind < skipped ? other_kind : skipped);
    const char *s = skipped == 1 ? "" : "s";
    if (other_kind && noted)
        snprintf(buf, cap, "skipped %zu files (%zu not " DOCSRC_KINDS "; %zu for other reasons; "
                 "each named above)", skipped, other_kind, noted);
    else if (other_kind)
        snprintf(buf, cap, "skipped %zu file%s (not " DOCSRC_KINDS "; named above)", skipped, s);
    else
        snprintf(buf, cap, "skipped %zu file%s (for the reasons noted above)", skipped, s);
    return buf;
}
