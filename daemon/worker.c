/* A worker's two threads: the I/O thread (broker socket, heartbeats, reconnects with back-off,
 * cancels) and the compute thread (the batch scheduler of daemon/sched.c, on the CPU or a
 * GPU), joined by an inproc PAIR socket. Cancels reach the scheduler as messages between
 * steps. */
#include "daemon/worker.h"
#include "daemon/worker_internal.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/fault.h"
#include "daemon/log.h"
#include "daemon/wire.h"
#include "daemon/zutil.h"
#include "model/generate.h"
#include "model/tokenizer.h"
#include "retriever/prompt.h"

size_t worker_kv_bytes(const struct Worker *w)
{
    return w ? w->kv_bytes : 0;
}

/* ---- compute thread ---- */

void worker_sigbuf_free(struct SigBuf *b)
{
    for (int i = 0; i < WS_N_FLOAT; i++)
        free(b->s.f[i]);
    free(b->s.text_end);
    free(b->s.quote_removed);
    free(b->hid_first);
    free(b->hid_sum);
    free(b->hid_last);
    memset(b, 0, sizeof *b);
}

/* Adds an answer token's captured rows: the first token's are kept, every token's summed, and
 * the latest kept as the last. */
static void sigbuf_hidden(struct SigBuf *b, const struct GenToken *t, int dim)
{
    size_t n = (size_t)t->n_hidden * dim;
    if (!b->hid_sum) {
        b->hid_first = malloc(n * sizeof *b->hid_first);
        b->hid_sum = calloc(n, sizeof *b->hid_sum);
        b->hid_last = malloc(n * sizeof *b->hid_last);
        if (!b->hid_first || !b->hid_sum || !b->hid_last) {
            b->oom = 1;
            return;
        }
        memcpy(b->hid_first, t->hidden, n * sizeof *b->hid_first);
        b->hid_rows = t->n_hidden;
        b->hid_dim = dim;
    }
    if (t->n_hidden != b->hid_rows)
        return;
    for (size_t i = 0; i < n; i++)
        b->hid_sum[i] += t->hidden[i];
    memcpy(b->hid_last, t->hidden, n * sizeof *b->hid_last);
}

/* The token that ends the turn is not an answer token, but the rows that gave it, at the last
 * answer token's position, have read the whole answer: they become the last rows. */
static void sigbuf_hidden_end(struct SigBuf *b, const struct GenToken *t)
{
    if (b->hid_last && t->hidden && t->n_hidden == b->hid_rows)
        memcpy(b->hid_last, t->hidden, (size_t)t->n_hidden * b->hid_dim * sizeof *b->hid_last);
}

float *worker_sigbuf_hidden(const struct SigBuf *b, size_t *n)
{
    *n = 0;
    if (!b->hid_first || !b->hid_sum || !b->hid_last || b->s.n == 0)
        return NULL;   /* none captured, or out of memory when the first answer token came */
    size_t d = (size_t)b->hid_dim;
    float *out = malloc((size_t)b->hid_rows * WIRE_HIDDEN_ROWS * d * sizeof *out);
    if (!out)
        return NULL;
    for (int r = 0; r < b->hid_rows; r++) {
        float *o = out + (size_t)r * WIRE_HIDDEN_ROWS * d;
        memcpy(o, b->hid_first + (size_t)r * d, d * sizeof *out);
        for (size_t i = 0; i < d; i++)
            o[d + i] = (float)(b->hid_sum[(size_t)r * d + i] / (double)b->s.n);
        memcpy(o + 2 * d, b->hid_last + (size_t)r * d, d * sizeof *out);
    }
    *n = (size_t)b->hid_rows * WIRE_HIDDEN_ROWS * d;
    return out;
}

static int sigbuf_grow(struct SigBuf *b)
{
    size_t cap = b->cap ? b->cap * 2 : 64;
    for (int i = 0; i < WS_N_FLOAT; i++) {
        float *f = realloc(b->s.f[i], cap * sizeof *f);
        if (!f)
            return -1;
        b->s.f[i] = f;
    }
    uint32_t *te = realloc(b->s.text_end, cap * sizeof *te);
    if (!te)
        return -1;
    b->s.text_end = te;
    if (b->quoting) {
        float *qr = realloc(b->s.quote_removed, cap * sizeof *qr);
        if (!qr)
            return -1;
        b->s.quote_removed = qr;
    }
    b->cap = cap;
    return 0;
}

