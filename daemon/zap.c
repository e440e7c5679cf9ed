/* CurveZMQ key files, the allowed-key set (sorted 32-byte keys, binary search) and the ZAP
 * handler thread: a REP socket on inproc://zeromq.zap.01 that answers libzmq's authentication
 * requests, plus a PULL socket that tells it to stop. Refusals are logged at most once a
 * second (a flood of bad handshakes must not flood the journal) and counted in /metrics. */
#include "daemon/zap.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zmq.h>

#include "daemon/log.h"
#include "daemon/zutil.h"

struct ZapKeys {
    unsigned char (*keys)[32];
    size_t n, cap;
};

/* The key on one line of a key file: 1 (key decoded into bin), 0 (blank or comment), -1. */
static int parse_line(const char *line, unsigned char bin[32], char z85[CURVE_KEY_Z85_LEN + 1])
{
    while (*line == ' ' || *line == '\t')
        line++;
    if (!*line || *line == '\n' || *line == '\r' || *line == '#')
        return 0;
    size_t n = strcspn(line, " \t\r\n");
    if (n != CURVE_KEY_Z85_LEN)
        return -1;
    memcpy(z85, line, n);
    z85[n] = 0;
    return zmq_z85_decode(bin, z85) ? 1 : -1;
}

static int file_mode_open(const char *path, FILE **f, int *group_readable, char *err, size_t errlen)
{
    struct stat st;
    *f = fopen(path, "r");
    if (!*f || fstat(fileno(*f), &st)) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        if (*f)
            fclose(*f);
        *f = NULL;
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", path);
        fclose(*f);
        *f = NULL;
        return -1;
    }
    if (group_readable)
        *group_readable = (st.st_mode & 077) != 0;
    return 0;
}

int curve_key_read(const char *path, char out[CURVE_KEY_Z85_LEN + 1], int *group_readable,
                   char *err, size_t errlen)
{
    FILE *f;
    if (file_mode_open(path, &f, group_readable, err, errlen))
        return -1;
    char line[1024];
    unsigned char bin[32];
    int lineno = 0, k = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if ((k = parse_line(line, bin, out)) != 0)
            break;
    }
    if (k < 0)
        snprintf(err, errlen, "%s:%d: not a CurveZMQ key (40 characters of Z85 text)", path, lineno);
    else if (k == 0)
        snprintf(err, errlen, "%s: no CurveZMQ key in it (40 characters of Z85 text)", path);
    fclose(f);
    memset(bin, 0, sizeof bin);
    memset(line, 0, sizeof line);   /* it held a secret */
    return k > 0 ? 0 : -1;
}

int curve_public_of(const char *secret_z85, char out[CURVE_KEY_Z85_LEN + 1])
{
    return zmq_curve_public(out, secret_z85) == 0 ? 0 : -1;
}

static int keys_add(struct ZapKeys *k, const unsigned char bin[32], char *err, size_t errlen)
{
    if (k->n == k->cap) {
        if (k->cap >= ZAP_MAX_KEYS) {
            snprintf(err, errlen, "more than %d allowed keys", ZAP_MAX_KEYS);
            return -1;
        }
        size_t cap = k->cap ? 2 * k->cap : 16;
        void *p = realloc(k->keys, cap * sizeof *k->keys);
        if (!p) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        k->keys = p;
        k->cap = cap;
    }
    memcpy(k->keys[k->n++], bin, 32);
    return 0;
}

static int load_file(struct ZapKeys *k, const char *path, char *err, size_t errlen)
{
    FILE *f;
    if (file_mode_open(path, &f, NULL, err, errlen))
        return -1;
    char line[1024], z85[CURVE_KEY_Z85_LEN + 1];
    unsigned char bin[32];
    int lineno = 0, rc = 0;
    while (rc == 0 && fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            snprintf(err, errlen, "%s:%d: line too long", path, lineno);
            rc = -1;
            break;
        }
        int p = parse_line(line, bin, z85);
        if (p < 0) {
            snprintf(err, errlen, "%s:%d: not a CurveZMQ public key (40 characters of Z85 text)",
                     path, lineno);
            rc = -1;
        } else if (p > 0) {
            char kerr[128];
            if (keys_add(k, bin, kerr, sizeof kerr)) {
                snprintf(err, errlen, "%s:%d: %s", path, lineno, kerr);
                rc = -1;
            }
        }
    }
    fclose(f);
    return rc;
}

