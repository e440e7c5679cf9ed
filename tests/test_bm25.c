/* Tests for the retriever's ranking pieces: the posting codec (round trips, empty lists, one
 * entry, huge gaps, corrupt input), BM25 scores against hand-computed values on a small corpus
 * (store and in-memory index, to 1e-6), MaxScore against exhaustive scoring, the analyzer
 * (Unicode lowercasing, word splitting, stop words, stemming), the chunker, the term bag and
 * the JSON reader. Needs no model file and no shared data. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "retriever/bm25.h"
#include "retriever/chunker.h"
#include "text/json.h"
#include "retriever/memindex.h"
#include "retriever/postings.h"
#include "retriever/status.h"
#include "retriever/store.h"
#include "retriever/termbag.h"
#include "retriever/text.h"
#include "text/unicode.h"
#include "text/utf8.h"
#include "text/tokcount.h"
#include "tests/check.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void rm_store(const char *dir)
{
    char p[512];
    snprintf(p, sizeof p, "%s/data.mdb", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/lock.mdb", dir);
    unlink(p);
    rmdir(dir);
}

/* ---- postings ------------------------------------------------------------------------- */

static int roundtrip(uint32_t base, const struct Posting *p, size_t n)
{
    uint8_t *buf = malloc(postings_bound(n));
    struct Posting *out = malloc((n + 1) * sizeof *out);
    size_t size, got = 0;
    int ok = buf && out && postings_encode(base, p, n, buf, &size) == RET_OK &&
             size <= postings_bound(n) &&
             postings_decode(base, buf, size, out, n + 1, &got) == RET_OK && got == n;
    for (size_t i = 0; ok && i < n; i++)
        ok = out[i].id == p[i].id && out[i].tf == p[i].tf && out[i].len == p[i].len;
    /* Every strict prefix of the encoding must be rejected, never misread. */
    for (size_t t = 0; ok && t < size && t < 300; t++) {
        size_t cut = size <= 300 ? t : (size_t)(rnd() % size);
        ok = postings_decode(base, buf, cut, out, n + 1, &got) == RET_ECORRUPT;
    }
    free(buf);
    free(out);
    return ok;
}

static void test_postings(void)
{
    CHECK(roundtrip(0, NULL, 0), "empty list");
    CHECK(roundtrip(12345, NULL, 0), "empty list with a base");
    struct Posting one = { 7, 3, 11 };
    CHECK(roundtrip(0, &one, 1), "one entry");
    CHECK(roundtrip(7, &one, 1), "one entry at its base");
    struct Posting gaps[] = { { 0, 1, 1 }, { 1, 2, 0 }, { 0x7FFFFFFF, 1, 5 }, { 0xFFFFFFFDu, 65535, 0xFFFFFFFFu },
                              { 0xFFFFFFFEu, 0xFFFFFFFFu, 2 } };
    CHECK(roundtrip(0, gaps, 5), "huge gaps and extreme values");
    struct Posting big[] = { { 0xFFFFFFFEu, 1, 1 } };
    CHECK(roundtrip(0, big, 1), "one entry at the top of the id range");

    size_t max_n = 5000, ok = 1;
    struct Posting *p = malloc(max_n * sizeof *p);
    for (int trial = 0; trial < 300 && ok; trial++) {
        size_t n = (size_t)(rnd() % (trial < 50 ? 5 : max_n));
        uint64_t id = rnd() % 1000;
        uint32_t base = (uint32_t)(id > 0 ? rnd() % (id + 1) : 0);
        size_t k;
        for (k = 0; k < n; k++) {
            if (id > 0xFFFFFFFEu)
                break;
            p[k].id = (uint32_t)id;
            p[k].tf = 1 + (uint32_t)(rnd() % (rnd() % 4 ? 4 : 100000));
            p[k].len = (uint32_t)(rnd() % 100000);
            uint64_t gap = rnd() % 8 == 0 ? rnd() % 100000000 : 1 + rnd() % 300;
            id += gap;
        }
        ok = roundtrip(base, p, k);
    }
    CHECK(ok, "random posting lists round-trip");
    free(p);

    /* Bad order and bad tf are refused by the encoder. */
    uint8_t buf[256];
    size_t size;
    struct Posting bad1[] = { { 5, 1, 1 }, { 5, 1, 1 } };
    struct Posting bad2[] = { { 5, 0, 1 } };
    CHECK(postings_encode(0, bad1, 2, buf, &size) == RET_EINPUT, "duplicate ids refused");
    CHECK(postings_encode(0, bad2, 1, buf, &size) == RET_EINPUT, "tf 0 refused");
    CHECK(postings_encode(9, &one, 1, buf, &size) == RET_EINPUT, "id below base refused");

    /* Random bytes never crash the decoder; lists claiming more than cap are refused. */
    struct Posting out[64];
    size_t got;
    int accepted_bad = 0;
    for (int t = 0; t < 20000; t++) {
        size_t len = rnd() % 40;
        for (size_t i = 0; i < len; i++)
            buf[i] = (uint8_t)rnd();
        if (postings_decode(0, buf, len, out, 64, &got) == RET_OK) {
            for (size_t i = 1; i < got; i++)
                accepted_bad |= out[i].id <= out[i - 1].id;
        }
    }
    CHECK(!accepted_bad, "decoder accepted decreasing ids");
    uint8_t over[] = { 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01 };
    uint64_t v;
    size_t used;
    CHECK(varint_get(over, sizeof over, &v, &used) == RET_ECORRUPT, "over-long varint refused");
    uint8_t vb[VARINT_MAX];
    size_t vn = varint_put(vb, UINT64_MAX);
    CHECK(vn == 10 && varint_get(vb, vn, &v, &used) == RET_OK && v == UINT64_MAX && used == 10,
          "varint UINT64_MAX");
}

