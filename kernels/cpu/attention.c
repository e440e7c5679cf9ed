/* Causal attention on the CPU: flash attention with an online softmax, never an N x N matrix.
 * Prefill splits the work into (KV head, block of query tokens) tasks, heaviest first; each
 * K/V tile is converted to f32 once per task and reused by every query head of the group for
 * every token of the block. A few tokens (decode) split the keys instead (flash-decoding):
 * tasks of (KV head, key segment) leave partial softmax states that the last task of each
 * head merges. Segment sizes depend only on the sequence length, never on the thread count,
 * so results do not depend on it. Also owns the KV cache layout and the key/value stores. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/f16.h"

enum {
    ROWS_TARGET = 96,   /* query rows (tokens x heads of a group) per prefill task */
    ROWS_AMX = 256,     /* the same on the AMX path, whose tile packing is per task */
    SPLIT_MAX_TOK = 4,  /* chunks this short split the keys */
    SEG_MIN = 512,      /* keys per segment, at least */
    SEG_MAX_COUNT = 64, /* segments per head, at most */
    RB_MAX = 6,
};


static size_t round16(size_t v) { return (v + 15) & ~(size_t)15; }

size_t cpu_kv_head_stride(int n_ctx, int head_dim, enum KvType type)
{
    return (size_t)(n_ctx + KV_TILE - 1) / KV_TILE * kv_tile_elems(type, head_dim);
}

static int block_tokens(int G, int amx)
{
    int bq = (amx ? ROWS_AMX : ROWS_TARGET) / G;
    return bq < 4 ? 4 : bq;
}

static int seg_len(int n_keys)
{
    int per = (n_keys + SEG_MAX_COUNT - 1) / SEG_MAX_COUNT;
    per = (per + KV_TILE - 1) / KV_TILE * KV_TILE;
    return per < SEG_MIN ? SEG_MIN : per;
}

/* Floats of one thread's workspace for R rows: queries, K and V tiles, score rows (or the
 * tile unit's split queries, packed tiles and block buffers, whichever is larger). */
static size_t ws_floats(int R, int hd)
{
    size_t f32 = round16((size_t)R * hd) + 2 * round16((size_t)hd * KV_TILE) + RB_MAX * KV_TILE;
    size_t amx = round16(cpu_attend_amx_ws_floats(R, hd));
    return f32 > amx ? f32 : amx;
}

/* Floats of one softmax state of R rows: O (R, hd), M (R), L (R). */
static size_t state_floats(int R, int hd) { return round16((size_t)R * hd) + 2 * round16((size_t)R); }

static int max_rows(int G)
{
    int q = block_tokens(G, 1) * G, s = SPLIT_MAX_TOK * G;
    return q > s ? q : s;
}

/* The AMX path's packed tiles of every KV head over n_ctx positions (none where it cannot run). */
static size_t amx_packed_bytes(int n_ctx, int hd, int n_kv_head)
{
    if (hd % 32 || !cpu_amx_usable_once()) return 0;
    return (size_t)n_kv_head * ((n_ctx + KV_TILE - 1) / KV_TILE) * CPU_AMX_TILE_ELEMS(hd) *
           sizeof(uint16_t) + 64;
}

size_t cpu_attention_scratch(int n_tok_max, int n_ctx, int head_dim, int n_q_head,
                             int n_kv_head, int threads)
{
    (void)n_tok_max;
    int G = n_q_head / n_kv_head, R = max_rows(G);
    size_t per = ws_floats(R, head_dim) + state_floats(R, head_dim);
    /* Every sequence length up to n_ctx splits into at most this many segments. */
    int n_seg = (n_ctx + SEG_MIN - 1) / SEG_MIN;
    n_seg = n_seg > SEG_MAX_COUNT ? SEG_MAX_COUNT : n_seg;
    size_t parts = (size_t)n_kv_head * n_seg * state_floats(SPLIT_MAX_TOK * G, head_dim);
    return (per * (size_t)threads + parts + 16) * sizeof(float) +
           (size_t)n_kv_head * sizeof(atomic_int) + 64 + amx_packed_bytes(n_ctx, head_dim, n_kv_head);
}

