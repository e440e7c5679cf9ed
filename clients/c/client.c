/* The client handle and its transport: a DEALER socket (optionally CurveZMQ) with a monitor
 * that explains failed connections, sends that wait for a connection, receives bounded by
 * timeouts and interruptible through an eventfd, and replies matched to requests by id. */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "clients/c/client_internal.h"

const char *diffrag_strerror(int status)
{
    switch (status) {
    case DIFFRAG_OK: return "ok";
    case DIFFRAG_EINVAL: return "invalid argument";
    case DIFFRAG_ENOMEM: return "out of memory";
    case DIFFRAG_ECONNECT: return "no connection to the daemon";
    case DIFFRAG_ETIMEOUT: return "no reply in time";
    case DIFFRAG_EPROTOCOL: return "malformed reply";
    case DIFFRAG_ESERVER: return "the daemon answered with an error";
    case DIFFRAG_EINTERRUPTED: return "interrupted";
    case DIFFRAG_EZMQ: return "ZeroMQ error";
    default: return "unknown status";
    }
}

const char *client_code(int status)
{
    switch (status) {
    case DIFFRAG_EINVAL: return "invalid";
    case DIFFRAG_ENOMEM: return "nomem";
    case DIFFRAG_ECONNECT: return "connect";
    case DIFFRAG_ETIMEOUT: return "timeout";
    case DIFFRAG_EPROTOCOL: return "protocol";
    case DIFFRAG_EINTERRUPTED: return "interrupted";
    case DIFFRAG_EZMQ: return "zmq";
    default: return "";
    }
}

int client_fail(DiffragClient *c, int status, const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    snprintf(c->code, sizeof c->code, "%s", code ? code : client_code(status));
    return status;
}

void client_clear(DiffragClient *c)
{
    c->err[0] = 0;
    c->code[0] = 0;
}

const char *diffrag_last_error(const DiffragClient *c)
{
    return c ? c->err : "no client";
}

const char *diffrag_last_error_code(const DiffragClient *c)
{
    return c ? c->code : "invalid";
}

void diffrag_options_init(DiffragOptions *o)
{
    memset(o, 0, sizeof *o);
    o->connect_timeout_ms = 5000;
    o->timeout_ms = 30000;
    o->query_timeout_ms = 600000;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int z85_key_ok(const char *k)
{
    uint8_t bin[32];
    return k && strlen(k) == DIFFRAG_KEY_Z85_LEN && zmq_z85_decode(bin, k) != NULL;
}

int diffrag_keygen(char public_key[41], char secret_key[41])
{
    if (!public_key || !secret_key)
        return DIFFRAG_EINVAL;
    return zmq_curve_keypair(public_key, secret_key) == 0 ? DIFFRAG_OK : DIFFRAG_EZMQ;
}

int diffrag_key_public(const char *secret_key, char public_key[41])
{
    if (!public_key || !z85_key_ok(secret_key))
        return DIFFRAG_EINVAL;
    return zmq_curve_public(public_key, secret_key) == 0 ? DIFFRAG_OK : DIFFRAG_EZMQ;
}

int diffrag_key_read(const char *path, char key[41], char *err, size_t errlen)
{
    char line[512];
    int found = 0;
    if (errlen)
        err[0] = 0;
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) {
        if (errlen)
            snprintf(err, errlen, "%s: %s", path ? path : "(null)", path ? strerror(errno) : "no path");
        return DIFFRAG_EINVAL;
    }
    while (!found && fgets(line, sizeof line, f)) {
        char *s = line, *e;
        while (*s == ' ' || *s == '\t')
            s++;
        if (*s == '#' || *s == '\n' || *s == '\r' || *s == 0)
            continue;
        e = s + strlen(s);
        while (e > s && (e[-1] == '\n' || e[-1] == '\r' || e[-1] == ' ' || e[-1] == '\t'))
            *--e = 0;
        if (!z85_key_ok(s))
            break;
        memcpy(key, s, DIFFRAG_KEY_Z85_LEN + 1);
        found = 1;
    }
    fclose(f);
    if (!found) {
        if (errlen)
            snprintf(err, errlen, "%s: no CurveZMQ key (40 characters of Z85 text) in it", path);
        return DIFFRAG_EINVAL;
    }
    return DIFFRAG_OK;
}

