/* Chunk KV copies in memory and the blend of a prompt's documents from them (chunkkv.h). The
 * copies sit in one array, found through a hash table of their keys; the budget is kept by
 * evicting the least recently used copy not needed by the blend being assembled. */
#include "model/chunkkv.h"

#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "text/errmsg.h"
#include "text/hash.h"

/* A copy as a record (chunkkv_record): this header, the tokens, the KV. */
#define RECORD_MAGIC 0x314b4b43u       /* "CKK1" */
#define RECORD_HEADER 32               /* u32 magic, n, kv_pos, 0; u64 frame hash, KV bytes */

struct RecordHeader {
    uint32_t magic, n, kv_pos, zero;
    uint64_t frame, kv_bytes;
};
_Static_assert(sizeof(struct RecordHeader) == RECORD_HEADER, "record header layout");

struct Copy {
    uint64_t key, frame;       /* hash of frame, lead and chunk; of frame and lead */
    int32_t *tokens;           /* the chunk's tokens (compared on a hash match) */
    int n, kv_pos;             /* tokens; the position its first token had */
    void *kv;                  /* engine_kv_export's copy */
    size_t bytes;              /* of kv and tokens */
    uint64_t used;             /* tick of the last use */
    uint64_t pin;              /* the blend that needs it (not evicted during it) */
    uint64_t made;             /* the blend that made it (0: read from a record) */
    struct RecordHeader header;  /* chunkkv_record's first piece */
};

struct ChunkKv {
    size_t budget, bytes;
    struct Copy *v;
    size_t n, cap;
    struct HashTable index;    /* key -> index in v (rebuilt after an eviction) */
    uint64_t tick, blend;
    struct ChunkKvStats st;
};

int chunkkv_new(size_t budget, struct ChunkKv **out)
{
    *out = NULL;
    if (budget == 0) return ENGINE_EINPUT;
    struct ChunkKv *c = calloc(1, sizeof *c);
    if (!c || hash_init(&c->index, 64)) {
        free(c);
        return ENGINE_ENOMEM;
    }
    c->budget = budget;
    *out = c;
    return ENGINE_OK;
}

static void copy_free(struct Copy *p)
{
    free(p->tokens);
    free(p->kv);
}

void chunkkv_destroy(struct ChunkKv **pc)
{
    struct ChunkKv *c = *pc;
    if (!c) return;
    for (size_t i = 0; i < c->n; i++) copy_free(&c->v[i]);
    free(c->v);
    hash_free(&c->index);
    free(c);
    *pc = NULL;
}

void chunkkv_stats(const struct ChunkKv *c, struct ChunkKvStats *out)
{
    *out = c->st;
    out->bytes = c->bytes;
    out->entries = c->n;
}

static int reindex(struct ChunkKv *c)
{
    hash_clear(&c->index);
    for (size_t i = 0; i < c->n; i++)
        if (!hash_insert(&c->index, c->v[i].key, i)) return -1;
    return 0;
}

static struct Copy *find(struct ChunkKv *c, uint64_t key, uint64_t frame, const int32_t *t, int n)
{
    size_t pos;
    for (struct HashSlot *s = hash_find(&c->index, key, &pos); s;
         s = hash_next(&c->index, key, &pos)) {
        struct Copy *p = &c->v[s->value];
        if (p->frame == frame && p->n == n && !memcmp(p->tokens, t, (size_t)n * sizeof *t))
            return p;
    }
    return NULL;
}

static uint64_t copy_key(uint64_t frame, const int32_t *t, int n)
{
    uint64_t key = hash_u64(frame ^ hash_bytes(t, (size_t)n * sizeof *t));
    return key == HASH_EMPTY ? 1 : key;
}

/* Room for `need` more bytes: the least recently used copies not pinned by this blend go.
 * 0, or -1 when they cannot make enough room. */
static int make_room(struct ChunkKv *c, size_t need)
{
    if (need > c->budget) return -1;
    int evicted = 0;
    while (c->bytes + need > c->budget) {
        size_t lru = c->n;
        for (size_t i = 0; i < c->n; i++)
            if (c->v[i].pin != c->blend && (lru == c->n || c->v[i].used < c->v[lru].used))
                lru = i;
        if (lru == c->n) break;
        c->bytes -= c->v[lru].bytes;
        copy_free(&c->v[lru]);
        c->v[lru] = c->v[--c->n];
        c->st.evictions++;
        evicted = 1;
    }
    if (evicted && reindex(c)) return -1;
    return c->bytes + need > c->budget ? -1 : 0;
}