/* ---- BM25 against hand-computed values -------------------------------------------------- */

static const char *const HAND_IDS[] = { "d1", "d2", "d3", "d4" };
static const char *const HAND_TEXT[] = {
    "the cat sat on the mat",      /* 6 terms */
    "The dog sat.",                /* 3 */
    "cats and dogs",               /* 3 */
    "A cat and a dog and a bird",  /* 8 */
};

struct Expect { const char *doc; double score; };

static double score_of(const struct SearchHit *h, size_t n, const char *doc, int *found)
{
    for (size_t i = 0; i < n; i++)
        if (h[i].doc_id_len == strlen(doc) && memcmp(h[i].doc_id, doc, h[i].doc_id_len) == 0) {
            *found = 1;
            return h[i].score;
        }
    *found = 0;
    return 0;
}

typedef int (*search_fn)(void *ctx, const char *q, const struct SearchOptions *o, struct SearchHit *hits,
                         size_t cap, size_t *n);

static double check_query(search_fn fn, void *ctx, const char *label, const char *q, double k1, double b,
                          const struct Expect *e, size_t ne)
{
    struct SearchOptions o;
    search_options_default(&o);
    o.k = 10;
    o.k1 = k1;
    o.b = b;
    struct SearchHit hits[10];
    size_t n = 0;
    int st = fn(ctx, q, &o, hits, 10, &n);
    CHECK(st == RET_OK, "%s: search \"%s\" failed: %d", label, q, st);
    CHECK(n == ne, "%s: \"%s\": %zu hits, expected %zu", label, q, n, ne);
    double max_diff = 0;
    for (size_t i = 0; i < ne; i++) {
        int found;
        double s = score_of(hits, n, e[i].doc, &found);
        CHECK(found, "%s: \"%s\": %s missing", label, q, e[i].doc);
        double d = fabs(s - e[i].score);
        if (d > max_diff)
            max_diff = d;
        CHECK(d < 1e-6, "%s: \"%s\": %s scored %.9f, hand-computed %.9f", label, q, e[i].doc, s, e[i].score);
    }
    for (size_t i = 1; i < n; i++)
        CHECK(hits[i - 1].score >= hits[i].score, "%s: hits not sorted", label);
    return max_diff;
}

static int mem_search(void *ctx, const char *q, const struct SearchOptions *o, struct SearchHit *hits,
                      size_t cap, size_t *n)
{
    return memidx_search(ctx, q, strlen(q), o, hits, cap, n, NULL, NULL, 0);
}

struct StoreCtx { struct Store *s; const char *coll; };

static int store_search_fn(void *ctx, const char *q, const struct SearchOptions *o, struct SearchHit *hits,
                           size_t cap, size_t *n)
{
    struct StoreCtx *c = ctx;
    struct StoreReader *r;
    char err[256];
    int st = store_read_begin(c->s, &r, err, sizeof err);
    if (st)
        return st;
    st = store_search(r, c->coll, q, strlen(q), o, hits, cap, n, NULL, err, sizeof err);
    if (st)
        fprintf(stderr, "store_search: %s\n", err);
    /* Hits borrow the snapshot; the checks only read scores and ids right away, so copy the
     * ids out of LMDB memory before ending it. */
    static char ids[10][8];
    for (size_t i = 0; i < *n && i < 10; i++) {
        size_t l = hits[i].doc_id_len < 7 ? hits[i].doc_id_len : 7;
        memcpy(ids[i], hits[i].doc_id, l);
        ids[i][l] = 0;
        hits[i].doc_id = ids[i];
        hits[i].doc_id_len = l;
    }
    store_read_end(&r);
    return st;
}

