/* diffrag-extract FILE: a PDF, DOCX or HTML document as Markdown on stdout, its first line
 * "title: TITLE" (docs/cli.md). The format is found by content; the process limits itself and
 * installs its seccomp filter (sandbox.c) before any parser sees the file. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clients/extract/extract.h"
#include "text/docformat.h"

#define PROG "diffrag-extract"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: " PROG " [options] FILE\n"
        "Writes a PDF, DOCX or HTML document (found by its content) as Markdown on stdout: the\n"
        "first line is \"title: TITLE\", the rest the text; a PDF's pages start with\n"
        "\"<!-- page N -->\" lines. FILE - reads stdin.\n"
        "  --name NAME        the file name the title falls back to (default: FILE's)\n"
        "  --max-output N     bytes of text at most (default 64 MiB)\n"
        "  --cpu S            processor seconds, pdftotext's included (default 30)\n"
        "  --memory MIB       address space of this process and of pdftotext (default 4096)\n"
        "exit status: 0 ok, 1 the file cannot be read as its format (its reason on stderr),\n"
        "2 usage, 3 a program it needs is missing (pdftotext), 4 a limit, 5 out of memory.\n");
}

static int fail(int code, const char *what, const char *why)
{
    fprintf(stderr, PROG ": %s: %s\n", what, why);
    return code;
}

static int write_all(const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(1, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The whole input (at most max bytes), from offset 0 for a file. */
static int read_input(int fd, size_t max, char **out, size_t *len, char *err, size_t errlen)
{
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) {
        snprintf(err, errlen, "out of memory");
        return EXTRACT_ENOMEM;
    }
    for (;;) {
        if (n == cap) {
            if (cap > max) {
                free(buf);
                snprintf(err, errlen, "over the %.0f MiB an HTML file may have", max / 1048576.0);
                return EXTRACT_ELIMIT;
            }
            char *p = realloc(buf, 2 * cap + 1);
            if (!p) {
                free(buf);
                snprintf(err, errlen, "out of memory");
                return EXTRACT_ENOMEM;
            }
            buf = p;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            snprintf(err, errlen, "%s", strerror(errno));
            free(buf);
            return EXTRACT_EBAD;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    if (n > max) {
        free(buf);
        snprintf(err, errlen, "over the %.0f MiB an HTML file may have", max / 1048576.0);
        return EXTRACT_ELIMIT;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return EXTRACT_OK;
}

/* The file's name without its folder and extension. */
static char *name_title(const char *name)
{
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    const char *dot = strrchr(base, '.');
    return md_one_line(base, dot && dot != base ? (size_t)(dot - base) : strlen(base));
}

static int parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || v == 0 || s[0] == '-')
        return -1;
    *out = (size_t)v;
    return 0;
}

