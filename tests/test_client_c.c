/* Tests for libdiffrag (clients/c/). Without arguments (as tests/test_c_units.py runs it): the
 * JSON conversions, the reply checks on truncated and corrupted messages, and the client
 * against a fake server on loopback that answers with every kind of malformed reply (each
 * must give DIFFRAG_EPROTOCOL with a clear message and leave the client usable), never
 * answers (timeouts), is not there (connection failure), sends stale replies, and takes
 * cancels (interrupt, callback, diffrag_cancel from a callback).
 * With --endpoint EP (tests/test_clients_c.py starts diffragd with a tiny model): every call
 * against the live daemon, streaming, cancel and server errors. Both modes also run under
 * valgrind there.
 * With --endpoint EP --quote QUESTION MAX_TOKENS FILE... (tests/test_quote_interfaces.py): one
 * greedy quote-mode query over the files as inline documents (each named by its path), blocking
 * and streamed, checked (each quote is its document's bytes at its offsets, the quotes make the
 * answer, the cited flags follow them), a free query and a bad answer_mode, with the decoded
 * quotes printed one a line ("quote MARKER DOC_ID CHUNK START END HEX-TEXT") for the caller to
 * compare with the daemon's own reply. */
#include <inttypes.h>
#include <math.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "clients/c/client_internal.h"
#include "clients/c/diffrag.h"
#include "clients/c/json.h"
#include "tests/check.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    nanosleep(&ts, NULL);
}

/* ---- JSON ---- */

static char *roundtrip(const char *json, int *status, char *err, size_t errlen)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    char *out = NULL;
    *status = json_to_msgpack(json, strlen(json), &pk, 8, err, errlen);
    if (*status == 0) {
        msgpack_unpacked up;
        msgpack_unpacked_init(&up);
        size_t off = 0;
        if (msgpack_unpack_next(&up, sb.data, sb.size, &off) == MSGPACK_UNPACK_SUCCESS)
            out = json_from_msgpack(&up.data);
        msgpack_unpacked_destroy(&up);
    }
    msgpack_sbuffer_destroy(&sb);
    return out;
}

static void test_json(void)
{
    static const struct { const char *in, *out; } ok[] = {
        { "{\"a\": 1, \"b\": [true, false, null], \"c\": \"x\"}",
          "{\"a\": 1, \"b\": [true, false, null], \"c\": \"x\"}" },
        { " [ ] ", "[]" },
        { "{}", "{}" },
        { "-9223372036854775808", "-9223372036854775808" },
        { "9223372036854775807", "9223372036854775807" },
        { "-0", "0" },
        { "\"a\\u0000b\"", "\"a\\u0000b\"" },
        { "0.1", "0.1" },
        { "1e300", "1e+300" },
        { "-2.5E-3", "-0.0025" },
        { "\"tab\\t nl\\n quote\\\" slash\\/ \\u00e9 \\ud83d\\ude00\"",
          "\"tab\\t nl\\n quote\\\" slash/ \xc3\xa9 \xf0\x9f\x98\x80\"" },
        { "\"\\u0001\\u007f\"", "\"\\u0001\\u007f\"" },
        { "[[[[1]]]]", "[[[[1]]]]" },
        { "{\"k\": {\"n\": [1, {\"m\": \"\"}]}}", "{\"k\": {\"n\": [1, {\"m\": \"\"}]}}" },
    };
    char err[200];
    int st;
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        char *got = roundtrip(ok[i].in, &st, err, sizeof err);
        CHECK(st == 0 && got && strcmp(got, ok[i].out) == 0, "json %s -> %s (%s)", ok[i].in,
              got ? got : "(null)", err);
        free(got);
    }
    static const char *const bad[] = {
        "", "{", "[1,]", "[1 2]", "{\"a\" 1}", "{1: 2}", "\"abc", "\"\\x\"", "\"\\ud800\"",
        "\"\\udc00x\"", "01", "1.", "-", "tru", "nul", "[1] x", "\"a\x01\"", "\"\xff\"",
        "[[[[[[[[[[1]]]]]]]]]]", "{\"a\":1,}", "1e", "\"\\u12\"",
        /* integers beyond the signed 64-bit range, reals beyond a double, a key twice */
        "18446744073709551615", "-9223372036854775809", "1e400", "{\"a\": 1, \"a\": 2}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *got = roundtrip(bad[i], &st, err, sizeof err);
        CHECK(st == -1 && !got && strstr(err, "JSON at byte"), "bad json \"%s\" gave %d (%s)",
              bad[i], st, err);
        free(got);
    }
    /* the message says where: the ninth of ten '[' (max_depth 8 allows eight), the 0xff byte */
    char *deep = roundtrip("[[[[[[[[[[1]]]]]]]]]]", &st, err, sizeof err);
    CHECK(st == -1 && !deep && strstr(err, "at byte 8: nested deeper than 8"), "depth: %s", err);
    deep = roundtrip("[[[[[[[[1]]]]]]]]", &st, err, sizeof err);
    CHECK(st == 0 && deep && strcmp(deep, "[[[[[[[[1]]]]]]]]") == 0, "eight levels: %s", err);
    free(deep);
    CHECK(roundtrip("  \"ab\xff\"", &st, err, sizeof err) == NULL && st == -1 &&
          strstr(err, "at byte 5: ") && strstr(err, "0xff"), "bad byte: %s", err);
    /* output escaping: control characters, invalid UTF-8 becomes U+FFFD, valid stays */
    struct JsonBuf b = { 0 };
    json_buf_string(&b, "a\x02\xc3\xa9\xff\xe2\x82", 7);
    CHECK(b.p && strcmp(b.p, "\"a\\u0002\xc3\xa9\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"") == 0,
          "escaped: %s", b.p);
    json_buf_free(&b);
    json_buf_double(&b, NAN);
    json_buf_double(&b, 3.0);
    CHECK(b.p && strcmp(b.p, "null3") == 0, "doubles: %s", b.p);
    json_buf_free(&b);
}

/* Every truncation and thousands of random corruptions of a well-formed reply: the checks
 * before msgpack-c must refuse or accept each without a crash, a leak or an overread (this
 * runs under valgrind and AddressSanitizer too), and what they accept must convert to JSON. */
static void test_reply_parse_corruptions(void)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 5);
    msgpack_pack_str_with_body(&pk, "id", 2);
    msgpack_pack_str_with_body(&pk, "#1", 2);
    msgpack_pack_str_with_body(&pk, "ok", 2);
    msgpack_pack_true(&pk);
    msgpack_pack_str_with_body(&pk, "answer", 6);
    msgpack_pack_str_with_body(&pk, "It is long.", 11);
    msgpack_pack_str_with_body(&pk, "citations", 9);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 2);
    msgpack_pack_str_with_body(&pk, "offsets", 7);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_uint32(&pk, 70000);
    msgpack_pack_int64(&pk, -5000000000LL);
    msgpack_pack_str_with_body(&pk, "score", 5);
    msgpack_pack_double(&pk, 1.25);
    msgpack_pack_str_with_body(&pk, "usage", 5);
    msgpack_pack_map(&pk, 1);
    msgpack_pack_bin_with_body(&pk, "k", 1);
    msgpack_pack_float(&pk, 2.5f);
    char err[200];
    int accepted = 0, refused = 0;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int trial = -(int)sb.size; trial < 20000; trial++) {
        size_t len = trial < 0 ? (size_t)(-trial) - 1 : sb.size; /* truncations first */
        char *data = malloc(sb.size);
        memcpy(data, sb.data, sb.size);
        for (int k = 0; trial >= 0 && k < 1 + trial % 4; k++) {
            rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
            data[rng % sb.size] = (char)(rng >> 32);
        }
        struct Reply *r = NULL;
        int rc = reply_parse(data, len, &r, err, sizeof err);
        if (rc == 0) {
            char *j = json_from_msgpack(r->map);
            CHECK(j && j[0] == '{', "json of an accepted reply");
            free(j);
            reply_free(&r);
            accepted++;
        } else {
            CHECK(rc == -1 && !r && err[0], "refused with a reason");
            refused++;
        }
    }
    printf("corrupted replies: %d accepted, %d refused\n", accepted, refused);
    CHECK(accepted > 0 && refused > 0, "both outcomes seen");
    msgpack_sbuffer_destroy(&sb);
}

/* ---- a fake server ---- */

enum FakeMode {
    FAKE_OK,          /* well-formed replies */
    FAKE_SILENT,      /* never answers */
    FAKE_RAW,         /* answers with raw_frames as given */
    FAKE_STALE_FIRST, /* a reply for another id, then the right one */
    FAKE_TWO_DELTAS,  /* a query gets two deltas, then silence */
    FAKE_CANCELLABLE, /* a query gets deltas until a cancel; ack then final */
    FAKE_CANCEL_FINAL_FIRST, /* the same, the final before the ack */
    FAKE_NIL_ID_ERROR,       /* an error reply with a nil id */
    FAKE_GROUNDING,          /* a query reply with grounding figures */
    FAKE_QUERY_BAD,          /* a query reply given by raw_frames with the request's id */
};