/* Appends one answer token: its probabilities and the watched heads' masses averaged
 * (docs/groundedness.md: doc_mass, gen_mass, diff_doc_mass; lookback per head, then
 * averaged, 0 for a head with no mass on either). */
static void sigbuf_add(struct SigBuf *b, const struct GenToken *t, uint32_t text_end)
{
    if (b->oom || (b->s.n == b->cap && sigbuf_grow(b))) {
        b->oom = 1;
        return;
    }
    double doc = 0, gen = 0, diff = 0, lb = 0;
    for (int h = 0; h < t->n_mass; h++) {
        const struct AttnMass *m = &t->mass[h];
        doc += m->doc;
        gen += m->gen;
        diff += m->diff_doc;
        if ((double)m->doc + m->gen != 0)
            lb += m->doc / ((double)m->doc + m->gen);
    }
    double k = t->n_mass > 0 ? (double)t->n_mass : 1;
    size_t i = b->s.n++;
    b->s.f[WS_LOGPROB][i] = t->sig.logprob;
    b->s.f[WS_ENTROPY][i] = t->sig.entropy;
    b->s.f[WS_MARGIN][i] = t->sig.margin;
    b->s.f[WS_DOC_MASS][i] = (float)(doc / k);
    b->s.f[WS_GEN_MASS][i] = (float)(gen / k);
    b->s.f[WS_DIFF_DOC_MASS][i] = (float)(diff / k);
    b->s.f[WS_LOOKBACK][i] = (float)(lb / k);
    b->s.text_end[i] = text_end;
    if (b->quoting)
        b->s.quote_removed[i] = t->quote_removed == t->quote_removed ? t->quote_removed : 0;
}

int worker_on_token(void *user, const struct GenToken *t)
{
    struct RunCtx *rc = user;
    if (!rc->got_first) {
        rc->ttft_ms = zu_now_ms() - rc->t0;
        rc->got_first = 1;
    }
    if (rc->stream && t->text_len)
        zu_send_job(rc->pair, NULL, 0, WIRE_DELTA, rc->job, t->text, t->text_len, 0);
    rc->released += (uint32_t)t->text_len;
    /* The control token that ends the turn is not an answer token, nor is the release of
     * held-back text at the end (id -1): what they release belongs to the last answer token. */
    const struct Tokenizer *tok = rc->w->m->tok;
    if (t->id < 0 || tok_is_end(tok, t->id) || tok_is_special(tok, t->id)) {
        if (rc->sig.s.n)
            rc->sig.s.text_end[rc->sig.s.n - 1] = rc->released;
        if (t->id >= 0 && !rc->sig.oom)
            sigbuf_hidden_end(&rc->sig, t);
    } else {
        sigbuf_add(&rc->sig, t, rc->released);
        if (t->hidden && t->n_hidden > 0 && !rc->sig.oom)
            sigbuf_hidden(&rc->sig, t, rc->w->m->cfg.dim);
    }
    return *rc->cancelled;
}

size_t worker_quote_bytes(const struct Tokenizer *tok, const struct WireJob *job,
                          const struct QuoteSpan *spans, int n, size_t text_len, uint32_t *out)
{
    size_t k = 0, used = 0;
    for (int i = 0; i < n && used < text_len; i++) {
        const struct QuoteSpan *qs = &spans[i];
        if (qs->span >= job->n_spans)
            continue;
        uint32_t first = job->doc_spans[2 * qs->span];
        size_t start = 0, end;
        for (uint32_t t = first; t < first + qs->tok_start && t < job->n_tokens; t++) {
            size_t len = 0;
            tok_piece(tok, job->tokens[t], &len);
            start += len;
        }
        end = start;
        for (uint32_t t = first + qs->tok_start; t < first + qs->tok_end && t < job->n_tokens; t++) {
            size_t len = 0;
            tok_piece(tok, job->tokens[t], &len);
            end += len;
        }
        if (qs->skip_space && start < end)
            start++;
        if (end - start > text_len - used)
            end = start + (text_len - used);
        if (end <= start || end > UINT32_MAX)
            continue;
        used += end - start;
        out[3 * k] = qs->span;
        out[3 * k + 1] = (uint32_t)start;
        out[3 * k + 2] = (uint32_t)end;
        k++;
    }
    return k;
}

