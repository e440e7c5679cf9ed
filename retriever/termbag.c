/* Open-addressing hash map from term bytes to counts (FNV-1a hash, linear probing), with an
 * arena for the term bytes so a chunk's terms cost no allocation per term once warm. */
#include "retriever/termbag.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/status.h"

static uint32_t term_hash(const char *s, size_t len)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)s[i];
        h *= 16777619u;
    }
    return h;
}

void termbag_init(struct TermBag *b) { memset(b, 0, sizeof *b); }

void termbag_free(struct TermBag *b)
{
    free(b->items);
    free(b->slots);
    free(b->arena);
    memset(b, 0, sizeof *b);
}

void termbag_clear(struct TermBag *b)
{
    b->n = 0;
    b->arena_len = 0;
    b->total = 0;
    if (b->slots)
        memset(b->slots, 0, b->n_slots * sizeof *b->slots);
}

static int rehash(struct TermBag *b, size_t n_slots)
{
    uint32_t *slots = calloc(n_slots, sizeof *slots);
    if (!slots)
        return RET_ENOMEM;
    for (size_t i = 0; i < b->n; i++) {
        size_t s = b->items[i].hash & (n_slots - 1);
        while (slots[s])
            s = (s + 1) & (n_slots - 1);
        slots[s] = (uint32_t)(i + 1);
    }
    free(b->slots);
    b->slots = slots;
    b->n_slots = n_slots;
    return RET_OK;
}

long termbag_find(const struct TermBag *b, const char *term, size_t len)
{
    if (!b->n_slots)
        return -1;
    uint32_t h = term_hash(term, len);
    size_t s = h & (b->n_slots - 1);
    while (b->slots[s]) {
        const struct TermBagItem *it = &b->items[b->slots[s] - 1];
        if (it->hash == h && it->len == len && memcmp(b->arena + it->off, term, len) == 0)
            return (long)(b->slots[s] - 1);
        s = (s + 1) & (b->n_slots - 1);
    }
    return -1;
}

int termbag_add(struct TermBag *b, const char *term, size_t len, uint32_t count, size_t *index)
{
    b->total += count;
    uint32_t h = term_hash(term, len);
    if (b->n_slots) {
        size_t s = h & (b->n_slots - 1);
        while (b->slots[s]) {
            struct TermBagItem *it = &b->items[b->slots[s] - 1];
            if (it->hash == h && it->len == len && memcmp(b->arena + it->off, term, len) == 0) {
                it->count += count;
                if (index)
                    *index = b->slots[s] - 1;
                return RET_OK;
            }
            s = (s + 1) & (b->n_slots - 1);
        }
    }
    if ((b->n + 1) * 2 > b->n_slots && rehash(b, b->n_slots ? b->n_slots * 2 : 64))
        return RET_ENOMEM;
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 32;
        struct TermBagItem *items = realloc(b->items, cap * sizeof *items);
        if (!items)
            return RET_ENOMEM;
        b->items = items;
        b->cap = cap;
    }
    if (b->arena_len + len > b->arena_cap) {
        size_t cap = b->arena_cap ? b->arena_cap * 2 : 1024;
        while (cap < b->arena_len + len)
            cap *= 2;
        char *arena = realloc(b->arena, cap);
        if (!arena)
            return RET_ENOMEM;
        b->arena = arena;
        b->arena_cap = cap;
    }
    memcpy(b->arena + b->arena_len, term, len);
    struct TermBagItem *it = &b->items[b->n];
    it->off = b->arena_len;
    it->len = (uint32_t)len;
    it->count = count;
    it->aux = 0;
    it->hash = h;
    b->arena_len += len;
    size_t s = h & (b->n_slots - 1);
    while (b->slots[s])
        s = (s + 1) & (b->n_slots - 1);
    b->slots[s] = (uint32_t)(b->n + 1);
    if (index)
        *index = b->n;
    b->n++;
    return RET_OK;
}

int termbag_emit(void *ctx, const char *term, size_t len)
{
    return termbag_add(ctx, term, len, 1, NULL);
}

static int item_cmp(const void *pa, const void *pb, void *arena_v)
{
    const struct TermBagItem *a = pa, *b = pb;
    const char *arena = arena_v;
    size_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(arena + a->off, arena + b->off, n);
    if (c)
        return c;
    return (a->len > b->len) - (a->len < b->len);
}

int termbag_sort(struct TermBag *b)
{
    qsort_r(b->items, b->n, sizeof *b->items, item_cmp, b->arena);
    return b->n_slots ? rehash(b, b->n_slots) : RET_OK;
}
