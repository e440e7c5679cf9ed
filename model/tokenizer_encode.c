/* Encoding text into token ids: special-token matching, the GPT-2 and Qwen2 pre-tokenizer
 * regexes written out by hand over code points, byte-level BPE merging by rank with a heap, and
 * a per-call cache of the ids of words already encoded. */
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer.h"
#include "model/tokenizer_internal.h"
#include "text/hash.h"
#include "text/unicode.h"
#include "text/utf8.h"

struct Symbol { int32_t id; int32_t prev, next; uint32_t len; }; /* len 0: merged away */
struct HeapItem { uint32_t rank; uint32_t pos; int32_t id; };

/* Words repeat, so a long text keeps the BPE result of each short word it has seen: its ids
 * and then its bytes, back to back in one array (one memory access finds both), and a table
 * from the word's hash to where they are. */
#define CACHE_MIN_TEXT 4096   /* shorter texts are not worth the table */
#define CACHE_MAX_WORD 32     /* bytes; longer words are rare and go straight to BPE */
#define CACHE_MAX_ENTRIES 12288
#define CACHE_INTS(n_bytes) (((n_bytes) + 3) / 4) /* int32 elements a word's bytes take */

/* A cache table value: offset of the ids in cache_ids << 16 | byte count << 8 | id count. */
static uint64_t cache_value(size_t off, size_t n_bytes, size_t n_ids)
{
    return (uint64_t)off << 16 | (uint64_t)n_bytes << 8 | n_ids;
}

struct Encoder {
    const struct Tokenizer *t;
    int32_t *ids;
    size_t cap, n;
    struct Symbol *sym;
    size_t sym_cap;
    struct HeapItem *heap;
    size_t heap_n;             /* heap holds 3 * sym_cap items */
    int32_t *word;             /* ids of the word being encoded (sym_cap entries) */
    int use_cache;             /* the text is long enough to cache its words */
    struct HashTable cache;    /* hash_bytes of a word -> cache_value() */
    int32_t *cache_ids;        /* each cached word's ids, then its bytes */
    size_t cache_ids_n, cache_ids_cap;
};

static void emit_id(struct Encoder *e, int32_t id)
{
    if (e->n < e->cap) e->ids[e->n] = id;
    e->n++;
}

/* Lowest rank first; among equal ranks the leftmost pair. */
static int heap_less(const struct HeapItem *a, const struct HeapItem *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct Encoder *e, struct HeapItem it)
{
    size_t i = e->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&it, &e->heap[p])) break;
        e->heap[i] = e->heap[p];
        i = p;
    }
    e->heap[i] = it;
}

static struct HeapItem heap_pop(struct Encoder *e)
{
    struct HeapItem top = e->heap[0], last = e->heap[--e->heap_n];
    size_t i = 0, n = e->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(&e->heap[c + 1], &e->heap[c])) c++;
        if (!heap_less(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n > 0) e->heap[i] = last;
    return top;
}

static void push_pair(struct Encoder *e, int32_t left)
{
    int32_t right = e->sym[left].next;
    if (right < 0) return;
    uint32_t rank;
    int32_t id;
    if (merge_find(e->t, e->sym[left].id, e->sym[right].id, &rank, &id))
        heap_push(e, (struct HeapItem){rank, (uint32_t)left, id});
}

/* One pre-token (n >= 2) into e->word, its token count in *n_ids: start from single bytes
 * and repeatedly merge the lowest-ranked adjacent pair. Stale heap entries (a side already
 * merged into something else) are recognised by checking that the pair still merges into the
 * recorded token. O(n log n) in the word's length. A byte with no token in the vocabulary is
 * dropped and its neighbours may merge across the gap, as a BPE model without an unknown
 * token does. */
