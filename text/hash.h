/* One hash function for byte strings, one mix for 64-bit integers, and one open-addressing
 * table of (hash, value) slots that the GGUF indexes, the tokenizer's vocabulary, merges and
 * encode cache, the analyzer's term bags and the grounding word set all use.
 *
 * The table holds no keys: each slot keeps the key's full 64-bit hash and a 64-bit value that
 * the caller chooses (usually the index of an entry it keeps, whose key it compares when the
 * hashes match). For integer keys hashed with the bijective hash_u64 the hash is the key, so a
 * matching hash is a match; a hash-only set (the grounding word set) stores hash_bytes alone.
 * Linear probing over a power-of-two array at most half full; a slot whose hash is
 * HASH_EMPTY is free, and neither function ever returns it for a key the callers use. */
#ifndef DIFFRAG_TEXT_HASH_H
#define DIFFRAG_TEXT_HASH_H

#include <stddef.h>
#include <stdint.h>

#define HASH_EMPTY 0u

/* The bytes taken 8 at a time (little-endian loads, so the value depends on the machine's byte
 * order), each word folded in with a multiply, then MurmurHash3's 64-bit finaliser so that
 * every bit of the result depends on every byte (the low bits pick the slot). Never
 * HASH_EMPTY. The document store keeps its values as the checksums of documents, chunks and
 * chunk KV records (retriever/store_sum.c, store_kv.c), in an LMDB file, which is bound to the
 * byte order of the machine that wrote it anyway: changing this function makes every stored
 * checksum wrong, so it needs a new store schema. */
uint64_t hash_bytes(const void *p, size_t n);
/* A bijective mix of a 64-bit integer (xorshift, odd multiply, xorshift of key ^ UINT64_MAX):
 * distinct keys give distinct hashes, and only the key UINT64_MAX gives HASH_EMPTY. Inline: the
 * tokenizer's merge lookups call it in their innermost loop. */
static inline uint64_t hash_u64(uint64_t key)
{
    key = ~key;
    key ^= key >> 31;
    key *= 0x9E3779B97F4A7C15ull;
    return key ^ (key >> 29);
}

struct HashSlot { uint64_t hash, value; };

struct HashTable {
    struct HashSlot *slots; /* mask + 1 slots; NULL before hash_init */
    size_t mask;
    size_t n;               /* slots in use, at most (mask + 1) / 2 */
};

/* Sizes an empty table for `expected` entries without growing. 0, or -1 when out of memory
 * (or when `expected` is too large to size; *t is then left empty and safe to free). */
int hash_init(struct HashTable *t, size_t expected);
/* Frees the slots and zeroes *t; a zeroed table may be freed again. */
void hash_free(struct HashTable *t);
/* Empties the table, keeping its size. */
void hash_clear(struct HashTable *t);

/* Adds a slot for hash h (which must not be HASH_EMPTY) with `value`, growing the table to
 * keep it at most half full; the caller has checked that its key is not there yet (or wants a
 * second slot for it). Returns the new slot, valid until the next hash_insert, or NULL when
 * out of memory (the table is unchanged). */
struct HashSlot *hash_insert(struct HashTable *t, uint64_t h, uint64_t value);

/* The slots holding hash h, in probe order: `for (s = hash_find(t, h, &pos); s;
 * s = hash_next(t, h, &pos))`. NULL when there are no more (also for an empty table). Slots
 * stay valid until the next hash_insert or hash_free. */
static inline struct HashSlot *hash_next(const struct HashTable *t, uint64_t h, size_t *pos)
{
    for (size_t i = *pos;; i = (i + 1) & t->mask) {
        struct HashSlot *s = &t->slots[i];
        if (s->hash == h) {
            *pos = (i + 1) & t->mask;
            return s;
        }
        if (s->hash == HASH_EMPTY) return NULL;
    }
}

static inline struct HashSlot *hash_find(const struct HashTable *t, uint64_t h, size_t *pos)
{
    if (!t->slots) return NULL;
    *pos = (size_t)h & t->mask;
    return hash_next(t, h, pos);
}

/* Start fetching the slot where a probe for h begins (a loop that looks up many keys issues
 * this a few dozen keys ahead). */
static inline void hash_prefetch(const struct HashTable *t, uint64_t h)
{
    __builtin_prefetch(&t->slots[(size_t)h & t->mask]);
}

#endif
