/* The KV page pool and its exact prefix cache: page memory, reference counts, the free stack,
 * the least-recently-used list of cached pages and the chained buckets that find a page by
 * its name (layout and rules in model/kvpool.h). */
#include "model/kvpool.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "model/engine.h"
#include "text/errmsg.h"
#include "text/hash.h"

struct PageMeta {
    uint64_t hash;
    int32_t ref;
    uint32_t gen;              /* bumped when the page leaves the cache: children's parent check */
    int32_t parent;            /* published: the previous page (-1: a prompt's first) */
    uint32_t parent_gen;
    int32_t lru_prev, lru_next;
    int32_t bucket_next;
    uint8_t published, in_lru;
};

struct KvPool {
    pthread_mutex_t mu;
    struct KvPoolLayout lay;
    size_t n_pages, page_bytes;
    int caching;
    uint64_t seed;             /* the model, KV type and RoPE settings */
    void *mem;
    struct PageMeta *meta;
    int32_t *tokens;           /* (n_pages, KV_TILE) ids of published pages */
    int32_t *free_stack;
    size_t n_free;
    int32_t lru_head, lru_tail; /* oldest, newest */
    int32_t *buckets;          /* bucket_mask + 1 chain heads */
    size_t bucket_mask;
    size_t n_used, n_cached;
    uint64_t queried, hit, evicted;
};

size_t kvpool_page_bytes(const struct ModelConfig *c, enum KvType t)
{
    return 2 * (size_t)c->n_layer * c->n_kv_head * kv_tile_elems(t, c->head_dim) *
           kv_elem_bytes(t);
}

size_t kvpool_pages_for(int n_positions)
{
    return n_positions > 0 ? ((size_t)n_positions + KV_TILE - 1) / KV_TILE : 0;
}

/* The GPU's pages (kvpool_new_names) in the seed's KV type field: bf16 in the device's layout,
 * so their names are never a CPU pool's. */
enum { SEED_GPU_BF16 = 16 };

/* A pool of n_pages pages of page_bytes; host_mem: with their memory (else the names and
 * references only); kv_kind: the seed's KV type field. */
static int pool_make(const struct Model *m, enum KvType t, int kv_kind, size_t page_bytes,
                     size_t n_pages, int caching, int host_mem, struct KvPool **out, char *err,
                     size_t errlen)
{
    *out = NULL;
    const struct ModelConfig *c = &m->cfg;
    if (n_pages < 1 || n_pages > (size_t)INT32_MAX / 2 || (unsigned)t > KV_Q8)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a KV pool needs 1..%d pages (asked: %zu)",
                          INT32_MAX / 2, n_pages);
    if (page_bytes == 0 || n_pages > SIZE_MAX / page_bytes)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "%zu KV pages do not fit in memory", n_pages);
    struct KvPool *p = calloc(1, sizeof *p);
    if (!p) return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory");
    size_t nb = 16;
    while (nb < n_pages) nb *= 2;
    p->n_pages = n_pages;
    p->page_bytes = page_bytes;
    p->caching = caching;
    p->bucket_mask = nb - 1;
    /* malloc, not calloc: a page is committed only when a sequence writes into it */
    p->mem = host_mem ? malloc(n_pages * page_bytes) : NULL;
    p->meta = calloc(n_pages, sizeof *p->meta);
    p->tokens = malloc(n_pages * KV_TILE * sizeof *p->tokens);
    p->free_stack = malloc(n_pages * sizeof *p->free_stack);
    p->buckets = malloc(nb * sizeof *p->buckets);
    if ((host_mem && !p->mem) || !p->meta || !p->tokens || !p->free_stack || !p->buckets ||
        pthread_mutex_init(&p->mu, NULL)) {
        free(p->mem); free(p->meta); free(p->tokens); free(p->free_stack); free(p->buckets);
        free(p);
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "cannot reserve %zu bytes for %zu KV pages",
                          n_pages * page_bytes, n_pages);
    }
    /* the top of the stack is page 0, so a lone sequence takes pages in order */
    for (size_t i = 0; i < n_pages; i++) p->free_stack[i] = (int32_t)(n_pages - 1 - i);
    p->n_free = n_pages;
    for (size_t i = 0; i < nb; i++) p->buckets[i] = -1;
    p->lru_head = p->lru_tail = -1;
    size_t tile = kv_tile_elems(t, c->head_dim);
    if (host_mem)
        p->lay = (struct KvPoolLayout){
            .base = p->mem, .kv_type = t, .head_stride = tile,
            .layer_stride = (size_t)c->n_kv_head * tile,
            .value_offset = (size_t)c->n_layer * c->n_kv_head * tile,
            .page_stride = 2 * (size_t)c->n_layer * c->n_kv_head * tile,
        };
    const struct RopeConfig *r = &c->rope;
    double seed_fields[] = {
        c->arch, c->dim, c->n_layer, c->n_head, c->n_q_head, c->n_kv_head, c->head_dim,
        c->ffn_dim, c->vocab, c->norm_eps, kv_kind, r->base, r->n_rot, r->layout, r->scaling,
        r->factor, r->orig_ctx, r->attn_factor, r->beta_fast, r->beta_slow,
        (double)(uintptr_t)m,
    };
    p->seed = hash_bytes(seed_fields, sizeof seed_fields);
    *out = p;
    return 0;
}