static int bpe_word(struct Encoder *e, const unsigned char *w, size_t n, size_t *n_ids)
{
    const struct Tokenizer *t = e->t;
    *n_ids = 0;
    if (n > INT32_MAX / 4) return TOK_ENOMEM;
    if (n > e->sym_cap) {
        size_t cap = n < 64 ? 64 : n;
        struct Symbol *s = realloc(e->sym, cap * sizeof *s);
        if (!s) return TOK_ENOMEM;
        e->sym = s;
        int32_t *word = realloc(e->word, cap * sizeof *word);
        if (!word) return TOK_ENOMEM;
        e->word = word;
        /* Each merge pushes at most two pairs after the initial n - 1. */
        struct HeapItem *h = realloc(e->heap, 3 * cap * sizeof *h);
        if (!h) return TOK_ENOMEM;
        e->heap = h;
        e->sym_cap = cap;
    }
    size_t n_sym = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id >= 0) {
            e->sym[n_sym] = (struct Symbol){id, (int32_t)n_sym - 1, (int32_t)n_sym + 1, 1};
            n_sym++;
        }
    }
    if (n_sym == 0) return TOK_OK;
    e->sym[n_sym - 1].next = -1;
    e->heap_n = 0;
    for (size_t i = 0; i + 1 < n_sym; i++) push_pair(e, (int32_t)i);
    while (e->heap_n > 0) {
        struct HeapItem top = heap_pop(e);
        struct Symbol *l = &e->sym[top.pos];
        if (l->len == 0 || l->next < 0) continue;
        struct Symbol *r = &e->sym[l->next];
        uint32_t rank;
        int32_t id;
        if (!merge_find(t, l->id, r->id, &rank, &id) || id != top.id) continue;
        l->id = top.id;
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (l->next >= 0) e->sym[l->next].prev = (int32_t)top.pos;
        if (l->prev >= 0) push_pair(e, l->prev);
        push_pair(e, (int32_t)top.pos);
    }
    for (int32_t i = 0; i >= 0; i = e->sym[i].next) e->word[(*n_ids)++] = e->sym[i].id;
    return TOK_OK;
}

/* The cached ids of the word w[0..n) with hash h: 1 with *ids and *n_ids set, or 0. */
static int cache_find(const struct Encoder *e, const unsigned char *w, size_t n, uint64_t h,
                      const int32_t **ids, size_t *n_ids)
{
    size_t pos;
    for (struct HashSlot *s = hash_find(&e->cache, h, &pos); s; s = hash_next(&e->cache, h, &pos)) {
        const int32_t *c = e->cache_ids + (s->value >> 16);
        size_t k = s->value & 0xFF;
        if (((s->value >> 8) & 0xFF) == n && memcmp(c + k, w, n) == 0) {
            *ids = c;
            *n_ids = k;
            return 1;
        }
    }
    return 0;
}

/* Remember the ids just made for w[0..n) (in e->word). The cache only saves time: when memory
 * runs short it stops growing and encoding carries on. */
static void cache_add(struct Encoder *e, const unsigned char *w, size_t n, uint64_t h,
                      size_t n_ids)
{
    size_t need = n_ids + CACHE_INTS(n);
    if (e->cache.n >= CACHE_MAX_ENTRIES || n_ids > 0xFF || e->cache_ids_n + need > UINT32_MAX)
        return;
    if (e->cache_ids_n + need > e->cache_ids_cap) {
        size_t cap = e->cache_ids_cap ? 2 * e->cache_ids_cap : 4096;
        int32_t *p = realloc(e->cache_ids, cap * sizeof *p);
        if (!p) return;
        e->cache_ids = p;
        e->cache_ids_cap = cap;
    }
    if (!hash_insert(&e->cache, h, cache_value(e->cache_ids_n, n, n_ids))) return;
    int32_t *c = e->cache_ids + e->cache_ids_n;
    if (n_ids) memcpy(c, e->word, n_ids * sizeof *e->word);
    memcpy(c + n_ids, w, n);
    e->cache_ids_n += need;
}

static int encode_word(struct Encoder *e, const unsigned char *w, size_t n)
{
    if (n == 1) {
        if (e->t->byte_id[w[0]] >= 0) emit_id(e, e->t->byte_id[w[0]]);
        return TOK_OK;
    }
    int cacheable = e->use_cache && n <= CACHE_MAX_WORD;
    uint64_t h = 0;
    if (cacheable) {
        h = hash_bytes(w, n);
        const int32_t *ids;
        size_t n_ids;
        if (cache_find(e, w, n, h, &ids, &n_ids)) {
            for (size_t i = 0; i < n_ids; i++) emit_id(e, ids[i]);
            return TOK_OK;
        }
    }
    size_t n_ids;
    int rc = bpe_word(e, w, n, &n_ids);
    if (rc) return rc;
    for (size_t i = 0; i < n_ids; i++) emit_id(e, e->word[i]);
    if (cacheable) cache_add(e, w, n, h, n_ids);
    return TOK_OK;
}

enum { CLS_INVALID = 4 }; /* beside enum UnicodeClass: an ill-formed byte, always alone */