struct Fake {
    void *ctx, *sock;
    char endpoint[64];
    pthread_t thread;
    pthread_mutex_t mu;
    enum FakeMode mode;
    /* FAKE_RAW / FAKE_QUERY_BAD: frames to send ("%ID%" in a frame is not substituted:
     * FAKE_QUERY_BAD builds the id itself, raw replaces the body) */
    const char *raw[3];
    size_t raw_len[3];
    int n_raw;
    int bad_kind;
    atomic_int stop;
    atomic_int requests;
    atomic_int cancels;
    char qid[64];
    char ident[256];
    size_t ident_len;
};

static struct Fake fake;

static void send_frames(struct Fake *f, const char *ident, size_t ident_len, const void *const *frames,
                        const size_t *lens, int n)
{
    zmq_send(f->sock, ident, ident_len, ZMQ_SNDMORE);
    for (int i = 0; i < n; i++)
        zmq_send(f->sock, frames[i], lens[i], i + 1 < n ? ZMQ_SNDMORE : 0);
}

static void send_sb(struct Fake *f, const char *ident, size_t ident_len, msgpack_sbuffer *sb)
{
    const void *fr[1] = { sb->data };
    size_t len[1] = { sb->size };
    send_frames(f, ident, ident_len, fr, len, 1);
}

static void pk_str(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str_with_body(pk, s, strlen(s));
}

static void pk_kv_str(msgpack_packer *pk, const char *k, const char *v)
{
    pk_str(pk, k);
    pk_str(pk, v);
}

/* A map of n fields starting with "id": id (nil when id is NULL). */
static void begin_reply(msgpack_sbuffer *sb, msgpack_packer *pk, const char *id, uint32_t n)
{
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(pk, n);
    pk_str(pk, "id");
    if (id)
        pk_str(pk, id);
    else
        msgpack_pack_nil(pk);
}

static void send_delta(struct Fake *f, const char *id, const char *text)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    begin_reply(&sb, &pk, id, 2);
    pk_kv_str(&pk, "delta", text);
    send_sb(f, f->ident, f->ident_len, &sb);
    msgpack_sbuffer_destroy(&sb);
}

static void send_answer(struct Fake *f, const char *id, const char *answer, const char *finish,
                        int grounding)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    begin_reply(&sb, &pk, id, 8 + (grounding != 0) * 3);
    pk_str(&pk, "ok"); msgpack_pack_true(&pk);
    pk_kv_str(&pk, "answer", answer);
    pk_kv_str(&pk, "finish_reason", finish);
    pk_str(&pk, "citations");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 7 + (grounding != 0) * 2);
    pk_kv_str(&pk, "doc_id", "rhine");
    pk_str(&pk, "chunk"); msgpack_pack_int(&pk, 0);
    if (grounding) {   /* where the chunk is: its heading path and pages */
        pk_kv_str(&pk, "heading", "Rivers \xe2\x80\xba Rhine");
        pk_str(&pk, "page"); msgpack_pack_array(&pk, 2); msgpack_pack_int(&pk, 3); msgpack_pack_int(&pk, 4);
    }
    pk_str(&pk, "score"); msgpack_pack_double(&pk, 2.5);
    pk_str(&pk, "offsets"); msgpack_pack_array(&pk, 2); msgpack_pack_int(&pk, 3); msgpack_pack_int(&pk, 40);
    pk_str(&pk, "marker"); msgpack_pack_int(&pk, 1);
    pk_str(&pk, "cited"); msgpack_pack_true(&pk);
    pk_str(&pk, "truncated"); msgpack_pack_false(&pk);
    pk_str(&pk, "usage");
    msgpack_pack_map(&pk, 3);
    pk_str(&pk, "prompt_tokens"); msgpack_pack_int(&pk, 120);
    pk_str(&pk, "context_tokens"); msgpack_pack_int(&pk, 80);
    pk_str(&pk, "completion_tokens"); msgpack_pack_int(&pk, 2);
    pk_str(&pk, "timings");
    msgpack_pack_map(&pk, 2);
    pk_str(&pk, "ttft_ms"); msgpack_pack_double(&pk, 12.5);
    pk_str(&pk, "total_ms"); msgpack_pack_double(&pk, 30.25);
    pk_str(&pk, "future_field"); msgpack_pack_int(&pk, 7); /* unknown keys are ignored */
    if (grounding) {   /* and a quote-mode answer's fields */
        pk_kv_str(&pk, "answer_mode", "quote");
        pk_str(&pk, "quotes");
        msgpack_pack_array(&pk, 2);
        for (int i = 0; i < 2; i++) {
            msgpack_pack_map(&pk, 5);
            pk_str(&pk, "marker"); msgpack_pack_int(&pk, 1);
            pk_kv_str(&pk, "doc_id", "rhine");
            pk_str(&pk, "chunk"); msgpack_pack_int(&pk, 0);
            pk_str(&pk, "offsets"); msgpack_pack_array(&pk, 2);
            msgpack_pack_int(&pk, i ? 13 : 3); msgpack_pack_int(&pk, i ? 25 : 12);
            pk_kv_str(&pk, "text", i ? " 1,230 km lo" : "It is a\nb");
        }
        pk_str(&pk, "grounding");
        msgpack_pack_map(&pk, 14);
        pk_str(&pk, "quote_removed"); msgpack_pack_double(&pk, 0.125);
        pk_str(&pk, "score"); msgpack_pack_double(&pk, 0.75);
        pk_str(&pk, "flagged"); msgpack_pack_true(&pk);
        pk_str(&pk, "abstained"); msgpack_pack_false(&pk);
        pk_str(&pk, "lookback_ratio"); msgpack_pack_double(&pk, 0.5);
        pk_str(&pk, "unsupported_token_ratio"); msgpack_pack_double(&pk, 0.25);
        pk_str(&pk, "mean_logprob"); msgpack_pack_double(&pk, -1.5);
        pk_str(&pk, "min_logprob"); msgpack_pack_double(&pk, -6.0);
        pk_str(&pk, "self_check"); msgpack_pack_double(&pk, 0.375);
        pk_str(&pk, "context_reliance"); msgpack_pack_double(&pk, 1.5);
        pk_str(&pk, "hidden_probe"); msgpack_pack_nil(&pk);
        pk_str(&pk, "answer_tokens"); msgpack_pack_int(&pk, 8);
        pk_str(&pk, "flagged_tokens"); msgpack_pack_int(&pk, 2);
        pk_kv_str(&pk, "detector", "test-detector");
    }
    send_sb(f, f->ident, f->ident_len, &sb);
    msgpack_sbuffer_destroy(&sb);
}

static void send_pong(struct Fake *f, const char *id)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    begin_reply(&sb, &pk, id, 5);
    pk_str(&pk, "ok"); msgpack_pack_true(&pk);
    pk_str(&pk, "pong"); msgpack_pack_true(&pk);
    pk_kv_str(&pk, "version", "0.1.0");
    pk_kv_str(&pk, "model", "fake");
    send_sb(f, f->ident, f->ident_len, &sb);
    msgpack_sbuffer_destroy(&sb);
}

static void send_cancel_ack(struct Fake *f, const char *id)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    begin_reply(&sb, &pk, id, 4);
    pk_str(&pk, "ok"); msgpack_pack_true(&pk);
    pk_str(&pk, "found"); msgpack_pack_true(&pk);
    pk_kv_str(&pk, "state", "running");
    send_sb(f, f->ident, f->ident_len, &sb);
    msgpack_sbuffer_destroy(&sb);
}

