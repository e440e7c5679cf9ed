/* The word splitter (the analyzer's rules over text/unicode.h's classes, keeping each word's
 * position and case) and the word set (a hash-only text/hash.h table). */
#include "text/words.h"

#include <stdlib.h>
#include <string.h>

#include "text/hash.h"
#include "text/unicode.h"
#include "text/utf8.h"

/* The word being collected: lowercased bytes (apostrophes included until the flush). */
struct WordAcc {
    char buf[4 * WORDS_MAX_BYTES + 8];
    size_t len;
    int overflow;
    struct Word w;
    int open;
};

static void acc_push(struct WordAcc *a, const char *b, size_t n)
{
    if (a->len + n > sizeof a->buf) {
        a->overflow = 1;    /* past any word length kept: the rest is cut anyway */
        return;
    }
    memcpy(a->buf + a->len, b, n);
    a->len += n;
}

static int acc_flush(struct WordAcc *a, words_fn fn, void *ctx)
{
    if (!a->open)
        return 0;
    a->open = 0;
    char *w = a->buf;
    size_t n = a->len;
    a->len = 0;
    if (!a->overflow && n >= 2 && w[n - 1] == 's' && w[n - 2] == '\'')
        n -= 2;
    a->overflow = 0;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (w[i] != '\'')
            w[k++] = w[i];
    n = utf8_cut(w, k, WORDS_MAX_BYTES);
    if (n == 0)
        return 0;
    memcpy(a->w.lower, w, n);
    a->w.lower_len = n;
    return fn(ctx, &a->w);
}

/* A word character at byte i (its code point cp, adv bytes) joins the word. */
static void acc_char(struct WordAcc *a, size_t i, size_t adv, uint32_t cp)
{
    uint32_t lo = unicode_lower(cp);
    if (!a->open) {
        a->open = 1;
        a->len = 0;
        a->overflow = 0;
        a->w.start = i;
        a->w.capital = lo != cp;
        a->w.digit = 0;
    }
    if (cp >= '0' && cp <= '9')
        a->w.digit = 1;
    char enc[4];
    acc_push(a, enc, utf8_encode(lo, enc));
    a->w.end = i + adv;
}

static int is_apostrophe(uint32_t cp) { return cp == '\'' || cp == 0x2019; }

static int ascii_word(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

/* The code point at u[i] and its word class; ill-formed bytes (UTF8_INVALID) separate. */
static enum UnicodeWordClass class_at(const unsigned char *u, size_t n, uint32_t *cp, size_t *adv)
{
    if (u[0] < 0x80) {
        *cp = u[0];
        *adv = 1;
        return ascii_word(u[0]) ? UNICODE_WORD : UNICODE_SEP;
    }
    *adv = utf8_decode(u, n, cp);
    return unicode_word_class(*cp);
}

int words_split(const char *text, size_t len, words_fn fn, void *ctx)
{
    const unsigned char *u = (const unsigned char *)text;
    struct WordAcc a;
    int rc;
    a.open = 0;
    a.len = 0;
    a.overflow = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp, next;
        size_t adv, adv2;
        enum UnicodeWordClass cls = class_at(u + i, len - i, &cp, &adv);
        if (cls == UNICODE_WORD) {
            acc_char(&a, i, adv, cp);
        } else if (is_apostrophe(cp) && a.open && i + adv < len) {
            /* kept only between two word characters ("don't", "Norman's") */
            if (class_at(u + i + adv, len - i - adv, &next, &adv2) == UNICODE_WORD)
                acc_push(&a, "'", 1);
            else if ((rc = acc_flush(&a, fn, ctx)))
                return rc;
        } else {
            if ((rc = acc_flush(&a, fn, ctx)))
                return rc;
            if (cls == UNICODE_IDEO) {
                acc_char(&a, i, adv, cp);
                if ((rc = acc_flush(&a, fn, ctx)))
                    return rc;
            }
        }
        i += adv;
    }
    return acc_flush(&a, fn, ctx);
}

/* ---- the word set: hash_bytes of each lowercased word, no keys kept ---- */

struct WordSet {
    struct HashTable table;
};

int words_set_new(struct WordSet **out)
{
    struct WordSet *ws = calloc(1, sizeof *ws);
    *out = NULL;
    if (!ws)
        return -1;
    if (hash_init(&ws->table, 128)) {
        free(ws);
        return -1;
    }
    *out = ws;
    return 0;
}

void words_set_destroy(struct WordSet **pws)
{
    struct WordSet *ws = pws ? *pws : NULL;
    if (!ws)
        return;
    hash_free(&ws->table);
    free(ws);
    *pws = NULL;
}

static int add_word(void *ctx, const struct Word *w)
{
    struct WordSet *ws = ctx;
    uint64_t h = hash_bytes(w->lower, w->lower_len);
    size_t pos;
    if (hash_find(&ws->table, h, &pos))
        return 0;
    return hash_insert(&ws->table, h, 0) ? 0 : -1;
}

int words_set_add_text(struct WordSet *ws, const char *text, size_t len)
{
    return words_split(text, len, add_word, ws) ? -1 : 0;
}

int words_set_has(const struct WordSet *ws, const char *lower, size_t len)
{
    size_t pos;
    return hash_find(&ws->table, hash_bytes(lower, len), &pos) != NULL;
}

size_t words_set_size(const struct WordSet *ws)
{
    return ws->table.n;
}