/* A new copy of chunk t[0..n) (key, frame) whose first token was at kv_pos, with kvb bytes of
 * KV for the caller to fill, appended after making room. NULL when it does not fit or memory
 * runs out. */
static struct Copy *copy_add(struct ChunkKv *c, uint64_t key, uint64_t frame, const int32_t *t,
                             int n, int kv_pos, size_t kvb)
{
    size_t tb = (size_t)n * sizeof *t;
    if (make_room(c, kvb + tb)) return NULL;
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 64;
        struct Copy *v = realloc(c->v, cap * sizeof *v);
        if (!v) return NULL;
        c->v = v;
        c->cap = cap;
    }
    struct Copy p = {.key = key, .frame = frame, .n = n, .kv_pos = kv_pos, .bytes = kvb + tb,
                     .used = ++c->tick, .pin = c->blend};
    p.tokens = malloc(tb);
    p.kv = malloc(kvb);
    if (!p.tokens || !p.kv || !hash_insert(&c->index, key, c->n)) {
        copy_free(&p);
        return NULL;
    }
    memcpy(p.tokens, t, tb);
    c->v[c->n] = p;
    c->bytes += p.bytes;
    return &c->v[c->n++];
}

/* Takes back the copy copy_add just appended. */
static void copy_drop_last(struct ChunkKv *c)
{
    struct Copy *p = &c->v[--c->n];
    c->bytes -= p->bytes;
    copy_free(p);
    reindex(c);
}

/* A blend of a prompt's documents in progress (chunkkv_blend_begin). */
enum { JOB_FRAME, JOB_COPIES, JOB_BLEND };

struct ChunkKvJob {
    struct ChunkKv *c;
    struct Engine *e, *helper;
    const int32_t *prompt;     /* borrowed, as are the spans and leads */
    const uint32_t *spans;
    struct ChunkKvSpans info;  /* zero: no leads, none computed in full */
    int docs_start, docs_end, n_prompt, n_spans;
    double share;
    uint64_t frame;
    int phase;
    int span, at;              /* the next chunk span; where the last one ended */
    struct EngineKvPart *parts;
    int np;
    int32_t *buf;              /* the frame, lead and chunk whose copy the helper computes */
    int buf_n, buf_done;       /* its tokens; those in the helper (0: no copy under way) */
    int buf_lead;              /* the lead's tokens in it */
    uint64_t after;            /* what the span's copy is made after (chunkkv_after) */
    struct ChunkKvBlend out;
};

/* Span i's lead (*nl tokens; NULL when it has none). */
static const int32_t *span_lead(const struct ChunkKvJob *j, int i, int *nl)
{
    *nl = 0;
    if (!j->info.lead_tokens) return NULL;
    *nl = (int)(j->info.leads[2 * i + 1] - j->info.leads[2 * i]);
    return j->info.lead_tokens + j->info.leads[2 * i];
}

/* The span's part: none when it is computed in full (ChunkKvSpans.n_full); else its copy,
 * when the cache holds it, or the copy that the helper is to make (*making set, the frame,
 * lead and chunk in buf), or no copy (computed in the blend) when there is no room for one.
 * 0, or -1 out of memory. */
static int span_part(struct ChunkKvJob *j, int *making)
{
    struct ChunkKv *c = j->c;
    int s0 = (int)j->spans[2 * j->span], n = (int)j->spans[2 * j->span + 1] - s0, nl;
    const int32_t *t = j->prompt + s0, *lead = span_lead(j, j->span, &nl);
    *making = 0;
    if (chunkkv_span_full(&j->info, j->span)) {
        j->out.chunks++;
        j->out.full++;
        j->parts[j->np++] = (struct EngineKvPart){t, n, NULL, 0, 0, 0};
        return 0;
    }
    j->after = chunkkv_after(j->frame, lead, nl);
    uint64_t key = copy_key(j->after, t, n);
    struct Copy *p = find(c, key, j->after, t, n);
    if (p) {
        c->st.hits++;
        j->out.chunks++;
        p->used = ++c->tick;
        p->pin = c->blend;
        /* made for this prompt: an earlier span of it held the same chunk */
        j->parts[j->np++] = (struct EngineKvPart){t, n, p->kv, 0, p->kv_pos, p->made == c->blend};
        return 0;
    }
    c->st.misses++;
    int nf = j->docs_start;
    if (make_room(c, engine_kv_bytes(j->helper, n) + (size_t)n * sizeof *t) == 0) {
        j->buf = malloc((size_t)(nf + nl + n) * sizeof *j->buf);
        if (!j->buf) return -1;
        memcpy(j->buf, j->prompt, (size_t)nf * sizeof *j->buf);
        if (nl) memcpy(j->buf + nf, lead, (size_t)nl * sizeof *j->buf);
        memcpy(j->buf + nf + nl, t, (size_t)n * sizeof *j->buf);
        j->buf_n = nf + nl + n;
        j->buf_lead = nl;
        engine_reset(j->helper);
        j->buf_done = engine_take_cached(j->helper, j->buf, (size_t)j->buf_n);
        *making = 1;
        return 0;
    }
    j->out.chunks++;
    j->parts[j->np++] = (struct EngineKvPart){t, n, NULL, 0, 0, 1};
    return 0;
}

