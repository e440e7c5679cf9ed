/* The batch scheduler of a worker's compute thread (daemon/worker_internal.h).
 *
 * Up to max_running requests at once. Each engine step takes the next decode token of every
 * request that is decoding and, within the step's token budget (while a request decodes,
 * step_tokens and no more than fit step_ms at the speed the last steps measured; else the
 * context's prefill chunk), prompt chunks of the others in the order they came
 * (Sarathi-Serve's stall-free batching: a long prompt never stops the others' tokens for more
 * than one short step). New jobs and cancels are read between steps. A request starts when
 * the pages it is promised (its prompt and max_tokens, less its cached prefix) fit beside what
 * the started ones are promised, so a tight pool runs fewer at once rather than thrash. When
 * the pool still has no page for a started one (other workers share it), the request that
 * came last is preempted: its pages go back, and it is recomputed later, its prompt in
 * prefill chunks and the tokens it had generated fed again one per step as the decode tokens
 * they were, so every position gets the same keys and values as before and the answer goes
 * on exactly as it would have (on a GPU, within the products' rounding). With
 * chunk KV reuse a request's documents are blended in steps too (docs/kv-reuse.md): the blend
 * takes what is left of a step's budget after the engine's step, one blend at a time. */
#include "daemon/worker_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/fault.h"
#include "daemon/log.h"
#include "daemon/zutil.h"
#include "model/lookup.h"

struct Seq {
    struct WireJob job;
    struct Engine *e;
    struct GenState *gen;
    struct RunCtx rc;
    int32_t *hist;              /* the prompt, then every generated token (the last one is the
                                   next to feed) */
    size_t n_hist, cap_hist;
    size_t n_prompt;
    size_t done;                /* tokens of hist in the engine */
    int started;                /* a step computed some of it (and it holds pages) */
    int decoding;               /* the first token was sampled */
    int cancelled, reason;
    int cached;
    int no_blend;               /* a blend failed: the prompt is prefilled as it is */
    int reused;                 /* document tokens whose stored KV stayed in the last blend */
    struct ChunkKvJob *blend;   /* its documents' blend, under way between steps */
    struct QuoteIndex *quote;   /* quote decoding: the index of its documents; NULL: free text */
    unsigned char *to_write;    /* the blend's chunks whose copies go to the store after it */
    uint64_t frame;             /* the hash of the blend's frame */
    double t_blend;             /* when the blend began */
    int blend_steps;            /* the steps it has taken */
    long blend_others;          /* tokens other sequences computed in those steps */
    double t_prefilled;
    uint64_t order;
    int32_t draft[LOOKUP_MAX_DRAFT + 1]; /* a verify step's rows: the next token, then the
                                   tokens drafted after it (prompt lookup) */
};

static int hist_push(struct Seq *q, int32_t t)
{
    if (q->n_hist == q->cap_hist) {
        size_t cap = q->cap_hist ? q->cap_hist * 2 : 64;
        int32_t *h = realloc(q->hist, cap * sizeof *h);
        if (!h)
            return -1;
        q->hist = h;
        q->cap_hist = cap;
    }
    q->hist[q->n_hist++] = t;
    return 0;
}

static void seq_blend_drop(struct Worker *w, struct Seq *q);

static void seq_free(struct Worker *w, struct Seq *q)
{
    seq_blend_drop(w, q);
    if (q->e) {
        engine_reset(q->e);
        w->seq_e[w->n_seq_e++] = q->e;   /* back to the idle contexts */
    }
    gen_abort(&q->gen);
    quote_index_destroy(&q->quote);
    worker_sigbuf_free(&q->rc.sig);
    free(q->hist);
    wire_job_free(&q->job);
    free(q);
}

/* A new job: decoded, given a context, grounded, its cached prefix taken. NULL after answering
 * it with an error. */
