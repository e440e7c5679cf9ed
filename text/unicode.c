/* Code-point classes and lowercasing: binary search over the generated range tables of
 * text/unicode_tables.h, with a fast path for ASCII. */
#include "text/unicode.h"

#include <stddef.h>

#include "text/unicode_tables.h"

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* The packed class byte of cp: pre-tokenizer class | word class << 2; 0 outside every range. */
static unsigned range_class(uint32_t cp)
{
    size_t lo = 0, hi = N_OF(unicode_ranges);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const struct UnicodeRange *r = &unicode_ranges[mid];
        if (cp > r->hi) lo = mid + 1;
        else if (cp < r->lo) hi = mid;
        else return r->cls;
    }
    return 0;
}

enum UnicodeClass unicode_class(uint32_t cp)
{
    if (cp < 0x80) {
        if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return UNICODE_LETTER;
        if (cp >= '0' && cp <= '9') return UNICODE_NUMBER;
        if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return UNICODE_SPACE;
        return UNICODE_OTHER;
    }
    return (enum UnicodeClass)(range_class(cp) & 3);
}

int unicode_is_letter(uint32_t cp) { return unicode_class(cp) == UNICODE_LETTER; }
int unicode_is_number(uint32_t cp) { return unicode_class(cp) == UNICODE_NUMBER; }
int unicode_is_space(uint32_t cp) { return unicode_class(cp) == UNICODE_SPACE; }

enum UnicodeWordClass unicode_word_class(uint32_t cp)
{
    if (cp < 0x80) {
        if ((cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z'))
            return UNICODE_WORD;
        return UNICODE_SEP;
    }
    return (enum UnicodeWordClass)(range_class(cp) >> 2);
}

uint32_t unicode_lower(uint32_t cp)
{
    if (cp < 0x80) return (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp;
    size_t lo = 0, hi = N_OF(unicode_lower_runs);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const struct UnicodeLowerRun *r = &unicode_lower_runs[mid];
        if (cp < r->lo) hi = mid;
        else if (cp > r->hi) lo = mid + 1;
        else return (cp - r->lo) % r->stride == 0 ? (uint32_t)((int32_t)cp + r->delta) : cp;
    }
    return cp;
}

const char *unicode_tables_version(void)
{
    return UNICODE_TABLES_VERSION;
}