/* The helper's copy is computed: kept, and the span's part takes it (or, when it cannot be
 * kept, the span is computed in the blend). */
static void copy_made(struct ChunkKvJob *j, int ok)
{
    char err[256];
    struct ChunkKv *c = j->c;
    int at = j->docs_start + j->buf_lead, n = j->buf_n - at;
    const int32_t *t = j->prompt + j->spans[2 * j->span];
    struct Copy *p = NULL;
    if (ok && (p = copy_add(c, copy_key(j->after, t, n), j->after, t, n, at,
                            engine_kv_bytes(j->helper, n))) &&
        engine_kv_export(j->helper, at, n, p->kv, err, sizeof err) != ENGINE_OK) {
        copy_drop_last(c);
        p = NULL;
    }
    if (p) {
        p->made = c->blend;
        j->out.computed++;
    }
    engine_reset(j->helper);
    free(j->buf);
    j->buf = NULL;
    j->buf_n = j->buf_done = j->buf_lead = 0;
    j->out.chunks++;
    j->parts[j->np++] = (struct EngineKvPart){t, n, p ? p->kv : NULL, 0, p ? p->kv_pos : 0, 1};
}

int chunkkv_blend_begin(struct ChunkKv *c, struct Engine *e, struct Engine *helper,
                        const int32_t *prompt, int docs_start, int docs_end, int n_prompt,
                        const uint32_t *spans, int n_spans, const struct ChunkKvSpans *info,
                        double share, struct ChunkKvJob **out, char *err, size_t errlen)
{
    *out = NULL;
    int n0 = e ? engine_n_past(e) : 0;
    if (!c || !e || !helper || !prompt || docs_end <= n0 || docs_end <= docs_start ||
        n_prompt < docs_end || n_spans < 0 || (n_spans && !spans) || !(share >= 0 && share <= 1))
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a blend needs documents after the "
                          "sequence's tokens and a share in [0, 1]");
    for (int i = 0, at = docs_start; i < n_spans; i++) {
        if ((int)spans[2 * i] < at || spans[2 * i + 1] < spans[2 * i] ||
            (int)spans[2 * i + 1] > docs_end)
            return errmsg_set(err, errlen, ENGINE_EINPUT, "chunk span %d is outside the "
                              "documents or out of order", i);
        at = (int)spans[2 * i + 1];
    }
    if (info && info->lead_tokens && n_spans) {
        if (!info->leads)
            return errmsg_set(err, errlen, ENGINE_EINPUT, "leads come without their ranges");
        for (int i = 0; i < n_spans; i++)
            if (info->leads[2 * i] > info->leads[2 * i + 1] ||
                info->leads[2 * i + 1] > info->n_lead_tokens)
                return errmsg_set(err, errlen, ENGINE_EINPUT, "the lead of chunk span %d is "
                                  "outside the lead tokens", i);
    }
    struct ChunkKvJob *j = calloc(1, sizeof *j);
    if (j) j->parts = calloc(2 * (size_t)n_spans + 1, sizeof *j->parts);
    if (!j || !j->parts) {
        free(j);
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory for a blend");
    }
    *j = (struct ChunkKvJob){.c = c, .e = e, .helper = helper, .prompt = prompt, .spans = spans,
                             .docs_start = docs_start, .docs_end = docs_end,
                             .n_prompt = n_prompt, .n_spans = n_spans, .share = share,
                             .frame = chunkkv_frame(prompt, docs_start), .phase = JOB_FRAME,
                             .at = n0 > docs_start ? n0 : docs_start, .parts = j->parts};
    if (info && n_spans) {
        j->info = *info;
        if (!info->lead_tokens) j->info.leads = NULL;
    }
    c->blend++;
    *out = j;
    return ENGINE_OK;
}

