/* Quote decoding (model/quote.c) against a brute-force reference: at every step of random
 * walks over random documents the allowed set is exactly the tokens that keep the answer a
 * join of verbatim document spans under the span rules, the removed mass is 1 - P(allowed),
 * and the recorded spans lie where their tokens are. Then real text through the SmolLM2
 * tokenizer: the spaceless first word. DIFFRAG_TEST_SCALE=small (valgrind's pass) walks over 12
 * random documents instead of 60: the reference's pass over the whole vocabulary at every step
 * is nearly all of the binary's time, 20-50 times slower under valgrind. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "model/quote.h"
#include "model/tokenizer.h"
#include "tests/check.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

/* Does seq[0..n) occur inside one of the spans? */
static int occurs(const int32_t *toks, const uint32_t *spans, size_t n_spans, const int32_t *seq,
                  size_t n)
{
    for (size_t s = 0; s < n_spans; s++)
        for (uint32_t a = spans[2 * s]; a + n <= spans[2 * s + 1]; a++)
            if (memcmp(toks + a, seq, n * sizeof *seq) == 0) return 1;
    return 0;
}

/* The allowed set by the rules, from scratch: continue the current span, start a new one
 * (first token, or after QUOTE_MIN_SPAN tokens while spans are left), end after a token. */
static int ref_allowed(const int32_t *toks, const uint32_t *spans, size_t n_spans,
                       const int32_t *cur, size_t cur_len, int n_spans_used, int n_answer,
                       int32_t t, const struct Tokenizer *tok)
{
    if (tok_is_end(tok, t)) return n_answer > 0;
    int32_t seq[64];
    if (cur_len > 0 && cur_len < 63) {
        memcpy(seq, cur, cur_len * sizeof *seq);
        seq[cur_len] = t;
        if (occurs(toks, spans, n_spans, seq, cur_len + 1)) return 1;
    }
    int may_start = n_answer == 0 || (cur_len >= QUOTE_MIN_SPAN && n_spans_used < QUOTE_MAX_SPANS);
    return may_start && occurs(toks, spans, n_spans, &t, 1);
}

