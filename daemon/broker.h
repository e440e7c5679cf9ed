/* The broker: diffragd's event loop. It owns the client ROUTER socket, the worker ROUTER
 * (inproc:// for worker threads, optionally tcp:// for remote workers) and the ROUTER of the
 * I/O threads; it admits requests into a bounded queue, hands retrieval and store work to
 * idle I/O threads and generation to idle workers (least recently used first), relays
 * streamed deltas, enforces deadlines and cancels, exchanges heartbeats, and drains on
 * SIGTERM. Everything it does in the loop is non-blocking. */
#ifndef DIFFRAG_BROKER_H
#define DIFFRAG_BROKER_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "daemon/grounding.h"
#include "daemon/metrics.h"

#define BROKER_WORKERS_INPROC "inproc://diffrag-workers"
#define BROKER_PREP_INPROC "inproc://diffrag-prep"
#define BROKER_HTTP_INPROC "inproc://diffrag-http"   /* the HTTP API's requests (openai.c) */
#define BROKER_CLIENT_RCVHWM 64   /* messages libzmq queues per client connection */

struct BrokerOpts {
    struct Config *cfg;              /* live configuration; SIGHUP reloads it in place */
    int argc;                        /* the command line, re-read on SIGHUP */
    char **argv;
    void *zctx;
    struct Metrics *metrics;
    /* the served model (startup.h's ServedModel), as ping answers it; a worker's READY names
     * its own (logged, not compared): the broker refuses only a worker whose vocabulary
     * differs, as the prompts' token ids would mean other words */
    const char *model_name;
    const char *model_architecture;
    const char *model_quantization;
    int64_t vocab;
    int inproc_workers;              /* READY=1 once this many workers registered */
    int io_threads;                  /* I/O threads that will connect to BROKER_PREP_INPROC */
    const char *version;
    volatile sig_atomic_t *sig_term; /* set by signal handlers; the loop acts on them */
    volatile sig_atomic_t *sig_hup;
    /* groundedness (docs/groundedness.md) */
    const struct GrCalibration *calibration; /* NULL: signals only, no score or flag */
    double threshold;                        /* flagged: score >= threshold */
    const int32_t *watch;                    /* (n_watch, 2) layer, head pairs the workers
                                                watch; NULL: each worker's default set */
    size_t n_watch;
    const int32_t *hidden;                   /* (n_hidden) layers whose residual stream each
                                                answer reports (docs/groundedness.md) */
    size_t n_hidden;
    const char *curve_secret;        /* Z85 secret key: the client socket is a CURVE server;
                                      * NULL: plain. Read during broker_new only. */
    struct Zap *zap;                 /* the ZAP handler whose keys SIGHUP re-reads; NULL: none */
};

struct Broker;

/* Creates and binds the sockets (client endpoint, worker endpoints, I/O threads). Nothing
 * connects to them until the caller starts the threads. 0, or -1 with err. */
int broker_new(const struct BrokerOpts *o, struct Broker **out, char *err, size_t errlen);

/* Serves until SIGTERM (or SIGINT) and the drain that follows; then tells the I/O threads to
 * exit. Returns 0. */
int broker_run(struct Broker *b);
/* After the in-process workers have stopped: tells the remaining (remote) workers that this
 * broker leaves, so they reconnect to its successor at once. */
void broker_farewell(struct Broker *b);

void broker_destroy(struct Broker **b);

#endif
