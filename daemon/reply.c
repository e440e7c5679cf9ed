/* The broker's replies: the end of every request (metrics, the log line, then the reply), error
 * replies, a query's final reply with its citations, usage, timings, grounding figures and
 * token signals, streamed deltas, store-op replies, and the replies the loop gives itself
 * (ping, the daemon's stats). */
#include "daemon/broker_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/zutil.h"

void reply_send(struct Broker *b, const struct Request *r, const void *body, size_t len)
{
    (void)b;   /* the reply goes to the socket r came on: the client's, or the HTTP API's */
    const void *bufs[3];
    size_t lens[3];
    int n = 0;
    bufs[n] = r->ident; lens[n++] = r->ident_len;
    if (r->req_envelope) { bufs[n] = ""; lens[n++] = 0; }
    bufs[n] = body; lens[n++] = len;
    /* ROUTER drops a reply to a client that left (or whose queue is full) instead of blocking */
    zu_send(r->sock, bufs, lens, n, ZMQ_DONTWAIT);
}

void reply_id_text(const struct Request *r, char *out, size_t cap)
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

/* Sending last means a client that has its reply finds it counted in /metrics and written in
 * the log. */
void reply_finish(struct Broker *b, struct Request *r, enum ErrCode code, const char *extra,
                         const void *reply, size_t reply_len)
{
    double total = zu_now_ms() - r->t_recv;
    metrics_request(b->o.metrics, r->p.op, code, total / 1e3);
    int level = r->p.op == OP_PING ? LL_DEBUG : LL_INFO;
    if (level <= dlog_level) {
        char id[300];
        reply_id_text(r, id, sizeof id);
        dlog_write(level, "op=%s id=%s%s code=%s total_ms=%.3f%s%s", op_name(r->p.op), id,
                   r->sock == b->http ? " via=http" : "", ec_name(code), total,
                   extra && extra[0] ? " " : "", extra ? extra : "");
    }
    if (reply)
        reply_send(b, r, reply, reply_len);
    if (r->prev)
        live_unlink(b, r);
    b->gauges_dirty = 1;
    request_free(r);
}

void reply_error(struct Broker *b, struct Request *r, enum ErrCode code, const char *msg)
{
    mpw_reset(&b->w);
    proto_error(&b->w, r->p.id_raw, r->p.id_len, code, msg);
    char extra[600], q[560];
    snprintf(extra, sizeof extra, "msg=%s", dlog_quote(q, sizeof q, msg, strlen(msg)));
    reply_finish(b, r, code, extra, b->w.failed ? NULL : b->w.buf.data, b->w.buf.size);
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

/* The width of the result's rows: it holds WIRE_HIDDEN_ROWS rows (first, mean, last) for each
 * layer the broker asked for; 0 when it holds none or not that many (no token, a worker of an
 * earlier version). */
static size_t hidden_dim(const struct Broker *b, const struct WireResult *res)
{
    size_t nl = b->o.n_hidden, dim = nl ? res->n_hidden / (WIRE_HIDDEN_ROWS * nl) : 0;
    return dim && res->n_hidden == WIRE_HIDDEN_ROWS * nl * dim ? dim : 0;
}

/* The calibration's hidden-state probe (its long probe from its length on; s->context_tokens
 * is set) over the result's rows of its layer (the broker asks every job for that layer); left
 * out when the result has none. */
static void probe(const struct Broker *b, const struct WireResult *res, struct GrSignals *s)
{
    const struct GrCalibration *c = b->o.calibration;
    size_t nl = b->o.n_hidden, dim = hidden_dim(b, res);
    if (!c || c->probe_layer < 0 || !dim)
        return;
    for (size_t i = 0; i < nl; i++)
        if (b->o.hidden[i] == c->probe_layer) {
            double z = gr_probe_logit(c, res->hidden + WIRE_HIDDEN_ROWS * i * dim, dim,
                                      s->context_tokens);
            if (isfinite(z)) {
                s->has_probe = 1;
                s->probe = z < -GR_PROBE_CLIP ? -GR_PROBE_CLIP : z > GR_PROBE_CLIP ? GR_PROBE_CLIP : z;
            }
            return;
        }
}

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
        .has_check = res->has_check, .check = res->check,
        .has_reliance = res->has_reliance, .reliance = res->reliance,
        .quote_removed = n ? ws->quote_removed : NULL,
        .context_tokens = r->ctx->documents.end > r->ctx->documents.start
                        ? r->ctx->documents.end - r->ctx->documents.start : 0,
    };
    probe(b, res, &g->sig);
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

