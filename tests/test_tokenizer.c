/* Tokenizer tests. With no arguments: unit tests over small vocabularies built in memory, over
 * SmolLM2's (BOS, special tokens, chat format, streaming, invalid UTF-8, long words) and over
 * Qwen2.5-Coder's (its pre-tokenizer on known pieces and random input, specials, default system
 * message, load and encoding speed printed). With arguments it is the C side of
 * tests/test_tokenizer.py (see usage()). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "text/unicode.h"
#include "text/utf8.h"
#include "tests/check.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define QWEN_MODEL "models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- growable byte buffer -------------------------------------------------------------- */

struct Buf { char *p; size_t n, cap; };

static void buf_put(struct Buf *b, const void *s, size_t n)
{
    if (n == 0) return;   /* nothing to copy (and b->p may still be NULL) */
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void buf_u32(struct Buf *b, uint32_t v) { buf_put(b, &v, 4); }
static void buf_u64(struct Buf *b, uint64_t v) { buf_put(b, &v, 8); }
static void buf_gstr(struct Buf *b, const char *s, size_t n) { buf_u64(b, n); buf_put(b, s, n); }

/* ---- tiny GGUF files built in memory (little-endian hosts) ------------------------------- */

struct MiniGguf { struct Buf kv; uint64_t n_kv; };

static void mg_key(struct MiniGguf *m, const char *key, uint32_t type)
{
    buf_gstr(&m->kv, key, strlen(key));
    buf_u32(&m->kv, type);
    m->n_kv++;
}

static void mg_str(struct MiniGguf *m, const char *key, const char *val)
{
    mg_key(m, key, GGUF_TYPE_STRING);
    buf_gstr(&m->kv, val, strlen(val));
}

static void mg_u32(struct MiniGguf *m, const char *key, uint32_t v)
{
    mg_key(m, key, GGUF_TYPE_UINT32);
    buf_u32(&m->kv, v);
}

static void mg_bool(struct MiniGguf *m, const char *key, int v)
{
    mg_key(m, key, GGUF_TYPE_BOOL);
    uint8_t b = (uint8_t)(v != 0);
    buf_put(&m->kv, &b, 1);
}

static void mg_strs(struct MiniGguf *m, const char *key, char **v, size_t n)
{
    mg_key(m, key, GGUF_TYPE_ARRAY);
    buf_u32(&m->kv, GGUF_TYPE_STRING);
    buf_u64(&m->kv, n);
    for (size_t i = 0; i < n; i++) buf_gstr(&m->kv, v[i], strlen(v[i]));
}

static void mg_i32s(struct MiniGguf *m, const char *key, const int32_t *v, size_t n)
{
    mg_key(m, key, GGUF_TYPE_ARRAY);
    buf_u32(&m->kv, GGUF_TYPE_INT32);
    buf_u64(&m->kv, n);
    buf_put(&m->kv, v, 4 * n);
}

static struct Buf mg_finish(struct MiniGguf *m)
{
    struct Buf f = {0};
    buf_put(&f, "GGUF", 4);
    buf_u32(&f, 3);
    buf_u64(&f, 0);
    buf_u64(&f, m->n_kv);
    buf_put(&f, m->kv.p, m->kv.n);
    static const char zeros[32];
    buf_put(&f, zeros, (32 - f.n % 32) % 32);
    free(m->kv.p);
    return f;
}

/* GPT-2 byte-level text of one byte, as the converters write token strings. */
static void byte_token(unsigned b, char out[4])
{
    int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    uint32_t cp = b;
    if (!printable) {
        cp = 256;
        for (unsigned x = 0; x < b; x++)
            if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) cp++;
    }
    size_t k = utf8_encode(cp, out);
    out[k] = 0;
}

struct MiniVocabOpts {
    const char *model, *pre;
    int add_bos;          /* -1: key absent */
    int drop_byte;        /* >= 0: leave this byte's token out */
    int bad_merge;        /* add a merge naming an unknown token */
    const char *chat_template;
};

/* Vocabulary: 0 "<s>", 1 "</s>", 2 "<|im_end|>" (control), 3 "<tool>", 4 "<tool>!"
 * (user-defined), then the 256 byte tokens (id NSP + byte), then "ab", "abc", "Ġa", "12",
 * "Ġb". */
#define NSP 5
static int mini_tokenizer(const struct MiniVocabOpts *o, struct Buf *file, struct GgufFile **g,
                          struct Tokenizer **t, char *err, size_t errlen)
{
    char *toks[300];
    int32_t types[300];
    char bytes[256][4];
    size_t n = 0;
    const char *specials[NSP] = {"<s>", "</s>", "<|im_end|>", "<tool>", "<tool>!"};
    for (int i = 0; i < NSP; i++) { toks[n] = (char *)specials[i]; types[n++] = i < 3 ? 3 : 4; }
    for (unsigned b = 0; b < 256; b++) {
        byte_token(b, bytes[b]);
        if ((int)b == o->drop_byte) continue;
        toks[n] = bytes[b];
        types[n++] = 1;
    }
    const char *extra[] = {"ab", "abc", "\xc4\xa0" "a", "12", "\xc4\xa0" "b"};
    for (int i = 0; i < 5; i++) { toks[n] = (char *)extra[i]; types[n++] = 1; }
    char *merges[] = {"a b", "ab c", "\xc4\xa0 a", "1 2", "\xc4\xa0 b", "x zz"};
    size_t n_merges = o->bad_merge ? 6 : 5;

    struct MiniGguf m = {0};
    mg_str(&m, "general.architecture", "llama");
    mg_str(&m, "tokenizer.ggml.model", o->model ? o->model : "gpt2");
    if (o->pre) mg_str(&m, "tokenizer.ggml.pre", o->pre);
    mg_strs(&m, "tokenizer.ggml.tokens", toks, n);
    mg_i32s(&m, "tokenizer.ggml.token_type", types, n);
    mg_strs(&m, "tokenizer.ggml.merges", merges, n_merges);
    mg_u32(&m, "tokenizer.ggml.bos_token_id", 0);
    mg_u32(&m, "tokenizer.ggml.eos_token_id", 1);
    if (o->add_bos >= 0) mg_bool(&m, "tokenizer.ggml.add_bos_token", o->add_bos);
    if (o->chat_template) mg_str(&m, "tokenizer.chat_template", o->chat_template);
    *file = mg_finish(&m);
    *t = NULL;
    int rc = gguf_open_buffer(file->p, file->n, "mini.gguf", g, err, errlen);
    if (rc != GGUF_OK) {
        fprintf(stderr, "gguf_open_buffer: %s\n", err);
        return -100;
    }
    return tok_load_gguf(*g, t, err, errlen);
}

static size_t encode(const struct Tokenizer *t, const char *s, size_t len, unsigned flags,
                     int32_t *ids, size_t cap)
{
    size_t n = 0;
    int rc = tok_encode(t, s, len, flags, ids, cap, &n);
    CHECK(rc == TOK_OK, "tok_encode returned %d", rc);
    return n;
}

