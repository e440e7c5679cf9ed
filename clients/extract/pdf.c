/* PDF to Markdown for diffrag-extract: poppler's pdftotext (GPL, so run as its own program,
 * never linked) writes the text layer in reading order, each page ended by a form feed; each
 * page with text becomes "<!-- page N -->" and its lines. The document's outline (its
 * bookmarks, as pdftohtml -xml lists them) gives the headings: an entry's line on its page
 * becomes a heading of the entry's depth. The title is the document's Title (pdfinfo), when it
 * has one. The children inherit this process's limits and seccomp filter, and each gets a
 * wall-clock limit of its own. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clients/extract/extract.h"
#include "text/docformat.h"

/* What a child wrote and how it ended. */
struct Run {
    char *out;
    size_t out_len;
    char errtext[2048];
    int status;      /* waitpid's */
    int timed_out, too_long, not_found;
};

/* Runs argv (found on PATH) with stdout and stderr captured: at most max_out bytes of stdout
 * (more: killed, too_long), for at most timeout_s seconds (timed_out). Returns 0, or -1 when
 * it cannot be started (err set). */
static int run_capture(char *const argv[], size_t max_out, double timeout_s, struct Run *r,
                       char *err, size_t errlen)
{
    int po[2], pe[2], px[2];
    memset(r, 0, sizeof *r);
    if (pipe2(po, O_CLOEXEC))
        goto fail0;
    if (pipe2(pe, O_CLOEXEC))
        goto fail1;
    if (pipe2(px, O_CLOEXEC)) /* carries errno of a failed exec */
        goto fail2;
    pid_t pid = fork();
    if (pid < 0)
        goto fail3;
    if (pid == 0) {
        dup2(po[1], 1);
        dup2(pe[1], 2);
        execvp(argv[0], argv);
        int e = errno;
        ssize_t w = write(px[1], &e, sizeof e);
        (void)w;
        _exit(127);
    }
    close(po[1]);
    close(pe[1]);
    close(px[1]);
    int e = 0;
    if (read(px[0], &e, sizeof e) == (ssize_t)sizeof e)
        r->not_found = e == ENOENT || e == EACCES ? 1 : 2;
    close(px[0]);
    if (r->not_found) {
        close(po[0]);
        close(pe[0]);
    } else {
        struct HelperOutput h;
        docformat_drain(po[0], pe[0], timeout_s * 1e3, max_out, &h);
        r->out = h.out;
        r->out_len = h.out_len;
        memcpy(r->errtext, h.errtext, sizeof r->errtext);
        r->timed_out = h.timed_out;
        r->too_long = h.too_long || h.oom; /* out of memory: treated as a limit */
        if (h.cut_short)
            kill(pid, SIGKILL);
    }
    while (waitpid(pid, &r->status, 0) < 0 && errno == EINTR)
        ;
    return 0;
fail3:
    close(px[0]);
    close(px[1]);
fail2:
    close(pe[0]);
    close(pe[1]);
fail1:
    close(po[0]);
    close(po[1]);
fail0:
    snprintf(err, errlen, "cannot start %s: %s", argv[0], strerror(errno));
    return -1;
}

/* The last non-empty line of s, with its "Syntax Error: " and like prefixes kept (they say
 * what is wrong), at most cap-1 bytes. */
static void last_line(const char *s, char *buf, size_t cap)
{
    const char *best = NULL;
    size_t best_len = 0;
    for (const char *p = s; *p;) {
        size_t l = strcspn(p, "\n");
        size_t t = l;
        while (t && (p[t - 1] == '\r' || p[t - 1] == ' '))
            t--;
        if (t) {
            best = p;
            best_len = t;
        }
        p += l + (p[l] == '\n');
    }
    if (!best) {
        snprintf(buf, cap, "no message");
        return;
    }
    snprintf(buf, cap, "%.*s", (int)best_len, best);
}