/* Malformed query replies that carry the right id: the client must name the field. */
static void send_bad_query(struct Fake *f, const char *id, int kind)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    if (kind == 0) { /* answer is an integer */
        begin_reply(&sb, &pk, id, 3);
        pk_str(&pk, "ok"); msgpack_pack_true(&pk);
        pk_str(&pk, "answer"); msgpack_pack_int(&pk, 5);
    } else if (kind == 1) { /* offsets of one element */
        begin_reply(&sb, &pk, id, 6);
        pk_str(&pk, "ok"); msgpack_pack_true(&pk);
        pk_kv_str(&pk, "answer", "x");
        pk_kv_str(&pk, "finish_reason", "stop");
        pk_str(&pk, "citations");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_map(&pk, 4);
        pk_kv_str(&pk, "doc_id", "d");
        pk_str(&pk, "chunk"); msgpack_pack_int(&pk, 0);
        pk_str(&pk, "score"); msgpack_pack_double(&pk, 1);
        pk_str(&pk, "offsets"); msgpack_pack_array(&pk, 1); msgpack_pack_int(&pk, 3);
        pk_str(&pk, "usage"); msgpack_pack_map(&pk, 0);
    } else if (kind == 2) { /* an error reply whose error is a string */
        begin_reply(&sb, &pk, id, 3);
        pk_str(&pk, "ok"); msgpack_pack_false(&pk);
        pk_kv_str(&pk, "error", "bad");
    } else if (kind == 3) { /* a delta that is not a string */
        begin_reply(&sb, &pk, id, 2);
        pk_str(&pk, "delta"); msgpack_pack_int(&pk, 1);
    } else if (kind == 6) { /* a quote whose offsets are one number */
        begin_reply(&sb, &pk, id, 7);
        pk_str(&pk, "ok"); msgpack_pack_true(&pk);
        pk_kv_str(&pk, "answer", "x");
        pk_kv_str(&pk, "finish_reason", "stop");
        pk_str(&pk, "citations"); msgpack_pack_array(&pk, 0);
        pk_str(&pk, "usage"); msgpack_pack_map(&pk, 2);
        pk_str(&pk, "prompt_tokens"); msgpack_pack_int(&pk, 1);
        pk_str(&pk, "completion_tokens"); msgpack_pack_int(&pk, 1);
        pk_str(&pk, "quotes"); msgpack_pack_array(&pk, 1);
        msgpack_pack_map(&pk, 5);
        pk_str(&pk, "marker"); msgpack_pack_int(&pk, 1);
        pk_kv_str(&pk, "doc_id", "d");
        pk_str(&pk, "chunk"); msgpack_pack_int(&pk, 0);
        pk_str(&pk, "offsets"); msgpack_pack_int(&pk, 3);
        pk_kv_str(&pk, "text", "x");
    } else if (kind == 7) { /* a citation whose pages run backwards */
        begin_reply(&sb, &pk, id, 6);
        pk_str(&pk, "ok"); msgpack_pack_true(&pk);
        pk_kv_str(&pk, "answer", "x");
        pk_kv_str(&pk, "finish_reason", "stop");
        pk_str(&pk, "usage"); msgpack_pack_map(&pk, 2);
        pk_str(&pk, "prompt_tokens"); msgpack_pack_int(&pk, 1);
        pk_str(&pk, "completion_tokens"); msgpack_pack_int(&pk, 1);
        pk_str(&pk, "citations"); msgpack_pack_array(&pk, 1);
        msgpack_pack_map(&pk, 5);
        pk_kv_str(&pk, "doc_id", "d");
        pk_str(&pk, "chunk"); msgpack_pack_int(&pk, 0);
        pk_str(&pk, "score"); msgpack_pack_double(&pk, 1);
        pk_str(&pk, "offsets"); msgpack_pack_array(&pk, 2); msgpack_pack_int(&pk, 0); msgpack_pack_int(&pk, 1);
        pk_str(&pk, "page"); msgpack_pack_array(&pk, 2); msgpack_pack_int(&pk, 2); msgpack_pack_int(&pk, 1);
    } else if (kind == 5) { /* a well-formed delta (for a request that does not stream) */
        begin_reply(&sb, &pk, id, 2);
        pk_kv_str(&pk, "delta", "x");
    } else { /* usage missing */
        begin_reply(&sb, &pk, id, 5);
        pk_str(&pk, "ok"); msgpack_pack_true(&pk);
        pk_kv_str(&pk, "answer", "x");
        pk_kv_str(&pk, "finish_reason", "stop");
        pk_str(&pk, "citations"); msgpack_pack_array(&pk, 0);
    }
    send_sb(f, f->ident, f->ident_len, &sb);
    msgpack_sbuffer_destroy(&sb);
}

static int get_str(const msgpack_object *map, const char *key, char *out, size_t len)
{
    out[0] = 0;
    for (uint32_t i = 0; map->type == MSGPACK_OBJECT_MAP && i < map->via.map.size; i++) {
        const msgpack_object_kv *kv = &map->via.map.ptr[i];
        if (kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == strlen(key) &&
            !memcmp(kv->key.via.str.ptr, key, kv->key.via.str.size) &&
            kv->val.type == MSGPACK_OBJECT_STR && kv->val.via.str.size < len) {
            memcpy(out, kv->val.via.str.ptr, kv->val.via.str.size);
            out[kv->val.via.str.size] = 0;
            return 1;
        }
    }
    return 0;
}

static void fake_handle(struct Fake *f, const char *body, size_t len)
{
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    char id[64], op[16], target[64];
    if (msgpack_unpack_next(&up, body, len, &off) != MSGPACK_UNPACK_SUCCESS) {
        msgpack_unpacked_destroy(&up);
        return;
    }
    get_str(&up.data, "id", id, sizeof id);
    get_str(&up.data, "op", op, sizeof op);
    get_str(&up.data, "target", target, sizeof target);
    msgpack_unpacked_destroy(&up);
    atomic_fetch_add(&f->requests, 1);
    pthread_mutex_lock(&f->mu);
    enum FakeMode mode = f->mode;
    pthread_mutex_unlock(&f->mu);
    int is_query = strcmp(op, "query") == 0;
    if (strcmp(op, "cancel") == 0) {
        atomic_fetch_add(&f->cancels, 1);
        if (mode == FAKE_CANCEL_FINAL_FIRST) {
            send_answer(f, f->qid, "Hello", "cancelled", 0);
            send_cancel_ack(f, id);
        } else {
            send_cancel_ack(f, id);
            send_answer(f, f->qid, "Hello", "cancelled", 0);
        }
        return;
    }
    switch (mode) {
    case FAKE_SILENT:
        break;
    case FAKE_RAW: {
        const void *fr[3] = { f->raw[0], f->raw[1], f->raw[2] };
        send_frames(f, f->ident, f->ident_len, fr, f->raw_len, f->n_raw);
        break;
    }
    case FAKE_STALE_FIRST:
        send_pong(f, "#999999");
        send_pong(f, id);
        break;
    case FAKE_NIL_ID_ERROR: {
        msgpack_sbuffer sb;
        msgpack_packer pk;
        begin_reply(&sb, &pk, NULL, 3);
        pk_str(&pk, "ok"); msgpack_pack_false(&pk);
        pk_str(&pk, "error");
        msgpack_pack_map(&pk, 2);
        pk_kv_str(&pk, "code", "too_large");
        pk_kv_str(&pk, "message", "message of 99 bytes over max_message_bytes");
        send_sb(f, f->ident, f->ident_len, &sb);
        msgpack_sbuffer_destroy(&sb);
        break;
    }
    case FAKE_QUERY_BAD:
        send_bad_query(f, id, f->bad_kind);
        break;
    case FAKE_TWO_DELTAS:
        if (is_query) {
            send_delta(f, id, "Hel");
            send_delta(f, id, "lo");
        } else
            send_pong(f, id);
        break;
    case FAKE_CANCELLABLE:
    case FAKE_CANCEL_FINAL_FIRST:
        if (is_query) {
            snprintf(f->qid, sizeof f->qid, "%s", id);
            send_delta(f, id, "Hel");
            send_delta(f, id, "lo");
        } else
            send_pong(f, id);
        break;
    case FAKE_GROUNDING:
    case FAKE_OK:
    default:
        if (is_query)
            send_answer(f, id, "It is 1,230 km long [1].", "stop", mode == FAKE_GROUNDING);
        else
            send_pong(f, id);
        break;
    }
}

static void *fake_main(void *arg)
{
    struct Fake *f = arg;
    while (!atomic_load(&f->stop)) {
        zmq_pollitem_t it = { f->sock, 0, ZMQ_POLLIN, 0 };
        if (zmq_poll(&it, 1, 20) <= 0)
            continue;
        zmq_msg_t frames[2];
        int n = 0, more = 1;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, f->sock, 0) < 0) {
                zmq_msg_close(&m);
                break;
            }
            more = zmq_msg_more(&m);
            if (n < 2)
                frames[n++] = m;
            else
                zmq_msg_close(&m);
        }
        if (n == 2) {
            f->ident_len = zmq_msg_size(&frames[0]) < sizeof f->ident ? zmq_msg_size(&frames[0]) : 0;
            memcpy(f->ident, zmq_msg_data(&frames[0]), f->ident_len);
            fake_handle(f, zmq_msg_data(&frames[1]), zmq_msg_size(&frames[1]));
        }
        for (int i = 0; i < n; i++)
            zmq_msg_close(&frames[i]);
    }
    return NULL;
}

static int fake_start(struct Fake *f)
{
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    f->ctx = zmq_ctx_new();
    f->sock = zmq_socket(f->ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_bind(f->sock, "tcp://127.0.0.1:*"))
        return -1;
    size_t len = sizeof f->endpoint;
    zmq_getsockopt(f->sock, ZMQ_LAST_ENDPOINT, f->endpoint, &len);
    return pthread_create(&f->thread, NULL, fake_main, f);
}

