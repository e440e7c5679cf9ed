/* Small ZeroMQ helpers shared by the broker and the workers: whole multi-frame messages in and
 * out, and a monotonic clock in milliseconds. */
#ifndef DIFFRAG_ZUTIL_H
#define DIFFRAG_ZUTIL_H

#include <stddef.h>
#include <stdint.h>

#include <zmq.h>

#define ZU_MAX_FRAMES 8

/* All frames of one message. Frames past ZU_MAX_FRAMES are read and dropped but counted in
 * n_total, so a caller can refuse a message with too many frames. */
struct ZuMsg {
    zmq_msg_t f[ZU_MAX_FRAMES];
    int n;        /* frames held in f */
    int n_total;  /* frames the message had */
};

/* Receives one whole message (flags: 0 or ZMQ_DONTWAIT). 0, or -1 with errno from zmq. */
int zu_recv(void *sock, struct ZuMsg *m, int flags);
void zu_close(struct ZuMsg *m);
static inline const void *zu_data(struct ZuMsg *m, int i) { return zmq_msg_data(&m->f[i]); }
static inline size_t zu_size(struct ZuMsg *m, int i) { return zmq_msg_size(&m->f[i]); }

/* Sends n frames as one message. 0, or -1 (errno from zmq; EHOSTUNREACH and EAGAIN mean the
 * peer is gone or slow, and the message was dropped). */
int zu_send(void *sock, const void *const *bufs, const size_t *lens, int n, int flags);
/* Shorthands for two frames [cmd][body] (body may be NULL: one frame) with an optional routing
 * id frame in front (id NULL: none); flags as for zu_send (ZMQ_DONTWAIT where a stalled peer
 * must not block the caller). */
int zu_send_cmd(void *sock, const void *id, size_t id_len, uint8_t cmd, const void *body,
                size_t body_len, int flags);
/* [cmd][u64 job LE | tail] */
int zu_send_job(void *sock, const void *id, size_t id_len, uint8_t cmd, uint64_t job,
                const void *tail, size_t tail_len, int flags);

double zu_now_ms(void);

#endif