static struct Seq *seq_admit(struct Worker *w, void *pair, uint64_t job_id, const void *body,
                             size_t len, uint64_t order)
{
    char err[512];
    struct Seq *q = calloc(1, sizeof *q);
    if (!q) {
        worker_send_error(pair, job_id, "internal", "out of memory");
        return NULL;
    }
    q->job.job = job_id;
    if (wire_job_decode(body, len, &q->job, err, sizeof err)) {
        worker_send_error(pair, job_id, "internal", err);
        free(q);
        return NULL;
    }
    const char *code = "internal";
    if (fault_hit(FAULT_WORKER_ENGINE_ERROR)) {
        snprintf(err, sizeof err, "the engine failed (injected fault)");
        goto fail;
    }
    if (q->job.n_tokens + 1 > (size_t)engine_opts(w->e)->n_ctx) {
        snprintf(err, sizeof err, "the prompt has %zu tokens; this worker's context holds %d",
                 q->job.n_tokens, engine_opts(w->e)->n_ctx);
        code = "too_large";
        goto fail;
    }
    if (w->n_seq_e > 0) {
        q->e = w->seq_e[--w->n_seq_e];
    } else if (engine_new_seq(w->e, &q->e, err, sizeof err)) {
        goto fail;
    }
    /* a prompt the whole pool cannot hold never runs; anything smaller runs, alone if need be */
    long pool = engine_pages_total(q->e), need = engine_pages_needed(q->e, (int)q->job.n_tokens);
    if (pool > 0 && need > pool) {
        snprintf(err, sizeof err, "the KV pool cannot hold this request: its prompt needs %ld "
                 "pages and the pool has %ld; raise kv_pool_bytes", need, pool);
        code = "overloaded";
        goto fail;
    }
    for (size_t i = 0; i < q->job.n_tokens; i++)
        if (hist_push(q, q->job.tokens[i])) {
            snprintf(err, sizeof err, "out of memory");
            goto fail;
        }
    if (worker_ground(w->m, q->e, &q->job, err, sizeof err))
        goto fail;
    q->rc = (struct RunCtx){ .w = w, .pair = pair, .job = job_id, .cancelled = &q->cancelled,
                             .stream = q->job.stream, .t0 = zu_now_ms() };
    struct GenParams p;
    memset(&p, 0, sizeof p);
    p.max_tokens = q->job.max_tokens;
    sampler_params_default(&p.sampler);
    p.sampler.temperature = q->job.temperature;
    p.sampler.top_p = q->job.top_p;
    p.sampler.seed = q->job.seed;
    p.stop = (const char *const *)q->job.stop;
    p.n_stop = q->job.n_stop;
    p.lookup = w->o.lookup;
    if (q->job.quote) {
        if (quote_index_new(q->job.tokens, q->job.n_tokens, q->job.doc_spans, q->job.n_spans,
                            w->m->tok, &q->quote, err, sizeof err))
            goto fail;
        p.quote = q->quote;
        q->rc.sig.quoting = 1;
    }
    if (gen_begin(w->m, &p, worker_on_token, &q->rc, &q->gen, err, sizeof err))
        goto fail;
    q->n_prompt = q->n_hist;
    q->cached = -1;             /* its cached prefix is taken when it starts */
    q->order = order;
    return q;
fail:
    worker_send_error(pair, job_id, code, err);
    seq_free(w, q);
    return NULL;
}

/* The end of a sequence: its result (the answer so far when cancelled), then it is freed. */
static void seq_finish(struct Worker *w, void *pair, struct Seq *q, int cancelled)
{
    struct GenResult g;
    struct WireResult r = { .job = q->job.job, .prompt_tokens = (int64_t)q->job.n_tokens,
                            .cached_tokens = q->cached > 0 ? q->cached : 0,
                            .reused_tokens = q->reused, .has_signals = 1 };
    double now = zu_now_ms();
    if (gen_end(&q->gen, cancelled, &g) || q->rc.sig.oom) {
        worker_send_error(pair, q->job.job, "internal", "out of memory for the answer");
        if (g.text)
            free(g.text);
        seq_free(w, q);
        return;
    }
    r.prefill_ms = (q->decoding ? q->t_prefilled : now) - q->rc.t0;
    switch (g.finish) {
    case FINISH_STOP: r.finish = WF_STOP; break;
    case FINISH_LENGTH: r.finish = WF_LENGTH; break;
    case FINISH_CANCELLED:
        r.finish = q->reason == WIRE_REASON_DEADLINE ? WF_DEADLINE : WF_CANCELLED;
        break;
    default: r.finish = WF_ERROR; r.code = "internal"; r.code_len = 8; break;
    }
    r.text = g.text;
    r.text_len = g.text_len;
    r.completion_tokens = g.n_generated;
    r.ttft_ms = q->rc.got_first ? q->rc.ttft_ms : 0;
    r.decode_ms = q->decoding ? now - q->t_prefilled : 0;
    r.sig = q->rc.sig.s;
    r.hidden = worker_sigbuf_hidden(&q->rc.sig, &r.n_hidden);
    uint32_t quotes[3 * QUOTE_MAX_SPANS];
    r.quotes = quotes;
    r.n_quotes = worker_quote_bytes(w->m->tok, &q->job, g.quotes, g.n_quotes, g.text_len, quotes);
    /* alone, between steps: a few dozen tokens against the sequence's pages */
    worker_after_answer(w, &q->job, q->e, q->hist + q->n_prompt, q->n_hist - q->n_prompt, &r);
    worker_send_result(pair, &r);
    free(r.hidden);
    free(g.text);
    seq_free(w, q);
}

