/* The broker's workers: the registry (READY, results, deltas, goodbyes), dispatch of waiting
 * queries to idle workers least recently used first, cancels passed on to them, heartbeats
 * and expiry, the retry of a lost worker's query, and the farewell at shutdown. */
#include "daemon/broker_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/zutil.h"

static struct WorkerRef *worker_find(struct Broker *b, const void *id, size_t len)
{
    for (struct WorkerRef *w = b->workers; w; w = w->next)
        if (w->ident_len == len && !memcmp(w->ident, id, len))
            return w;
    return NULL;
}

static void send_worker(struct Broker *b, const struct WorkerRef *w, uint8_t cmd, const void *body,
                        size_t len)
{
    zu_send_cmd(b->back, w->ident, w->ident_len, cmd, body, len, ZMQ_DONTWAIT);
}

static void job_lost(struct Broker *b, struct Request *r);

/* The job of w with this id, or NULL. */
static struct Request *worker_job(const struct WorkerRef *w, uint64_t job)
{
    for (int i = 0; i < w->n_reqs; i++)
        if (w->reqs[i]->job == job)
            return w->reqs[i];
    return NULL;
}

static void worker_add_job(struct Broker *b, struct WorkerRef *w, struct Request *r)
{
    if (w->n_reqs++ == 0)
        b->n_busy++;
    w->reqs[w->n_reqs - 1] = r;
    r->worker = w;
    b->n_running++;
    b->gauges_dirty = 1;
}

void workers_detach(struct Broker *b, struct Request *r)
{
    struct WorkerRef *w = r->worker;
    if (!w)
        return;
    for (int i = 0; i < w->n_reqs; i++)
        if (w->reqs[i] == r) {
            w->reqs[i] = w->reqs[--w->n_reqs];
            b->n_running--;
            if (w->n_reqs == 0)
                b->n_busy--;
            break;
        }
    r->worker = NULL;
    b->gauges_dirty = 1;
}

/* Every job of w is lost (it left, or restarted): each is retried or answered. */
static void worker_lose_jobs(struct Broker *b, struct WorkerRef *w)
{
    while (w->n_reqs > 0) {
        struct Request *r = w->reqs[w->n_reqs - 1];
        workers_detach(b, r);
        job_lost(b, r);
    }
}

/* A worker leaves the registry: `lost` when it went silent (counted, and worth a warning),
 * not when it said goodbye. Its job, if any, is retried or answered. */
static void worker_remove(struct Broker *b, struct WorkerRef *w, const char *why, int lost)
{
    struct WorkerRef **pp = &b->workers;
    while (*pp && *pp != w)
        pp = &(*pp)->next;
    if (*pp)
        *pp = w->next;
    if (!w->refused)
        b->n_workers--;
    int busy = w->n_reqs;
    if (lost || busy) {
        dlog(LL_WARN, "msg=\"worker lost\" reason=%s model=\"%s\" busy=%d", why, w->info.model,
             busy);
        metrics_worker_lost(b->o.metrics);
    } else {
        dlog(LL_INFO, "msg=\"worker left\" model=\"%s\" workers=%d", w->info.model, b->n_workers);
    }
    /* its jobs leave it first, so a retry never picks it */
    struct Request *lost_reqs[WIRE_MAX_RUNNING];
    int n_lost = 0;
    while (w->n_reqs > 0) {
        lost_reqs[n_lost] = w->reqs[w->n_reqs - 1];
        workers_detach(b, lost_reqs[n_lost++]);
    }
    free(w);
    b->gauges_dirty = 1;
    lifecycle_update_gauges(b);   /* /readyz reflects the loss before the client hears of it */
    for (int i = 0; i < n_lost; i++)
        job_lost(b, lost_reqs[i]);
}

/* The worker running r is gone: retry once when nothing was streamed yet and another worker
 * can take it, otherwise answer with an error (never silence). */
static void job_lost(struct Broker *b, struct Request *r)
{
    if (!r->streamed && !r->retried && !b->draining && b->n_workers > 0) {
        r->retried = 1;
        r->job = 0;
        b->n_pending++;
        request_wait_worker(b, r, 1);
        return;
    }
    reply_error(b, r, EC_INTERNAL, "the worker running this request was lost");
}

