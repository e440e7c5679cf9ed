/* The broker loop: admission, the bounded queues, dispatch to I/O threads and workers (LRU),
 * worker registry and heartbeats, deltas and final replies, deadlines, cancels, SIGHUP reload,
 * sd_notify (READY, STATUS, WATCHDOG, RELOADING, STOPPING) and the SIGTERM drain. */
#include "daemon/broker.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#include "daemon/log.h"
#include "daemon/prep.h"
#include "daemon/request.h"
#include "daemon/wire.h"
#include "daemon/zap.h"
#include "daemon/zutil.h"

struct WorkerRef {
    struct WorkerRef *next;
    uint8_t ident[REQ_MAX_IDENT];
    size_t ident_len;
    struct WireInfo info;
    int refused;                /* wrong model: registered only so it is not re-asked */
    struct Request *req;        /* busy when non-NULL */
    double expiry, idle_since;
};

struct PrepRef {
    uint8_t ident[REQ_MAX_IDENT];
    size_t ident_len;
    struct Request *req;
    int stopped;
};

struct Broker {
    struct BrokerOpts o;
    struct Config *cfg;
    void *front, *back, *prep;
    struct Request all;                     /* sentinel of the live list */
    int n_live, n_pending;
    struct Request *prepq_head, *prepq_tail;
    struct Request *waitq_head, *waitq_tail;
    int n_wait;
    struct WorkerRef *workers;
    int n_workers, n_busy;
    struct PrepRef *preps;
    int n_preps, n_writes;
    uint64_t next_job;
    double started, next_hb, next_watchdog, next_status;
    uint64_t watchdog_usec;
    int ready_sent, draining, drain_forced;
    double drain_deadline, hard_deadline;
    int gauges_dirty;
    char last_status[160];
    struct MpWriter w;                      /* scratch for replies */
};

static double now_ms(void) { return zu_now_ms(); }

/* ---- lists ---- */

static void live_link(struct Broker *b, struct Request *r)
{
    r->next = &b->all;
    r->prev = b->all.prev;
    b->all.prev->next = r;
    b->all.prev = r;
    b->n_live++;
}

static void live_unlink(struct Broker *b, struct Request *r)
{
    r->prev->next = r->next;
    r->next->prev = r->prev;
    r->prev = r->next = NULL;
    b->n_live--;
}

static void q_push(struct Request **head, struct Request **tail, struct Request *r, int front)
{
    r->qnext = NULL;
    if (!*head) {
        *head = *tail = r;
    } else if (front) {
        r->qnext = *head;
        *head = r;
    } else {
        (*tail)->qnext = r;
        *tail = r;
    }
}

static int q_remove(struct Request **head, struct Request **tail, struct Request *r)
{
    struct Request *prev = NULL;
    for (struct Request *q = *head; q; prev = q, q = q->qnext) {
        if (q != r)
            continue;
        if (prev) prev->qnext = q->qnext;
        else *head = q->qnext;
        if (*tail == q) *tail = prev;
        q->qnext = NULL;
        return 1;
    }
    return 0;
}

static void request_free(struct Request *r)
{
    proto_params_free(&r->p);
    zmq_msg_close(&r->body);
    ctx_destroy(&r->ctx);
    gr_wordset_destroy(&r->doc_words);
    mpw_destroy(&r->reply);
    free(r);
}

/* ---- replies ---- */

static void send_client(struct Broker *b, const struct Request *r, const void *body, size_t len)
{
    const void *bufs[3];
    size_t lens[3];
    int n = 0;
    bufs[n] = r->ident; lens[n++] = r->ident_len;
    if (r->req_envelope) { bufs[n] = ""; lens[n++] = 0; }
    bufs[n] = body; lens[n++] = len;
    /* ROUTER drops a reply to a client that left (or whose queue is full) instead of blocking */
    zu_send(b->front, bufs, lens, n, ZMQ_DONTWAIT);
}

static void id_text(const struct Request *r, char *out, size_t cap)
{
    struct MpCursor c;
    struct MpObj o;
    if (!r->p.id_raw) {
        snprintf(out, cap, "-");
        return;
    }
    mp_cursor_init(&c, r->p.id_raw, r->p.id_len);
    if (mp_next(&c, &o)) {
        snprintf(out, cap, "?");
    } else if (o.type == MP_STR) {
        dlog_quote(out, cap, o.s, o.len);
    } else if (o.type == MP_UINT) {
        snprintf(out, cap, "%llu", (unsigned long long)o.v.u);
    } else {
        snprintf(out, cap, "%lld", (long long)o.v.i);
    }
}

/* The end of a request: metrics, the log line, then `reply` (when not NULL) is sent, and the
 * request leaves every list. Sending last means a client that has its reply finds it counted
 * in /metrics and written in the log. */
static void finish_reply(struct Broker *b, struct Request *r, enum ErrCode code, const char *extra,
                         const void *reply, size_t reply_len)
{
    double total = now_ms() - r->t_recv;
    metrics_request(b->o.metrics, r->p.op, code, total / 1e3);
    int level = r->p.op == OP_PING ? LL_DEBUG : LL_INFO;
    if (level <= dlog_level) {
        char id[300];
        id_text(r, id, sizeof id);
        dlog_write(level, "op=%s id=%s code=%s total_ms=%.3f%s%s", op_name(r->p.op), id,
                   ec_name(code), total, extra && extra[0] ? " " : "", extra ? extra : "");
    }
    if (reply)
        send_client(b, r, reply, reply_len);
    if (r->prev)
        live_unlink(b, r);
    b->gauges_dirty = 1;
    request_free(r);
}

static void reply_error(struct Broker *b, struct Request *r, enum ErrCode code, const char *msg)
{
    mpw_reset(&b->w);
    proto_error(&b->w, r->p.id_raw, r->p.id_len, code, msg);
    char extra[600], q[560];
    snprintf(extra, sizeof extra, "msg=%s", dlog_quote(q, sizeof q, msg, strlen(msg)));
    finish_reply(b, r, code, extra, b->w.failed ? NULL : b->w.buf.data, b->w.buf.size);
}