int kvpool_new(const struct Model *m, enum KvType t, size_t n_pages, int caching,
               struct KvPool **out, char *err, size_t errlen)
{
    return pool_make(m, t, (int)t, kvpool_page_bytes(&m->cfg, t), n_pages, caching, 1, out, err,
                     errlen);
}

int kvpool_new_names(const struct Model *m, size_t page_bytes, size_t n_pages, int caching,
                     struct KvPool **out, char *err, size_t errlen)
{
    return pool_make(m, KV_F32, SEED_GPU_BF16, page_bytes, n_pages, caching, 0, out, err, errlen);
}

void kvpool_destroy(struct KvPool **pp)
{
    struct KvPool *p = *pp;
    if (!p) return;
    pthread_mutex_destroy(&p->mu);
    free(p->mem);
    free(p->meta);
    free(p->tokens);
    free(p->free_stack);
    free(p->buckets);
    free(p);
    *pp = NULL;
}

void kvpool_stats(struct KvPool *p, struct KvPoolStats *o)
{
    pthread_mutex_lock(&p->mu);
    *o = (struct KvPoolStats){
        .pages = p->n_pages, .pages_used = p->n_used, .pages_cached = p->n_cached,
        .pages_free = p->n_free, .page_bytes = p->page_bytes, .queried_tokens = p->queried,
        .hit_tokens = p->hit, .evicted_pages = p->evicted,
    };
    pthread_mutex_unlock(&p->mu);
}

void kvpool_layout(const struct KvPool *p, struct KvPoolLayout *out) { *out = p->lay; }

int kvpool_caching(const struct KvPool *p) { return p->caching; }

uint64_t kvpool_chain_hash(const struct KvPool *p, uint64_t parent_hash, const int32_t *tokens)
{
    uint64_t buf[2 + KV_TILE / 2];
    buf[0] = p->seed;
    buf[1] = parent_hash;
    memcpy(buf + 2, tokens, KV_TILE * sizeof *tokens);
    return hash_bytes(buf, sizeof buf);
}

static void lru_unlink(struct KvPool *p, int32_t i)
{
    struct PageMeta *m = &p->meta[i];
    if (m->lru_prev >= 0) p->meta[m->lru_prev].lru_next = m->lru_next;
    else p->lru_head = m->lru_next;
    if (m->lru_next >= 0) p->meta[m->lru_next].lru_prev = m->lru_prev;
    else p->lru_tail = m->lru_prev;
    m->in_lru = 0;
    p->n_cached--;
}

static void lru_append(struct KvPool *p, int32_t i)
{
    struct PageMeta *m = &p->meta[i];
    m->lru_prev = p->lru_tail;
    m->lru_next = -1;
    if (p->lru_tail >= 0) p->meta[p->lru_tail].lru_next = i;
    else p->lru_head = i;
    p->lru_tail = i;
    m->in_lru = 1;
    p->n_cached++;
}

static void bucket_remove(struct KvPool *p, int32_t i)
{
    int32_t *at = &p->buckets[p->meta[i].hash & p->bucket_mask];
    while (*at >= 0 && *at != i) at = &p->meta[*at].bucket_next;
    if (*at == i) *at = p->meta[i].bucket_next;
}

/* The published page named h after `parent` holding `tokens`, or -1. */
static int32_t find(const struct KvPool *p, uint64_t h, int32_t parent, const int32_t *tokens)
{
    uint32_t pgen = parent >= 0 ? p->meta[parent].gen : 0;
    for (int32_t i = p->buckets[h & p->bucket_mask]; i >= 0; i = p->meta[i].bucket_next) {
        const struct PageMeta *m = &p->meta[i];
        if (m->hash == h && m->parent == parent && m->parent_gen == pgen &&
            !memcmp(p->tokens + (size_t)i * KV_TILE, tokens, KV_TILE * sizeof *tokens))
            return i;
    }
    return -1;
}

/* A free page, else the least recently used cached one (evicted), referenced once; -1 when
 * every page is referenced. Under the lock. */