static int set_curve(DiffragClient *c, const DiffragOptions *o, char *err, size_t errlen)
{
    char pub[41], sec[41];
    if (!z85_key_ok(o->server_key)) {
        snprintf(err, errlen, "server_key is not a CurveZMQ key (40 characters of Z85 text)");
        return DIFFRAG_EINVAL;
    }
    if (o->secret_key) {
        if (!z85_key_ok(o->secret_key)) {
            snprintf(err, errlen, "secret_key is not a CurveZMQ key (40 characters of Z85 text)");
            return DIFFRAG_EINVAL;
        }
        memcpy(sec, o->secret_key, sizeof sec);
        if (o->public_key) {
            if (!z85_key_ok(o->public_key)) {
                snprintf(err, errlen, "public_key is not a CurveZMQ key (40 characters of Z85 text)");
                return DIFFRAG_EINVAL;
            }
            memcpy(pub, o->public_key, sizeof pub);
        } else if (zmq_curve_public(pub, sec)) {
            snprintf(err, errlen, "zmq_curve_public: %s", zmq_strerror(errno));
            return DIFFRAG_EZMQ;
        }
    } else if (o->public_key) {
        snprintf(err, errlen, "public_key without secret_key");
        return DIFFRAG_EINVAL;
    } else if (zmq_curve_keypair(pub, sec)) {
        snprintf(err, errlen, "CurveZMQ is not available in this libzmq: %s", zmq_strerror(errno));
        return DIFFRAG_EZMQ;
    }
    /* Z85 keys are passed with their NUL (41 bytes), as zmq_setsockopt expects for text */
    if (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, o->server_key, 41) ||
        zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, pub, 41) ||
        zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, sec, 41)) {
        snprintf(err, errlen, "CurveZMQ socket options: %s", zmq_strerror(errno));
        return DIFFRAG_EZMQ;
    }
    memset(sec, 0, sizeof sec);
    return DIFFRAG_OK;
}

#define ENDPOINT_FORMS "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"

/* Is ep of a form a client connects to: tcp://HOST:PORT (with a numeric port), ipc://PATH or
 * inproc://NAME? ZeroMQ's own refusal of "127.0.0.1:7400" says only "Invalid argument". */
static int endpoint_form_ok(const char *ep)
{
    const char *rest = strstr(ep, "://");
    if (!rest || !rest[3])
        return 0;
    size_t scheme = (size_t)(rest - ep);
    rest += 3;
    if (scheme == 3 && !strncmp(ep, "tcp", 3)) {
        const char *colon = strrchr(rest, ':');
        return colon && colon > rest && colon[1] &&
               strspn(colon + 1, "0123456789") == strlen(colon + 1);
    }
    return (scheme == 3 && !strncmp(ep, "ipc", 3)) || (scheme == 6 && !strncmp(ep, "inproc", 6));
}

/* The host of a tcp:// endpoint ("tcp://[SOURCE;]HOST:PORT", HOST maybe in brackets) in buf;
 * 0 when the endpoint has no host to resolve. */
static int endpoint_host(const char *ep, char *buf, size_t len)
{
    if (strncmp(ep, "tcp://", 6))
        return 0;
    const char *h = ep + 6, *semi = strchr(h, ';');
    if (semi)
        h = semi + 1;
    const char *colon = strrchr(h, ':');
    if (!colon)
        return 0;
    size_t n = (size_t)(colon - h);
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
        h++;
        n -= 2;
    }
    if (n == 0 || n >= len || (n == 1 && h[0] == '*'))
        return 0;
    memcpy(buf, h, n);
    buf[n] = 0;
    return 1;
}

/* Before the first connection: a host name that does not resolve fails the call at once
 * (ZeroMQ would retry it until connect_timeout and say nothing). A temporary failure of the
 * resolver only becomes the note of a later ECONNECT. */
