/* UTF-8 decoding/encoding and code-point classes for the pre-tokenizer: a strict decoder that
 * reports ill-formed input instead of guessing, and binary search over the generated range
 * tables with a fast path for ASCII. */
#include "model/unicode.h"

#include "model/unicode_tables.h"

#define N_RANGES(a) (sizeof(a) / sizeof((a)[0]))

/* Valid range of the second byte given the lead byte (Unicode Table 3-7); later continuation
 * bytes are always 0x80..0xBF. */
static int utf8_lead(unsigned char b, size_t *need, unsigned char *lo, unsigned char *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) { *need = 2; return 1; }
    if (b >= 0xE0 && b <= 0xEF) {
        *need = 3;
        if (b == 0xE0) *lo = 0xA0;
        if (b == 0xED) *hi = 0x9F;  /* excludes the surrogates */
        return 1;
    }
    if (b >= 0xF0 && b <= 0xF4) {
        *need = 4;
        if (b == 0xF0) *lo = 0x90;
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

size_t unicode_decode_utf8(const unsigned char *s, size_t len, uint32_t *cp)
{
    if (s[0] < 0x80) { *cp = s[0]; return 1; }
    size_t need;
    size_t k = utf8_prefix(s, len, &need);
    if (need == 0) { *cp = UNICODE_INVALID; return 1; }
    if (k < need) { *cp = UNICODE_INVALID; return k; }
    uint32_t v = s[0] & (need == 2 ? 0x1F : need == 3 ? 0x0F : 0x07);
    for (size_t i = 1; i < need; i++) v = (v << 6) | (s[i] & 0x3F);
    *cp = v;
    return need;
}

int unicode_is_incomplete_utf8(const unsigned char *s, size_t len)
{
    if (len == 0) return 0;
    size_t need;
    size_t k = utf8_prefix(s, len, &need);
    return need > 0 && k == len && len < need;
}

size_t unicode_encode_utf8(uint32_t cp, char out[4])
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

static int in_ranges(const struct UnicodeRange *r, size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (cp > r[mid].hi) lo = mid + 1;
        else if (cp < r[mid].lo) hi = mid;
        else return 1;
    }
    return 0;
}

int unicode_is_letter(uint32_t cp)
{
    return in_ranges(unicode_letter_ranges, N_RANGES(unicode_letter_ranges), cp);
}

int unicode_is_number(uint32_t cp)
{
    return in_ranges(unicode_number_ranges, N_RANGES(unicode_number_ranges), cp);
}

int unicode_is_space(uint32_t cp)
{
    return in_ranges(unicode_space_ranges, N_RANGES(unicode_space_ranges), cp);
}

enum UnicodeClass unicode_class(uint32_t cp)
{
    if (cp < 0x80) {
        if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return UNICODE_LETTER;
        if (cp >= '0' && cp <= '9') return UNICODE_NUMBER;
        if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return UNICODE_SPACE;
        return UNICODE_OTHER;
    }
    if (cp == UNICODE_INVALID) return UNICODE_OTHER;
    if (unicode_is_letter(cp)) return UNICODE_LETTER;
    if (unicode_is_number(cp)) return UNICODE_NUMBER;
    if (unicode_is_space(cp)) return UNICODE_SPACE;
    return UNICODE_OTHER;
}

const char *unicode_tables_version(void)
{
    return UNICODE_TABLES_VERSION;
}