static void fake_stop(struct Fake *f)
{
    atomic_store(&f->stop, 1);
    pthread_join(f->thread, NULL);
    zmq_close(f->sock);
    zmq_ctx_term(f->ctx);
    pthread_mutex_destroy(&f->mu);
}

static void fake_mode(enum FakeMode m)
{
    pthread_mutex_lock(&fake.mu);
    fake.mode = m;
    pthread_mutex_unlock(&fake.mu);
}

static void fake_raw(int n, const char *f0, size_t l0, const char *f1, size_t l1)
{
    pthread_mutex_lock(&fake.mu);
    fake.mode = FAKE_RAW;
    fake.n_raw = n;
    fake.raw[0] = f0;
    fake.raw_len[0] = l0;
    fake.raw[1] = f1;
    fake.raw_len[1] = l1;
    pthread_mutex_unlock(&fake.mu);
}

static DiffragClient *client_for(const char *endpoint, int connect_ms, int timeout_ms)
{
    DiffragOptions o;
    diffrag_options_init(&o);
    o.connect_timeout_ms = connect_ms;
    o.timeout_ms = timeout_ms;
    o.query_timeout_ms = timeout_ms;
    DiffragClient *c = NULL;
    char err[256];
    int rc = diffrag_new(&c, endpoint, &o, err, sizeof err);
    CHECK(rc == DIFFRAG_OK && c, "diffrag_new(%s): %s", endpoint, err);
    return c;
}

static int ping_ok(DiffragClient *c)
{
    DiffragPong *p = NULL;
    int rc = diffrag_ping(c, &p);
    int ok = rc == DIFFRAG_OK && p && p->model && strcmp(p->model, "fake") == 0;
    diffrag_pong_free(&p);
    return ok;
}

struct DeltaLog {
    char text[256];
    int n;
    int stop_after;         /* return non-zero after this many deltas (0: never) */
    DiffragClient *cancel_client; /* call diffrag_cancel from the callback */
    const char *cancel_target;
    int cancel_rc;
    char cancel_state[16];
};

static int log_delta(void *user, const char *text, size_t len)
{
    struct DeltaLog *l = user;
    CHECK(text[len] == 0 && strlen(text) == len, "a delta is NUL-terminated text");
    size_t have = strlen(l->text);
    if (have + len < sizeof l->text) {
        memcpy(l->text + have, text, len);
        l->text[have + len] = 0;
    }
    l->n++;
    if (l->cancel_client && l->n == 2)
        l->cancel_rc = diffrag_cancel(l->cancel_client, l->cancel_target, l->cancel_state,
                                      sizeof l->cancel_state);
    return l->stop_after && l->n >= l->stop_after;
}

struct Interrupter {
    DiffragClient *c;
    int after_ms;
};

static void *interrupt_later(void *arg)
{
    struct Interrupter *it = arg;
    sleep_ms(it->after_ms);
    diffrag_interrupt(it->c);
    return NULL;
}

