/* The OpenAI-compatible HTTP API (openai.h, docs/openai.md): the server, its connections and
 * API keys; a chat request passed to the broker as the msgpack `query` (openai_req.c writes it),
 * its replies awaited and sent back as openai_reply.c writes them; a query cancelled when its
 * client hangs up. What one request may cost is bounded: its body (max_body), the tree parsed
 * from it (max_json_values), the bodies parsed at once (parse slots), and the connections
 * answering at once (the guard's reserved slots); refusals are logged at most once a second. */
#include "daemon/openai.h"

#include <errno.h>
#include <microhttpd.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "daemon/broker.h"
#include "daemon/http.h"
#include "daemon/log.h"
#include "daemon/mp.h"
#include "daemon/zutil.h"
#include "text/json.h"

#define API_MAX_KEYS 1024
#define API_KEY_MAX_LEN 1024
#define API_POLL_MS 100               /* how often a waiting request looks at its client */
#define API_CANCEL_WAIT_MS 5000       /* for the final reply of a query cancelled on disconnect */
#define API_PARSE_WAIT_MS 5000        /* for a parse slot, before a 503 */
#define API_CONNECTION_MEMORY (64 * 1024)  /* per connection, for the request's headers */
#define API_TLS_FILE_MAX (1 << 20)

struct OpenAi {
    struct MHD_Daemon *d;
    struct HttpGuard *guard;
    struct Metrics *metrics;
    void *zctx;
    char *model;
    char *architecture, *quantization;  /* the model's, for /v1/models */
    char *default_collection;          /* NULL: none */
    size_t max_body;
    const char *max_body_key;          /* the setting naming max_body (a constant) */
    struct OpenAiLimits limits;        /* what a body may hold (openai_translate) */
    pthread_mutex_t parse_mu;          /* parse_free */
    pthread_cond_t parse_cv;
    int parse_slots, parse_free;       /* bodies parsed at once; slots free now */
    int parse_init;                    /* parse_mu and parse_cv are initialised */
    struct DlogLimit refusals;         /* their log lines: at most one a second */
    unsigned char (*keys)[32];         /* SHA-256 of each accepted key */
    size_t n_keys;
    char *tls_cert, *tls_key;          /* PEM text; NULL: plain HTTP */
    long created;                      /* when the model was loaded (/v1/models) */
    unsigned idle_s;                   /* the connections' idle timeout */
    atomic_int stopping;
};

enum Route { R_NONE, R_CHAT, R_MODELS, R_MODEL };

/* One HTTP request, from its headers to its last byte. */
struct ApiReq {
    struct OpenAi *api;
    struct MHD_Connection *conn;
    enum Route route;
    int fd;                        /* the client's socket: polled for a hang-up */
    int answered;                  /* a response is queued: the rest of the body is dropped */
    int has_body, body_read;       /* the request announces a body; it has all been read */
    int close_after;               /* the response ends the connection */
    int can_probe;                 /* plain HTTP/1.1: a half-close can be told from a close */
    int probed;                    /* the interim response that tells them apart is sent */
    int busy;                      /* counted busy by the guard, without an idle timeout */
    char *body;
    size_t len, cap, expect;       /* expect: its Content-Length (0: none given) */
    int too_large;
    /* the query */
    void *sock;                    /* DEALER to the broker; NULL before sending */
    int stream;
    int gone;                      /* the client hung up */
    struct OpenAiChat chat;        /* the completion's id, and where its reply stands */
    struct JsonBuf out;            /* stream text not yet handed to the server */
    size_t out_off;
};

/* ---- small helpers ---- */