static const uint8_t ascii_class[128] = {
    /* 0x00 */ 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 0, 0,
    /* 0x10 */ 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    /* 0x20 */ 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    /* 0x30 */ 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0,
    /* 0x40 */ 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    /* 0x50 */ 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,
    /* 0x60 */ 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    /* 0x70 */ 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,
};

/* Class of the code point at s[0..n), n >= 1, and its length in *k. */
static int class_at(const unsigned char *s, size_t n, size_t *k)
{
    if (s[0] < 0x80) { *k = 1; return ascii_class[s[0]]; }
    uint32_t cp;
    size_t len = utf8_decode(s, n, &cp);
    if (cp == UTF8_INVALID) { *k = 1; return CLS_INVALID; }
    *k = len;
    return (int)unicode_class(cp);
}

/* The GPT-2 pre-tokenizer regex
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * matched by hand, leftmost alternative first. With split_digits every \p{N} code point is a
 * piece of its own and the regex runs on the text between them, so a digit ends a piece just
 * like the end of the text does (the lookahead sees no \S there). Ill-formed bytes are pieces
 * of their own as well, so each becomes its byte token. */
static int pretokenize(struct Encoder *e, const unsigned char *s, size_t len, int split_digits)
{
    size_t pos = 0;
    while (pos < len) {
        size_t k, k2, end;
        int c = class_at(s + pos, len - pos, &k);
        int rc;
        if (c == CLS_INVALID || (split_digits && c == UNICODE_NUMBER)) {
            if ((rc = encode_word(e, s + pos, k))) return rc;
            pos += k;
            continue;
        }
        if (s[pos] == '\'' && pos + 1 < len) {
            unsigned char a = s[pos + 1], b = pos + 2 < len ? s[pos + 2] : 0;
            int two = a == 's' || a == 't' || a == 'm' || a == 'd';
            int three = (a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l');
            size_t m = two ? 2 : three ? 3 : 0;
            if (m) {
                if ((rc = encode_word(e, s + pos, m))) return rc;
                pos += m;
                continue;
            }
        }
        size_t p = pos;
        int run = c;
        if (s[pos] == ' ' && pos + 1 < len) {
            int c2 = class_at(s + pos + 1, len - pos - 1, &k2);
            if (c2 == UNICODE_LETTER || c2 == UNICODE_OTHER ||
                (c2 == UNICODE_NUMBER && !split_digits)) {
                p = pos + 1;
                run = c2;
                k = k2;
            }
        }
        if (run == UNICODE_LETTER || run == UNICODE_NUMBER || run == UNICODE_OTHER) {
            end = p + k;
            while (end < len && class_at(s + end, len - end, &k2) == run) end += k2;
        } else {
            /* \s+(?!\S) gives back the last space when \S follows, \s+ takes a lone one. */
            size_t last = pos;
            int next = -1;
            end = pos;
            while (end < len) {
                next = class_at(s + end, len - end, &k2);
                if (next != UNICODE_SPACE) break;
                last = end;
                end += k2;
            }
            int followed_by_text = end < len && next != CLS_INVALID &&
                                   !(split_digits && next == UNICODE_NUMBER);
            if (followed_by_text && last > pos) end = last;
        }
        if ((rc = encode_word(e, s + pos, end - pos))) return rc;
        pos = end;
    }
    return TOK_OK;
}

/* Length of a contraction (?i:'s|'t|'re|'ve|'m|'ll|'d) at s[0] == '\'', or 0. Case-insensitive
 * as Oniguruma folds it, which also lets U+017F LATIN SMALL LETTER LONG S stand for 's'. */
static size_t contraction_qwen2(const unsigned char *s, size_t len)
{
    if (len < 2) return 0;
    unsigned a = s[1] | 0x20u, b = len > 2 ? s[2] | 0x20u : 0;
    if (s[1] >= 0x80) return len > 2 && s[1] == 0xC5 && s[2] == 0xBF ? 3 : 0; /* 'ſ */
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (((a == 'r' || a == 'v') && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* Qwen2's pre-tokenizer regex (its tokenizer.json; tokenizer.ggml.pre "qwen2")
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*
 *   |\s*[\r\n]+|\s+(?!\S)|\s+
 * matched by hand, leftmost alternative first: a letter run may take one leading character that
 * is neither a letter, a digit, CR nor LF; every digit stands alone; a punctuation run takes
 * the line breaks after it; a whitespace run that holds line breaks ends after its last one.
 * Ill-formed bytes are pieces of their own and end the text around them for the lookahead, as
 * in pretokenize. */
static int pretokenize_qwen2(struct Encoder *e, const unsigned char *s, size_t len)
{
    size_t pos = 0;
    while (pos < len) {
        size_t k, k2 = 0, end;
        int c = class_at(s + pos, len - pos, &k);
        if (c == CLS_INVALID || c == UNICODE_NUMBER) {
            end = pos + k;
        } else if (s[pos] == '\'' && (end = contraction_qwen2(s + pos, len - pos)) > 0) {
            end += pos;
        } else {
            int c2 = pos + k < len ? class_at(s + pos + k, len - pos - k, &k2) : -1;
            int line_break = s[pos] == '\r' || s[pos] == '\n';
            if (c == UNICODE_LETTER || (c2 == UNICODE_LETTER && !line_break)) {
                end = c == UNICODE_LETTER ? pos + k : pos + k + k2;
                while (end < len && class_at(s + end, len - end, &k2) == UNICODE_LETTER) end += k2;
            } else if (c == UNICODE_OTHER || (s[pos] == ' ' && c2 == UNICODE_OTHER)) {
                end = c == UNICODE_OTHER ? pos + k : pos + 1 + k2;
                while (end < len && class_at(s + end, len - end, &k2) == UNICODE_OTHER) end += k2;
                while (end < len && (s[end] == '\r' || s[end] == '\n')) end++;
            } else {
                /* Whitespace: up to its last line break if it has one (\s*[\r\n]+), else all
                 * of it, less its last character when text follows (\s+(?!\S), \s+). */
                size_t last = pos, after_break = 0;
                int next = -1;
                end = pos;
                while (end < len) {
                    next = class_at(s + end, len - end, &k2);
                    if (next != UNICODE_SPACE) break;
                    last = end;
                    end += k2;
                    if (s[last] == '\r' || s[last] == '\n') after_break = end;
                }
                if (after_break) end = after_break;
                else if (end < len && next != CLS_INVALID && last > pos) end = last;
            }
        }
        int rc = encode_word(e, s + pos, end - pos);
        if (rc) return rc;
        pos = end;
    }
    return TOK_OK;
}

static int encode_text(struct Encoder *e, const unsigned char *s, size_t len)
{
    if (e->t->pre == PRE_QWEN2) return pretokenize_qwen2(e, s, len);
    return pretokenize(e, s, len, e->t->pre == PRE_DIGITS_GPT2);
}

int tok_encode(const struct Tokenizer *t, const char *text, size_t len, unsigned flags,
               int32_t *ids, size_t cap, size_t *n_out)
{
    *n_out = 0;
    if ((!text && len > 0) || (!ids && cap > 0)) return TOK_EINPUT;
    const unsigned char *s = (const unsigned char *)text;
    struct Encoder e = {.t = t, .ids = ids, .cap = cap};
    e.use_cache = len >= CACHE_MIN_TEXT && hash_init(&e.cache, 4096) == 0; /* else: no cache */
    int rc = TOK_OK;
    if ((flags & TOK_ADD_BOS) && t->add_bos && t->bos >= 0) emit_id(&e, t->bos);
    /* Control tokens are recognised only when asked; user-defined ones (Qwen2's <tool_call>)
     * always, as Hugging Face's added vocabulary and llama.cpp both do. */
    int parse_control = (flags & TOK_PARSE_SPECIAL) != 0;
    uint8_t want_first = parse_control ? SPECIAL_ANY : SPECIAL_USER;
    if (t->n_specials == 0) {
        if (len > 0) rc = encode_text(&e, s, len);
    } else {
        size_t seg = 0;
        for (size_t p = 0; p < len && rc == TOK_OK;) {
            const struct Special *hit = NULL;
            if (t->special_first[s[p]] & want_first) {
                for (size_t i = 0; i < t->n_specials; i++) {
                    const struct Special *sp = &t->specials[i];
                    if ((parse_control || !sp->control) && sp->len <= len - p &&
                        memcmp(s + p, sp->text, sp->len) == 0) {
                        hit = sp;
                        break;
                    }
                }
            }
            if (!hit) { p++; continue; }
            if (p > seg) rc = encode_text(&e, s + seg, p - seg);
            emit_id(&e, hit->id);
            p += hit->len;
            seg = p;
        }
        if (rc == TOK_OK && seg < len) rc = encode_text(&e, s + seg, len - seg);
    }
    free(e.sym);
    free(e.heap);
    free(e.word);
    hash_free(&e.cache);
    free(e.cache_ids);
    *n_out = e.n;
    return rc;
}