static void test_fake_server(void)
{
    CHECK(fake_start(&fake) == 0, "fake server");
    printf("fake server at %s\n", fake.endpoint);
    DiffragClient *c = client_for(fake.endpoint, 1000, 400);
    if (!c)
        return;
    fake_mode(FAKE_OK);
    CHECK(ping_ok(c), "ping the fake: %s", diffrag_last_error(c));
    CHECK(*diffrag_last_error(c) == 0 && *diffrag_last_error_code(c) == 0, "no error after ok");

    /* every kind of malformed message: EPROTOCOL naming the problem, then a good ping */
    static const unsigned char not_mp[] = { 0xc1, 'x' };
    static const unsigned char array[] = { 0x91, 0x01 };
    static const unsigned char trailing[] = { 0x81, 0xa2, 'i', 'd', 0xc0, 0x00 };
    static const unsigned char truncated[] = { 0x83, 0xa2, 'i', 'd' };
    static const unsigned char huge[] = { 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01 };
    static const unsigned char huge_str[] = { 0xdb, 0x7f, 0xff, 0xff, 0xff, 'a' };
    static const unsigned char no_id[] = { 0x81, 0xa2, 'o', 'k', 0xc3 };
    static const unsigned char ok_not_bool[] = { 0x82, 0xa2, 'i', 'd', 0xc0, 0xa2, 'o', 'k', 0x01 };
    static const unsigned char int_key[] = { 0x82, 0xa2, 'i', 'd', 0xc0, 0x01, 0xc3 };
    static const unsigned char neither[] = { 0x81, 0xa2, 'i', 'd', 0xc0 };
    unsigned char deep[200];
    for (int i = 0; i < 199; i++)
        deep[i] = 0x91; /* arrays of one element, 199 deep */
    deep[199] = 0x01;
    const struct { const char *name; const void *p; size_t n; const char *expect; } bad[] = {
        { "not msgpack", not_mp, sizeof not_mp, "not msgpack" },
        { "an array", array, sizeof array, "not a msgpack map" },
        { "trailing bytes", trailing, sizeof trailing, "after the msgpack object" },
        { "truncated", truncated, sizeof truncated, "claims" },
        { "a huge array claim", huge, sizeof huge, "claims 4294967295" },
        { "a huge string claim", huge_str, sizeof huge_str, "truncated" },
        { "no id", no_id, sizeof no_id, "no \"id\"" },
        { "ok not a boolean", ok_not_bool, sizeof ok_not_bool, "\"ok\" is not a boolean" },
        { "an integer key", int_key, sizeof int_key, "not a string" },
        { "neither ok nor delta", neither, sizeof neither, "neither" },
        { "deep nesting", deep, sizeof deep, "nested deeper" },
        { "an empty frame", "", 0, "empty reply frame" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fake_raw(1, bad[i].p, bad[i].n, NULL, 0);
        DiffragPong *p = NULL;
        int rc = diffrag_ping(c, &p);
        const char *msg = diffrag_last_error(c);
        CHECK(rc == DIFFRAG_EPROTOCOL && !p && strstr(msg, "malformed reply") &&
              strstr(msg, bad[i].expect) && !strcmp(diffrag_last_error_code(c), "protocol"),
              "%s: rc=%d msg=%s", bad[i].name, rc, msg);
        printf("malformed (%s): %s\n", bad[i].name, msg);
        fake_mode(FAKE_OK);
        CHECK(ping_ok(c), "usable after %s: %s", bad[i].name, diffrag_last_error(c));
    }
    fake_raw(2, "\x81\xa2id\xc0", 5, "\x80", 1);
    int rc = diffrag_ping(c, &(DiffragPong *){ NULL });
    CHECK(rc == DIFFRAG_EPROTOCOL && strstr(diffrag_last_error(c), "2 frames"), "two frames: %s",
          diffrag_last_error(c));
    fake_mode(FAKE_OK);
    CHECK(ping_ok(c), "usable after two frames");

    /* malformed query replies with the right id */
    DiffragDoc doc = { .id = "rhine", .text = "The Rhine is 1,230 km long." };
    DiffragQuery q = { .question = "How long is the Rhine?", .docs = &doc, .n_docs = 1 };
    DiffragAnswer *a = NULL;
    static const char *const bad_query[] = { "answer: expected a string, got an integer",
        "citations[0].offsets: expected [start, end]", "an error reply needs",
        "neither \"ok\" nor a string \"delta\"", "usage: missing", NULL,
        "quotes[0].offsets: expected an array",
        "citations[0].page: expected [first, last] with 1 <= first <= last" };
    for (int k = 0; k < 8; k++) {
        if (!bad_query[k])
            continue;
        pthread_mutex_lock(&fake.mu);
        fake.mode = FAKE_QUERY_BAD;
        fake.bad_kind = k;
        pthread_mutex_unlock(&fake.mu);
        rc = diffrag_query(c, &q, NULL, NULL, &a);
        CHECK(rc == DIFFRAG_EPROTOCOL && !a && strstr(diffrag_last_error(c), bad_query[k]),
              "bad query reply %d: rc=%d %s", k, rc, diffrag_last_error(c));
        printf("malformed query reply %d: %s\n", k, diffrag_last_error(c));
    }
    /* a delta answering a request that does not stream */
    pthread_mutex_lock(&fake.mu);
    fake.mode = FAKE_QUERY_BAD;
    fake.bad_kind = 5;
    pthread_mutex_unlock(&fake.mu);
    DiffragStats *st = NULL;
    rc = diffrag_stats(c, NULL, &st);
    CHECK(rc == DIFFRAG_EPROTOCOL && !st && strstr(diffrag_last_error(c), "does not stream"),
          "unexpected delta: %d %s", rc, diffrag_last_error(c));

    /* a well-formed answer with grounding; unknown fields ignored */
    fake_mode(FAKE_GROUNDING);
    rc = diffrag_query(c, &q, NULL, NULL, &a);
    CHECK(rc == DIFFRAG_OK && a, "grounded answer: %s", diffrag_last_error(c));
    if (a) {
        CHECK(strcmp(a->answer, "It is 1,230 km long [1].") == 0 && a->answer_len == 24 &&
              strcmp(a->finish_reason, "stop") == 0, "answer %s", a->answer);
        CHECK(a->n_citations == 1 && !strcmp(a->citations[0].doc_id, "rhine") &&
              a->citations[0].start == 3 && a->citations[0].end == 40 && a->citations[0].cited &&
              !a->citations[0].truncated && a->citations[0].score == 2.5, "citation");
        CHECK(a->citations[0].heading && a->citations[0].heading_len == 16 &&
              !strcmp(a->citations[0].heading, "Rivers \xe2\x80\xba Rhine") &&
              a->citations[0].page_first == 3 && a->citations[0].page_last == 4,
              "citation heading %s, pages %lld-%lld",
              a->citations[0].heading ? a->citations[0].heading : "(null)",
              (long long)a->citations[0].page_first, (long long)a->citations[0].page_last);
        CHECK(a->prompt_tokens == 120 && a->context_tokens == 80 && a->completion_tokens == 2 &&
              a->ttft_ms == 12.5 && a->total_ms == 30.25, "usage and timings");
        CHECK(a->has_grounding && a->grounding.flagged && !a->grounding.abstained &&
              a->grounding.score == 0.75 && a->grounding.min_logprob == -6.0 &&
              a->grounding.self_check == 0.375 && a->grounding.context_reliance == 1.5 &&
              isnan(a->grounding.hidden_probe) && a->grounding.answer_tokens == 8 && a->grounding.flagged_tokens == 2 &&
              a->grounding.detector && !strcmp(a->grounding.detector, "test-detector"), "grounding");
        CHECK(a->json && strstr(a->json, "\"future_field\": 7") && strstr(a->json, "\"grounding\": {"),
              "json %s", a->json);
        CHECK(a->answer_mode && !strcmp(a->answer_mode, "quote") && a->n_quotes == 2 &&
              a->quotes[0].marker == 1 && !strcmp(a->quotes[0].doc_id, "rhine") &&
              a->quotes[0].chunk == 0 && a->quotes[0].start == 3 && a->quotes[0].end == 12 &&
              a->quotes[0].text_len == 9 && !strcmp(a->quotes[0].text, "It is a\nb") &&
              a->quotes[1].start == 13 && a->quotes[1].end == 25 &&
              !strcmp(a->quotes[1].text, " 1,230 km lo") && a->grounding.quote_removed == 0.125,
              "quotes: mode %s, %zu quotes", a->answer_mode ? a->answer_mode : "-", a->n_quotes);
        diffrag_answer_free(&a);
        CHECK(a == NULL, "free clears the pointer");
    }
    fake_mode(FAKE_OK);
    rc = diffrag_query(c, &q, NULL, NULL, &a);
    CHECK(rc == DIFFRAG_OK && a && !a->has_grounding, "answer without grounding");
    /* a reply without answer_mode (a daemon before quote mode): free, no quotes */
    CHECK(a && a->answer_mode && !strcmp(a->answer_mode, "free") && !a->n_quotes && !a->quotes,
          "free by default");
    /* nor heading nor page (a daemon before them): NULL, no pages */
    CHECK(a && a->n_citations == 1 && !a->citations[0].heading && !a->citations[0].heading_len &&
          !a->citations[0].page_first && !a->citations[0].page_last, "no heading, no pages");
    diffrag_answer_free(&a);

    /* stale replies are dropped; a nil-id error is this call's */
    fake_mode(FAKE_STALE_FIRST);
    CHECK(ping_ok(c), "stale reply skipped: %s", diffrag_last_error(c));
    fake_mode(FAKE_NIL_ID_ERROR);
    rc = diffrag_ping(c, &(DiffragPong *){ NULL });
    CHECK(rc == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(c), "too_large") &&
          strstr(diffrag_last_error(c), "over max_message_bytes"), "nil id error: %d %s", rc,
          diffrag_last_error(c));

    /* a daemon that does not answer: ETIMEOUT on time, for a plain call and mid-stream */
    fake_mode(FAKE_SILENT);
    double t0 = now_ms();
    rc = diffrag_ping(c, &(DiffragPong *){ NULL });
    double waited = now_ms() - t0;
    printf("timeout: ping waited %.0f ms for a 400 ms timeout\n", waited);
    CHECK(rc == DIFFRAG_ETIMEOUT && !strcmp(diffrag_last_error_code(c), "timeout") &&
          waited >= 399 && waited < 1500, "silent ping: rc=%d after %.0f ms", rc, waited);
    fake_mode(FAKE_TWO_DELTAS);
    struct DeltaLog log = { .stop_after = 0 };
    q.timeout_ms = 300;
    t0 = now_ms();
    rc = diffrag_query(c, &q, log_delta, &log, &a);
    waited = now_ms() - t0;
    printf("timeout: stream stalled after %d deltas, gave up after %.0f ms (300 ms timeout)\n",
           log.n, waited);
    CHECK(rc == DIFFRAG_ETIMEOUT && log.n == 2 && !strcmp(log.text, "Hello") && waited >= 299 &&
          waited < 1500, "stalled stream: rc=%d deltas=%d", rc, log.n);
    q.timeout_ms = 0;
    fake_mode(FAKE_OK);
    CHECK(ping_ok(c), "usable after timeouts (late replies dropped)");

    /* interrupt from another thread: a plain call stops at once */
    fake_mode(FAKE_SILENT);
    DiffragClient *slow = client_for(fake.endpoint, 1000, 5000);
    struct Interrupter it = { slow, 150 };
    pthread_t th;
    pthread_create(&th, NULL, interrupt_later, &it);
    t0 = now_ms();
    rc = diffrag_ping(slow, &(DiffragPong *){ NULL });
    waited = now_ms() - t0;
    pthread_join(th, NULL);
    printf("interrupt: ping returned after %.0f ms (interrupted at 150 ms)\n", waited);
    CHECK(rc == DIFFRAG_EINTERRUPTED && waited < 1000, "interrupted ping: %d after %.0f", rc, waited);

    /* a query: the interrupt cancels on the daemon and returns its final reply */
    fake_mode(FAKE_CANCELLABLE);
    int cancels0 = atomic_load(&fake.cancels);
    pthread_create(&th, NULL, interrupt_later, &it);
    memset(&log, 0, sizeof log);
    rc = diffrag_query(slow, &q, log_delta, &log, &a);
    pthread_join(th, NULL);
    CHECK(rc == DIFFRAG_OK && a && !strcmp(a->finish_reason, "cancelled") && log.n == 2 &&
          atomic_load(&fake.cancels) == cancels0 + 1, "interrupted query: rc=%d %s", rc,
          diffrag_last_error(slow));
    diffrag_answer_free(&a);
    /* the callback asks to stop */
    memset(&log, 0, sizeof log);
    log.stop_after = 1;
    rc = diffrag_query(slow, &q, log_delta, &log, &a);
    CHECK(rc == DIFFRAG_OK && a && !strcmp(a->finish_reason, "cancelled") && log.n == 1 &&
          a->n_deltas == 2 && atomic_load(&fake.cancels) == cancels0 + 2,
          "callback stop: rc=%d deltas=%d", rc, log.n);
    diffrag_answer_free(&a);
    /* diffrag_cancel from inside the callback, with the query's final reply arriving before
     * the cancel's acknowledgement (it must wait in the mailbox) and after it */
    for (int order = 0; order < 2; order++) {
        fake_mode(order ? FAKE_CANCEL_FINAL_FIRST : FAKE_CANCELLABLE);
        memset(&log, 0, sizeof log);
        log.cancel_client = slow;
        log.cancel_target = "my-query";
        q.id = "my-query";
        rc = diffrag_query(slow, &q, log_delta, &log, &a);
        CHECK(rc == DIFFRAG_OK && a && !strcmp(a->finish_reason, "cancelled") &&
              log.cancel_rc == DIFFRAG_OK && !strcmp(log.cancel_state, "running") &&
              !strcmp(a->id, "my-query"), "cancel from callback (order %d): rc=%d cancel=%d %s",
              order, rc, log.cancel_rc, diffrag_last_error(slow));
        diffrag_answer_free(&a);
    }
    q.id = NULL;
    fake_mode(FAKE_OK);
    CHECK(ping_ok(slow), "usable after cancels");
    diffrag_destroy(&slow);
    CHECK(slow == NULL, "destroy clears the pointer");

    /* arguments */
    DiffragQuery empty = { 0 };
    CHECK(diffrag_query(c, &empty, NULL, NULL, &a) == DIFFRAG_EINVAL &&
          strstr(diffrag_last_error(c), "question"), "no question");
    DiffragQuery nowhere = { .question = "q" };
    CHECK(diffrag_query(c, &nowhere, NULL, NULL, &a) == DIFFRAG_EINVAL, "no docs, no collection");
    DiffragDoc nometa = { .id = "x", .text = "t", .meta_json = "{\"a\": }" };
    DiffragIngestResult *ir = NULL;
    CHECK(diffrag_ingest(c, "c", &nometa, 1, &ir) == DIFFRAG_EINVAL &&
          strstr(diffrag_last_error(c), "meta_json"), "bad meta: %s", diffrag_last_error(c));
    nometa.meta_json = "[1]";
    CHECK(diffrag_ingest(c, "c", &nometa, 1, &ir) == DIFFRAG_EINVAL, "meta not an object");
    CHECK(diffrag_ingest(c, NULL, &nometa, 1, &ir) == DIFFRAG_EINVAL, "no collection");
    DiffragFile nofile[2] = { { .name = "a.html", .bytes = "<p>x</p>", .len = 8 },
                              { .name = "b.pdf", .bytes = "", .len = 0 } };
    CHECK(diffrag_ingest_files(c, "c", nofile, 2, &ir) == DIFFRAG_EINVAL && !ir &&
          strstr(diffrag_last_error(c), "files[1] (b.pdf) has no bytes"), "a file without bytes: %s",
          diffrag_last_error(c));
    nofile[1] = (DiffragFile){ .bytes = "x", .len = 1 };
    CHECK(diffrag_ingest_files(c, "c", nofile, 2, &ir) == DIFFRAG_EINVAL &&
          strstr(diffrag_last_error(c), "files[1] has no name"), "a file without a name");
    CHECK(diffrag_ingest_files(c, "c", NULL, 0, &ir) == DIFFRAG_EINVAL, "no files");
    DiffragDropResult *xr = NULL;
    CHECK(diffrag_drop(c, "", &xr) == DIFFRAG_EINVAL && !xr, "drop without a collection");
    DiffragClient *x = NULL;
    char err[200];
    CHECK(diffrag_new(&x, "", NULL, err, sizeof err) == DIFFRAG_EINVAL && !x, "empty endpoint");
    CHECK(diffrag_new(&x, "nonsense://x", NULL, err, sizeof err) == DIFFRAG_EINVAL && !x,
          "bad endpoint: %s", err);
    /* no scheme, or no port: the message says what an endpoint looks like */
    static const char *const forms[] = { "127.0.0.1:7400", "tcp://127.0.0.1", "tcp://h:x",
                                         "ipc://" };
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++)
        CHECK(diffrag_new(&x, forms[i], NULL, err, sizeof err) == DIFFRAG_EINVAL && !x &&
              strstr(err, "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME") &&
              strstr(err, forms[i]), "endpoint %s: %s", forms[i], err);
    DiffragOptions o;
    diffrag_options_init(&o);
    o.server_key = "too-short";
    CHECK(diffrag_new(&x, fake.endpoint, &o, err, sizeof err) == DIFFRAG_EINVAL &&
          strstr(err, "server_key"), "bad server key: %s", err);
    diffrag_destroy(&c);
    fake_stop(&fake);
}

