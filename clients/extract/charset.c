/* The encoding of an HTML page, as a browser settles it, and its conversion to UTF-8 (gumbo
 * reads UTF-8 only and would turn every byte of another encoding past ASCII into U+FFFD). */
#include <ctype.h>
#include <errno.h>
#include <iconv.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "clients/extract/extract.h"

/* Bytes a <meta> declaring the encoding must lie within (the HTML standard's prescan). */
#define PRESCAN_BYTES 1024

static int valid_utf8(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2
                 : (c & 0xF8) == 0xF0 ? 3 : 9;
        if (k == 9 || (k == 1 && c < 0xC2) || i + k >= n)
            return 0; /* not a lead byte, an overlong pair, or cut at the end */
        for (size_t j = 1; j <= k; j++)
            if ((s[i + j] & 0xC0) != 0x80)
                return 0;
        i += k + 1;
    }
    return 1;
}

/* The value after `key` (charset=) at p, quoted or not, into label. */
static int take_label(const char *p, const char *end, char *label, size_t cap)
{
    while (p < end && (*p == ' ' || *p == '=' || *p == '"' || *p == '\''))
        p++;
    size_t n = 0;
    while (p < end && n + 1 < cap && (isalnum((unsigned char)*p) || strchr("-_.:", *p)))
        label[n++] = *p++;
    label[n] = 0;
    return n > 0;
}

/* A charset declared by a <meta> in the first bytes: <meta charset=X> or the charset= of an
 * http-equiv Content-Type's content. */
static int meta_charset(const char *buf, size_t len, char *label, size_t cap)
{
    const char *end = buf + (len < PRESCAN_BYTES ? len : PRESCAN_BYTES);
    for (const char *p = buf; p + 5 < end; p++) {
        if (*p != '<' || strncasecmp(p + 1, "meta", 4) != 0)
            continue;
        const char *close = memchr(p, '>', (size_t)(end - p));
        const char *tag_end = close ? close : end;
        for (const char *q = p + 5; q + 7 < tag_end; q++)
            if (strncasecmp(q, "charset", 7) == 0 && take_label(q + 7, tag_end, label, cap))
                return 1;
    }
    return 0;
}

/* The iconv name of a label, or NULL for UTF-8 (nothing to convert). Labels for Latin-1 and
 * ASCII mean windows-1252, as they do to browsers: pages so labelled use its 0x80-0x9F. */
static const char *encoding_of(const char *label)
{
    static const char *const utf8[] = { "utf-8", "utf8", "unicode-1-1-utf-8", NULL };
    static const char *const cp1252[] = { "iso-8859-1", "iso8859-1", "latin1", "l1", "ascii",
                                          "us-ascii", "windows-1252", "cp1252", "x-cp1252",
                                          "iso_8859-1", "cp819", "ibm819", NULL };
    for (int i = 0; utf8[i]; i++)
        if (!strcasecmp(label, utf8[i]))
            return NULL;
    /* a <meta> read as ASCII cannot be in UTF-16 or UTF-32: browsers take UTF-8 then */
    if (!strncasecmp(label, "utf-16", 6) || !strncasecmp(label, "utf-32", 6) ||
        !strncasecmp(label, "ucs-", 4))
        return NULL;
    for (int i = 0; cp1252[i]; i++)
        if (!strcasecmp(label, cp1252[i]))
            return "WINDOWS-1252";
    return label;
}

/* buf[0..len) from `from` to UTF-8 (malloc'd); a byte that is not of the encoding becomes
 * U+FFFD. 0 on success, -1 when iconv does not know the encoding, else EXTRACT_ENOMEM. */
static int convert(const char *from, const char *buf, size_t len, char **out, size_t *out_len)
{
    iconv_t cd = iconv_open("UTF-8", from);
    if (cd == (iconv_t)-1)
        return -1;
    size_t cap = len * 2 + 16, n = 0;
    char *o = malloc(cap);
    char *in = (char *)buf;
    size_t left = len;
    while (o) {
        char *op = o + n;
        size_t room = cap - n;
        size_t rc = iconv(cd, left ? &in : NULL, left ? &left : NULL, &op, &room);
        n = (size_t)(op - o);
        if (rc != (size_t)-1 && !left)
            break;
        int e = rc == (size_t)-1 ? errno : 0;
        if (e == E2BIG || cap - n < 3) { /* no room: for the output, or for a U+FFFD */
            char *g = realloc(o, cap * 2);
            if (!g)
                free(o);
            o = g;
            cap *= 2;
        } else if (e) { /* EILSEQ or EINVAL: one byte that does not decode */
            memcpy(o + n, "\xEF\xBF\xBD", 3);
            n += 3;
            in++;
            left--;
        }
    }
    iconv_close(cd);
    if (!o)
        return EXTRACT_ENOMEM;
    *out = o;
    *out_len = n;
    return 0;
}

int html_to_utf8(const char *buf, size_t len, char **out, size_t *out_len, char *label,
                 size_t label_cap)
{
    *out = NULL;
    *out_len = 0;
    label[0] = 0;
    if (len >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3))
        return 0;
    const char *enc = NULL;
    if (meta_charset(buf, len, label, label_cap))
        enc = encoding_of(label);
    if (!enc && !valid_utf8((const unsigned char *)buf, len)) {
        /* declared UTF-8 or undeclared, and not UTF-8: the web's legacy default */
        snprintf(label, label_cap, "windows-1252");
        enc = "WINDOWS-1252";
    }
    if (!enc)
        return 0;
    int rc = convert(enc, buf, len, out, out_len);
    if (rc != -1)
        return rc;
    /* a label iconv does not know is no label */
    if (valid_utf8((const unsigned char *)buf, len)) {
        label[0] = 0;
        return 0;
    }
    snprintf(label, label_cap, "windows-1252");
    return convert("WINDOWS-1252", buf, len, out, out_len) ? EXTRACT_ENOMEM : 0;
}