/* The portable path: the same tiles and state as the vector paths, in plain loops. */
static void attend_scalar(const struct AttnArgs *a, int g, int t0, int bq, int kb, int ke,
                          float *ws, float *O, float *M, float *L)
{
    int hd = a->head_dim, G = a->n_q_head / a->n_kv_head, R = bq * G;
    float *Q = ws, *S = ws + round16((size_t)R * hd) + 2 * round16((size_t)hd * KV_TILE);
    const float qscale = a->scale * 1.44269504088896341f;
    for (int r = 0; r < R; r++) {
        const float *src = a->q + (size_t)(t0 + r / G) * a->q_stride + (size_t)(g * G + r % G) * hd;
        for (int d = 0; d < hd; d++) Q[(size_t)r * hd + d] = src[d] * qscale;
    }
    for (int k0 = kb; k0 < ke; k0 += KV_TILE) {
        int nk = ke - k0 < KV_TILE ? ke - k0 : KV_TILE;
        size_t base = kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride, a->kv_type, hd,
                                   g, k0);
        for (int r = 0; r < R; r++) {
            int nv = ATTN_ROW_POS(a, t0 + r / G) + 1 - k0;
            nv = nv > nk ? nk : nv;
            if (nv <= 0) continue;
            const float *q = Q + (size_t)r * hd;
            float m_tile = -INFINITY;
            for (int j = 0; j < nv; j++) {
                float s = 0.f;
                for (int d = 0; d < hd; d++) s += q[d] * cpu_kv_key(a->k, a->kv_type, base, d, j, hd);
                S[j] = s;
                if (s > m_tile) m_tile = s;
            }
            float m_new = m_tile > M[r] ? m_tile : M[r];
            float corr = m_new > M[r] ? (M[r] == -INFINITY ? 0.f : exp2f(M[r] - m_new)) : 1.f;
            float l = L[r] * corr;
            float *o = O + (size_t)r * hd;
            for (int d = 0; d < hd; d++) o[d] *= corr;
            for (int j = 0; j < nv; j++) {
                float p = exp2f(S[j] - m_new);
                l += p;
                for (int d = 0; d < hd; d++) o[d] += p * cpu_kv_value(a->v, a->kv_type, base, d, j, hd);
            }
            L[r] = l;
            M[r] = m_new;
        }
    }
}

typedef void (*attend_fn)(const struct AttnArgs *, int, int, int, int, int, float *, float *,
                          float *, float *);

static attend_fn attend_for(enum CpuIsa isa, int hd)
{
    if (isa == CPU_ISA_AVX512 && hd % 16 == 0) return cpu_attend_avx512;
    if (isa >= CPU_ISA_AVX2 && hd % 8 == 0) return cpu_attend_avx2;
    return attend_scalar;
}

int cpu_attn_amx_handles(enum CpuIsa isa, enum KvType kv_type, int hd)
{
    return isa == CPU_ISA_AVX512 && kv_type != KV_Q8 && hd % 32 == 0 && cpu_amx_usable_once();
}

static void state_init(int R, int hd, float *O, float *M, float *L)
{
    memset(O, 0, (size_t)R * hd * sizeof(float));
    for (int r = 0; r < R; r++) { M[r] = -INFINITY; L[r] = 0.f; }
}

/* Normalises R rows of state (tokens t0.., group g) into the output, combining the DIFF V2
 * head pairs when lambda is given. */