static int id_equal(const uint8_t *a, size_t alen, const uint8_t *c, size_t clen)
{
    struct MpCursor x, y;
    struct MpObj ox, oy;
    mp_cursor_init(&x, a, alen);
    mp_cursor_init(&y, c, clen);
    if (mp_next(&x, &ox) || mp_next(&y, &oy) || ox.type != oy.type)
        return 0;
    if (ox.type == MP_STR)
        return ox.len == oy.len && !memcmp(ox.s, oy.s, ox.len);
    if (ox.type == MP_UINT)
        return ox.v.u == oy.v.u;
    if (ox.type == MP_INT)
        return ox.v.i == oy.v.i;
    return 0;
}

static int answer_cites(const char *text, size_t len, int marker)
{
    char pat[24];
    int n = snprintf(pat, sizeof pat, "[%d]", marker);
    return memmem(text, len, pat, (size_t)n) != NULL;
}

static enum ErrCode code_parse(const char *s, size_t len)
{
    for (int c = 1; c < EC_COUNT; c++)
        if (strlen(ec_name(c)) == len && !memcmp(ec_name(c), s, len))
            return (enum ErrCode)c;
    return EC_INTERNAL;
}

/* The answer's groundedness: lexical support from the documents' words, then the figures of
 * docs/groundedness.md. unsupported and token_score (NULL unless asked for) are owned by the
 * caller afterwards. */
struct Grounded {
    struct GrSignals sig;
    struct GrSummary sum;
    uint8_t *unsupported;
    double *token_score;
};

static int ground(const struct Broker *b, const struct Request *r, const struct WireResult *res,
                  struct Grounded *g)
{
    memset(g, 0, sizeof *g);
    const struct WireSignals *ws = &res->sig;
    size_t n = res->has_signals ? ws->n : 0;
    g->unsupported = calloc(n + 1, 1);
    if (r->p.include_token_signals && b->o.calibration)
        g->token_score = calloc(n + 1, sizeof *g->token_score);
    if (!g->unsupported || (r->p.include_token_signals && b->o.calibration && !g->token_score))
        return -1;
    const char *text = res->text ? res->text : "";
    size_t len = res->text ? res->text_len : 0;
    g->sig = (struct GrSignals){
        .n = n, .logprob = ws->f[WS_LOGPROB], .entropy = ws->f[WS_ENTROPY],
        .margin = ws->f[WS_MARGIN], .doc_mass = ws->f[WS_DOC_MASS], .gen_mass = ws->f[WS_GEN_MASS],
        .diff_doc_mass = ws->f[WS_DIFF_DOC_MASS], .lookback = ws->f[WS_LOOKBACK],
        .text_end = ws->text_end, .unsupported = g->unsupported,
    };
    if (n)
        gr_lexical(r->doc_words, text, len, ws->text_end, n, g->unsupported);
    gr_summarize(b->o.calibration, b->o.threshold, &g->sig, text, len, g->token_score, &g->sum);
    return 0;
}

static void put_opt_double(struct MpWriter *w, const char *key, int have, double v)
{
    mpw_cstr(w, key);
    if (have)
        mpw_double(w, v);
    else
        mpw_nil(w);
}

static void put_grounding(const struct Broker *b, struct MpWriter *w, const struct Grounded *g)
{
    const struct GrSummary *s = &g->sum;
    mpw_cstr(w, "grounding");
    mpw_map(w, 10);
    put_opt_double(w, "score", s->scored, s->score);
    mpw_cstr(w, "flagged");
    if (s->scored)
        mpw_bool(w, s->flagged);
    else
        mpw_nil(w);
    mpw_kv_bool(w, "abstained", s->abstained);
    put_opt_double(w, "lookback_ratio", s->has_ratios, s->lookback_ratio);
    put_opt_double(w, "unsupported_token_ratio", s->has_ratios, s->unsupported_token_ratio);
    put_opt_double(w, "mean_logprob", s->has_ratios, s->mean_logprob);
    put_opt_double(w, "min_logprob", s->has_ratios, s->min_logprob);
    mpw_kv_uint(w, "answer_tokens", s->answer_tokens);
    mpw_kv_uint(w, "flagged_tokens", s->flagged_tokens);
    mpw_kv_cstr(w, "detector", b->o.calibration ? b->o.calibration->name : "none");
}

static void put_float_array(struct MpWriter *w, const char *key, const float *v, size_t n)
{
    mpw_cstr(w, key);
    mpw_array(w, n);
    for (size_t i = 0; i < n; i++)
        mpw_double(w, v[i]);
}

/* "token_signals": equal-length arrays over the answer tokens. */
static void put_token_signals(struct MpWriter *w, const struct WireResult *res,
                              const struct Grounded *g)
{
    const struct GrSignals *s = &g->sig;
    const char *text = res->text ? res->text : "";   /* text_end was checked against it */
    mpw_cstr(w, "token_signals");
    mpw_map(w, 9 + (g->token_score ? 1 : 0));
    mpw_cstr(w, "text");
    mpw_array(w, s->n);
    for (size_t i = 0; i < s->n; i++) {
        uint32_t a = i ? s->text_end[i - 1] : 0;
        mpw_str(w, text + a, s->text_end[i] - a);
    }
    put_float_array(w, "logprob", s->logprob, s->n);
    put_float_array(w, "entropy", s->entropy, s->n);
    put_float_array(w, "margin", s->margin, s->n);
    put_float_array(w, "doc_mass", s->doc_mass, s->n);
    put_float_array(w, "gen_mass", s->gen_mass, s->n);
    put_float_array(w, "diff_doc_mass", s->diff_doc_mass, s->n);
    put_float_array(w, "lookback", s->lookback, s->n);
    mpw_cstr(w, "unsupported");
    mpw_array(w, s->n);
    for (size_t i = 0; i < s->n; i++)
        mpw_bool(w, s->unsupported[i]);
    if (g->token_score) {
        mpw_cstr(w, "score");
        mpw_array(w, s->n);
        for (size_t i = 0; i < s->n; i++)
            mpw_double(w, g->token_score[i]);
    }
}

/* logfmt of an optional figure: "-" when it is not defined. */
static const char *opt_fmt(char *buf, size_t cap, int have, double v)
{
    if (have)
        snprintf(buf, cap, "%.4f", v);
    else
        snprintf(buf, cap, "-");
    return buf;
}