static int check_host(DiffragClient *c)
{
    char host[256];
    if (c->host_ok || !endpoint_host(c->endpoint, host, sizeof host)) {
        c->host_ok = 1;
        return DIFFRAG_OK;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int e = getaddrinfo(host, NULL, &hints, &res);
    if (res)
        freeaddrinfo(res);
    if (e == 0) {
        c->host_ok = 1;
        return DIFFRAG_OK;
    }
    if (e == EAI_NONAME || e == EAI_FAIL
#ifdef EAI_NODATA
        || e == EAI_NODATA
#endif
#ifdef EAI_ADDRFAMILY
        || e == EAI_ADDRFAMILY
#endif
    )
        return client_fail(c, DIFFRAG_ECONNECT, NULL, "no connection to %s: the host \"%s\" "
                           "does not resolve (%s)", c->endpoint, host, gai_strerror(e));
    snprintf(c->conn_note, sizeof c->conn_note, "the host \"%.64s\" does not resolve now (%s)",
             host, gai_strerror(e));
    return DIFFRAG_OK;
}

int diffrag_new(DiffragClient **out, const char *endpoint, const DiffragOptions *opt,
                char *err, size_t errlen)
{
    char scratch[8];
    DiffragOptions defaults;
    int rc = DIFFRAG_ENOMEM;
    if (!errlen) {
        err = scratch;
        errlen = sizeof scratch;
    }
    err[0] = 0;
    if (!out) {
        snprintf(err, errlen, "out is NULL");
        return DIFFRAG_EINVAL;
    }
    *out = NULL;
    if (!endpoint || !*endpoint) {
        snprintf(err, errlen, "no endpoint");
        return DIFFRAG_EINVAL;
    }
    if (!endpoint_form_ok(endpoint)) {
        snprintf(err, errlen, "endpoint '%s': " ENDPOINT_FORMS, endpoint);
        return DIFFRAG_EINVAL;
    }
    if (!opt) {
        diffrag_options_init(&defaults);
        opt = &defaults;
    }
    if (opt->connect_timeout_ms < 0 || opt->timeout_ms < 0 || opt->query_timeout_ms < 0) {
        snprintf(err, errlen, "timeouts must be positive (milliseconds), or 0 for the default");
        return DIFFRAG_EINVAL;
    }
    DiffragClient *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return DIFFRAG_ENOMEM;
    }
    c->wake_fd = -1;
    diffrag_options_init(&defaults);
    c->connect_timeout_ms = opt->connect_timeout_ms ? opt->connect_timeout_ms
                                                    : defaults.connect_timeout_ms;
    c->timeout_ms = opt->timeout_ms ? opt->timeout_ms : defaults.timeout_ms;
    c->query_timeout_ms = opt->query_timeout_ms ? opt->query_timeout_ms : defaults.query_timeout_ms;
    atomic_init(&c->interrupts, 0);
    c->endpoint = strdup(endpoint);
    if (!c->endpoint) {
        snprintf(err, errlen, "out of memory");
        goto err;
    }
    c->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->wake_fd < 0) {
        snprintf(err, errlen, "eventfd: %s", strerror(errno));
        rc = DIFFRAG_EZMQ;
        goto err;
    }
    rc = DIFFRAG_EZMQ;
    if (opt->zmq_context) {
        c->ctx = opt->zmq_context;
    } else {
        c->ctx = zmq_ctx_new();
        c->own_ctx = 1;
        if (!c->ctx) {
            snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(errno));
            goto err;
        }
    }
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    if (!c->sock) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(errno));
        goto err;
    }
    int zero = 0, one = 1;
    /* IMMEDIATE: queue nothing until a connection is up, so that a send waiting for one can
     * tell "nothing listens" from "the daemon is slow" */
    if (zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(c->sock, ZMQ_IMMEDIATE, &one, sizeof one)) {
        snprintf(err, errlen, "zmq_setsockopt: %s", zmq_strerror(errno));
        goto err;
    }
    if (opt->server_key) {
        rc = set_curve(c, opt, err, errlen);
        if (rc)
            goto err;
    } else if (opt->public_key || opt->secret_key) {
        snprintf(err, errlen, "a client key pair needs the server's public key (server_key)");
        rc = DIFFRAG_EINVAL;
        goto err;
    }
    rc = DIFFRAG_EZMQ;
    char mon[64];
    snprintf(mon, sizeof mon, "inproc://diffrag-monitor-%p", (void *)c);
    if (zmq_socket_monitor(c->sock, mon, ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_CONNECTED |
                           ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                           ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                           ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_SUCCEEDED)) {
        snprintf(err, errlen, "zmq_socket_monitor: %s", zmq_strerror(errno));
        goto err;
    }
    c->monitor = zmq_socket(c->ctx, ZMQ_PAIR);
    if (!c->monitor || zmq_setsockopt(c->monitor, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_connect(c->monitor, mon)) {
        snprintf(err, errlen, "monitor socket: %s", zmq_strerror(errno));
        goto err;
    }
    if (zmq_connect(c->sock, endpoint)) {
        int e = errno;
        rc = e == EINVAL || e == EPROTONOSUPPORT ? DIFFRAG_EINVAL : DIFFRAG_EZMQ;
        snprintf(err, errlen, "cannot connect to \"%s\": %s%s", endpoint, zmq_strerror(e),
                 rc == DIFFRAG_EINVAL ? " (" ENDPOINT_FORMS ")" : "");
        goto err;
    }
    *out = c;
    return DIFFRAG_OK;
err:
    diffrag_destroy(&c);
    return rc;
}

