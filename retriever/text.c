/* The analyzer that turns text into index terms: words are runs of letters, marks and digits
 * (text/unicode.h's word classes; an apostrophe between letters stays inside a word, a
 * possessive 's is dropped), each ideograph is a term by itself, then stop words and stemming
 * apply. */
#include "retriever/text.h"

#include <stdlib.h>
#include <string.h>
#include <libstemmer.h>

#include "retriever/status.h"
#include "text/hash.h"
#include "text/unicode.h"
#include "text/utf8.h"

/* Lucene's English stop set (EnglishAnalyzer.ENGLISH_STOP_WORDS_SET), sorted for bsearch. */
static const char *const STOP_WORDS[] = {
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is",
    "it", "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there",
    "these", "they", "this", "to", "was", "will", "with",
};

/* The words that make a sentence a question rather than say what it is about: interrogatives,
 * auxiliary verbs and personal pronouns ("How do I cancel a query?"), sorted for bsearch.
 * Rare in prose, so BM25 gives them a high weight and ranks a chunk that happens to hold
 * "how" or "I" above one about the subject; a question's terms leave them out
 * (analyzer_run_question). */
static const char *const QUESTION_WORDS[] = {
    "am", "are", "can", "could", "did", "do", "does", "had", "has", "have", "how", "i", "is",
    "me", "my", "should", "was", "we", "were", "what", "when", "where", "which", "who", "whom",
    "whose", "why", "would", "you", "your",
};

static int in_sorted(const char *const *set, size_t n_set, const char *w, size_t len)
{
    size_t lo = 0, hi = n_set;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const char *s = set[mid];
        size_t sl = strlen(s);
        int c = memcmp(w, s, len < sl ? len : sl);
        if (c == 0)
            c = (len > sl) - (len < sl);
        if (c == 0) return 1;
        if (c < 0) hi = mid; else lo = mid + 1;
    }
    return 0;
}

static int is_stop_word(const char *w, size_t len)
{
    return in_sorted(STOP_WORDS, sizeof STOP_WORDS / sizeof STOP_WORDS[0], w, len);
}

static int is_question_word(const char *w, size_t len)
{
    return in_sorted(QUESTION_WORDS, sizeof QUESTION_WORDS / sizeof QUESTION_WORDS[0], w, len);
}

/* Stems of recent words: most words of a text repeat, and the stemmer costs far more than a
 * lookup. Cleared when full. */
#define STEM_CACHE_SLOTS 16384
#define STEM_CACHE_WORD 24
struct StemSlot { uint32_t hash; uint8_t word_len, stem_len; char word[STEM_CACHE_WORD], stem[STEM_CACHE_WORD]; };

struct Analyzer {
    unsigned flags;
    int question;    /* this run leaves out QUESTION_WORDS */
    int lower;       /* lowercase ASCII letters in the word being collected */
    struct sb_stemmer *stemmer;
    struct StemSlot *stems;  /* STEM_CACHE_SLOTS, word_len 0 = empty */
    size_t n_stems;
    char *word;      /* the word being collected, lowercased */
    size_t len, cap;
};

int analyzer_new(unsigned flags, struct Analyzer **out, char *err, size_t errlen)
{
    *out = NULL;
    if (flags & ~(unsigned)ANALYZE_KNOWN_FLAGS)
        return ret_fail(err, errlen, RET_EINPUT, "unknown analyzer flags 0x%x", flags);
    struct Analyzer *a = calloc(1, sizeof *a);
    if (!a)
        goto nomem;
    a->flags = flags;
    a->cap = 256;
    a->word = malloc(a->cap);
    if (!a->word)
        goto nomem;
    if (flags & ANALYZE_STEM) {
        a->stemmer = sb_stemmer_new("english", "UTF_8");
        a->stems = calloc(STEM_CACHE_SLOTS, sizeof *a->stems);
        if (!a->stemmer || !a->stems)
            goto nomem;
    }
    *out = a;
    return RET_OK;
nomem:
    analyzer_destroy(&a);
    return ret_fail(err, errlen, RET_ENOMEM, "out of memory creating the analyzer");
}

void analyzer_destroy(struct Analyzer **pa)
{
    struct Analyzer *a = pa ? *pa : NULL;
    if (!a)
        return;
    if (a->stemmer)
        sb_stemmer_delete(a->stemmer);
    free(a->stems);
    free(a->word);
    free(a);
    *pa = NULL;
}

unsigned analyzer_flags(const struct Analyzer *a) { return a->flags; }

static int word_push(struct Analyzer *a, const char *bytes, size_t n)
{
    if (a->len + n > a->cap) {
        size_t cap = a->cap * 2 + n;
        char *w = realloc(a->word, cap);
        if (!w)
            return RET_ENOMEM;
        a->word = w;
        a->cap = cap;
    }
    memcpy(a->word + a->len, bytes, n);
    a->len += n;
    return 0;
}