static void finish_rows(const struct AttnArgs *a, int g, int t0, int bq, const float *O,
                        const float *L)
{
    int hd = a->head_dim, G = a->n_q_head / a->n_kv_head;
    for (int t = 0; t < bq; t++)
        for (int j = 0; j < G; j++) {
            int r = t * G + j, h = g * G + j;
            const float *o = O + (size_t)r * hd;
            if (!a->lambda) {
                float inv = 1.f / L[r];
                float *dst = a->out + (size_t)(t0 + t) * a->out_stride + (size_t)h * hd;
                for (int d = 0; d < hd; d++) dst[d] = o[d] * inv;
            } else if (j % 2 == 0) {
                /* out_i = o_2i - sigmoid(lambda_i) o_2i+1 for output head i = h / 2. */
                float lam = a->lambda[(size_t)(t0 + t) * a->lambda_stride + h / 2];
                float sg = 1.f / (1.f + expf(-lam));
                float i1 = 1.f / L[r], i2 = sg / L[r + 1];
                const float *o2 = o + hd;
                float *dst = a->out + (size_t)(t0 + t) * a->out_stride + (size_t)(h / 2) * hd;
                for (int d = 0; d < hd; d++) dst[d] = o[d] * i1 - o2[d] * i2;
            }
        }
}

struct AttnJob {
    const struct AttnArgs *a;
    attend_fn attend;
    uint16_t *packed;          /* the AMX path: every head's tiles packed; NULL: f32 paths */
    int n_tiles;               /* tiles per head in `packed` */
    float *scratch;
    size_t per_thread;         /* floats: workspace then state */
    int R;                     /* rows of a task's state */
    int bq, n_qblocks;         /* prefill split */
    int seg, n_seg, k_end;     /* key split */
    float *parts;              /* (n_kv_head, n_seg) states */
    size_t part_floats;
    atomic_int *done;          /* (n_kv_head) segments finished */
};

static void qblock_task(void *ctx, int task, int thread)
{
    const struct AttnJob *job = ctx;
    const struct AttnArgs *a = job->a;
    int hd = a->head_dim, G = a->n_q_head / a->n_kv_head;
    /* Later blocks see more keys: hand them out first. */
    int qb = job->n_qblocks - 1 - task / a->n_kv_head, g = task % a->n_kv_head;
    int t0 = qb * job->bq, bq = a->n_tok - t0 < job->bq ? a->n_tok - t0 : job->bq;
    int R = bq * G;
    float *ws = job->scratch + job->per_thread * (size_t)thread;
    float *O = ws + ws_floats(job->R, hd);
    float *M = O + round16((size_t)job->R * hd), *L = M + round16((size_t)job->R);
    state_init(R, hd, O, M, L);
    int ke = ATTN_ROW_POS(a, t0 + bq - 1) + 1;
    if (job->packed)
        cpu_attend_amx(a, g, t0, bq, 0, ke,
                       job->packed + (size_t)g * job->n_tiles * CPU_AMX_TILE_ELEMS(hd), ws, O, M, L);
    else
        job->attend(a, g, t0, bq, 0, ke, ws, O, M, L);
    finish_rows(a, g, t0, bq, O, L);
}

/* Merges the n_seg partial states of head g (in segment order) and writes its outputs. */
static void merge_head(const struct AttnJob *job, int g, float *ws)
{
    const struct AttnArgs *a = job->a;
    int hd = a->head_dim, R = job->R;
    float *O = ws, *M = O + round16((size_t)R * hd), *L = M + round16((size_t)R);
    for (int r = 0; r < R; r++) {
        float mx = -INFINITY;
        for (int s = 0; s < job->n_seg; s++) {
            const float *pm = job->parts + ((size_t)g * job->n_seg + s) * job->part_floats +
                              round16((size_t)R * hd);
            if (pm[r] > mx) mx = pm[r];
        }
        float l = 0.f, *o = O + (size_t)r * hd;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int s = 0; s < job->n_seg; s++) {
            const float *po = job->parts + ((size_t)g * job->n_seg + s) * job->part_floats;
            const float *pm = po + round16((size_t)R * hd), *pl = pm + round16((size_t)R);
            if (pm[r] == -INFINITY) continue;
            float w = exp2f(pm[r] - mx);
            l += w * pl[r];
            for (int d = 0; d < hd; d++) o[d] += w * po[(size_t)r * hd + d];
        }
        M[r] = mx;
        L[r] = l;
    }
    finish_rows(a, g, 0, a->n_tok, O, L);
}