static void test_random(const struct Tokenizer *tok, int trials)
{
    int nv = tok_n_vocab(tok);
    float *logits = malloc((size_t)nv * sizeof *logits), *masked = malloc((size_t)nv * sizeof *masked);
    int32_t toks[400];
    /* tokens without a leading space, so that no spaceless alias joins the first step's set
     * (test_text covers those) */
    int32_t alpha_id[8];
    int n_alpha_id = 0;
    for (int32_t t = 300; n_alpha_id < 8; t++) {
        size_t plen;
        const char *p = tok_piece(tok, t, &plen);
        if (p && plen > 0 && p[0] != ' ') alpha_id[n_alpha_id++] = t;
    }
    int in_alpha[1024] = {0};
    int multi = 0, bad_sets = 0, bad_mass = 0, bad_place = 0, bad_draft = 0, n_drafted = 0;
    int walks = 0, steps = 0;
    for (int trial = 0; trial < trials; trial++) {
        /* documents over a small alphabet of ordinary tokens, so that runs repeat */
        int alpha = 3 + (int)(rnd() % 6);
        size_t n = 40 + rnd() % 300;
        for (size_t i = 0; i < n; i++) toks[i] = alpha_id[rnd() % (uint32_t)alpha];
        for (int i = 0; i < 8; i++) in_alpha[alpha_id[i]] = i < alpha;
        uint32_t spans[16];
        size_t n_spans = 1 + rnd() % 5;
        uint32_t at = rnd() % 5;
        for (size_t s = 0; s < n_spans; s++) {
            uint32_t a = at + rnd() % 8, b = a + rnd() % 60;
            if (b > n) b = (uint32_t)n;
            if (a > b) a = b;
            spans[2 * s] = a;
            spans[2 * s + 1] = b;
            at = b;
        }
        struct QuoteIndex *q = NULL;
        char err[256];
        CHECK(quote_index_new(toks, n, spans, n_spans, tok, &q, err, sizeof err) == 0, "%s", err);
        if (!q) continue;
        for (int walk = 0; walk < 4; walk++, walks++) {
            struct QuoteCursor c;
            quote_cursor_init(&c);
            int32_t answer[64], cur[64];
            size_t cur_len = 0;
            for (int step = 0; step < 40; step++, steps++) {
                for (int i = 0; i < nv; i++) logits[i] = -30.0f + (float)(rnd() % 1000) / 100.0f;
                for (int i = 0; i < alpha; i++) logits[alpha_id[i]] = (float)(rnd() % 500) / 100.0f;
                logits[tok_eos(tok)] = step < 6 ? -5.0f : 3.0f;
                float removed = quote_mask(q, &c, logits, nv, masked);
                double z = 0, kept = 0;
                int32_t allowed[64];
                int n_allowed = 0;
                for (int t = 0; t < nv; t++) {
                    double w = exp((double)logits[t]);
                    z += w;
                    /* the documents hold only the alphabet's tokens */
                    int ref = t < 1024 && in_alpha[t]
                            ? ref_allowed(toks, spans, n_spans, cur, cur_len, c.n_spans,
                                          c.n_tokens, t, tok)
                            : tok_is_end(tok, t) && c.n_tokens > 0;
                    int got = masked[t] != -INFINITY;
                    if (ref != got && bad_sets++ < 5)
                        fprintf(stderr, "trial %d step %d token %d: ref %d got %d (len %d, spans %d, "
                                "answer %d)\n", trial, step, t, ref, got, (int)cur_len, c.n_spans,
                                c.n_tokens);
                    if (ref) kept += w;
                    if (got && n_allowed < 64) allowed[n_allowed++] = t;
                }
                if (fabs(removed - (1 - kept / z)) > 1e-5) bad_mass++;
                if (n_allowed == 0) break;
                /* the end of the turn one time in ten, so that walks join several spans */
                int32_t t = allowed[rnd() % (uint32_t)n_allowed];
                for (int tries = 0; tries < 8 && quote_is_end(q, t) && rnd() % 10; tries++)
                    t = allowed[rnd() % (uint32_t)n_allowed];
                CHECK(quote_advance(q, &c, t) == 0, "an allowed token is taken");
                if (quote_is_end(q, t)) break;
                answer[c.n_tokens - 1] = t;
                if (c.len == 1) cur_len = 0;
                cur[cur_len++] = t;
                /* every span lies where it says: its document tokens are the answer's */
                size_t k = 0;
                for (int s = 0; s < c.n_spans; s++) {
                    const struct QuoteSpan *sp = &c.spans[s];
                    uint32_t len = sp->tok_end - sp->tok_start;
                    if (sp->span >= n_spans || spans[2 * sp->span] + sp->tok_end > spans[2 * sp->span + 1] ||
                        memcmp(toks + spans[2 * sp->span] + sp->tok_start, answer + k,
                               len * sizeof *answer) != 0)
                        bad_place++;
                    k += len;
                }
                if (k != (size_t)c.n_tokens) bad_place++;
                if (c.n_spans > 1 && c.len == 1) multi++;
                /* the draft: what follows the span's first occurrence, within its document span */
                int32_t draft[8];
                int nd = quote_draft(q, &c, draft, 8), ref_nd = -1;
                size_t ref_at = 0;
                for (size_t s = 0; s < n_spans && ref_nd < 0; s++)
                    for (uint32_t a = spans[2 * s]; a + cur_len <= spans[2 * s + 1] && ref_nd < 0; a++)
                        if (memcmp(toks + a, cur, cur_len * sizeof *cur) == 0) {
                            ref_at = a + cur_len;
                            ref_nd = (int)(spans[2 * s + 1] - ref_at) < 8
                                     ? (int)(spans[2 * s + 1] - ref_at) : 8;
                        }
                if (ref_nd != nd || memcmp(draft, toks + ref_at, (size_t)(nd > 0 ? nd : 0) * sizeof *draft))
                    bad_draft++;
                n_drafted += nd;
            }
        }
        /* a token outside the allowed set is refused and leaves the cursor as it was */
        struct QuoteCursor c;
        quote_cursor_init(&c);
        CHECK(quote_advance(q, &c, 299) == -1 && c.n_tokens == 0, "a token no document has");
        CHECK(quote_draft(q, &c, (int32_t[4]){0}, 4) == 0, "no draft before a span opens");
        quote_index_destroy(&q);
        CHECK(q == NULL, "destroy clears the pointer");
    }
    CHECK(multi > trials / 3, "walks that joined spans: %d", multi);
    printf("random walks: %d walks (%d joined spans), %d steps; allowed-set mismatches %d, mass mismatches %d, "
           "misplaced spans %d\n", walks, multi, steps, bad_sets, bad_mass, bad_place);
    CHECK(bad_sets == 0, "allowed sets match the reference (%d differ)", bad_sets);
    CHECK(bad_mass == 0, "removed mass matches (%d differ)", bad_mass);
    CHECK(bad_place == 0, "spans lie where their tokens are (%d misplaced)", bad_place);
    printf("drafts: %d tokens drafted, %d drafts differ from the reference\n", n_drafted, bad_draft);
    CHECK(n_drafted > trials * 16, "walks drafted (%d tokens)", n_drafted);
    CHECK(bad_draft == 0, "drafts follow the span's first occurrence (%d differ)", bad_draft);
    free(logits);
    free(masked);
}