/* What the prompt holds of the documents (the planner's struct PlanRead) and of the earlier
 * turns. */
static void put_read(struct MpWriter *w, const struct PlanRead *rs, const struct Context *ctx)
{
    mpw_cstr(w, "context");
    mpw_map(w, 11);
    mpw_kv_uint(w, "documents", rs->documents);
    mpw_cstr(w, "doc_tokens");
    if (rs->doc_tokens >= 0)
        mpw_uint(w, (uint64_t)rs->doc_tokens);
    else
        mpw_nil(w);
    mpw_kv_uint(w, "placed_tokens", rs->placed_tokens);
    mpw_kv_uint(w, "chunks_matched", rs->chunks_matched);
    mpw_kv_uint(w, "chunks_placed", rs->chunks_placed);
    mpw_kv_uint(w, "chunks_left_out", rs->chunks_left_out);
    mpw_kv_uint(w, "chunks_below_floor", rs->chunks_below_floor);
    mpw_kv_bool(w, "whole", rs->whole);
    mpw_kv_bool(w, "window", rs->window);
    mpw_kv_uint(w, "history_turns", ctx->n_turns);
    mpw_kv_uint(w, "history_left_out", ctx->n_turns_skipped);
}

static void put_grounding(const struct Broker *b, struct MpWriter *w, const struct Grounded *g)
{
    const struct GrSummary *s = &g->sum;
    mpw_cstr(w, "grounding");
    mpw_map(w, 14);
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
    put_opt_double(w, "self_check", s->has_check, s->self_check);
    put_opt_double(w, "context_reliance", s->has_reliance, s->context_reliance);
    put_opt_double(w, "hidden_probe", s->has_probe, s->hidden_probe);
    put_opt_double(w, "quote_removed", s->has_quote, s->quote_removed);
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

/* "hidden_states": the residual stream of the configured layers (grounding_hidden_layers),
 * each as its first answer token's row, its mean over the answer, and its last row; nil when
 * the answer has none (no token). */
static void put_hidden_states(const struct Broker *b, struct MpWriter *w,
                              const struct WireResult *res)
{
    size_t nl = b->o.n_hidden, dim = hidden_dim(b, res);
    mpw_cstr(w, "hidden_states");
    if (!dim) {
        mpw_nil(w);
        return;
    }
    const char *keys[WIRE_HIDDEN_ROWS] = {"first", "mean", "last"};
    mpw_map(w, 1 + WIRE_HIDDEN_ROWS);
    mpw_cstr(w, "layers");
    mpw_array(w, nl);
    for (size_t i = 0; i < nl; i++)
        mpw_int(w, b->o.hidden[i]);
    for (int k = 0; k < WIRE_HIDDEN_ROWS; k++) {
        mpw_cstr(w, keys[k]);
        mpw_array(w, nl);
        for (size_t i = 0; i < nl; i++) {
            const float *row = res->hidden + (WIRE_HIDDEN_ROWS * i + (size_t)k) * dim;
            mpw_array(w, dim);
            for (size_t j = 0; j < dim; j++)
                mpw_float(w, row[j]);
        }
    }
}

/* "token_signals": equal-length arrays over the answer tokens. */
static void put_token_signals(struct MpWriter *w, const struct WireResult *res,
                              const struct Grounded *g)
{
    const struct GrSignals *s = &g->sig;
    const char *text = res->text ? res->text : "";   /* text_end was checked against it */
    mpw_cstr(w, "token_signals");
    int scored = g->token_score && g->sum.scored;
    mpw_map(w, 9 + (scored ? 1 : 0) + (s->quote_removed ? 1 : 0));
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
    if (s->quote_removed)
        put_float_array(w, "quote_removed", s->quote_removed, s->n);
    mpw_cstr(w, "unsupported");
    mpw_array(w, s->n);
    for (size_t i = 0; i < s->n; i++)
        mpw_bool(w, s->unsupported[i]);
    if (scored) {
        mpw_cstr(w, "score");
        mpw_array(w, s->n);
        for (size_t i = 0; i < s->n; i++)
            mpw_double(w, g->token_score[i]);
    }
}

/* What the answer policy (the query's unsupported) makes of an answer: its outcome and, when
 * declined, why (docs/groundedness.md#declining). `answer` drops the detector's flag from the
 * reply and the flag counters (the score stays); `decline` replaces the answer with
 * decline_text when retrieval matched nothing (no generation: reply_declines_unread), when the
 * model gave the prompt's refusal, or when the detector flagged it. */
struct Outcome {
    int outcome;        /* enum MetricsOutcome */
    int reason;         /* enum MetricsDecline when declined; -1 otherwise */
};

int reply_declines_unread(const struct Request *r)
{
    return r->p.op == OP_QUERY && r->p.unsupported == UNSUP_DECLINE && r->read.chunks_matched == 0;
}

static struct Outcome outcome_of(const struct Request *r, struct GrSummary *gs)
{
    struct Outcome o = { MO_ANSWERED, -1 };
    if (r->p.unsupported == UNSUP_ANSWER && gs->scored) {
        gs->flagged = 0;
        gs->flagged_tokens = 0;
    }
    if (r->p.unsupported == UNSUP_DECLINE) {
        if (reply_declines_unread(r))
            o.reason = MD_NO_MATCH;
        else if (gs->abstained)
            o.reason = MD_MODEL_REFUSED;
        else if (gs->scored && gs->flagged)
            o.reason = MD_FLAGGED;
    }
    if (o.reason >= 0)
        o.outcome = MO_DECLINED;
    else if (gs->scored && gs->flagged)
        o.outcome = MO_FLAGGED;
    return o;
}

/* The quoted spans of a quote-mode answer, checked against the prompt: each must be inside its
 * chunk's text, and the spans' bytes, one after the other, must be the answer's. A span that
 * fails is left out (and logged: the worker and the broker disagree about the prompt). */
struct Quote { size_t cite, start, end, at; };   /* chunk-text bytes; `at`: in the answer */

static size_t check_quotes(const struct Context *ctx, const struct WireResult *res,
                           struct Quote *out)
{
    size_t n = 0, at = 0;
    const char *text = res->text ? res->text : "";
    for (size_t i = 0; i < res->n_quotes && n < WIRE_MAX_QUOTES; i++) {
        uint32_t span = res->quotes[3 * i], s = res->quotes[3 * i + 1], e = res->quotes[3 * i + 2];
        const struct CtxCitation *c = span < ctx->n_cites ? &ctx->cites[span] : NULL;
        if (!c || e > c->bytes.end - c->bytes.start || at + (e - s) > res->text_len ||
            memcmp(ctx->text + c->bytes.start + s, text + at, e - s) != 0) {
            dlog_write(LL_WARN, "quote %zu of the answer does not match the prompt's documents "
                       "(span %u, bytes %u-%u): left out", i, span, s, e);
            continue;
        }
        out[n++] = (struct Quote){ span, s, e, at };
        at += e - s;
    }
    return n;
}

static void put_quotes(struct MpWriter *w, const struct Context *ctx, const struct Quote *q,
                       size_t n, const char *text)
{
    mpw_cstr(w, "quotes");
    mpw_array(w, n);
    for (size_t i = 0; i < n; i++) {
        const struct CtxCitation *c = &ctx->cites[q[i].cite];
        mpw_map(w, 5);
        mpw_kv_int(w, "marker", c->marker);
        mpw_kv_str(w, "doc_id", c->doc_id, c->doc_id_len);
        mpw_kv_uint(w, "chunk", c->chunk);
        mpw_cstr(w, "offsets");   /* in the document, like a citation's */
        mpw_array(w, 2);
        mpw_uint(w, c->byte_start + q[i].start);
        mpw_uint(w, c->byte_start + q[i].end);
        mpw_kv_str(w, "text", text + q[i].at, q[i].end - q[i].start);
    }
}

static int quotes_cite(const struct Quote *q, size_t n, size_t cite)
{
    for (size_t i = 0; i < n; i++)
        if (q[i].cite == cite)
            return 1;
    return 0;
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

void reply_query(struct Broker *b, struct Request *r, const struct WireResult *res)
{
    if (res->finish == WF_ERROR) {
        char msg[512];
        snprintf(msg, sizeof msg, "%.*s", (int)res->message_len, res->message ? res->message : "");
        reply_error(b, r, res->code ? code_parse(res->code, res->code_len) : EC_INTERNAL,
                    msg[0] ? msg : "the worker failed");
        return;
    }
    const struct Context *ctx = r->ctx;
    double now = zu_now_ms();
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
    struct Outcome oc = outcome_of(r, &g.sum);
    int declined = oc.outcome == MO_DECLINED, unread = oc.reason == MD_NO_MATCH;
    const char *text = res->text ? res->text : "";
    size_t text_len = res->text ? res->text_len : 0;
    const char *answer = declined ? b->cfg->decline_text : text;
    size_t answer_len = declined ? strlen(answer) : text_len;
    size_t n_cites = unread ? 0 : ctx->n_cites;   /* nothing was read: nothing to cite */
    size_t prompt_tokens = unread ? 0 : ctx->n_tokens;
    if (unread)
        context_tokens = 0;
    struct Quote quotes[WIRE_MAX_QUOTES];
    size_t n_quotes = unread ? 0 : check_quotes(ctx, res, quotes);
    int quoting = r->p.answer_mode == ANSWER_QUOTE;
    struct MpWriter *w = &b->w;
    mpw_reset(w);
    proto_reply_head(w, 12 + (r->p.include_token_signals ? 1 : 0) +
                        (r->p.include_hidden_states ? 1 : 0), r->p.id_raw, r->p.id_len, 1);
    mpw_kv_str(w, "answer", answer, answer_len);
    mpw_kv_bool(w, "declined", declined);
    mpw_cstr(w, "decline_reason");
    if (declined)
        mpw_cstr(w, metrics_decline_name(oc.reason));
    else
        mpw_nil(w);
    mpw_cstr(w, "attempt");   /* what the model generated, when it was declined */
    if (declined && !unread)
        mpw_str(w, text, text_len);
    else
        mpw_nil(w);
    mpw_kv_cstr(w, "finish_reason", wire_finish_name(res->finish));
    mpw_kv_cstr(w, "answer_mode", quoting ? "quote" : "free");
    put_quotes(w, ctx, quotes, n_quotes, text);   /* of the generated text: attempt or answer */
    mpw_cstr(w, "citations");
    mpw_array(w, n_cites);
    for (size_t i = 0; i < n_cites; i++) {
        const struct CtxCitation *c = &ctx->cites[i];
        mpw_map(w, 10);
        mpw_kv_str(w, "doc_id", c->doc_id, c->doc_id_len);
        mpw_kv_uint(w, "chunk", c->chunk);
        mpw_kv_str(w, "heading", c->heading, c->heading_len);
        mpw_cstr(w, "page");  /* [first, last] pages of a text with page markers, else nil */
        if (c->page_first) {
            mpw_array(w, 2);
            mpw_uint(w, c->page_first);
            mpw_uint(w, c->page_last);
        } else {
            mpw_nil(w);
        }
        mpw_kv_double(w, "score", c->score);
        mpw_cstr(w, "offsets");
        mpw_array(w, 2);
        mpw_uint(w, c->byte_start);
        mpw_uint(w, c->byte_end);
        mpw_kv_int(w, "marker", c->marker);
        /* a quoted answer cites by its spans; a free one by its markers */
        mpw_kv_bool(w, "cited", quoting ? !declined && quotes_cite(quotes, n_quotes, i)
                                        : answer_cites(answer, answer_len, c->marker));
        mpw_kv_bool(w, "truncated", c->truncated);
        mpw_kv_bool(w, "whole", c->whole);
    }
    put_read(w, &r->read, ctx);
    mpw_cstr(w, "usage");
    mpw_map(w, 5);
    mpw_kv_uint(w, "prompt_tokens", prompt_tokens);
    mpw_kv_uint(w, "context_tokens", context_tokens);
    mpw_kv_uint(w, "completion_tokens", (uint64_t)res->completion_tokens);
    mpw_kv_uint(w, "cached_tokens", (uint64_t)res->cached_tokens);
    mpw_kv_uint(w, "reused_tokens", (uint64_t)res->reused_tokens);
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
    if (r->p.include_hidden_states)
        put_hidden_states(b, w, res);
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
        .context_tokens = ctx->n_tokens, .cached_tokens = (uint64_t)res->cached_tokens,
        .finish = (int)res->finish,
    };
    if (!unread)   /* the generation figures count queries a worker ran */
        metrics_query(b->o.metrics, &q);
    const struct GrSummary *gs = &g.sum;
    metrics_grounding(b->o.metrics, gs);
    metrics_outcome(b->o.metrics, oc.outcome, oc.reason);
    char extra[1024], f_score[32], f_lb[32], f_uns[32], f_mlp[32], f_minlp[32];
    snprintf(extra, sizeof extra,
             "finish=%s queue_ms=%.3f retrieve_ms=%.3f prefill_ms=%.3f ttft_ms=%.3f decode_ms=%.3f "
             "prompt_tokens=%zu cached_tokens=%lld reused_tokens=%lld context_tokens=%zu "
             "completion_tokens=%lld "
             "doc_tokens=%lld placed_tokens=%zu chunks_left_out=%zu whole=%s window=%s "
             "retried=%d detector=%s "
             "score=%s flagged=%s abstained=%s lookback_ratio=%s unsupported_token_ratio=%s "
             "mean_logprob=%s min_logprob=%s answer_tokens=%zu flagged_tokens=%zu outcome=%s%s%s",
             wire_finish_name(res->finish), queue_ms, r->retrieve_ms, res->prefill_ms, ttft,
             res->decode_ms, prompt_tokens, (long long)res->cached_tokens,
             (long long)res->reused_tokens, context_tokens,
             (long long)res->completion_tokens, r->read.doc_tokens, r->read.placed_tokens,
             r->read.chunks_left_out, r->read.whole ? "true" : "false",
             r->read.window ? "true" : "false",
             r->retried, b->o.calibration ? b->o.calibration->name : "none",
             opt_fmt(f_score, sizeof f_score, gs->scored, gs->score),
             gs->scored ? (gs->flagged ? "true" : "false") : "-", gs->abstained ? "true" : "false",
             opt_fmt(f_lb, sizeof f_lb, gs->has_ratios, gs->lookback_ratio),
             opt_fmt(f_uns, sizeof f_uns, gs->has_ratios, gs->unsupported_token_ratio),
             opt_fmt(f_mlp, sizeof f_mlp, gs->has_ratios, gs->mean_logprob),
             opt_fmt(f_minlp, sizeof f_minlp, gs->has_ratios, gs->min_logprob),
             gs->answer_tokens, gs->flagged_tokens, metrics_outcome_name(oc.outcome),
             declined ? " decline_reason=" : "", declined ? metrics_decline_name(oc.reason) : "");
    reply_finish(b, r, EC_OK, extra, w->buf.data, w->buf.size);
}

void reply_store_op(struct Broker *b, struct Request *r)
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
    reply_finish(b, r, EC_OK, extra, w->buf.data, w->buf.size);
}

