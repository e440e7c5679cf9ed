/* The KV page pool: the keys and values of every sequence of a process, in pages of KV_TILE
 * positions, and the exact prefix cache over them.
 *
 * A page holds one tile (kernels/backend.h) of every layer and KV head, keys then values. A
 * sequence keeps a page table and takes pages as it writes positions; pages are shared by
 * reference count. A full page that a prefill wrote can be published: it is then named by a
 * hash chained over the model, the KV type, the RoPE settings, its KV_TILE token ids and the
 * previous page's name (as vLLM's automatic prefix caching names its blocks), and a later
 * sequence whose prompt starts with the same tokens takes it instead of computing it. A match
 * compares the token ids and the previous page itself, never only hashes, so a hash collision
 * cannot hand a sequence another prompt's keys. Published pages nobody references stay cached
 * and are evicted least-recently-used when a page is needed; a sequence gives its pages back
 * last page first, so a prompt's tail is evicted before its head.
 *
 * Thread safe: one mutex, taken once per page operation (not per position). */
#ifndef DIFFRAG_KVPOOL_H
#define DIFFRAG_KVPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "model/model.h"

struct KvPool;

/* Bytes of one page (keys and values of KV_TILE positions, all layers and KV heads), and the
 * pages an n-position sequence needs. */
size_t kvpool_page_bytes(const struct ModelConfig *c, enum KvType t);
size_t kvpool_pages_for(int n_positions);

/* A pool of n_pages pages for model m's caches of type t; caching = 0 never publishes or
 * matches (every page is private to its sequence). The memory is reserved, not touched: pages
 * are committed as positions are written. 0, or ENGINE_EINPUT / ENGINE_ENOMEM codes of
 * model/engine.h with err. The model must outlive the pool. */
int kvpool_new(const struct Model *m, enum KvType t, size_t n_pages, int caching,
               struct KvPool **out, char *err, size_t errlen);
/* A pool of the names and reference counts of n_pages pages whose memory lies elsewhere (the
 * GPU's KV pool, model/engine_gpu.c: bf16 keys and values in the device's layout), of
 * page_bytes each (what kvpool_stats reports). Its pages are named by the same chain
 * (kvpool_chain_hash) over a seed that says they are the GPU's, so a name never stands for a
 * CPU pool's page and the other way round. kvpool_layout's base is NULL. 0, or the codes of
 * kvpool_new. */
int kvpool_new_names(const struct Model *m, size_t page_bytes, size_t n_pages, int caching,
                     struct KvPool **out, char *err, size_t errlen);
void kvpool_destroy(struct KvPool **p);

struct KvPoolStats {
    size_t pages;              /* the pool's size */
    size_t pages_used;         /* referenced by a sequence */
    size_t pages_cached;       /* published and unreferenced: kept for reuse, evictable */
    size_t pages_free;         /* neither (pages = used + cached + free) */
    size_t page_bytes;
    uint64_t queried_tokens;   /* prompt tokens looked up in the cache */
    uint64_t hit_tokens;       /* of them, taken from cached pages */
    uint64_t evicted_pages;
};
void kvpool_stats(struct KvPool *p, struct KvPoolStats *out);

/* ---- for the engine ---- */

/* The layout, in cache elements from kvpool_base: page p's keys of layer l, KV head g start at
 * p * page_stride + (l * n_kv_head + g) * head_stride, its values value_offset further on. */
struct KvPoolLayout {
    void *base;
    enum KvType kv_type;
    size_t page_stride, head_stride, layer_stride, value_offset;
};
void kvpool_layout(const struct KvPool *p, struct KvPoolLayout *out);
int kvpool_caching(const struct KvPool *p);

/* A fresh private page, referenced once: a free one, else the least recently used cached one
 * (evicted). 0, or -1 when every page is referenced. */
int kvpool_alloc(struct KvPool *p, int32_t *page);
/* n such pages into pages[0..n): 0, or -1 (nothing taken) when fewer than n are free or
 * cached. */
int kvpool_alloc_n(struct KvPool *p, int n, int32_t *pages);

/* The longest run of published pages that holds tokens[0 .. 64 m) as a prompt's first pages,
 * m <= max_pages: each is referenced once more and written to pages[0..m); hashes[0..m) receive
 * their names. Counts n_tokens as queried and 64 m as hit. Returns m (0 when caching is off). */
int kvpool_match(struct KvPool *p, const int32_t *tokens, size_t n_tokens, int max_pages,
                 int32_t *pages, uint64_t *hashes);

/* What kvpool_match would take now, without taking it (no reference, no count): the length
 * of the run (the return), and in *idle how many of its pages nobody references (cached ones:
 * they count as available to kvpool_alloc until a match takes them). */
int kvpool_peek(struct KvPool *p, const int32_t *tokens, size_t n_tokens, int max_pages,
                int *idle);

/* The name of the page after `parent_hash` (0: the first page) holding `tokens` (KV_TILE ids). */
uint64_t kvpool_chain_hash(const struct KvPool *p, uint64_t parent_hash, const int32_t *tokens);

/* Publishes `page` (full, written by a prefill, referenced by the caller) under `hash` with its
 * tokens, after `parent` (-1 for a prompt's first page). Nothing happens when caching is off,
 * when the parent is not itself published, or when an equal page is already published (the
 * caller's stays private). */
void kvpool_publish(struct KvPool *p, int32_t page, int32_t parent, uint64_t hash,
                    const int32_t *tokens);

/* Drops one reference to each of pages[0..n), last first: a page nobody references becomes
 * cached (published) or free (private). */
void kvpool_release(struct KvPool *p, const int32_t *pages, int n);

#endif