/* After a step gave the sequence its next token's logits: sample, stream, and either go on
 * decoding (0) or finish: answered and freed (1). */
static int seq_advance(struct Worker *w, void *pair, struct Seq *q)
{
    char err[256];
    if (!q->decoding) {
        q->decoding = 1;
        q->t_prefilled = zu_now_ms();
    }
    int32_t next;
    int rc = gen_next(q->gen, q->e, &next, err, sizeof err);
    if (rc < 0) {
        worker_send_error(pair, q->job.job, "internal", err);
        seq_free(w, q);
        return 1;
    }
    if (rc == 0 || q->cancelled) {
        seq_finish(w, pair, q, q->cancelled);
        return 1;
    }
    if (hist_push(q, next)) {
        worker_send_error(pair, q->job.job, "internal", "out of memory");
        seq_free(w, q);
        return 1;
    }
    return 0;
}

/* Prompt lookup: the tokens drafted after the sequence's next one (at most room), in
 * q->draft after that token; 0 when it decodes alone. A draft never needs a page that the
 * token alone would not, so verify steps change nothing in the pool's accounting. */
static int seq_draft(struct Seq *q, int room)
{
    if (q->done + 1 != q->n_hist)
        return 0;               /* catching up after a preemption: not the answer's end yet */
    int k = gen_draft_room(q->gen, q->e);
    if (k > room)
        k = room;
    while (k > 0 && engine_pages_needed(q->e, k + 1) > engine_pages_needed(q->e, 1))
        k--;
    k = gen_draft(q->gen, q->hist, (int)q->n_hist, q->draft + 1, k);
    q->draft[0] = q->hist[q->done];
    return k;
}

/* After a verify step of the sequence's next token and k drafted ones: each row in turn is
 * advanced as a decode step's would be, while the model chooses the drafted token (which is
 * then in the engine already). 1 when the sequence was answered and freed, as seq_advance. */
static int seq_advance_drafted(struct Worker *w, void *pair, struct Seq *q, int k)
{
    for (int i = 0;; i++) {
        if (k && engine_verify_keep(q->e, i)) {
            worker_send_error(pair, q->job.job, "internal", "a verify step lost its rows");
            seq_free(w, q);
            return 1;
        }
        size_t at = q->n_hist;
        if (seq_advance(w, pair, q))
            return 1;
        if (i == k || q->hist[at] != q->draft[i + 1])
            return 0;
        q->done++;
        if (w->o.stats)
            atomic_fetch_add(&w->o.stats->lookup_accepted, 1);
    }
}

struct Sched {
    struct Seq *run[WIRE_MAX_RUNNING];
    int n;
    uint64_t next_order;
    long promised;      /* the pages this worker published as promised (sched_promise) */
    /* step_ms's estimates, exponential averages (0: none yet): seconds of a step of decode
     * tokens alone, and seconds each prefill token adds to such a step */
    double t_decode, t_token;
};

/* Prefill tokens a step beside decoding requests takes at least, however slow: the prompt
 * still advances. */
enum { STEP_MIN_PREFILL = 8 };

static double ema(double avg, double v) { return avg > 0 ? 0.7 * avg + 0.3 * v : v; }

/* After a step of nd decode and np prefill tokens that took t seconds. */
static void sched_timed(struct Sched *sc, int nd, int np, double t)
{
    if (nd > 0 && np == 0) {
        sc->t_decode = ema(sc->t_decode, t);
    } else if (np > 0 && (nd > 0 || sc->t_token == 0)) {
        /* a prefill-only step (whole chunks, cheaper per token) only starts the estimate */
        double per = (t - (nd > 0 ? sc->t_decode : 0)) / np;
        if (per > 0)
            sc->t_token = ema(sc->t_token, per);
    }
}

static void sched_remove(struct Sched *sc, int i)
{
    memmove(&sc->run[i], &sc->run[i + 1], (size_t)(sc->n - i - 1) * sizeof *sc->run);
    sc->n--;
}

/* How long the thread waits for a message when it has requests but none could run (their
 * pages are held by other workers' requests), before it tries again. */
enum { SCHED_PAUSE_MS = 5 };

/* Reads the messages waiting on the PAIR (waits for one when nothing runs; up to
 * SCHED_PAUSE_MS when `paused`, nothing having run in the last step): jobs join, cancels mark
 * their sequence. Returns -1 when the thread is to end (DISCONNECT, a failed socket or an
 * injected exit). */