static double run_hand_queries(search_fn fn, void *ctx, const char *label, int stem)
{
    const double L2 = log(2.0), L103 = log(10.0 / 3.0);
    double md = 0, d;
    if (!stem) {
        /* N = 4 chunks, lengths 6, 3, 3, 8, avglen 5; idf(df=2) = ln 2, idf(df=1) = ln(10/3).
         * k1 = 0.9, b = 0.4: denominators tf + 0.9 (0.6 + 0.4 len / 5). */
        struct Expect e1[] = { { "d1", 2 * L2 * 1.9 / 1.972 }, { "d2", L2 * 1.9 / 1.756 }, { "d4", L2 * 1.9 / 2.116 } };
        d = check_query(fn, ctx, label, "cat sat", 0.9, 0.4, e1, 3); md = d > md ? d : md;
        struct Expect e2[] = { { "d1", L2 * 2 * 1.9 / 2.972 }, { "d2", L2 * 1.9 / 1.756 } };
        d = check_query(fn, ctx, label, "THE", 0.9, 0.4, e2, 2); md = d > md ? d : md;
        /* Query term multiplicity counts: "and" twice. */
        struct Expect e3[] = { { "d3", 2 * L2 * 1.9 / 1.756 },
                               { "d4", 2 * L2 * 2 * 1.9 / 3.116 + L2 * 1.9 / 2.116 },
                               { "d2", L2 * 1.9 / 1.756 } };
        d = check_query(fn, ctx, label, "and, and dog!", 0.9, 0.4, e3, 3); md = d > md ? d : md;
        struct Expect e4[] = { { "d1", L103 * 1.9 / 1.972 }, { "d4", L103 * 1.9 / 2.116 } };
        d = check_query(fn, ctx, label, "mat bird", 0.9, 0.4, e4, 2); md = d > md ? d : md;
        /* k1 = 1.2, b = 0.75: d1 "mat": 2.2 / (1 + 1.2 (0.25 + 0.75 * 6/5)) = 2.2 / 2.38. */
        struct Expect e5[] = { { "d1", L103 * 2.2 / 2.38 } };
        d = check_query(fn, ctx, label, "mat", 1.2, 0.75, e5, 1); md = d > md ? d : md;
        /* "cats" is its own term without stemming: df 1 (d3, length 3). */
        struct Expect e6[] = { { "d3", L103 * 1.9 / 1.756 } };
        d = check_query(fn, ctx, label, "cats", 0.9, 0.4, e6, 1); md = d > md ? d : md;
        d = check_query(fn, ctx, label, "zebra", 0.9, 0.4, NULL, 0); md = d > md ? d : md;
    } else {
        /* With stemming "cats" -> "cat" (df 3: d1, d3, d4), "dogs" -> "dog" (df 3: d2, d3, d4):
         * idf(df=3) = ln(1 + 1.5 / 3.5) = ln(10/7). */
        const double L107 = log(10.0 / 7.0);
        struct Expect e1[] = { { "d1", L107 * 1.9 / 1.972 }, { "d3", L107 * 1.9 / 1.756 }, { "d4", L107 * 1.9 / 2.116 } };
        d = check_query(fn, ctx, label, "cats", 0.9, 0.4, e1, 3); md = d > md ? d : md;
        struct Expect e2[] = { { "d2", L107 * 1.9 / 1.756 + L2 * 1.9 / 1.756 },
                               { "d3", L107 * 1.9 / 1.756 }, { "d4", L107 * 1.9 / 2.116 },
                               { "d1", L2 * 1.9 / 1.972 } };
        d = check_query(fn, ctx, label, "dog sitting sat", 0.9, 0.4, e2, 4); md = d > md ? d : md;
    }
    return md;
}

static void hand_docs(struct StoreDoc *docs)
{
    for (int i = 0; i < 4; i++)
        docs[i] = (struct StoreDoc){ HAND_IDS[i], 2, HAND_TEXT[i], strlen(HAND_TEXT[i]), NULL, 0, NULL, 0 };
}

static void test_bm25_hand(void)
{
    struct TokenCounter tc;
    tokcount_simple(&tc);
    struct StoreDoc docs[4];
    hand_docs(docs);
    double max_diff = 0;
    for (int stem = 0; stem < 2; stem++) {
        struct IndexOptions io;
        index_options_default(&io);
        io.analyzer_flags = stem ? ANALYZE_STEM : 0;
        io.index_flags = 0;
        struct MemIndex *m;
        char err[256];
        int st = memidx_build(docs, 4, &io, 0, &tc, &m, err, sizeof err);
        CHECK(st == RET_OK, "memidx_build: %s", err);
        if (st)
            continue;
        CHECK(memidx_n_chunks(m) == 4, "one chunk per document, got %zu", memidx_n_chunks(m));
        double d = run_hand_queries(mem_search, m, stem ? "memory/stem" : "memory", stem);
        max_diff = d > max_diff ? d : max_diff;
        memidx_destroy(&m);

        char dir[] = "/tmp/diffrag-bm25-XXXXXX";
        CHECK(mkdtemp(dir) != NULL, "mkdtemp");
        struct Store *s;
        st = store_open(dir, NULL, &s, err, sizeof err);
        CHECK(st == RET_OK, "store_open: %s", err);
        if (st)
            continue;
        st = store_put_docs(s, "hand", docs, 4, &io, &tc, err, sizeof err);
        CHECK(st == RET_OK, "store_put_docs: %s", err);
        struct StoreCtx sc = { s, "hand" };
        d = run_hand_queries(store_search_fn, &sc, stem ? "store/stem" : "store", stem);
        max_diff = d > max_diff ? d : max_diff;
        store_close(&s);
        rm_store(dir);
    }
    printf("bm25 hand-computed scores: max |diff| = %.3g (tolerance 1e-6)\n", max_diff);
}