static int32_t take_page(struct KvPool *p)
{
    int32_t i = -1;
    if (p->n_free) {
        i = p->free_stack[--p->n_free];
    } else if (p->lru_head >= 0) {
        i = p->lru_head;
        lru_unlink(p, i);
        bucket_remove(p, i);
        p->meta[i].published = 0;
        p->meta[i].gen++;
        p->evicted++;
    }
    if (i >= 0) {
        p->meta[i].ref = 1;
        p->n_used++;
    }
    return i;
}

int kvpool_alloc(struct KvPool *p, int32_t *page)
{
    pthread_mutex_lock(&p->mu);
    int32_t i = take_page(p);
    pthread_mutex_unlock(&p->mu);
    *page = i;
    return i >= 0 ? 0 : -1;
}

int kvpool_alloc_n(struct KvPool *p, int n, int32_t *pages)
{
    if (n < 0) return -1;
    pthread_mutex_lock(&p->mu);
    /* all or nothing: the check and the takes under one lock, so another thread's takes
     * cannot leave this call half served */
    int ok = (size_t)n <= p->n_free + p->n_cached;
    for (int k = 0; ok && k < n; k++) pages[k] = take_page(p);
    pthread_mutex_unlock(&p->mu);
    return ok ? 0 : -1;
}

/* The published pages that hold tokens' full pages from the first, in order, at most
 * max_pages (under p->mu). take: a reference to each (out of the LRU when it was idle), with
 * its page and chain hash stored; else only *idle counts the idle ones. */
static int walk_chain(struct KvPool *p, const int32_t *tokens, size_t n_tokens, int max_pages,
                      int take, int32_t *pages, uint64_t *hashes, int *idle)
{
    int m = 0;
    uint64_t h = 0;
    int32_t parent = -1;
    while (m < max_pages && (size_t)(m + 1) * KV_TILE <= n_tokens) {
        const int32_t *t = tokens + (size_t)m * KV_TILE;
        h = kvpool_chain_hash(p, h, t);
        int32_t i = find(p, h, parent, t);
        if (i < 0) break;
        struct PageMeta *mi = &p->meta[i];
        if (!take) {
            *idle += mi->ref == 0;
        } else {
            if (mi->ref++ == 0) {
                lru_unlink(p, i);
                p->n_used++;
            }
            pages[m] = i;
            hashes[m] = h;
        }
        m++;
        parent = i;
    }
    return m;
}

int kvpool_match(struct KvPool *p, const int32_t *tokens, size_t n_tokens, int max_pages,
                 int32_t *pages, uint64_t *hashes)
{
    if (!p->caching) return 0;
    pthread_mutex_lock(&p->mu);
    int m = walk_chain(p, tokens, n_tokens, max_pages, 1, pages, hashes, NULL);
    p->queried += n_tokens;
    p->hit += (uint64_t)m * KV_TILE;
    pthread_mutex_unlock(&p->mu);
    return m;
}

int kvpool_peek(struct KvPool *p, const int32_t *tokens, size_t n_tokens, int max_pages,
                int *idle)
{
    *idle = 0;
    if (!p->caching) return 0;
    pthread_mutex_lock(&p->mu);
    int m = walk_chain(p, tokens, n_tokens, max_pages, 0, NULL, NULL, idle);
    pthread_mutex_unlock(&p->mu);
    return m;
}

void kvpool_publish(struct KvPool *p, int32_t page, int32_t parent, uint64_t hash,
                    const int32_t *tokens)
{
    if (!p->caching) return;
    pthread_mutex_lock(&p->mu);
    struct PageMeta *m = &p->meta[page];
    if (!m->published && (parent < 0 || p->meta[parent].published) &&
        find(p, hash, parent, tokens) < 0) {
        memcpy(p->tokens + (size_t)page * KV_TILE, tokens, KV_TILE * sizeof *tokens);
        m->hash = hash;
        m->parent = parent;
        m->parent_gen = parent >= 0 ? p->meta[parent].gen : 0;
        m->published = 1;
        size_t b = hash & p->bucket_mask;
        m->bucket_next = p->buckets[b];
        p->buckets[b] = page;
    }
    pthread_mutex_unlock(&p->mu);
}

void kvpool_release(struct KvPool *p, const int32_t *pages, int n)
{
    if (n <= 0) return;
    pthread_mutex_lock(&p->mu);
    for (int k = n - 1; k >= 0; k--) {
        int32_t i = pages[k];
        struct PageMeta *m = &p->meta[i];
        if (--m->ref > 0) continue;
        p->n_used--;
        if (m->published) {
            lru_append(p, i);
        } else {
            m->gen++;
            p->free_stack[p->n_free++] = i;
        }
    }
    pthread_mutex_unlock(&p->mu);
}