static void split_task(void *ctx, int task, int thread)
{
    const struct AttnJob *job = ctx;
    const struct AttnArgs *a = job->a;
    int hd = a->head_dim;
    /* Segments of one head are consecutive tasks, so each head's merge can start early. */
    int g = task / job->n_seg, s = task % job->n_seg;
    int kb = s * job->seg, ke = kb + job->seg < job->k_end ? kb + job->seg : job->k_end;
    float *ws = job->scratch + job->per_thread * (size_t)thread;
    float *O = job->parts + ((size_t)g * job->n_seg + s) * job->part_floats;
    float *M = O + round16((size_t)job->R * hd), *L = M + round16((size_t)job->R);
    state_init(job->R, hd, O, M, L);
    job->attend(a, g, 0, a->n_tok, kb, ke, ws, O, M, L);
    /* The task that completes a head merges it; acq_rel orders the other segments' states
     * before the merge reads them. */
    if (atomic_fetch_add_explicit(&job->done[g], 1, memory_order_acq_rel) == job->n_seg - 1)
        merge_head(job, g, ws + ws_floats(job->R, hd));
}

/* The AMX path's first pass: tile task % n_tiles of head task / n_tiles, packed. */
static void pack_task(void *ctx, int task, int thread)
{
    (void)thread;
    const struct AttnJob *job = ctx;
    const struct AttnArgs *a = job->a;
    int g = task / job->n_tiles, t = task % job->n_tiles;
    cpu_amx_pack_tile(a, g, t * KV_TILE, job->k_end,
                      job->packed + ((size_t)g * job->n_tiles + t) * CPU_AMX_TILE_ELEMS(a->head_dim));
}

void cpu_attention_with(enum CpuIsa isa, int amx, struct ThreadPool *pool,
                        const struct AttnArgs *a, void *scratch)
{
    int hd = a->head_dim, G = a->n_q_head / a->n_kv_head;
    int Rmax = max_rows(G);
    int prefill = a->n_tok > SPLIT_MAX_TOK || a->rowwise;
    struct AttnJob job = {
        .a = a,
        .attend = attend_for(isa, hd),
        .scratch = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63),
        .per_thread = ws_floats(Rmax, hd) + state_floats(Rmax, hd),
    };
    if (prefill) {
        int use_amx = amx && cpu_attn_amx_handles(isa, a->kv_type, hd);
        job.bq = block_tokens(G, use_amx);
        job.R = job.bq * G;
        job.n_qblocks = (a->n_tok + job.bq - 1) / job.bq;
        if (use_amx) {
            /* The packed tiles after the threads' workspaces (cpu_attention_scratch). */
            job.k_end = ATTN_ROW_POS(a, a->n_tok - 1) + 1;
            job.n_tiles = (job.k_end + KV_TILE - 1) / KV_TILE;
            job.packed = (uint16_t *)(void *)(job.scratch + job.per_thread * (size_t)pool_threads(pool));
            pool_run(pool, a->n_kv_head * job.n_tiles, pack_task, &job);
        }
        pool_run(pool, a->n_kv_head * job.n_qblocks, qblock_task, &job);
        return;
    }
    job.R = a->n_tok * G;
    job.k_end = ATTN_ROW_POS(a, a->n_tok - 1) + 1;
    job.seg = seg_len(job.k_end);
    job.n_seg = (job.k_end + job.seg - 1) / job.seg;
    job.part_floats = state_floats(SPLIT_MAX_TOK * G, hd);
    job.parts = job.scratch + job.per_thread * (size_t)pool_threads(pool);
    job.done = (atomic_int *)(void *)(job.parts + (size_t)a->n_kv_head * job.n_seg * job.part_floats);
    for (int g = 0; g < a->n_kv_head; g++) atomic_init(&job.done[g], 0);
    pool_run(pool, a->n_kv_head * job.n_seg, split_task, &job);
}