int chunkkv_blend_step(struct ChunkKvJob *j, int tokens, int *done, struct ChunkKvBlend *out,
                       char *err, size_t errlen)
{
    *done = 0;
    int left = tokens > 0 ? tokens : 1, rc;
    while (left > 0 && j->phase == JOB_FRAME) {
        int n0 = engine_n_past(j->e), n = j->docs_start - n0 < left ? j->docs_start - n0 : left;
        if (n > 0 && (rc = engine_prefill(j->e, j->prompt + n0, (size_t)n, err, errlen)))
            return rc;
        left -= n > 0 ? n : 0;
        if (engine_n_past(j->e) >= j->docs_start) j->phase = JOB_COPIES;
    }
    while (left > 0 && j->phase == JOB_COPIES) {
        if (j->buf) {
            /* the helper computes the frame (mostly from the prefix cache) and the chunk */
            int n = j->buf_n - j->buf_done < left ? j->buf_n - j->buf_done : left;
            char e2[256];
            int ok = engine_prefill(j->helper, j->buf + j->buf_done, (size_t)n, e2,
                                    sizeof e2) == ENGINE_OK;
            left -= n;
            j->buf_done += n;
            if (!ok || j->buf_done == j->buf_n) {
                copy_made(j, ok);
                j->at = (int)j->spans[2 * j->span + 1];
                j->span++;
            }
            continue;
        }
        if (j->span == j->n_spans) {
            if (j->docs_end > j->at)
                j->parts[j->np++] = (struct EngineKvPart){j->prompt + j->at, j->docs_end - j->at,
                                                          NULL, 0, 0, 0};
            rc = engine_blend_begin(j->e, j->parts, j->np, j->share, j->prompt + j->docs_end,
                                    j->n_prompt - j->docs_end, err, errlen);
            if (rc) return rc;
            j->phase = JOB_BLEND;
            break;
        }
        int s0 = (int)j->spans[2 * j->span], s1 = (int)j->spans[2 * j->span + 1];
        if (s1 <= j->at) {   /* the sequence holds it (a cached prefix) */
            j->span++;
            continue;
        }
        if (s0 < j->at) {    /* it holds its start: the rest is computed */
            j->parts[j->np++] = (struct EngineKvPart){j->prompt + j->at, s1 - j->at, NULL, 0, 0,
                                                      0};
            j->at = s1;
            j->span++;
            continue;
        }
        if (s0 > j->at) {
            j->parts[j->np++] = (struct EngineKvPart){j->prompt + j->at, s0 - j->at, NULL, 0, 0, 0};
            j->at = s0;
        }
        if (s1 == s0) {
            j->span++;
            continue;
        }
        int making;
        if (span_part(j, &making))
            return errmsg_set(err, errlen, ENGINE_ENOMEM, "out of memory for a chunk's copy");
        if (!making) {
            j->at = s1;
            j->span++;
        }
    }
    if (left <= 0 || j->phase != JOB_BLEND) return ENGINE_OK;
    struct EngineBlendStats st;
    int fin = 0;
    rc = engine_blend_step(j->e, left, &fin, &st, err, errlen);
    if (rc || !fin) return rc;
    j->out.probed = st.probed;
    j->out.probe_s = st.probe_s;
    j->out.reused = st.reused - st.fresh;
    j->out.fresh = st.fresh;
    j->out.recomputed = st.recomputed;
    j->out.bytes_read = st.imported_bytes;
    *out = j->out;
    *done = 1;
    return ENGINE_OK;
}

void chunkkv_blend_end(struct ChunkKvJob **pj)
{
    struct ChunkKvJob *j = *pj;
    if (!j) return;
    if (j->buf) engine_reset(j->helper);
    free(j->buf);
    free(j->parts);
    free(j);
    *pj = NULL;
}

