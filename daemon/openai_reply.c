/* The OpenAI-compatible API's replies (openai.h): the broker's msgpack replies read and
 * written as OpenAI's JSON, a whole chat completion or the Server-Sent Events of a stream, with
 * the protocol's error codes as HTTP statuses. The HTTP side (openai.c) sends what this writes. */
#include "daemon/openai.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "daemon/mp.h"
#include "text/json.h"

unsigned openai_error_status(const char *code, const char **type)
{
    static const struct { const char *code; unsigned status; const char *type; } map[] = {
        { "bad_request", 400, "invalid_request_error" },
        { "too_large", 413, "invalid_request_error" },
        { "not_found", 404, "not_found_error" },
        { "overloaded", 429, "overloaded_error" },
        { "deadline_exceeded", 504, "timeout_error" },
        { "cancelled", 503, "server_error" },
        { "shutting_down", 503, "server_error" },
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(code, map[i].code)) {
            *type = map[i].type;
            return map[i].status;
        }
    *type = "server_error";
    return 500;
}

/* ---- reading the broker's msgpack ---- */

/* Positions *val at the value of `key` in the map buf[0..len) holds. 1 found, 0 not. */
static int mp_find(const void *buf, size_t len, const char *key, struct MpCursor *val)
{
    struct MpCursor c;
    struct MpObj o, k;
    mp_cursor_init(&c, buf, len);
    if (mp_next(&c, &o) || o.type != MP_MAP)
        return 0;
    size_t kl = strlen(key);
    for (uint32_t i = 0; i < o.v.n; i++) {
        if (mp_next(&c, &k))
            return 0;
        if (k.type == MP_STR && k.len == kl && !memcmp(k.s, key, kl)) {
            *val = c;
            return 1;
        }
        if ((k.type == MP_ARRAY || k.type == MP_MAP) && mp_skip_body(&c, &k))
            return 0;
        if (mp_skip(&c))
            return 0;
    }
    return 0;
}

static int mp_get_str(const void *buf, size_t len, const char *key, const char **s, size_t *n)
{
    struct MpCursor c;
    struct MpObj o;
    if (!mp_find(buf, len, key, &c) || mp_next(&c, &o) || o.type != MP_STR)
        return 0;
    *s = o.s;
    *n = o.len;
    return 1;
}

static long long mp_get_int(const void *buf, size_t len, const char *key)
{
    struct MpCursor c;
    struct MpObj o;
    if (!mp_find(buf, len, key, &c) || mp_next(&c, &o))
        return 0;
    return o.type == MP_UINT ? (long long)o.v.u : o.type == MP_INT ? (long long)o.v.i : 0;
}

/* ---- writing OpenAI's JSON ---- */

/* One msgpack value as JSON (the reply's citations, context, grounding, timings). */
static int mp_to_json(struct MpCursor *c, struct JsonBuf *b, int depth)
{
    struct MpObj o;
    if (depth > MP_MAX_DEPTH || mp_next(c, &o))
        return -1;
    char num[32];
    switch (o.type) {
    case MP_NIL: json_buf_puts(b, "null"); return 0;
    case MP_BOOL: json_buf_puts(b, o.v.b ? "true" : "false"); return 0;
    case MP_UINT:
        snprintf(num, sizeof num, "%llu", (unsigned long long)o.v.u);
        json_buf_puts(b, num);
        return 0;
    case MP_INT:
        snprintf(num, sizeof num, "%lld", (long long)o.v.i);
        json_buf_puts(b, num);
        return 0;
    case MP_FLOAT: json_buf_double(b, o.v.f); return 0;
    case MP_STR: json_buf_string(b, o.s, o.len); return 0;
    case MP_BIN:
    case MP_EXT: json_buf_puts(b, "null"); return 0;
    case MP_ARRAY:
        json_buf_puts(b, "[");
        for (uint32_t i = 0; i < o.v.n; i++) {
            if (i)
                json_buf_puts(b, ",");
            if (mp_to_json(c, b, depth + 1))
                return -1;
        }
        json_buf_puts(b, "]");
        return 0;
    case MP_MAP:
        json_buf_puts(b, "{");
        for (uint32_t i = 0; i < o.v.n; i++) {
            struct MpObj k;
            if (mp_next(c, &k) || k.type != MP_STR)
                return -1;
            if (i)
                json_buf_puts(b, ",");
            json_buf_string(b, k.s, k.len);
            json_buf_puts(b, ":");
            if (mp_to_json(c, b, depth + 1))
                return -1;
        }
        json_buf_puts(b, "}");
        return 0;
    }
    return -1;
}