static void on_worker_ready(struct Broker *b, const uint8_t *id, size_t id_len, const void *body,
                            size_t len, double now)
{
    struct WireInfo info;
    char err[256];
    if (id_len > REQ_MAX_IDENT)
        return;
    if (wire_info_decode(body, len, &info, err, sizeof err)) {
        dlog(LL_WARN, "msg=\"worker READY refused\" error=\"%s\"", err);
        zu_send_cmd(b->back, id, id_len, WIRE_DISCONNECT, NULL, 0, ZMQ_DONTWAIT);
        return;
    }
    struct WorkerRef *w = worker_find(b, id, id_len);
    if (w) {
        /* READY from a worker that should be busy: its jobs are lost (it restarted) */
        worker_lose_jobs(b, w);
    } else {
        w = calloc(1, sizeof *w);
        if (!w)
            return;
        memcpy(w->ident, id, id_len);
        w->ident_len = id_len;
        w->next = b->workers;
        b->workers = w;
        w->refused = info.vocab != b->o.vocab;
        if (!w->refused)
            b->n_workers++;
    }
    w->info = info;
    w->expiry = now + (double)b->cfg->heartbeat_ms * (double)b->cfg->heartbeat_liveness;
    w->idle_since = now;
    b->gauges_dirty = 1;
    if (w->refused)
        dlog(LL_ERROR, "msg=\"worker serves another vocabulary; not used\" model=\"%s\" vocab=%lld "
             "expected=%lld", info.model, (long long)info.vocab, (long long)b->o.vocab);
    else
        dlog(LL_INFO, "msg=\"worker ready\" model=\"%s\" n_ctx=%lld threads=%lld kv_bytes=%llu "
             "max_running=%lld workers=%d", info.model, (long long)info.n_ctx,
             (long long)info.threads, (unsigned long long)info.kv_bytes,
             (long long)info.max_running, b->n_workers);
}

static void on_worker_result(struct Broker *b, struct WorkerRef *w, const uint8_t *body, size_t len)
{
    uint64_t job = wire_get_u64(body);
    struct Request *r = worker_job(w, job);
    w->idle_since = zu_now_ms();
    if (!r) {
        dlog(LL_DEBUG, "msg=\"late result dropped\" job=%llu", (unsigned long long)job);
        return;
    }
    workers_detach(b, r);
    struct WireResult res = { .job = job };
    char err[256];
    if (wire_result_decode(body + 8, len - 8, &res, err, sizeof err)) {
        dlog(LL_WARN, "msg=\"worker sent a malformed result\" model=\"%s\" error=\"%s\"",
             w->info.model, err);
        reply_error(b, r, EC_INTERNAL, err);
        return;
    }
    reply_query(b, r, &res);
    wire_result_free(&res);
}

static void on_worker_delta(struct Broker *b, struct WorkerRef *w, const uint8_t *body, size_t len)
{
    struct Request *r = worker_job(w, wire_get_u64(body));
    if (!r || !r->p.stream || r->req_envelope)
        return;
    reply_delta(b, r, (const char *)body + 8, len - 8);
}

void workers_receive(struct Broker *b)
{
    struct ZuMsg m;
    while (zu_recv(b->back, &m, ZMQ_DONTWAIT) == 0) {
        double now = zu_now_ms();
        if (m.n_total < 2 || m.n_total > 3 || zu_size(&m, 1) != 1) {
            zu_close(&m);
            continue;
        }
        const uint8_t *id = zu_data(&m, 0);
        size_t id_len = zu_size(&m, 0);
        uint8_t cmd = *(const uint8_t *)zu_data(&m, 1);
        const uint8_t *body = m.n == 3 ? zu_data(&m, 2) : NULL;
        size_t blen = m.n == 3 ? zu_size(&m, 2) : 0;
        if (cmd == WIRE_READY) {
            on_worker_ready(b, id, id_len, body, blen, now);
            zu_close(&m);
            continue;
        }
        struct WorkerRef *w = worker_find(b, id, id_len);
        if (!w) {
            /* not registered (expired, or from before a restart): ask it to start over */
            if (cmd != WIRE_DISCONNECT)
                zu_send_cmd(b->back, id, id_len, WIRE_DISCONNECT, NULL, 0, ZMQ_DONTWAIT);
            zu_close(&m);
            continue;
        }
        w->expiry = now + (double)b->cfg->heartbeat_ms * (double)b->cfg->heartbeat_liveness;
        if (cmd == WIRE_RESULT && blen >= 8)
            on_worker_result(b, w, body, blen);
        else if (cmd == WIRE_DELTA && blen >= 8)
            on_worker_delta(b, w, body, blen);
        else if (cmd == WIRE_DISCONNECT)
            worker_remove(b, w, "disconnect", 0);
        zu_close(&m);
    }
}

