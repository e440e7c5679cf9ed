/* Quote decoding (model/quote.h): the suffix automaton of a prompt's document tokens, the
 * allowed set at each answer step, and the probability mass the constraint removes. */
#include "model/quote.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct QuoteIndex {
    const struct Tokenizer *tok;
    /* states: (n_states) */
    int32_t *len, *link, *firstpos, *head;
    int32_t n_states, cap_states;
    /* edges: (n_edges) token, target state, next edge of the same state (-1: last) */
    int32_t *e_tok, *e_to, *e_next;
    int32_t n_edges, cap_edges;
    /* (state, token) -> edge, open addressing; key 0 is never used (state 0's token 0 is
     * stored as key 1 << 63 | 0, see key_of) */
    uint64_t *h_key;
    int32_t *h_edge;
    size_t h_mask;
    /* the documents laid end to end: span i's first token is at off[i], its separator at
     * off[i] + (spans' length) */
    uint32_t *off, *span_len;
    size_t n_spans;
    int32_t *seq;              /* those tokens, each span's separator a negative id */
    int32_t n_seq;
    int32_t *ends;             /* end-of-turn ids */
    size_t n_ends;
    int32_t *alias_from, *alias_to;  /* spaceless first tokens -> their document token,
                                        sorted by alias_from */
    size_t n_alias;
};

static uint64_t key_of(int32_t state, int32_t token)
{
    return (1ull << 63) | ((uint64_t)(uint32_t)state << 31) | (uint64_t)((uint32_t)token & 0x7fffffffu);
}

static size_t hash_of(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k;
}

static int32_t edge_find(const struct QuoteIndex *q, int32_t state, int32_t token)
{
    uint64_t k = key_of(state, token);
    for (size_t h = hash_of(k) & q->h_mask;; h = (h + 1) & q->h_mask) {
        if (q->h_key[h] == k) return q->h_edge[h];
        if (q->h_key[h] == 0) return -1;
    }
}

static int32_t next_state(const struct QuoteIndex *q, int32_t state, int32_t token)
{
    int32_t e = edge_find(q, state, token);
    return e < 0 ? -1 : q->e_to[e];
}

/* Adds an edge; the caller made sure there is room and that the edge is new. */
static void edge_add(struct QuoteIndex *q, int32_t state, int32_t token, int32_t to)
{
    int32_t e = q->n_edges++;
    q->e_tok[e] = token;
    q->e_to[e] = to;
    q->e_next[e] = q->head[state];
    q->head[state] = e;
    uint64_t k = key_of(state, token);
    size_t h = hash_of(k) & q->h_mask;
    while (q->h_key[h] != 0) h = (h + 1) & q->h_mask;
    q->h_key[h] = k;
    q->h_edge[h] = e;
}

static int32_t state_add(struct QuoteIndex *q, int32_t len, int32_t firstpos)
{
    int32_t s = q->n_states++;
    q->len[s] = len;
    q->link[s] = -1;
    q->firstpos[s] = firstpos;
    q->head[s] = -1;
    return s;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The spaceless spellings of the tokens that can start a span (every document token): for
 * a token whose piece is " word", the single token "word" when the vocabulary has one and it
 * is not itself a document token. */
static int build_aliases(struct QuoteIndex *q)
{
    size_t n_root = 0;
    for (int32_t e = q->head[0]; e >= 0; e = q->e_next[e]) n_root++;
    q->alias_from = malloc((n_root + 1) * sizeof *q->alias_from);
    q->alias_to = malloc((n_root + 1) * sizeof *q->alias_to);
    int64_t *pairs = malloc((n_root + 1) * sizeof *pairs);
    if (!q->alias_from || !q->alias_to || !pairs) { free(pairs); return -1; }
    size_t n = 0;
    for (int32_t e = q->head[0]; e >= 0; e = q->e_next[e]) {
        int32_t t = q->e_tok[e];
        if (t < 0) continue;
        size_t plen;
        const char *p = tok_piece(q->tok, t, &plen);
        if (!p || plen < 2 || p[0] != ' ' || tok_is_special(q->tok, t)) continue;
        int32_t ids[2];
        size_t n_ids = 0;
        if (tok_encode(q->tok, p + 1, plen - 1, 0, ids, 2, &n_ids) != TOK_OK || n_ids != 1)
            continue;
        if (next_state(q, 0, ids[0]) >= 0) continue;
        pairs[n++] = ((int64_t)ids[0] << 32) | (uint32_t)t;
    }
    /* sorted by the alias; of two document tokens with the same spaceless spelling, one */
    qsort(pairs, n, sizeof *pairs, cmp_i64);
    for (size_t i = 0; i < n; i++) {
        int32_t from = (int32_t)(pairs[i] >> 32), to = (int32_t)(uint32_t)pairs[i];
        if (q->n_alias > 0 && q->alias_from[q->n_alias - 1] == from) continue;
        q->alias_from[q->n_alias] = from;
        q->alias_to[q->n_alias++] = to;
    }
    free(pairs);
    return 0;
}

static int32_t alias_of(const struct QuoteIndex *q, int32_t token)
{
    size_t lo = 0, hi = q->n_alias;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (q->alias_from[mid] < token) lo = mid + 1;
        else hi = mid;
    }
    return lo < q->n_alias && q->alias_from[lo] == token ? q->alias_to[lo] : -1;
}