/* "key":VALUE for a key of the reply map, or "key":null without it. */
static void copy_field(struct JsonBuf *b, const void *buf, size_t len, const char *key, int comma)
{
    struct MpCursor c;
    if (comma)
        json_buf_puts(b, ",");
    json_buf_string(b, key, strlen(key));
    json_buf_puts(b, ":");
    size_t at = b->len;
    if (!mp_find(buf, len, key, &c) || mp_to_json(&c, b, 0)) {
        if (!b->oom && b->p) {
            b->len = at;
            b->p[at] = 0;
        }
        json_buf_puts(b, "null");
    }
}

/* OpenAI's finish_reason for the protocol's: a cancelled answer ended as asked ("stop"), one
 * cut by its deadline ended early as by a limit ("length"); the `diffrag` object keeps the
 * protocol's own. */
static const char *finish_of(const void *buf, size_t len)
{
    const char *s;
    size_t n;
    if (!mp_get_str(buf, len, "finish_reason", &s, &n))
        return "stop";
    if ((n == 6 && !memcmp(s, "length", 6)) || (n == 8 && !memcmp(s, "deadline", 8)))
        return "length";
    return "stop";
}

static void put_usage(struct JsonBuf *b, const void *buf, size_t len)
{
    struct MpCursor u;
    long long prompt = 0, completion = 0, cached = 0;
    if (mp_find(buf, len, "usage", &u)) {
        const void *ub = u.p;
        size_t ul = (size_t)(u.end - u.p);
        prompt = mp_get_int(ub, ul, "prompt_tokens");
        completion = mp_get_int(ub, ul, "completion_tokens");
        cached = mp_get_int(ub, ul, "cached_tokens");
    }
    char t[256];
    snprintf(t, sizeof t, "\"usage\":{\"prompt_tokens\":%lld,\"completion_tokens\":%lld,"
             "\"total_tokens\":%lld,\"prompt_tokens_details\":{\"cached_tokens\":%lld}}",
             prompt, completion, prompt + completion, cached);
    json_buf_puts(b, t);
}

/* The reply's context, with the turns the API left out before the query (the oldest) added to
 * those the planner left out, so that history_turns + history_left_out is every earlier turn of
 * the request. */
static void put_context(struct JsonBuf *b, const void *buf, size_t len, size_t left_out)
{
    struct MpCursor c;
    struct MpObj o;
    if (!left_out || !mp_find(buf, len, "context", &c) || mp_next(&c, &o) || o.type != MP_MAP) {
        copy_field(b, buf, len, "context", 1);
        return;
    }
    size_t at = b->len;
    json_buf_puts(b, ",\"context\":{");
    for (uint32_t i = 0; i < o.v.n; i++) {
        struct MpObj k, v;
        if (mp_next(&c, &k) || k.type != MP_STR)
            goto bad;
        json_buf_puts(b, i ? "," : "");
        json_buf_string(b, k.s, k.len);
        json_buf_puts(b, ":");
        struct MpCursor at_v = c;
        if (k.len == 16 && !memcmp(k.s, "history_left_out", 16) && !mp_next(&at_v, &v) &&
            v.type == MP_UINT) {
            char num[32];
            snprintf(num, sizeof num, "%llu", (unsigned long long)(v.v.u + left_out));
            json_buf_puts(b, num);
            c = at_v;
        } else if (mp_to_json(&c, b, 1)) {
            goto bad;
        }
    }
    json_buf_puts(b, "}");
    return;
bad:
    if (!b->oom && b->p) {
        b->len = at;
        b->p[at] = 0;
    }
    copy_field(b, buf, len, "context", 1);
}

/* The `diffrag` object of a completion: citations, what the prompt read, grounding, timings,
 * the protocol's finish_reason, whether the answer was declined (with why, and the model's
 * attempt), and how it was written (answer_mode, and a quote-mode answer's quotes); a
 * stream's last chunk adds the final `answer`, which replaces what its deltas showed when it
 * was declined after generating (docs/openai.md). */
static void put_diffrag(struct JsonBuf *b, const struct OpenAiChat *ch, const void *buf,
                        size_t len, int with_answer)
{
    json_buf_puts(b, "\"diffrag\":{");
    copy_field(b, buf, len, "finish_reason", 0);
    copy_field(b, buf, len, "declined", 1);
    copy_field(b, buf, len, "decline_reason", 1);
    copy_field(b, buf, len, "attempt", 1);
    copy_field(b, buf, len, "answer_mode", 1);
    copy_field(b, buf, len, "quotes", 1);
    if (with_answer)
        copy_field(b, buf, len, "answer", 1);
    copy_field(b, buf, len, "citations", 1);
    put_context(b, buf, len, ch->history_left_out);
    copy_field(b, buf, len, "grounding", 1);
    copy_field(b, buf, len, "timings", 1);
    json_buf_puts(b, "}");
}