static void reply_query(struct Broker *b, struct Request *r, const struct WireResult *res)
{
    if (res->finish == WF_ERROR) {
        char msg[512];
        snprintf(msg, sizeof msg, "%.*s", (int)res->message_len, res->message ? res->message : "");
        reply_error(b, r, res->code ? code_parse(res->code, res->code_len) : EC_INTERNAL,
                    msg[0] ? msg : "the worker failed");
        return;
    }
    const struct Context *ctx = r->ctx;
    double now = now_ms();
    double waited = r->t_dispatch - r->t_recv;
    double queue_ms = waited - r->retrieve_ms;
    if (queue_ms < 0) queue_ms = 0;
    double ttft = res->completion_tokens > 0 ? waited + res->ttft_ms : 0;
    double total = now - r->t_recv;
    size_t context_tokens = ctx->documents.end > ctx->documents.start
                          ? ctx->documents.end - ctx->documents.start : 0;
    struct Grounded g;
    if (ground(b, r, res, &g)) {
        free(g.unsupported);
        free(g.token_score);
        reply_error(b, r, EC_INTERNAL, "out of memory scoring the answer");
        return;
    }
    struct MpWriter *w = &b->w;
    mpw_reset(w);
    proto_reply_head(w, 6 + (r->p.include_token_signals ? 1 : 0), r->p.id_raw, r->p.id_len, 1);
    mpw_kv_str(w, "answer", res->text ? res->text : "", res->text ? res->text_len : 0);
    mpw_kv_cstr(w, "finish_reason", wire_finish_name(res->finish));
    mpw_cstr(w, "citations");
    mpw_array(w, ctx->n_cites);
    for (size_t i = 0; i < ctx->n_cites; i++) {
        const struct CtxCitation *c = &ctx->cites[i];
        mpw_map(w, 7);
        mpw_kv_str(w, "doc_id", c->doc_id, c->doc_id_len);
        mpw_kv_uint(w, "chunk", c->chunk);
        mpw_kv_double(w, "score", c->score);
        mpw_cstr(w, "offsets");
        mpw_array(w, 2);
        mpw_uint(w, c->byte_start);
        mpw_uint(w, c->byte_end);
        mpw_kv_int(w, "marker", c->marker);
        mpw_kv_bool(w, "cited", res->text && answer_cites(res->text, res->text_len, c->marker));
        mpw_kv_bool(w, "truncated", c->truncated);
    }
    mpw_cstr(w, "usage");
    mpw_map(w, 3);
    mpw_kv_uint(w, "prompt_tokens", ctx->n_tokens);
    mpw_kv_uint(w, "context_tokens", context_tokens);
    mpw_kv_uint(w, "completion_tokens", (uint64_t)res->completion_tokens);
    mpw_cstr(w, "timings");
    mpw_map(w, 6);
    mpw_kv_double(w, "queue_ms", queue_ms);
    mpw_kv_double(w, "retrieve_ms", r->retrieve_ms);
    mpw_kv_double(w, "prefill_ms", res->prefill_ms);
    mpw_kv_double(w, "ttft_ms", ttft);
    mpw_kv_double(w, "decode_ms", res->decode_ms);
    mpw_kv_double(w, "total_ms", total);
    put_grounding(b, w, &g);
    if (r->p.include_token_signals)
        put_token_signals(w, res, &g);
    free(g.unsupported);
    free(g.token_score);
    if (w->failed) {
        reply_error(b, r, EC_INTERNAL, "out of memory building the reply");
        return;
    }
    struct QueryObs q = {
        .queue_s = queue_ms / 1e3, .retrieval_s = r->retrieve_ms / 1e3,
        .ttft_s = res->completion_tokens > 0 ? ttft / 1e3 : -1,
        .tpot_s = res->completion_tokens > 1 ? res->decode_ms / 1e3 / (double)(res->completion_tokens - 1) : -1,
        .prefill_tps = res->prefill_ms > 0 ? (double)ctx->n_tokens / (res->prefill_ms / 1e3) : -1,
        .prompt_tokens = ctx->n_tokens, .generated_tokens = (uint64_t)res->completion_tokens,
        .context_tokens = ctx->n_tokens,
    };
    metrics_query(b->o.metrics, &q);
    const struct GrSummary *gs = &g.sum;
    metrics_grounding(b->o.metrics, gs);
    char extra[1024], f_score[32], f_lb[32], f_uns[32], f_mlp[32], f_minlp[32];
    snprintf(extra, sizeof extra,
             "finish=%s queue_ms=%.3f retrieve_ms=%.3f prefill_ms=%.3f ttft_ms=%.3f decode_ms=%.3f "
             "prompt_tokens=%zu context_tokens=%zu completion_tokens=%lld retried=%d detector=%s "
             "score=%s flagged=%s abstained=%s lookback_ratio=%s unsupported_token_ratio=%s "
             "mean_logprob=%s min_logprob=%s answer_tokens=%zu flagged_tokens=%zu",
             wire_finish_name(res->finish), queue_ms, r->retrieve_ms, res->prefill_ms, ttft,
             res->decode_ms, ctx->n_tokens, context_tokens, (long long)res->completion_tokens,
             r->retried, b->o.calibration ? b->o.calibration->name : "none",
             opt_fmt(f_score, sizeof f_score, gs->scored, gs->score),
             gs->scored ? (gs->flagged ? "true" : "false") : "-", gs->abstained ? "true" : "false",
             opt_fmt(f_lb, sizeof f_lb, gs->has_ratios, gs->lookback_ratio),
             opt_fmt(f_uns, sizeof f_uns, gs->has_ratios, gs->unsupported_token_ratio),
             opt_fmt(f_mlp, sizeof f_mlp, gs->has_ratios, gs->mean_logprob),
             opt_fmt(f_minlp, sizeof f_minlp, gs->has_ratios, gs->min_logprob),
             gs->answer_tokens, gs->flagged_tokens);
    finish_reply(b, r, EC_OK, extra, w->buf.data, w->buf.size);
}

