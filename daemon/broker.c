/* The broker's event loop and client intake: the client socket (decode, admission into the
 * bounded queue, cancels, deadlines), the live list and the two queues, and the hand-off to the
 * I/O threads. Replies are in reply.c, the workers in workers.c, sd_notify, reload and the
 * drain in lifecycle.c; the op table (ops.c) says how each op is served. */
#include "daemon/broker_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#include "daemon/log.h"
#include "daemon/ops.h"
#include "daemon/prep.h"
#include "daemon/zap.h"
#include "daemon/zutil.h"

static double now_ms(void) { return zu_now_ms(); }

/* ---- the live list and the queues ---- */

static void live_link(struct Broker *b, struct Request *r)
{
    r->next = &b->all;
    r->prev = b->all.prev;
    b->all.prev->next = r;
    b->all.prev = r;
    b->n_live++;
}

void live_unlink(struct Broker *b, struct Request *r)
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

void request_free(struct Request *r)
{
    proto_params_free(&r->p);
    zmq_msg_close(&r->body);
    ctx_destroy(&r->ctx);
    words_set_destroy(&r->doc_words);
    mpw_destroy(&r->reply);
    free(r);
}

void request_wait_worker(struct Broker *b, struct Request *r, int front)
{
    r->state = RS_WAIT;
    b->n_wait++;
    q_push(&b->waitq_head, &b->waitq_tail, r, front);
}