void quote_index_destroy(struct QuoteIndex **pq)
{
    struct QuoteIndex *q = *pq;
    if (!q) return;
    free(q->len); free(q->link); free(q->firstpos); free(q->head);
    free(q->e_tok); free(q->e_to); free(q->e_next);
    free(q->h_key); free(q->h_edge);
    free(q->off); free(q->span_len); free(q->seq);
    free(q->ends); free(q->alias_from); free(q->alias_to);
    free(q);
    *pq = NULL;
}

int quote_index_new(const int32_t *tokens, size_t n_tokens, const uint32_t *spans,
                    size_t n_spans, const struct Tokenizer *tok, struct QuoteIndex **out,
                    char *err, size_t errlen)
{
    *out = NULL;
    size_t total = 0;
    for (size_t i = 0; i < n_spans; i++) {
        if (spans[2 * i] > spans[2 * i + 1] || spans[2 * i + 1] > n_tokens) {
            snprintf(err, errlen, "quote: document span %zu [%u, %u) is outside the prompt of "
                     "%zu tokens", i, spans[2 * i], spans[2 * i + 1], n_tokens);
            return -1;
        }
        total += spans[2 * i + 1] - spans[2 * i] + 1;  /* its tokens and a separator */
    }
    if (total > (1u << 28)) {
        snprintf(err, errlen, "quote: %zu document tokens are too many to index", total);
        return -1;
    }
    struct QuoteIndex *q = calloc(1, sizeof *q);
    if (!q) goto oom;
    q->tok = tok;
    q->cap_states = (int32_t)(2 * total + 2);
    q->cap_edges = (int32_t)(3 * total + 4);
    size_t hcap = 16;
    while (hcap < 2 * (size_t)q->cap_edges) hcap *= 2;
    q->h_mask = hcap - 1;
    q->len = malloc((size_t)q->cap_states * sizeof *q->len);
    q->link = malloc((size_t)q->cap_states * sizeof *q->link);
    q->firstpos = malloc((size_t)q->cap_states * sizeof *q->firstpos);
    q->head = malloc((size_t)q->cap_states * sizeof *q->head);
    q->e_tok = malloc((size_t)q->cap_edges * sizeof *q->e_tok);
    q->e_to = malloc((size_t)q->cap_edges * sizeof *q->e_to);
    q->e_next = malloc((size_t)q->cap_edges * sizeof *q->e_next);
    q->h_key = calloc(hcap, sizeof *q->h_key);
    q->h_edge = malloc(hcap * sizeof *q->h_edge);
    q->off = malloc((n_spans + 1) * sizeof *q->off);
    q->span_len = malloc((n_spans + 1) * sizeof *q->span_len);
    q->seq = malloc((total + 1) * sizeof *q->seq);
    if (!q->seq || !q->len || !q->link || !q->firstpos || !q->head || !q->e_tok || !q->e_to ||
        !q->e_next || !q->h_key || !q->h_edge || !q->off || !q->span_len)
        goto oom;
    q->n_spans = n_spans;
    int32_t last = state_add(q, 0, -1);
    int32_t pos = 0;
    for (size_t i = 0; i < n_spans; i++) {
        q->off[i] = (uint32_t)pos;
        q->span_len[i] = spans[2 * i + 1] - spans[2 * i];
        for (uint32_t k = spans[2 * i]; k <= spans[2 * i + 1]; k++, pos++) {
            /* the separator after each span is a token no answer can be: -(i + 1) */
            int32_t c = k < spans[2 * i + 1] ? tokens[k] : -(int32_t)(i + 1);
            q->seq[q->n_seq++] = c;
            int32_t cur = state_add(q, q->len[last] + 1, pos);
            int32_t x = last;
            while (x >= 0 && edge_find(q, x, c) < 0) {
                edge_add(q, x, c, cur);
                x = q->link[x];
            }
            if (x < 0) {
                q->link[cur] = 0;
            } else {
                int32_t qs = next_state(q, x, c);
                if (q->len[x] + 1 == q->len[qs]) {
                    q->link[cur] = qs;
                } else {
                    int32_t clone = state_add(q, q->len[x] + 1, q->firstpos[qs]);
                    /* the clone's edges are copies of qs's (their order carries no meaning) */
                    for (int32_t e = q->head[qs]; e >= 0; e = q->e_next[e])
                        edge_add(q, clone, q->e_tok[e], q->e_to[e]);
                    q->link[clone] = q->link[qs];
                    while (x >= 0) {
                        int32_t e = edge_find(q, x, c);
                        if (e < 0 || q->e_to[e] != qs) break;
                        q->e_to[e] = clone;
                        x = q->link[x];
                    }
                    q->link[qs] = q->link[cur] = clone;
                }
            }
            last = cur;
        }
    }
    /* the tokens that end a turn */
    int32_t nv = tok_n_vocab(tok);
    size_t n_end = 0;
    for (int32_t t = 0; t < nv; t++) n_end += tok_is_end(tok, t) != 0;
    q->ends = malloc((n_end + 1) * sizeof *q->ends);
    if (!q->ends) goto oom;
    for (int32_t t = 0; t < nv; t++)
        if (tok_is_end(tok, t)) q->ends[q->n_ends++] = t;
    qsort(q->ends, q->n_ends, sizeof *q->ends, cmp_i32);
    if (build_aliases(q)) goto oom;
    *out = q;
    return 0;
oom:
    quote_index_destroy(&q);
    snprintf(err, errlen, "quote: out of memory indexing the documents");
    return -1;
}