static int sched_read(struct Worker *w, void *pair, struct Sched *sc, int paused, int *stop)
{
    if (paused && sc->n) {
        zmq_pollitem_t pi = { pair, 0, ZMQ_POLLIN, 0 };
        zmq_poll(&pi, 1, SCHED_PAUSE_MS);
    }
    for (;;) {
        struct ZuMsg m;
        if (zu_recv(pair, &m, sc->n ? ZMQ_DONTWAIT : 0)) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN ? 0 : -1;
        }
        uint8_t cmd = m.n >= 1 && zu_size(&m, 0) == 1 ? *(const uint8_t *)zu_data(&m, 0) : 0;
        const uint8_t *b = m.n == 2 ? zu_data(&m, 1) : NULL;
        size_t bl = m.n == 2 ? zu_size(&m, 1) : 0;
        if (cmd == WIRE_DISCONNECT) {
            zu_close(&m);
            *stop = 1;
            return 0;
        }
        if (cmd == WIRE_JOB && fault_hit(FAULT_WORKER_THREAD_EXIT)) {
            dlog(LL_WARN, "msg=\"compute thread exits (injected fault)\" worker=%d", w->o.index);
            zu_close(&m);
            return -1;
        }
        if (cmd == WIRE_JOB && bl >= 8) {
            if (sc->n >= WIRE_MAX_RUNNING) {
                worker_send_error(pair, wire_get_u64(b), "overloaded", "worker full");
            } else {
                struct Seq *q = seq_admit(w, pair, wire_get_u64(b), b + 8, bl - 8, sc->next_order++);
                if (q)
                    sc->run[sc->n++] = q;
            }
        } else if (cmd == WIRE_CANCEL && bl >= 9) {
            uint64_t job = wire_get_u64(b);
            for (int i = 0; i < sc->n; i++)
                if (sc->run[i]->job.job == job && !sc->run[i]->cancelled) {
                    sc->run[i]->cancelled = 1;
                    sc->run[i]->reason = b[8];
                }
        }
        zu_close(&m);
        if (!sc->n)
            continue;   /* nothing runs: wait for a job */
    }
}

static void stats_step(struct WorkerStats *st, int tokens)
{
    if (!st)
        return;
    atomic_fetch_add(&st->steps, 1);
    atomic_fetch_add(&st->step_tokens, (uint64_t)tokens);
    int b = 0;
    while (b < WORKER_STEP_BUCKETS - 1 && tokens > (1 << b))
        b++;
    atomic_fetch_add(&st->step_bucket[b], 1);
}

/* Whether a sequence that starts now blends its documents from stored chunk KV (docs/
 * kv-reuse.md): the worker keeps a chunk store, the job says where its documents are, and a
 * question follows them. */
static int seq_blends(const struct Worker *w, const struct Seq *q)
{
    return w->ckv && !q->no_blend && q->job.docs[1] > q->job.docs[0] &&
           q->job.docs[1] < q->n_prompt;
}

/* The worker's chunk-reuse figures after a blend: the blend's own, and what the store's changed
 * by since the last update. */
static void stats_blend(struct Worker *w, const struct ChunkKvBlend *b)
{
    struct WorkerStats *st = w->o.stats;
    struct ChunkKvStats now;
    chunkkv_stats(w->ckv, &now);
    if (st) {
        atomic_fetch_add(&st->kv_reused, (uint64_t)b->reused);
        atomic_fetch_add(&st->kv_recomputed, (uint64_t)b->recomputed);
        atomic_fetch_add(&st->kv_fresh, (uint64_t)b->fresh);
        atomic_fetch_add(&st->kv_bytes_read, (uint64_t)b->bytes_read);
        atomic_fetch_add(&st->kv_hits, now.hits - w->ckv_last.hits);
        atomic_fetch_add(&st->kv_misses, now.misses - w->ckv_last.misses);
        /* unsigned wrap-around adds the (possibly negative) change */
        atomic_fetch_add(&st->kv_store_bytes, (uint64_t)now.bytes - (uint64_t)w->ckv_last.bytes);
        atomic_fetch_add(&st->kv_store_chunks,
                         (uint64_t)now.entries - (uint64_t)w->ckv_last.entries);
    }
    w->ckv_last = now;
}

/* A blend under way ends unfinished: the helper's copy under way is dropped, and the copies it
 * made are written to the store as a finished blend's are (a restart finds them in memory and
 * would not write them). The caller resets the sequence. */
static void seq_blend_drop(struct Worker *w, struct Seq *q)
{
    if (q->blend) {
        chunkkv_blend_end(&q->blend);
        if (q->to_write)
            records_save(w, &q->job, q->hist, q->frame, q->to_write);
    }
    free(q->to_write);
    q->to_write = NULL;
}