void worker_send_result(void *pair, const struct WireResult *r)
{
    struct MpWriter mw;
    mpw_init(&mw);
    wire_result_encode(&mw, r);
    if (mw.failed) {
        /* out of memory for the text: still answer, without it */
        struct WireResult e = { .job = r->job, .finish = WF_ERROR, .code = "internal", .code_len = 8,
                                .message = "out of memory", .message_len = 13 };
        mpw_reset(&mw);
        wire_result_encode(&mw, &e);
    }
    zu_send_job(pair, NULL, 0, WIRE_RESULT, r->job, mw.buf.data, mw.buf.size, 0);
    mpw_destroy(&mw);
}

void worker_send_error(void *pair, uint64_t job, const char *code, const char *msg)
{
    struct WireResult r = { .job = job, .finish = WF_ERROR, .code = code, .code_len = strlen(code),
                            .message = msg, .message_len = strlen(msg) };
    worker_send_result(pair, &r);
}

int worker_ground(const struct Model *m, struct Engine *e, const struct WireJob *job, char *err,
                  size_t errlen)
{
    struct AttnWatch want[ENGINE_MAX_WATCH];
    int n;
    if (!job->watch_given) {
        n = engine_default_watch(m, want, ENGINE_MAX_WATCH);
    } else {
        n = (int)job->n_watch;
        for (int i = 0; i < n; i++)
            want[i] = (struct AttnWatch){ job->watch[2 * i], job->watch[2 * i + 1] };
    }
    if (engine_watch(e, want, n, err, errlen))
        return -1;
    /* a layer the model lacks (a broker without the model cannot check) refuses the job */
    int layers[WIRE_MAX_HIDDEN], nh = 0;
    for (size_t i = 0; i < job->n_hidden && i < WIRE_MAX_HIDDEN; i++)
        layers[nh++] = job->hidden[i];
    if (engine_capture(e, layers, nh, err, errlen))
        return -1;
    uint8_t *cls = calloc(job->n_tokens, 1);
    if (!cls) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < job->n_spans; i++)
        memset(cls + job->doc_spans[2 * i], ATTN_DOC, job->doc_spans[2 * i + 1] - job->doc_spans[2 * i]);
    int rc = engine_set_spans(e, cls, job->n_tokens, err, errlen);
    free(cls);
    return rc ? -1 : 0;
}

/* The check's tokens and the verdict words' ids, from the model's tokenizer. */
static void check_init(struct Worker *w)
{
    const struct Tokenizer *t = w->m->tok;
    const char *text = prompt_check();
    size_t n;
    w->n_check = 0;
    if (tok_encode(t, text, strlen(text), TOK_PARSE_SPECIAL, w->check, WORKER_CHECK_MAX, &n) ||
        n == 0 || n > WORKER_CHECK_MAX)
        return;
    for (int yes = 0; yes <= 1; yes++) {
        int32_t *ids = yes ? w->yes_id : w->no_id;
        int *k = yes ? &w->n_yes : &w->n_no;
        *k = 0;
        /* a word's first token (the whole word in the vocabularies of real models) */
        for (const char *const *word = prompt_check_words(yes); *word && *k < 4; word++) {
            int32_t id;
            size_t m;
            if (!tok_encode(t, *word, strlen(*word), 0, &id, 1, &m) && m >= 1)
                ids[(*k)++] = id;
        }
    }
    for (int i = 0; i < w->n_yes; i++)
        for (int j = 0; j < w->n_no; j++)
            if (w->yes_id[i] == w->no_id[j])
                return;   /* a token that says both cannot tell them apart */
    if (w->n_yes && w->n_no)
        w->n_check = (int)n;
}

/* A log-odds or log-probability difference (not NaN) as the wire carries it: within +-1e4. */
static float clamp_log(double v)
{
    return (float)(v > 1e4 ? 1e4 : v < -1e4 ? -1e4 : v);
}

/* log of the sum of exp(lg[ids[i]] - mx) */
static double log_sum(const float *lg, const int32_t *ids, int n, double mx)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += exp((double)lg[ids[i]] - mx);
    return log(s);
}

/* The self-check: appends the check's tokens to context e (which holds the prompt and the
 * answer) and reads the verdict from the next token's logits, log P(yes words) - log P(no
 * words). 0 with *logodds, or -1 when the job did not ask for it, the model cannot run it, or
 * it failed (no room in the context or the pool, a device error). */