static enum MHD_Result respond(struct ApiReq *q, unsigned status, struct JsonBuf *body,
                               const char *retry_after, int www_auth)
{
    q->answered = 1;
    if (body->oom || !body->p) {
        json_buf_free(body);
        return MHD_NO;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(body->len, body->p,
                                                             MHD_RESPMEM_MUST_FREE);
    if (!r) {
        json_buf_free(body);
        return MHD_NO;
    }
    body->p = NULL;
    json_buf_free(body);
    MHD_add_response_header(r, "Content-Type", "application/json");
    /* a response before the body's end, or to framing not to be trusted, ends the connection:
     * what follows cannot be read as the next request */
    if (q->close_after || (q->has_body && !q->body_read))
        MHD_add_response_header(r, "Connection", "close");
    if (retry_after)
        MHD_add_response_header(r, "Retry-After", retry_after);
    if (www_auth)
        MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ret = MHD_queue_response(q->conn, status, r);
    MHD_destroy_response(r);
    metrics_http_request(q->api->metrics, q->route == R_CHAT ? "chat_completions"
                         : q->route == R_NONE ? "other" : "models", (int)status);
    return ret;
}

/* One line for a refused request, at most one a second (a flood of refusals must not flood
 * the log), with how many were held back; the level checked first. */
static void log_refusal(struct OpenAi *a, int level, unsigned status, const char *code,
                        const char *msg)
{
    unsigned long held;
    if (level > dlog_level || !dlog_limit_pass(&a->refusals, &held))
        return;
    char why[256];
    dlog_quote(why, sizeof why, msg, strlen(msg));
    dlog_write(level, "msg=\"http request refused\" status=%u code=%s reason=%s "
               "suppressed_since_last=%lu", status, code ? code : "-", why, held);
}

/* OpenAI's error object: {"error": {"message", "type", "param", "code"}}, logged at level. */
static enum MHD_Result refuse(struct ApiReq *q, int level, unsigned status, const char *type,
                              const char *code, const char *param, const char *msg)
{
    struct JsonBuf b = { 0 };
    json_buf_puts(&b, "{\"error\":{\"message\":");
    json_buf_string(&b, msg, strlen(msg));
    json_buf_puts(&b, ",\"type\":");
    json_buf_string(&b, type, strlen(type));
    json_buf_puts(&b, ",\"param\":");
    if (param)
        json_buf_string(&b, param, strlen(param));
    else
        json_buf_puts(&b, "null");
    json_buf_puts(&b, ",\"code\":");
    if (code)
        json_buf_string(&b, code, strlen(code));
    else
        json_buf_puts(&b, "null");
    json_buf_puts(&b, "}}\n");
    log_refusal(q->api, level, status, code, msg);
    return respond(q, status, &b, status == 429 || status == 503 ? "1" : NULL, status == 401);
}

/* A refusal the client's own request explains (logged at debug). */
static enum MHD_Result respond_error(struct ApiReq *q, unsigned status, const char *type,
                                     const char *code, const char *param, const char *msg)
{
    return refuse(q, LL_DEBUG, status, type, code, param, msg);
}

static enum MHD_Result bad_request(struct ApiReq *q, const char *param, const char *msg)
{
    return respond_error(q, 400, "invalid_request_error", "bad_request", param, msg);
}

/* Whether the client has hung up (or its connection failed). A client that only shut its
 * sending side after its request (as `nc -N` does; HTTP/1.1 allows it) still reads its answer,
 * but until something is written it looks the same as one that closed. Once the answer has
 * begun, its own writes tell them apart (a closed socket answers with a reset); before, over
 * plain HTTP/1.1, an interim `100 Continue` (which every client skips) is written once to the
 * same end. Over TLS or HTTP/1.0 nothing can be written early: a half-close counts as leaving. */
static int client_gone(struct ApiReq *q)
{
    if (q->fd < 0)
        return 0;
    struct pollfd p = { .fd = q->fd, .events = POLLRDHUP };
    if (poll(&p, 1, 0) <= 0)
        return 0;
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL))
        return 1;
    if (!(p.revents & POLLRDHUP) || q->answered || q->probed)
        return 0;
    if (!q->can_probe)
        return 1;
    static const char probe[] = "HTTP/1.1 100 Continue\r\n\r\n";
    q->probed = 1;
    return send(q->fd, probe, sizeof probe - 1, MSG_NOSIGNAL | MSG_DONTWAIT) !=
           (ssize_t)(sizeof probe - 1);
}

/* A parse slot: a chat body is parsed into a tree and written as the query (several times its
 * size in memory) by at most parse_slots requests at once. Waits for one up to
 * API_PARSE_WAIT_MS (a parse takes milliseconds to a few hundred). 0, or -1 without one. */
