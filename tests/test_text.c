/* Unit tests of the text/ layer: the hash table (collisions, growth, clearing, the bijective
 * integer mix), UTF-8 edge cases, the Unicode classes and lowercase mapping, the word splitter
 * and word set, and the simple token counter's round trip. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check.h"
#include "text/hash.h"
#include "text/json.h"
#include "text/tokcount.h"
#include "text/unicode.h"
#include "text/utf8.h"
#include "text/words.h"

static size_t count_hash(const struct HashTable *t, uint64_t h)
{
    size_t pos, n = 0;
    for (struct HashSlot *s = hash_find(t, h, &pos); s; s = hash_next(t, h, &pos))
        n++;
    return n;
}

static void test_hash(void)
{
    struct HashTable t = {0};
    size_t pos;
    CHECK(hash_find(&t, 5, &pos) == NULL, "an unsized table finds nothing");
    CHECK(hash_insert(&t, 5, 50) != NULL && t.n == 1, "insert into an unsized table");
    /* Many keys through growth: every one found with its value, none that was not added. */
    int all = 1;
    for (uint64_t k = 0; k < 20000; k++) {
        if (!hash_insert(&t, hash_u64(k), k * 3)) all = 0;
    }
    CHECK(all && t.n == 20001, "20,000 inserts (n = %zu)", t.n);
    CHECK(t.n <= (t.mask + 1) / 2, "at most half full (%zu of %zu)", t.n, t.mask + 1);
    for (uint64_t k = 0; k < 20000; k++) {
        struct HashSlot *s = hash_find(&t, hash_u64(k), &pos);
        if (!s || s->value != k * 3 || hash_next(&t, hash_u64(k), &pos)) all = 0;
    }
    CHECK(all, "each key found once with its value");
    CHECK(hash_find(&t, hash_u64(20000), &pos) == NULL, "absent key");
    /* Equal hashes (the caller tells the keys apart): every slot is walked. */
    for (int i = 0; i < 5; i++) hash_insert(&t, 77, (uint64_t)i);
    CHECK(count_hash(&t, 77) == 5, "five slots of one hash walked: %zu", count_hash(&t, 77));
    size_t cap = t.mask + 1;
    hash_clear(&t);
    CHECK(t.n == 0 && t.mask + 1 == cap && count_hash(&t, 77) == 0 && count_hash(&t, 5) == 0,
          "clear keeps the size, drops the slots");
    hash_free(&t);
    hash_free(&t);
    CHECK(t.slots == NULL && t.n == 0, "free twice");

    CHECK(hash_init(&t, 1000) == 0 && t.mask + 1 == 2048, "sized for 1000: %zu", t.mask + 1);
    hash_free(&t);
    CHECK(hash_init(&t, SIZE_MAX / 2) == -1 && t.slots == NULL, "absurd size refused");

    /* hash_u64 is a bijection: no two of these keys collide; only UINT64_MAX is HASH_EMPTY. */
    CHECK(hash_u64(UINT64_MAX) == HASH_EMPTY && hash_u64(0) != HASH_EMPTY, "hash_u64 empty key");
    struct HashTable seen = {0};
    int distinct = 1;
    for (uint64_t a = 0; a < 300; a++)
        for (uint64_t b = 0; b < 300; b++) {
            uint64_t h = hash_u64(a << 32 | b);
            if (hash_find(&seen, h, &pos)) distinct = 0;
            hash_insert(&seen, h, 0);
        }
    CHECK(distinct, "90,000 pair keys, 90,000 hashes");
    hash_free(&seen);

    /* hash_bytes: depends on every byte and on the length, never HASH_EMPTY. */
    char buf[40];
    memset(buf, 'a', sizeof buf);
    int differ = 1;
    for (size_t n = 0; n <= 32; n++) {
        uint64_t h = hash_bytes(buf, n);
        if (h == HASH_EMPTY || h == hash_bytes(buf, n + 1)) differ = 0;
        for (size_t i = 0; i < n; i++) {
            buf[i] ^= 1;
            if (hash_bytes(buf, n) == h) differ = 0;
            buf[i] ^= 1;
        }
    }
    CHECK(differ, "hash_bytes changes with each byte and with the length");
}

static void test_utf8(void)
{
    uint32_t cp;
    CHECK(utf8_decode((const unsigned char *)"\xe2\x82\xac", 3, &cp) == 3 && cp == 0x20AC, "euro");
    CHECK(utf8_decode((const unsigned char *)"\xe2\x82" "A", 3, &cp) == 2 && cp == UTF8_INVALID,
          "maximal ill-formed prefix");
    CHECK(utf8_decode((const unsigned char *)"\xc0\xaf", 2, &cp) == 1 && cp == UTF8_INVALID,
          "overlong");
    size_t bad = 99;
    CHECK(utf8_valid("ok", 2, &bad) && bad == 99, "valid leaves bad_off alone");
    CHECK(!utf8_valid("ab\xed\xa0\x80", 5, &bad) && bad == 2, "surrogate at 2");
    char out[4];
    CHECK(utf8_encode(0xD800, out) == 0 && utf8_encode(0x110000, out) == 0, "no encoding");
    CHECK(utf8_encode(0x10FFFF, out) == 4 && memcmp(out, "\xf4\x8f\xbf\xbf", 4) == 0, "U+10FFFF");
    CHECK(utf8_cut("a\xc3\xa9", 3, 2) == 1 && utf8_cut("a\xc3\xa9", 3, 3) == 3, "cut");
    CHECK(utf8_is_incomplete((const unsigned char *)"\xe2\x82", 2) &&
          !utf8_is_incomplete((const unsigned char *)"\xe2" "A", 2), "incomplete");
}