static int ids_equal(const int32_t *a, size_t na, const int32_t *b, size_t nb)
{
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}

static void test_mini_vocab(void)
{
    char err[256];
    struct Buf file;
    struct GgufFile *g = NULL;
    struct Tokenizer *t = NULL;
    int32_t ids[64];

    /* gpt2 pre-tokenizer: digits merge; add_bos_token true. */
    struct MiniVocabOpts o = {.pre = "gpt2", .add_bos = 1, .drop_byte = -1};
    int rc = mini_tokenizer(&o, &file, &g, &t, err, sizeof err);
    CHECK(rc == TOK_OK, "load: %d %s", rc, err);
    if (rc == TOK_OK) {
        int32_t v = tok_n_vocab(t);
        CHECK(v == NSP + 256 + 5, "n_vocab %d", v);
        int32_t ab = v - 5, abc = v - 4, d12 = v - 2, sp_b = v - 1, sp = NSP + ' ';
        /* Pre-tokens "abc", " ab", " 12"; "a b" outranks "Ġ a", and no merge joins Ġ to "12". */
        size_t n = encode(t, "abc ab 12", 9, 0, ids, 64);
        int32_t want[] = {abc, sp, ab, sp, d12};
        CHECK(ids_equal(ids, n, want, 5), "gpt2 ids n=%zu: %d %d %d %d %d", n, ids[0], ids[1],
              ids[2], ids[3], ids[4]);
        n = encode(t, "ab", 2, TOK_ADD_BOS, ids, 64);
        CHECK(n == 2 && ids[0] == 0 && ids[1] == ab, "ADD_BOS with add_bos_token=true: n=%zu", n);
        n = encode(t, "", 0, TOK_ADD_BOS, ids, 64);
        CHECK(n == 1 && ids[0] == 0, "empty text + BOS: n=%zu", n);
        n = encode(t, "ab", 2, 0, ids, 64);
        CHECK(n == 1 && ids[0] == ab, "no flag, no BOS: n=%zu", n);
        /* Specials, longest first: control ones only when asked, user-defined ones always. */
        const char *txt = "a<tool>b<tool>!</s><|im_end|> b<s";
        n = encode(t, txt, strlen(txt), TOK_PARSE_SPECIAL, ids, 64);
        int32_t want_sp[] = {NSP + 'a', 3, NSP + 'b', 4, 1, 2, sp_b, NSP + '<', NSP + 's'};
        CHECK(ids_equal(ids, n, want_sp, 9), "special parse n=%zu", n);
        n = encode(t, txt, strlen(txt), 0, ids, 64);
        int has_control = 0;
        for (size_t i = 0; i < n && i < 64; i++) has_control |= ids[i] < 3;
        CHECK(!has_control && n > 9 && n <= 64 && ids[0] == NSP + 'a' && ids[1] == 3 &&
              ids[2] == NSP + 'b' && ids[3] == 4, "control tokens as text: n=%zu", n);
        CHECK(tok_is_end(t, 1) && tok_is_end(t, 2) && !tok_is_end(t, 0) && !tok_is_end(t, 3),
              "end ids");
        CHECK(tok_is_special(t, 0) && !tok_is_special(t, 3) && !tok_is_special(t, ab), "special");
        /* Chat without a template in the file: ChatML, no default system, TOK_OK. */
        struct ChatMessage msg = {CHAT_USER, "hi", 2};
        char chat[128];
        size_t cn;
        rc = tok_chat_format(t, &msg, 1, 1, chat, sizeof chat, &cn);
        const char *want_chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        CHECK(rc == TOK_OK && strcmp(chat, want_chat) == 0 && cn == strlen(want_chat),
              "chat without template: rc=%d \"%s\"", rc, chat);
    }
    tok_destroy(&t);
    CHECK(t == NULL, "tok_destroy NULLs the pointer");
    tok_destroy(&t);
    gguf_close(&g);
    free(file.p);

    /* smollm: every digit on its own; add_bos_token absent means no BOS. */
    o = (struct MiniVocabOpts){.pre = "smollm", .add_bos = -1, .drop_byte = -1};
    rc = mini_tokenizer(&o, &file, &g, &t, err, sizeof err);
    CHECK(rc == TOK_OK, "load smollm: %d %s", rc, err);
    if (rc == TOK_OK) {
        size_t n = encode(t, "x 12", 4, TOK_ADD_BOS, ids, 64);
        int32_t want[] = {NSP + 'x', NSP + ' ', NSP + '1', NSP + '2'};
        CHECK(ids_equal(ids, n, want, 4), "smollm digits n=%zu", n);
    }
    tok_destroy(&t);
    gguf_close(&g);
    free(file.p);

    /* Non-ChatML template: ChatML text is still produced, flagged TOK_EUNSUPPORTED. */
    o = (struct MiniVocabOpts){.pre = "default", .add_bos = 0, .drop_byte = -1,
                               .chat_template = "{% for m in messages %}[INST] {{ m.content }}"};
    rc = mini_tokenizer(&o, &file, &g, &t, err, sizeof err);
    CHECK(rc == TOK_OK, "load default: %d %s", rc, err);
    if (rc == TOK_OK) {
        struct ChatMessage msg = {CHAT_ASSISTANT, "ok", 2};
        char chat[64];
        size_t cn;
        rc = tok_chat_format(t, &msg, 1, 0, chat, sizeof chat, &cn);
        CHECK(rc == TOK_EUNSUPPORTED && strcmp(chat, "<|im_start|>assistant\nok<|im_end|>\n") == 0,
              "fallback chat rc=%d \"%s\"", rc, chat);
        msg.role = (enum ChatRole)7;
        CHECK(tok_chat_format(t, &msg, 1, 0, chat, sizeof chat, &cn) == TOK_EINPUT, "bad role");
    }
    tok_destroy(&t);
    gguf_close(&g);
    free(file.p);

    /* A default system message written with escapes, after a non-literal system turn. */
    o = (struct MiniVocabOpts){.pre = "gpt2", .add_bos = 0, .drop_byte = -1, .chat_template =
        "{% if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]"
        "['content'] + '<|im_end|>\\n' }}{% else %}{{ '<|im_start|>system\\nYou are Q, "
        "\\'a\\' helper.<|im_end|>\\n' }}{% endif %}<|im_start|>"};
    rc = mini_tokenizer(&o, &file, &g, &t, err, sizeof err);
    CHECK(rc == TOK_OK, "load escaped template: %d %s", rc, err);
    if (rc == TOK_OK) {
        struct ChatMessage msg = {CHAT_USER, "hi", 2};
        char chat[128];
        size_t cn;
        rc = tok_chat_format(t, &msg, 1, 0, chat, sizeof chat, &cn);
        CHECK(rc == TOK_OK && strcmp(chat, "<|im_start|>system\nYou are Q, 'a' helper.<|im_end|>"
                                           "\n<|im_start|>user\nhi<|im_end|>\n") == 0,
              "escaped default system rc=%d \"%s\"", rc, chat);
    }
    tok_destroy(&t);
    gguf_close(&g);
    free(file.p);

    /* A byte without a token is dropped. */
    o = (struct MiniVocabOpts){.pre = "gpt2", .add_bos = 0, .drop_byte = 0x04};
    rc = mini_tokenizer(&o, &file, &g, &t, err, sizeof err);
    CHECK(rc == TOK_OK, "load without byte 0x04: %d %s", rc, err);
    if (rc == TOK_OK) {
        size_t n = encode(t, "a\x04" "b\x04", 4, 0, ids, 64);
        /* Byte ids past 0x04 shift down by one. */
        CHECK(n == 2 && ids[0] == NSP + 'a' - 1 && ids[1] == NSP + 'b' - 1, "a<04>b<04>: n=%zu", n);
    }
    tok_destroy(&t);
    gguf_close(&g);
    free(file.p);

    /* Refusals carry a message naming the problem. */
    struct { struct MiniVocabOpts o; int want; const char *needle; } bad[] = {
        {{.pre = "llama-bpe", .add_bos = 0, .drop_byte = -1}, TOK_EUNSUPPORTED, "llama-bpe"},
        {{.model = "llama", .pre = "gpt2", .add_bos = 0, .drop_byte = -1}, TOK_EUNSUPPORTED,
         "llama"},
        {{.pre = "gpt2", .add_bos = 0, .drop_byte = 'A'}, TOK_EFORMAT, "0x41"},
        {{.pre = "gpt2", .add_bos = 0, .drop_byte = -1, .bad_merge = 1}, TOK_EFORMAT, "x zz"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        rc = mini_tokenizer(&bad[i].o, &file, &g, &t, err, sizeof err);
        CHECK(rc == bad[i].want && t == NULL && strstr(err, bad[i].needle),
              "refusal %zu: rc=%d err=\"%s\"", i, rc, err);
        printf("refused as expected: %s\n", err);
        tok_destroy(&t);
        gguf_close(&g);
        free(file.p);
    }
}

/* ---- default model --------------------------------------------------------------------- */

static void test_model_basics(const struct Tokenizer *t)
{
    int32_t ids[256];
    CHECK(tok_n_vocab(t) == 49152, "n_vocab %d", tok_n_vocab(t));
    CHECK(tok_bos(t) == 1 && tok_eos(t) == 2, "bos %d eos %d", tok_bos(t), tok_eos(t));
    CHECK(tok_is_end(t, 2) && tok_is_end(t, 0) && !tok_is_end(t, 1) && !tok_is_end(t, 100),
          "end tokens");
    CHECK(tok_is_special(t, 0) && tok_is_special(t, 16) && !tok_is_special(t, 17), "specials");

    /* Empty input: nothing, with or without flags (the file says add_bos_token = false). */
    size_t n = 99;
    CHECK(tok_encode(t, NULL, 0, TOK_ADD_BOS | TOK_PARSE_SPECIAL, NULL, 0, &n) == TOK_OK && n == 0,
          "empty input n=%zu", n);
    CHECK(tok_encode(t, NULL, 3, 0, ids, 256, &n) == TOK_EINPUT, "NULL text with len > 0");
    n = encode(t, "Hello", 5, TOK_ADD_BOS, ids, 256);
    CHECK(n >= 1 && ids[0] != tok_bos(t), "add_bos_token=false: no BOS (first id %d)", ids[0]);
    char dec[64];
    size_t dn = 99;
    CHECK(tok_decode(t, NULL, 0, dec, sizeof dec, &dn) == TOK_OK && dn == 0, "decode empty");
    int32_t bad_id = 49152;
    CHECK(tok_decode(t, &bad_id, 1, dec, sizeof dec, &dn) == TOK_ERANGE, "decode bad id");
    CHECK(tok_piece(t, -1, &dn) == NULL && tok_piece(t, 49152, NULL) == NULL, "piece range");

    /* Sizing convention: cap 0 counts, a short buffer truncates but reports the full count. */
    const char *s = "The quick brown fox jumps over the lazy dog.";
    size_t full = encode(t, s, strlen(s), 0, NULL, 0);
    size_t part = encode(t, s, strlen(s), 0, ids, 3);
    CHECK(full == part && full > 3, "count %zu vs %zu", full, part);
    printf("\"%s\" -> %zu tokens\n", s, full);

    /* Special tokens: parsed only with TOK_PARSE_SPECIAL. */
    const char *chat = "<|im_start|>user\nHi<|im_end|><|im_end|x";
    n = encode(t, chat, strlen(chat), TOK_PARSE_SPECIAL, ids, 256);
    CHECK(n >= 5 && ids[0] == 1 && ids[n - 1] != 2, "special parse: n=%zu first=%d", n, ids[0]);
    int n_end = 0;
    for (size_t i = 0; i < n; i++) n_end += ids[i] == 2;
    CHECK(n_end == 1, "one <|im_end|> parsed, the broken one is text (%d)", n_end);
    n = encode(t, chat, strlen(chat), 0, ids, 256);
    int any = 0;
    for (size_t i = 0; i < n; i++) any |= tok_is_special(t, ids[i]);
    CHECK(!any, "no special ids without TOK_PARSE_SPECIAL");
    CHECK(tok_decode(t, ids, n, dec, sizeof dec, &dn) == TOK_OK && dn == strlen(chat) &&
          memcmp(dec, chat, dn) == 0, "special text round trip");
    size_t pl;
    const char *p = tok_piece(t, 2, &pl);
    CHECK(p && pl == 10 && memcmp(p, "<|im_end|>", 10) == 0, "control piece is its text");
    p = tok_piece(t, 17, &pl);
    CHECK(p && pl == 1 && p[0] == '!', "piece 17");
}

static void test_invalid_utf8_generic(const struct Tokenizer *t)
{
    /* Stray continuation, truncated sequences, a surrogate, past U+10FFFF, an overlong form
     * (0xE0 0x80 0xAF): all bytes the vocabulary has tokens for. */
    static const char s[] = "ok\x80" "abc\xe2\x82 \xc3(\x80\xed\xa0\x80" "z\xf4\x90\x80\x80"
                            "\xe0\x80\xaf end\xe2\x82";
    size_t len = sizeof s - 1;
    int32_t ids[128];
    size_t n = encode(t, s, len, TOK_PARSE_SPECIAL, ids, 128);
    char dec[128];
    size_t dn;
    CHECK(tok_decode(t, ids, n, dec, sizeof dec, &dn) == TOK_OK && dn == len &&
          memcmp(dec, s, len) == 0, "invalid UTF-8 round trip (%zu bytes back of %zu)", dn, len);
    /* Each ill-formed byte is its own byte token. */
    int n_single = 0;
    for (size_t i = 0; i < n; i++) {
        size_t pl;
        const char *p = tok_piece(t, ids[i], &pl);
        n_single += pl == 1 && (unsigned char)p[0] >= 0x80;
    }
    CHECK(n_single == 17, "%d ill-formed bytes as byte tokens, want 17", n_single);
    printf("invalid UTF-8: %zu bytes -> %zu tokens, round trip ok\n", len, n);
}

static void test_invalid_utf8(const struct Tokenizer *t)
{
    test_invalid_utf8_generic(t);
    int32_t ids[128];
    char dec[128];
    size_t n, dn;
    /* SmolLM2 has no token for 0xFF, 0xC0 or U+0004: they are dropped. */
    static const char d[] = "ok\xff\xc0ok!\x04!";
    n = encode(t, d, sizeof d - 1, 0, ids, 128);
    CHECK(tok_decode(t, ids, n, dec, sizeof dec, &dn) == TOK_OK && dn == 6 &&
          memcmp(dec, "okok!!", 6) == 0, "bytes without tokens dropped (%zu)", dn);
    /* ...and the bytes around the gap merge as if it were not there. */
    int32_t gap[8], plain[8];
    size_t ng = encode(t, "!\x04!", 3, 0, gap, 8), np = encode(t, "!!", 2, 0, plain, 8);
    CHECK(np == 1 && ids_equal(gap, ng, plain, np), "!<04>! gives %zu tokens, !! %zu", ng, np);
}

static void test_stream(const struct Tokenizer *t)
{
    /* Find a multi-byte character the vocabulary splits across tokens. */
    static const char *cands[] = {"\xf0\x9f\xa6\x99", "\xf0\x9f\xa7\xa9", "\xf0\x9f\xaa\x90",
                                  "\xf0\x90\x8d\x88", "\xe2\xbf\xb0"};
    const char *ch = NULL;
    int32_t ids[16];
    size_t n = 0;
    for (size_t c = 0; c < sizeof cands / sizeof cands[0] && !ch; c++) {
        n = encode(t, cands[c], strlen(cands[c]), 0, ids, 16);
        if (n >= 2) ch = cands[c];
    }
    CHECK(ch != NULL, "no candidate character splits across tokens");
    if (!ch) return;
    uint32_t cp;
    utf8_decode((const unsigned char *)ch, strlen(ch), &cp);
    printf("stream: U+%04X splits into %zu tokens\n", (unsigned)cp, n);
    struct TokStream st;
    tok_stream_init(&st, t);
    char out[512], all[64];
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int w = tok_stream_feed(&st, ids[i], out, sizeof out);
        CHECK(w >= 0, "feed %zu: %d", i, w);
        if (i + 1 < n) CHECK(w == 0, "incomplete sequence emitted early (%d bytes)", w);
        if (w > 0) { memcpy(all + total, out, (size_t)w); total += (size_t)w; }
    }
    CHECK(total == strlen(ch) && memcmp(all, ch, total) == 0, "stream reassembles (%zu)", total);
    CHECK(tok_stream_flush(&st, out, sizeof out) == 0, "nothing left to flush");

    /* A truncated sequence at the end becomes U+FFFD on flush. */
    tok_stream_init(&st, t);
    int w = tok_stream_feed(&st, ids[0], out, sizeof out);
    CHECK(w == 0 && st.n_pending > 0, "held back: %d", w);
    w = tok_stream_flush(&st, out, 2);
    CHECK(w == TOK_ERANGE && st.n_pending > 0, "flush into 2 bytes refused");
    w = tok_stream_flush(&st, out, sizeof out);
    CHECK(w == 3 && memcmp(out, "\xef\xbf\xbd", 3) == 0, "flush gives U+FFFD (%d)", w);

    /* The start of a sequence followed by ASCII: U+FFFD then the text; a stray byte too. */
    tok_stream_init(&st, t);
    w = tok_stream_feed(&st, ids[0], out, sizeof out);
    int32_t a_ids[4];
    size_t an = encode(t, "A", 1, 0, a_ids, 4);
    w = an == 1 ? tok_stream_feed(&st, a_ids[0], out, sizeof out) : -1;
    CHECK(w == 4 && memcmp(out, "\xef\xbf\xbd" "A", 4) == 0, "broken sequence then A (%d)", w);
    int32_t cont[4];
    an = encode(t, "\x80", 1, 0, cont, 4);
    w = an == 1 ? tok_stream_feed(&st, cont[0], out, sizeof out) : -1;
    CHECK(w == 3 && memcmp(out, "\xef\xbf\xbd", 3) == 0, "stray 0x80 (%d)", w);
    /* Too small a buffer leaves the stream unchanged. */
    int32_t hello[8];
    an = encode(t, " Hello", 6, 0, hello, 8);
    w = tok_stream_feed(&st, hello[0], out, 2);
    CHECK(an == 1 && w == TOK_ERANGE, "short buffer refused (%d)", w);
    w = tok_stream_feed(&st, hello[0], out, sizeof out);
    CHECK(w == 6 && memcmp(out, " Hello", 6) == 0, "retry fits (%d)", w);
    CHECK(tok_stream_feed(&st, -5, out, sizeof out) == TOK_ERANGE, "bad id");
    size_t need = 3 * (tok_max_piece_len(t) + 3);
    printf("stream: max piece %zu bytes, buffer bound %zu\n", tok_max_piece_len(t), need);
    CHECK(need <= 512, "bound %zu fits the 512-byte buffers callers use", need);
}