static void reply_store_op(struct Broker *b, struct Request *r)
{
    struct MpWriter *w = &b->w;
    mpw_reset(w);
    proto_reply_head(w, r->reply_fields, r->p.id_raw, r->p.id_len, 1);
    mpw_raw(w, r->reply.buf.data, r->reply.buf.size);
    if (w->failed) {
        reply_error(b, r, EC_INTERNAL, "out of memory building the reply");
        return;
    }
    char extra[64];
    snprintf(extra, sizeof extra, "io_ms=%.3f", r->retrieve_ms);
    finish_reply(b, r, EC_OK, extra, w->buf.data, w->buf.size);
}

/* ---- workers ---- */

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
static void update_gauges(struct Broker *b);

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
    struct Request *r = w->req;
    if (r) {
        b->n_busy--;
        r->worker = NULL;
    }
    if (lost || r) {
        dlog(LL_WARN, "msg=\"worker lost\" reason=%s model=\"%s\" busy=%d", why, w->info.model,
             r != NULL);
        metrics_worker_lost(b->o.metrics);
    } else {
        dlog(LL_INFO, "msg=\"worker left\" model=\"%s\" workers=%d", w->info.model, b->n_workers);
    }
    free(w);
    b->gauges_dirty = 1;
    update_gauges(b);   /* /readyz reflects the loss before the client hears of it */
    if (r)
        job_lost(b, r);
}

static void dispatch_workers(struct Broker *b);

/* The worker running r is gone: retry once when nothing was streamed yet and another worker
 * can take it, otherwise answer with an error (never silence). */