void diffrag_destroy(DiffragClient **pc)
{
    DiffragClient *c = pc ? *pc : NULL;
    if (!c)
        return;
    if (c->sock) {
        zmq_socket_monitor(c->sock, NULL, 0);
        zmq_close(c->sock);
    }
    if (c->monitor)
        zmq_close(c->monitor);
    if (c->own_ctx && c->ctx)
        zmq_ctx_term(c->ctx);
    if (c->wake_fd >= 0)
        close(c->wake_fd);
    while (c->mail_head) {
        struct Reply *r = c->mail_head;
        c->mail_head = r->next;
        reply_free(&r);
    }
    for (size_t i = 0; i < c->n_inflight; i++)
        free(c->inflight[i]);
    free(c->inflight);
    free(c->endpoint);
    free(c);
    *pc = NULL;
}

void diffrag_interrupt(DiffragClient *c)
{
    if (!c)
        return;
    atomic_fetch_add(&c->interrupts, 1);
    uint64_t one = 1;
    ssize_t w = write(c->wake_fd, &one, sizeof one);
    (void)w; /* a full counter already wakes the reader */
}

void client_begin(DiffragClient *c)
{
    uint64_t v;
    client_clear(c);
    while (read(c->wake_fd, &v, sizeof v) > 0)
        ;
    atomic_store(&c->interrupts, 0);
}

void client_next_id(DiffragClient *c, char *buf, size_t len)
{
    snprintf(buf, len, "#%llu", (unsigned long long)++c->seq);
}

int client_register(DiffragClient *c, const char *id)
{
    if (c->n_inflight == c->cap_inflight) {
        size_t cap = c->cap_inflight ? 2 * c->cap_inflight : 4;
        char **p = realloc(c->inflight, cap * sizeof *p);
        if (!p)
            return client_fail(c, DIFFRAG_ENOMEM, NULL, "out of memory");
        c->inflight = p;
        c->cap_inflight = cap;
    }
    c->inflight[c->n_inflight] = strdup(id);
    if (!c->inflight[c->n_inflight])
        return client_fail(c, DIFFRAG_ENOMEM, NULL, "out of memory");
    c->n_inflight++;
    return DIFFRAG_OK;
}

void client_unregister(DiffragClient *c, const char *id)
{
    for (size_t i = 0; i < c->n_inflight; i++) {
        if (strcmp(c->inflight[i], id) == 0) {
            free(c->inflight[i]);
            c->inflight[i] = c->inflight[--c->n_inflight];
            break;
        }
    }
    /* whatever is still queued for it is no longer wanted */
    struct Reply **pp = &c->mail_head, *last = NULL;
    while (*pp) {
        struct Reply *r = *pp;
        if (reply_id_is(r, id)) {
            *pp = r->next;
            reply_free(&r);
        } else {
            last = r;
            pp = &r->next;
        }
    }
    c->mail_tail = last;
}

static int is_registered(DiffragClient *c, const struct Reply *r)
{
    for (size_t i = 0; i < c->n_inflight; i++)
        if (reply_id_is(r, c->inflight[i]))
            return 1;
    return 0;
}

/* Reads the monitor's events and remembers what the latest connection attempt came to. */
static void drain_monitor(DiffragClient *c)
{
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        uint16_t event = 0;
        uint32_t value = 0;
        if (zmq_msg_size(&m) >= 6) {
            memcpy(&event, zmq_msg_data(&m), 2);
            memcpy(&value, (char *)zmq_msg_data(&m) + 2, 4);
        }
        while (zmq_msg_more(&m)) { /* the second frame holds the address */
            zmq_msg_close(&m);
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, c->monitor, ZMQ_DONTWAIT) < 0)
                break;
        }
        zmq_msg_close(&m);
        switch (event) {
        case ZMQ_EVENT_CONNECT_RETRIED:
            if (!c->conn_note[0] || !strncmp(c->conn_note, "connection refused", 18))
                snprintf(c->conn_note, sizeof c->conn_note,
                         "connection refused: is diffragd running and listening there?");
            break;
        case ZMQ_EVENT_CONNECTED:
            snprintf(c->conn_note, sizeof c->conn_note,
                     "the TCP connection was made but the ZeroMQ handshake did not complete");
            break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
            snprintf(c->conn_note, sizeof c->conn_note, "the daemon refused this client's "
                     "CurveZMQ key (ZAP status %u): is its public key allowed there?", value);
            break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
                snprintf(c->conn_note, sizeof c->conn_note, "security mechanism mismatch: the "
                         "daemon and this client disagree on CurveZMQ (give or drop the "
                         "server key)");
            else
                snprintf(c->conn_note, sizeof c->conn_note, "the handshake failed (ZMTP "
                         "protocol error 0x%x): a wrong server key?", value);
            break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            /* A plain client against a CURVE daemon sees this instead of a mechanism
             * mismatch when the daemon closes the connection first. */
            if (!c->conn_note[0] || strncmp(c->conn_note, "security mechanism", 18))
                snprintf(c->conn_note, sizeof c->conn_note, "the handshake failed: %s (does "
                         "the daemon require CurveZMQ, or this client's server key not match "
                         "it?)", zmq_strerror((int)value));
            break;
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
            c->conn_note[0] = 0;
            break;
        default:
            break;
        }
    }
}