static struct WorkerRef *pick_worker(struct Broker *b, size_t need, int *any_fits)
{
    struct WorkerRef *best = NULL;
    *any_fits = 0;
    for (struct WorkerRef *w = b->workers; w; w = w->next) {
        if (w->refused || (size_t)w->info.n_ctx < need)
            continue;
        *any_fits = 1;
        if (w->n_reqs >= w->info.max_running)
            continue;
        if (!best || w->n_reqs < best->n_reqs ||
            (w->n_reqs == best->n_reqs && w->idle_since < best->idle_since))
            best = w;
    }
    return best;
}

void workers_dispatch(struct Broker *b)
{
    while (b->waitq_head) {
        struct Request *r = b->waitq_head;
        size_t need = r->ctx->n_tokens + (size_t)r->p.max_tokens;
        int any_fits;
        struct WorkerRef *w = pick_worker(b, need, &any_fits);
        if (!w) {
            if (!any_fits && b->n_workers > 0) {
                request_unqueue(b, r);
                char msg[200];
                snprintf(msg, sizeof msg, "the prompt (%zu tokens) plus max_tokens (%ld) exceeds "
                         "every worker's context", r->ctx->n_tokens, r->p.max_tokens);
                reply_error(b, r, EC_TOO_LARGE, msg);
                continue;
            }
            return;
        }
        struct MpWriter *mw = &b->w;
        const char *stops[PROTO_MAX_STOP];
        size_t stop_lens[PROTO_MAX_STOP];
        for (size_t i = 0; i < r->p.n_stop; i++) {
            stops[i] = r->p.stop[i].p;
            stop_lens[i] = r->p.stop[i].len;
        }
        /* the documents' token spans: each placed chunk's text, not its label; the stored
         * chunks among them (collection id, chunk id), for their KV records; and the copy
         * label each chunk's KV copy is made after */
        size_t nc = r->ctx->n_cites;
        uint32_t *spans = malloc(7 * nc * sizeof *spans + sizeof *spans);
        uint32_t *refs = spans ? spans + 2 * nc : NULL;
        uint32_t *leads = spans ? spans + 4 * nc : NULL;
        uint32_t *ranks = spans ? spans + 6 * nc : NULL;
        int any_ref = 0;
        if (spans)
            for (size_t i = 0; i < r->ctx->n_cites; i++) {
                const struct CtxCitation *ci = &r->ctx->cites[i];
                spans[2 * i] = (uint32_t)ci->tokens.start;
                spans[2 * i + 1] = (uint32_t)ci->tokens.end;
                refs[2 * i] = (uint32_t)(ci->ref >> 32);
                refs[2 * i + 1] = (uint32_t)ci->ref;
                any_ref |= refs[2 * i] != 0;
                leads[2 * i] = (uint32_t)ci->lead.start;
                leads[2 * i + 1] = (uint32_t)ci->lead.end;
                /* its rank among the placed chunks by retrieval (the cites' ranks are their
                 * places among the chunks offered, best first) */
                ranks[i] = 0;
                for (size_t k = 0; k < nc; k++)
                    ranks[i] += r->ctx->cites[k].rank < ci->rank;
            }
        struct WireGround wg = { .doc_spans = spans, .n_spans = r->ctx->n_cites,
                                 .watch = b->o.watch, .n_watch = b->o.n_watch,
                                 .self_check = b->cfg->grounding_self_check != 0,
                                 .docs = { (uint32_t)r->ctx->documents.start,
                                           (uint32_t)r->ctx->documents.end },
                                 .chunk_refs = any_ref ? refs : NULL,
                                 .hidden = b->o.hidden, .n_hidden = b->o.n_hidden,
                                 .lead_tokens = r->ctx->leads,
                                 .n_lead_tokens = r->ctx->n_leads, .doc_leads = leads,
                                 .doc_ranks = ranks,
                                 .quote = r->p.answer_mode == ANSWER_QUOTE };
        /* context reliance: the same prompt without its documents (frame, question, turn) */
        const struct Context *cx = r->ctx;
        int32_t *bare = NULL;
        if (b->cfg->grounding_reliance && cx->documents.end > cx->documents.start) {
            size_t n_bare = cx->n_tokens - (cx->documents.end - cx->documents.start);
            bare = malloc(n_bare * sizeof *bare);
            if (bare) {
                memcpy(bare, cx->tokens, cx->documents.start * sizeof *bare);
                memcpy(bare + cx->documents.start, cx->tokens + cx->documents.end,
                       (cx->n_tokens - cx->documents.end) * sizeof *bare);
                wg.bare = bare;
                wg.n_bare = n_bare;
            }
        }
        mpw_reset(mw);
        if (!spans)
            mw->failed = 1;
        wire_job_encode(mw, r->ctx->tokens, r->ctx->n_tokens, (int)r->p.max_tokens, r->p.temperature,
                        r->p.top_p, r->p.seed, stops, stop_lens, r->p.n_stop, r->p.stream, &wg);
        free(spans);
        free(bare);
        request_unqueue(b, r);
        if (mw->failed) {
            reply_error(b, r, EC_INTERNAL, "out of memory encoding the job");
            continue;
        }
        r->job = ++b->next_job;
        if (zu_send_job(b->back, w->ident, w->ident_len, WIRE_JOB, r->job, mw->buf.data,
                        mw->buf.size, ZMQ_DONTWAIT)) {
            reply_error(b, r, EC_INTERNAL, "cannot reach the worker");
            continue;
        }
        r->state = RS_RUN;
        r->t_dispatch = zu_now_ms();
        worker_add_job(b, w, r);
        /* A deadline or cancel that came while it waited is passed on now. */
        if (r->cancelled || r->deadline_hit) {
            uint8_t reason = r->deadline_hit ? WIRE_REASON_DEADLINE : WIRE_REASON_CANCEL;
            zu_send_job(b->back, w->ident, w->ident_len, WIRE_CANCEL, r->job, &reason, 1, ZMQ_DONTWAIT);
        }
    }
}

