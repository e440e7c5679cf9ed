/* HTTP plumbing shared by the metrics endpoint and the OpenAI-compatible API: binding, and the
 * connection guard against slow clients and clients that read nothing (http.h). */
#include "daemon/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "daemon/log.h"

#define HTTP_SWEEP_MS 200   /* how often deadlines are checked */
/* Each connection's kernel send buffer (the kernel doubles it): what a client that reads nothing
 * can hold in the kernel, instead of the megabytes autotuning grants a loopback connection, and
 * how soon such a client is found out. A stream or a whole answer is far smaller per write. */
#define HTTP_SNDBUF (64 * 1024)

struct HttpConn {
    int used, closing;          /* closing: shut down here, MHD has not reported it closed */
    int busy;                   /* its request is being answered */
    int refused;                /* came while every slot was busy: answered 503 */
    int fd;
    int family;                 /* AF_INET or AF_INET6 */
    unsigned char ip[16];       /* client address (4 or 16 bytes used) */
    double since;               /* accept, or end of the last request on this connection */
    double stalled_since;       /* busy: since when its answer waits unread; 0: it does not */
    uint64_t acked;             /* bytes of it the client had acknowledged then */
};

struct HttpGuard {
    pthread_mutex_t mu;         /* conns, stop */
    pthread_cond_t wake;
    pthread_t sweeper;
    int stop;
    int max_open, max_per_ip, max_busy, n_slots;
    double deadline_s;
    struct HttpConn *conns;
    struct DlogLimit cut_log;   /* lines for connections cut for reading nothing */
};

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int http_bind(const char *key, const char *hostport, int *fd_out, unsigned *mhd_flags, char *err,
              size_t errlen)
{
    char host[256];
    const char *colon = strrchr(hostport, ':');
    *fd_out = -1;
    if (!colon || (size_t)(colon - hostport) >= sizeof host) {
        snprintf(err, errlen, "%s: \"%s\" is not HOST:PORT", key, hostport);
        return -1;
    }
    memcpy(host, hostport, (size_t)(colon - hostport));
    host[colon - hostport] = 0;
    if (host[0] == '[' && host[strlen(host) - 1] == ']') {
        memmove(host, host + 1, strlen(host));
        host[strlen(host) - 1] = 0;
    }
    if (!strcmp(host, "localhost"))
        strcpy(host, "127.0.0.1");
    int port = atoi(colon + 1);
    struct sockaddr_in a4;
    struct sockaddr_in6 a6;
    const struct sockaddr *sa;
    memset(&a4, 0, sizeof a4);
    memset(&a6, 0, sizeof a6);
    if (inet_pton(AF_INET, host, &a4.sin_addr) == 1) {
        a4.sin_family = AF_INET;
        a4.sin_port = htons((uint16_t)port);
        sa = (const struct sockaddr *)&a4;
    } else if (inet_pton(AF_INET6, host, &a6.sin6_addr) == 1) {
        a6.sin6_family = AF_INET6;
        a6.sin6_port = htons((uint16_t)port);
        sa = (const struct sockaddr *)&a6;
        *mhd_flags |= MHD_USE_IPv6;
    } else {
        snprintf(err, errlen, "%s: \"%s\" is not an IP address", key, host);
        return -1;
    }
    /* Bound here rather than by libmicrohttpd, so a failure names its cause (EADDRINUSE,
     * EADDRNOTAVAIL, EACCES) instead of a guess. */
    socklen_t salen = sa->sa_family == AF_INET ? sizeof a4 : sizeof a6;
    int fd = socket(sa->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", hostport, strerror(errno));
        return -1;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (sa->sa_family == AF_INET6)
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    if (bind(fd, sa, salen) || listen(fd, HTTP_LISTEN_BACKLOG)) {
        snprintf(err, errlen, "%s: %s", hostport, strerror(errno));
        close(fd);
        return -1;
    }
    *fd_out = fd;
    return 0;
}

/* Ends a connection from any thread: MHD sees the socket hang up and closes it. Called under
 * mu, on a slot MHD has not reported closed; MHD reports a connection closed (http_guard_notify,
 * which takes mu) before it closes the descriptor, so fd is still this connection's socket and
 * not a reused number. */
static void conn_drop(struct HttpConn *k)
{
    shutdown(k->fd, SHUT_RDWR);
    k->closing = 1;
}

static int same_ip(const struct HttpConn *a, const struct HttpConn *b)
{
    return a->family == b->family
        && !memcmp(a->ip, b->ip, a->family == AF_INET ? 4 : 16);
}

/* Makes room for k (registered, not yet counted) under the per-address and total limits by
 * dropping the longest-held other connection that is not busy, of the same address first. When
 * every other connection is busy (only possible with no reserved slots), k is marked refused:
 * the handler answers it 503 rather than it being closed unanswered. Refused connections count
 * toward no limit; libmicrohttpd's own (http_guard_slots) bounds them. */
static void conns_admit(struct HttpGuard *g, struct HttpConn *k)
{
    for (;;) {
        int total = 0, per_ip = 0;
        struct HttpConn *oldest_ip = NULL, *oldest = NULL;
        for (int i = 0; i < g->n_slots; i++) {
            struct HttpConn *o = &g->conns[i];
            if (!o->used || o->closing || o->refused || o == k)
                continue;
            total++;
            if (!o->busy && (!oldest || o->since < oldest->since))
                oldest = o;
            if (same_ip(o, k)) {
                per_ip++;
                if (!o->busy && (!oldest_ip || o->since < oldest_ip->since))
                    oldest_ip = o;
            }
        }
        struct HttpConn *drop = NULL;
        if (per_ip >= g->max_per_ip)
            drop = oldest_ip;
        else if (total >= g->max_open)
            drop = oldest;
        else
            return;
        if (!drop) {
            k->refused = 1;
            return;
        }
        conn_drop(drop);
    }
}

void http_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                       enum MHD_ConnectionNotificationCode toe)
{
    struct HttpGuard *g = cls;
    pthread_mutex_lock(&g->mu);
    if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        struct HttpConn *k = *socket_context;
        if (k)
            memset(k, 0, sizeof *k);
        *socket_context = NULL;
        pthread_mutex_unlock(&g->mu);
        return;
    }
    const union MHD_ConnectionInfo *fi = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    const union MHD_ConnectionInfo *ai = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    struct HttpConn *k = NULL;
    for (int i = 0; i < g->n_slots && !k; i++)
        if (!g->conns[i].used)
            k = &g->conns[i];
    if (!fi) {
        pthread_mutex_unlock(&g->mu);
        return;
    }
    if (!k) {   /* cannot happen while MHD's own limit is http_guard_slots; refuse */
        shutdown(fi->connect_fd, SHUT_RDWR);
        pthread_mutex_unlock(&g->mu);
        return;
    }
    memset(k, 0, sizeof *k);
    k->used = 1;
    k->fd = fi->connect_fd;
    k->since = now_s();
    int sndbuf = HTTP_SNDBUF;
    setsockopt(k->fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    const struct sockaddr *sa = ai ? ai->client_addr : NULL;
    if (sa && sa->sa_family == AF_INET) {
        k->family = AF_INET;
        memcpy(k->ip, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, 4);
    } else if (sa && sa->sa_family == AF_INET6) {
        k->family = AF_INET6;
        memcpy(k->ip, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, 16);
    }
    *socket_context = k;
    conns_admit(g, k);
    pthread_mutex_unlock(&g->mu);
}

