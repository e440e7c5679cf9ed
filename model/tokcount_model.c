/* TokenCounter adapters over the model's tokenizer (model/tokenizer.h): chunk sizes and prompt
 * budgets are counted in the tokens the model will actually see. The cached counter splits
 * text before every space that follows a non-space and precedes one: the GPT-2 family
 * pre-tokenizers (the only ones model/tokenizer.c accepts) never join a piece across such a
 * point, so the count of the text is the sum of the counts of these words, and each distinct
 * word is encoded only once. */
#include "model/tokcount_model.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer.h"
#include "text/hash.h"

static int model_encode(void *ctx, const char *text, size_t len, unsigned flags, int32_t *ids,
                        size_t cap, size_t *n_out)
{
    unsigned tf = 0;
    if (flags & TC_SPECIAL)
        tf |= TOK_PARSE_SPECIAL;
    if (flags & TC_ADD_BOS)
        tf |= TOK_ADD_BOS;
    return tok_encode(ctx, text, len, tf, ids, cap, n_out);
}

static int model_decode(void *ctx, const int32_t *ids, size_t n, char *out, size_t cap,
                        size_t *n_out)
{
    return tok_decode(ctx, ids, n, out, cap, n_out);
}

void tokcount_from_tokenizer(const struct Tokenizer *t, struct TokenCounter *out)
{
    /* The interface's ctx is non-const; the tokenizer is only ever read through it. */
    out->ctx = (void *)t;
    out->encode = model_encode;
    out->decode = model_decode;
    out->count = NULL;
    out->count_ctx = NULL;
}

/* ---- cached counting ---- */

#define WORD_MAX 23            /* longer words are counted without the cache */
#define STRIPES 64             /* independent tables, each with its own lock */
#define STRIPE_SLOTS 4096      /* power of two; a stripe stops caching at 3/4 full */

struct WordSlot { uint64_t hash; uint32_t count; uint8_t len; char word[WORD_MAX]; };

struct Stripe {
    pthread_mutex_t lock;
    size_t used;
    struct WordSlot slots[STRIPE_SLOTS];
};

struct TokCountModel {
    const struct Tokenizer *tok;
    struct Stripe stripes[STRIPES];
};

static int count_word(struct TokCountModel *m, const char *w, size_t n, size_t *out)
{
    if (n > WORD_MAX)
        return tok_encode(m->tok, w, n, 0, NULL, 0, out);
    uint64_t h = hash_bytes(w, n);
    struct Stripe *st = &m->stripes[h % STRIPES];
    size_t i = (h / STRIPES) & (STRIPE_SLOTS - 1);
    pthread_mutex_lock(&st->lock);
    for (;; i = (i + 1) & (STRIPE_SLOTS - 1)) {
        struct WordSlot *s = &st->slots[i];
        if (s->len == 0)
            break;
        if (s->hash == h && s->len == n && memcmp(s->word, w, n) == 0) {
            *out = s->count;
            pthread_mutex_unlock(&st->lock);
            return 0;
        }
    }
    pthread_mutex_unlock(&st->lock);
    int rc = tok_encode(m->tok, w, n, 0, NULL, 0, out);
    if (rc || *out > UINT32_MAX)
        return rc;
    pthread_mutex_lock(&st->lock);
    if (st->used < STRIPE_SLOTS * 3 / 4) {
        /* Probe again: another thread may have added the word meanwhile. */
        for (i = (h / STRIPES) & (STRIPE_SLOTS - 1);; i = (i + 1) & (STRIPE_SLOTS - 1)) {
            struct WordSlot *s = &st->slots[i];
            if (s->len == 0) {
                s->hash = h;
                s->count = (uint32_t)*out;
                s->len = (uint8_t)n;
                memcpy(s->word, w, n);
                st->used++;
                break;
            }
            if (s->hash == h && s->len == n && memcmp(s->word, w, n) == 0)
                break;
        }
    }
    pthread_mutex_unlock(&st->lock);
    return 0;
}

static int is_ascii_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

static int cached_count(void *ctx, const char *text, size_t len, size_t *n_out)
{
    struct TokCountModel *m = ctx;
    const unsigned char *s = (const unsigned char *)text;
    size_t total = 0, start = 0;
    for (size_t i = 1; i + 1 < len; i++) {
        if (s[i] != ' ' || s[i - 1] >= 0x80 || is_ascii_space(s[i - 1]) || is_ascii_space(s[i + 1]))
            continue;
        size_t n;
        int rc = count_word(m, text + start, i - start, &n);
        if (rc)
            return rc;
        total += n;
        start = i;
    }
    if (start < len) {
        size_t n;
        int rc = count_word(m, text + start, len - start, &n);
        if (rc)
            return rc;
        total += n;
    }
    *n_out = total;
    return 0;
}

int tokcount_model_new(const struct Tokenizer *t, struct TokCountModel **out)
{
    struct TokCountModel *m = calloc(1, sizeof *m);
    *out = NULL;
    if (!m)
        return TOKCOUNT_ENOMEM;
    m->tok = t;
    for (size_t i = 0; i < STRIPES; i++)
        pthread_mutex_init(&m->stripes[i].lock, NULL);
    *out = m;
    return TOKCOUNT_OK;
}

void tokcount_model_destroy(struct TokCountModel **pm)
{
    struct TokCountModel *m = pm ? *pm : NULL;
    if (!m)
        return;
    for (size_t i = 0; i < STRIPES; i++)
        pthread_mutex_destroy(&m->stripes[i].lock);
    free(m);
    *pm = NULL;
}

void tokcount_model_counter(struct TokCountModel *m, struct TokenCounter *out)
{
    tokcount_from_tokenizer(m->tok, out);
    out->count = cached_count;
    out->count_ctx = m;
}