/* Why the child failed, into err; the EXTRACT_* status. */
static int child_failed(const char *prog, const struct Run *r, const struct ExtractLimits *lim,
                        char *err, size_t errlen)
{
    char line[512];
    if (r->not_found == 1) {
        snprintf(err, errlen, "%s is not installed (Debian: apt-get install poppler-utils)", prog);
        return EXTRACT_ETOOL;
    }
    if (r->not_found) {
        snprintf(err, errlen, "cannot start %s", prog);
        return EXTRACT_ETOOL;
    }
    if (r->timed_out) {
        snprintf(err, errlen, "%s took too long; stopped", prog);
        return EXTRACT_ELIMIT;
    }
    if (r->too_long) {
        snprintf(err, errlen, "its text is over %.0f MiB, the most it may have",
                 lim->max_output / 1048576.0);
        return EXTRACT_ELIMIT;
    }
    if (WIFSIGNALED(r->status)) {
        int sig = WTERMSIG(r->status);
        if (sig == SIGXCPU || sig == SIGKILL)
            snprintf(err, errlen, "%s ran out of its %u s of processor time; stopped", prog,
                     lim->cpu_seconds);
        else
            snprintf(err, errlen, "%s crashed (%s): a damaged file?", prog, strsignal(sig));
        return sig == SIGXCPU || sig == SIGKILL ? EXTRACT_ELIMIT : EXTRACT_EBAD;
    }
    int code = WIFEXITED(r->status) ? WEXITSTATUS(r->status) : -1;
    if (strstr(r->errtext, "assword")) {
        snprintf(err, errlen, "encrypted: it needs a password; decrypt it first (e.g. "
                 "qpdf --decrypt --password=PASSWORD IN.pdf OUT.pdf)");
        return EXTRACT_EBAD;
    }
    if (code == 3) {
        snprintf(err, errlen, "its permissions forbid copying its text");
        return EXTRACT_EBAD;
    }
    last_line(r->errtext, line, sizeof line);
    snprintf(err, errlen, "damaged (%s exit status %d: %s)", prog, code, line);
    return EXTRACT_EBAD;
}

static int blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n' && s[i] != '\f' &&
            s[i] != '\v')
            return 0;
    return 1;
}

/* An outline entry: its title on one line, its depth (1: top) and the page it points to. */
struct OutlineItem {
    char *title;
    size_t title_len;
    int level;
    long page;
};

struct Outline {
    struct OutlineItem *v;
    size_t n, next;  /* next: the first entry not yet placed or passed over */
};

enum { OUTLINE_MAX_ITEMS = 4096, OUTLINE_MAX_TITLE = 512, OUTLINE_WINDOW = 64 };

static void outline_free(struct Outline *o)
{
    for (size_t i = 0; i < o->n; i++)
        free(o->v[i].title);
    free(o->v);
    memset(o, 0, sizeof *o);
}

/* s[0..n) with XML's five named entities decoded, in place (pdftohtml writes every other
 * character as UTF-8). Returns the new length. */