/* Random bytes, mostly ill-formed UTF-8: decode(encode(x)) is x without the bytes that have no
 * token, and the stream's output is always valid UTF-8. */
static void test_random_bytes(const struct Tokenizer *t)
{
    uint64_t state = 0x9E3779B97F4A7C15ull;
    char text[256], dec[256], streamed[2048];
    int32_t ids[256];
    int bad_round_trip = 0, bad_stream = 0;
    size_t total = 0;
    for (int iter = 0; iter < 2000; iter++) {
        size_t len = 0, want_len = 0;
        char want[256];
        size_t n_bytes = 1 + (size_t)(iter % 200);
        for (size_t i = 0; i < n_bytes; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            unsigned r = (unsigned)(state >> 33);
            /* Bias towards bytes that start or continue sequences, and ASCII. */
            unsigned char b = (unsigned char)(r % 3 == 0 ? 0x80 + (r >> 8) % 0x80
                                              : r % 3 == 1 ? (r >> 8) % 0x80 : (r >> 8));
            text[len++] = (char)b;
            int32_t one[4];
            if (encode(t, (char *)&b, 1, 0, one, 4) == 1) want[want_len++] = (char)b;
        }
        total += len;
        size_t n = encode(t, text, len, 0, ids, 256), dn = 0;
        if (n > 256 || tok_decode(t, ids, n, dec, sizeof dec, &dn) != TOK_OK || dn != want_len ||
            memcmp(dec, want, dn) != 0)
            bad_round_trip++;
        struct TokStream st;
        tok_stream_init(&st, t);
        size_t sn = 0;
        for (size_t i = 0; i < n && i < 256; i++) {
            int w = tok_stream_feed(&st, ids[i], streamed + sn, sizeof streamed - sn);
            if (w < 0) { bad_stream++; break; }
            sn += (size_t)w;
        }
        int w = tok_stream_flush(&st, streamed + sn, sizeof streamed - sn);
        sn += w > 0 ? (size_t)w : 0;
        for (size_t i = 0; i < sn;) {
            uint32_t cp;
            i += utf8_decode((const unsigned char *)streamed + i, sn - i, &cp);
            if (cp == UTF8_INVALID) { bad_stream++; break; }
        }
    }
    CHECK(bad_round_trip == 0, "%d random byte strings did not round trip", bad_round_trip);
    CHECK(bad_stream == 0, "%d streams gave ill-formed UTF-8", bad_stream);
    printf("random bytes: 2000 strings, %zu bytes, round trip and stream ok\n", total);
}