static void test_no_daemon(void)
{
    /* a port where nothing listens: bind one, note it, close it */
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_ROUTER);
    char ep[64];
    size_t len = sizeof ep;
    zmq_bind(s, "tcp://127.0.0.1:*");
    zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len);
    zmq_close(s);
    zmq_ctx_term(ctx);
    DiffragClient *c = client_for(ep, 300, 1000);
    if (!c)
        return;
    double t0 = now_ms();
    int rc = diffrag_ping(c, &(DiffragPong *){ NULL });
    double waited = now_ms() - t0;
    printf("no daemon: %s (after %.0f ms)\n", diffrag_last_error(c), waited);
    CHECK(rc == DIFFRAG_ECONNECT && !strcmp(diffrag_last_error_code(c), "connect") &&
          strstr(diffrag_last_error(c), "connection refused") && waited >= 299 && waited < 1500,
          "rc=%d %s", rc, diffrag_last_error(c));
    diffrag_destroy(&c);
    /* a host that does not resolve says so (not "connection refused") */
    c = client_for("tcp://nosuchhost.invalid:7400", 300, 1000);
    if (!c)
        return;
    rc = diffrag_ping(c, &(DiffragPong *){ NULL });
    printf("no such host: %s\n", diffrag_last_error(c));
    CHECK(rc == DIFFRAG_ECONNECT && strstr(diffrag_last_error(c), "\"nosuchhost.invalid\" does "
          "not resolve"), "rc=%d %s", rc, diffrag_last_error(c));
    diffrag_destroy(&c);
}

static void test_keys(void)
{
    char pub[41], sec[41], pub2[41];
    CHECK(diffrag_keygen(pub, sec) == DIFFRAG_OK && strlen(pub) == 40 && strlen(sec) == 40, "keygen");
    CHECK(diffrag_key_public(sec, pub2) == DIFFRAG_OK && strcmp(pub, pub2) == 0, "public of secret");
    CHECK(diffrag_key_public("not a key", pub2) == DIFFRAG_EINVAL, "bad secret");
    char path[] = "/tmp/diffrag-key-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0)
        return;
    FILE *f = fdopen(fd, "w");
    fprintf(f, "# a comment\n\n  %s  \n", sec);
    fclose(f);
    char key[41], err[256];
    CHECK(diffrag_key_read(path, key, err, sizeof err) == DIFFRAG_OK && !strcmp(key, sec), "read: %s", err);
    f = fopen(path, "w");
    fprintf(f, "short\n");
    fclose(f);
    CHECK(diffrag_key_read(path, key, err, sizeof err) == DIFFRAG_EINVAL && strstr(err, "no CurveZMQ key"),
          "bad file: %s", err);
    unlink(path);
    CHECK(diffrag_key_read(path, key, err, sizeof err) == DIFFRAG_EINVAL && strstr(err, "No such file"),
          "missing file: %s", err);
}

/* ---- against a live daemon ---- */