static int took_interrupt(DiffragClient *c)
{
    uint64_t v;
    return read(c->wake_fd, &v, sizeof v) > 0;
}

int client_send(DiffragClient *c, const void *buf, size_t len)
{
    int rc = check_host(c);
    if (rc)
        return rc;
    double deadline = now_ms() + c->connect_timeout_ms;
    for (;;) {
        drain_monitor(c);
        zmq_pollitem_t items[3] = {
            { c->sock, 0, ZMQ_POLLOUT, 0 },
            { c->monitor, 0, ZMQ_POLLIN, 0 },
            { NULL, c->wake_fd, ZMQ_POLLIN, 0 },
        };
        double left = deadline - now_ms();
        if (left <= 0)
            return client_fail(c, DIFFRAG_ECONNECT, NULL, "no connection to %s within %d ms%s%s",
                               c->endpoint, c->connect_timeout_ms, c->conn_note[0] ? ": " : "",
                               c->conn_note);
        int n = zmq_poll(items, 3, (long)left + 1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return client_fail(c, DIFFRAG_EZMQ, NULL, "zmq_poll: %s", zmq_strerror(errno));
        }
        if ((items[2].revents & ZMQ_POLLIN) && took_interrupt(c))
            return client_fail(c, DIFFRAG_EINTERRUPTED, NULL, "interrupted before sending");
        if (items[0].revents & ZMQ_POLLOUT) {
            if (zmq_send(c->sock, buf, len, ZMQ_DONTWAIT) == (int)len)
                return DIFFRAG_OK;
            if (errno != EAGAIN && errno != EINTR)
                return client_fail(c, DIFFRAG_EZMQ, NULL, "zmq_send: %s", zmq_strerror(errno));
        }
    }
}

/* Reads one whole message (all its frames) from the socket: 0 with *out, or a status. */
static int read_message(DiffragClient *c, struct Reply **out)
{
    zmq_msg_t m;
    char *data = NULL;
    size_t len = 0;
    int frames = 0;
    *out = NULL;
    for (;;) {
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) < 0) {
            int e = errno;
            zmq_msg_close(&m);
            free(data);
            if (e == EAGAIN && frames == 0)
                return 1; /* nothing after all */
            return client_fail(c, DIFFRAG_EZMQ, NULL, "zmq_msg_recv: %s", zmq_strerror(e));
        }
        if (frames++ == 0) {
            len = zmq_msg_size(&m);
            data = malloc(len ? len : 1);
            if (!data) {
                /* the rest of the frames must still be read off the socket */
                int more = zmq_msg_more(&m);
                zmq_msg_close(&m);
                while (more) {
                    zmq_msg_init(&m);
                    more = zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&m);
                    zmq_msg_close(&m);
                }
                return client_fail(c, DIFFRAG_ENOMEM, NULL, "out of memory for a %zu-byte reply", len);
            }
            memcpy(data, zmq_msg_data(&m), len);
        }
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        if (!more)
            break;
    }
    if (frames != 1) {
        free(data);
        return client_fail(c, DIFFRAG_EPROTOCOL, NULL,
                           "malformed reply from %s: %d frames (the protocol sends one)",
                           c->endpoint, frames);
    }
    char why[200];
    int rc = reply_parse(data, len, out, why, sizeof why);
    if (rc == -2)
        return client_fail(c, DIFFRAG_ENOMEM, NULL, "out of memory");
    if (rc)
        return client_fail(c, DIFFRAG_EPROTOCOL, NULL, "malformed reply from %s: %s",
                           c->endpoint, why);
    return DIFFRAG_OK;
}