static void test_chat(const struct Tokenizer *t)
{
    const char *sys = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                      "by Hugging Face<|im_end|>\n";
    struct ChatMessage m[3] = {{CHAT_USER, "What is 2+2?", 12},
                               {CHAT_ASSISTANT, "4", 1},
                               {CHAT_USER, "Thanks", 6}};
    char want[1024], got[1024];
    snprintf(want, sizeof want, "%s<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant"
             "\n4<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n", sys);
    size_t n = 0;
    int rc = tok_chat_format(t, m, 3, 1, NULL, 0, &n);
    CHECK(rc == TOK_OK && n == strlen(want), "sizing call rc=%d n=%zu want %zu", rc, n,
          strlen(want));
    rc = tok_chat_format(t, m, 3, 1, got, n + 1, &n);
    CHECK(rc == TOK_OK && strcmp(got, want) == 0, "default system inserted:\n%s", got);
    /* Truncation still NUL-terminates. */
    rc = tok_chat_format(t, m, 3, 1, got, 10, &n);
    CHECK(rc == TOK_OK && strlen(got) == 9 && n == strlen(want), "truncated: \"%s\"", got);

    struct ChatMessage s2[2] = {{CHAT_SYSTEM, "Be brief.", 9}, {CHAT_USER, "Hi", 2}};
    rc = tok_chat_format(t, s2, 2, 0, got, sizeof got, &n);
    const char *want2 = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n";
    CHECK(rc == TOK_OK && strcmp(got, want2) == 0, "explicit system: \"%s\"", got);
    rc = tok_chat_format(t, NULL, 0, 1, got, sizeof got, &n);
    CHECK(rc == TOK_OK && strcmp(got, "<|im_start|>assistant\n") == 0, "no messages: \"%s\"", got);

    /* The formatted prompt tokenizes with its control tokens. */
    int32_t ids[128];
    tok_chat_format(t, m, 1, 1, got, sizeof got, &n);
    size_t k = encode(t, got, n, TOK_PARSE_SPECIAL | TOK_ADD_BOS, ids, 128);
    int n_start = 0, n_end = 0;
    for (size_t i = 0; i < k && i < 128; i++) { n_start += ids[i] == 1; n_end += ids[i] == 2; }
    size_t last = 0, tail_len = 0;
    for (size_t i = 0; i < k && i < 128; i++)
        if (ids[i] == 1) last = i;
    char tail[64];
    int drc = k <= 128 ? tok_decode(t, ids + last + 1, k - last - 1, tail, sizeof tail, &tail_len)
                       : TOK_ERANGE;
    CHECK(k > 10 && k <= 128 && ids[0] == 1 && n_start == 3 && n_end == 2 && drc == TOK_OK &&
          tail_len == 10 && memcmp(tail, "assistant\n", 10) == 0,
          "chat tokens k=%zu first=%d starts=%d ends=%d", k, ids[0], n_start, n_end);
    printf("chat prompt: %zu bytes -> %zu tokens\n", n, k);
}