static int self_check(struct Worker *w, const struct WireJob *job, struct Engine *e,
                      float *logodds)
{
    char err[256];
    if (!job->self_check || w->n_check == 0)
        return -1;
    if (engine_prefill(e, w->check, (size_t)w->n_check, err, sizeof err)) {
        dlog(LL_DEBUG, "msg=\"self-check skipped\" worker=%d job=%llu error=\"%s\"", w->o.index,
             (unsigned long long)job->job, err);
        return -1;
    }
    const float *lg = engine_logits(e);
    if (!lg)
        return -1;
    double mx = -INFINITY;
    for (int i = 0; i < w->n_yes; i++)
        if (lg[w->yes_id[i]] > mx) mx = lg[w->yes_id[i]];
    for (int i = 0; i < w->n_no; i++)
        if (lg[w->no_id[i]] > mx) mx = lg[w->no_id[i]];
    if (!isfinite(mx))
        return -1;
    *logodds = clamp_log(log_sum(lg, w->yes_id, w->n_yes, mx) -
                         log_sum(lg, w->no_id, w->n_no, mx));
    return 0;
}

/* Context reliance: resets CPU context e and scores the k answer tokens `ans` after the job's
 * prompt without its documents; *out = mean(lp_with[0..k)) - mean(log p(ans[j] | bare prompt,
 * ans[0..j))). 0, or -1 when the job did not ask for it, on a GPU context, or when it failed
 * (no room, out of memory). */
static int reliance(struct Worker *w, const struct WireJob *job, struct Engine *e,
                    const int32_t *ans, size_t k, const float *lp_with, float *out)
{
    char err[256];
    if (!job->bare || job->n_bare == 0 || k == 0 || engine_opts(e)->device != ENGINE_CPU)
        return -1;
    size_t n = job->n_bare + k;
    int32_t *toks = malloc(n * sizeof *toks);
    float *nll = malloc(n * sizeof *nll);
    int rc = -1;
    if (!toks || !nll)
        goto out;
    memcpy(toks, job->bare, job->n_bare * sizeof *toks);
    memcpy(toks + job->n_bare, ans, k * sizeof *toks);
    engine_reset(e);
    if (engine_score_positions(e, toks, n, nll, NULL, NULL, err, sizeof err)) {
        dlog(LL_DEBUG, "msg=\"context reliance skipped\" worker=%d job=%llu error=\"%s\"",
             w->o.index, (unsigned long long)job->job, err);
        goto out;
    }
    double with = 0, without = 0;
    for (size_t j = 0; j < k; j++) {
        with += lp_with[j];
        without -= nll[job->n_bare + j - 1];   /* position n_bare + j - 1 predicts ans[j] */
    }
    double v = (with - without) / (double)k;
    if (isfinite(v)) {
        *out = clamp_log(v);
        rc = 0;
    }
out:
    free(toks);
    free(nll);
    return rc;
}

void worker_after_answer(struct Worker *w, const struct WireJob *job, struct Engine *e,
                         const int32_t *ans, size_t k, struct WireResult *r)
{
    if ((r->finish != WF_STOP && r->finish != WF_LENGTH) || r->completion_tokens == 0)
        return;
    r->has_check = !self_check(w, job, e, &r->check);
    if (k > r->sig.n)
        k = r->sig.n;
    r->has_reliance = !reliance(w, job, e, ans, k, r->sig.f[WS_LOGPROB], &r->reliance);
}

static void *compute_main(void *arg)
{
    struct Worker *w = arg;
    void *pair = zmq_socket(w->zctx, ZMQ_PAIR);
    if (!pair || zmq_connect(pair, w->pair_ep)) {
        dlog(LL_ERROR, "msg=\"worker compute socket failed\" worker=%d error=\"%s\"", w->o.index,
             zmq_strerror(errno));
        if (pair)
            zmq_close(pair);
        return NULL;
    }
    sched_run(w, pair);
    zu_send_cmd(pair, NULL, 0, WIRE_DISCONNECT, NULL, 0, 0);  /* bye: the I/O thread may exit */
    zmq_close(pair);
    return NULL;
}

/* ---- I/O thread ---- */

