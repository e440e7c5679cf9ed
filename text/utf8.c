/* UTF-8 decoding, validation, encoding and cutting: one strict decoder (Unicode Table 3-7,
 * second-byte ranges by lead byte) that every check and every caller goes through. */
#include "text/utf8.h"

/* Valid range of the second byte given the lead byte (Unicode Table 3-7); later continuation
 * bytes are always 0x80..0xBF. 0 when b is not a lead byte. */
static int utf8_lead(unsigned char b, size_t *need, unsigned char *lo, unsigned char *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) { *need = 2; return 1; }
    if (b >= 0xE0 && b <= 0xEF) {
        *need = 3;
        if (b == 0xE0) *lo = 0xA0;  /* no overlong forms */
        if (b == 0xED) *hi = 0x9F;  /* excludes the surrogates */
        return 1;
    }
    if (b >= 0xF0 && b <= 0xF4) {
        *need = 4;
        if (b == 0xF0) *lo = 0x90;  /* no overlong forms */
        if (b == 0xF4) *hi = 0x8F;  /* nothing past U+10FFFF */
        return 1;
    }
    return 0;
}

/* Number of leading bytes of s[0..len) that form a valid prefix of one sequence, and the
 * sequence length the lead byte asks for (0 when the lead byte is not a lead byte). */
static size_t utf8_prefix(const unsigned char *s, size_t len, size_t *need)
{
    unsigned char lo, hi;
    if (!utf8_lead(s[0], need, &lo, &hi)) { *need = 0; return 0; }
    size_t k = 1;
    while (k < *need && k < len) {
        unsigned char b = s[k];
        if (b < lo || b > hi) break;
        lo = 0x80;
        hi = 0xBF;
        k++;
    }
    return k;
}

size_t utf8_decode(const unsigned char *s, size_t len, uint32_t *cp)
{
    if (s[0] < 0x80) { *cp = s[0]; return 1; }
    size_t need;
    size_t k = utf8_prefix(s, len, &need);
    if (need == 0) { *cp = UTF8_INVALID; return 1; }
    if (k < need) { *cp = UTF8_INVALID; return k; }
    uint32_t v = s[0] & (need == 2 ? 0x1F : need == 3 ? 0x0F : 0x07);
    for (size_t i = 1; i < need; i++) v = (v << 6) | (s[i] & 0x3F);
    *cp = v;
    return need;
}

int utf8_is_incomplete(const unsigned char *s, size_t len)
{
    if (len == 0) return 0;
    size_t need;
    size_t k = utf8_prefix(s, len, &need);
    return need > 0 && k == len && len < need;
}

int utf8_valid(const char *s, size_t len, size_t *bad_off)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        if (u[i] < 0x80) { i++; continue; }
        uint32_t cp;
        size_t k = utf8_decode(u + i, len - i, &cp);
        if (cp == UTF8_INVALID) {
            if (bad_off) *bad_off = i;
            return 0;
        }
        i += k;
    }
    return 1;
}

size_t utf8_encode(uint32_t cp, char out[4])
{
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    if (cp <= 0x10FFFF) {
        out[0] = (char)(0xF0 | (cp >> 18));
        out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[3] = (char)(0x80 | (cp & 0x3F));
        return 4;
    }
    return 0;
}

size_t utf8_cut(const char *s, size_t len, size_t max)
{
    if (len <= max) return len;
    size_t n = max;
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80) n--;
    return n;
}