static int load_dir(struct ZapKeys *k, const char *path, char *err, size_t errlen)
{
    DIR *d = opendir(path);
    if (!d) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 5 || strcmp(e->d_name + n - 4, ".pub") || e->d_name[0] == '.')
            continue;
        char file[4096], z85[CURVE_KEY_Z85_LEN + 1];
        unsigned char bin[32];
        if ((size_t)snprintf(file, sizeof file, "%s/%s", path, e->d_name) >= sizeof file)
            continue;
        if (curve_key_read(file, z85, NULL, err, errlen) || !zmq_z85_decode(bin, z85) ||
            keys_add(k, bin, err, errlen))
            rc = -1;
    }
    closedir(d);
    return rc;
}

static int cmp_key(const void *a, const void *b)
{
    return memcmp(a, b, 32);
}

int zap_keys_load(const char *path, struct ZapKeys **out, size_t *n_keys, char *err, size_t errlen)
{
    *out = NULL;
    struct ZapKeys *k = calloc(1, sizeof *k);
    struct stat st;
    if (!k) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (stat(path, &st)) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        goto err;
    }
    if ((S_ISDIR(st.st_mode) ? load_dir(k, path, err, errlen) : load_file(k, path, err, errlen)))
        goto err;
    if (k->n)
        qsort(k->keys, k->n, sizeof *k->keys, cmp_key);
    size_t w = 0;
    for (size_t i = 0; i < k->n; i++)
        if (w == 0 || memcmp(k->keys[w - 1], k->keys[i], 32))
            memmove(k->keys[w++], k->keys[i], 32);
    k->n = w;
    if (n_keys)
        *n_keys = k->n;
    *out = k;
    return 0;
err:
    zap_keys_destroy(&k);
    return -1;
}

void zap_keys_destroy(struct ZapKeys **kp)
{
    struct ZapKeys *k = kp ? *kp : NULL;
    if (!k)
        return;
    free(k->keys);
    free(k);
    *kp = NULL;
}

int zap_keys_allow(const struct ZapKeys *k, const unsigned char key[32])
{
    return k && k->n && bsearch(key, k->keys, k->n, sizeof *k->keys, cmp_key) != NULL;
}

/* ---- the handler ---- */

struct Zap {
    void *zctx, *rep, *ctl;
    char ctl_ep[64];
    pthread_t thread;
    int started;
    pthread_mutex_t mu;           /* guards the key sets, swapped by zap_set_keys */
    struct ZapKeys *keys;         /* clients; NULL: any client key */
    struct ZapKeys *worker_keys;  /* remote workers; NULL: none */
    struct Metrics *metrics;
    struct DlogLimit refusals;    /* their log lines: at most one a second */
};

static int frame_is(struct ZuMsg *m, int i, const char *s)
{
    return i < m->n && zu_size(m, i) == strlen(s) && !memcmp(zu_data(m, i), s, strlen(s));
}

static void answer(struct Zap *z, struct ZuMsg *m, int ok, const char *text, const char *user)
{
    /* version, request id (echoed), status code, status text, user id, metadata */
    const void *bufs[6] = { "1.0", zu_data(m, 1), ok ? "200" : "400", text, user, "" };
    size_t lens[6] = { 3, zu_size(m, 1), 3, strlen(text), strlen(user), 0 };
    zu_send(z->rep, bufs, lens, 6, 0);
}

static void handle(struct Zap *z, struct ZuMsg *m)
{
    /* frames: version, request id, domain, address, routing id, mechanism, credentials... */
    if (m->n_total < 6 || m->n < 6 || !frame_is(m, 0, "1.0")) {
        /* not a ZAP request we can answer in kind; REP still owes a reply */
        const void *bufs[1] = { "" };
        size_t lens[1] = { 0 };
        zu_send(z->rep, bufs, lens, 1, 0);
        return;
    }
    int ok = 0, worker = frame_is(m, 2, ZAP_DOMAIN_WORKERS);
    char user[CURVE_KEY_Z85_LEN + 1] = "";
    const char *why = worker ? "worker key not allowed" : "client key not allowed";
    if (frame_is(m, 5, "CURVE") && m->n >= 7 && zu_size(m, 6) == 32) {
        const unsigned char *key = zu_data(m, 6);
        zmq_z85_encode(user, key, 32);
        pthread_mutex_lock(&z->mu);
        if (worker)
            ok = zap_keys_allow(z->worker_keys, key);
        else
            ok = !z->keys || zap_keys_allow(z->keys, key);
        pthread_mutex_unlock(&z->mu);
    } else {
        why = "only CURVE is accepted";
    }
    answer(z, m, ok, ok ? "OK" : why, ok ? user : "");
    if (z->metrics)
        metrics_auth(z->metrics, ok);
    unsigned long suppressed;
    if (!ok && LL_WARN <= dlog_level && dlog_limit_pass(&z->refusals, &suppressed)) {
        char addr[80] = "";
        if (m->n > 3)
            dlog_quote(addr, sizeof addr, zu_data(m, 3), zu_size(m, 3));
        dlog_write(LL_WARN, "msg=\"%s refused by CurveZMQ authentication\" reason=\"%s\" "
                   "address=%s key=%s suppressed_since_last=%lu", worker ? "worker" : "client",
                   why, addr[0] ? addr : "-", user[0] ? user : "-", suppressed);
    }
}

