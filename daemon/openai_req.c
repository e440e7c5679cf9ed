/* The OpenAI-compatible API's requests (openai.h): a chat-completions body read and checked,
 * and written as the msgpack protocol's `query`. Apart from the server so that the fuzz target
 * (tests/fuzz/fuzz_openai.c) links it alone. */
#include "daemon/openai.h"

#include <stdio.h>
#include <string.h>

#include "daemon/proto.h"
#include "text/json.h"

#define API_MAX_MESSAGES 1024         /* messages of one request */

/* Appends a message's content (a string, or an array of text parts) to out. NULL, or why not. */
static const char *content_text(json_t *content, struct JsonBuf *out)
{
    if (json_is_string(content)) {
        json_buf_put(out, json_string_value(content), json_string_length(content));
        return NULL;
    }
    if (!json_is_array(content))
        return "content must be a string or an array of text parts";
    size_t i;
    json_t *part;
    json_array_foreach(content, i, part) {
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type))
            return "each content part must be an object with a type";
        if (strcmp(json_string_value(type), "text"))
            return "only text content parts are supported";
        if (!json_is_string(text))
            return "a text content part needs a string text";
        if (i)
            json_buf_puts(out, "\n");
        json_buf_put(out, json_string_value(text), json_string_length(text));
    }
    return NULL;
}

/* A JSON value as msgpack, for the fields passed on unchanged (the daemon's decoder then checks
 * them and names what is wrong). In `docs`, a string is a document's text. */
static void put_json(struct MpWriter *w, json_t *v, int docs)
{
    size_t i;
    const char *k;
    json_t *e;
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        mpw_map(w, json_object_size(v));
        json_object_foreach(v, k, e) {
            mpw_cstr(w, k);
            put_json(w, e, 0);
        }
        break;
    case JSON_ARRAY:
        mpw_array(w, json_array_size(v));
        json_array_foreach(v, i, e) {
            if (docs && json_is_string(e)) {
                mpw_map(w, 1);
                mpw_kv_str(w, "text", json_string_value(e), json_string_length(e));
            } else {
                put_json(w, e, 0);
            }
        }
        break;
    case JSON_STRING: mpw_str(w, json_string_value(v), json_string_length(v)); break;
    case JSON_INTEGER: mpw_int(w, (int64_t)json_integer_value(v)); break;
    case JSON_REAL: mpw_double(w, json_real_value(v)); break;
    case JSON_TRUE: mpw_bool(w, 1); break;
    case JSON_FALSE: mpw_bool(w, 0); break;
    case JSON_NULL: mpw_nil(w); break;
    }
}

/* A field, JSON null counting as absent (as OpenAI's API treats it). */
static json_t *field(json_t *root, const char *key)
{
    json_t *v = json_object_get(root, key);
    return json_is_null(v) ? NULL : v;
}

