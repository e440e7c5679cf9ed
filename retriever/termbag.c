/* Term bytes to counts: items in insertion order, their bytes in an arena (so a chunk's terms
 * cost no allocation per term once warm), found through a text/hash.h table of item indexes. */
#include "retriever/termbag.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/status.h"

void termbag_init(struct TermBag *b) { memset(b, 0, sizeof *b); }

void termbag_free(struct TermBag *b)
{
    free(b->items);
    hash_free(&b->index);
    free(b->arena);
    memset(b, 0, sizeof *b);
}

void termbag_clear(struct TermBag *b)
{
    b->n = 0;
    b->arena_len = 0;
    b->total = 0;
    hash_clear(&b->index);
}

/* The index slot of the term, or NULL. */
static struct HashSlot *find_slot(const struct TermBag *b, const char *term, size_t len, uint64_t h)
{
    size_t pos;
    for (struct HashSlot *s = hash_find(&b->index, h, &pos); s; s = hash_next(&b->index, h, &pos)) {
        const struct TermBagItem *it = &b->items[s->value];
        if (it->len == len && memcmp(b->arena + it->off, term, len) == 0)
            return s;
    }
    return NULL;
}

long termbag_find(const struct TermBag *b, const char *term, size_t len)
{
    struct HashSlot *s = find_slot(b, term, len, hash_bytes(term, len));
    return s ? (long)s->value : -1;
}

int termbag_add(struct TermBag *b, const char *term, size_t len, uint32_t count, size_t *index)
{
    b->total += count;
    uint64_t h = hash_bytes(term, len);
    struct HashSlot *s = find_slot(b, term, len, h);
    if (s) {
        b->items[s->value].count += count;
        if (index)
            *index = (size_t)s->value;
        return RET_OK;
    }
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
    if (!b->index.slots && hash_init(&b->index, 32))
        return RET_ENOMEM;
    if (!hash_insert(&b->index, h, b->n))
        return RET_ENOMEM;
    memcpy(b->arena + b->arena_len, term, len);
    struct TermBagItem *it = &b->items[b->n];
    it->off = b->arena_len;
    it->len = (uint32_t)len;
    it->count = count;
    it->aux = 0;
    b->arena_len += len;
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
    if (!b->index.slots)
        return RET_OK;
    /* The items moved: index them again (the table keeps its size, so nothing is allocated). */
    hash_clear(&b->index);
    for (size_t i = 0; i < b->n; i++)
        if (!hash_insert(&b->index, hash_bytes(b->arena + b->items[i].off, b->items[i].len), i))
            return RET_ENOMEM;
    return RET_OK;
}
