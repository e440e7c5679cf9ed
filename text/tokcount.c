/* Helpers over the TokenCounter interface and the simple reversible counter used by unit
 * tests and by ingest without a model. */
#include "text/tokcount.h"

#include <stdlib.h>
#include <string.h>

int tokcount_count(const struct TokenCounter *tc, const char *text, size_t len, size_t *n)
{
    *n = 0;
    if (len == 0)
        return TOKCOUNT_OK;
    if (tc->count)
        return tc->count(tc->count_ctx, text, len, n) ? TOKCOUNT_EFAIL : TOKCOUNT_OK;
    return tc->encode(tc->ctx, text, len, 0, NULL, 0, n) ? TOKCOUNT_EFAIL : TOKCOUNT_OK;
}

int tokcount_encode_alloc(const struct TokenCounter *tc, const char *text, size_t len,
                          unsigned flags, int32_t **ids, size_t *n)
{
    *ids = NULL;
    *n = 0;
    if (len == 0 && !(flags & TC_ADD_BOS))
        return TOKCOUNT_OK;
    size_t need = 0;
    if (tc->encode(tc->ctx, text, len, flags, NULL, 0, &need))
        return TOKCOUNT_EFAIL;
    if (need == 0)
        return TOKCOUNT_OK;
    int32_t *buf = malloc(need * sizeof *buf);
    if (!buf)
        return TOKCOUNT_ENOMEM;
    size_t got = 0;
    if (tc->encode(tc->ctx, text, len, flags, buf, need, &got) || got != need) {
        free(buf);
        return TOKCOUNT_EFAIL;
    }
    *ids = buf;
    *n = need;
    return TOKCOUNT_OK;
}

#define SIMPLE_SPECIAL_BASE 0x7F000000
static const char *const SIMPLE_SPECIALS[] = { "<|endoftext|>", "<|im_start|>", "<|im_end|>" };
#define N_SIMPLE_SPECIALS (sizeof SIMPLE_SPECIALS / sizeof SIMPLE_SPECIALS[0])

static int is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static void put_id(int32_t *ids, size_t cap, size_t *n, int32_t id)
{
    if (*n < cap)
        ids[*n] = id;
    (*n)++;
}

/* Emit tokens of up to 3 bytes for text[0..len). */
static void simple_bytes(const unsigned char *s, size_t len, int32_t *ids, size_t cap, size_t *n)
{
    size_t i = 0;
    while (i < len) {
        /* A piece: leading whitespace then non-whitespace. */
        size_t end = i;
        while (end < len && is_space(s[end]))
            end++;
        while (end < len && !is_space(s[end]))
            end++;
        for (size_t p = i; p < end; p += 3) {
            size_t m = end - p < 3 ? end - p : 3;
            uint32_t id = (uint32_t)m << 24;
            for (size_t k = 0; k < m; k++)
                id |= (uint32_t)s[p + k] << (16 - 8 * k);
            put_id(ids, cap, n, (int32_t)id);
        }
        i = end;
    }
}

static int simple_encode(void *ctx, const char *text, size_t len, unsigned flags, int32_t *ids,
                         size_t cap, size_t *n_out)
{
    (void)ctx;
    const unsigned char *s = (const unsigned char *)text;
    size_t n = 0, start = 0, i = 0;
    if (flags & TC_SPECIAL) {
        while (i < len) {
            size_t k;
            for (k = 0; k < N_SIMPLE_SPECIALS; k++) {
                size_t sl = strlen(SIMPLE_SPECIALS[k]);
                if (len - i >= sl && memcmp(text + i, SIMPLE_SPECIALS[k], sl) == 0)
                    break;
            }
            if (k == N_SIMPLE_SPECIALS) {
                i++;
                continue;
            }
            simple_bytes(s + start, i - start, ids, cap, &n);
            put_id(ids, cap, &n, (int32_t)(SIMPLE_SPECIAL_BASE + k));
            i += strlen(SIMPLE_SPECIALS[k]);
            start = i;
        }
    }
    simple_bytes(s + start, len - start, ids, cap, &n);
    *n_out = n;
    return 0;
}

static int simple_decode(void *ctx, const int32_t *ids, size_t n, char *out, size_t cap,
                         size_t *n_out)
{
    (void)ctx;
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t id = (uint32_t)ids[i];
        if (id >= SIMPLE_SPECIAL_BASE) {
            if (id - SIMPLE_SPECIAL_BASE >= N_SIMPLE_SPECIALS)
                return TOKCOUNT_EINPUT;
            const char *sp = SIMPLE_SPECIALS[id - SIMPLE_SPECIAL_BASE];
            for (size_t k = 0; sp[k]; k++, len++)
                if (len < cap)
                    out[len] = sp[k];
            continue;
        }
        size_t m = id >> 24;
        if (m < 1 || m > 3)
            return TOKCOUNT_EINPUT;
        for (size_t k = 0; k < m; k++, len++)
            if (len < cap)
                out[len] = (char)((id >> (16 - 8 * k)) & 0xFF);
    }
    *n_out = len;
    return 0;
}

void tokcount_simple(struct TokenCounter *out)
{
    out->ctx = NULL;
    out->encode = simple_encode;
    out->decode = simple_decode;
    out->count = NULL;
    out->count_ctx = NULL;
}
