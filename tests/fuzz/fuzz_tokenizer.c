/* libFuzzer target: the BPE tokenizer of the default model on arbitrary bytes. Checks that
 * encoding is bounded, ids are in range, decoding works, and the streaming detokeniser emits
 * only valid UTF-8. Needs models/SmolLM2-135M-Instruct.Q4_1.gguf (run from the repo root). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer.h"

static struct GgufFile *g_file;
static struct Tokenizer *g_tok;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char err[256];
    const char *path = getenv("DIFFRAG_FUZZ_MODEL");
    if (!path) path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (gguf_open(path, &g_file, err, sizeof err) != GGUF_OK ||
        tok_load_gguf(g_file, &g_tok, err, sizeof err) != TOK_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err);
        exit(1);
    }
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    unsigned flags = size && (data[0] & 1) ? TOK_PARSE_SPECIAL : 0;
    size_t n = 0;
    tok_encode(g_tok, (const char *)data, size, flags, NULL, 0, &n);
    if (n > size + 2) __builtin_trap(); /* at most one token per byte (+ BOS) */
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    size_t n2;
    tok_encode(g_tok, (const char *)data, size, flags, ids, n, &n2);
    if (n2 != n) __builtin_trap();
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tok_n_vocab(g_tok)) __builtin_trap();
    size_t need;
    tok_decode(g_tok, ids, n, NULL, 0, &need);
    char *out = malloc(need + 1);
    tok_decode(g_tok, ids, n, out, need + 1, &need);
    struct TokStream st;
    tok_stream_init(&st, g_tok);
    char piece[1024];
    for (size_t i = 0; i < n; i++) {
        int k = tok_stream_feed(&st, ids[i], piece, sizeof piece);
        if (k > 0 && !utf8_ok((unsigned char *)piece, (size_t)k)) __builtin_trap();
    }
    int k = tok_stream_flush(&st, piece, sizeof piece);
    if (k > 0 && !utf8_ok((unsigned char *)piece, (size_t)k)) __builtin_trap();
    free(out);
    free(ids);
    return 0;
}
