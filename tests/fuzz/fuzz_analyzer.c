/* libFuzzer target: the BM25 text normaliser (UTF-8 decoding, lowercasing, word splitting,
 * stemming) on arbitrary bytes, with and without stemming. Terms must be non-empty. */
#include <stdlib.h>

#include "retriever/text.h"
#include "text/utf8.h"

static struct Analyzer *g_stem, *g_plain;

static int emit(void *ctx, const char *term, size_t len)
{
    (void)term;
    if (len == 0) __builtin_trap();
    ++*(size_t *)ctx;
    return 0;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char err[256];
    if (analyzer_new(ANALYZE_STEM | ANALYZE_STOPWORDS, &g_stem, err, sizeof err) != 0 ||
        analyzer_new(0, &g_plain, err, sizeof err) != 0)
        exit(1);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t n1 = 0, n2 = 0;
    analyzer_run(g_stem, (const char *)data, size, emit, &n1);
    analyzer_run(g_plain, (const char *)data, size, emit, &n2);
    if (n1 > size || n2 > size) __builtin_trap();
    size_t bad;
    utf8_valid((const char *)data, size, &bad);
    return 0;
}