void workers_cancel(struct Broker *b, struct Request *r, uint8_t reason)
{
    if (r->worker)
        zu_send_job(b->back, r->worker->ident, r->worker->ident_len, WIRE_CANCEL, r->job, &reason, 1,
                    ZMQ_DONTWAIT);
}

void workers_heartbeat(struct Broker *b, double now)
{
    if (now >= b->next_hb) {
        for (struct WorkerRef *w = b->workers; w; w = w->next)
            send_worker(b, w, WIRE_HEARTBEAT, NULL, 0);
        b->next_hb = now + (double)b->cfg->heartbeat_ms;
    }
    struct WorkerRef *w = b->workers;
    while (w) {
        struct WorkerRef *next = w->next;
        if (now > w->expiry)
            worker_remove(b, w, "heartbeat_timeout", 1);
        w = next;
    }
}

void broker_farewell(struct Broker *b)
{
    workers_receive(b);   /* goodbyes of the worker threads stopped meanwhile */
    for (struct WorkerRef *w = b->workers; w; w = w->next)
        send_worker(b, w, WIRE_DISCONNECT, NULL, 0);
}

uint64_t workers_kv_bytes(const struct Broker *b)
{
    uint64_t kv = 0;
    for (const struct WorkerRef *w = b->workers; w; w = w->next)
        if (!w->refused)
            kv += w->info.kv_bytes;
    return kv;
}