static int parse_slot_take(struct OpenAi *a)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += API_PARSE_WAIT_MS / 1000;
    until.tv_nsec += (API_PARSE_WAIT_MS % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&a->parse_mu);
    while (!a->parse_free && !atomic_load(&a->stopping))
        if (pthread_cond_timedwait(&a->parse_cv, &a->parse_mu, &until) == ETIMEDOUT)
            break;
    int got = a->parse_free > 0 && !atomic_load(&a->stopping);
    a->parse_free -= got;
    pthread_mutex_unlock(&a->parse_mu);
    return got ? 0 : -1;
}

static void parse_slot_give(struct OpenAi *a)
{
    pthread_mutex_lock(&a->parse_mu);
    a->parse_free++;
    pthread_cond_signal(&a->parse_cv);
    pthread_mutex_unlock(&a->parse_mu);
}

/* ---- talking to the broker ---- */

/* The broker's next message for q in *m (initialised here). 0; -1 when the client hung up
 * (q->gone) or the API stops. */
static int next_msg(struct ApiReq *q, zmq_msg_t *m)
{
    for (;;) {
        zmq_pollitem_t it = { q->sock, 0, ZMQ_POLLIN, 0 };
        int n = zmq_poll(&it, 1, API_POLL_MS);
        if (n > 0) {
            zmq_msg_init(m);
            if (zmq_msg_recv(m, q->sock, ZMQ_DONTWAIT) >= 0)
                return 0;
            zmq_msg_close(m);
        }
        if (n < 0 && errno != EINTR)
            return -1;
        if (client_gone(q)) {
            q->gone = 1;
            return -1;
        }
        if (atomic_load(&q->api->stopping))
            return -1;
    }
}

static int is_final(const zmq_msg_t *m)
{
    return openai_reply_final(zmq_msg_data((zmq_msg_t *)m), zmq_msg_size((zmq_msg_t *)m));
}

/* The query is still running for a client that left: cancel it, and wait (a while) for its
 * final reply so the broker has answered it before the socket closes. */
static void cancel_query(struct ApiReq *q)
{
    struct MpWriter w;
    mpw_init(&w);
    mpw_map(&w, 3);
    mpw_kv_uint(&w, "v", 1);
    mpw_kv_cstr(&w, "op", "cancel");
    mpw_kv_uint(&w, "target", 1);
    if (!w.failed)
        zmq_send(q->sock, w.buf.data, w.buf.size, ZMQ_DONTWAIT);
    mpw_destroy(&w);
    metrics_http_disconnect(q->api->metrics);
    /* when the API stops, the broker has answered every request it admitted and reads no more */
    double until = atomic_load(&q->api->stopping) ? 0 : zu_now_ms() + API_CANCEL_WAIT_MS;
    while (zu_now_ms() < until) {
        zmq_pollitem_t it = { q->sock, 0, ZMQ_POLLIN, 0 };
        if (zmq_poll(&it, 1, API_POLL_MS) <= 0)
            continue;
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, q->sock, ZMQ_DONTWAIT) >= 0 && is_final(&m) &&
            openai_reply_int(zmq_msg_data(&m), zmq_msg_size(&m), "id") == 1) {
            zmq_msg_close(&m);
            break;
        }
        zmq_msg_close(&m);
    }
}

static void close_query(struct ApiReq *q)
{
    if (!q->sock)
        return;
    if (!q->chat.final_seen)
        cancel_query(q);
    zmq_close(q->sock);
    q->sock = NULL;
}

/* An error reply of the broker as an HTTP response. */
static enum MHD_Result respond_reply_error(struct ApiReq *q, const zmq_msg_t *m)
{
    char code[32], msg[1024];
    const char *type;
    openai_reply_error(zmq_msg_data((zmq_msg_t *)m), zmq_msg_size((zmq_msg_t *)m), code, msg);
    unsigned status = openai_error_status(code, &type);
    return respond_error(q, status, type, code, NULL, msg);
}