static void test_live(const char *endpoint)
{
    DiffragClient *c = client_for(endpoint, 2000, 20000);
    if (!c)
        return;
    const char *coll = "c-client";
    DiffragPong *p = NULL;
    int rc = diffrag_ping(c, &p);
    CHECK(rc == DIFFRAG_OK && p && p->version && p->model, "ping: %s", diffrag_last_error(c));
    if (p)
        printf("live: diffragd %s, model %s, ping %.2f ms\n", p->version, p->model, p->rtt_ms);
    diffrag_pong_free(&p);

    DiffragDoc docs[3] = {
        { .id = "rhine", .title = "Rhine", .meta_json = "{\"source\": \"test\", \"n\": [1, 2.5]}",
          .text = "The Rhine is a European river that begins in the Swiss canton of Graubunden "
                  "and flows into the North Sea. It is about 1,230 km long." },
        { .id = "paris", .title = "Paris", .text = "Paris is the capital and most populous city "
          "of France, with an estimated population of 2,102,650 residents." },
        { .id = "oxygen", .text = "Oxygen is a chemical element with symbol O and atomic number 8.",
          .text_len = 39 /* only "Oxygen is a chemical element with symbol" */ },
    };
    DiffragIngestResult *ir = NULL;
    rc = diffrag_ingest(c, coll, docs, 3, &ir);
    CHECK(rc == DIFFRAG_OK && ir && ir->ingested == 3 && ir->docs == 3 && ir->chunks >= 3 &&
          ir->collection && !strcmp(ir->collection, coll), "ingest: %s", diffrag_last_error(c));
    if (ir)
        printf("live: ingested %lld docs, %lld bytes, collection %lld docs %lld chunks\n",
               (long long)ir->ingested, (long long)ir->bytes, (long long)ir->docs, (long long)ir->chunks);
    diffrag_ingest_result_free(&ir);

    DiffragList *l = NULL;
    rc = diffrag_list(c, NULL, NULL, 0, &l);
    int found = 0;
    for (size_t i = 0; l && i < l->n_collections; i++)
        found |= !strcmp(l->collections[i], coll);
    CHECK(rc == DIFFRAG_OK && found, "list collections: %s", diffrag_last_error(c));
    diffrag_list_free(&l);
    rc = diffrag_list(c, coll, NULL, 2, &l);
    CHECK(rc == DIFFRAG_OK && l && l->n_docs == 2 && !strcmp(l->docs[0].id, "oxygen") &&
          !strcmp(l->docs[1].id, "paris") && l->next && !strcmp(l->next, "paris") &&
          l->docs[0].bytes == 39, "list page 1: %s", diffrag_last_error(c));
    diffrag_list_free(&l);
    rc = diffrag_list(c, coll, "paris", 0, &l);
    CHECK(rc == DIFFRAG_OK && l && l->n_docs == 1 && !strcmp(l->docs[0].id, "rhine") && !l->next,
          "list page 2");
    diffrag_list_free(&l);

    DiffragDocument *d = NULL;
    rc = diffrag_get(c, coll, "rhine", &d);
    CHECK(rc == DIFFRAG_OK && d && !strcmp(d->text, docs[0].text) && !strcmp(d->title, "Rhine") &&
          d->meta_json && !strcmp(d->meta_json, "{\"source\": \"test\", \"n\": [1, 2.5]}"),
          "get: %s meta=%s", diffrag_last_error(c), d && d->meta_json ? d->meta_json : "-");
    diffrag_document_free(&d);
    rc = diffrag_get(c, coll, "oxygen", &d);
    CHECK(rc == DIFFRAG_OK && d && d->text_len == 39 && !d->meta_json && !strcmp(d->title, ""),
          "get oxygen (text_len honoured, no title, no meta)");
    diffrag_document_free(&d);

    /* a document with headings and page markers (a PDF as diffrag-extract writes it): its
     * citations say where, the whole document its first and last pages */
    DiffragDoc paged = { .id = "report.pdf", .title = "Harbour report",
        .text = "# Harbour report\n\n<!-- page 1 -->\n\nThe harbour handled more grain.\n\n"
                "<!-- page 2 -->\n\n## Results\n\nThe quay was rebuilt in spring.\n" };
    DiffragQuery pq = { .question = "When was the quay rebuilt?", .docs = &paged, .n_docs = 1,
                        .max_tokens = 2 };
    DiffragAnswer *pa = NULL;
    rc = diffrag_query(c, &pq, NULL, NULL, &pa);
    CHECK(rc == DIFFRAG_OK && pa && pa->n_citations == 1 && pa->citations[0].whole &&
          pa->citations[0].page_first == 1 && pa->citations[0].page_last == 2 &&
          pa->citations[0].heading && !pa->citations[0].heading_len,
          "a whole paged document: pp. %lld-%lld: %s", pa && pa->n_citations ? (long long)pa->citations[0].page_first : -1,
          pa && pa->n_citations ? (long long)pa->citations[0].page_last : -1, diffrag_last_error(c));
    diffrag_answer_free(&pa);

    /* files as they are on disk, read by the daemon's extraction helper: an HTML page goes in
     * as Markdown with its <title>; a PDF without a text layer rejects its batch, naming it */
    static const char page[] = "<html><head><title>Rhine facts</title></head><body><h1>Length</h1>"
                               "<p>The Rhine is about 1,230 km long.</p><script>x()</script></body></html>";
    char fcoll[300];
    snprintf(fcoll, sizeof fcoll, "%s-files", coll);
    DiffragFile files[2] = { { .name = "rhine.html", .bytes = page, .len = sizeof page - 1 },
                             { .name = "scan.pdf", .bytes = "%PDF-1.4\n%%EOF\n", .len = 15 } };
    rc = diffrag_ingest_files(c, fcoll, files, 2, &ir);
    CHECK(rc == DIFFRAG_ESERVER && strstr(diffrag_last_error(c), "scan.pdf"), "a bad file fails its batch: %s",
          diffrag_last_error(c));
    diffrag_ingest_result_free(&ir);
    rc = diffrag_ingest_files(c, fcoll, files, 1, &ir);
    CHECK(rc == DIFFRAG_OK && ir && ir->ingested == 1 && ir->added == 1 && ir->docs == 1,
          "ingest a file: %s", diffrag_last_error(c));
    diffrag_ingest_result_free(&ir);
    rc = diffrag_get(c, fcoll, "rhine.html", &d);
    CHECK(rc == DIFFRAG_OK && d && !strcmp(d->title, "Rhine facts") && strstr(d->text, "# Length\n") &&
          strstr(d->text, "1,230 km") && !strstr(d->text, "<h1>") && !strstr(d->text, "x()"),
          "the file's document: %s %s", diffrag_last_error(c), d ? d->text : "-");
    diffrag_document_free(&d);
    DiffragDropResult *fdr = NULL;
    CHECK(diffrag_drop(c, fcoll, &fdr) == DIFFRAG_OK, "drop the files' collection");
    diffrag_drop_result_free(&fdr);

    DiffragStats *s = NULL;
    rc = diffrag_stats(c, coll, &s);
    CHECK(rc == DIFFRAG_OK && s && s->docs == 3 && s->chunks >= 3 && s->terms > 0 &&
          s->text_bytes == (int64_t)(strlen(docs[0].text) + strlen(docs[1].text) + 39),
          "collection stats: %s", diffrag_last_error(c));
    diffrag_stats_free(&s);
    rc = diffrag_stats(c, NULL, &s);
    CHECK(rc == DIFFRAG_OK && s && s->version && !s->collection &&
          s->workers_idle + s->workers_busy >= 1 && s->kv_cache_bytes > 0, "daemon stats");
    if (s)
        printf("live: workers idle %lld busy %lld, kv cache %lld bytes\n", (long long)s->workers_idle,
               (long long)s->workers_busy, (long long)s->kv_cache_bytes);
    diffrag_stats_free(&s);

    /* a blocking query over the collection */
    DiffragQuery q = { .question = "What is the population of Paris, the capital of France?",
                       .collection = coll, .max_tokens = 12 };
    DiffragAnswer *a = NULL;
    rc = diffrag_query(c, &q, NULL, NULL, &a);
    CHECK(rc == DIFFRAG_OK && a && a->n_citations >= 1 && !strcmp(a->citations[0].doc_id, "paris") &&
          a->completion_tokens >= 1 && a->completion_tokens <= 12 && a->n_deltas == 0 &&
          a->prompt_tokens > a->context_tokens && a->context_tokens > 0, "query: %s",
          diffrag_last_error(c));
    if (a)
        printf("live: query finish=%s completion_tokens=%lld citations=%zu total_ms=%.1f\n",
               a->finish_reason, (long long)a->completion_tokens, a->n_citations, a->total_ms);
    diffrag_answer_free(&a);

    /* streaming over inline documents: the deltas make the answer */
    struct DeltaLog log = { 0 };
    DiffragDoc inline_doc = { .text = docs[0].text };
    DiffragQuery sq = { .question = "How long is the Rhine?", .docs = &inline_doc, .n_docs = 1,
                        .max_tokens = 20 };
    rc = diffrag_query(c, &sq, log_delta, &log, &a);
    CHECK(rc == DIFFRAG_OK && a && log.n >= 1 && (size_t)log.n == a->n_deltas &&
          strcmp(log.text, a->answer) == 0 && a->n_citations == 1 &&
          !strcmp(a->citations[0].doc_id, "1"), "stream: rc=%d deltas=%d %s", rc, log.n,
          diffrag_last_error(c));
    if (a)
        printf("live: stream deltas=%d answer_len=%zu finish=%s\n", log.n, a->answer_len,
               a->finish_reason);
    diffrag_answer_free(&a);

    /* server errors carry the daemon's code */
    rc = diffrag_get(c, coll, "no-such-doc", &d);
    CHECK(rc == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(c), "not_found") && !d,
          "not_found: %s", diffrag_last_error(c));
    DiffragQuery badq = { .question = "x", .collection = coll, .top_k = -1 };
    rc = diffrag_query(c, &badq, NULL, NULL, &a);
    CHECK(rc == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(c), "bad_request"),
          "bad_request: %s", diffrag_last_error(c));
    char *longq = malloc(5000);
    memset(longq, 'a', 4999);
    longq[4999] = 0;
    badq.question = longq;
    badq.top_k = 0;
    rc = diffrag_query(c, &badq, NULL, NULL, &a);
    CHECK(rc == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(c), "too_large"),
          "too_large: %s", diffrag_last_error(c));
    free(longq);
    char state[16];
    rc = diffrag_cancel(c, "never-sent", state, sizeof state);
    CHECK(rc == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(c), "not_found"),
          "cancel unknown: %s", diffrag_last_error(c));

    /* cancel a running query from its callback, and by the callback's return value */
    memset(&log, 0, sizeof log);
    log.cancel_client = c;
    log.cancel_target = "long";
    DiffragQuery lq = { .question = "Tell me everything about the Rhine.", .docs = docs,
                        .n_docs = 2, .max_tokens = 1000, .id = "long" };
    rc = diffrag_query(c, &lq, log_delta, &log, &a);
    CHECK(rc == DIFFRAG_OK && a && log.cancel_rc == DIFFRAG_OK &&
          !strcmp(log.cancel_state, "running") && !strcmp(a->finish_reason, "cancelled") &&
          a->completion_tokens < 1000, "cancel from callback: rc=%d cancel=%d state=%s %s", rc,
          log.cancel_rc, log.cancel_state, diffrag_last_error(c));
    if (a)
        printf("live: cancelled after %lld tokens (%d deltas seen)\n",
               (long long)a->completion_tokens, log.n);
    diffrag_answer_free(&a);
    memset(&log, 0, sizeof log);
    log.stop_after = 3;
    lq.id = NULL;
    rc = diffrag_query(c, &lq, log_delta, &log, &a);
    CHECK(rc == DIFFRAG_OK && a && !strcmp(a->finish_reason, "cancelled") && log.n == 3 &&
          a->completion_tokens < 1000, "stop by callback: rc=%d %s", rc, diffrag_last_error(c));
    diffrag_answer_free(&a);

    DiffragDeleteResult *dr = NULL;
    const char *ids[] = { "paris", "nope" };
    rc = diffrag_delete(c, coll, ids, 2, &dr);
    CHECK(rc == DIFFRAG_OK && dr && dr->deleted == 1 && dr->docs == 2, "delete: %s",
          diffrag_last_error(c));
    diffrag_delete_result_free(&dr);
    rc = diffrag_delete(c, "no-such-collection", ids, 1, &dr);
    CHECK(rc == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(c), "not_found"), "delete unknown");

    /* drop: the documents it held, then the collection is gone */
    DiffragDropResult *xr = NULL;
    rc = diffrag_drop(c, coll, &xr);
    CHECK(rc == DIFFRAG_OK && xr && xr->dropped == 2 && !strcmp(xr->collection, coll) &&
          strstr(xr->json, "\"dropped\": 2"), "drop: %s", diffrag_last_error(c));
    diffrag_drop_result_free(&xr);
    CHECK(!xr, "drop result freed");
    rc = diffrag_stats(c, coll, &s);
    CHECK(rc == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(c), "not_found") && !s,
          "stats of a dropped collection: %s", diffrag_last_error(c));
    rc = diffrag_drop(c, coll, &xr);
    CHECK(rc == DIFFRAG_ESERVER && !strcmp(diffrag_last_error_code(c), "not_found") && !xr,
          "drop again: %s", diffrag_last_error(c));
    CHECK(diffrag_ping(c, &p) == DIFFRAG_OK, "still answering");
    diffrag_pong_free(&p);
    diffrag_destroy(&c);
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *p = NULL;
    *len = 0;
    if (!f)
        return NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n > 0 && fseek(f, 0, SEEK_SET) == 0 && (p = malloc((size_t)n + 1)) &&
            fread(p, 1, (size_t)n, f) == (size_t)n) {
            p[n] = 0;
            *len = (size_t)n;
        } else {
            free(p);
            p = NULL;
        }
    }
    fclose(f);
    return p;
}

