/* A small map from term bytes to a count and an auxiliary value, used to gather a chunk's
 * term frequencies, a query's terms and an in-memory index's dictionary. Items keep insertion
 * order; the term bytes live in one arena owned by the bag; a text/hash.h table finds them. */
#ifndef DIFFRAG_TERMBAG_H
#define DIFFRAG_TERMBAG_H

#include <stddef.h>
#include <stdint.h>

#include "text/hash.h"

struct TermBagItem {
    size_t off;      /* term bytes at arena + off */
    uint32_t len;
    uint32_t count;  /* how many times the term was added */
    uint32_t aux;    /* caller's value (0 when first added) */
};

struct TermBag {
    struct TermBagItem *items;
    size_t n, cap;
    struct HashTable index;  /* hash_bytes of each term -> its item's index */
    char *arena;
    size_t arena_len, arena_cap;
    uint64_t total;   /* sum of all counts */
};

void termbag_init(struct TermBag *b);
void termbag_free(struct TermBag *b);
void termbag_clear(struct TermBag *b);   /* keeps the memory */
/* Adds `count` occurrences; *index (optional) receives the item's index. RET_OK or RET_ENOMEM. */
int termbag_add(struct TermBag *b, const char *term, size_t len, uint32_t count, size_t *index);
/* Index of the term or -1. */
long termbag_find(const struct TermBag *b, const char *term, size_t len);
static inline const char *termbag_term(const struct TermBag *b, size_t i) { return b->arena + b->items[i].off; }
/* analyzer_emit_fn adapter: ctx is a struct TermBag. */
int termbag_emit(void *ctx, const char *term, size_t len);
/* Sort items by term bytes (the hash slots are rebuilt). RET_OK or RET_ENOMEM. */
int termbag_sort(struct TermBag *b);

#endif