void reply_ping(struct Broker *b, struct Request *r)
{
    struct MpWriter *w = &b->w;
    mpw_reset(w);
    proto_reply_head(w, 5, r->p.id_raw, r->p.id_len, 1);
    mpw_kv_bool(w, "pong", 1);
    mpw_kv_cstr(w, "version", b->o.version);
    mpw_kv_cstr(w, "model", b->o.model_name);
    mpw_kv_cstr(w, "architecture", b->o.model_architecture);
    mpw_kv_cstr(w, "quantization", b->o.model_quantization);
    reply_finish(b, r, EC_OK, NULL, w->buf.data, w->buf.size);
}

void reply_daemon_stats(struct Broker *b, struct Request *r)
{
    struct MpWriter *w = &b->w;
    uint64_t kv = workers_kv_bytes(b);
    mpw_reset(w);
    proto_reply_head(w, 8, r->p.id_raw, r->p.id_len, 1);
    mpw_kv_cstr(w, "version", b->o.version);
    mpw_kv_cstr(w, "model", b->o.model_name);
    mpw_kv_double(w, "uptime_s", (zu_now_ms() - b->started) / 1e3);
    mpw_cstr(w, "workers");
    mpw_map(w, 2);
    mpw_kv_int(w, "idle", b->n_workers - b->n_busy);
    mpw_kv_int(w, "busy", b->n_busy);
    mpw_kv_int(w, "queue_depth", b->n_wait);
    mpw_kv_int(w, "inflight", b->n_live);
    mpw_kv_uint(w, "kv_cache_bytes", kv);
    mpw_kv_bool(w, "draining", b->draining);
    reply_finish(b, r, EC_OK, NULL, w->buf.data, w->buf.size);
}

void reply_delta(struct Broker *b, struct Request *r, const char *text, size_t len)
{
    struct MpWriter *mw = &b->w;
    mpw_reset(mw);
    mpw_map(mw, 2);
    mpw_cstr(mw, "id");
    if (r->p.id_raw)
        mpw_raw(mw, r->p.id_raw, r->p.id_len);
    else
        mpw_nil(mw);
    mpw_kv_str(mw, "delta", text, len);
    if (!mw->failed) {
        reply_send(b, r, mw->buf.data, mw->buf.size);
        r->streamed = 1;
    }
}
