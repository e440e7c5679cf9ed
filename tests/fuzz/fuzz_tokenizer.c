/* libFuzzer target: the BPE tokenizers of SmolLM2 (GPT-2 regex, digits split) and, when its
 * file is there, Qwen2.5-Coder (Qwen2's regex) on arbitrary bytes. Checks that encoding is
 * bounded, ids are in range, decoding gives back every byte that has a token, and the
 * streaming detokeniser emits only valid UTF-8. Needs models/SmolLM2-135M-Instruct.Q4_1.gguf
 * (run from the repo root); DIFFRAG_FUZZ_MODEL=PATH fuzzes that file's tokenizer alone. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/tokenizer.h"

#define MAX_TOKENIZERS 2

static struct Tokenizer *g_tok[MAX_TOKENIZERS];
static int g_n_tok;
static int g_byte_ok[MAX_TOKENIZERS][256]; /* does this byte have a token of its own? */

static void load(const char *path)
{
    char err[256];
    struct GgufFile *g = NULL;
    struct Tokenizer *t = NULL;
    if (gguf_open(path, &g, err, sizeof err) != GGUF_OK ||
        tok_load_gguf(g, &t, err, sizeof err) != TOK_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err);
        exit(1);
    }
    gguf_close(&g); /* the tokenizer keeps copies of what it needs */
    for (unsigned b = 0; b < 256; b++) {
        char c = (char)b;
        size_t n = 0;
        tok_encode(t, &c, 1, 0, NULL, 0, &n);
        g_byte_ok[g_n_tok][b] = n == 1;
    }
    g_tok[g_n_tok++] = t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *path = getenv("DIFFRAG_FUZZ_MODEL");
    if (path) {
        load(path);
        return 0;
    }
    load("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    const char *qwen = "models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
    if (access(qwen, R_OK) == 0) load(qwen);
    return 0;
}

static int utf8_ok(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || i + len > n) return 0;
        for (size_t k = 1; k < len; k++)
            if ((s[i + k] & 0xC0) != 0x80) return 0;
        i += len;
    }
    return 1;
}

static void fuzz_one(int which, const uint8_t *data, size_t size)
{
    const struct Tokenizer *tok = g_tok[which];
    unsigned flags = size && (data[0] & 1) ? TOK_PARSE_SPECIAL : 0;
    size_t n = 0;
    tok_encode(tok, (const char *)data, size, flags, NULL, 0, &n);
    if (n > size + 2) __builtin_trap(); /* at most one token per byte (+ BOS) */
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    size_t n2;
    tok_encode(tok, (const char *)data, size, flags, ids, n, &n2);
    if (n2 != n) __builtin_trap();
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tok_n_vocab(tok)) __builtin_trap();
    size_t need;
    tok_decode(tok, ids, n, NULL, 0, &need);
    char *out = malloc(need + 1);
    tok_decode(tok, ids, n, out, need + 1, &need);
    /* Every byte with a token comes back, in order, and nothing else. */
    size_t back = 0;
    for (size_t i = 0; i < size; i++)
        if (g_byte_ok[which][data[i]] && (back >= need || out[back++] != (char)data[i]))
            __builtin_trap();
    if (back != need) __builtin_trap();
    struct TokStream st;
    tok_stream_init(&st, tok);
    char piece[1024];
    for (size_t i = 0; i < n; i++) {
        int k = tok_stream_feed(&st, ids[i], piece, sizeof piece);
        if (k > 0 && !utf8_ok((unsigned char *)piece, (size_t)k)) __builtin_trap();
    }
    int k = tok_stream_flush(&st, piece, sizeof piece);
    if (k > 0 && !utf8_ok((unsigned char *)piece, (size_t)k)) __builtin_trap();
    free(out);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (int i = 0; i < g_n_tok; i++) fuzz_one(i, data, size);
    return 0;
}