static void put_head(struct JsonBuf *b, const struct OpenAiChat *ch, const char *object)
{
    char t[160];
    json_buf_puts(b, "{\"id\":");
    json_buf_string(b, ch->id, strlen(ch->id));
    snprintf(t, sizeof t, ",\"object\":\"%s\",\"created\":%ld,\"model\":", object, ch->created);
    json_buf_puts(b, t);
    json_buf_string(b, ch->model, strlen(ch->model));
}

int openai_reply_final(const void *buf, size_t len)
{
    struct MpCursor c;
    return mp_find(buf, len, "ok", &c);
}

int openai_reply_ok(const void *buf, size_t len)
{
    struct MpCursor c;
    struct MpObj o;
    return mp_find(buf, len, "ok", &c) && !mp_next(&c, &o) && o.type == MP_BOOL && o.v.b;
}

long long openai_reply_int(const void *buf, size_t len, const char *key)
{
    return mp_get_int(buf, len, key);
}

void openai_reply_error(const void *buf, size_t len, char code[32], char msg[1024])
{
    struct MpCursor e;
    const char *c = "internal", *t = "the daemon failed to answer";
    size_t cl = strlen(c), tl = strlen(t);
    if (mp_find(buf, len, "error", &e)) {
        mp_get_str(e.p, (size_t)(e.end - e.p), "code", &c, &cl);
        mp_get_str(e.p, (size_t)(e.end - e.p), "message", &t, &tl);
    }
    snprintf(code, 32, "%.*s", (int)(cl < 31 ? cl : 31), c);
    snprintf(msg, 1024, "%.*s", (int)(tl < 1023 ? tl : 1023), t);
}

void openai_put_completion(struct JsonBuf *b, const struct OpenAiChat *ch, const void *buf,
                           size_t len)
{
    const char *answer = "";
    size_t alen = 0;
    mp_get_str(buf, len, "answer", &answer, &alen);
    put_head(b, ch, "chat.completion");
    json_buf_puts(b, ",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":");
    json_buf_string(b, answer, alen);
    json_buf_puts(b, "},\"logprobs\":null,\"finish_reason\":\"");
    json_buf_puts(b, finish_of(buf, len));
    json_buf_puts(b, "\"}],");
    put_usage(b, buf, len);
    json_buf_puts(b, ",");
    put_diffrag(b, ch, buf, len, 0);
    json_buf_puts(b, "}\n");
}

void openai_put_stream(struct JsonBuf *b, struct OpenAiChat *ch, const void *buf, size_t len)
{
    const char *s;
    size_t n;
    if (!ch->role_sent) {
        json_buf_puts(b, "data: ");
        put_head(b, ch, "chat.completion.chunk");
        json_buf_puts(b, ",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\","
                         "\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
        ch->role_sent = 1;
    }
    if (!openai_reply_final(buf, len)) {
        if (!mp_get_str(buf, len, "delta", &s, &n) || !n)
            return;
        json_buf_puts(b, "data: ");
        put_head(b, ch, "chat.completion.chunk");
        json_buf_puts(b, ",\"choices\":[{\"index\":0,\"delta\":{\"content\":");
        json_buf_string(b, s, n);
        json_buf_puts(b, "},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
        return;
    }
    ch->final_seen = 1;
    if (!openai_reply_ok(buf, len)) {
        /* an error after the stream began (a lost worker): OpenAI's error event */
        char code[32], msg[1024];
        const char *type;
        openai_reply_error(buf, len, code, msg);
        openai_error_status(code, &type);
        json_buf_puts(b, "data: {\"error\":{\"message\":");
        json_buf_string(b, msg, strlen(msg));
        json_buf_puts(b, ",\"type\":");
        json_buf_string(b, type, strlen(type));
        json_buf_puts(b, ",\"param\":null,\"code\":");
        json_buf_string(b, code, strlen(code));
        json_buf_puts(b, "}}\n\n");
    } else {
        json_buf_puts(b, "data: ");
        put_head(b, ch, "chat.completion.chunk");
        json_buf_puts(b, ",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,"
                         "\"finish_reason\":\"");
        json_buf_puts(b, finish_of(buf, len));
        json_buf_puts(b, "\"}],");
        put_diffrag(b, ch, buf, len, 1);
        json_buf_puts(b, "}\n\n");
        if (ch->include_usage) {
            json_buf_puts(b, "data: ");
            put_head(b, ch, "chat.completion.chunk");
            json_buf_puts(b, ",\"choices\":[],");
            put_usage(b, buf, len);
            json_buf_puts(b, "}\n\n");
        }
    }
    json_buf_puts(b, "data: [DONE]\n\n");
    ch->ended = 1;
}