/* --- KV cache stores (layout in kernels/backend.h) --- */

/* One head's n (<= 256) values into int8 with one scale (largest magnitude / 127; 0 for all
 * zeros), rounded to nearest even: value d goes to q[d], or for a key (key = 1) to
 * q[cpu_kv_key_index(KV_Q8, d, 0)] (the caller adds the position's offset). The loops are
 * plain so that they vectorise: the largest magnitude as the largest of the magnitudes' bit
 * patterns (which order as the magnitudes do), and the rounding by adding and subtracting
 * 1.5 * 2^23, exact below 2^22. */
static void q8_row(const float *x, int n, int8_t *q, int key, float *scale)
{
    uint32_t mbits = 0;
    for (int d = 0; d < n; d++) {
        uint32_t b;
        memcpy(&b, x + d, sizeof b);
        b &= 0x7fffffffu;
        mbits = b > mbits ? b : mbits;
    }
    float amax;
    memcpy(&amax, &mbits, sizeof amax);
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t t[256];
    for (int d = 0; d < n; d++) t[d] = (int8_t)(int)((x[d] * inv + 12582912.f) - 12582912.f);
    if (key)
        for (int d = 0; d < n; d++) q[cpu_kv_key_index(KV_Q8, d, 0)] = t[d];
    else
        memcpy(q, t, (size_t)n);
    *scale = amax / 127.f;
}

void cpu_kv_store_rows(const struct RopeStoreArgs *a, int t0, int t1)
{
    int hd = a->head_dim;
    for (int t = t0; t < t1; t++) {
        int pos = a->pos ? a->pos[t] : a->pos0 + t, col = pos % KV_TILE;
        for (int g = 0; g < a->n_kv_head; g++) {
            size_t tile = kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride, a->kv_type,
                                       hd, g, pos);
            size_t kbase = tile + col, vbase = tile + (size_t)col * hd;
            const float *ks = a->k + (size_t)t * a->kv_stride + (size_t)g * hd;
            const float *vs = a->v + (size_t)t * a->kv_stride + (size_t)g * hd;
            if (a->kv_type == KV_F32) {
                float *kd = (float *)a->kcache, *vd = (float *)a->vcache;
                for (int d = 0; d < hd; d++) kd[kbase + (size_t)d * KV_TILE] = ks[d];
                memcpy(vd + vbase, vs, (size_t)hd * sizeof(float));
            } else if (a->kv_type == KV_F16) {
                uint16_t *kd = (uint16_t *)a->kcache, *vd = (uint16_t *)a->vcache;
                for (int d = 0; d < hd; d++) kd[kbase + (size_t)d * KV_TILE] = f32_to_f16(ks[d]);
                for (int d = 0; d < hd; d++) vd[vbase + d] = f32_to_f16(vs[d]);
            } else {
                int8_t *kd = (int8_t *)a->kcache + tile, *vd = (int8_t *)a->vcache + tile;
                q8_row(ks, hd, kd + cpu_kv_key_index(KV_Q8, 0, col), 1,
                       (float *)(void *)(kd + (size_t)hd * KV_TILE) + col);
                q8_row(vs, hd, vd + (size_t)col * hd, 0,
                       (float *)(void *)(vd + (size_t)hd * KV_TILE) + col);
            }
        }
    }
}

/* --- KV copies for chunk reuse (KvCopyArgs in kernels/backend.h) --- */

/* Bytes of one head's key (or value) in a packed row, its Q8 scale included. */
static size_t kv_head_bytes(const struct KvCopyArgs *a)
{
    return (size_t)a->head_dim * kv_elem_bytes(a->kv_type) +
           (a->kv_type == KV_Q8 ? sizeof(float) : 0);
}

/* Copies one head's key and value at position pos between the cache and a packed row:
 * out = 1 from the cache into the row, out = 0 from the row into the cache. */