/* ---- MaxScore == exhaustive ------------------------------------------------------------- */

static void random_text(char *out, size_t cap, size_t n_words, size_t vocab)
{
    size_t len = 0;
    for (size_t w = 0; w < n_words && len + 16 < cap; w++) {
        /* Zipf-like: small word numbers are much more frequent. */
        double u = (double)(rnd() % 1000000) / 1e6;
        size_t id = (size_t)pow((double)vocab, u) - 1;
        len += (size_t)snprintf(out + len, cap - len, "%sw%zu", w ? " " : "", id);
        if (rnd() % 9 == 0)
            len += (size_t)snprintf(out + len, cap - len, ".");
    }
    out[len] = 0;
}

static void test_maxscore(void)
{
    struct TokenCounter tc;
    tokcount_simple(&tc);
    size_t n_docs = 3000;
    struct StoreDoc *docs = calloc(n_docs, sizeof *docs);
    char (*ids)[16] = calloc(n_docs, 16);
    char **texts = calloc(n_docs, sizeof *texts);
    for (size_t i = 0; i < n_docs; i++) {
        texts[i] = malloc(1024);
        random_text(texts[i], 1024, 3 + rnd() % 60, 800);
        snprintf(ids[i], 16, "r%zu", i);
        docs[i] = (struct StoreDoc){ ids[i], strlen(ids[i]), texts[i], strlen(texts[i]), NULL, 0, NULL, 0 };
    }
    struct IndexOptions io;
    index_options_default(&io);
    io.chunk.target_tokens = 32;
    io.chunk.overlap_tokens = 8;
    struct MemIndex *m;
    char err[256];
    int st = memidx_build(docs, n_docs, &io, 0, &tc, &m, err, sizeof err);
    CHECK(st == RET_OK, "memidx_build: %s", err);
    if (st)
        return;
    size_t mismatches = 0, queries = 0;
    uint64_t pruned_postings = 0, full_postings = 0;
    double max_diff = 0;
    struct SearchHit a[50], b[50];
    for (int q = 0; q < 400; q++) {
        char query[256];
        random_text(query, sizeof query, 1 + rnd() % 8, 900);
        struct SearchOptions o;
        search_options_default(&o);
        static const size_t ks[] = { 1, 3, 10, 50 };
        o.k = ks[q % 4];
        if (q % 5 == 0) {
            o.k1 = 1.2;
            o.b = 0.75;
        }
        size_t na, nb;
        struct Bm25Stats sa, sb;
        o.exhaustive = 0;
        st = memidx_search(m, query, strlen(query), &o, a, 50, &na, &sa, err, sizeof err);
        o.exhaustive = 1;
        st |= memidx_search(m, query, strlen(query), &o, b, 50, &nb, &sb, err, sizeof err);
        CHECK(st == RET_OK, "search failed: %s", err);
        queries++;
        pruned_postings += sa.postings;
        full_postings += sb.postings;
        int same = na == nb;
        for (size_t i = 0; same && i < na; i++) {
            double d = fabs(a[i].score - b[i].score);
            max_diff = d > max_diff ? d : max_diff;
            /* Equal scores may legitimately order differently only if they tie. */
            same = d < 1e-9 && (a[i].chunk_id == b[i].chunk_id || fabs(a[i].score - b[i].score) < 1e-12);
        }
        mismatches += !same;
    }
    CHECK(mismatches == 0, "MaxScore differs from exhaustive scoring on %zu of %zu queries", mismatches, queries);
    CHECK(pruned_postings < full_postings, "pruning scored %llu postings, exhaustive %llu",
          (unsigned long long)pruned_postings, (unsigned long long)full_postings);
    printf("maxscore vs exhaustive: %zu queries, %zu mismatches, max |score diff| %.3g; postings scored "
           "%llu vs %llu (%.1f%%)\n", queries, mismatches, max_diff, (unsigned long long)pruned_postings,
           (unsigned long long)full_postings, 100.0 * (double)pruned_postings / (double)full_postings);

    /* Document filter: only chunks of the named documents, and the same scores as unfiltered. */
    const char *fids[] = { "r10", "r2000", "nope" };
    size_t flens[] = { 3, 5, 4 };
    struct SearchOptions o;
    search_options_default(&o);
    o.k = 50;
    o.doc_ids = fids;
    o.doc_id_lens = flens;
    o.n_doc_ids = 3;
    char query[1024];
    snprintf(query, sizeof query, "%s %s", texts[10], texts[2000]);
    size_t na;
    st = memidx_search(m, query, strlen(query), &o, a, 50, &na, NULL, err, sizeof err);
    int only = st == RET_OK && na > 0;
    for (size_t i = 0; i < na; i++)
        only &= (a[i].doc_id_len == 3 && !memcmp(a[i].doc_id, "r10", 3)) ||
                (a[i].doc_id_len == 5 && !memcmp(a[i].doc_id, "r2000", 5));
    CHECK(only, "document filter returned other documents (%zu hits)", na);
    memidx_destroy(&m);
    for (size_t i = 0; i < n_docs; i++)
        free(texts[i]);
    free(texts);
    free(ids);
    free(docs);
}

