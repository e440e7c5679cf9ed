/* Prompt-lookup drafting (model/lookup.h): a backward scan for the history's suffix. The scan
 * is linear in the history, microseconds beside a decode step even at long contexts. */
#include "model/lookup.h"

#include <string.h>

/* The start of the latest occurrence of hist[n - g..n) that ends before n - 1, or -1. */
static int latest_match(const int32_t *hist, int n, int g)
{
    const int32_t *pat = hist + n - g;
    for (int i = n - g - 1; i >= 0; i--)
        if (hist[i] == pat[0] && memcmp(hist + i, pat, (size_t)g * sizeof *pat) == 0) return i;
    return -1;
}

int lookup_draft(const int32_t *hist, int n, int32_t *draft, int k_max)
{
    if (k_max < 1) return 0;
    for (int g = LOOKUP_NGRAM_MAX; g >= LOOKUP_NGRAM_MIN; g--) {
        if (n <= g) continue;
        int at = latest_match(hist, n, g);
        if (at < 0) continue;
        int from = at + g, k = n - from < k_max ? n - from : k_max;
        memcpy(draft, hist + from, (size_t)k * sizeof *draft);
        return k;
    }
    return 0;
}