/* The whole completion of a successful final reply. */
static enum MHD_Result respond_completion(struct ApiReq *q, const zmq_msg_t *m)
{
    struct JsonBuf b = { 0 };
    openai_put_completion(&b, &q->chat, zmq_msg_data((zmq_msg_t *)m),
                          zmq_msg_size((zmq_msg_t *)m));
    return respond(q, 200, &b, NULL, 0);
}

/* Stream events for one broker message, queued for stream_read. */
static void stream_event(struct ApiReq *q, const zmq_msg_t *m)
{
    openai_put_stream(&q->out, &q->chat, zmq_msg_data((zmq_msg_t *)m),
                      zmq_msg_size((zmq_msg_t *)m));
}

/* The stream's body, asked for by the connection's thread, which may wait here. */
static ssize_t stream_read(void *cls, uint64_t pos, char *out, size_t max)
{
    (void)pos;
    struct ApiReq *q = cls;
    for (;;) {
        if (q->out.oom)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        if (q->out_off < q->out.len) {
            size_t n = q->out.len - q->out_off;
            if (n > max)
                n = max;
            memcpy(out, q->out.p + q->out_off, n);
            q->out_off += n;
            return (ssize_t)n;
        }
        json_buf_free(&q->out);
        q->out_off = 0;
        if (q->chat.ended)
            return MHD_CONTENT_READER_END_OF_STREAM;
        zmq_msg_t m;
        if (next_msg(q, &m))
            return MHD_CONTENT_READER_END_WITH_ERROR;
        stream_event(q, &m);
        zmq_msg_close(&m);
    }
}

/* A complete chat request: read, sent to the broker, answered. */
static enum MHD_Result answer_chat(struct ApiReq *q)
{
    struct OpenAi *a = q->api;
    char msg[512];
    if (q->too_large) {
        snprintf(msg, sizeof msg, "the request body is larger than %zu bytes (%s)", a->max_body,
                 a->max_body_key);
        return refuse(q, LL_INFO, 413, "invalid_request_error", "too_large", NULL, msg);
    }
    /* From here the time is the answer's (a parse, a long prefill, a stream's pauses), bounded
     * by the query's own limits: neither the guard's deadline nor the idle timeout applies; but
     * a client that reads nothing of its answer is cut (http.h). Some connections are kept for
     * other requests: past the rest, a 503. */
    if (http_guard_busy(a->guard, q->conn)) {
        snprintf(msg, sizeof msg, "every connection for answers is answering one "
                 "(http_max_connections less http_reserved_connections): retry");
        return refuse(q, LL_INFO, 503, "overloaded_error", "overloaded", NULL, msg);
    }
    q->busy = 1;
    MHD_set_connection_option(q->conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    if (parse_slot_take(a)) {
        snprintf(msg, sizeof msg, "the server is parsing as many request bodies as it parses at "
                 "once (http_parse_slots = %d): retry", a->parse_slots);
        return refuse(q, LL_INFO, 503, "overloaded_error", "overloaded", NULL, msg);
    }
    const char *param = NULL;
    struct MpWriter w;
    struct OpenAiAsk ask;
    mpw_init(&w);
    const char *why = openai_translate(q->body, q->len, &a->limits, &w, &ask, msg, sizeof msg,
                                       &param);
    q->stream = ask.stream;
    q->chat.include_usage = ask.include_usage;
    q->chat.history_left_out = ask.history_left_out;
    free(q->body);
    q->body = NULL;
    if (why) {
        mpw_destroy(&w);
        parse_slot_give(a);
        if (ask.status == 413)
            return refuse(q, LL_INFO, 413, "invalid_request_error", "too_large", param, why);
        return bad_request(q, param, why);
    }
    q->sock = zmq_socket(q->api->zctx, ZMQ_DEALER);
    int linger = 0;
    if (!q->sock || zmq_setsockopt(q->sock, ZMQ_LINGER, &linger, sizeof linger) ||
        zmq_connect(q->sock, BROKER_HTTP_INPROC) ||
        zmq_send(q->sock, w.buf.data, w.buf.size, 0) < 0) {
        mpw_destroy(&w);
        parse_slot_give(a);
        if (q->sock)
            zmq_close(q->sock);
        q->sock = NULL;
        return respond_error(q, 500, "server_error", "internal", NULL,
                             "cannot pass the request to the broker");
    }
    mpw_destroy(&w);
    parse_slot_give(a);
    unsigned char rnd[12];
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd)
        memset(rnd, 0, sizeof rnd);
    int o = snprintf(q->chat.id, sizeof q->chat.id, "chatcmpl-");
    for (size_t i = 0; i < sizeof rnd; i++)
        o += snprintf(q->chat.id + o, sizeof q->chat.id - (size_t)o, "%02x", rnd[i]);
    q->chat.created = (long)time(NULL);
    q->chat.model = q->api->model;
    zmq_msg_t m;
    for (;;) {
        if (next_msg(q, &m))
            return MHD_NO;   /* the client left (its query is cancelled when the request ends) */
        if (q->stream || is_final(&m))
            break;
        zmq_msg_close(&m);   /* not asked for: nothing but the final reply is awaited */
    }
    enum MHD_Result ret = MHD_NO;
    if (is_final(&m)) {
        q->chat.final_seen = 1;
        if (!openai_reply_ok(zmq_msg_data(&m), zmq_msg_size(&m)))
            ret = respond_reply_error(q, &m);
        else if (!q->stream)
            ret = respond_completion(q, &m);
        else
            stream_event(q, &m);
    } else {
        stream_event(q, &m);
    }
    zmq_msg_close(&m);
    if (q->answered)
        return ret;
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024,
                                                               stream_read, q, NULL);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    q->answered = 1;
    ret = MHD_queue_response(q->conn, 200, r);
    MHD_destroy_response(r);
    metrics_http_request(q->api->metrics, "chat_completions", 200);
    return ret;
}

