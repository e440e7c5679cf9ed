/* Escaping for a terminal: one scan over UTF-8 text that writes C0/C1 controls, DEL and
 * ill-formed bytes as visible escapes, so that printed ids, titles and texts cannot send the
 * terminal a control sequence. */
#include "text/termsafe.h"

#include <stdint.h>

#include "text/utf8.h"

/* The escape for the n bytes at s[i] (one sequence of s[0..len): code point cp, or
 * UTF8_INVALID when ill-formed), written into out: its length (0: the bytes pass as they are). */
static size_t term_escape_one(const unsigned char *s, size_t i, size_t len, size_t n, uint32_t cp,
                              unsigned flags, char out[16])
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    if (cp == UTF8_INVALID) {
        for (size_t k = 0; k < n; k++) {
            out[o++] = '\\';
            out[o++] = 'x';
            out[o++] = hex[s[i + k] >> 4];
            out[o++] = hex[s[i + k] & 15];
        }
        return o;
    }
    if (cp < 0x20 || cp == 0x7F) {
        if ((flags & TERM_KEEP_LAYOUT) &&
            (cp == '\t' || cp == '\n' || (cp == '\r' && i + 1 < len && s[i + 1] == '\n')))
            return 0;
        out[0] = '\\';
        out[1] = 'x';
        out[2] = hex[cp >> 4];
        out[3] = hex[cp & 15];
        return 4;
    }
    if (cp >= 0x80 && cp <= 0x9F) {
        out[0] = '\\';
        out[1] = 'u';
        out[2] = '0';
        out[3] = '0';
        out[4] = hex[cp >> 4];
        out[5] = hex[cp & 15];
        return 6;
    }
    return 0;
}

size_t term_write_escaped(FILE *f, const char *s, size_t len, unsigned flags)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t total = 0, run = 0, i = 0; /* s[run..i) is waiting to be written as it is */
    char esc[16];
    if (len == 0)
        return 0;
    while (i < len) {
        uint32_t cp = u[i];
        size_t n = u[i] < 0x80 ? 1 : utf8_decode(u + i, len - i, &cp);
        size_t e = term_escape_one(u, i, len, n, cp, flags, esc);
        if (e) {
            fwrite(s + run, 1, i - run, f);
            fwrite(esc, 1, e, f);
            total += (i - run) + e;
            run = i + n;
        }
        i += n;
    }
    fwrite(s + run, 1, len - run, f);
    return total + (len - run);
}