static void test_long_words(const struct Tokenizer *t)
{
    size_t len = 100000;
    char *s = malloc(len + 1);
    int32_t *ids = malloc(len * sizeof *ids);
    char *dec = malloc(len);
    if (!s || !ids || !dec) { CHECK(0, "out of memory"); goto done; }
    struct { const char *what; char fill; } cases[] = {{"100 KB of letters", 'a'},
                                                       {"100 KB of spaces", ' '},
                                                       {"100 KB of dots", '.'}};
    for (size_t c = 0; c < 3; c++) {
        memset(s, cases[c].fill, len);
        double t0 = now_s();
        size_t n = encode(t, s, len, 0, ids, len);
        double dt = now_s() - t0;
        size_t dn = 0;
        CHECK(n <= len && tok_decode(t, ids, n, dec, len, &dn) == TOK_OK && dn == len &&
              memcmp(dec, s, len) == 0, "%s round trip", cases[c].what);
        CHECK(dt < 2.0, "%s took %.3f s", cases[c].what, dt);
        printf("%s: %zu tokens in %.1f ms\n", cases[c].what, n, dt * 1e3);
    }
    /* 10,000 spaces then a word: the last space joins the word. */
    memset(s, ' ', 10000);
    memcpy(s + 10000, "word", 4);
    size_t n = encode(t, s, 10004, 0, ids, len);
    int32_t w[4];
    size_t wn = encode(t, " word", 5, 0, w, 4);
    CHECK(wn == 1 && n >= 2 && ids[n - 1] == w[0], "spaces then word: last id %d want %d",
          ids[n - 1], w[0]);
done:
    free(s);
    free(ids);
    free(dec);
}