/* The chat request root as the msgpack query (openai_translate). */
static const char *translate(struct OpenAiAsk *q, const struct OpenAiLimits *lim, json_t *root,
                             struct MpWriter *w, char *msg, size_t cap, const char **param)
{
    const char *default_collection = lim->default_collection;
    size_t turn_len[API_MAX_MESSAGES];   /* each earlier user or assistant turn's text; 0: none */
    static const char *const ext_keys[] = { "collection", "docs", "ids", "top_k",
                                            "max_context_tokens", "order", "relevance_floor",
                                            "deadline_ms", "unsupported", "answer_mode" };
    struct MpWriter f;         /* the map's entries; counted in n */
    size_t n = 0;
    struct JsonBuf system = { 0 }, text = { 0 };
    const char *why = NULL;
    mpw_init(&f);
    if (!json_is_object(root)) {
        why = "the body must be a JSON object";
        goto out;
    }
    json_t *messages = field(root, "messages"), *m;
    *param = "messages";
    if (!messages) {
        why = "messages is required";
        goto out;
    }
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        why = "messages must be a non-empty array";
        goto out;
    }
    if (json_array_size(messages) > API_MAX_MESSAGES) {
        snprintf(msg, cap, "messages holds %zu entries; at most %d are read",
                 json_array_size(messages), API_MAX_MESSAGES);
        why = msg;
        goto out;
    }
    size_t last = json_array_size(messages) - 1, i, n_turns = 0;
    json_array_foreach(messages, i, m) {
        turn_len[i] = 0;
        json_t *role = json_object_get(m, "role");
        if (!json_is_object(m) || !json_is_string(role)) {
            snprintf(msg, cap, "messages[%zu] must be an object with a string role", i);
            why = msg;
            goto out;
        }
        const char *r = json_string_value(role);
        int is_user = !strcmp(r, "user"), is_asst = !strcmp(r, "assistant");
        int is_sys = !strcmp(r, "system") || !strcmp(r, "developer");
        if (!is_user && !is_asst && !is_sys) {
            snprintf(msg, cap, "messages[%zu]: role \"%.32s\" is not supported (system, "
                     "developer, user, assistant; diffrag calls no tools)", i, r);
            why = msg;
            goto out;
        }
        if (i == last && !is_user) {
            why = "the last message must be the user's question";
            goto out;
        }
        json_t *content = field(m, "content");
        if (!content && is_asst && i < last)
            continue;   /* an assistant turn of tool calls only: nothing to keep */
        if (!content) {
            snprintf(msg, cap, "messages[%zu] has no content", i);
            why = msg;
            goto out;
        }
        struct JsonBuf *dst = is_sys ? &system : &text;
        if (is_sys && system.len)
            json_buf_puts(&system, "\n\n");
        const char *bad = content_text(content, dst);
        if (bad) {
            snprintf(msg, cap, "messages[%zu]: %s", i, bad);
            why = msg;
            goto out;
        }
        if (!is_sys && i < last) {
            turn_len[i] = text.len;    /* an empty turn adds nothing: left out */
            n_turns += text.len > 0;
            json_buf_free(&text);      /* written below, turn by turn */
        }
    }
    if (system.len > lim->max_turn_bytes) {
        snprintf(msg, cap, "the system text (system and developer messages joined) has %zu "
                 "bytes; the limit is %zu (max_turn_bytes)", system.len, lim->max_turn_bytes);
        q->status = 413;
        why = msg;
        goto out;
    }
    /* The newest turns go in, as many as the protocol takes, and none older than a turn too long
     * to send (the planner places the newest that fit, so an older one would not be placed
     * either); the rest are left out, as the planner leaves out what does not fit the budget. */
    size_t first = last, kept = 0;
    for (size_t j = last; j-- > 0;) {
        if (!turn_len[j])
            continue;
        if (kept == PROTO_MAX_HISTORY || turn_len[j] > lim->max_turn_bytes)
            break;
        kept++;
        first = j;
    }
    q->history_left_out = n_turns - kept;
    /* the question: the last message's text */
    json_buf_free(&text);
    if (content_text(field(json_array_get(messages, last), "content"), &text)) {
        why = "the last message's content is not text";
        goto out;
    }
    mpw_kv_str(&f, "question", text.p ? text.p : "", text.len);
    n++;
    if (system.len) {
        mpw_kv_str(&f, "system", system.p, system.len);
        n++;
    }
    if (kept) {
        mpw_cstr(&f, "history");
        mpw_array(&f, kept);
        n++;
        for (i = first; i < last; i++) {
            if (!turn_len[i])
                continue;
            m = json_array_get(messages, i);
            const char *r = json_string_value(json_object_get(m, "role"));
            json_buf_free(&text);
            content_text(field(m, "content"), &text);
            mpw_map(&f, 2);
            mpw_kv_cstr(&f, "role", r);
            mpw_kv_str(&f, "content", text.p ? text.p : "", text.len);
        }
    }
    /* the standard fields */
    json_t *v;
    if ((v = field(root, "model")) && !json_is_string(v)) {
        *param = "model";
        why = "model must be a string";
        goto out;
    }
    if ((v = field(root, "n")) && (!json_is_integer(v) || json_integer_value(v) != 1)) {
        *param = "n";
        why = "n: diffrag gives one choice a request (n = 1)";
        goto out;
    }
    json_t *mt = field(root, "max_completion_tokens");
    *param = mt ? "max_completion_tokens" : "max_tokens";
    if (!mt)
        mt = field(root, "max_tokens");
    if (mt) {
        if (!json_is_integer(mt)) {
            snprintf(msg, cap, "%s must be an integer", *param);
            why = msg;
            goto out;
        }
        mpw_cstr(&f, "max_tokens");
        put_json(&f, mt, 0);
        n++;
    }
    static const char *const numbers[] = { "temperature", "top_p" };
    for (size_t k = 0; k < 2; k++)
        if ((v = field(root, numbers[k]))) {
            *param = numbers[k];
            if (!json_is_number(v)) {
                snprintf(msg, cap, "%s must be a number", numbers[k]);
                why = msg;
                goto out;
            }
            mpw_kv_double(&f, numbers[k], json_number_value(v));
            n++;
        }
    if ((v = field(root, "seed"))) {
        *param = "seed";
        if (!json_is_integer(v) || json_integer_value(v) < 0) {
            why = "seed must be a non-negative integer";
            goto out;
        }
        mpw_cstr(&f, "seed");
        put_json(&f, v, 0);
        n++;
    }
    if ((v = field(root, "stop"))) {
        mpw_cstr(&f, "stop");
        put_json(&f, v, 0);
        n++;
    }
    if ((v = field(root, "stream")) && !json_is_boolean(v)) {
        *param = "stream";
        why = "stream must be a boolean";
        goto out;
    }
    q->stream = v && json_is_true(v);
    if ((v = field(root, "stream_options"))) {
        json_t *iu = json_object_get(v, "include_usage");
        *param = "stream_options";
        if (!json_is_object(v) || (iu && !json_is_boolean(iu))) {
            why = "stream_options must be an object; include_usage a boolean";
            goto out;
        }
        q->include_usage = iu && json_is_true(iu);
    }
    /* fields diffrag does not serve, refused rather than ignored where ignoring them would
     * change what the client gets back */
    if (((v = field(root, "tools")) && json_array_size(v) > 0) ||
        ((v = field(root, "functions")) && json_array_size(v) > 0)) {
        *param = "tools";
        why = "diffrag does not call tools: send no tools";
        goto out;
    }
    if ((v = field(root, "logprobs")) && json_is_true(v)) {
        *param = "logprobs";
        why = "logprobs are not served here; ask the msgpack protocol for token_signals "
              "(docs/protocol.md)";
        goto out;
    }
    if ((v = field(root, "response_format"))) {
        json_t *t = json_object_get(v, "type");
        *param = "response_format";
        if (!json_is_string(t) || strcmp(json_string_value(t), "text")) {
            why = "response_format: only {\"type\": \"text\"} is served";
            goto out;
        }
    }
    /* the documents */
    json_t *ext = field(root, "diffrag");
    int has_docs = 0;
    if (ext) {
        *param = "diffrag";
        if (!json_is_object(ext)) {
            why = "diffrag must be an object";
            goto out;
        }
        const char *k;
        json_object_foreach(ext, k, v) {
            size_t e = 0;
            while (e < sizeof ext_keys / sizeof ext_keys[0] && strcmp(k, ext_keys[e]))
                e++;
            if (e == sizeof ext_keys / sizeof ext_keys[0]) {
                snprintf(msg, cap, "diffrag.%.64s is not a field (collection, docs, ids, top_k, "
                         "max_context_tokens, order, relevance_floor, deadline_ms, unsupported, "
                         "answer_mode)", k);
                why = msg;
                goto out;
            }
            if (json_is_null(v))
                continue;
            mpw_cstr(&f, k);
            put_json(&f, v, !strcmp(k, "docs"));
            n++;
            has_docs |= !strcmp(k, "docs") || !strcmp(k, "collection");
        }
    }
    if (!has_docs) {
        if (!default_collection || !default_collection[0]) {
            *param = "diffrag";
            why = "no documents: name diffrag.collection or send diffrag.docs (this daemon has "
                  "no default_collection)";
            goto out;
        }
        mpw_kv_cstr(&f, "collection", default_collection);
        n++;
    }
    mpw_map(w, n + 4);
    mpw_kv_uint(w, "v", 1);
    mpw_kv_cstr(w, "op", "query");
    mpw_kv_uint(w, "id", 1);
    mpw_kv_bool(w, "stream", q->stream);
    mpw_raw(w, f.buf.data, f.buf.size);
    if (f.failed || w->failed)
        why = "out of memory";
out:
    mpw_destroy(&f);
    json_buf_free(&system);
    json_buf_free(&text);
    if (system.oom || text.oom)
        why = "out of memory";
    return why;
}

const char *openai_translate(const char *body, size_t len, const struct OpenAiLimits *lim,
                             struct MpWriter *w, struct OpenAiAsk *ask, char *msg, size_t cap,
                             const char **param)
{
    json_t *root = NULL;
    *param = NULL;
    memset(ask, 0, sizeof *ask);
    ask->status = 400;
    /* what the tree would cost is known before it is built: a body of empty objects would cost
     * jansson some 70 times its size */
    if (json_measure(body ? body : "", len, lim->max_json_values) > lim->max_json_values) {
        snprintf(msg, cap, "the body holds more than %zu JSON values (http_max_json_values)",
                 lim->max_json_values);
        ask->status = 413;
        return msg;
    }
    if (json_parse(body ? body : "", len, OPENAI_JSON_DEPTH, &root, msg, cap))
        return msg;
    const char *why = translate(ask, lim, root, w, msg, cap, param);
    json_decref(root);
    return why;
}