void quote_cursor_init(struct QuoteCursor *c)
{
    memset(c, 0, sizeof *c);
}

int quote_is_end(const struct QuoteIndex *q, int32_t token)
{
    return tok_is_end(q->tok, token) || tok_is_special(q->tok, token);
}

static int may_start_span(const struct QuoteCursor *c)
{
    return c->n_tokens == 0 ||
           (c->pending == 0 && c->len >= QUOTE_MIN_SPAN && c->n_spans < QUOTE_MAX_SPANS);
}

/* The continuation bytes still owed after the token's bytes (UTF-8 lead bytes open a
 * character, continuation bytes close it). */
static int pending_after(const struct QuoteIndex *q, int pending, int32_t token, int skip)
{
    size_t len = 0;
    const unsigned char *p = (const unsigned char *)tok_piece(q->tok, token, &len);
    for (size_t i = skip ? 1 : 0; p && i < len; i++) {
        unsigned char b = p[i];
        if (pending > 0 && (b & 0xC0) == 0x80) pending--;
        else if (b >= 0xF0) pending = 3;
        else if (b >= 0xE0) pending = 2;
        else if (b >= 0xC0) pending = 1;
        else pending = 0;
    }
    return pending;
}

/* Allows token t: copies its logit and adds its weight once. */
static void allow(const float *logits, float *masked, int n_vocab, int32_t t, float mx,
                  double *kept)
{
    if (t < 0 || t >= n_vocab || masked[t] != -INFINITY) return;
    float x = logits[t];
    if (x != x) return;   /* NaN: never chosen, no mass */
    masked[t] = x;
    *kept += exp((double)x - mx);
}

