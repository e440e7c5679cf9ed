/* The op table: one row per protocol op (docs/protocol.md), read by the decoder (proto.c), the
 * I/O threads (prep.c) and the broker. A row names the op, the function that decodes and
 * validates its fields, the stage that serves it, and what an I/O thread runs for it.
 * Adding an op: its enum Op value (proto.h), its row here, its decoder and its handler. */
#ifndef DIFFRAG_OPS_H
#define DIFFRAG_OPS_H

#include <stddef.h>

#include "daemon/proto.h"

struct ProtoDec;     /* proto.c: a request being decoded */
struct PrepShared;   /* prep.h */
struct Request;      /* request.h */

enum OpStage {
    OPS_LOOP,    /* answered by the broker's loop at once (ping, cancel, the daemon's stats) */
    OPS_READ,    /* an I/O thread reads the store; the reply follows */
    OPS_WRITE,   /* an I/O thread writes the store (writes take at most io_threads - 1 of them);
                  * the reply follows the durable commit */
    OPS_QUERY,   /* an I/O thread retrieves and assembles the prompt, then it waits for a worker */
};

struct OpDef {
    const char *name;                        /* the "op" value on the wire */
    int (*decode)(struct ProtoDec *d);       /* its fields: 0, or -1 with the error set */
    enum OpStage stage;
    int loop_without_collection;             /* no "collection": answered in the loop instead */
    /* What an I/O thread runs (NULL for OPS_LOOP): fills r->reply/r->reply_fields for a store
     * op, r->ctx for a query, or r->code and r->message. */
    void (*run)(const struct PrepShared *sh, struct Request *r);
};

/* The row of op; NULL for OP_NONE or a value out of range. */
const struct OpDef *ops_get(enum Op op);
/* The op named name[0..len); OP_NONE when there is none. */
enum Op ops_find(const char *name, size_t len);
/* The stage that serves a decoded request (a row's stage, or OPS_LOOP for a stats request
 * without a collection). OPS_LOOP for OP_NONE. */
enum OpStage ops_stage(const struct RequestParams *p);
/* Store writes (ingest, delete, drop) share the I/O threads with reads under a limit. */
static inline int ops_writes(const struct RequestParams *p) { return ops_stage(p) == OPS_WRITE; }

/* The per-op decoders (proto.c). */
int proto_decode_ping(struct ProtoDec *d);
int proto_decode_query(struct ProtoDec *d);
int proto_decode_ingest(struct ProtoDec *d);
int proto_decode_delete(struct ProtoDec *d);
int proto_decode_drop(struct ProtoDec *d);
int proto_decode_get(struct ProtoDec *d);
int proto_decode_list(struct ProtoDec *d);
int proto_decode_stats(struct ProtoDec *d);
int proto_decode_cancel(struct ProtoDec *d);

#endif