static void kv_copy_head(const struct KvCopyArgs *a, int g, int pos, uint8_t *row, int out)
{
    int hd = a->head_dim, col = pos % KV_TILE;
    size_t eb = kv_elem_bytes(a->kv_type), hb = kv_head_bytes(a);
    size_t tile = kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride, a->kv_type, hd, g, pos);
    uint8_t *kc = (uint8_t *)a->kcache + tile * eb, *vc = (uint8_t *)a->vcache + tile * eb;
    uint8_t *kr = row + (size_t)g * 2 * hb, *vr = kr + hb;
    for (int d = 0; d < hd; d++) {
        uint8_t *src = kc + cpu_kv_key_index(a->kv_type, d, col) * eb;
        if (out) memcpy(kr + (size_t)d * eb, src, eb);
        else memcpy(src, kr + (size_t)d * eb, eb);
    }
    uint8_t *vsrc = vc + (size_t)col * hd * eb;
    if (out) memcpy(vr, vsrc, (size_t)hd * eb);
    else memcpy(vsrc, vr, (size_t)hd * eb);
    if (a->kv_type == KV_Q8) {
        float *ks = (float *)(void *)(kc + (size_t)hd * KV_TILE) + col;
        float *vs = (float *)(void *)(vc + (size_t)hd * KV_TILE) + col;
        if (out) {
            memcpy(kr + (size_t)hd, ks, sizeof *ks);
            memcpy(vr + (size_t)hd, vs, sizeof *vs);
        } else {
            memcpy(ks, kr + (size_t)hd, sizeof *ks);
            memcpy(vs, vr + (size_t)hd, sizeof *vs);
        }
    }
}

void cpu_kv_read(const struct KvCopyArgs *a)
{
    int hd = a->head_dim;
    for (int t = 0; t < a->n_tok; t++) {
        int pos = a->pos0 + t, col = pos % KV_TILE;
        for (int g = 0; g < a->n_kv_head; g++) {
            if (!a->k && !a->v) {
                kv_copy_head(a, g, pos, (uint8_t *)a->rows + (size_t)t * a->row_stride, 1);
                continue;
            }
            size_t tile = kv_tile_addr(a->pages, a->page_stride, a->kv_head_stride, a->kv_type,
                                       hd, g, pos);
            size_t at = (size_t)t * a->kv_stride + (size_t)g * hd;
            if (a->k)
                for (int d = 0; d < hd; d++)
                    a->k[at + d] = cpu_kv_key(a->kcache, a->kv_type, tile, d, col, hd);
            if (a->v)
                for (int d = 0; d < hd; d++)
                    a->v[at + d] = cpu_kv_value(a->vcache, a->kv_type, tile, d, col, hd);
        }
    }
}

void cpu_kv_write_packed(const struct KvCopyArgs *a)
{
    for (int t = 0; t < a->n_tok; t++)
        for (int g = 0; g < a->n_kv_head; g++)
            kv_copy_head(a, g, a->pos0 + t, (uint8_t *)a->rows + (size_t)t * a->row_stride, 0);
}

void cpu_kv_unpack(const struct KvCopyArgs *a, int t, float *k, float *v)
{
    int hd = a->head_dim;
    size_t hb = kv_head_bytes(a);
    const uint8_t *row = (const uint8_t *)a->rows + (size_t)t * a->row_stride;
    for (int g = 0; g < a->n_kv_head; g++)
        for (int w = 0; w < 2; w++) {
            const uint8_t *src = row + ((size_t)g * 2 + w) * hb;
            float *dst = (w ? v : k) + (size_t)g * hd;
            if (a->kv_type == KV_F32) {
                memcpy(dst, src, (size_t)hd * sizeof(float));
            } else if (a->kv_type == KV_F16) {
                for (int d = 0; d < hd; d++) {
                    uint16_t h;
                    memcpy(&h, src + 2 * (size_t)d, sizeof h);
                    dst[d] = f16_to_f32(h);
                }
            } else {
                float sc;
                memcpy(&sc, src + hd, sizeof sc);
                for (int d = 0; d < hd; d++) dst[d] = (float)(int8_t)src[d] * sc;
            }
        }
}
