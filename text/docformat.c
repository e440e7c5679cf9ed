/* Format detection by content (docformat.h): magic bytes for PDF and zip, the opening tag for
 * HTML; and the extensions a folder walk takes for those formats. */
#include "text/docformat.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static int starts_ci(const unsigned char *p, size_t n, const char *lit)
{
    size_t l = strlen(lit);
    return n >= l && strncasecmp((const char *)p, lit, l) == 0;
}

/* 1 when a tag name of `lit` ends at p[l] (white space, '>' or '/'), or the buffer ends. */
static int tag_at(const unsigned char *p, size_t n, const char *lit)
{
    size_t l = strlen(lit);
    if (!starts_ci(p, n, lit))
        return 0;
    if (n == l)
        return 1;
    unsigned char c = p[l];
    return c == '>' || c == '/' || c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f';
}

static size_t skip_space(const unsigned char *p, size_t i, size_t n)
{
    while (i < n && (p[i] == ' ' || p[i] == '\t' || p[i] == '\r' || p[i] == '\n' || p[i] == '\f'))
        i++;
    return i;
}

/* Past "<?...?>" or "<!--...-->" at p[i], or i when neither starts there (or it does not end). */
static size_t skip_decl(const unsigned char *p, size_t i, size_t n)
{
    const char *end = NULL;
    size_t from = i;
    if (starts_ci(p + i, n - i, "<?")) {
        end = "?>";
        from = i + 2;
    } else if (starts_ci(p + i, n - i, "<!--")) {
        end = "-->";
        from = i + 4;
    } else {
        return i;
    }
    size_t el = strlen(end);
    for (size_t j = from; j + el <= n; j++)
        if (memcmp(p + j, end, el) == 0)
            return j + el;
    return i;
}

enum DocFormat docformat_sniff(const unsigned char *p, size_t n)
{
    if (n > DOCFORMAT_SNIFF_BYTES)
        n = DOCFORMAT_SNIFF_BYTES;
    if (n >= 4 && memcmp(p, "PK\3\4", 4) == 0)
        return DOCFMT_ZIP;
    for (size_t i = 0; i + 5 <= n; i++)
        if (memcmp(p + i, "%PDF-", 5) == 0)
            return DOCFMT_PDF;
    size_t i = n >= 3 && memcmp(p, "\xEF\xBB\xBF", 3) == 0 ? 3 : 0;
    for (;;) {
        i = skip_space(p, i, n);
        size_t j = skip_decl(p, i, n);
        if (j == i)
            break;
        i = j;
    }
    if (tag_at(p + i, n - i, "<!doctype") && starts_ci(p + skip_space(p, i + 9, n),
                                                       n - skip_space(p, i + 9, n), "html"))
        return DOCFMT_HTML;
    if (tag_at(p + i, n - i, "<html") || tag_at(p + i, n - i, "<head") ||
        tag_at(p + i, n - i, "<body"))
        return DOCFMT_HTML;
    return DOCFMT_TEXT;
}

enum DocFormat docformat_of_name(const char *name)
{
    const char *dot = strrchr(name, '.');
    if (!dot || strchr(dot, '/'))
        return DOCFMT_TEXT;
    if (!strcasecmp(dot, ".pdf"))
        return DOCFMT_PDF;
    if (!strcasecmp(dot, ".docx"))
        return DOCFMT_ZIP;
    if (!strcasecmp(dot, ".html") || !strcasecmp(dot, ".htm") || !strcasecmp(dot, ".xhtml"))
        return DOCFMT_HTML;
    return DOCFMT_TEXT;
}

const char *docformat_name(enum DocFormat f)
{
    return f == DOCFMT_PDF ? "PDF" : f == DOCFMT_ZIP ? "DOCX" : f == DOCFMT_HTML ? "HTML" : "text";
}

void docformat_helper_path(const char *configured, char *out, size_t cap)
{
    if (configured && configured[0]) {
        snprintf(out, cap, "%s", configured);
        return;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            if ((size_t)snprintf(out, cap, "%s/" DOCFORMAT_HELPER, exe) < cap &&
                access(out, X_OK) == 0)
                return;
        }
    }
    snprintf(out, cap, DOCFORMAT_HELPER);
}

void docformat_helper_reason(const char *errtext, char *err, size_t errlen)
{
    const char *line = errtext, *p = errtext;
    while (*p) {
        const char *nl = strchr(p, '\n');
        if (p[0] && p[0] != '\n')
            line = p;
        if (!nl)
            break;
        p = nl + 1;
    }
    size_t l = strcspn(line, "\n");
    static const char prefix[] = DOCFORMAT_HELPER ": -: ";
    if (l >= sizeof prefix - 1 && !strncmp(line, prefix, sizeof prefix - 1)) {
        line += sizeof prefix - 1;
        l -= sizeof prefix - 1;
    }
    snprintf(err, errlen, "%.*s", (int)l, l ? line : "no reason given");
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Appends buf[0..n) to r->out; sets too_long past max_out, oom when it cannot grow. */
static void drain_append(struct HelperOutput *r, size_t *cap, const char *buf, size_t n,
                         size_t max_out)
{
    if (r->out_len + n > max_out) {
        r->too_long = 1;
        return;
    }
    if (r->out_len + n + 1 > *cap) {
        size_t nc = *cap ? *cap : 65536;
        while (nc < r->out_len + n + 1)
            nc *= 2;
        char *p = realloc(r->out, nc);
        if (!p) {
            r->oom = 1;
            return;
        }
        r->out = p;
        *cap = nc;
    }
    memcpy(r->out + r->out_len, buf, n);
    r->out_len += n;
    r->out[r->out_len] = 0;
}

void docformat_drain(int out_fd, int err_fd, double timeout_ms, size_t max_out,
                     struct HelperOutput *r)
{
    memset(r, 0, sizeof *r);
    size_t cap = 0, elen = 0;
    struct pollfd fds[2] = { { out_fd, POLLIN, 0 }, { err_fd, POLLIN, 0 } };
    int open_fds = 2;
    double deadline = now_ms() + timeout_ms;
    while (open_fds && !r->too_long && !r->oom) {
        double left = deadline - now_ms();
        if (left <= 0) {
            r->timed_out = 1;
            break;
        }
        int k = poll(fds, 2, (int)left + 1);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            break;
        for (int i = 0; i < 2 && !r->too_long && !r->oom; i++) {
            if (fds[i].fd < 0 || !fds[i].revents)
                continue;
            char buf[65536];
            ssize_t n = read(fds[i].fd, buf, sizeof buf);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0) {
                close(fds[i].fd);
                fds[i].fd = -1;
                open_fds--;
            } else if (i == 1) {
                size_t room = sizeof r->errtext - 1 - elen;
                size_t take = (size_t)n < room ? (size_t)n : room;
                memcpy(r->errtext + elen, buf, take);
                elen += take;
            } else {
                drain_append(r, &cap, buf, (size_t)n, max_out);
            }
        }
    }
    r->errtext[elen] = 0;
    r->cut_short = open_fds > 0;
    for (int i = 0; i < 2; i++)
        if (fds[i].fd >= 0)
            close(fds[i].fd);
}
