/* The I/O threads: each takes a request from the broker, runs its op's I/O stage (the op
 * table's handler, stages.c) and hands it back. */
#include "daemon/prep.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/ops.h"
#include "daemon/zutil.h"

struct PrepPool {
    void *zctx;
    char endpoint[128];
    const struct PrepShared *sh;
    pthread_t *threads;
    int n;
};

void prep_run(const struct PrepShared *sh, struct Request *r)
{
    double t0 = zu_now_ms();
    r->code = EC_OK;
    r->message[0] = 0;
    const struct OpDef *op = ops_get(r->p.op);
    if (op && op->run) {
        op->run(sh, r);
    } else {
        r->code = EC_BAD_REQUEST;
        snprintf(r->message, sizeof r->message, "not an I/O operation");
    }
    if (r->code == EC_OK && r->reply.failed) {
        r->code = EC_INTERNAL;
        snprintf(r->message, sizeof r->message, "out of memory building the reply");
    }
    r->retrieve_ms = zu_now_ms() - t0;
}

static void *prep_main(void *arg)
{
    struct PrepPool *pool = arg;
    void *s = zmq_socket(pool->zctx, ZMQ_DEALER);
    if (!s || zmq_connect(s, pool->endpoint)) {
        dlog(LL_ERROR, "msg=\"I/O thread socket failed\" error=\"%s\"", zmq_strerror(errno));
        if (s)
            zmq_close(s);
        return NULL;
    }
    zmq_send(s, "R", 1, 0);
    for (;;) {
        struct Request *r;
        int n = zmq_recv(s, &r, sizeof r, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n != (int)sizeof r)
            break;    /* the empty frame: exit */
        prep_run(pool->sh, r);
        zmq_send(s, &r, sizeof r, 0);
    }
    zmq_close(s);
    return NULL;
}

int prep_start(void *zctx, const char *endpoint, int n, const struct PrepShared *sh,
               struct PrepPool **out, char *err, size_t errlen)
{
    struct PrepPool *p = calloc(1, sizeof *p);
    *out = NULL;
    if (!p || !(p->threads = calloc((size_t)n, sizeof *p->threads))) {
        free(p);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    p->zctx = zctx;
    p->sh = sh;
    snprintf(p->endpoint, sizeof p->endpoint, "%s", endpoint);
    for (int i = 0; i < n; i++) {
        if (pthread_create(&p->threads[i], NULL, prep_main, p)) {
            snprintf(err, errlen, "cannot start an I/O thread");
            p->n = i;
            *out = p;
            return -1;
        }
    }
    p->n = n;
    *out = p;
    return 0;
}

void prep_join(struct PrepPool **pp)
{
    struct PrepPool *p = pp ? *pp : NULL;
    if (!p)
        return;
    for (int i = 0; i < p->n; i++)
        pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p);
    *pp = NULL;
}