/* A blend that failed: logged, and the sequence starts over on the exact path (its pages back,
 * no blend). */
static void seq_blend_failed(struct Worker *w, struct Seq *q, const char *err)
{
    dlog(LL_WARN, "msg=\"chunk KV reuse failed; the prompt is prefilled instead\" worker=%d "
         "job=%llu error=\"%s\"", w->o.index, (unsigned long long)q->job.job, err);
    seq_blend_drop(w, q);
    engine_reset(q->e);
    q->no_blend = 1;
    q->reused = 0;
    q->done = engine_take_cached(q->e, q->hist, q->n_prompt);
    stats_blend(w, &(struct ChunkKvBlend){0});
}

/* The blend of a sequence that has just started (holding its cached prefix) begins: the
 * records of its stored chunks that the chunk store lacks are read; then its steps (seq_blend_
 * step) prefill the rest of the frame, make the copies still lacking and blend the documents. */
static void seq_blend_begin(struct Worker *w, struct Seq *q)
{
    char err[256];
    q->t_blend = zu_now_ms();
    q->blend_steps = 0;
    q->blend_others = 0;
    q->frame = chunkkv_frame(q->hist, (int)q->job.docs[0]);
    q->to_write = w->o.kv_store && q->job.chunk_refs ? calloc(q->job.n_spans + 1, 1) : NULL;
    if (q->to_write)
        records_load(w, &q->job, q->hist, q->frame, q->to_write);
    struct ChunkKvSpans info = { q->job.lead_tokens, q->job.n_lead_tokens, q->job.doc_leads,
                                 q->job.doc_ranks, w->o.kv_reuse_full };
    if (chunkkv_blend_begin(w->ckv, q->e, w->ckv_helper, q->hist, (int)q->job.docs[0],
                            (int)q->job.docs[1], (int)q->n_prompt, q->job.doc_spans,
                            (int)q->job.n_spans, &info, w->o.kv_reuse_recompute, &q->blend,
                            err, sizeof err))
        seq_blend_failed(w, q, err);
}

/* About `tokens` tokens' worth of the blend, while others computed `others` tokens in this
 * step. When it ends, done ends the documents and the copies it made go to the store. */
static void seq_blend_step(struct Worker *w, struct Seq *q, int tokens, int others)
{
    char err[256];
    struct ChunkKvBlend b;
    int fin = 0;
    q->blend_steps++;
    q->blend_others += others;
    if (chunkkv_blend_step(q->blend, tokens, &fin, &b, err, sizeof err)) {
        seq_blend_failed(w, q, err);
        return;
    }
    if (!fin)
        return;
    chunkkv_blend_end(&q->blend);
    q->done = q->job.docs[1];
    q->reused = b.reused;
    stats_blend(w, &b);
    if (q->to_write)
        records_save(w, &q->job, q->hist, q->frame, q->to_write);
    free(q->to_write);
    q->to_write = NULL;
    dlog(LL_DEBUG, "msg=\"documents blended\" worker=%d job=%llu chunks=%d made=%d full=%d "
         "reused=%d fresh=%d recomputed=%d probed=%d probe_ms=%.1f steps=%d others_tokens=%ld "
         "ms=%.1f", w->o.index, (unsigned long long)q->job.job, b.chunks, b.computed, b.full,
         b.reused, b.fresh, b.recomputed, b.probed, b.probe_s * 1e3, q->blend_steps,
         q->blend_others, zu_now_ms() - q->t_blend);
}

/* ---- pages: what a request is promised, and what it costs the pool to start ----
 * A request is promised the positions of its prompt and of the max_tokens answer tokens it
 * may generate (within its context). It starts only when what it would take (those pages,
 * less the prefix it finds cached, plus the cached pages it takes that nobody else holds: they
 * stop being available) fits in the pages nobody uses less what the started requests, of
 * this worker and the others sharing the pool, are promised and do not hold yet. A started
 * request then never lacks a page, and a tight pool runs fewer requests at once instead of
 * preempting them (docs/configuration.md, Continuous batching). Under FAULT_SCHED_OVERCOMMIT
 * a step admits as before projections: a new request on its first chunk's pages, a started
 * one keeping room for its next token, so a small pool runs out and preempts. */

/* Pages the blend helper needs for the frame and the longest lead and chunk after it. */
static long helper_pages(const struct Worker *w, const struct Seq *q)
{
    int longest = 0;
    const uint32_t *l = q->job.doc_leads;
    for (size_t i = 0; i < q->job.n_spans; i++) {
        int n = (int)(q->job.doc_spans[2 * i + 1] - q->job.doc_spans[2 * i]) +
                (l ? (int)(l[2 * i + 1] - l[2 * i]) : 0);
        if (n > longest)
            longest = n;
    }
    int helper = (int)q->job.docs[0] + longest - engine_n_past(w->ckv_helper);
    return helper > 0 ? engine_pages_needed(w->ckv_helper, helper) : 0;
}

