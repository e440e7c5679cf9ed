/* The OpenAI-compatible HTTP API (docs/openai.md): POST /v1/chat/completions and GET /v1/models
 * over libmicrohttpd, one thread per connection. Each chat request becomes a msgpack `query`
 * sent to the broker over BROKER_HTTP_INPROC on a DEALER socket of its own, so it passes the
 * same admission queue, limits, deadlines, metrics and log line as a ZeroMQ client's; the
 * answer (or its streamed deltas) comes back as a chat completion (or Server-Sent Events). A
 * client that disconnects before its answer ends has its query cancelled. */
#ifndef DIFFRAG_OPENAI_H
#define DIFFRAG_OPENAI_H

#include <stddef.h>

#include "daemon/metrics.h"
#include "daemon/mp.h"

struct OpenAiOpts {
    const char *listen;              /* HOST:PORT */
    const char *api_key_file;        /* "" or NULL: no key asked */
    const char *tls_cert_file;       /* "" or NULL: plain HTTP */
    const char *tls_key_file;
    int max_connections;
    int reserved_connections;        /* of them, never busy answering (http.h's guard) */
    double timeout_s;                /* to send a whole request; to read some of an answer */
    size_t max_body_bytes;           /* larger bodies: 413, unread */
    const char *max_body_key;        /* the setting that sets it, for the 413's message */
    size_t max_json_values;          /* larger trees: 413, unparsed */
    int parse_slots;                 /* bodies parsed at once */
    size_t max_turn_bytes;           /* longest system text or earlier turn */
    const char *default_collection;  /* "" or NULL: none */
    const char *model_name;          /* what /v1/models lists and replies name */
    const char *model_architecture;  /* /v1/models' diffrag object (startup.h's ServedModel) */
    const char *model_quantization;
    void *zctx;                      /* the broker's ZeroMQ context */
    struct Metrics *metrics;         /* borrowed; outlives the API */
};

struct OpenAi;

/* Reads the key file (refusing a malformed one) and the TLS files, binds and starts serving.
 * Every string is copied. 0, or -1 with err. */
int openai_start(const struct OpenAiOpts *o, struct OpenAi **out, char *err, size_t errlen);
/* Stops serving: requests still waiting end (their queries cancelled), connections close,
 * threads are joined. Call before the broker's sockets close. NULL is a no-op. */
void openai_stop(struct OpenAi **a);

/* What a chat request asks of its reply, besides the query. */
struct OpenAiAsk {
    int stream;          /* Server-Sent Events */
    int include_usage;   /* stream_options.include_usage */
    size_t history_left_out;   /* earlier turns the API left out of the query (the oldest) */
    unsigned status;     /* a refusal's HTTP status: 400, or 413 (too large) */
};

/* What openai_translate allows. */
struct OpenAiLimits {
    const char *default_collection;  /* read when a request names no documents; NULL or "": none */
    size_t max_json_values;          /* values of the body's JSON (json_measure) */
    size_t max_turn_bytes;           /* the joined system text; each earlier turn */
};

/* Nesting a request body may have (the outermost object counts 1). */
#define OPENAI_JSON_DEPTH 32

/* Reads a chat-completions request body (JSON) and writes the msgpack `query` it asks for into
 * w (initialised by the caller). A body of more than lim->max_json_values values is refused
 * before it is parsed. Of the earlier turns the newest go in, at most PROTO_MAX_HISTORY, and
 * none older than a turn over lim->max_turn_bytes (the ones left out: ask->history_left_out).
 * NULL, or why the request is refused (ask->status 400 or 413; a message in msg or a constant)
 * with *param the field at fault (or NULL). The daemon's own decoder checks the query after
 * it. */
const char *openai_translate(const char *body, size_t len, const struct OpenAiLimits *lim,
                             struct MpWriter *w, struct OpenAiAsk *ask, char *msg, size_t cap,
                             const char **param);

/* ---- the broker's replies as OpenAI's JSON (openai_reply.c) ----
 * buf[0..len) is one message of the broker's to a query (msgpack, docs/protocol.md): a delta,
 * or the final reply (the one with `ok`). Nothing keeps a pointer into it. */

/* One chat completion, and where its reply stands. */
struct OpenAiChat {
    char id[40];          /* "chatcmpl-" and 24 hex digits */
    long created;         /* Unix time the query was sent */
    const char *model;    /* the served model's name; borrowed from the API, which outlives it */
    int include_usage;    /* stream_options.include_usage: a last chunk carries the usage */
    int role_sent;        /* the stream's first chunk (the assistant's role) is written */
    int final_seen;       /* the broker's final reply came */
    int ended;            /* the stream's last event ([DONE]) is written */
    size_t history_left_out;  /* turns left out before the query: added to the context's */
};

struct JsonBuf;

/* 1 when buf is a final reply, 0 a delta. */
int openai_reply_final(const void *buf, size_t len);
/* 1 when buf is a final reply with ok = true. */
int openai_reply_ok(const void *buf, size_t len);
/* The integer at key of the reply map; 0 when absent or not an integer. */
long long openai_reply_int(const void *buf, size_t len, const char *key);
/* The code and message of an error reply ("internal" and a generic message where it lacks
 * them), NUL-terminated and cut to fit. */
void openai_reply_error(const void *buf, size_t len, char code[32], char msg[1024]);
/* The HTTP status and OpenAI error type (*type, a constant) of a protocol error code. */
unsigned openai_error_status(const char *code, const char **type);

/* Appends the whole chat.completion object of a successful final reply to b. */
void openai_put_completion(struct JsonBuf *b, const struct OpenAiChat *ch, const void *buf,
                           size_t len);
/* Appends the Server-Sent Events one broker message makes to b: the assistant's role first
 * (once), then a delta's content chunk; for the final reply the finishing chunk (with the
 * `diffrag` object), the usage chunk when asked, or an error event, and [DONE]; sets
 * ch->role_sent, ch->final_seen and ch->ended as it goes. */
void openai_put_stream(struct JsonBuf *b, struct OpenAiChat *ch, const void *buf, size_t len);

#endif