static void test_unicode(void)
{
    struct { const char *s; size_t len; uint32_t cp; size_t k; } cases[] = {
        {"A", 1, 'A', 1}, {"\xc3\xa9", 2, 0xE9, 2}, {"\xe2\x82\xac", 3, 0x20AC, 3},
        {"\xf0\x9f\x98\x80", 4, 0x1F600, 4}, {"\xc0\xaf", 2, UTF8_INVALID, 1},
        {"\xe0\x80\xaf", 3, UTF8_INVALID, 1}, {"\xed\xa0\x80", 3, UTF8_INVALID, 1},
        {"\xf4\x90\x80\x80", 4, UTF8_INVALID, 1}, {"\xe2\x82", 2, UTF8_INVALID, 2},
        {"\xe2\x82" "A", 3, UTF8_INVALID, 2}, {"\x80", 1, UTF8_INVALID, 1},
        {"\xf0\x9f\x98", 3, UTF8_INVALID, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint32_t cp;
        size_t k = utf8_decode((const unsigned char *)cases[i].s, cases[i].len, &cp);
        CHECK(cp == cases[i].cp && k == cases[i].k, "decode case %zu: cp %X k %zu", i, cp, k);
    }
    CHECK(utf8_is_incomplete((const unsigned char *)"\xf0\x9f\x98", 3) &&
          !utf8_is_incomplete((const unsigned char *)"\xf0\x9f\x98\x80", 4) &&
          !utf8_is_incomplete((const unsigned char *)"\xed\xa0", 2), "incomplete");
    CHECK(unicode_class('a') == UNICODE_LETTER && unicode_class(0x4E2D) == UNICODE_LETTER &&
          unicode_class(0x0663) == UNICODE_NUMBER && unicode_class(0x00BD) == UNICODE_NUMBER &&
          unicode_class(0x3000) == UNICODE_SPACE && unicode_class(0x1C) == UNICODE_OTHER &&
          unicode_class(0x0301) == UNICODE_OTHER && unicode_class(0x1F600) == UNICODE_OTHER,
          "classes");
    printf("unicode tables: %s\n", unicode_tables_version());
}

/* ---- Qwen2.5-Coder ----------------------------------------------------------------------- */

/* The pieces text splits into under Qwen2's regex, each checked as the decoded text of the
 * tokens between boundaries: encoding each expected piece alone must give exactly the ids the
 * whole text gives at that place (the pieces are encoded independently by BPE). */
static void check_pieces(const struct Tokenizer *t, const char *text, const char *const *pieces,
                         size_t n_pieces)
{
    int32_t whole[256], one[256], joined[256];
    size_t n = encode(t, text, strlen(text), 0, whole, 256), nj = 0;
    for (size_t i = 0; i < n_pieces && nj < 256; i++) {
        size_t k = encode(t, pieces[i], strlen(pieces[i]), 0, one, 256);
        for (size_t j = 0; j < k && nj < 256; j++) joined[nj++] = one[j];
    }
    CHECK(ids_equal(whole, n, joined, nj), "pieces of \"%s\": %zu ids, pieces give %zu", text,
          n, nj);
}

static void test_qwen_pre_tokenizer(const struct Tokenizer *t)
{
    /* Token counts that only Qwen2's splitting gives: "\n\n" after text is one token, a
     * digit run is one token per digit, ".\n\n" keeps its line breaks. */
    int32_t ids[64];
    size_t n = encode(t, "Hello world", 11, 0, ids, 64);
    CHECK(n == 2 && ids[0] == 9707 && ids[1] == 1879, "Hello world: n=%zu %d %d", n, ids[0],
          ids[1]);
    n = encode(t, "2024", 4, 0, ids, 64);
    CHECK(n == 4, "digits one by one: n=%zu", n);
    static const char *const p1[] = {"foo", ".\n\n", "bar"};
    check_pieces(t, "foo.\n\nbar", p1, 3);
    static const char *const p2[] = {"a", " ", " b", "\n\n", " ", " c", "\r\n\r\n", " d"};
    check_pieces(t, "a  b\n\n  c\r\n\r\n d", p2, 8);
    static const char *const p3[] = {"(foo", ")", " ", "1", "2", "3", " x", "1"};
    check_pieces(t, "(foo) 123 x1", p3, 8);
    static const char *const p4[] = {" IT", "'S", " We", "'Re", " it", "'\xc5\xbf", " '", "ll"};
    check_pieces(t, " IT'S We'Re it'\xc5\xbf 'll", p4, 8);
    static const char *const p5[] = {"\t", "\tfoo", "  ", "\xe3\x80\x80" "bar", " \n", " x"};
    check_pieces(t, "\t\tfoo  \xe3\x80\x80" "bar \n x", p5, 6);
    static const char *const p6[] = {"  \n\n", " ", " x", " !!\n\n", "abc", " \t\n"};
    check_pieces(t, "  \n\n  x !!\n\nabc \t\n", p6, 6);
    /* An ill-formed byte stands alone and ends the whitespace before it like the text's end. */
    static const char *const p7[] = {"x", "  ", "\xff", " y"};
    check_pieces(t, "x  \xff y", p7, 4);
}

static void test_qwen_basics(const struct Tokenizer *t)
{
    CHECK(tok_n_vocab(t) == 151936, "n_vocab %d", tok_n_vocab(t));
    CHECK(tok_bos(t) == 151643 && tok_eos(t) == 151645, "bos %d eos %d", tok_bos(t), tok_eos(t));
    CHECK(tok_is_end(t, 151645) && tok_is_end(t, 151643) && !tok_is_end(t, 151644) &&
          !tok_is_end(t, 151657) && !tok_is_end(t, 9707), "end tokens: <|im_end|>, <|endoftext|>");
    CHECK(tok_is_special(t, 151644) && tok_is_special(t, 151664) && !tok_is_special(t, 151657) &&
          !tok_is_special(t, 151665) && !tok_is_special(t, 100), "control tokens");
    size_t pl = 99;
    const char *p = tok_piece(t, 151665, &pl);
    CHECK(p && pl == 0, "padding token 151665 decodes to nothing (%zu bytes)", pl);
    p = tok_piece(t, 151659, &pl);
    CHECK(p && pl == 14 && memcmp(p, "<|fim_prefix|>", 14) == 0, "fim piece");

    /* Every byte has a token: any bytes at all come back exactly. */
    for (unsigned b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        int32_t id[2];
        size_t k = encode(t, (const char *)&c, 1, 0, id, 2);
        CHECK(k == 1, "byte 0x%02X gives %zu tokens", b, k);
    }

    /* <tool_call> is user-defined: one token with or without TOK_PARSE_SPECIAL; <|im_end|>
     * only with it. No BOS (add_bos_token is false). */
    const char *s = "<tool_call>{}</tool_call><|im_end|>";
    int32_t ids[64];
    size_t n = encode(t, s, strlen(s), TOK_ADD_BOS, ids, 64);
    CHECK(n > 4 && ids[0] == 151657 && ids[n - 1] != 151645, "plain: n=%zu first %d", n, ids[0]);
    int found = 0;
    for (size_t i = 0; i < n && i < 64; i++) found += ids[i] == 151658;
    CHECK(found == 1, "</tool_call> matched without TOK_PARSE_SPECIAL");
    n = encode(t, s, strlen(s), TOK_PARSE_SPECIAL, ids, 64);
    CHECK(n == 4 && ids[0] == 151657 && ids[2] == 151658 && ids[3] == 151645,
          "parsed: n=%zu", n);

    /* The default system message, as the template writes it. */
    struct ChatMessage m = {CHAT_USER, "Hi", 2};
    char out[512];
    size_t on;
    int rc = tok_chat_format(t, &m, 1, 1, out, sizeof out, &on);
    const char *want = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                       "helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                       "<|im_start|>assistant\n";
    CHECK(rc == TOK_OK && strcmp(out, want) == 0, "chat rc=%d:\n%s", rc, out);
}

/* Random text built from the characters the regex tells apart (letters of several scripts,
 * digits, apostrophes and contraction letters, punctuation, every kind of whitespace, CR, LF,
 * emoji, ill-formed bytes, special texts), with and without TOK_PARSE_SPECIAL: at most one
 * token per byte, and decoding gives the text back byte for byte. */
static void test_qwen_random_text(const struct Tokenizer *t)
{
    static const char *const atoms[] = {
        "a", "Z", "s", "S", "t", "re", "VE", "m", "ll", "D", "'", "'", "\xc5\xbf", "1", "42",
        "\xd9\xa3", " ", " ", "  ", "\t", "\n", "\r", "\r\n", "\xc2\xa0", "\xe3\x80\x80", "\x0b",
        ".", ",", "!", "(", "}", "<", "|", "\xe2\x80\x94", "\xe4\xb8\xad", "\xd0\xb6",
        "\xd7\xa9", "\xe0\xa4\x95", "\xe0\xa4\xbf", "\xf0\x9f\x98\x80", "\xe2\x80\x8d",
        "\xf0\x9f\x8f\xbd", "\xcc\x81", "\xff", "\x80", "\xe2\x82", "\xed\xa0\x80", "<|im_end|>",
        "<tool_call>",
    };
    size_t n_atoms = sizeof atoms / sizeof atoms[0];
    uint64_t state = 0x2545F4914F6CDD1Dull;
    char text[1024], dec[1024];
    int32_t ids[1024];
    int bad = 0;
    size_t total = 0;
    for (int iter = 0; iter < 3000; iter++) {
        size_t len = 0;
        size_t n_parts = 1 + (size_t)(iter % 120);
        for (size_t i = 0; i < n_parts; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            const char *a = atoms[(state >> 33) % n_atoms];
            size_t k = strlen(a);
            if (len + k > 900) break;
            memcpy(text + len, a, k);
            len += k;
        }
        total += len;
        unsigned flags = iter % 2 ? TOK_PARSE_SPECIAL : 0;
        size_t n = encode(t, text, len, flags, ids, 1024), dn = 0;
        if (n > len || tok_decode(t, ids, n, dec, sizeof dec, &dn) != TOK_OK || dn != len ||
            memcmp(dec, text, len) != 0)
            bad++;
    }
    CHECK(bad == 0, "%d of 3000 random texts did not round trip", bad);
    printf("qwen2 random text: 3000 texts, %zu bytes, round trip ok\n", total);
}

/* A document of at least 32K tokens whose words are mostly new (random syllables of Latin,
 * Cyrillic and CJK letters between spaces, punctuation, digits, line breaks), so that the
 * encoder's word cache helps little: the encoding speed printed is a low one; the text must
 * come back. tests/test_tokenizer.py times real prose and code. */
static void test_qwen_long_document(const struct Tokenizer *t)
{
    static const char *const syll[] = {
        "ka", "ri", "to", "men", "sul", "qua", "ex", "str", "io", "ph", "th", "ng", "ae", "zy",
        "\xd0\xba\xd0\xb0", "\xd1\x80\xd0\xbe", "\xd0\xb2\xd0\xb8", "\xd1\x89\xd0\xb5",
        "\xe4\xb8\xad", "\xe6\x96\x87", "\xe5\xad\x97", "\xe8\xaf\x8d",
    };
    static const char *const sep[] = {" ", " ", " ", " ", ", ", ". ", ".\n\n", "\n", " (", ") ",
                                      "'s ", " 1", "7 ", "\t", "\r\n", "; "};
    size_t n_syll = sizeof syll / sizeof syll[0], n_sep = sizeof sep / sizeof sep[0];
    size_t cap = 600000, len = 0;
    char *text = malloc(cap), *dec = malloc(cap);
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!text || !dec || !ids) { CHECK(0, "out of memory"); goto done; }
    uint64_t state = 0x853C49E6748FEA9Bull;
    while (len < 200000) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        unsigned r = (unsigned)(state >> 33);
        for (unsigned k = 0; k < 1 + r % 4; k++) {
            const char *p = syll[(r >> (4 + 5 * k)) % n_syll];
            size_t pl = strlen(p);
            memcpy(text + len, p, pl);
            len += pl;
        }
        const char *p = sep[(r >> 25) % n_sep];
        memcpy(text + len, p, strlen(p));
        len += strlen(p);
    }
    size_t n = 0;
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        double t0 = now_s();
        n = encode(t, text, len, 0, ids, cap);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    size_t dn = 0;
    CHECK(n >= 32768 && n <= cap && tok_decode(t, ids, n, dec, cap, &dn) == TOK_OK &&
          dn == len && memcmp(dec, text, len) == 0, "long document round trip (%zu tokens)", n);
    printf("qwen2 document of random words: %zu bytes -> %zu tokens in %.1f ms (%.2f M "
           "tokens/s)\n", len, n, best * 1e3, (double)n / best / 1e6);