/* The positions a request is promised: its prompt and max_tokens answer tokens, within its
 * context. */
static int seq_span(const struct Seq *q)
{
    long n = (long)q->n_prompt + (q->job.max_tokens > 0 ? q->job.max_tokens : 1);
    int ctx = engine_opts(q->e)->n_ctx;
    return n < ctx ? (int)n : ctx;
}

/* Pages a started request may still take: up to its promised positions, and the helper's
 * while its documents blend (overcommitting: its next token's, or a blend's prompt's). */
static long seq_ahead(const struct Worker *w, const struct Seq *q, int overcommit)
{
    int n_past = engine_n_past(q->e);
    int left = !overcommit ? seq_span(q) - n_past : q->blend ? (int)q->n_prompt - n_past : 1;
    return (left > 0 ? engine_pages_needed(q->e, left) : 0) + (q->blend ? helper_pages(w, q) : 0);
}

/* What starting request q now costs the pool, in pages (blend: its documents blend; chunk:
 * its first chunk's tokens, for overcommitting). */
static long seq_cost(const struct Worker *w, const struct Seq *q, int blend, int chunk,
                     int overcommit)
{
    long helper = blend ? helper_pages(w, q) : 0;
    if (overcommit)
        return engine_pages_needed(q->e, blend ? (int)q->n_prompt : chunk) + helper;
    int idle = 0;
    int cached = engine_peek_cached(q->e, q->hist, q->n_prompt, &idle);
    return engine_pages_for(q->e, seq_span(q)) - engine_pages_for(q->e, cached) + idle + helper;
}

/* Pages the worker's started requests may still take. */
static long sched_ahead(const struct Worker *w, const struct Sched *sc, int overcommit)
{
    long n = 0;
    for (int i = 0; i < sc->n; i++)
        if (sc->run[i]->started)
            n += seq_ahead(w, sc->run[i], overcommit);
    return n;
}

/* Publishes `mine`, what this worker's started requests may still take, where the other
 * workers sharing the pool see it; returns what theirs may. */
static long sched_promise(struct Worker *w, struct Sched *sc, long mine)
{
    struct WorkerStats *st = w->o.stats;
    long delta = mine - sc->promised;
    sc->promised = mine;
    if (!st)
        return 0;
    long others = (long)(atomic_fetch_add(&st->kv_promised, delta) + delta) - mine;
    return others > 0 ? others : 0;
}

/* A sequence that has not started, or was preempted: its pages go back, it starts over. */
static void seq_unstart(struct Worker *w, struct Seq *q)
{
    seq_blend_drop(w, q);
    engine_reset(q->e);
    q->done = 0;
    q->started = 0;
}

/* One step: the next token of every started sequence past its prompt (a decode token, or a
 * generated token fed again after a preemption), then prompt chunks within the budget, oldest
 * first. A sequence that has not started joins only when what it costs fits the pages nobody
 * uses or is promised (alone in this worker, it may try), oldest first: one that does not fit
 * holds back those after it. When a started one still lacks a page (the pool is shared by
 * other workers, or overcommitted), the one that came last gives its pages back and waits;
 * only one longer than the whole pool ends. Returns 1 when a step ran, 0 when there was
 * nothing to run (or nothing could: the pages are other workers'). */