/* ---- analyzer ------------------------------------------------------------------------------ */

struct Terms { char buf[1024]; size_t len; };

static int collect(void *ctx, const char *t, size_t len)
{
    struct Terms *ts = ctx;
    if (ts->len + len + 2 < sizeof ts->buf) {
        if (ts->len)
            ts->buf[ts->len++] = '|';
        memcpy(ts->buf + ts->len, t, len);
        ts->len += len;
        ts->buf[ts->len] = 0;
    }
    return 0;
}

/* The terms of text, '|'-joined: a chunk's (analyzer_run) or, with query, a query's
 * (index_query_terms, each distinct term once). */
static void expect_analysis(unsigned flags, int query, const char *text, const char *want)
{
    struct Analyzer *a;
    CHECK(analyzer_new(flags, &a, NULL, 0) == RET_OK, "analyzer_new");
    struct Terms ts = { { 0 }, 0 };
    if (query) {
        struct TermBag bag;
        termbag_init(&bag);
        CHECK(index_query_terms(a, text, strlen(text), &bag) == RET_OK, "index_query_terms");
        for (size_t i = 0; i < bag.n; i++)
            collect(&ts, termbag_term(&bag, i), bag.items[i].len);
        termbag_free(&bag);
    } else {
        analyzer_run(a, text, strlen(text), collect, &ts);
    }
    CHECK(strcmp(ts.buf, want) == 0, "%s(\"%s\", 0x%x) = \"%s\", want \"%s\"",
          query ? "query" : "analyze", text, flags, ts.buf, want);
    analyzer_destroy(&a);
}

static void expect_terms(unsigned flags, const char *text, const char *want)
{
    expect_analysis(flags, 0, text, want);
}

static void expect_query(unsigned flags, const char *query, const char *want)
{
    expect_analysis(flags, 1, query, want);
}

/* A question's interrogatives, auxiliaries and pronouns are not what it is about: they leave
 * its terms (unless they are all it has), and not the chunks' (analyzer_run is unchanged). */
static void test_question_words(void)
{
    expect_query(ANALYZE_STEM, "How do I cancel a query?", "cancel|a|queri");
    expect_query(0, "Which port does diffragd listen on? What is it?", "port|diffragd|listen|on|it");
    expect_query(0, "Who were your Normans?", "normans");
    /* in capitals a word names something: the WHO, not "who" */
    expect_query(0, "What does WHO do about malaria? CAN I?", "who|about|malaria|can");
    expect_query(0, "Who is it?", "it");
    expect_query(0, "Who are you?", "who|are|you");      /* nothing else: all of them stay */
    expect_query(0, "Is the Rhine 1,230 km long?", "the|rhine|1|230|km|long");
    expect_terms(0, "How do I cancel a query?", "how|do|i|cancel|a|query");

    /* A chunk that holds the question words does not outrank the one about the subject. */
    static const char about[] = "To cancel a query, send the cancel op with the query's id.";
    static const char other[] = "How do I read this? I do not know how. I wonder how.";
    struct StoreDoc docs[] = {
        { .id = "about", .id_len = 5, .text = about, .text_len = sizeof about - 1 },
        { .id = "other", .id_len = 5, .text = other, .text_len = sizeof other - 1 },
    };
    struct IndexOptions io;
    index_options_default(&io);
    io.index_flags = 0;
    struct TokenCounter tc;
    tokcount_simple(&tc);
    struct MemIndex *m;
    char err[256];
    CHECK(memidx_build(docs, 2, &io, 0, &tc, &m, err, sizeof err) == RET_OK, "memidx_build: %s", err);
    struct SearchOptions o;
    search_options_default(&o);
    o.k = 2;
    struct SearchHit hits[2];
    size_t n = 0;
    CHECK(memidx_search(m, "How do I cancel a query?", 24, &o, hits, 2, &n, NULL, err, sizeof err)
          == RET_OK && n == 1 && hits[0].doc_id_len == 5 && !memcmp(hits[0].doc_id, "about", 5),
          "the question finds only the chunk about cancelling (%zu hits, first %.*s)", n,
          n ? (int)hits[0].doc_id_len : 1, n ? hits[0].doc_id : "-");
    memidx_destroy(&m);
}