static size_t xml_unescape(char *s, size_t n)
{
    static const struct { const char *name; char c; } ent[] = {
        {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        size_t k = 0;
        if (s[i] == '&')
            for (; k < sizeof ent / sizeof *ent; k++)
                if (n - i >= strlen(ent[k].name) && !memcmp(s + i, ent[k].name, strlen(ent[k].name)))
                    break;
        if (s[i] == '&' && k < sizeof ent / sizeof *ent) {
            s[w++] = ent[k].c;
            i += strlen(ent[k].name);
        } else {
            s[w++] = s[i++];
        }
    }
    return w;
}

/* The outline entries of pdftohtml -xml's output (its <outline> lists of <item page="N">
 * elements, nested for subsections), in document order; entries without a page are left out,
 * their children kept at their depth. At most OUTLINE_MAX_ITEMS. */
static void outline_parse(const char *s, size_t n, struct Outline *o)
{
    const char *end = s + n, *p = s;
    int depth = 0;
    while (p < end && o->n < OUTLINE_MAX_ITEMS) {
        const char *lt = memchr(p, '<', (size_t)(end - p));
        if (!lt)
            break;
        size_t left = (size_t)(end - lt);
        if (left >= 9 && !memcmp(lt, "<outline>", 9)) {
            depth++;
            p = lt + 9;
            continue;
        }
        if (left >= 10 && !memcmp(lt, "</outline>", 10)) {
            depth -= depth > 0;
            p = lt + 10;
            continue;
        }
        if (left < 6 || memcmp(lt, "<item", 5) || (lt[5] != ' ' && lt[5] != '>')) {
            p = lt + 1;
            continue;
        }
        const char *gt = memchr(lt, '>', left);
        const char *close = gt ? memmem(gt, (size_t)(end - gt), "</item>", 7) : NULL;
        if (!close)
            break;
        const char *pg = memmem(lt, (size_t)(gt - lt), "page=\"", 6);
        long page = pg ? strtol(pg + 6, NULL, 10) : 0;
        size_t tl = (size_t)(close - gt - 1);
        p = close + 7;
        if (page < 1 || tl == 0 || tl > OUTLINE_MAX_TITLE)
            continue;
        char raw[OUTLINE_MAX_TITLE];
        memcpy(raw, gt + 1, tl);
        tl = xml_unescape(raw, tl);
        char *title = md_one_line(raw, tl);
        if (!title)
            return;
        if (!title[0]) {
            free(title);
            continue;
        }
        if (!(o->n & (o->n + 1))) { /* n + 1 a power of two: grow */
            struct OutlineItem *nv = realloc(o->v, (2 * o->n + 1) * sizeof *nv);
            if (!nv) {
                free(title);
                return;
            }
            o->v = nv;
        }
        o->v[o->n++] = (struct OutlineItem){title, strlen(title), depth > 0 ? depth : 1, page};
    }
}

/* 1 when line (collapsed to one line, as md_one_line gives it) is the entry's heading: its title,
 * or its title after a section number the title leaves out ("2.1 ", "A.3. ", "IV ",
 * "Appendix B ", "Chapter 3 "). A running head ("Chapter 3: Title") is not. */
static int outline_line(const char *line, size_t n, const struct OutlineItem *it)
{
    static const char *const words[] = {"Appendix ", "Chapter ", "Part ", "Section "};
    if (n < it->title_len || memcmp(line + n - it->title_len, it->title, it->title_len))
        return 0;
    size_t pre = n - it->title_len, i = 0;
    if (pre == 0)
        return 1;
    if (pre < 2 || pre > 24 || line[pre - 1] != ' ')
        return 0;
    for (size_t w = 0; w < sizeof words / sizeof *words; w++)
        if (!strncmp(line, words[w], strlen(words[w]))) {
            i = strlen(words[w]);
            break;
        }
    if (i == pre)
        return 1; /* "Appendix A Title" for the entry "A Title" */
    for (; i + 1 < pre; i++)
        if (!(line[i] >= '0' && line[i] <= '9') && !(line[i] >= 'A' && line[i] <= 'Z') &&
            line[i] != '.')
            return 0;
    return 1;
}

/* The outline entry whose heading line on page `page` is line (an entry is looked for on its
 * own page and the next, in document order, among the OUTLINE_WINDOW entries not yet placed,
 * which bounds the work of an outline that points everything at one page), or NULL; the
 * entries before it are passed over. */
static const struct OutlineItem *outline_match(struct Outline *o, long page, const char *line,
                                               size_t n)
{
    while (o->next < o->n && o->v[o->next].page < page - 1)
        o->next++;
    char *one = NULL;
    size_t stop = o->n - o->next > OUTLINE_WINDOW ? o->next + OUTLINE_WINDOW : o->n;
    for (size_t j = o->next; j < stop && o->v[j].page <= page; j++) {
        if (!one && !(one = md_one_line(line, n)))
            return NULL;
        if (outline_line(one, strlen(one), &o->v[j])) {
            free(one);
            o->next = j + 1;
            return &o->v[j];
        }
    }
    free(one);
    return NULL;
}

/* The pages of pdftotext's output (each ended by '\f') into out, the outline's entries as
 * headings where their lines are found. Returns the pages with text. */
static size_t pages(const char *s, size_t n, struct Outline *ol, struct Md *out)
{
    size_t page = 0, with_text = 0;
    for (size_t i = 0; i < n;) {
        const char *ff = memchr(s + i, '\f', n - i);
        size_t end = ff ? (size_t)(ff - s) : n;
        page++;
        if (!blank(s + i, end - i)) {
            char mark[48];
            int ml = snprintf(mark, sizeof mark, "<!-- page %zu -->", page);
            md_block(out);
            md_raw(out, mark, (size_t)ml);
            md_block(out);
            int blank_run = 0;
            for (size_t j = i; j < end;) {
                size_t l = strcspn(s + j, "\n\f");
                if (j + l > end)
                    l = end - j;
                const struct OutlineItem *h = NULL;
                if (blank(s + j, l)) {
                    blank_run = 1;
                } else if ((h = outline_match(ol, (long)page, s + j, l))) {
                    md_heading(out, h->level);
                    md_text(out, s + j, l);
                    md_block(out);
                    blank_run = 0;
                } else {
                    if (blank_run)
                        md_block(out);
                    blank_run = 0;
                    md_newline(out);
                    md_text(out, s + j, l); /* collapses runs of spaces, escapes a leading '#' */
                }
                j += l + 1;
            }
            with_text++;
        }
        i = end + 1;
    }
    md_block(out);
    return with_text;
}

/* The Title line of pdfinfo's output, or NULL. */
static char *info_title(const char *s)
{
    for (const char *p = s; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, "Title:", 6)) {
            const char *v = p + 6;
            size_t l = strcspn(v, "\n");
            char *t = md_one_line(v, l);
            if (t && !t[0]) {
                free(t);
                t = NULL;
            }
            return t;
        }
    return NULL;
}

