/* What the parts of libdiffrag share and users never see: the client handle, a received
 * reply, the transport calls of client.c and the reply checks and field readers of reply.c. */
#ifndef DIFFRAG_CLIENT_INTERNAL_H
#define DIFFRAG_CLIENT_INTERNAL_H

#include <msgpack.h>
#include <stdatomic.h>
#include <stdint.h>

#include "clients/c/diffrag.h"

/* Deepest nesting accepted in a reply: below msgpack-c's own fixed parser stack (32). */
#define REPLY_MAX_DEPTH 24
#define CLIENT_ID_MAX 256

/* One message from the daemon, checked to be exactly one msgpack map with an "id". */
struct Reply {
    char *data;               /* the raw message; the objects below point into it */
    size_t len;
    msgpack_unpacked up;
    const msgpack_object *map;
    const msgpack_object *id; /* NULL when the id is nil */
    int final;                /* has "ok" (else it is a delta) */
    int ok;
    struct Reply *next;       /* mailbox link */
};

struct DiffragClient {
    void *ctx;
    int own_ctx;
    void *sock;               /* DEALER */
    void *monitor;            /* PAIR receiving the DEALER's connection events */
    char *endpoint;
    int connect_timeout_ms, timeout_ms, query_timeout_ms;
    uint64_t seq;
    int wake_fd;              /* eventfd written by diffrag_interrupt */
    atomic_int interrupts;
    /* ids of requests whose replies are still wanted; messages for them wait in the mailbox
     * while another call reads the socket (a cancel sent from a delta callback) */
    char **inflight;
    size_t n_inflight, cap_inflight;
    struct Reply *mail_head, *mail_tail;
    /* what the monitor said about the latest connection attempt, for ECONNECT messages */
    char conn_note[160];
    int host_ok;              /* the endpoint's host resolved once (or it has none) */
    char err[1024];
    char code[32];
};

/* Errors: set the message and code of the last call and return status. */
int client_fail(DiffragClient *c, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void client_clear(DiffragClient *c);
/* The client's own code for a status ("timeout" ...). */
const char *client_code(int status);

/* A fresh request id ("#N") in buf (at least 24 bytes). */
void client_next_id(DiffragClient *c, char *buf, size_t len);
/* Replies to registered ids are kept while another call reads; others are dropped. */
int client_register(DiffragClient *c, const char *id);
void client_unregister(DiffragClient *c, const char *id);
/* Starts a call: forgets interrupts that came while no call ran. */
void client_begin(DiffragClient *c);

/* Sends one request frame once a connection is up (ECONNECT after connect_timeout_ms). */
int client_send(DiffragClient *c, const void *buf, size_t len);
/* The next message for request id within timeout_ms of silence: DIFFRAG_OK with *out (free it
 * with reply_free), or ETIMEOUT, EINTERRUPTED, EPROTOCOL (a malformed message; the reply
 * that should have come is then lost to this call), EZMQ, ENOMEM. */
int client_recv(DiffragClient *c, const char *id, int timeout_ms, struct Reply **out);
/* A whole request-reply exchange: sends msg under id and waits for the final reply. A server
 * error becomes DIFFRAG_ESERVER (the reply is freed); a delta is a protocol error. */
int client_call(DiffragClient *c, const char *id, const msgpack_sbuffer *msg, int timeout_ms,
                struct Reply **out);
/* Records a server error reply {"ok": false, "error": {...}} as the last error. */
int client_server_error(DiffragClient *c, const struct Reply *r);

/* ---- reply.c ---- */

/* Checks that p[0..n) is exactly one msgpack object nested at most max_depth deep, whose
 * containers do not claim more elements than bytes remain: 0, or -1 with a message. */
int reply_scan(const unsigned char *p, size_t n, int max_depth, char *err, size_t errlen);
/* Takes ownership of data (malloc'd, len bytes) and parses it: 0, -1 (malformed: message in
 * err; data is freed) or -2 (out of memory). */
int reply_parse(char *data, size_t len, struct Reply **out, char *err, size_t errlen);
void reply_free(struct Reply **r);
/* Does the reply's id equal the string id? */
int reply_id_is(const struct Reply *r, const char *id);

const msgpack_object *mpo_get(const msgpack_object *map, const char *key);

/* Field readers for decoding a reply: each records the first problem (naming the field) and
 * then does nothing, so a decoder reads every field and checks `failed` once. */
struct Dec {
    const char *ctx;   /* the object being read, for messages ("citations[2]") */
    int failed;        /* 0, DIFFRAG_EPROTOCOL or DIFFRAG_ENOMEM */
    char err[256];
};
char *dec_str(struct Dec *d, const msgpack_object *map, const char *key, int required,
              size_t *len);
/* A string or nil (NULL), for fields like "next". */
char *dec_str_or_nil(struct Dec *d, const msgpack_object *map, const char *key);
int64_t dec_int(struct Dec *d, const msgpack_object *map, const char *key, int required);
double dec_num(struct Dec *d, const msgpack_object *map, const char *key, int required);
int dec_bool(struct Dec *d, const msgpack_object *map, const char *key, int required);
const msgpack_object *dec_type(struct Dec *d, const msgpack_object *map, const char *key,
                               msgpack_object_type type, int required);
char *dec_json(struct Dec *d, const msgpack_object *o);
/* An integer object read directly (an array element); key names it in messages. */
int64_t dec_as_int(struct Dec *d, const msgpack_object *o, const char *key);
/* Records a problem with the field key (or out of memory). */
void dec_bad(struct Dec *d, const char *key, const char *what);
void dec_oom(struct Dec *d);
char *dec_strdup(struct Dec *d, const char *s, size_t len);

#endif