static enum MHD_Result answer_models(struct ApiReq *q, const char *url)
{
    struct OpenAi *a = q->api;
    char t[160];
    struct JsonBuf b = { 0 };
    const char *one = q->route == R_MODEL ? url + strlen("/v1/models/") : NULL;
    if (one && strcmp(one, a->model)) {
        char msg[512];
        snprintf(msg, sizeof msg, "the model \"%.200s\" is not served here (this daemon serves "
                 "\"%.200s\")", one, a->model);
        return respond_error(q, 404, "not_found_error", "not_found", "model", msg);
    }
    if (!one)
        json_buf_puts(&b, "{\"object\":\"list\",\"data\":[");
    json_buf_puts(&b, "{\"id\":");
    json_buf_string(&b, a->model, strlen(a->model));
    snprintf(t, sizeof t, ",\"object\":\"model\",\"created\":%ld,\"owned_by\":\"diffrag\","
             "\"diffrag\":{\"architecture\":", a->created);
    json_buf_puts(&b, t);
    json_buf_string(&b, a->architecture, strlen(a->architecture));
    json_buf_puts(&b, ",\"quantization\":");
    json_buf_string(&b, a->quantization, strlen(a->quantization));
    json_buf_puts(&b, one ? "}}\n" : "}}]}\n");
    return respond(q, 200, &b, NULL, 0);
}

/* ---- the server's callbacks ---- */

