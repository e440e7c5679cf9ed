/* The client protocol (docs/protocol.md is the contract): one msgpack map per request, decoded
 * and validated here before anything is queued, with limits checked against the counts a
 * message claims before anything is sized from them; and the error replies. */
#ifndef DIFFRAG_PROTO_H
#define DIFFRAG_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "daemon/mp.h"
#include "retriever/context.h"
#include "retriever/index.h"

#define PROTO_VERSION 1
#define PROTO_MAX_ID_BYTES 256
#define PROTO_MAX_STOP_BYTES 256
#define PROTO_MAX_STOP 64             /* config max_stop may not exceed it */
#define PROTO_MAX_LIST_LIMIT 1000
#define PROTO_MAX_DEADLINE_MS 86400000L
#define PROTO_MAX_INCLUDE 8               /* entries of a query's "include" */
#define PROTO_MAX_HISTORY 256             /* turns of a query's "history" */

/* The ops; daemon/ops.c holds each one's row (name, decoder, stage, handler). */
enum Op { OP_PING, OP_QUERY, OP_INGEST, OP_DELETE, OP_DROP, OP_GET, OP_LIST, OP_STATS, OP_CANCEL,
          OP_NONE, OP_COUNT };
const char *op_name(enum Op op);   /* "ping", ...; "none" for OP_NONE (daemon/ops.c) */

enum ErrCode { EC_OK, EC_BAD_REQUEST, EC_TOO_LARGE, EC_OVERLOADED, EC_NOT_FOUND,
               EC_DEADLINE_EXCEEDED, EC_CANCELLED, EC_SHUTTING_DOWN, EC_UNSUPPORTED_VERSION,
               EC_INTERNAL, EC_COUNT };
const char *ec_name(enum ErrCode c);   /* "ok", "bad_request", ... */

struct Slice { const char *p; size_t len; };

/* An ingest document given as a file: its bytes (msgpack bin) and its name, borrowed from the
 * message; the stage extracts its text (daemon/extract.h). bytes NULL: a text document. */
struct DocFile { const uint8_t *bytes; size_t len; struct Slice name; };

/* A decoded request. Every pointer borrows the message buffer given to proto_decode, except
 * the arrays docs, files, ids, auto_ids and history, which proto_params_free releases (the turns'
 * texts borrow the buffer too). */
struct RequestParams {
    enum Op op;
    const uint8_t *id_raw; size_t id_len;       /* the id value's msgpack bytes; NULL: none */
    struct Slice question;
    struct StoreDoc *docs; size_t n_docs;       /* query: inline; ingest: to store */
    char (*auto_ids)[16];                       /* ids given to inline docs without one */
    struct DocFile *files;                      /* ingest: per document; NULL: no document
                                                   of the batch carries bytes */
    struct Slice collection;                    /* len 0: none; drop: the one to remove */
    struct Slice *ids; size_t n_ids;            /* query filter, delete list */
    struct Slice doc_id;                        /* get */
    struct Slice after; long limit;             /* list */
    long top_k, max_context_tokens, max_tokens;
    double relevance_floor;                     /* query: share of the best chunk's score */
    int order;                                  /* query: enum CtxOrder (rank, document,
                                                   nearest) */
    int window;                                 /* query: 1 when it names no order and chunk
                                                   KV reuse is off (PlanRequest.window) */
    double temperature, top_p;
    uint64_t seed;
    struct Slice stop[PROTO_MAX_STOP];
    size_t n_stop;
    int stream;
    long deadline_ms;                           /* 0: none */
    int include_token_signals;                  /* query: "include": ["token_signals"] */
    int include_hidden_states;                  /* query: "include": ["hidden_states"] */
    struct Slice system;                        /* query: the client's system text; len 0:
                                                   none */
    struct CtxTurn *history; size_t n_history;  /* query: earlier turns, oldest first */
    int unsupported;                            /* query: enum ConfigUnsupported, the request's
                                                   or the configuration's */
    int answer_mode;                            /* query: enum ConfigAnswerMode, likewise */
    const uint8_t *target_raw; size_t target_len; /* cancel: the id of the request to stop */
};

/* Decodes and validates buf[0..len) against the limits in cfg. On failure *code is the error
 * code (EC_BAD_REQUEST, EC_TOO_LARGE, EC_UNSUPPORTED_VERSION) and err the message; p->id_raw
 * is set whenever the id could be read, so the error reply can echo it. Returns 0 or -1. */
int proto_decode(const void *buf, size_t len, const struct Config *cfg, struct RequestParams *p,
                 enum ErrCode *code, char *err, size_t errlen);
void proto_params_free(struct RequestParams *p);

/* Starts a reply map of n_fields + 2 entries with "id" (echoed, or nil) and "ok". */
void proto_reply_head(struct MpWriter *w, size_t n_fields, const uint8_t *id, size_t id_len, int ok);
/* A whole error reply {id, ok: false, error: {code, message}}. */
void proto_error(struct MpWriter *w, const uint8_t *id, size_t id_len, enum ErrCode code,
                 const char *message);

#endif
