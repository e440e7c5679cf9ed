/* Posting-list codec. A list (or one block of a list) is stored as
 *
 *   varint count | varint last_id - base | varint max_tf | varint min_len |
 *   count x { varint id delta | varint tf | varint len }
 *
 * where the first delta is taken from `base` (the block's key in the store, <= every id in
 * it) and each later delta from the previous id (so > 0: ids strictly increase). tf >= 1;
 * len is the chunk's length in terms, kept beside each posting so scoring never has to look
 * the chunk up. An empty list is the four header varints with count 0. Varints are LEB128
 * (7 bits a byte, low first). */
#ifndef DIFFRAG_POSTINGS_H
#define DIFFRAG_POSTINGS_H

#include <stddef.h>
#include <stdint.h>

#define POSTINGS_BLOCK 128   /* postings per stored block */
#define VARINT_MAX 10

struct Posting { uint32_t id, tf, len; };

struct PostingsHeader {
    uint32_t count, last_id, max_tf, min_len;
    size_t size;          /* bytes the header took */
};

size_t varint_put(uint8_t *out, uint64_t v);
/* RET_OK, or RET_ECORRUPT for a truncated or over-long varint. */
int varint_get(const uint8_t *p, size_t n, uint64_t *v, size_t *used);

/* Bytes enough to encode n postings. */
static inline size_t postings_bound(size_t n) { return 4 * 5 + n * 15; }

/* Encode p[0..n) (ids strictly increasing, all >= base, tf >= 1) into out, which must hold
 * postings_bound(n) bytes. Returns RET_OK or RET_EINPUT (order or tf violated); *size = bytes. */
int postings_encode(uint32_t base, const struct Posting *p, size_t n, uint8_t *out, size_t *size);

/* Read only the header. RET_OK or RET_ECORRUPT. */
int postings_header(uint32_t base, const uint8_t *buf, size_t len, struct PostingsHeader *h);

/* Decode all postings; out must hold the header's count (check with postings_header, or pass
 * cap and get RET_ECORRUPT when the count exceeds it). Every field is checked: ids within
 * 32 bits and increasing, tf >= 1, no trailing bytes. RET_OK or RET_ECORRUPT. */
int postings_decode(uint32_t base, const uint8_t *buf, size_t len, struct Posting *out, size_t cap,
                    size_t *n);

#endif
