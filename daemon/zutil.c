/* ZeroMQ message helpers: receive a whole multi-frame message, send frames, and the clock. */
#include "daemon/zutil.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/wire.h"

int zu_recv(void *sock, struct ZuMsg *m, int flags)
{
    m->n = 0;
    m->n_total = 0;
    for (;;) {
        zmq_msg_t tmp, *f = m->n < ZU_MAX_FRAMES ? &m->f[m->n] : &tmp;
        zmq_msg_init(f);
        /* Only the first frame may find nothing: the rest of a message arrives with it. */
        if (zmq_msg_recv(f, sock, m->n_total ? 0 : flags) < 0) {
            int e = errno;
            zmq_msg_close(f);
            zu_close(m);
            errno = e;
            return -1;
        }
        int more = zmq_msg_more(f);
        m->n_total++;
        if (f == &tmp)
            zmq_msg_close(f);
        else
            m->n++;
        if (!more)
            return 0;
    }
}

void zu_close(struct ZuMsg *m)
{
    for (int i = 0; i < m->n; i++)
        zmq_msg_close(&m->f[i]);
    m->n = 0;
}

int zu_send(void *sock, const void *const *bufs, const size_t *lens, int n, int flags)
{
    for (int i = 0; i < n; i++)
        if (zmq_send(sock, bufs[i], lens[i], flags | (i + 1 < n ? ZMQ_SNDMORE : 0)) < 0)
            return -1;
    return 0;
}

int zu_send_cmd(void *sock, const void *id, size_t id_len, uint8_t cmd, const void *body,
                size_t body_len, int flags)
{
    const void *bufs[3];
    size_t lens[3];
    int n = 0;
    if (id) { bufs[n] = id; lens[n++] = id_len; }
    bufs[n] = &cmd; lens[n++] = 1;
    if (body) { bufs[n] = body; lens[n++] = body_len; }
    return zu_send(sock, bufs, lens, n, flags);
}

int zu_send_job(void *sock, const void *id, size_t id_len, uint8_t cmd, uint64_t job,
                const void *tail, size_t tail_len, int flags)
{
    uint8_t small[256];
    uint8_t *b = tail_len + 8 <= sizeof small ? small : malloc(tail_len + 8);
    if (!b) {
        errno = ENOMEM;
        return -1;
    }
    wire_put_u64(b, job);
    if (tail_len)
        memcpy(b + 8, tail, tail_len);
    int rc = zu_send_cmd(sock, id, id_len, cmd, b, tail_len + 8, flags);
    if (b != small)
        free(b);
    return rc;
}

double zu_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}