static void test_text(const struct Tokenizer *tok)
{
    const char *doc = "The Rhine is about 1,230 kilometres long. It rises in the Alps.";
    int32_t toks[64];
    size_t n = 0;
    CHECK(tok_encode(tok, doc, strlen(doc), 0, toks, 64, &n) == TOK_OK && n < 64, "encode");
    uint32_t spans[2] = {0, (uint32_t)n};
    struct QuoteIndex *q = NULL;
    char err[256];
    CHECK(quote_index_new(toks, n, spans, 1, tok, &q, err, sizeof err) == 0, "%s", err);
    int32_t about[4];
    size_t n_about = 0;
    tok_encode(tok, "about", 5, 0, about, 4, &n_about);
    CHECK(n_about == 1, "\"about\" is one token");
    int nv = tok_n_vocab(tok);
    float *logits = calloc((size_t)nv, sizeof *logits), *masked = malloc((size_t)nv * sizeof *masked);
    struct QuoteCursor c;
    quote_cursor_init(&c);
    logits[about[0]] = 20.0f;
    float removed = quote_mask(q, &c, logits, nv, masked);
    CHECK(masked[about[0]] == 20.0f, "the spaceless first word is allowed");
    CHECK(masked[tok_eos(tok)] == -INFINITY, "no end before the first token");
    CHECK(removed > 0 && removed < 0.01f, "little mass removed when the model quotes (%g)", removed);
    CHECK(quote_advance(q, &c, about[0]) == 0 && c.n_spans == 1 && c.spans[0].skip_space,
          "it starts a span without its space");
    CHECK(c.spans[0].tok_start == 3 && c.spans[0].tok_end == 4, "at \" about\" (%u, %u)",
          c.spans[0].tok_start, c.spans[0].tok_end);
    /* the next token must continue the text: " 1" or similar, not " Alps" (too soon for a
     * new span), and the end of the turn now may come */
    int32_t alps[4];
    size_t n_alps = 0;
    tok_encode(tok, " Alps", 5, 0, alps, 4, &n_alps);
    quote_mask(q, &c, logits, nv, masked);
    CHECK(masked[toks[4]] != -INFINITY, "the next document token continues");
    CHECK(n_alps == 1 && (masked[alps[0]] == -INFINITY) == (QUOTE_MIN_SPAN > 1),
          "another span after one token only when QUOTE_MIN_SPAN allows it");
    CHECK(masked[tok_eos(tok)] != -INFINITY, "the end may come after a token");
    /* a character split across tokens: while it is incomplete the span must go on (no end, no
     * new span), so every span holds whole characters */
    {
        const char *rare = "Clef \xf0\x9d\x84\x9e and \xea\x99\xae eye.";
        int32_t rt[64];
        size_t nr = 0;
        CHECK(tok_encode(tok, rare, strlen(rare), 0, rt, 64, &nr) == TOK_OK && nr < 64, "encode");
        uint32_t rs[2] = {0, (uint32_t)nr};
        struct QuoteIndex *rq = NULL;
        CHECK(quote_index_new(rt, nr, rs, 1, tok, &rq, err, sizeof err) == 0, "%s", err);
        struct QuoteCursor rc;
        quote_cursor_init(&rc);
        int split_seen = 0, bad = 0;
        for (size_t i = 0; rq && i < nr; i++) {
            CHECK(quote_advance(rq, &rc, rt[i]) == 0, "the document's own tokens");
            quote_mask(rq, &rc, logits, nv, masked);
            int end_open = masked[tok_eos(tok)] != -INFINITY;
            if (rc.pending > 0) {
                split_seen++;
                /* only the document's next token: the one that goes on with the character */
                for (int t = 0; t < nv; t++)
                    if (masked[t] != -INFINITY && (i + 1 >= nr || t != rt[i + 1]))
                        bad++;
            } else if (!end_open) {
                bad++;
            }
        }
        printf("multi-byte characters: %d steps inside one\n", split_seen);
        CHECK(split_seen > 0, "the test text splits a character across tokens");
        CHECK(bad == 0, "inside a character only the span goes on (%d wrong)", bad);
        quote_index_destroy(&rq);
    }
    /* an empty index: the answer can only end */
    struct QuoteIndex *empty = NULL;
    uint32_t none[2] = {0, 0};
    CHECK(quote_index_new(toks, n, none, 1, tok, &empty, err, sizeof err) == 0, "%s", err);
    quote_cursor_init(&c);
    quote_mask(empty, &c, logits, nv, masked);
    int n_open = 0;
    for (int t = 0; t < nv; t++) n_open += masked[t] != -INFINITY;
    CHECK(n_open >= 1 && masked[tok_eos(tok)] != -INFINITY, "nothing to quote: only the end (%d)",
          n_open);
    /* a span beyond the prompt is refused */
    uint32_t bad[2] = {0, (uint32_t)n + 1};
    struct QuoteIndex *b = NULL;
    CHECK(quote_index_new(toks, n, bad, 1, tok, &b, err, sizeof err) == -1 && !b &&
          strstr(err, "outside"), "a span out of range: %s", err);
    quote_index_destroy(&empty);
    quote_index_destroy(&q);
    free(logits);
    free(masked);
}

int main(void)
{
    char err[512];
    struct GgufFile *g = NULL;
    struct Tokenizer *tok = NULL;
    if (gguf_open(MODEL, &g, err, sizeof err) != GGUF_OK) {
        fprintf(stderr, "FAIL: %s (run `make model`)\n", err);
        return 1;
    }
    int rc = tok_load_gguf(g, &tok, err, sizeof err);
    gguf_close(&g);
    CHECK(rc == TOK_OK, "tokenizer: %s", err);
    int small = check_small_scale();
    if (small) printf("reduced scale (DIFFRAG_TEST_SCALE=small): 12 random documents of 60\n");
    if (rc == TOK_OK) {
        test_random(tok, small ? 12 : 60);
        test_text(tok);
    }
    tok_destroy(&tok);
    return check_report("test_quote");
}
