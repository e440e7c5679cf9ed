/* The hash functions and the growth of the open-addressing (hash, value) table; lookups are
 * inline in text/hash.h. */
#include "text/hash.h"

#include <stdlib.h>
#include <string.h>

static uint64_t fmix64(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

static uint64_t load64(const unsigned char *s)
{
    uint64_t v;
    memcpy(&v, s, 8);
    return v;
}

static uint64_t load32(const unsigned char *s)
{
    uint32_t v;
    memcpy(&v, s, 4);
    return v;
}

uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xc4ceb9fe1a85ec53ull), v;
    /* The last 1..8 bytes are read in register-sized loads that may overlap bytes already
     * taken (the length is in the seed, so that loses nothing). */
    if (n > 8) {
        size_t left = n;
        for (; left > 8; s += 8, left -= 8) {
            h = (h ^ load64(s)) * 0xff51afd7ed558ccdull;
            h ^= h >> 32;
        }
        v = load64(s + left - 8);
    } else if (n >= 4) {
        v = load32(s) | load32(s + n - 4) << 32;
    } else if (n > 0) {
        v = (uint64_t)s[0] | (uint64_t)s[n / 2] << 8 | (uint64_t)s[n - 1] << 16;
    } else {
        v = 0;
    }
    h = (h ^ v) * 0xff51afd7ed558ccdull;
    h = fmix64(h ^ (h >> 32));
    return h != HASH_EMPTY ? h : 1;
}

static int table_alloc(struct HashTable *t, size_t n_slots)
{
    struct HashSlot *s = calloc(n_slots, sizeof *s);
    if (!s) return -1;
    t->slots = s;
    t->mask = n_slots - 1;
    t->n = 0;
    return 0;
}

int hash_init(struct HashTable *t, size_t expected)
{
    memset(t, 0, sizeof *t);
    size_t cap = 16;
    while (cap / 2 < expected) {
        if (cap > SIZE_MAX / 2 / sizeof(struct HashSlot)) return -1;
        cap <<= 1;
    }
    return table_alloc(t, cap);
}

void hash_free(struct HashTable *t)
{
    free(t->slots);
    memset(t, 0, sizeof *t);
}

void hash_clear(struct HashTable *t)
{
    if (t->slots) memset(t->slots, 0, (t->mask + 1) * sizeof *t->slots);
    t->n = 0;
}

static struct HashSlot *put(struct HashTable *t, uint64_t h, uint64_t value)
{
    size_t i = (size_t)h & t->mask;
    while (t->slots[i].hash != HASH_EMPTY) i = (i + 1) & t->mask;
    t->slots[i] = (struct HashSlot){h, value};
    t->n++;
    return &t->slots[i];
}

struct HashSlot *hash_insert(struct HashTable *t, uint64_t h, uint64_t value)
{
    if (!t->slots && hash_init(t, 8)) return NULL;
    size_t cap = t->mask + 1;
    if ((t->n + 1) > cap / 2) {
        if (cap > SIZE_MAX / 2 / sizeof(struct HashSlot)) return NULL;
        struct HashTable grown;
        if (table_alloc(&grown, cap * 2)) return NULL;
        for (size_t i = 0; i < cap; i++)
            if (t->slots[i].hash != HASH_EMPTY) put(&grown, t->slots[i].hash, t->slots[i].value);
        free(t->slots);
        *t = grown;
    }
    return put(t, h, value);
}