int client_recv(DiffragClient *c, const char *id, int timeout_ms, struct Reply **out)
{
    *out = NULL;
    /* something that came while another call was reading */
    for (struct Reply **pp = &c->mail_head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
        if (reply_id_is(*pp, id)) {
            struct Reply *r = *pp;
            *pp = r->next;
            if (c->mail_tail == r)
                c->mail_tail = prev;
            r->next = NULL;
            *out = r;
            return DIFFRAG_OK;
        }
    }
    double deadline = now_ms() + timeout_ms;
    for (;;) {
        zmq_pollitem_t items[2] = {
            { c->sock, 0, ZMQ_POLLIN, 0 },
            { NULL, c->wake_fd, ZMQ_POLLIN, 0 },
        };
        double left = deadline - now_ms();
        if (left <= 0)
            return client_fail(c, DIFFRAG_ETIMEOUT, NULL, "no reply from %s within %d ms",
                               c->endpoint, timeout_ms);
        int n = zmq_poll(items, 2, (long)left + 1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return client_fail(c, DIFFRAG_EZMQ, NULL, "zmq_poll: %s", zmq_strerror(errno));
        }
        if ((items[1].revents & ZMQ_POLLIN) && took_interrupt(c))
            return client_fail(c, DIFFRAG_EINTERRUPTED, NULL, "interrupted");
        if (!(items[0].revents & ZMQ_POLLIN))
            continue;
        struct Reply *r;
        int rc = read_message(c, &r);
        if (rc == 1)
            continue;
        if (rc)
            return rc;
        /* A nil id answers a request the daemon could not read far enough to find its id;
         * only the calls of this handle send on its socket, so it is this call's. */
        if (reply_id_is(r, id) || (!r->id && r->final)) {
            *out = r;
            return DIFFRAG_OK;
        }
        if (is_registered(c, r)) {
            if (c->mail_tail)
                c->mail_tail->next = r;
            else
                c->mail_head = r;
            c->mail_tail = r;
        } else {
            reply_free(&r); /* late: its call timed out or was abandoned */
        }
    }
}

int client_server_error(DiffragClient *c, const struct Reply *r)
{
    struct Dec d = { .ctx = "error" };
    const msgpack_object *e = dec_type(&d, r->map, "error", MSGPACK_OBJECT_MAP, 1);
    const msgpack_object *code = e ? mpo_get(e, "code") : NULL;
    const msgpack_object *msg = e ? mpo_get(e, "message") : NULL;
    if (d.failed || !code || code->type != MSGPACK_OBJECT_STR ||
        (msg && msg->type != MSGPACK_OBJECT_STR))
        return client_fail(c, DIFFRAG_EPROTOCOL, NULL, "malformed reply from %s: an error "
                           "reply needs \"error\": {\"code\": str, \"message\": str}", c->endpoint);
    char cbuf[32];
    size_t cl = code->via.str.size < sizeof cbuf - 1 ? code->via.str.size : sizeof cbuf - 1;
    memcpy(cbuf, code->via.str.ptr, cl);
    cbuf[cl] = 0;
    for (size_t i = 0; i < cl; i++) /* codes are identifiers; keep people's terminals safe */
        if (cbuf[i] < 0x20 || cbuf[i] == 0x7f)
            cbuf[i] = '?';
    return client_fail(c, DIFFRAG_ESERVER, cbuf, "%s: %.*s", cbuf,
                       msg ? (int)(msg->via.str.size > 900 ? 900 : msg->via.str.size) : 0,
                       msg ? msg->via.str.ptr : "");
}

int client_call(DiffragClient *c, const char *id, const msgpack_sbuffer *msg, int timeout_ms,
                struct Reply **out)
{
    *out = NULL;
    int rc = client_register(c, id);
    if (rc)
        return rc;
    rc = client_send(c, msg->data, msg->size);
    struct Reply *r = NULL;
    if (rc == DIFFRAG_OK)
        rc = client_recv(c, id, timeout_ms, &r);
    client_unregister(c, id);
    if (rc)
        return rc;
    if (!r->final) {
        reply_free(&r);
        return client_fail(c, DIFFRAG_EPROTOCOL, NULL, "malformed reply from %s: a delta "
                           "answered a request that does not stream", c->endpoint);
    }
    if (!r->ok) {
        rc = client_server_error(c, r);
        reply_free(&r);
        return rc;
    }
    *out = r;
    return DIFFRAG_OK;
}