static void test_analyzer(void)
{
    expect_terms(0, "Hello, World! It's 2024.", "hello|world|it|2024");
    expect_terms(0, "ÉCOLE Straße ΣΟΦΙΑ İstanbul ÀÖ", "école|straße|σοφια|istanbul|àö");
    expect_terms(0, "Norman's don't rock'n'roll", "norman|dont|rocknroll");
    expect_terms(0, "state-of-the-art e-mail_x", "state|of|the|art|e|mail|x");
    expect_terms(0, "东京大学 in Tokyo", "东|京|大|学|in|tokyo");
    expect_terms(0, "naïve café", "naïve|café");
    expect_terms(0, "'quoted' words'", "quoted|words");
    expect_terms(ANALYZE_STOPWORDS, "The cat and the hat", "cat|hat");
    expect_terms(ANALYZE_STEM, "running runners ran easily", "run|runner|ran|easili");
    expect_terms(ANALYZE_STEM | ANALYZE_STOPWORDS, "The connections of this network", "connect|network");
    /* Invalid UTF-8 separates words instead of failing. */
    expect_terms(0, "ab\xff" "cd\xc3", "ab|cd");
    char longw[200];
    memset(longw, 'x', 150);
    longw[150] = 0;
    struct Analyzer *a;
    analyzer_new(0, &a, NULL, 0);
    struct Terms ts = { { 0 }, 0 };
    analyzer_run(a, longw, 150, collect, &ts);
    CHECK(ts.len == ANALYZE_MAX_TERM, "long word cut to %d bytes, got %zu", ANALYZE_MAX_TERM, ts.len);
    analyzer_destroy(&a);
    CHECK(analyzer_new(0x80, &a, NULL, 0) == RET_EINPUT, "unknown analyzer flag refused");

    CHECK(utf8_valid("abc\xc3\xa9", 5, NULL), "valid UTF-8");
    size_t bad;
    CHECK(!utf8_valid("ab\xc0\xaf", 4, &bad) && bad == 2, "overlong refused at 2");
    CHECK(!utf8_valid("\xed\xa0\x80", 3, NULL), "surrogate refused");
    CHECK(!utf8_valid("\xf4\x90\x80\x80", 4, NULL), "past U+10FFFF refused");
    CHECK(!utf8_valid("\xe2\x82", 2, NULL), "truncated refused");
    CHECK(unicode_lower(0x0130) == 'i' && unicode_lower(0x1E9E) == 0xDF && unicode_lower(0x0410) == 0x0430 &&
          unicode_lower(0x0100) == 0x0101 && unicode_lower(0x0101) == 0x0101 && unicode_lower(0x10400) == 0x10428,
          "lowercase table");
}

/* ---- chunker ------------------------------------------------------------------------------- */