static void job_lost(struct Broker *b, struct Request *r)
{
    if (!r->streamed && !r->retried && !b->draining && b->n_workers > 0) {
        r->retried = 1;
        r->state = RS_WAIT;
        r->job = 0;
        b->n_pending++;
        b->n_wait++;
        q_push(&b->waitq_head, &b->waitq_tail, r, 1);
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
        /* READY from a worker that should be busy: its job is lost (it restarted) */
        if (w->req) {
            struct Request *r = w->req;
            w->req = NULL;
            r->worker = NULL;
            b->n_busy--;
            job_lost(b, r);
        }
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
        dlog(LL_INFO, "msg=\"worker ready\" model=\"%s\" n_ctx=%lld threads=%lld kv_bytes=%llu workers=%d",
             info.model, (long long)info.n_ctx, (long long)info.threads,
             (unsigned long long)info.kv_bytes, b->n_workers);
}

static void on_worker_result(struct Broker *b, struct WorkerRef *w, const uint8_t *body, size_t len)
{
    struct Request *r = w->req;
    uint64_t job = wire_get_u64(body);
    w->idle_since = now_ms();
    if (!r || r->job != job) {
        dlog(LL_DEBUG, "msg=\"late result dropped\" job=%llu", (unsigned long long)job);
        return;
    }
    w->req = NULL;
    b->n_busy--;
    r->worker = NULL;
    b->gauges_dirty = 1;
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
    struct Request *r = w->req;
    if (!r || r->job != wire_get_u64(body) || !r->p.stream || r->req_envelope)
        return;
    struct MpWriter *mw = &b->w;
    mpw_reset(mw);
    mpw_map(mw, 2);
    mpw_cstr(mw, "id");
    if (r->p.id_raw)
        mpw_raw(mw, r->p.id_raw, r->p.id_len);
    else
        mpw_nil(mw);
    mpw_kv_str(mw, "delta", (const char *)body + 8, len - 8);
    if (!mw->failed) {
        send_client(b, r, mw->buf.data, mw->buf.size);
        r->streamed = 1;
    }
}

static void handle_workers(struct Broker *b)
{
    struct ZuMsg m;
    while (zu_recv(b->back, &m, ZMQ_DONTWAIT) == 0) {
        double now = now_ms();
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
        if (!w->req && (!best || w->idle_since < best->idle_since))
            best = w;
    }
    return best;
}

static void dispatch_workers(struct Broker *b)
{
    while (b->waitq_head) {
        struct Request *r = b->waitq_head;
        size_t need = r->ctx->n_tokens + (size_t)r->p.max_tokens;
        int any_fits;
        struct WorkerRef *w = pick_worker(b, need, &any_fits);
        if (!w) {
            if (!any_fits && b->n_workers > 0) {
                q_remove(&b->waitq_head, &b->waitq_tail, r);
                b->n_wait--;
                b->n_pending--;
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
        /* the documents' token spans: each placed chunk's text, not its label */
        uint32_t *spans = malloc(2 * r->ctx->n_cites * sizeof *spans + sizeof *spans);
        if (spans)
            for (size_t i = 0; i < r->ctx->n_cites; i++) {
                spans[2 * i] = (uint32_t)r->ctx->cites[i].tokens.start;
                spans[2 * i + 1] = (uint32_t)r->ctx->cites[i].tokens.end;
            }
        struct WireGround wg = { .doc_spans = spans, .n_spans = r->ctx->n_cites,
                                 .watch = b->o.watch, .n_watch = b->o.n_watch };
        mpw_reset(mw);
        if (!spans)
            mw->failed = 1;
        wire_job_encode(mw, r->ctx->tokens, r->ctx->n_tokens, (int)r->p.max_tokens, r->p.temperature,
                        r->p.top_p, r->p.seed, stops, stop_lens, r->p.n_stop, r->p.stream, &wg);
        free(spans);
        q_remove(&b->waitq_head, &b->waitq_tail, r);
        b->n_wait--;
        b->n_pending--;
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
        r->worker = w;
        r->t_dispatch = now_ms();
        w->req = r;
        b->n_busy++;
        b->gauges_dirty = 1;
        /* A deadline or cancel that came while it waited is passed on now. */
        if (r->cancelled || r->deadline_hit) {
            uint8_t reason = r->deadline_hit ? WIRE_REASON_DEADLINE : WIRE_REASON_CANCEL;
            zu_send_job(b->back, w->ident, w->ident_len, WIRE_CANCEL, r->job, &reason, 1, ZMQ_DONTWAIT);
        }
    }
}

static void cancel_running(struct Broker *b, struct Request *r, uint8_t reason)
{
    if (r->worker)
        zu_send_job(b->back, r->worker->ident, r->worker->ident_len, WIRE_CANCEL, r->job, &reason, 1,
                    ZMQ_DONTWAIT);
}

/* ---- I/O threads ---- */

static int is_write(const struct Request *r)
{
    return r->p.op == OP_INGEST || r->p.op == OP_DELETE;
}

static void dispatch_prep(struct Broker *b)
{
    for (int i = 0; i < b->n_preps && b->prepq_head; i++) {
        struct PrepRef *p = &b->preps[i];
        if (p->req || p->stopped)
            continue;
        /* writes serialise in LMDB anyway; keep a thread free for reads when there are two */
        int write_slots = b->o.io_threads > 1 ? b->o.io_threads - 1 : 1;
        struct Request *r = b->prepq_head;
        while (r && is_write(r) && b->n_writes >= write_slots)
            r = r->qnext;
        if (!r)
            return;
        q_remove(&b->prepq_head, &b->prepq_tail, r);
        r->state = RS_PREP;
        p->req = r;
        if (is_write(r))
            b->n_writes++;
        const void *bufs[2] = { p->ident, &r };
        size_t lens[2] = { p->ident_len, sizeof r };
        zu_send(b->prep, bufs, lens, 2, 0);
    }
}

static void prep_done(struct Broker *b, struct Request *r)
{
    if (is_write(r))
        b->n_writes--;
    if (r->p.op != OP_QUERY) {
        b->n_pending--;
        if (r->code != EC_OK)
            reply_error(b, r, r->code, r->message);
        else
            reply_store_op(b, r);
        return;
    }
    if (r->code == EC_OK && (r->cancelled || r->deadline_hit || b->drain_forced)) {
        b->n_pending--;
        reply_error(b, r, r->cancelled ? EC_CANCELLED : r->deadline_hit ? EC_DEADLINE_EXCEEDED
                                                                      : EC_SHUTTING_DOWN,
                    r->cancelled ? "cancelled before generation"
                    : r->deadline_hit ? "the deadline passed before generation started"
                                      : "the daemon is shutting down");
        return;
    }
    if (r->code != EC_OK) {
        b->n_pending--;
        reply_error(b, r, r->code, r->message);
        return;
    }
    r->state = RS_WAIT;
    b->n_wait++;
    q_push(&b->waitq_head, &b->waitq_tail, r, 0);
    b->gauges_dirty = 1;
}

static void handle_prep(struct Broker *b)
{
    struct ZuMsg m;
    while (zu_recv(b->prep, &m, ZMQ_DONTWAIT) == 0) {
        if (m.n != 2 || zu_size(&m, 0) > REQ_MAX_IDENT) {
            zu_close(&m);
            continue;
        }
        const void *id = zu_data(&m, 0);
        size_t id_len = zu_size(&m, 0);
        struct PrepRef *p = NULL;
        for (int i = 0; i < b->n_preps; i++)
            if (b->preps[i].ident_len == id_len && !memcmp(b->preps[i].ident, id, id_len))
                p = &b->preps[i];
        if (zu_size(&m, 1) == 1) {          /* "R": a new thread */
            if (!p && b->n_preps < b->o.io_threads) {
                p = &b->preps[b->n_preps++];
                memcpy(p->ident, id, id_len);
                p->ident_len = id_len;
            }
        } else if (p && zu_size(&m, 1) == sizeof(struct Request *)) {
            struct Request *r;
            memcpy(&r, zu_data(&m, 1), sizeof r);
            if (r == p->req) {
                p->req = NULL;
                prep_done(b, r);
            }
        }
        zu_close(&m);
    }
}

/* ---- client requests ---- */

static void reply_ping(struct Broker *b, struct Request *r)
{
    struct MpWriter *w = &b->w;
    mpw_reset(w);
    proto_reply_head(w, 3, r->p.id_raw, r->p.id_len, 1);
    mpw_kv_bool(w, "pong", 1);
    mpw_kv_cstr(w, "version", b->o.version);
    mpw_kv_cstr(w, "model", b->o.model_name);
    finish_reply(b, r, EC_OK, NULL, w->buf.data, w->buf.size);
}

static void reply_daemon_stats(struct Broker *b, struct Request *r)
{
    struct MpWriter *w = &b->w;
    uint64_t kv = 0;
    for (struct WorkerRef *wr = b->workers; wr; wr = wr->next)
        if (!wr->refused)
            kv += wr->info.kv_bytes;
    mpw_reset(w);
    proto_reply_head(w, 8, r->p.id_raw, r->p.id_len, 1);
    mpw_kv_cstr(w, "version", b->o.version);
    mpw_kv_cstr(w, "model", b->o.model_name);
    mpw_kv_double(w, "uptime_s", (now_ms() - b->started) / 1e3);
    mpw_cstr(w, "workers");
    mpw_map(w, 2);
    mpw_kv_int(w, "idle", b->n_workers - b->n_busy);
    mpw_kv_int(w, "busy", b->n_busy);
    mpw_kv_int(w, "queue_depth", b->n_wait);
    mpw_kv_int(w, "inflight", b->n_live);
    mpw_kv_uint(w, "kv_cache_bytes", kv);
    mpw_kv_bool(w, "draining", b->draining);
    finish_reply(b, r, EC_OK, NULL, w->buf.data, w->buf.size);
}

static void handle_cancel(struct Broker *b, struct Request *c)
{
    struct Request *t = NULL;
    for (struct Request *r = b->all.next; r != &b->all; r = r->next)
        if (r->ident_len == c->ident_len && !memcmp(r->ident, c->ident, r->ident_len) &&
            r->p.id_raw && id_equal(r->p.id_raw, r->p.id_len, c->p.target_raw, c->p.target_len)) {
            t = r;
            break;
        }
    if (!t) {
        reply_error(b, c, EC_NOT_FOUND, "no request in flight from this client has that id");
        return;
    }
    if (t->p.op != OP_QUERY) {
        reply_error(b, c, EC_BAD_REQUEST, "only queries can be cancelled");
        return;
    }
    const char *state = "running";
    if (t->state == RS_PREP_WAIT || t->state == RS_WAIT) {
        state = "queued";
    } else if (t->state == RS_PREP) {
        state = "retrieving";
        t->cancelled = 1;
    } else if (!t->cancelled) {
        t->cancelled = 1;
        cancel_running(b, t, WIRE_REASON_CANCEL);
    }
    struct MpWriter *w = &b->w;
    mpw_reset(w);
    proto_reply_head(w, 2, c->p.id_raw, c->p.id_len, 1);
    mpw_kv_bool(w, "found", 1);
    mpw_kv_cstr(w, "state", state);
    finish_reply(b, c, EC_OK, NULL, w->buf.data, w->buf.size);
    if (t->state == RS_PREP_WAIT || t->state == RS_WAIT) {
        if (t->state == RS_PREP_WAIT)
            q_remove(&b->prepq_head, &b->prepq_tail, t);
        else if (q_remove(&b->waitq_head, &b->waitq_tail, t))
            b->n_wait--;
        b->n_pending--;
        reply_error(b, t, EC_CANCELLED, "cancelled while queued");
    }
}

static void admit(struct Broker *b, struct Request *r)
{
    const struct Config *cfg = b->cfg;
    switch (r->p.op) {
    case OP_PING:
        reply_ping(b, r);
        return;
    case OP_CANCEL:
        handle_cancel(b, r);
        return;
    case OP_STATS:
        if (!r->p.collection.len) {
            reply_daemon_stats(b, r);
            return;
        }
        break;
    default:
        break;
    }
    if (b->n_pending >= cfg->max_queue) {
        char msg[128];
        snprintf(msg, sizeof msg, "the queue is full (%ld requests waiting); retry later",
                 cfg->max_queue);
        reply_error(b, r, EC_OVERLOADED, msg);
        return;
    }
    r->chunk_tokens = cfg->chunk_tokens;
    r->chunk_overlap = cfg->chunk_overlap;
    r->deadline = r->p.deadline_ms ? r->t_recv + (double)r->p.deadline_ms : 0;
    r->state = RS_PREP_WAIT;
    live_link(b, r);
    b->n_pending++;
    b->gauges_dirty = 1;
    q_push(&b->prepq_head, &b->prepq_tail, r, 0);
}

static void handle_clients(struct Broker *b)
{
    for (int budget = 0; budget < 256; budget++) {
        struct ZuMsg m;
        if (zu_recv(b->front, &m, ZMQ_DONTWAIT))
            return;
        size_t id_len = zu_size(&m, 0);
        if (m.n_total < 2 || id_len == 0 || id_len > REQ_MAX_IDENT) {
            zu_close(&m);
            continue;
        }
        struct Request *r = calloc(1, sizeof *r);
        if (!r) {
            zu_close(&m);
            continue;
        }
        zmq_msg_init(&r->body);
        mpw_init(&r->reply);
        memcpy(r->ident, zu_data(&m, 0), id_len);
        r->ident_len = id_len;
        r->t_recv = now_ms();
        r->p.op = OP_NONE;
        int body_at = 1;
        if (m.n_total >= 3 && zu_size(&m, 1) == 0) {   /* REQ envelope: empty delimiter */
            r->req_envelope = 1;
            body_at = 2;
        }
        int n_body = m.n_total - body_at;
        if (body_at < m.n)
            zmq_msg_move(&r->body, &m.f[body_at]);
        zu_close(&m);
        if (n_body != 1) {
            char msg[96];
            snprintf(msg, sizeof msg, "a request is one frame; this message had %d", n_body);
            reply_error(b, r, EC_BAD_REQUEST, msg);
            continue;
        }
        enum ErrCode code;
        char err[512];
        if (proto_decode(zmq_msg_data(&r->body), zmq_msg_size(&r->body), b->cfg, &r->p, &code, err,
                         sizeof err)) {
            reply_error(b, r, code, err);
            continue;
        }
        if (b->draining && r->p.op != OP_CANCEL) {
            reply_error(b, r, EC_SHUTTING_DOWN, "the daemon is shutting down");
            continue;
        }
        admit(b, r);
    }
}

/* ---- timers ---- */

static void check_deadlines(struct Broker *b, double now)
{
    struct Request *r = b->all.next;
    while (r != &b->all) {
        struct Request *next = r->next;
        if (r->deadline && now >= r->deadline && !r->deadline_hit) {
            r->deadline_hit = 1;
            if (r->state == RS_PREP_WAIT || r->state == RS_WAIT) {
                if (r->state == RS_PREP_WAIT)
                    q_remove(&b->prepq_head, &b->prepq_tail, r);
                else if (q_remove(&b->waitq_head, &b->waitq_tail, r))
                    b->n_wait--;
                b->n_pending--;
                reply_error(b, r, EC_DEADLINE_EXCEEDED, "the deadline passed while queued");
            } else if (r->state == RS_RUN) {
                cancel_running(b, r, WIRE_REASON_DEADLINE);
            }
        }
        r = next;
    }
}

static void heartbeats(struct Broker *b, double now)
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

static void update_gauges(struct Broker *b)
{
    if (!b->gauges_dirty)
        return;
    uint64_t kv = 0;
    for (struct WorkerRef *w = b->workers; w; w = w->next)
        if (!w->refused)
            kv += w->info.kv_bytes;
    metrics_gauges(b->o.metrics, b->n_wait, b->n_live, b->n_workers - b->n_busy, b->n_busy, kv);
    b->gauges_dirty = 0;
}

static void notify_status(struct Broker *b, double now, int force)
{
    if (!force && now < b->next_status)
        return;
    b->next_status = now + 1000;
    char s[160];
    snprintf(s, sizeof s, "STATUS=%s: %d workers (%d busy), %d queued, %d in flight",
             b->draining ? "draining" : b->ready_sent ? "serving" : "starting", b->n_workers,
             b->n_busy, b->n_wait, b->n_live);
    if (force || strcmp(s, b->last_status)) {
        sd_notify(0, s);
        snprintf(b->last_status, sizeof b->last_status, "%s", s);
    }
}

/* The allowed client keys are re-read on every SIGHUP, so a key file edited in place (a key
 * added or revoked) takes effect without a restart. A file that does not load leaves the
 * keys in force. */
static void reload_keys(struct Broker *b)
{
    if (!b->o.zap)
        return;
    struct ZapKeys *keys = NULL;
    size_t n = 0;
    char err[512];
    if (b->cfg->curve_allowed_keys[0] &&
        zap_keys_load(b->cfg->curve_allowed_keys, &keys, &n, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"allowed client keys not reloaded; the previous ones stay\" error=\"%s\"",
             err);
    } else {
        zap_set_keys(b->o.zap, 0, &keys);
        if (b->cfg->curve_allowed_keys[0])
            dlog(LL_INFO, "msg=\"allowed client keys reloaded\" keys=%zu", n);
        else
            dlog(LL_WARN, "msg=\"curve_allowed_keys is empty: any client with the daemon's public "
                 "key may connect\"");
    }
    if (!b->cfg->worker_listen[0])
        return;
    if (!b->cfg->curve_worker_keys[0] ||
        zap_keys_load(b->cfg->curve_worker_keys, &keys, &n, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"worker keys not reloaded; the previous ones stay\" error=\"%s\"",
             b->cfg->curve_worker_keys[0] ? err : "curve_worker_keys is empty");
        return;
    }
    zap_set_keys(b->o.zap, 1, &keys);
    dlog(LL_INFO, "msg=\"worker keys reloaded\" keys=%zu", n);
}

static void reload(struct Broker *b)
{
    char changed[512], ignored[512], err[512];
    sd_notify(0, "RELOADING=1\nSTATUS=reloading the configuration");
    if (config_reload(b->cfg, b->o.argc, b->o.argv, changed, sizeof changed, ignored,
                      sizeof ignored, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"reload failed; the configuration is unchanged\" error=\"%s\"", err);
    } else {
        dlog_level = dlog_level_parse(b->cfg->log_level);
        int64_t maxmsg = (int64_t)b->cfg->max_message_bytes * 4 + 65536;
        zmq_setsockopt(b->front, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
        reload_keys(b);
        dlog(LL_INFO, "msg=\"configuration reloaded\" changed=\"%s\" needs_restart=\"%s\"", changed,
             ignored);
    }
    sd_notify(0, "READY=1");
    notify_status(b, now_ms(), 1);
}

static void start_drain(struct Broker *b, double now)
{
    b->draining = 1;
    b->drain_deadline = now + b->cfg->drain_timeout * 1e3;
    metrics_set_draining(b->o.metrics);
    sd_notify(0, "STOPPING=1");
    dlog(LL_INFO, "msg=\"draining\" inflight=%d drain_timeout_s=%g", b->n_live, b->cfg->drain_timeout);
    notify_status(b, now, 1);
}

/* The drain time is up: queued requests are refused, running ones cancelled (their replies
 * still come, finish_reason "cancelled"); a little later, what is left gets an error. */
static void force_drain(struct Broker *b, double now)
{
    b->drain_forced = 1;
    b->hard_deadline = now + 2000 + (double)b->cfg->heartbeat_ms;
    struct Request *r = b->all.next;
    while (r != &b->all) {
        struct Request *next = r->next;
        if (r->state == RS_PREP_WAIT || r->state == RS_WAIT) {
            if (r->state == RS_PREP_WAIT)
                q_remove(&b->prepq_head, &b->prepq_tail, r);
            else if (q_remove(&b->waitq_head, &b->waitq_tail, r))
                b->n_wait--;
            b->n_pending--;
            reply_error(b, r, EC_SHUTTING_DOWN, "the daemon is shutting down");
        } else if (r->state == RS_RUN) {
            cancel_running(b, r, WIRE_REASON_SHUTDOWN);
        }
        r = next;
    }
}

static void give_up_running(struct Broker *b)
{
    struct Request *r = b->all.next;
    while (r != &b->all) {
        struct Request *next = r->next;
        if (r->state == RS_RUN) {
            if (r->worker) {
                r->worker->req = NULL;
                b->n_busy--;
            }
            reply_error(b, r, EC_SHUTTING_DOWN, "the daemon is shutting down");
        }
        r = next;
    }
}

static void stop_prep_threads(struct Broker *b)
{
    double until = now_ms() + 5000;
    int stopped = 0;
    while (stopped < b->o.io_threads && now_ms() < until) {
        for (int i = 0; i < b->n_preps; i++) {
            struct PrepRef *p = &b->preps[i];
            if (!p->stopped) {
                const void *bufs[2] = { p->ident, "" };
                size_t lens[2] = { p->ident_len, 0 };
                zu_send(b->prep, bufs, lens, 2, 0);
                p->stopped = 1;
                stopped++;
            }
        }
        if (stopped < b->o.io_threads) {
            zmq_pollitem_t it = { b->prep, 0, ZMQ_POLLIN, 0 };
            if (zmq_poll(&it, 1, 100) > 0)
                handle_prep(b);
        }
    }
}

int broker_run(struct Broker *b)
{
    b->started = now_ms();
    b->next_hb = b->started;
    b->next_watchdog = b->started;
    if (sd_watchdog_enabled(0, &b->watchdog_usec) <= 0)
        b->watchdog_usec = 0;
    b->gauges_dirty = 1;
    for (;;) {
        double now = now_ms();
        if (*b->o.sig_hup) {
            *b->o.sig_hup = 0;
            reload(b);
        }
        if (*b->o.sig_term && !b->draining)
            start_drain(b, now);
        if (b->draining) {
            if (b->n_live == 0)
                break;
            if (!b->drain_forced && now >= b->drain_deadline)
                force_drain(b, now);
            if (b->drain_forced && now >= b->hard_deadline) {
                give_up_running(b);
                if (b->n_live == 0)
                    break;
            }
        }
        if (!b->ready_sent && b->n_workers >= b->o.inproc_workers) {
            sd_notify(0, "READY=1");
            b->ready_sent = 1;
            dlog(LL_INFO, "msg=\"ready\" workers=%d", b->n_workers);
            notify_status(b, now, 1);
        }
        double wake = b->next_hb;
        if (b->watchdog_usec && b->next_watchdog < wake)
            wake = b->next_watchdog;
        for (struct Request *r = b->all.next; r != &b->all; r = r->next)
            if (r->deadline && !r->deadline_hit && r->deadline < wake)
                wake = r->deadline;
        for (struct WorkerRef *w = b->workers; w; w = w->next)
            if (w->expiry < wake)
                wake = w->expiry;
        long timeout = (long)(wake - now) + 1;
        if (timeout < 0) timeout = 0;
        if (timeout > 250) timeout = 250;   /* signals may land on another thread's stack */
        zmq_pollitem_t items[3] = {
            { b->back, 0, ZMQ_POLLIN, 0 },
            { b->prep, 0, ZMQ_POLLIN, 0 },
            { b->front, 0, ZMQ_POLLIN, 0 },
        };
        int n = zmq_poll(items, 3, timeout);
        if (n < 0 && errno != EINTR) {
            dlog(LL_ERROR, "msg=\"poll failed\" error=\"%s\"", zmq_strerror(errno));
            break;
        }
        if (n > 0 && (items[0].revents & ZMQ_POLLIN))
            handle_workers(b);
        if (n > 0 && (items[1].revents & ZMQ_POLLIN))
            handle_prep(b);
        if (n > 0 && (items[2].revents & ZMQ_POLLIN))
            handle_clients(b);
        now = now_ms();
        check_deadlines(b, now);
        heartbeats(b, now);
        dispatch_prep(b);
        dispatch_workers(b);
        update_gauges(b);
        if (b->watchdog_usec && now >= b->next_watchdog) {
            sd_notify(0, "WATCHDOG=1");
            b->next_watchdog = now + (double)b->watchdog_usec / 2e3;
        }
        notify_status(b, now, 0);
    }
    dlog(LL_INFO, "msg=\"drained\" inflight=%d", b->n_live);
    stop_prep_threads(b);
    return 0;
}

void broker_farewell(struct Broker *b)
{
    handle_workers(b);   /* goodbyes of the worker threads stopped meanwhile */
    for (struct WorkerRef *w = b->workers; w; w = w->next)
        send_worker(b, w, WIRE_DISCONNECT, NULL, 0);
}

/* ---- setup ---- */

int broker_new(const struct BrokerOpts *o, struct Broker **out, char *err, size_t errlen)
{
    *out = NULL;
    struct Broker *b = calloc(1, sizeof *b);
    if (!b) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    b->o = *o;
    b->cfg = o->cfg;
    b->all.next = b->all.prev = &b->all;
    mpw_init(&b->w);
    b->preps = calloc((size_t)(o->io_threads > 0 ? o->io_threads : 1), sizeof *b->preps);
    b->front = zmq_socket(o->zctx, ZMQ_ROUTER);
    b->back = zmq_socket(o->zctx, ZMQ_ROUTER);
    b->prep = zmq_socket(o->zctx, ZMQ_ROUTER);
    if (!b->preps || !b->front || !b->back || !b->prep) {
        snprintf(err, errlen, "cannot create sockets: %s", zmq_strerror(errno));
        goto err;
    }
    int linger = 1000, hwm = 100000;
    int64_t maxmsg = (int64_t)o->cfg->max_message_bytes * 4 + 65536, wmax = WIRE_MAX_MESSAGE;
    /* Messages waiting per client connection: libzmq holds each whole (up to maxmsg) before
     * the loop reads it, so this bounds what one peer can make the daemon hold; a client
     * that sends faster waits in TCP. */
    int client_rcvhwm = BROKER_CLIENT_RCVHWM;
    zmq_setsockopt(b->front, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(b->front, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(b->front, ZMQ_RCVHWM, &client_rcvhwm, sizeof client_rcvhwm);
    zmq_setsockopt(b->front, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    if (o->curve_secret) {
        int server = 1;
        /* Z85 text with its NUL (41 bytes), as zmq_setsockopt takes keys given as text */
        if (zmq_setsockopt(b->front, ZMQ_CURVE_SERVER, &server, sizeof server) ||
            zmq_setsockopt(b->front, ZMQ_CURVE_SECRETKEY, o->curve_secret, CURVE_KEY_Z85_LEN + 1) ||
            zmq_setsockopt(b->front, ZMQ_ZAP_DOMAIN, ZAP_DOMAIN, strlen(ZAP_DOMAIN))) {
            snprintf(err, errlen, "cannot enable CurveZMQ on the client socket: %s", zmq_strerror(errno));
            goto err;
        }
        /* Remote workers see every prompt: on a network endpoint they authenticate too, in
         * their own ZAP domain (inproc:// worker threads have no handshake). */
        if (o->cfg->worker_listen[0] &&
            (zmq_setsockopt(b->back, ZMQ_CURVE_SERVER, &server, sizeof server) ||
             zmq_setsockopt(b->back, ZMQ_CURVE_SECRETKEY, o->curve_secret, CURVE_KEY_Z85_LEN + 1) ||
             zmq_setsockopt(b->back, ZMQ_ZAP_DOMAIN, ZAP_DOMAIN_WORKERS, strlen(ZAP_DOMAIN_WORKERS)))) {
            snprintf(err, errlen, "cannot enable CurveZMQ on the worker socket: %s", zmq_strerror(errno));
            goto err;
        }
    }
    zmq_setsockopt(b->back, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(b->back, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(b->back, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(b->back, ZMQ_MAXMSGSIZE, &wmax, sizeof wmax);
    if (zmq_bind(b->front, o->cfg->listen)) {
        snprintf(err, errlen, "cannot listen on %s: %s", o->cfg->listen, zmq_strerror(errno));
        goto err;
    }
    if (zmq_bind(b->back, BROKER_WORKERS_INPROC) || zmq_bind(b->prep, BROKER_PREP_INPROC)) {
        snprintf(err, errlen, "cannot bind inproc sockets: %s", zmq_strerror(errno));
        goto err;
    }
    if (o->cfg->worker_listen[0] && zmq_bind(b->back, o->cfg->worker_listen)) {
        snprintf(err, errlen, "cannot listen for workers on %s: %s", o->cfg->worker_listen,
                 zmq_strerror(errno));
        goto err;
    }
    *out = b;
    return 0;
err:
    broker_destroy(&b);
    return -1;
}

void broker_destroy(struct Broker **bp)
{
    struct Broker *b = bp ? *bp : NULL;
    if (!b)
        return;
    while (b->all.next && b->all.next != &b->all) {
        struct Request *r = b->all.next;
        live_unlink(b, r);
        request_free(r);
    }
    for (struct WorkerRef *w = b->workers, *next; w; w = next) {
        next = w->next;
        free(w);
    }
    if (b->front) zmq_close(b->front);
    if (b->back) zmq_close(b->back);
    if (b->prep) zmq_close(b->prep);
    mpw_destroy(&b->w);
    free(b->preps);
    free(b);
    *bp = NULL;
}
