/* The broker's state, shared by the files that make up the broker: broker.c (the event loop,
 * client intake, the queues, the I/O threads), reply.c (replies), workers.c (the worker
 * registry, LRU dispatch, heartbeats) and lifecycle.c (sd_notify, SIGHUP reload, the drain).
 * All of it runs on the broker thread. Not a public header. */
#ifndef DIFFRAG_BROKER_INTERNAL_H
#define DIFFRAG_BROKER_INTERNAL_H

#include "daemon/broker.h"
#include "daemon/mp.h"
#include "daemon/request.h"
#include "daemon/wire.h"

struct WorkerRef {
    struct WorkerRef *next;
    uint8_t ident[REQ_MAX_IDENT];
    size_t ident_len;
    struct WireInfo info;
    int refused;                /* wrong model: registered only so it is not re-asked */
    struct Request *reqs[WIRE_MAX_RUNNING]; /* the jobs it runs (busy when n_reqs > 0) */
    int n_reqs;
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
    void *http;                             /* ROUTER on BROKER_HTTP_INPROC: the HTTP API */
    struct Request all;                     /* sentinel of the live list */
    int n_live, n_pending;                  /* n_pending: in either queue or an I/O thread */
    struct Request *prepq_head, *prepq_tail; /* waiting for an I/O thread (RS_PREP_WAIT) */
    struct Request *waitq_head, *waitq_tail; /* waiting for a worker (RS_WAIT) */
    int n_wait;
    struct WorkerRef *workers;
    int n_workers, n_busy;                  /* n_busy: workers running at least one job */
    int n_running;                          /* jobs running on workers */
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

/* ---- broker.c: the live list and the queues ---- */

void live_unlink(struct Broker *b, struct Request *r);
void request_free(struct Request *r);
/* Puts r in the worker queue (RS_WAIT): at the front when it is retried. */
void request_wait_worker(struct Broker *b, struct Request *r, int front);
/* Takes r off whichever queue it waits in (RS_PREP_WAIT or RS_WAIT) and out of the pending
 * count; its state is left for the caller, which answers or dispatches it next. */
void request_unqueue(struct Broker *b, struct Request *r);

/* ---- reply.c ---- */

/* Sends body to r's client (never blocks: a reply to a client that left is dropped). */
void reply_send(struct Broker *b, const struct Request *r, const void *body, size_t len);
/* The end of a request: metrics, the log line (extra: more logfmt fields, or NULL), then
 * `reply` (when not NULL) is sent, and the request leaves every list and is freed. */
void reply_finish(struct Broker *b, struct Request *r, enum ErrCode code, const char *extra,
                  const void *reply, size_t reply_len);
void reply_error(struct Broker *b, struct Request *r, enum ErrCode code, const char *msg);
/* A query's final reply from its worker's result (grounding, token signals, metrics). */
void reply_query(struct Broker *b, struct Request *r, const struct WireResult *res);
/* Whether a retrieved query is declined without generating: its policy is decline and the
 * search matched no chunk (docs/groundedness.md#declining). The broker then answers it with
 * reply_query and an empty result, never a worker. */
int reply_declines_unread(const struct Request *r);
/* A store op's reply: the fields its I/O stage wrote into r->reply. */
void reply_store_op(struct Broker *b, struct Request *r);
void reply_ping(struct Broker *b, struct Request *r);
void reply_daemon_stats(struct Broker *b, struct Request *r);
/* A streamed piece of the answer. */
void reply_delta(struct Broker *b, struct Request *r, const char *text, size_t len);
/* r's id as the log line writes it: an integer, a logfmt-quoted string, or "-" without one. */
void reply_id_text(const struct Request *r, char *out, size_t cap);

/* ---- workers.c ---- */

/* Reads every message waiting on the worker socket (READY, RESULT, DELTA, DISCONNECT). */
void workers_receive(struct Broker *b);
/* Hands waiting queries to workers with room (up to their max_running), the least loaded
 * first, then the least recently idle. */
void workers_dispatch(struct Broker *b);
/* r (running) no longer belongs to its worker: the broker gave up on it. */
void workers_detach(struct Broker *b, struct Request *r);
/* Passes a cancel (WIRE_REASON_*) on to the worker running r, if any. */
void workers_cancel(struct Broker *b, struct Request *r, uint8_t reason);
/* Sends heartbeats when due and removes workers that went silent. */
void workers_heartbeat(struct Broker *b, double now);
/* Sum of the usable workers' KV cache bytes. */
uint64_t workers_kv_bytes(const struct Broker *b);

/* ---- lifecycle.c ---- */

void lifecycle_update_gauges(struct Broker *b);
/* sd_notify STATUS= once a second, or now when force. */
void lifecycle_notify_status(struct Broker *b, double now, int force);
/* SIGHUP: the configuration and the key files, re-read. */
void lifecycle_reload(struct Broker *b);
void lifecycle_start_drain(struct Broker *b, double now);
/* The drain time is up: queued requests are refused, running ones cancelled. */
void lifecycle_force_drain(struct Broker *b, double now);
/* The hard deadline after that: running requests are answered shutting_down. */
void lifecycle_give_up_running(struct Broker *b);

#endif