static int key_ok(const struct OpenAi *a, const char *auth)
{
    if (!a->n_keys)
        return 1;
    if (!auth || strncasecmp(auth, "Bearer ", 7))
        return 0;
    const char *key = auth + 7;
    while (*key == ' ')
        key++;
    unsigned char h[32];
    unsigned int hl = 0;
    if (!EVP_Digest(key, strlen(key), h, &hl, EVP_sha256(), NULL) || hl != 32)
        return 0;
    int ok = 0;
    for (size_t i = 0; i < a->n_keys; i++)   /* every key compared, in constant time */
        ok |= !CRYPTO_memcmp(h, a->keys[i], 32);
    return ok;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **state)
{
    (void)version;
    struct OpenAi *a = cls;
    struct ApiReq *q = *state;
    if (!q) {   /* first call: the headers */
        q = calloc(1, sizeof *q);
        if (!q)
            return MHD_NO;
        *state = q;
        q->api = a;
        q->conn = c;
        q->fd = -1;
        const union MHD_ConnectionInfo *fi = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (fi)
            q->fd = fi->connect_fd;
        q->can_probe = !a->tls_cert && version && !strcmp(version, "HTTP/1.1");
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                                     MHD_HTTP_HEADER_CONTENT_LENGTH);
        q->has_body = (cl && strtoull(cl, NULL, 10) > 0) ||
                      MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                                  MHD_HTTP_HEADER_TRANSFER_ENCODING);
        char why[256];
        unsigned bad = http_framing_check(c, method, version, why, sizeof why);
        if (bad) {
            q->close_after = 1;
            return refuse(q, LL_INFO, bad, "invalid_request_error",
                          bad == 501 ? "not_implemented" : "bad_request", NULL, why);
        }
        if (http_guard_refused(a->guard, c)) {
            q->close_after = 1;
            return refuse(q, LL_INFO, 503, "overloaded_error", "overloaded", NULL,
                          "every connection of this server is answering a request "
                          "(http_max_connections): retry");
        }
        int post = !strcmp(method, "POST"), get = !strcmp(method, "GET");
        if (!strcmp(url, "/v1/chat/completions"))
            q->route = R_CHAT;
        else if (!strcmp(url, "/v1/models"))
            q->route = R_MODELS;
        else if (!strncmp(url, "/v1/models/", 11) && url[11])
            q->route = R_MODEL;
        const char *auth = MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                                       MHD_HTTP_HEADER_AUTHORIZATION);
        if (!key_ok(a, auth))
            return refuse(q, LL_INFO, 401, "invalid_request_error", "invalid_api_key", NULL,
                          auth ? "a valid API key is required: this one is wrong"
                               : "a valid API key is required: Authorization: Bearer KEY");
        if (q->route == R_NONE)
            return respond_error(q, 404, "not_found_error", "not_found", NULL,
                                 "no such endpoint (POST /v1/chat/completions, GET /v1/models)");
        if ((q->route == R_CHAT && !post) || (q->route != R_CHAT && !get))
            return respond_error(q, 405, "invalid_request_error", "method_not_allowed", NULL,
                                 q->route == R_CHAT ? "use POST" : "use GET");
        if (q->route != R_CHAT)
            return answer_models(q, url);
        if (cl && strtoull(cl, NULL, 10) > a->max_body) {
            q->too_large = 1;
            return answer_chat(q);
        }
        q->expect = cl ? (size_t)strtoull(cl, NULL, 10) : 0;
        return MHD_YES;
    }
    if (q->answered) {   /* the rest of a body already answered */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (q->too_large || q->len + n > a->max_body) {
            /* a body without Content-Length past the cap: the rest is dropped as it comes, and
             * the 413 follows its end (libmicrohttpd answers only before or after an upload);
             * one that never ends is cut at http_timeout, as the connection is not busy */
            q->too_large = 1;
            free(q->body);
            q->body = NULL;
            q->len = q->cap = 0;
            return MHD_YES;
        }
        if (q->len + n + 1 > q->cap) {
            /* the announced length at once (no copies while growing); else doubling */
            size_t cap = q->cap ? q->cap : q->expect >= q->len + n ? q->expect + 1 : 4096;
            while (cap < q->len + n + 1)
                cap *= 2;
            if (cap > a->max_body + 1)
                cap = a->max_body + 1;
            char *p = realloc(q->body, cap);
            if (!p)
                return MHD_NO;
            q->body = p;
            q->cap = cap;
        }
        memcpy(q->body + q->len, upload, n);
        q->len += n;
        q->body[q->len] = 0;
        return MHD_YES;
    }
    q->body_read = 1;
    return answer_chat(q);
}

static void request_done(void *cls, struct MHD_Connection *c, void **state,
                         enum MHD_RequestTerminationCode toe)
{
    (void)toe;
    struct OpenAi *a = cls;
    struct ApiReq *q = *state;
    http_guard_request_done(a->guard, c);
    if (!q)
        return;
    if (q->busy)
        MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, a->idle_s);
    close_query(q);
    free(q->body);
    json_buf_free(&q->out);
    free(q);
    *state = NULL;
}