static void test_unicode(void)
{
    CHECK(unicode_class('a') == UNICODE_LETTER && unicode_class(0x0663) == UNICODE_NUMBER &&
          unicode_class(0x3000) == UNICODE_SPACE && unicode_class(0x0301) == UNICODE_OTHER &&
          unicode_class(UTF8_INVALID) == UNICODE_OTHER, "pre-tokenizer classes");
    CHECK(unicode_word_class(0x0301) == UNICODE_WORD &&
          unicode_word_class(0x4E2D) == UNICODE_IDEO &&
          unicode_word_class(0x3042) == UNICODE_IDEO && unicode_word_class(0x2019) == UNICODE_SEP &&
          unicode_word_class(0xD800) == UNICODE_SEP &&
          unicode_word_class(UTF8_INVALID) == UNICODE_SEP, "word classes");
    CHECK(unicode_lower('Q') == 'q' && unicode_lower(0x0130) == 'i' &&
          unicode_lower(0x0100) == 0x0101 &&
          unicode_lower(0x0101) == 0x0101 && unicode_lower(0x10400) == 0x10428 &&
          unicode_lower(UTF8_INVALID) == UTF8_INVALID, "lowercase");
    CHECK(strcmp(unicode_tables_version(), "14.0.0") == 0, "tables %s", unicode_tables_version());
}

struct Got { char text[256]; size_t n; };

static int got_word(void *ctx, const struct Word *w)
{
    struct Got *g = ctx;
    size_t used = strlen(g->text);
    snprintf(g->text + used, sizeof g->text - used, "%s%.*s@%zu%s%s",
             g->n ? "|" : "", (int)w->lower_len, w->lower, w->start,
             w->capital ? "C" : "", w->digit ? "D" : "");
    g->n++;
    return 0;
}

static void test_words(void)
{
    struct Got g = {{0}, 0};
    const char *t = "Don't stop: \xe4\xb8\xad\xe6\x96\x87 \xc3\x89t\xc3\xa9 x\xff" "y Norman's B2";
    words_split(t, strlen(t), got_word, &g);
    CHECK(strcmp(g.text, "dont@0C|stop@6|\xe4\xb8\xad@12|\xe6\x96\x87@15|\xc3\xa9t\xc3\xa9@19C|"
                         "x@25|y@27|norman@29C|b2@38CD") == 0, "words: %s", g.text);
    struct WordSet *ws = NULL;
    CHECK(words_set_new(&ws) == 0, "set");
    CHECK(words_set_add_text(ws, t, strlen(t)) == 0 && words_set_size(ws) == 9, "size %zu",
          words_set_size(ws));
    CHECK(words_set_has(ws, "norman", 6) && words_set_has(ws, "\xe4\xb8\xad", 3) &&
          !words_set_has(ws, "Norman", 6) && !words_set_has(ws, "norman's", 8), "lookups");
    words_set_destroy(&ws);
    words_set_destroy(&ws);
    CHECK(ws == NULL, "destroyed");
}

static void test_tokcount(void)
{
    struct TokenCounter tc;
    tokcount_simple(&tc);
    const char *t = "<|im_start|>user\nHello,  world<|im_end|>";
    int32_t *ids = NULL;
    size_t n = 0, cnt = 0;
    CHECK(tokcount_encode_alloc(&tc, t, strlen(t), TC_SPECIAL, &ids, &n) == TOKCOUNT_OK && n > 2,
          "encode");
    char out[128];
    size_t len = 0;
    CHECK(tc.decode(tc.ctx, ids, n, out, sizeof out, &len) == 0 && len == strlen(t) &&
          memcmp(out, t, len) == 0, "round trip");
    free(ids);
    CHECK(tokcount_count(&tc, "abcdef gh", 9, &cnt) == TOKCOUNT_OK && cnt == 3, "count %zu", cnt);
    int32_t bogus = 0x05000000;
    CHECK(tc.decode(tc.ctx, &bogus, 1, out, sizeof out, &len) == TOKCOUNT_EINPUT, "bad id");
}

/* json_measure counts what jansson would build, checked against the tree json_parse builds. */
static size_t tree_values(json_t *v)
{
    size_t n = 1, i;
    const char *k;
    json_t *e;
    if (json_is_object(v))
        json_object_foreach(v, k, e) n += 1 + tree_values(e);   /* the key, the value */
    else if (json_is_array(v))
        json_array_foreach(v, i, e) n += tree_values(e);
    return n;
}

static void test_json_measure(void)
{
    static const char *const texts[] = {
        "{}", "[{},{},[]]", "0", " -1.5e+3 ", "[true,false,null,\"x\"]",
        "{\"a\\\"}\":[1,{\"b\":\"]}\\\\\"},\"c\"]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi [1] {x}\"}],\"n\":1}",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        json_t *root = NULL;
        char err[128];
        CHECK(json_parse(texts[i], strlen(texts[i]), 8, &root, err, sizeof err) == JSON_OK,
              "%s: %s", texts[i], err);
        size_t want = root ? tree_values(root) : 0, got = json_measure(texts[i], strlen(texts[i]), 1000);
        CHECK(got == want, "%s: measured %zu values, the tree has %zu", texts[i], got, want);
        json_decref(root);
    }
    /* it stops one past the limit, and counts a malformed text as far as its tokens go */
    CHECK(json_measure("[{},{},{},{},{}]", 16, 3) == 4, "stops past the limit");
    CHECK(json_measure("[[[", 3, 100) == 3 && json_measure("\"open", 5, 100) == 1 &&
          json_measure("", 0, 100) == 0, "malformed");
}

int main(void)
{
    test_hash();
    test_utf8();
    test_unicode();
    test_words();
    test_tokcount();
    test_json_measure();
    return check_report("test_text");
}