static void test_chunker(void)
{
    struct TokenCounter tc;
    tokcount_simple(&tc);
    const char *t = "Dr. Smith went to Washington. He arrived at 5 p.m. on Monday! Did he stay? "
                    "Yes, e.g. for a week.\n\nA new paragraph starts here. J. R. R. Tolkien wrote it.\n"
                    "# A heading\n- a list item\n- another item\n";
    size_t *st, n;
    uint8_t *para;
    CHECK(chunk_sentences(t, strlen(t), &st, &para, &n) == RET_OK, "chunk_sentences");
    const char *want[] = { "Dr. Smith", "He arrived", "Did he", "Yes, e.g.", "A new paragraph", "J. R. R.",
                           "# A heading", "- a list item", "- another" };
    int want_para[] = { 1, 0, 0, 0, 1, 0, 0, 0, 0 };
    CHECK(n == 9, "9 sentence units, got %zu", n);
    for (size_t i = 0; i < n && i < 9; i++) {
        CHECK(strncmp(t + st[i], want[i], strlen(want[i])) == 0, "unit %zu starts \"%.12s\", want \"%s\"",
              i, t + st[i], want[i]);
        CHECK(para[i] == want_para[i], "unit %zu paragraph flag %d", i, para[i]);
    }
    free(st);
    free(para);

    /* Sizes, offsets, overlap and progress on a long text with an oversize sentence. */
    size_t cap = 200000, len = 0;
    char *big = malloc(cap);
    for (int s = 0; s < 600; s++) {
        size_t words = s == 300 ? 2000 : 3 + rnd() % 30; /* one run-on sentence of 2000 words */
        for (size_t w = 0; w < words; w++)
            len += (size_t)snprintf(big + len, cap - len, "%s%s", w ? " " : (s ? " " : ""),
                                    w == 0 ? "Start" : (rnd() % 3 ? "word" : "longerword"));
        len += (size_t)snprintf(big + len, cap - len, ".%s", s % 20 == 19 ? "\n\n" : "");
    }
    struct ChunkOptions co = { 64, 16 };
    struct ChunkSpan *cs;
    size_t nc;
    char err[256];
    CHECK(chunk_text(big, len, &co, &tc, &cs, &nc, err, sizeof err) == RET_OK, "chunk_text: %s", err);
    int ok = nc > 10;
    size_t max_tok = 0, overlaps = 0;
    uint64_t covered = 0;
    for (size_t i = 0; i < nc; i++) {
        size_t cnt;
        tokcount_count(&tc, big + cs[i].start, cs[i].end - cs[i].start, &cnt);
        max_tok = cnt > max_tok ? cnt : max_tok;
        ok &= cs[i].end > cs[i].start && cs[i].end <= len;
        ok &= big[cs[i].start] != ' ' && big[cs[i].end - 1] != ' ';
        if (i) {
            ok &= cs[i].start > cs[i - 1].start && cs[i].end > cs[i - 1].end;
            overlaps += cs[i].start < cs[i - 1].end;
            ok &= cs[i].start <= cs[i - 1].end + 4; /* nothing but whitespace is skipped */
        }
        covered = cs[i].end;
    }
    CHECK(ok, "chunk spans must be ordered, trimmed, progressing and contiguous");
    CHECK(max_tok <= 64 + 2, "largest chunk has %zu tokens (target 64)", max_tok);
    CHECK(overlaps > 0, "overlap of 16 tokens produced no overlapping chunks");
    size_t trimmed = len;
    while (trimmed && (big[trimmed - 1] == '\n' || big[trimmed - 1] == ' '))
        trimmed--;
    CHECK(covered == trimmed, "chunks cover the text (%llu of %zu)", (unsigned long long)covered, trimmed);
    printf("chunker: %zu chunks of <= %zu tokens (target 64, overlap 16), %zu overlapping\n", nc, max_tok, overlaps);
    free(cs);

    co.overlap_tokens = 0;
    CHECK(chunk_text("   \n\n ", 6, &co, &tc, &cs, &nc, err, sizeof err) == RET_OK && nc == 0, "blank text: 0 chunks");
    free(cs);
    CHECK(chunk_text("x", 1, &co, &tc, &cs, &nc, err, sizeof err) == RET_OK && nc == 1 && cs[0].end == 1, "one byte");
    free(cs);
    /* A single word longer than the target is cut at character boundaries. */
    char word[3000];
    for (int i = 0; i < 1000; i++)
        memcpy(word + 3 * i, "\xe6\x9d\xb1", 3);
    CHECK(chunk_text(word, 3000, &co, &tc, &cs, &nc, err, sizeof err) == RET_OK && nc > 1, "long word split");
    ok = 1;
    for (size_t i = 0; i < nc; i++)
        ok &= utf8_valid(word + cs[i].start, cs[i].end - cs[i].start, NULL);
    CHECK(ok, "long word pieces are valid UTF-8");
    free(cs);
    struct ChunkOptions badopt = { 8, 0 };
    CHECK(chunk_text("x", 1, &badopt, &tc, &cs, &nc, err, sizeof err) == RET_EINPUT, "tiny target refused");
    free(big);
}

/* ---- simple counter, term bag, JSON ------------------------------------------------------ */