static int sched_step(struct Worker *w, void *pair, struct Sched *sc)
{
    char err[512];
    int overcommit = fault_hit(FAULT_SCHED_OVERCOMMIT);
    /* while a sequence is decoding, steps stay short so its tokens keep coming (stall-free);
     * otherwise a prompt prefills in whole chunks */
    int budget = engine_opts(w->e)->chunk, no_new = 0, decoding = 0;
    for (int i = 0; i < sc->n; i++)
        decoding += sc->run[i]->started && sc->run[i]->done >= sc->run[i]->n_prompt;
    if (decoding && w->o.step_tokens > 0 && w->o.step_tokens < budget)
        budget = w->o.step_tokens;
    if (decoding && w->o.step_ms > 0 && sc->t_token > 0) {
        /* and no more prefill tokens than fit step_ms at the speed measured lately */
        double room = w->o.step_ms / 1e3 - sc->t_decode;
        double fit = room > 0 ? room / sc->t_token : 0;
        int cap = decoding + (fit > STEP_MIN_PREFILL ? (fit < budget ? (int)fit : budget)
                                                     : STEP_MIN_PREFILL);
        if (cap < budget)
            budget = cap;
    }
    for (int attempt = 0; attempt < 4 * WIRE_MAX_RUNNING; attempt++) {
        /* finished by a cancel between steps */
        for (int i = 0; i < sc->n;)
            if (sc->run[i]->cancelled) {
                seq_finish(w, pair, sc->run[i], 1);
                sched_remove(sc, i);
            } else {
                i++;
            }
        struct EngineBatchItem it[WIRE_MAX_RUNNING];
        struct Seq *who[WIRE_MAX_RUNNING];
        uint8_t joined[WIRE_MAX_RUNNING];   /* the item's sequence starts in this step */
        int k = 0, left = budget, any_started = 0, blending = 0;
        struct Seq *bq = NULL;              /* the blend that takes a share of this step */
        int b_tokens = 0;
        /* pages a sequence that has not started may take: those nobody uses, less what the
         * started ones, here and in the other workers, may still take */
        for (int i = 0; i < sc->n; i++)
            if (sc->run[i]->started) {
                any_started = 1;
                blending |= sc->run[i]->blend != NULL;
            }
        long mine = sched_ahead(w, sc, overcommit), others = sched_promise(w, sc, mine);
        long spare = engine_pages_available(w->e) - mine - others;
        /* every decoding request's own token comes before any draft's rows, and drafts take
         * no row while a prompt waits for its prefill: they would delay its first token */
        int n_dec = 0, prefilling = 0;
        for (int i = 0; i < sc->n; i++) {
            int dec = sc->run[i]->started && sc->run[i]->done >= sc->run[i]->n_prompt;
            n_dec += dec;
            prefilling |= !dec;
        }
        for (int i = 0; i < sc->n && left > 0; i++) {
            struct Seq *q = sc->run[i];
            if (!q->started || q->done < q->n_prompt)
                continue;
            joined[k] = 0;
            who[k] = q;
            int nd = prefilling ? 0 : seq_draft(q, left - n_dec);
            n_dec--;
            it[k++] = (struct EngineBatchItem){ q->e, nd ? q->draft : q->hist + q->done, 1 + nd,
                                                0, q->done + 1 == q->n_hist, nd > 0 };
            left -= 1 + nd;
        }
        for (int i = 0; i < sc->n && left > 0; i++) {
            struct Seq *q = sc->run[i];
            if (q->started && q->done >= q->n_prompt)
                continue;
            if (q->blend) {
                /* a blend under way takes what is left of the step, after the engine's step */
                bq = q;
                b_tokens = left;
                left = 0;
                break;
            }
            joined[k] = !q->started;
            if (!q->started) {
                if (no_new)
                    continue;
                size_t rest = q->n_prompt;
                int n = rest < (size_t)left ? (int)rest : left;
                int blend = seq_blends(w, q);
                /* one blend at a time (the worker has one helper): the next one waits */
                if (blend && blending)
                    continue;
                long need = seq_cost(w, q, blend, n, overcommit);
                if (any_started && need > spare) {
                    no_new = 1;     /* it waits for room, and those after it behind it */
                    continue;
                }
                spare -= need;
                any_started = 1;
                q->done = engine_take_cached(q->e, q->hist, q->n_prompt);
                if (q->cached < 0)
                    q->cached = (int)q->done;
                q->started = 1;
                /* a cached prefix may reach into the documents (exact pages: a copy's
                 * prefill publishes the frame, its copy label and its chunk, which is how a
                 * prompt opening with that chunk starts): the blend covers the rest */
                if (blend && q->done < q->job.docs[1]) {
                    seq_blend_begin(w, q);
                    if (q->blend) {
                        blending = 1;
                        bq = q;
                        b_tokens = left;
                        left = 0;
                        break;
                    }
                }
            }
            size_t rest = q->n_prompt - q->done;
            int n = rest < (size_t)left ? (int)rest : left;
            who[k] = q;
            it[k++] = (struct EngineBatchItem){ q->e, q->hist + q->done, n, 1,
                                                q->done + (size_t)n == q->n_prompt &&
                                                q->n_hist == q->n_prompt, 0 };
            left -= n;
        }
        if (k == 0 && !bq)
            return 0;
        sched_promise(w, sc, sched_ahead(w, sc, overcommit));
        int failed = -1;
        double t0 = zu_now_ms();
        int rc = k ? engine_step(w->e, it, k, &failed, err, sizeof err) : ENGINE_OK;
        if (rc == ENGINE_EBUDGET && failed >= 0) {
            struct Seq *f = who[failed];
            /* those that joined in this step start over and wait for free pages; the pages
             * they took (cached prefixes among them) may be what f lacked: without them, the
             * started ones try again before anything is judged */
            int n_joined = 0;
            for (int j = 0; j < k; j++)
                if (joined[j]) {
                    seq_unstart(w, who[j]);
                    n_joined++;
                }
            no_new = 1;
            if (n_joined)
                continue;
            int holders = 0, victim = -1;
            for (int i = 0; i < sc->n; i++)
                if (sc->run[i]->started) {
                    holders++;
                    if (victim < 0 || sc->run[i]->order > sc->run[victim]->order)
                        victim = i;
                }
            if (holders == 1 && engine_pages_for(f->e, (int)f->done + it[failed].n) >
                                    engine_pages_total(f->e)) {
                /* alone and longer than the whole pool: it can never go on. What it streamed
                 * stands, ended as at a full context ("length"); the prompt fits (seq_admit) */
                sched_remove(sc, victim);
                if (f->decoding) {
                    seq_finish(w, pair, f, 0);
                } else {
                    worker_send_error(pair, f->job.job, "overloaded", "the KV pool cannot hold "
                                      "this request: raise kv_pool_bytes");
                    seq_free(w, f);
                }
                continue;
            }
            /* the one that came last gives its pages back and waits; when f is alone here,
             * it fits the pool alone and the pages it lacks are another worker's: it waits
             * for them (sched_run pauses while nothing can run) */
            struct Seq *v = sc->run[victim];
            seq_unstart(w, v);
            if (w->o.stats)
                atomic_fetch_add(&w->o.stats->preemptions, 1);
            dlog(LL_DEBUG, "msg=\"sequence preempted\" worker=%d job=%llu tokens=%zu",
                 w->o.index, (unsigned long long)v->job.job, v->n_hist);
            /* it goes to the back: the others go first */
            sched_remove(sc, victim);
            sc->run[sc->n++] = v;
            continue;
        }
        if (rc) {
            /* a sequence at fault is answered; anything else ends every sequence */
            for (int i = 0; i < sc->n;) {
                struct Seq *q = sc->run[i];
                if (failed < 0 || q == who[failed]) {
                    worker_send_error(pair, q->job.job, rc == ENGINE_ECTX ? "too_large" : "internal", err);
                    seq_free(w, q);
                    sched_remove(sc, i);
                } else {
                    i++;
                }
            }
            return 1;
        }
        int tokens = 0, nd = 0;
        for (int j = 0; j < k; j++) {
            tokens += it[j].n;
            nd += it[j].prefill ? 0 : it[j].n;
            if (it[j].verify && w->o.stats)
                atomic_fetch_add(&w->o.stats->lookup_drafted, (uint64_t)it[j].n - 1);
        }
        /* the blend's share after the others' tokens: its work counts as prefill tokens */
        if (bq)
            seq_blend_step(w, bq, b_tokens, tokens);
        sched_timed(sc, nd, tokens - nd + (bq ? b_tokens : 0), (zu_now_ms() - t0) / 1e3);
        if (k)
            stats_step(w->o.stats, tokens);
        for (int j = 0; j < k; j++) {
            struct Seq *q = who[j];
            /* a verify step's drafted rows count once the model has kept them */
            q->done += it[j].verify ? 1 : (size_t)it[j].n;
            if (!it[j].logits)
                continue;
            int at = -1;
            for (int i = 0; i < sc->n; i++)
                if (sc->run[i] == q)
                    at = i;
            if (seq_advance_drafted(w, pair, q, it[j].verify ? it[j].n - 1 : 0) && at >= 0)
                sched_remove(sc, at);   /* answered and freed: it leaves the batch */
        }
        break;
    }
    /* what the others see until the next step: an idle worker promises nothing */
    sched_promise(w, sc, sched_ahead(w, sc, overcommit));
    return 1;
}

void sched_run(struct Worker *w, void *pair)
{
    struct Sched sc;
    memset(&sc, 0, sizeof sc);
    int stop = 0, ran = 1;
    for (;;) {
        if (sched_read(w, pair, &sc, !ran, &stop)) {
            /* the thread fails: its sequences are lost with it (the I/O thread answers them) */
            for (int i = 0; i < sc.n; i++)
                seq_free(w, sc.run[i]);
            sched_promise(w, &sc, 0);
            return;
        }
        if (stop)
            break;
        ran = sched_step(w, pair, &sc);
    }
    /* shutting down (or the socket failed): every sequence ends, answered as cancelled */
    for (int i = 0; i < sc.n; i++) {
        if (!sc.run[i]->cancelled)
            sc.run[i]->reason = WIRE_REASON_SHUTDOWN;
        seq_finish(w, pair, sc.run[i], 1);
    }
    sched_promise(w, &sc, 0);
}