static void print_hex(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        printf("%02x", (unsigned char)s[i]);
}

/* The quotes of a quote-mode answer against the documents they name. */
static void check_quotes(const DiffragAnswer *a, const DiffragDoc *docs, size_t n_docs,
                         const char *what)
{
    CHECK(a->answer_mode && !strcmp(a->answer_mode, "quote") && a->n_quotes >= 1,
          "%s: answer_mode %s, %zu quotes", what, a->answer_mode ? a->answer_mode : "-",
          a->n_quotes);
    size_t at = 0;
    for (size_t i = 0; i < a->n_quotes; i++) {
        const DiffragQuote *q = &a->quotes[i];
        const DiffragDoc *d = NULL;
        for (size_t k = 0; k < n_docs; k++)
            if (!strcmp(docs[k].id, q->doc_id))
                d = &docs[k];
        CHECK(d && q->start >= 0 && q->start < q->end && (size_t)q->end <= d->text_len &&
              (size_t)(q->end - q->start) == q->text_len &&
              !memcmp(d->text + q->start, q->text, q->text_len),
              "%s: quote %zu (%s %lld-%lld) is the document's bytes", what, i, q->doc_id,
              (long long)q->start, (long long)q->end);
        CHECK(at + q->text_len <= a->answer_len && !memcmp(a->answer + at, q->text, q->text_len),
              "%s: quote %zu continues the answer", what, i);
        at += q->text_len;
        int marked = 0;
        for (size_t k = 0; k < a->n_citations; k++)
            marked |= a->citations[k].marker == q->marker && a->citations[k].cited &&
                      !strcmp(a->citations[k].doc_id, q->doc_id);
        CHECK(marked, "%s: quote %zu's citation [%lld] is cited", what, i, (long long)q->marker);
    }
    CHECK(at == a->answer_len, "%s: the quotes make the answer (%zu of %zu bytes)", what, at,
          a->answer_len);
    CHECK(a->has_grounding && a->grounding.quote_removed >= 0 && a->grounding.quote_removed <= 1,
          "%s: quote_removed %g", what, a->has_grounding ? a->grounding.quote_removed : NAN);
}

static void test_quote(const char *endpoint, const char *question, int max_tokens,
                       char **files, int n_files)
{
    DiffragClient *c = client_for(endpoint, 2000, 60000);
    DiffragDoc *docs = calloc((size_t)n_files, sizeof *docs);
    if (!c || !docs) {
        CHECK(0, "client and documents");
        free(docs);
        diffrag_destroy(&c);
        return;
    }
    for (int i = 0; i < n_files; i++) {
        docs[i].id = files[i];                        /* as `diffrag ask -d FILE` sends it: */
        docs[i].title = NULL;                         /* the path as its id, no title */
        docs[i].text = read_all(files[i], &docs[i].text_len);
        CHECK(docs[i].text && docs[i].text_len, "read %s", files[i]);
    }
    DiffragQuery q = { .question = question, .docs = docs, .n_docs = (size_t)n_files,
                       .max_tokens = max_tokens, .answer_mode = "quote" };
    DiffragAnswer *a = NULL, *s = NULL;
    int rc = diffrag_query(c, &q, NULL, NULL, &a);
    CHECK(rc == DIFFRAG_OK && a, "quote query: %s", diffrag_last_error(c));
    if (a) {
        check_quotes(a, docs, (size_t)n_files, "blocking");
        for (size_t i = 0; i < a->n_quotes; i++) {
            const DiffragQuote *x = &a->quotes[i];
            printf("quote %lld %s %lld %lld %lld ", (long long)x->marker, x->doc_id,
                   (long long)x->chunk, (long long)x->start, (long long)x->end);
            print_hex(x->text, x->text_len);
            putchar('\n');
        }
        printf("quote_removed %.17g\n", a->grounding.quote_removed);
    }
    /* streamed: the same greedy answer, its deltas the quotes' text */
    struct DeltaLog log = { 0 };
    rc = diffrag_query(c, &q, log_delta, &log, &s);
    CHECK(rc == DIFFRAG_OK && s && !strcmp(log.text, s->answer), "streamed quote query: %s",
          diffrag_last_error(c));
    if (s) {
        check_quotes(s, docs, (size_t)n_files, "streamed");
        int same = a && a->n_quotes == s->n_quotes;
        for (size_t i = 0; same && i < a->n_quotes; i++)
            same = a->quotes[i].start == s->quotes[i].start &&
                   a->quotes[i].end == s->quotes[i].end &&
                   !strcmp(a->quotes[i].doc_id, s->quotes[i].doc_id);
        CHECK(same, "streamed quotes equal the blocking query's");
    }
    diffrag_answer_free(&a);
    diffrag_answer_free(&s);
    /* free: no quotes, no removed mass */
    q.answer_mode = "free";
    rc = diffrag_query(c, &q, NULL, NULL, &a);
    CHECK(rc == DIFFRAG_OK && a && !strcmp(a->answer_mode, "free") && !a->n_quotes &&
          !a->quotes && a->has_grounding && isnan(a->grounding.quote_removed),
          "free query: %s", diffrag_last_error(c));
    diffrag_answer_free(&a);
    q.answer_mode = "bogus";
    rc = diffrag_query(c, &q, NULL, NULL, &a);
    CHECK(rc == DIFFRAG_ESERVER && !a && !strcmp(diffrag_last_error_code(c), "bad_request") &&
          strstr(diffrag_last_error(c), "answer_mode must be"), "bad answer_mode: %s",
          diffrag_last_error(c));
    for (int i = 0; i < n_files; i++)
        free((char *)docs[i].text);
    free(docs);
    diffrag_destroy(&c);
}

int main(int argc, char **argv)
{
    const char *endpoint = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--endpoint") && i + 1 < argc) {
            endpoint = argv[++i];
        } else if (!strcmp(argv[i], "--quote") && endpoint && i + 3 < argc) {
            test_quote(endpoint, argv[i + 1], atoi(argv[i + 2]), argv + i + 3, argc - i - 3);
            return check_report("test_client_c");
        } else {
            fprintf(stderr, "usage: %s [--endpoint EP [--quote QUESTION MAX_TOKENS FILE...]]\n",
                    argv[0]);
            return 2;
        }
    }
    if (endpoint) {
        test_live(endpoint);
    } else {
        test_json();
        test_reply_parse_corruptions();
        test_keys();
        test_no_daemon();
        test_fake_server();
    }
    return check_report("test_client_c");
}