/* 1 when "%%EOF" is in the last 1024 bytes of the file (where readers look for it). */
static int has_eof_marker(int fd)
{
    struct stat sb;
    char tail[1024 + 1];
    if (fstat(fd, &sb))
        return 0;
    off_t from = sb.st_size > 1024 ? sb.st_size - 1024 : 0;
    ssize_t n = pread(fd, tail, sizeof tail - 1, from);
    if (n <= 0)
        return 0;
    tail[n] = 0;
    return memmem(tail, (size_t)n, "%%EOF", 5) != NULL;
}

int extract_pdf(int fd, const struct ExtractLimits *lim, struct Md *out, char **title,
                char *err, size_t errlen)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    if (!has_eof_marker(fd)) {
        snprintf(err, errlen, "truncated: no %%%%EOF at its end (an incomplete copy or "
                 "download?)");
        return EXTRACT_EBAD;
    }
    double timeout = lim->cpu_seconds * 2.0 + 5;
    char *argv[] = { "pdftotext", "-enc", "UTF-8", "-eol", "unix", "-q", path, "-", NULL };
    struct Run r;
    if (run_capture(argv, lim->max_output, timeout, &r, err, errlen))
        return EXTRACT_ETOOL;
    /* -q hides the messages of a file that opens: run again without it for why it failed */
    if (!r.not_found && !r.timed_out && !r.too_long && !(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0)) {
        struct Run again;
        char *argv2[] = { "pdftotext", "-enc", "UTF-8", path, "-", NULL };
        if (!run_capture(argv2, lim->max_output, timeout, &again, err, errlen)) {
            memcpy(r.errtext, again.errtext, sizeof r.errtext);
            free(again.out);
        }
    }
    int rc = WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0 && !r.not_found && !r.timed_out &&
             !r.too_long ? EXTRACT_OK : child_failed("pdftotext", &r, lim, err, errlen);
    /* The outline: pdftohtml lists it whole with the first page's text; a document without
     * one, or a pdftohtml that fails, leaves the text without headings. */
    struct Outline ol = {0};
    if (!rc) {
        char *argv4[] = { "pdftohtml", "-xml", "-i", "-q", "-stdout", "-f", "1", "-l", "1",
                          path, NULL };
        struct Run x;
        char ignored[256];
        if (!run_capture(argv4, lim->max_output, timeout, &x, ignored, sizeof ignored)) {
            if (WIFEXITED(x.status) && WEXITSTATUS(x.status) == 0 && x.out && !x.too_long)
                outline_parse(x.out, x.out_len, &ol);
            free(x.out);
        }
    }
    if (!rc && pages(r.out ? r.out : "", r.out_len, &ol, out) == 0) {
        snprintf(err, errlen, "no text layer: a scanned PDF? OCR it first (e.g. ocrmypdf IN.pdf "
                 "OUT.pdf)");
        rc = EXTRACT_EBAD;
    }
    free(r.out);
    outline_free(&ol);
    if (!rc && out->oom) {
        snprintf(err, errlen, "out of memory");
        rc = EXTRACT_ENOMEM;
    }
    if (rc)
        return rc;
    char *argv3[] = { "pdfinfo", "-enc", "UTF-8", path, NULL };
    char ignored[256];
    if (!run_capture(argv3, 1 << 20, timeout, &r, ignored, sizeof ignored)) {
        if (WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0 && r.out)
            *title = info_title(r.out);
        free(r.out);
    }
    return EXTRACT_OK;
}