static void *connect_broker(struct Worker *w)
{
    void *s = zmq_socket(w->zctx, ZMQ_DEALER);
    if (!s)
        return NULL;
    int linger = 200, hwm = 100000;
    int64_t maxmsg = WIRE_MAX_MESSAGE;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    if (w->curve_server[0] &&
        (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, w->curve_server, 41) ||
         zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, w->curve_public, 41) ||
         zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, w->curve_secret, 41))) {
        dlog(LL_ERROR, "msg=\"worker cannot set its CurveZMQ keys\" worker=%d error=\"%s\"",
             w->o.index, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    if (zmq_connect(s, w->endpoint)) {
        dlog(LL_ERROR, "msg=\"worker cannot connect\" worker=%d endpoint=%s error=\"%s\"",
             w->o.index, w->endpoint, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}

/* Closing to reconnect: nothing queued on the old connection (a stale READY above all) may
 * reach the broker later, so no linger. */
static void drop_socket(void *s)
{
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(s);
}

static void send_ready(struct Worker *w, void *dealer)
{
    struct WireInfo info;
    memset(&info, 0, sizeof info);
    snprintf(info.model, sizeof info.model, "%s", w->model_name);
    info.vocab = w->m->cfg.vocab;
    info.n_ctx = engine_opts(w->e)->n_ctx;
    info.threads = engine_opts(w->e)->n_threads;
    info.kv_bytes = w->kv_bytes;
    info.max_running = w->max_running;
    struct MpWriter mw;
    mpw_init(&mw);
    wire_info_encode(&mw, &info);
    if (!mw.failed)
        zu_send_cmd(dealer, NULL, 0, WIRE_READY, mw.buf.data, mw.buf.size, ZMQ_DONTWAIT);
    mpw_destroy(&mw);
}

/* Binds a fresh PAIR for the next compute thread (a PAIR takes one peer in its lifetime; a
 * new name avoids racing the old peer's teardown) and starts that thread. 0 or -1. */
static int start_compute(struct Worker *w, char *err, size_t errlen)
{
    w->generation++;
    snprintf(w->pair_ep, sizeof w->pair_ep, "inproc://diffrag-worker-%p-pair-%d", (void *)w,
             w->generation);
    w->pair_io = zmq_socket(w->zctx, ZMQ_PAIR);
    if (!w->pair_io || zmq_bind(w->pair_io, w->pair_ep)) {
        snprintf(err, errlen, "worker sockets: %s", zmq_strerror(errno));
        return -1;
    }
    if (pthread_create(&w->compute_thread, NULL, compute_main, w)) {
        snprintf(err, errlen, "cannot start a thread");
        return -1;
    }
    w->compute_started = 1;
    return 0;
}

/* The compute thread ended without being asked to: the engine context it left may be in any
 * state, so it is rebuilt before a new thread takes over. 0, or -1 when the worker cannot go
 * on (it then leaves the broker). */
static int restart_compute(struct Worker *w)
{
    char err[512];
    pthread_join(w->compute_thread, NULL);
    w->compute_started = 0;
    zmq_close(w->pair_io);
    w->pair_io = NULL;
    /* the sequences the thread left are lost with it; their contexts go with the runner */
    while (w->n_seq_e > 0)
        engine_destroy(&w->seq_e[--w->n_seq_e]);
    engine_destroy(&w->ckv_helper);
    chunkkv_destroy(&w->ckv);
    engine_destroy(&w->e);
    int rc = engine_new(w->m, &w->o.engine, &w->e, err, sizeof err);
    if (rc == 0)
        rc = start_compute(w, err, sizeof err);
    if (rc) {
        dlog(LL_ERROR, "msg=\"worker cannot restart its compute thread; it leaves the pool\" "
             "worker=%d error=\"%s\"", w->o.index, err);
        return -1;
    }
    dlog(LL_WARN, "msg=\"worker compute thread restarted\" worker=%d generation=%d", w->o.index,
         w->generation);
    return 0;
}

static void send_job_error(void *dealer, uint64_t job, const char *message)
{
    struct WireResult r = { .job = job, .finish = WF_ERROR, .code = "internal", .code_len = 8,
                            .message = message, .message_len = strlen(message) };
    struct MpWriter mw;
    mpw_init(&mw);
    wire_result_encode(&mw, &r);
    if (!mw.failed)
        zu_send_job(dealer, NULL, 0, WIRE_RESULT, r.job, mw.buf.data, mw.buf.size, ZMQ_DONTWAIT);
    mpw_destroy(&mw);
}

/* Asks the compute thread to stop a job: the batch scheduler reads the CANCEL between steps. */
static void request_cancel(struct Worker *w, uint64_t job, int reason)
{
    uint8_t r = (uint8_t)reason;
    zu_send_job(w->pair_io, NULL, 0, WIRE_CANCEL, job, &r, 1, 0);
}

/* The jobs the I/O thread handed to the compute thread and has not seen answered. A job of a
 * connection that is gone is discarded: its result must not reach the next connection. */
struct IoJobs {
    uint64_t id[WIRE_MAX_RUNNING];
    uint8_t discard[WIRE_MAX_RUNNING];
    int n;
};

static int io_job_find(const struct IoJobs *j, uint64_t id)
{
    for (int i = 0; i < j->n; i++)
        if (j->id[i] == id)
            return i;
    return -1;
}

/* Cancels every live job; with discard, their results will be dropped. */
static void io_jobs_cancel_all(struct Worker *w, struct IoJobs *j, int discard)
{
    for (int i = 0; i < j->n; i++) {
        if (!j->discard[i])
            request_cancel(w, j->id[i], WIRE_REASON_SHUTDOWN);
        if (discard)
            j->discard[i] = 1;
    }
}

static void *io_main(void *arg)
{
    struct Worker *w = arg;
    const double hb = w->o.heartbeat_ms;
    void *dealer = NULL;
    double now = zu_now_ms(), next_hb = now, last_heard = now, reconnect_at = now;
    double backoff = hb;
    int stopping = 0, ready_owed = 0;
    struct IoJobs jobs = { .n = 0 };
    for (;;) {
        now = zu_now_ms();
        if (!dealer && !stopping && now >= reconnect_at) {
            dealer = connect_broker(w);
            if (dealer) {
                last_heard = now;
                next_hb = now + hb;
                ready_owed = 1;
            } else {
                reconnect_at = now + backoff;
            }
        }
        if (dealer && ready_owed && jobs.n == 0) {
            send_ready(w, dealer);
            ready_owed = 0;
        }
        zmq_pollitem_t items[3] = {
            { w->ctl, 0, ZMQ_POLLIN, 0 },
            { w->pair_io, 0, ZMQ_POLLIN, 0 },
            { dealer, 0, ZMQ_POLLIN, 0 },
        };
        double until = dealer ? next_hb : reconnect_at;
        long timeout = stopping ? 100 : (long)(until - now);
        if (timeout < 0) timeout = 0;
        if (timeout > 1000) timeout = 1000;
        int n = zmq_poll(items, dealer ? 3 : 2, timeout);
        if (n < 0 && errno != EINTR)
            break;
        now = zu_now_ms();
        if (n > 0 && (items[0].revents & ZMQ_POLLIN)) {
            struct ZuMsg m;
            if (zu_recv(w->ctl, &m, ZMQ_DONTWAIT) == 0)
                zu_close(&m);
            if (!stopping) {
                stopping = 1;
                io_jobs_cancel_all(w, &jobs, 0);
                zu_send_cmd(w->pair_io, NULL, 0, WIRE_DISCONNECT, NULL, 0, 0);
                if (dealer)
                    zu_send_cmd(dealer, NULL, 0, WIRE_DISCONNECT, NULL, 0, ZMQ_DONTWAIT);
            }
        }
        if (n > 0 && (items[1].revents & ZMQ_POLLIN)) {
            struct ZuMsg m;
            int done = 0, died = 0;
            while (zu_recv(w->pair_io, &m, ZMQ_DONTWAIT) == 0) {
                uint8_t cmd = m.n >= 1 && zu_size(&m, 0) == 1 ? *(const uint8_t *)zu_data(&m, 0) : 0;
                if (cmd == WIRE_DISCONNECT) {
                    if (stopping)
                        done = 1;
                    else
                        died = 1;
                } else if ((cmd == WIRE_DELTA || cmd == WIRE_RESULT) && m.n == 2 &&
                           zu_size(&m, 1) >= 8) {
                    int at = io_job_find(&jobs, wire_get_u64(zu_data(&m, 1)));
                    if (dealer && at >= 0 && !jobs.discard[at]) {
                        const void *bufs[2] = { zu_data(&m, 0), zu_data(&m, 1) };
                        size_t lens[2] = { 1, zu_size(&m, 1) };
                        zu_send(dealer, bufs, lens, 2, ZMQ_DONTWAIT);
                    }
                    if (cmd == WIRE_RESULT && at >= 0) {
                        if (jobs.discard[at] && dealer)
                            ready_owed = 1;   /* a fresh connection has not heard READY */
                        jobs.id[at] = jobs.id[jobs.n - 1];
                        jobs.discard[at] = jobs.discard[jobs.n - 1];
                        jobs.n--;
                    }
                }
                zu_close(&m);
                if (done || died)
                    break;
            }
            if (done)
                break;
            if (died) {
                /* its job will never be answered by it: answer it here, then carry on with a
                 * new thread and engine */
                dlog(LL_ERROR, "msg=\"worker compute thread ended unexpectedly\" worker=%d busy=%d",
                     w->o.index, jobs.n);
                for (int i = 0; i < jobs.n; i++) {
                    if (dealer && !jobs.discard[i])
                        send_job_error(dealer, jobs.id[i], "the worker's compute thread failed "
                                       "during this request; it was restarted");
                    if (jobs.discard[i] && dealer)
                        ready_owed = 1;
                }
                jobs.n = 0;
                if (restart_compute(w)) {
                    if (dealer)
                        zu_send_cmd(dealer, NULL, 0, WIRE_DISCONNECT, NULL, 0, ZMQ_DONTWAIT);
                    break;
                }
            }
        }
        if (dealer && n > 0 && (items[2].revents & ZMQ_POLLIN)) {
            struct ZuMsg m;
            while (dealer && zu_recv(dealer, &m, ZMQ_DONTWAIT) == 0) {
                last_heard = now;
                backoff = hb;
                uint8_t cmd = m.n >= 1 && zu_size(&m, 0) == 1 ? *(const uint8_t *)zu_data(&m, 0) : 0;
                const uint8_t *b = m.n == 2 ? zu_data(&m, 1) : NULL;
                size_t bl = m.n == 2 ? zu_size(&m, 1) : 0;
                if (cmd == WIRE_JOB && bl >= 8) {
                    if (jobs.n >= w->max_running || stopping) {
                        /* the broker thinks this worker has room: answer rather than drop */
                        send_job_error(dealer, wire_get_u64(b), "worker busy");
                    } else {
                        jobs.id[jobs.n] = wire_get_u64(b);
                        jobs.discard[jobs.n++] = 0;
                        const void *bufs[2] = { zu_data(&m, 0), b };
                        size_t lens[2] = { 1, bl };
                        zu_send(w->pair_io, bufs, lens, 2, 0);
                    }
                } else if (cmd == WIRE_CANCEL && bl >= 9) {
                    int at = io_job_find(&jobs, wire_get_u64(b));
                    if (at >= 0 && !jobs.discard[at])
                        request_cancel(w, jobs.id[at], b[8]);
                } else if (cmd == WIRE_DISCONNECT) {
                    /* The broker does not know this worker (it restarted, or expired us):
                     * register again on a fresh connection. */
                    dlog(LL_INFO, "msg=\"broker asked to reconnect\" worker=%d", w->o.index);
                    io_jobs_cancel_all(w, &jobs, 1);
                    drop_socket(dealer);
                    dealer = NULL;
                    reconnect_at = now;
                }
                zu_close(&m);
            }
        }
        if (dealer && now >= next_hb) {
            zu_send_cmd(dealer, NULL, 0, WIRE_HEARTBEAT, NULL, 0, ZMQ_DONTWAIT);
            next_hb = now + hb;
        }
        if (dealer && !stopping && now - last_heard > hb * w->o.liveness) {
            dlog(LL_WARN, "msg=\"broker silent, reconnecting\" worker=%d endpoint=%s backoff_ms=%.0f",
                 w->o.index, w->endpoint, backoff);
            io_jobs_cancel_all(w, &jobs, 1);
            drop_socket(dealer);
            dealer = NULL;
            reconnect_at = now + backoff;
            backoff = backoff * 2 > hb * 32 ? hb * 32 : backoff * 2;
        }
    }
    if (dealer)
        zmq_close(dealer);
    return NULL;
}

/* ---- lifecycle ---- */

int worker_start(void *zctx, const struct Model *m, const struct WorkerOpts *o,
                 struct Worker **out, char *err, size_t errlen)
{
    *out = NULL;
    struct Worker *w = calloc(1, sizeof *w);
    if (!w) {
        snprintf(err, errlen, "out of memory");
        return ENGINE_ENOMEM;
    }
    w->zctx = zctx;
    w->m = m;
    w->o = *o;
    snprintf(w->endpoint, sizeof w->endpoint, "%s", o->endpoint);
    w->o.endpoint = w->endpoint;
    snprintf(w->model_name, sizeof w->model_name, "%s", o->model_name ? o->model_name : m->name);
    w->o.model_name = w->model_name;
    if (o->curve_server && o->curve_public && o->curve_secret) {
        snprintf(w->curve_server, sizeof w->curve_server, "%s", o->curve_server);
        snprintf(w->curve_public, sizeof w->curve_public, "%s", o->curve_public);
        snprintf(w->curve_secret, sizeof w->curve_secret, "%s", o->curve_secret);
    }
    w->o.curve_server = w->o.curve_public = w->o.curve_secret = NULL;
    int rc = engine_new(m, &o->engine, &w->e, err, errlen);
    if (rc)
        goto err;
    if (o->kv_reuse) {
        if (o->engine.device != ENGINE_CPU) {
            snprintf(err, errlen, "kv_reuse runs on CPU workers; this one is on a GPU");
            rc = ENGINE_EINPUT;
            goto err;
        }
        if ((rc = chunkkv_new(o->kv_reuse_bytes ? o->kv_reuse_bytes : 1, &w->ckv)) ||
            (rc = engine_new_seq(w->e, &w->ckv_helper, err, errlen))) {
            if (rc == ENGINE_ENOMEM)
                snprintf(err, errlen, "out of memory for the chunk KV store");
            goto err;
        }
    }
    check_init(w);
    w->max_running = o->max_running < 1 ? 1
                     : o->max_running > WIRE_MAX_RUNNING ? WIRE_MAX_RUNNING : o->max_running;
    struct EngineMemory mem;
    engine_estimate(m, &o->engine, &mem);
    w->kv_bytes = mem.kv_bytes;
    snprintf(w->ctl_ep, sizeof w->ctl_ep, "inproc://diffrag-worker-%p-ctl", (void *)w);
    w->ctl = zmq_socket(zctx, ZMQ_PULL);
    if (!w->ctl || zmq_bind(w->ctl, w->ctl_ep)) {
        snprintf(err, errlen, "worker sockets: %s", zmq_strerror(errno));
        rc = ENGINE_ENOMEM;
        goto err;
    }
    if (start_compute(w, err, errlen)) {
        rc = ENGINE_ENOMEM;
        goto err;
    }
    if (pthread_create(&w->io_thread, NULL, io_main, w)) {
        snprintf(err, errlen, "cannot start a thread");
        rc = ENGINE_ENOMEM;
        goto err;
    }
    w->io_started = 1;
    *out = w;
    return 0;
err:
    worker_stop(&w);
    return rc;
}

void worker_stop(struct Worker **wp)
{
    struct Worker *w = wp ? *wp : NULL;
    if (!w)
        return;
    if (w->io_started) {
        void *push = zmq_socket(w->zctx, ZMQ_PUSH);
        if (push) {
            int linger = 1000;
            zmq_setsockopt(push, ZMQ_LINGER, &linger, sizeof linger);
            if (zmq_connect(push, w->ctl_ep) == 0)
                zmq_send(push, "x", 1, 0);
            zmq_close(push);
        }
        pthread_join(w->io_thread, NULL);
    } else if (w->compute_started) {
        zu_send_cmd(w->pair_io, NULL, 0, WIRE_DISCONNECT, NULL, 0, 0);
    }
    if (w->compute_started)
        pthread_join(w->compute_thread, NULL);
    if (w->pair_io)
        zmq_close(w->pair_io);
    if (w->ctl)
        zmq_close(w->ctl);
    while (w->n_seq_e > 0)
        engine_destroy(&w->seq_e[--w->n_seq_e]);
    records_flush(w, NULL, 0);
    free(w->kv_touch);
    engine_destroy(&w->ckv_helper);
    chunkkv_destroy(&w->ckv);
    engine_destroy(&w->e);
    memset(w->curve_secret, 0, sizeof w->curve_secret);
    free(w);
    *wp = NULL;
}