static void test_misc(void)
{
    struct TokenCounter tc;
    tokcount_simple(&tc);
    const char *s = "<|im_start|>user\nHello, wörld!<|im_end|>\n";
    int32_t ids[64];
    size_t n, m;
    char out[128];
    tc.encode(tc.ctx, s, strlen(s), TC_SPECIAL, ids, 64, &n);
    tc.decode(tc.ctx, ids, n, out, sizeof out, &m);
    CHECK(m == strlen(s) && memcmp(out, s, m) == 0, "simple counter round trip");
    CHECK(ids[0] == 0x7F000001, "special token recognised");
    size_t n2;
    tc.encode(tc.ctx, s, strlen(s), 0, NULL, 0, &n2);
    CHECK(n2 > n, "without TC_SPECIAL the markers are plain text (%zu vs %zu)", n2, n);

    struct TermBag b;
    termbag_init(&b);
    char w[16];
    for (int i = 0; i < 5000; i++) {
        snprintf(w, sizeof w, "t%d", i % 1000);
        termbag_add(&b, w, strlen(w), 1, NULL);
    }
    CHECK(b.n == 1000 && b.total == 5000, "termbag counts: %zu terms, %llu total", b.n, (unsigned long long)b.total);
    long f = termbag_find(&b, "t999", 4);
    CHECK(f >= 0 && b.items[f].count == 5, "termbag_find");
    termbag_sort(&b);
    int sorted = 1;
    for (size_t i = 1; i < b.n; i++) {
        size_t la = b.items[i - 1].len, lb = b.items[i].len;
        int c = memcmp(termbag_term(&b, i - 1), termbag_term(&b, i), la < lb ? la : lb);
        sorted &= c < 0 || (c == 0 && la < lb);
    }
    CHECK(sorted && termbag_find(&b, "t5", 2) >= 0, "termbag sorted and still searchable");
    termbag_free(&b);

    const char *keys[] = { "id", "title", "text" };
    char *v[3];
    size_t vl[3];
    char err[256];
    const char *good = " {\"id\": \"a\\u00e9\\ud83d\\ude00\", \"n\": [1, -2.5e3, {\"x\": null}], \"text\": \"l1\\nl2 \\\"q\\\"\", \"ok\": true} ";
    CHECK(json_object_strings(good, strlen(good), keys, 3, v, vl, err, sizeof err) == RET_OK, "json: %s", err);
    CHECK(v[0] && strcmp(v[0], "a\xc3\xa9\xf0\x9f\x98\x80") == 0 && !v[1] && v[2] && strcmp(v[2], "l1\nl2 \"q\"") == 0,
          "json values");
    for (int i = 0; i < 3; i++)
        free(v[i]);
    const char *bad[] = { "{\"id\": \"a\",}", "{\"id\": 1}", "{\"id\": \"x\", \"id\": \"y\"}", "[1]",
                          "{\"text\": \"\\ud800\"}", "{\"text\": \"a\x01\"}", "{\"a\": 01}", "{\"a\": tru}",
                          "{} x", "{\"text\": \"\xff\"}", "{\"a\": 1.}", "" };
    int all_refused = 1;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int r = json_object_strings(bad[i], strlen(bad[i]), keys, 3, v, vl, err, sizeof err);
        all_refused &= r == RET_EINPUT && !v[0] && !v[1] && !v[2];
        if (r != RET_EINPUT)
            fprintf(stderr, "accepted bad JSON: %s\n", bad[i]);
    }
    CHECK(all_refused, "malformed JSON refused");
    char deep[200];
    memset(deep, '[', 100);
    snprintf(deep, sizeof deep, "{\"a\": %.*s", 90, "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[");
    CHECK(json_object_strings(deep, strlen(deep), keys, 3, v, vl, err, sizeof err) == RET_EINPUT, "deep nesting refused");
    char deep_ok[300];
    snprintf(deep_ok, sizeof deep_ok, "{\"a\": %.*s1%.*s}", 70, deep + 6, 70,
             "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]");
    CHECK(json_object_strings(deep_ok, strlen(deep_ok), keys, 3, v, vl, err, sizeof err) == RET_EINPUT &&
          strstr(err, "at byte 69: nested deeper than 64") != NULL, "depth message: %s", err);
    CHECK((int)JSON_OK == RET_OK && (int)JSON_EINPUT == RET_EINPUT && (int)JSON_ENOMEM == RET_ENOMEM,
          "JSON codes are the retriever's");
    const char *twice = "{\"x\": 1, \"id\": \"a\", \"x\": 2}";
    CHECK(json_object_strings(twice, strlen(twice), keys, 3, v, vl, err, sizeof err) == RET_EINPUT &&
          !v[0] && strstr(err, "duplicate"), "any key twice refused: %s", err);
    const char *num = "{\"id\": 5, \"text\": \"t\"}";
    CHECK(json_object_strings(num, strlen(num), keys, 3, v, vl, err, sizeof err) == RET_EINPUT &&
          strstr(err, "\"id\" must be a string"), "non-string field: %s", err);
    const char *nul = "{\"text\": \"a\\u0000b\"}";
    CHECK(json_object_strings(nul, strlen(nul), keys, 3, v, vl, err, sizeof err) == RET_OK &&
          v[2] && vl[2] == 3 && memcmp(v[2], "a\0b", 3) == 0, "NUL escape kept with its length");
    free(v[2]);
    char *written = NULL;
    size_t written_len = 0;
    FILE *mem = open_memstream(&written, &written_len);
    json_write_string(mem, "q\"b\\n\n\x01\x7f\xc3\xa9\xff", 11);
    fclose(mem);
    CHECK(written && strcmp(written, "\"q\\\"b\\\\n\\n\\u0001\\u007f\xc3\xa9\xef\xbf\xbd\"") == 0,
          "json_write_string: %s", written ? written : "(null)");
    free(written);
}

int main(void)
{
    test_postings();
    test_bm25_hand();
    test_maxscore();
    test_analyzer();
    test_question_words();
    test_chunker();
    test_misc();
    return check_report("test_bm25");
}