int chunkkv_blend(struct ChunkKv *c, struct Engine *e, struct Engine *helper,
                  const int32_t *prompt, int docs_start, int docs_end, int n_prompt,
                  const uint32_t *spans, int n_spans, const struct ChunkKvSpans *info,
                  double share, struct ChunkKvBlend *out, char *err, size_t errlen)
{
    struct ChunkKvJob *j;
    memset(out, 0, sizeof *out);
    int rc = chunkkv_blend_begin(c, e, helper, prompt, docs_start, docs_end, n_prompt, spans,
                                 n_spans, info, share, &j, err, errlen);
    for (int done = 0; rc == ENGINE_OK && !done;)
        rc = chunkkv_blend_step(j, 1 << 22, &done, out, err, errlen);
    chunkkv_blend_end(&j);
    return rc;
}

uint64_t chunkkv_identity(const struct Model *m, enum KvType kv_type, const char *numerics)
{
    /* the configuration's fields are all 4 bytes wide: no padding to hash */
    uint64_t h = hash_bytes(&m->cfg, sizeof m->cfg);
    h = hash_u64(h ^ hash_bytes(m->arena, m->arena_bytes));
    h = hash_u64(h ^ hash_bytes(numerics, strlen(numerics)));
    return hash_u64(h ^ (uint64_t)kv_type);
}

uint64_t chunkkv_frame(const int32_t *prompt, int docs_start)
{
    return hash_bytes(prompt, (size_t)docs_start * sizeof *prompt);
}

int chunkkv_span_full(const struct ChunkKvSpans *s, int i)
{
    return s && s->ranks && s->n_full > 0 && s->ranks[i] < (uint32_t)s->n_full;
}

uint64_t chunkkv_after(uint64_t frame, const int32_t *lead, int n)
{
    return n > 0 ? hash_u64(frame ^ hash_bytes(lead, (size_t)n * sizeof *lead)) : frame;
}

uint64_t chunkkv_key(uint64_t frame, const int32_t *t, int n)
{
    return copy_key(frame, t, n);
}

int chunkkv_has(struct ChunkKv *c, uint64_t frame, const int32_t *t, int n)
{
    return find(c, copy_key(frame, t, n), frame, t, n) != NULL;
}

int chunkkv_record(struct ChunkKv *c, uint64_t frame, const int32_t *t, int n,
                   struct ChunkKvRecord *out)
{
    struct Copy *p = find(c, copy_key(frame, t, n), frame, t, n);
    if (!p) return 0;
    size_t tb = (size_t)n * sizeof *t;
    p->header = (struct RecordHeader){RECORD_MAGIC, (uint32_t)n, (uint32_t)p->kv_pos, 0,
                                      p->frame, p->bytes - tb};
    *out = (struct ChunkKvRecord){{&p->header, p->tokens, p->kv},
                                  {RECORD_HEADER, tb, p->bytes - tb}};
    return 1;
}

int chunkkv_insert(struct ChunkKv *c, const struct Engine *e, uint64_t frame, const int32_t *t,
                   int n, const void *rec, size_t len, char *err, size_t errlen)
{
    struct RecordHeader h;
    size_t tb = (size_t)n * sizeof *t, kvb = engine_kv_bytes(e, n);
    if (len < RECORD_HEADER)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "a chunk KV record of %zu bytes is too "
                          "short", len);
    memcpy(&h, rec, sizeof h);
    const uint8_t *at = (const uint8_t *)rec + RECORD_HEADER;
    if (h.magic != RECORD_MAGIC || h.zero != 0)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "not a chunk KV record of this format");
    if (h.n != (uint32_t)n || h.frame != frame || h.kv_bytes != kvb || len != RECORD_HEADER + tb + kvb ||
        memcmp(at, t, tb))
        return errmsg_set(err, errlen, ENGINE_EINPUT, "the chunk KV record is of other tokens, "
                          "another frame or another KV encoding");
    if (h.kv_pos > (uint32_t)ENGINE_MAX_CTX)
        return errmsg_set(err, errlen, ENGINE_EINPUT, "the chunk KV record's position %u is out "
                          "of range", h.kv_pos);
    uint64_t key = copy_key(frame, t, n);
    if (find(c, key, frame, t, n)) return ENGINE_OK;
    struct Copy *p = copy_add(c, key, frame, t, n, (int)h.kv_pos, kvb);
    if (!p)
        return errmsg_set(err, errlen, ENGINE_ENOMEM, "no room in memory for the chunk's KV");
    memcpy(p->kv, at + tb, kvb);
    return ENGINE_OK;
}
