/* Strict request framing for diffragd's HTTP listeners (http.h): what RFC 9112 asks of a server
 * and libmicrohttpd 0.9.75 lets through. Two Content-Lengths (the first used, the rest of the
 * body read as a second request), Content-Length with chunked, a transfer coding it cannot
 * decode (whose body it then reads until the connection ends), HTTP/1.1 without Host, and a NUL
 * in a header (the value cut there) are each a request that a proxy in front could frame or
 * read otherwise: request smuggling. Each is refused, and the connection closed. */
#include "daemon/http.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

/* What the header fields of one request hold, gathered by scan_field. */
struct FieldScan {
    int hosts, lengths, codings;
    const char *coding;          /* the (last) Transfer-Encoding value */
    const char *line_end;        /* where the previous field line's value ended; NULL: none */
    int layout;                  /* check where each field line lies (see layout_known) */
    int broken;                  /* a field line is not where a clean CRLF-ended one would be */
};

/* libmicrohttpd up to 0.9.75 parses the request in its read buffer, in place: each line's CR LF
 * become two NULs and each field's name and value are pointers into that line (the value runs
 * to the line's end). So in a request of CRLF-ended lines with no NUL in them, every field line
 * begins exactly two bytes after the previous line's value ends, both bytes NUL, and the last
 * value is followed by four NULs (its CR LF and the blank line's). A NUL inside a value ends the
 * value early and leaves its remainder before the next line; a bare LF leaves one NUL, not two;
 * a folded (obs-fold) value is copied elsewhere. Any of these breaks the pattern, which is how
 * they are found: the library hands out no raw bytes. Later versions parse differently (and
 * refuse NULs themselves), so the check runs only where this layout is known. */
static int layout_known(void)
{
    unsigned major = 0, minor = 0, patch = 0;
    const char *v = MHD_get_version();
    return v && sscanf(v, "%u.%u.%u", &major, &minor, &patch) == 3 && major == 0 && minor == 9 &&
           patch <= 75;
}

static int clean_break(const char *end, const char *next)
{
    return next == end + 2 && !end[0] && !end[1];
}

static enum MHD_Result scan_field(void *cls, enum MHD_ValueKind kind, const char *key,
                                  size_t key_size, const char *value, size_t value_size)
{
    (void)kind;
    struct FieldScan *s = cls;
    if (s->layout && s->line_end && !clean_break(s->line_end, key))
        s->broken = 1;
    s->line_end = value ? value + value_size : NULL;
    if (!value)
        s->broken = 1;
    if (key_size == 4 && !strcasecmp(key, "Host"))
        s->hosts++;
    else if (key_size == 14 && !strcasecmp(key, "Content-Length"))
        s->lengths++;
    else if (key_size == 17 && !strcasecmp(key, "Transfer-Encoding")) {
        s->codings++;
        s->coding = value;
    }
    return MHD_YES;
}

unsigned http_framing_check(struct MHD_Connection *c, const char *method, const char *version,
                            char *msg, size_t cap)
{
    (void)method;
    struct FieldScan s;
    memset(&s, 0, sizeof s);
    s.layout = layout_known();
    /* the request line ends like a field line: its version runs to the line's end */
    if (s.layout && version && version[0])
        s.line_end = version + strlen(version);
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, scan_field, &s);
    /* after the last field (or the request line): its CR LF, then the blank line's */
    if (s.layout && s.line_end &&
        (s.line_end[0] || s.line_end[1] || s.line_end[2] || s.line_end[3]))
        s.broken = 1;
    int http11 = version && !strcmp(version, "HTTP/1.1");
    if (s.broken) {
        snprintf(msg, cap, "malformed request: a NUL byte in the request line or a header, a "
                 "line not ended by CRLF, or a folded header");
        return 400;
    }
    if (http11 && s.hosts == 0) {
        snprintf(msg, cap, "an HTTP/1.1 request needs a Host header");
        return 400;
    }
    if (s.hosts > 1) {
        snprintf(msg, cap, "more than one Host header");
        return 400;
    }
    if (s.lengths > 1) {
        snprintf(msg, cap, "more than one Content-Length header");
        return 400;
    }
    if (s.codings && s.lengths) {
        snprintf(msg, cap, "Content-Length and Transfer-Encoding together: send one");
        return 400;
    }
    if (s.codings && !http11) {
        snprintf(msg, cap, "Transfer-Encoding in a request that is not HTTP/1.1");
        return 400;
    }
    if (s.codings > 1 || (s.codings && strcasecmp(s.coding, "chunked"))) {
        snprintf(msg, cap, "the transfer coding \"%.60s\" is not supported: send the body with a "
                 "Content-Length, or chunked", s.codings > 1 ? "(several)" : s.coding);
        return 501;
    }
    return 0;
}