static void conn_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                        enum MHD_ConnectionNotificationCode toe)
{
    struct OpenAi *a = cls;
    http_guard_notify(a->guard, c, socket_context, toe);
    metrics_http_connections(a->metrics, http_guard_open(a->guard));
}

/* ---- start, stop ---- */

static int read_file(const char *path, char **out, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    *out = NULL;
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    char *p = malloc(API_TLS_FILE_MAX + 1);
    size_t n = p ? fread(p, 1, API_TLS_FILE_MAX + 1, f) : 0;
    int bad = ferror(f);
    fclose(f);
    if (!p || bad || n > API_TLS_FILE_MAX || n == 0) {
        snprintf(err, errlen, "%s: %s", path, !p ? "out of memory" : bad ? "read error"
                 : n == 0 ? "empty" : "larger than 1 MiB");
        free(p);
        return -1;
    }
    p[n] = 0;
    *out = p;
    return 0;
}

/* One key a line; blank lines and # comments skipped; keys are printable ASCII without blanks. */
static int load_keys(struct OpenAi *a, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "http_api_key_file %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (!fstat(fileno(f), &st) && (st.st_mode & 077))
        dlog(LL_WARN, "msg=\"the API key file can be read by other users; chmod 600 it\" "
             "file=\"%s\"", path);
    a->keys = calloc(API_MAX_KEYS, sizeof *a->keys);
    char line[API_KEY_MAX_LEN + 4];
    int lineno = 0, rc = 0;
    while (a->keys && fgets(line, sizeof line, f)) {
        lineno++;
        size_t n = strlen(line);
        if (n == sizeof line - 1 && line[n - 1] != '\n') {
            snprintf(err, errlen, "http_api_key_file %s:%d: longer than %d bytes", path, lineno,
                     API_KEY_MAX_LEN);
            rc = -1;
            break;
        }
        while (n && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ' ||
                     line[n - 1] == '\t'))
            line[--n] = 0;
        char *k = line;
        while (*k == ' ' || *k == '\t')
            k++;
        if (!*k || *k == '#')
            continue;
        for (char *p = k; *p; p++)
            if (*p <= ' ' || *p > '~') {
                snprintf(err, errlen, "http_api_key_file %s:%d: a key is printable ASCII "
                         "without blanks", path, lineno);
                rc = -1;
                break;
            }
        if (rc)
            break;
        if (a->n_keys == API_MAX_KEYS) {
            snprintf(err, errlen, "http_api_key_file %s: more than %d keys", path, API_MAX_KEYS);
            rc = -1;
            break;
        }
        unsigned int hl = 0;
        if (!EVP_Digest(k, strlen(k), a->keys[a->n_keys], &hl, EVP_sha256(), NULL) || hl != 32) {
            snprintf(err, errlen, "http_api_key_file: cannot hash a key");
            rc = -1;
            break;
        }
        a->n_keys++;
    }
    fclose(f);
    if (!a->keys) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (!rc && !a->n_keys) {
        snprintf(err, errlen, "http_api_key_file %s holds no key", path);
        rc = -1;
    }
    return rc;
}

static void api_free(struct OpenAi *a)
{
    if (!a)
        return;
    http_guard_destroy(&a->guard);
    if (a->parse_init) {
        pthread_cond_destroy(&a->parse_cv);
        pthread_mutex_destroy(&a->parse_mu);
    }
    free(a->model);
    free(a->architecture);
    free(a->quantization);
    free(a->default_collection);
    free(a->keys);
    free(a->tls_cert);
    free(a->tls_key);
    free(a);
}