static struct HttpConn *conn_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *si = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return si ? si->socket_context : NULL;
}

void http_guard_request_done(struct HttpGuard *g, struct MHD_Connection *c)
{
    pthread_mutex_lock(&g->mu);
    struct HttpConn *k = conn_of(c);
    if (k) {
        k->since = now_s();
        k->busy = 0;
    }
    pthread_mutex_unlock(&g->mu);
}

int http_guard_busy(struct HttpGuard *g, struct MHD_Connection *c)
{
    int rc = 0;
    pthread_mutex_lock(&g->mu);
    struct HttpConn *k = conn_of(c);
    if (k && !k->busy) {
        int busy = 0;
        for (int i = 0; i < g->n_slots; i++)
            busy += g->conns[i].used && !g->conns[i].closing && g->conns[i].busy;
        if (busy >= g->max_busy) {
            rc = -1;
        } else {
            k->busy = 1;
            k->stalled_since = 0;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return rc;
}

int http_guard_refused(struct HttpGuard *g, struct MHD_Connection *c)
{
    pthread_mutex_lock(&g->mu);
    struct HttpConn *k = conn_of(c);
    int refused = k && k->refused;
    pthread_mutex_unlock(&g->mu);
    return refused;
}

int http_guard_open(struct HttpGuard *g)
{
    int n = 0;
    pthread_mutex_lock(&g->mu);
    for (int i = 0; i < g->n_slots; i++)
        n += g->conns[i].used && !g->conns[i].closing;
    pthread_mutex_unlock(&g->mu);
    return n;
}

unsigned http_guard_slots(const struct HttpGuard *g)
{
    return (unsigned)g->n_slots;
}

/* Whether a busy connection's client has read nothing of its answer for the deadline: bytes
 * wait in its kernel send queue and the count it has acknowledged has not moved since
 * stalled_since. A client that reads, however slowly, moves it. Where the kernel gives no
 * acknowledged count (TCP_INFO before Linux 4.1), no connection is found stalled. */
static int conn_stalled(struct HttpConn *k, double now, double deadline_s)
{
    int queued = 0;
    struct tcp_info ti;
    socklen_t tl = sizeof ti;
    if (ioctl(k->fd, SIOCOUTQ, &queued) || queued <= 0 ||
        getsockopt(k->fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) ||
        tl < offsetof(struct tcp_info, tcpi_bytes_acked) + sizeof ti.tcpi_bytes_acked) {
        k->stalled_since = 0;
        return 0;
    }
    if (!k->stalled_since || ti.tcpi_bytes_acked != k->acked) {
        k->stalled_since = now;
        k->acked = ti.tcpi_bytes_acked;
        return 0;
    }
    return now - k->stalled_since >= deadline_s;
}

/* A few times a second: closes every connection past its deadline, and every busy one whose
 * client has read nothing for as long (its answer's end then comes as a hang-up: a stream's
 * query is cancelled). */
static void *sweep_main(void *arg)
{
    struct HttpGuard *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        t.tv_nsec += HTTP_SWEEP_MS * 1000000L;
        t.tv_sec += t.tv_nsec / 1000000000L;
        t.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&g->wake, &g->mu, &t);
        double now = now_s(), cut = now - g->deadline_s;
        for (int i = 0; i < g->n_slots; i++) {
            struct HttpConn *k = &g->conns[i];
            if (!k->used || k->closing)
                continue;
            if (!k->busy && k->since < cut) {
                conn_drop(k);
            } else if (k->busy && conn_stalled(k, now, g->deadline_s)) {
                conn_drop(k);
                unsigned long held;
                if (LL_INFO <= dlog_level && dlog_limit_pass(&g->cut_log, &held))
                    dlog_write(LL_INFO, "msg=\"http connection cut: its client read nothing of "
                               "its answer\" seconds=%g suppressed_since_last=%lu",
                               g->deadline_s, held);
            }
        }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

int http_guard_new(int max_open, int max_per_ip, int reserved, double deadline_s,
                   struct HttpGuard **out, char *err, size_t errlen)
{
    *out = NULL;
    if (max_open < 1 || reserved < 0 || reserved >= max_open) {
        snprintf(err, errlen, "%d reserved connections of %d: keep at least one for answers",
                 reserved, max_open);
        return -1;
    }
    struct HttpGuard *g = calloc(1, sizeof *g);
    if (g)
        g->conns = calloc((size_t)(2 * max_open), sizeof *g->conns);
    if (!g || !g->conns) {
        free(g);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    g->max_open = max_open;
    g->max_per_ip = max_per_ip;
    g->max_busy = max_open - reserved;
    g->n_slots = 2 * max_open;
    g->deadline_s = deadline_s;
    pthread_mutex_init(&g->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g->wake, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&g->sweeper, NULL, sweep_main, g)) {
        snprintf(err, errlen, "no thread for HTTP request deadlines");
        pthread_cond_destroy(&g->wake);
        pthread_mutex_destroy(&g->mu);
        free(g->conns);
        free(g);
        return -1;
    }
    *out = g;
    return 0;
}

void http_guard_destroy(struct HttpGuard **gp)
{
    struct HttpGuard *g = gp ? *gp : NULL;
    if (!g)
        return;
    pthread_mutex_lock(&g->mu);
    g->stop = 1;
    pthread_cond_signal(&g->wake);
    pthread_mutex_unlock(&g->mu);
    pthread_join(g->sweeper, NULL);
    pthread_cond_destroy(&g->wake);
    pthread_mutex_destroy(&g->mu);
    free(g->conns);
    free(g);
    *gp = NULL;
}