int main(int argc, char **argv)
{
    struct ExtractLimits lim = { .max_output = 64u << 20, .max_input = 128u << 20,
                                 .max_entry = 64u << 20, .max_ratio = 200, .cpu_seconds = 30,
                                 .max_memory = (size_t)4 << 30 };
    const char *name = NULL;
    static const struct option longs[] = {
        { "name", required_argument, NULL, 'n' }, { "max-output", required_argument, NULL, 'o' },
        { "cpu", required_argument, NULL, 'c' }, { "memory", required_argument, NULL, 'm' },
        { "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 } };
    int c;
    size_t v;
    while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            return 0;
        }
        if (c == 'n') {
            name = optarg;
            continue;
        }
        if (c == '?' || parse_size(optarg, &v) ||
            (c == 'c' && v > 86400) || (c == 'm' && v > ((size_t)1 << 24))) {
            if (c != '?')
                fprintf(stderr, PROG ": --%s %s: not a number in range\n",
                        c == 'o' ? "max-output" : c == 'c' ? "cpu" : "memory", optarg);
            usage(stderr);
            return EXTRACT_EUSAGE;
        }
        if (c == 'o')
            lim.max_output = v;
        else if (c == 'c')
            lim.cpu_seconds = (unsigned)v;
        else
            lim.max_memory = v << 20;
    }
    if (optind != argc - 1) {
        fprintf(stderr, PROG ": expected one FILE\n");
        usage(stderr);
        return EXTRACT_EUSAGE;
    }
    const char *path = argv[optind];
    if (!name)
        name = strcmp(path, "-") ? path : "stdin";
    signal(SIGPIPE, SIG_IGN);
    char err[1024];
    if (sandbox_limits(&lim, err, sizeof err))
        return fail(EXTRACT_ETOOL, "sandbox", err);
    /* not close-on-exec: pdftotext reads it as /proc/self/fd/N */
    int fd = strcmp(path, "-") ? open(path, O_RDONLY | O_NOCTTY | O_NONBLOCK) : 0;
    struct stat sb;
    if (fd < 0)
        return fail(EXTRACT_EBAD, path, strerror(errno));
    if (fstat(fd, &sb))
        return fail(EXTRACT_EBAD, path, strerror(errno));
    if (S_ISDIR(sb.st_mode))
        return fail(EXTRACT_EBAD, path, "a folder");
    if (S_ISREG(sb.st_mode))
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    unsigned char head[DOCFORMAT_SNIFF_BYTES];
    ssize_t hn = S_ISREG(sb.st_mode) ? pread(fd, head, sizeof head, 0) : 0;
    char *buf = NULL;
    size_t len = 0;
    int rc = EXTRACT_OK;
    if (!S_ISREG(sb.st_mode)) { /* a pipe: read it all now, sniff what came */
        if ((rc = read_input(fd, lim.max_input, &buf, &len, err, sizeof err)))
            return fail(rc, path, err);
        hn = (ssize_t)(len < sizeof head ? len : sizeof head);
        memcpy(head, buf, (size_t)hn);
    }
    if (hn < 0)
        return fail(EXTRACT_EBAD, path, strerror(errno));
    enum DocFormat fmt = docformat_sniff(head, (size_t)hn);
    enum DocFormat by_name = docformat_of_name(name);
    if (fmt == DOCFMT_TEXT && by_name == DOCFMT_HTML)
        fmt = DOCFMT_HTML; /* an HTML fragment, named as HTML */
    if (fmt == DOCFMT_TEXT) {
        free(buf);
        if (by_name == DOCFMT_PDF)
            return fail(EXTRACT_EBAD, path, "named .pdf, but it does not start with %PDF-: not a PDF");
        if (by_name == DOCFMT_ZIP)
            return fail(EXTRACT_EBAD, path, "named .docx, but it is not a zip archive: not a DOCX document");
        return fail(EXTRACT_EBAD, path, "not a PDF, DOCX or HTML document (by its content): "
                    "unsupported format");
    }
    if ((fmt == DOCFMT_PDF || fmt == DOCFMT_ZIP) && !S_ISREG(sb.st_mode)) {
        free(buf);
        return fail(EXTRACT_EBAD, path, "a PDF or DOCX document is read from a file, not a pipe");
    }
    if (sandbox_filter(fmt == DOCFMT_PDF, err, sizeof err)) {
        free(buf);
        return fail(EXTRACT_ETOOL, "sandbox", err);
    }
    struct Md md;
    char *title = NULL;
    md_init(&md, lim.max_output);
    if (fmt == DOCFMT_PDF) {
        rc = extract_pdf(fd, &lim, &md, &title, err, sizeof err);
    } else if (fmt == DOCFMT_ZIP) {
        rc = extract_docx(fd, &lim, &md, &title, err, sizeof err);
    } else {
        if (!buf)
            rc = read_input(fd, lim.max_input, &buf, &len, err, sizeof err);
        if (!rc)
            rc = extract_html(buf, len, &md, &title, err, sizeof err);
    }
    free(buf);
    if (!rc && md.over) {
        snprintf(err, sizeof err, "its text is over %.0f MiB, the most it may have",
                 lim.max_output / 1048576.0);
        rc = EXTRACT_ELIMIT;
    }
    if (!rc && md.n == 0) {
        snprintf(err, sizeof err, "a %s document without text", docformat_name(fmt));
        rc = EXTRACT_EBAD;
    }
    if (!rc && !title && !(title = name_title(name))) {
        snprintf(err, sizeof err, "out of memory");
        rc = EXTRACT_ENOMEM;
    }
    if (rc) {
        free(title);
        md_free(&md);
        return fail(rc, path, err);
    }
    /* the body without the blank lines md_block leaves at its end */
    while (md.n && md.p[md.n - 1] == '\n')
        md.n--;
    int w = write_all("title: ", 7) || write_all(title, strlen(title)) || write_all("\n", 1) ||
            write_all(md.p, md.n) || write_all("\n", 1);
    free(title);
    md_free(&md);
    if (w)
        return fail(EXTRACT_ETOOL, "stdout", strerror(errno));
    return EXTRACT_OK;
}