static void *zap_main(void *arg)
{
    struct Zap *z = arg;
    for (;;) {
        zmq_pollitem_t items[2] = { { z->rep, 0, ZMQ_POLLIN, 0 }, { z->ctl, 0, ZMQ_POLLIN, 0 } };
        int n = zmq_poll(items, 2, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (items[1].revents & ZMQ_POLLIN)
            break;
        if (items[0].revents & ZMQ_POLLIN) {
            struct ZuMsg m;
            if (zu_recv(z->rep, &m, ZMQ_DONTWAIT) == 0) {
                handle(z, &m);
                zu_close(&m);
            }
        }
    }
    return NULL;
}

int zap_start(void *zctx, struct ZapKeys **clients, struct ZapKeys **workers, struct Metrics *m,
              struct Zap **out, char *err, size_t errlen)
{
    *out = NULL;
    struct Zap *z = calloc(1, sizeof *z);
    if (!z) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    pthread_mutex_init(&z->mu, NULL);
    z->zctx = zctx;
    z->metrics = m;
    z->keys = *clients;
    *clients = NULL;
    z->worker_keys = *workers;
    *workers = NULL;
    snprintf(z->ctl_ep, sizeof z->ctl_ep, "inproc://diffrag-zap-ctl-%p", (void *)z);
    z->rep = zmq_socket(zctx, ZMQ_REP);
    z->ctl = zmq_socket(zctx, ZMQ_PULL);
    int linger = 0;
    if (z->rep)
        zmq_setsockopt(z->rep, ZMQ_LINGER, &linger, sizeof linger);
    if (!z->rep || !z->ctl || zmq_bind(z->rep, ZAP_ENDPOINT) || zmq_bind(z->ctl, z->ctl_ep)) {
        snprintf(err, errlen, "cannot start the ZAP handler: %s", zmq_strerror(errno));
        goto err;
    }
    if (pthread_create(&z->thread, NULL, zap_main, z)) {
        snprintf(err, errlen, "cannot start the ZAP handler thread");
        goto err;
    }
    z->started = 1;
    *out = z;
    return 0;
err:
    zap_stop(&z);
    return -1;
}

void zap_set_keys(struct Zap *z, int workers, struct ZapKeys **keys)
{
    pthread_mutex_lock(&z->mu);
    struct ZapKeys **slot = workers ? &z->worker_keys : &z->keys;
    struct ZapKeys *old = *slot;
    *slot = *keys;
    *keys = NULL;
    pthread_mutex_unlock(&z->mu);
    zap_keys_destroy(&old);
}

void zap_stop(struct Zap **zp)
{
    struct Zap *z = zp ? *zp : NULL;
    if (!z)
        return;
    if (z->started) {
        void *push = zmq_socket(z->zctx, ZMQ_PUSH);
        if (push) {
            int linger = 1000;
            zmq_setsockopt(push, ZMQ_LINGER, &linger, sizeof linger);
            if (zmq_connect(push, z->ctl_ep) == 0)
                zmq_send(push, "x", 1, 0);
            zmq_close(push);
        }
        pthread_join(z->thread, NULL);
    }
    if (z->rep)
        zmq_close(z->rep);
    if (z->ctl)
        zmq_close(z->ctl);
    zap_keys_destroy(&z->keys);
    zap_keys_destroy(&z->worker_keys);
    pthread_mutex_destroy(&z->mu);
    free(z);
    *zp = NULL;
}