void request_unqueue(struct Broker *b, struct Request *r)
{
    if (r->state == RS_PREP_WAIT)
        q_remove(&b->prepq_head, &b->prepq_tail, r);
    else if (r->state == RS_WAIT && q_remove(&b->waitq_head, &b->waitq_tail, r))
        b->n_wait--;
    b->n_pending--;
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

/* The live request from the client with this ZeroMQ identity whose id is the msgpack value
 * id[0..id_len), or NULL. A request without an id matches nothing. Cancels find their target
 * here, and admission refuses a second request with an id already in flight, so that one id
 * names at most one live request per connection. */
static struct Request *live_find(struct Broker *b, const uint8_t *ident, size_t ident_len,
                                 const uint8_t *id, size_t id_len)
{
    for (struct Request *r = b->all.next; r != &b->all; r = r->next)
        if (r->ident_len == ident_len && !memcmp(r->ident, ident, ident_len) && r->p.id_raw &&
            id_equal(r->p.id_raw, r->p.id_len, id, id_len))
            return r;
    return NULL;
}

/* ---- I/O threads ---- */

static void dispatch_prep(struct Broker *b)
{
    for (int i = 0; i < b->n_preps && b->prepq_head; i++) {
        struct PrepRef *p = &b->preps[i];
        if (p->req || p->stopped)
            continue;
        /* writes serialise in LMDB anyway; keep a thread free for reads when there are two */
        int write_slots = b->o.io_threads > 1 ? b->o.io_threads - 1 : 1;
        struct Request *r = b->prepq_head;
        while (r && ops_writes(&r->p) && b->n_writes >= write_slots)
            r = r->qnext;
        if (!r)
            return;
        q_remove(&b->prepq_head, &b->prepq_tail, r);
        r->state = RS_PREP;
        p->req = r;
        if (ops_writes(&r->p))
            b->n_writes++;
        const void *bufs[2] = { p->ident, &r };
        size_t lens[2] = { p->ident_len, sizeof r };
        zu_send(b->prep, bufs, lens, 2, 0);
    }
}

static void prep_done(struct Broker *b, struct Request *r)
{
    if (ops_writes(&r->p))
        b->n_writes--;
    if (ops_stage(&r->p) != OPS_QUERY) {
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
    if (reply_declines_unread(r)) {   /* nothing bears on the question: no prefill */
        b->n_pending--;
        r->t_dispatch = zu_now_ms();
        if (r->p.stream && !r->req_envelope)   /* the deltas concatenate to the answer */
            reply_delta(b, r, b->cfg->decline_text, strlen(b->cfg->decline_text));
        reply_query(b, r, &(struct WireResult){ .finish = WF_STOP });
        return;
    }
    request_wait_worker(b, r, 0);
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

/* ---- client requests ---- */

static void handle_cancel(struct Broker *b, struct Request *c)
{
    struct Request *t = live_find(b, c->ident, c->ident_len, c->p.target_raw, c->p.target_len);
    if (!t) {
        reply_error(b, c, EC_NOT_FOUND, "no request in flight from this client has that id");
        return;
    }
    if (ops_stage(&t->p) != OPS_QUERY) {
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
        workers_cancel(b, t, WIRE_REASON_CANCEL);
    }
    struct MpWriter *w = &b->w;
    mpw_reset(w);
    proto_reply_head(w, 2, c->p.id_raw, c->p.id_len, 1);
    mpw_kv_bool(w, "found", 1);
    mpw_kv_cstr(w, "state", state);
    reply_finish(b, c, EC_OK, NULL, w->buf.data, w->buf.size);
    if (t->state == RS_PREP_WAIT || t->state == RS_WAIT) {
        request_unqueue(b, t);
        reply_error(b, t, EC_CANCELLED, "cancelled while queued");
    }
}

/* The ops the op table serves in the loop (OPS_LOOP): they need the broker's own state. */
static void answer_in_loop(struct Broker *b, struct Request *r)
{
    if (r->p.op == OP_PING)
        reply_ping(b, r);
    else if (r->p.op == OP_CANCEL)
        handle_cancel(b, r);
    else if (r->p.op == OP_STATS)
        reply_daemon_stats(b, r);
    else
        reply_error(b, r, EC_INTERNAL, "this op has no handler in the loop");
}

static void admit(struct Broker *b, struct Request *r)
{
    const struct Config *cfg = b->cfg;
    if (ops_stage(&r->p) == OPS_LOOP) {
        answer_in_loop(b, r);
        return;
    }
    if (r->p.id_raw && live_find(b, r->ident, r->ident_len, r->p.id_raw, r->p.id_len)) {
        char id[300], msg[400];
        reply_id_text(r, id, sizeof id);
        snprintf(msg, sizeof msg, "id %s is already in flight on this connection: wait for its "
                 "reply or cancel it", id);
        reply_error(b, r, EC_BAD_REQUEST, msg);
        return;
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
    r->extract_timeout_ms = cfg->extract_timeout_ms;
    r->deadline = r->p.deadline_ms ? r->t_recv + (double)r->p.deadline_ms : 0;
    r->state = RS_PREP_WAIT;
    live_link(b, r);
    b->n_pending++;
    b->gauges_dirty = 1;
    q_push(&b->prepq_head, &b->prepq_tail, r, 0);
}

static void handle_clients(struct Broker *b, void *sock)
{
    for (int budget = 0; budget < 256; budget++) {
        struct ZuMsg m;
        if (zu_recv(sock, &m, ZMQ_DONTWAIT))
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
        r->sock = sock;
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
                request_unqueue(b, r);
                reply_error(b, r, EC_DEADLINE_EXCEEDED, "the deadline passed while queued");
            } else if (r->state == RS_RUN) {
                workers_cancel(b, r, WIRE_REASON_DEADLINE);
            }
        }
        r = next;
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
            lifecycle_reload(b);
        }
        if (*b->o.sig_term && !b->draining)
            lifecycle_start_drain(b, now);
        if (b->draining) {
            if (b->n_live == 0)
                break;
            if (!b->drain_forced && now >= b->drain_deadline)
                lifecycle_force_drain(b, now);
            if (b->drain_forced && now >= b->hard_deadline) {
                lifecycle_give_up_running(b);
                if (b->n_live == 0)
                    break;
            }
        }
        if (!b->ready_sent && b->n_workers >= b->o.inproc_workers) {
            sd_notify(0, "READY=1");
            b->ready_sent = 1;
            dlog(LL_INFO, "msg=\"ready\" workers=%d", b->n_workers);
            lifecycle_notify_status(b, now, 1);
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
        zmq_pollitem_t items[4] = {
            { b->back, 0, ZMQ_POLLIN, 0 },
            { b->prep, 0, ZMQ_POLLIN, 0 },
            { b->front, 0, ZMQ_POLLIN, 0 },
            { b->http, 0, ZMQ_POLLIN, 0 },
        };
        int n = zmq_poll(items, 4, timeout);
        if (n < 0 && errno != EINTR) {
            dlog(LL_ERROR, "msg=\"poll failed\" error=\"%s\"", zmq_strerror(errno));
            break;
        }
        if (n > 0 && (items[0].revents & ZMQ_POLLIN))
            workers_receive(b);
        if (n > 0 && (items[1].revents & ZMQ_POLLIN))
            handle_prep(b);
        if (n > 0 && (items[2].revents & ZMQ_POLLIN))
            handle_clients(b, b->front);
        if (n > 0 && (items[3].revents & ZMQ_POLLIN))
            handle_clients(b, b->http);
        now = now_ms();
        check_deadlines(b, now);
        workers_heartbeat(b, now);
        dispatch_prep(b);
        workers_dispatch(b);
        lifecycle_update_gauges(b);
        if (b->watchdog_usec && now >= b->next_watchdog) {
            sd_notify(0, "WATCHDOG=1");
            b->next_watchdog = now + (double)b->watchdog_usec / 2e3;
        }
        lifecycle_notify_status(b, now, 0);
    }
    dlog(LL_INFO, "msg=\"drained\" inflight=%d", b->n_live);
    stop_prep_threads(b);
    return 0;
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
    b->http = zmq_socket(o->zctx, ZMQ_ROUTER);
    if (!b->preps || !b->front || !b->back || !b->prep || !b->http) {
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
    /* The HTTP gateway's connections: one DEALER per HTTP request, in this process. */
    zmq_setsockopt(b->http, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(b->http, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(b->http, ZMQ_RCVHWM, &client_rcvhwm, sizeof client_rcvhwm);
    zmq_setsockopt(b->back, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(b->back, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(b->back, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(b->back, ZMQ_MAXMSGSIZE, &wmax, sizeof wmax);
    if (zmq_bind(b->front, o->cfg->listen)) {
        snprintf(err, errlen, "cannot listen on %s: %s", o->cfg->listen, zmq_strerror(errno));
        goto err;
    }
    if (zmq_bind(b->back, BROKER_WORKERS_INPROC) || zmq_bind(b->prep, BROKER_PREP_INPROC) ||
        zmq_bind(b->http, BROKER_HTTP_INPROC)) {
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
    if (b->http) zmq_close(b->http);
    mpw_destroy(&b->w);
    free(b->preps);
    free(b);
    *bp = NULL;
}