int openai_start(const struct OpenAiOpts *o, struct OpenAi **out, char *err, size_t errlen)
{
    *out = NULL;
    struct OpenAi *a = calloc(1, sizeof *a);
    if (!a) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    a->metrics = o->metrics;
    a->zctx = o->zctx;
    a->max_body = o->max_body_bytes;
    a->max_body_key = o->max_body_key ? o->max_body_key : "max_message_bytes";
    a->limits.max_json_values = o->max_json_values;
    a->limits.max_turn_bytes = o->max_turn_bytes;
    a->parse_slots = a->parse_free = o->parse_slots > 0 ? o->parse_slots : 1;
    pthread_mutex_init(&a->parse_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->parse_cv, &ca);
    pthread_condattr_destroy(&ca);
    a->parse_init = 1;
    a->created = (long)time(NULL);
    a->model = strdup(o->model_name);
    a->architecture = strdup(o->model_architecture ? o->model_architecture : "unknown");
    a->quantization = strdup(o->model_quantization ? o->model_quantization : "unknown");
    if (o->default_collection && o->default_collection[0])
        a->default_collection = strdup(o->default_collection);
    a->limits.default_collection = a->default_collection;
    if (!a->model || !a->architecture || !a->quantization ||
        (o->default_collection && o->default_collection[0] && !a->default_collection)) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    if (o->api_key_file && o->api_key_file[0] && load_keys(a, o->api_key_file, err, errlen))
        goto fail;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD;
    int tls = o->tls_cert_file && o->tls_cert_file[0];
    if (tls) {
        if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
            snprintf(err, errlen, "http_tls_cert_file: this libmicrohttpd has no TLS; put a "
                     "reverse proxy in front instead");
            goto fail;
        }
        char why[512];
        if (read_file(o->tls_cert_file, &a->tls_cert, why, sizeof why) ||
            read_file(o->tls_key_file, &a->tls_key, why, sizeof why)) {
            snprintf(err, errlen, "HTTP API TLS: %s", why);
            goto fail;
        }
        flags |= MHD_USE_TLS;
    }
    char why[512];
    if (http_guard_new(o->max_connections, o->max_connections, o->reserved_connections,
                       o->timeout_s, &a->guard, why, sizeof why)) {
        snprintf(err, errlen, "cannot serve the HTTP API: %s", why);
        goto fail;
    }
    int fd;
    if (http_bind("http_listen", o->listen, &fd, &flags, why, sizeof why)) {
        snprintf(err, errlen, "cannot serve the HTTP API: %s", why);
        goto fail;
    }
    unsigned idle = (unsigned)(o->timeout_s + 0.999);
    a->idle_s = idle;
    if (tls)
        a->d = MHD_start_daemon(flags, 0, NULL, NULL, handle, a, MHD_OPTION_LISTEN_SOCKET, fd,
                                MHD_OPTION_CONNECTION_LIMIT, http_guard_slots(a->guard),
                                MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)API_CONNECTION_MEMORY,
                                MHD_OPTION_CONNECTION_TIMEOUT, idle,
                                MHD_OPTION_NOTIFY_CONNECTION, conn_notify, a,
                                MHD_OPTION_NOTIFY_COMPLETED, request_done, a,
                                MHD_OPTION_HTTPS_MEM_CERT, a->tls_cert,
                                MHD_OPTION_HTTPS_MEM_KEY, a->tls_key, MHD_OPTION_END);
    else
        a->d = MHD_start_daemon(flags, 0, NULL, NULL, handle, a, MHD_OPTION_LISTEN_SOCKET, fd,
                                MHD_OPTION_CONNECTION_LIMIT, http_guard_slots(a->guard),
                                MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)API_CONNECTION_MEMORY,
                                MHD_OPTION_CONNECTION_TIMEOUT, idle,
                                MHD_OPTION_NOTIFY_CONNECTION, conn_notify, a,
                                MHD_OPTION_NOTIFY_COMPLETED, request_done, a, MHD_OPTION_END);
    if (!a->d) {
        snprintf(err, errlen, "cannot serve the HTTP API on %s: the HTTP server did not start%s",
                 o->listen, tls ? " (are the TLS certificate and key valid PEM?)" : "");
        close(fd);
        goto fail;
    }
    *out = a;
    return 0;
fail:
    api_free(a);
    return -1;
}

void openai_stop(struct OpenAi **ap)
{
    struct OpenAi *a = ap ? *ap : NULL;
    if (!a)
        return;
    atomic_store(&a->stopping, 1);
    pthread_mutex_lock(&a->parse_mu);
    pthread_cond_broadcast(&a->parse_cv);   /* requests waiting for a parse slot end */
    pthread_mutex_unlock(&a->parse_mu);
    MHD_stop_daemon(a->d);
    api_free(a);
    *ap = NULL;
}