float quote_mask(const struct QuoteIndex *q, const struct QuoteCursor *c, const float *logits,
                 int n_vocab, float *masked)
{
    float mx = -INFINITY;
    for (int i = 0; i < n_vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double z = 0;
    if (mx > -INFINITY)
        for (int i = 0; i < n_vocab; i++)
            if (logits[i] == logits[i]) z += exp((double)logits[i] - mx);
    for (int i = 0; i < n_vocab; i++) masked[i] = -INFINITY;
    double kept = 0;
    if (c->len > 0)
        for (int32_t e = q->head[c->state]; e >= 0; e = q->e_next[e])
            allow(logits, masked, n_vocab, q->e_tok[e], mx, &kept);
    if (may_start_span(c)) {
        for (int32_t e = q->head[0]; e >= 0; e = q->e_next[e])
            allow(logits, masked, n_vocab, q->e_tok[e], mx, &kept);
        if (c->n_tokens == 0)
            for (size_t i = 0; i < q->n_alias; i++)
                allow(logits, masked, n_vocab, q->alias_from[i], mx, &kept);
    }
    int any = kept > 0;
    if ((c->n_tokens > 0 && c->pending == 0) || !any) {
        for (size_t i = 0; i < q->n_ends; i++)
            allow(logits, masked, n_vocab, q->ends[i], mx, &kept);
    }
    /* nothing allowed has a finite logit: let the end of the turn through whatever its logit */
    int open = 0;
    for (size_t i = 0; i < q->n_ends && !open; i++)
        open = q->ends[i] < n_vocab && masked[q->ends[i]] != -INFINITY;
    if (kept == 0 && !open && q->n_ends > 0 && q->ends[0] < n_vocab)
        masked[q->ends[0]] = 0;
    if (!(z > 0)) return 0;
    double removed = 1.0 - kept / z;
    return (float)(removed < 0 ? 0 : removed > 1 ? 1 : removed);
}

int quote_draft(const struct QuoteIndex *q, const struct QuoteCursor *c, int32_t *draft,
                int k_max)
{
    if (c->len <= 0 || c->state <= 0) return 0;
    int k = 0;
    for (int32_t p = q->firstpos[c->state] + 1; k < k_max && p < q->n_seq && q->seq[p] >= 0; p++)
        draft[k++] = q->seq[p];
    return k;
}

/* Where the current span lies: the first occurrence of its tokens in the documents. */
static void span_place(const struct QuoteIndex *q, struct QuoteCursor *c)
{
    int32_t end = q->firstpos[c->state];          /* its last token's position */
    int32_t start = end - c->len + 1;
    size_t lo = 0, hi = q->n_spans;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (q->off[mid] <= (uint32_t)start) lo = mid;
        else hi = mid;
    }
    struct QuoteSpan *s = &c->spans[c->n_spans - 1];
    s->span = (uint32_t)lo;
    s->tok_start = (uint32_t)start - q->off[lo];
    s->tok_end = (uint32_t)end + 1 - q->off[lo];
    s->skip_space = c->skip_space;
}

int quote_advance(const struct QuoteIndex *q, struct QuoteCursor *c, int32_t token)
{
    if (quote_is_end(q, token)) return 0;
    int32_t to = c->len > 0 ? next_state(q, c->state, token) : -1;
    if (to > 0) {
        c->state = to;
        c->len++;
        c->n_tokens++;
        c->pending = pending_after(q, c->pending, token, 0);
        span_place(q, c);
        return 0;
    }
    if (!may_start_span(c)) return -1;
    int skip = 0;
    int32_t doc = -1;
    to = next_state(q, 0, token);
    if (to < 0 && c->n_tokens == 0) {
        doc = alias_of(q, token);
        if (doc >= 0) {
            to = next_state(q, 0, doc);
            skip = 1;
        }
    }
    if (to <= 0) return -1;
    c->n_spans++;
    c->state = to;
    c->len = 1;
    c->skip_space = skip;
    c->n_tokens++;
    c->pending = pending_after(q, 0, skip ? doc : token, 0);
    span_place(q, c);
    return 0;
}