static int stem_emit(struct Analyzer *a, const char *w, size_t n, analyzer_emit_fn emit, void *ctx)
{
    struct StemSlot *slot = NULL;
    uint32_t h = 0;
    if (n <= STEM_CACHE_WORD) {
        h = (uint32_t)hash_bytes(w, n);
        for (size_t i = h & (STEM_CACHE_SLOTS - 1);; i = (i + 1) & (STEM_CACHE_SLOTS - 1)) {
            slot = &a->stems[i];
            if (slot->word_len == 0)
                break;
            if (slot->hash == h && slot->word_len == n && memcmp(slot->word, w, n) == 0)
                return emit(ctx, slot->stem, slot->stem_len);
        }
    }
    const sb_symbol *st = sb_stemmer_stem(a->stemmer, (const sb_symbol *)w, (int)n);
    if (!st)
        return RET_ENOMEM;
    int sl = sb_stemmer_length(a->stemmer);
    if (sl <= 0)
        return emit(ctx, w, n);
    size_t stem_len = utf8_cut((const char *)st, (size_t)sl, ANALYZE_MAX_TERM);
    if (slot && stem_len <= STEM_CACHE_WORD) {
        if (a->n_stems >= STEM_CACHE_SLOTS / 2) {
            /* Full enough that probes get long: start over (slot is then the home slot). */
            memset(a->stems, 0, STEM_CACHE_SLOTS * sizeof *a->stems);
            a->n_stems = 0;
            slot = &a->stems[h & (STEM_CACHE_SLOTS - 1)];
        }
        slot->hash = h;
        slot->word_len = (uint8_t)n;
        slot->stem_len = (uint8_t)stem_len;
        memcpy(slot->word, w, n);
        memcpy(slot->stem, st, stem_len);
        a->n_stems++;
    }
    return emit(ctx, (const char *)st, stem_len);
}

static int word_flush(struct Analyzer *a, analyzer_emit_fn emit, void *ctx)
{
    char *w = a->word;
    size_t n = a->len;
    /* a word in capitals ("WHO", "CAN") names something: only its lowercase form is a
     * question word ("I" is always written so, and stays one) */
    int capitals = n >= 2 && a->lower == 0;
    a->len = 0;
    a->lower = 0;
    if (n >= 2 && w[n - 1] == 's' && w[n - 2] == '\'')
        n -= 2;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (w[i] != '\'')
            w[k++] = w[i];
    n = utf8_cut(w, k, ANALYZE_MAX_TERM);
    if (n == 0)
        return 0;
    if ((a->flags & ANALYZE_STOPWORDS) && is_stop_word(w, n))
        return 0;
    if (a->question && !capitals && is_question_word(w, n))
        return 0;
    if (a->stemmer)
        return stem_emit(a, w, n, emit, ctx);
    return emit(ctx, w, n);
}

static int is_apostrophe(uint32_t cp) { return cp == '\'' || cp == 0x2019; }

int analyzer_run(struct Analyzer *a, const char *text, size_t len, analyzer_emit_fn emit, void *ctx)
{
    const unsigned char *u = (const unsigned char *)text;
    size_t i = 0;
    int rc = 0;
    a->len = 0;
    a->lower = 0;
    while (i < len) {
        unsigned char c = u[i];
        if (c < 0x80 && c != '\'') {
            /* ASCII fast path: letters and digits extend the word, anything else ends it. */
            int is_word = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z');
            if (is_word) {
                if (a->len == a->cap) {
                    char *w = realloc(a->word, a->cap * 2);
                    if (!w)
                        return RET_ENOMEM;
                    a->word = w;
                    a->cap *= 2;
                }
                a->lower += c >= 'a' && c <= 'z';
                a->word[a->len++] = (char)((c >= 'A' && c <= 'Z') ? c + 32 : c);
            } else if (a->len && (rc = word_flush(a, emit, ctx))) {
                return rc;
            }
            i++;
            continue;
        }
        /* Ill-formed bytes (cp = UTF8_INVALID) are separators. */
        uint32_t cp;
        size_t adv = utf8_decode(u + i, len - i, &cp);
        enum UnicodeWordClass cls = unicode_word_class(cp);
        if (cls == UNICODE_WORD) {
            char enc[4];
            size_t m = utf8_encode(unicode_lower(cp), enc);
            if ((rc = word_push(a, enc, m)))
                return rc;
        } else if (cls == UNICODE_SEP && is_apostrophe(cp) && a->len > 0 && i + adv < len) {
            /* Keep an apostrophe only between two word characters ("don't", "Norman's"). */
            uint32_t next;
            utf8_decode(u + i + adv, len - i - adv, &next);
            if (unicode_word_class(next) == UNICODE_WORD) {
                if ((rc = word_push(a, "'", 1)))
                    return rc;
            } else if ((rc = word_flush(a, emit, ctx))) {
                return rc;
            }
        } else {
            if (a->len && (rc = word_flush(a, emit, ctx)))
                return rc;
            if (cls == UNICODE_IDEO) {
                char enc[4];
                size_t m = utf8_encode(cp, enc);
                if ((rc = emit(ctx, enc, m)))
                    return rc;
            }
        }
        i += adv;
    }
    if (a->len)
        rc = word_flush(a, emit, ctx);
    return rc;
}

int analyzer_run_question(struct Analyzer *a, const char *text, size_t len, analyzer_emit_fn emit,
                          void *ctx)
{
    a->question = 1;
    int rc = analyzer_run(a, text, len, emit, ctx);
    a->question = 0;
    return rc;
}
