/* Format detection by content (docformat.h): magic bytes for PDF and zip, the opening tag for
 * HTML; and the extensions a folder walk takes for those formats. */
#include "text/docformat.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
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