done:
    free(text);
    free(dec);
    free(ids);
}

static void test_qwen(void)
{
    char err[512];
    struct GgufFile *g = NULL;
    struct Tokenizer *t = NULL;
    if (gguf_open(QWEN_MODEL, &g, err, sizeof err) != GGUF_OK) {
        CHECK(0, "%s (run `make model`)", err);
        return;
    }
    double t0 = now_s();
    int rc = tok_load_gguf(g, &t, err, sizeof err);
    double dt = now_s() - t0;
    gguf_close(&g);
    CHECK(rc == TOK_OK, "load %s: %s", QWEN_MODEL, err);
    if (rc != TOK_OK) return;
    printf("qwen2: loaded %d tokens in %.1f ms\n", tok_n_vocab(t), dt * 1e3);
    test_qwen_basics(t);
    test_qwen_pre_tokenizer(t);
    test_invalid_utf8_generic(t);
    test_random_bytes(t);
    test_qwen_random_text(t);
    test_long_words(t);
    test_qwen_long_document(t);
    tok_destroy(&t);
}

/* ---- command-line modes for tests/test_tokenizer.py ---------------------------------------- */

static void usage(void)
{
    fprintf(stderr,
            "usage: test_tokenizer                      run the unit tests\n"
            "       test_tokenizer --encode MODEL [--special] [--bos] < text   ids on one line\n"
            "       test_tokenizer --encode-time MODEL < text   load and best encoding times\n"
            "       test_tokenizer --decode MODEL < ids                       bytes\n"
            "       test_tokenizer --encode-batch MODEL [--special] < records  one id line each\n"
            "       test_tokenizer --decode-batch MODEL [--stream] < id lines  records\n"
            "       test_tokenizer --chat MODEL [--gen] < records of \"ROLE LEN\\nTEXT\"\n"
            "a record is \"LEN\\n\" followed by LEN bytes\n");
}

static char *read_all(FILE *f, size_t *len)
{
    struct Buf b = {0};
    char chunk[65536];
    size_t k;
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0) buf_put(&b, chunk, k);
    buf_put(&b, "", 1);
    *len = b.n - 1;
    return b.p;
}

static int print_ids(const struct Tokenizer *t, const char *s, size_t len, unsigned flags)
{
    size_t n = 0;
    int rc = tok_encode(t, s, len, flags, NULL, 0, &n);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (rc || !ids) { free(ids); return 1; }
    rc = tok_encode(t, s, len, flags, ids, n, &n);
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    putchar('\n');
    free(ids);
    return rc != TOK_OK;
}

/* Parse space-separated ids from s (up to a newline or the end). */
static int32_t *parse_ids(const char *s, const char *end, size_t *n)
{
    size_t cap = 16;
    int32_t *ids = malloc(cap * sizeof *ids);
    *n = 0;
    while (ids && s < end) {
        char *e;
        long v = strtol(s, &e, 10);
        if (e == s) break;
        if (*n == cap) {
            cap *= 2;
            int32_t *p = realloc(ids, cap * sizeof *ids);
            if (!p) { free(ids); return NULL; }
            ids = p;
        }
        ids[(*n)++] = (int32_t)v;
        s = e;
    }
    return ids;
}

static int decode_ids(const struct Tokenizer *t, const int32_t *ids, size_t n, int stream,
                      struct Buf *out)
{
    if (!stream) {
        size_t dn = 0;
        if (tok_decode(t, ids, n, NULL, 0, &dn) != TOK_OK) return 1;
        char *d = malloc(dn ? dn : 1);
        if (!d) return 1;
        tok_decode(t, ids, n, d, dn, &dn);
        buf_put(out, d, dn);
        free(d);
        return 0;
    }
    struct TokStream st;
    tok_stream_init(&st, t);
    char piece[512];
    for (size_t i = 0; i < n; i++) {
        int w = tok_stream_feed(&st, ids[i], piece, sizeof piece);
        if (w < 0) return 1;
        buf_put(out, piece, (size_t)w);
    }
    int w = tok_stream_flush(&st, piece, sizeof piece);
    if (w < 0) return 1;
    buf_put(out, piece, (size_t)w);
    return 0;
}

static int run_cli(int argc, char **argv)
{
    const char *mode = argv[1], *path = argc > 2 ? argv[2] : NULL;
    unsigned flags = 0;
    int stream = 0, gen = 0;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--special")) flags |= TOK_PARSE_SPECIAL;
        else if (!strcmp(argv[i], "--bos")) flags |= TOK_ADD_BOS;
        else if (!strcmp(argv[i], "--stream")) stream = 1;
        else if (!strcmp(argv[i], "--gen")) gen = 1;
        else { usage(); return 2; }
    }
    if (!path) { usage(); return 2; }
    char err[512];
    struct GgufFile *g = NULL;
    struct Tokenizer *t = NULL;
    double t0 = now_s();
    if (gguf_open(path, &g, err, sizeof err) != GGUF_OK ||
        tok_load_gguf(g, &t, err, sizeof err) != TOK_OK) {
        fprintf(stderr, "%s\n", err);
        gguf_close(&g);
        return 1;
    }
    double load_s = now_s() - t0;
    size_t len;
    char *in = read_all(stdin, &len);
    char *end = in + len;
    int rc = 0;
    struct Buf out = {0};
    if (!strcmp(mode, "--encode")) {
        rc = print_ids(t, in, len, flags);
    } else if (!strcmp(mode, "--encode-time")) {
        /* Load time, then the fastest of 5 encodings of the whole input. */
        size_t n = 0;
        rc = tok_encode(t, in, len, flags, NULL, 0, &n) != TOK_OK;
        int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
        double best = 1e9;
        for (int r = 0; r < 5 && ids && !rc; r++) {
            double t1 = now_s();
            rc = tok_encode(t, in, len, flags, ids, n, &n) != TOK_OK;
            double dt = now_s() - t1;
            if (dt < best) best = dt;
        }
        rc |= !ids;
        if (!rc) printf("load_s %.6f tokens %zu encode_s %.6f\n", load_s, n, best);
        free(ids);
    } else if (!strcmp(mode, "--decode")) {
        size_t n;
        int32_t *ids = parse_ids(in, end, &n);
        rc = !ids || decode_ids(t, ids, n, stream, &out);
        if (out.n) fwrite(out.p, 1, out.n, stdout);
        free(ids);
    } else if (!strcmp(mode, "--encode-batch")) {
        for (char *p = in; p < end && !rc;) {
            char *e;
            unsigned long long n = strtoull(p, &e, 10);
            if (e == p || *e != '\n' || n > (unsigned long long)(end - e - 1)) { rc = 1; break; }
            rc = print_ids(t, e + 1, (size_t)n, flags);
            p = e + 1 + n;
        }
    } else if (!strcmp(mode, "--decode-batch")) {
        for (char *p = in; p < end && !rc;) {
            char *nl = memchr(p, '\n', (size_t)(end - p));
            if (!nl) nl = end;
            size_t n;
            int32_t *ids = parse_ids(p, nl, &n);
            out.n = 0;
            rc = !ids || decode_ids(t, ids, n, stream, &out);
            printf("%zu\n", out.n);
            if (out.n) fwrite(out.p, 1, out.n, stdout);   /* out.p is NULL until a first put */
            free(ids);
            p = nl + 1;
        }
    } else if (!strcmp(mode, "--chat")) {
        struct ChatMessage msgs[64];
        size_t n_msgs = 0;
        for (char *p = in; p < end && n_msgs < 64;) {
            char role[16];
            unsigned long long n;
            int used = 0;
            if (sscanf(p, "%15s %llu%n", role, &n, &used) != 2 || p[used] != '\n' ||
                n > (unsigned long long)(end - p - used - 1)) {
                rc = 1;
                break;
            }
            enum ChatRole r = !strcmp(role, "system") ? CHAT_SYSTEM
                            : !strcmp(role, "user") ? CHAT_USER : CHAT_ASSISTANT;
            msgs[n_msgs++] = (struct ChatMessage){r, p + used + 1, (size_t)n};
            p += used + 1 + n;
        }
        size_t n = 0;
        if (!rc) tok_chat_format(t, msgs, n_msgs, gen, NULL, 0, &n);
        char *s = malloc(n + 1);
        if (!rc && s) {
            rc = tok_chat_format(t, msgs, n_msgs, gen, s, n + 1, &n) != TOK_OK;
            fwrite(s, 1, n, stdout);
        }
        free(s);
    } else {
        usage();
        rc = 2;
    }
    free(out.p);
    free(in);
    tok_destroy(&t);
    gguf_close(&g);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc > 1) return run_cli(argc, argv);
    test_unicode();
    test_mini_vocab();
    char err[512];
    struct GgufFile *g = NULL;
    struct Tokenizer *t = NULL;
    if (gguf_open(DEFAULT_MODEL, &g, err, sizeof err) != GGUF_OK) {
        fprintf(stderr, "FAIL: default model: %s (run `make model`)\n", err);
        return 1;
    }
    double t0 = now_s();
    int rc = tok_load_gguf(g, &t, err, sizeof err);
    double dt = now_s() - t0;
    gguf_close(&g); /* the tokenizer keeps copies of everything it needs */
    CHECK(rc == TOK_OK, "load default model: %s", err);
    if (rc == TOK_OK) {
        printf("loaded %d tokens in %.1f ms\n", tok_n_vocab(t), dt * 1e3);
        test_model_basics(t);
        test_invalid_utf8(t);
        test_stream(t);
        test_random_bytes(t);
        test_chat(t);
        test_long_words(t);
    }
    tok_destroy(&t);
    test_qwen();
    return check_report("test_tokenizer");
}
