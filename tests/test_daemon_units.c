/* Unit tests of the daemon's pure parts: the msgpack reader (round trips, every truncation,
 * random bytes, nesting limits), the broker <-> worker bodies, request decoding (a query's
 * conversation history and system text included), configuration values, logfmt quoting,
 * CurveZMQ key files and fault-point periods. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "daemon/config.h"
#include "daemon/fault.h"
#include "daemon/log.h"
#include "daemon/mp.h"
#include "daemon/proto.h"
#include "daemon/wire.h"
#include "daemon/zap.h"
#include "tests/check.h"

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* A str is UTF-8 whatever it is given: each byte that is not part of well-formed UTF-8
 * becomes U+FFFD, the rest is kept. */
static void test_mp_str_is_utf8(void)
{
    struct MpWriter w;
    mpw_init(&w);
    mpw_array(&w, 3);
    mpw_str(&w, "a\xff" "b\xc3", 4);               /* a stray byte, a cut sequence */
    mpw_str(&w, "h\xc3\xa9llo \xe2\x82\xac", 10);  /* well-formed: as it is */
    mpw_str(&w, "\xed\xa0\x80", 3);                 /* a surrogate: three bytes, three U+FFFD */
    struct MpCursor c;
    struct MpObj o;
    mp_cursor_init(&c, w.buf.data, w.buf.size);
    CHECK(!w.failed && mp_next(&c, &o) == 0 && o.type == MP_ARRAY && o.v.n == 3, "array");
    CHECK(mp_next(&c, &o) == 0 && o.type == MP_STR && o.len == 8 &&
          !memcmp(o.s, "a\xef\xbf\xbd" "b\xef\xbf\xbd", 8), "repaired: %.*s", (int)o.len, o.s);
    CHECK(mp_next(&c, &o) == 0 && o.type == MP_STR && o.len == 10 &&
          !memcmp(o.s, "h\xc3\xa9llo \xe2\x82\xac", 10), "kept");
    CHECK(mp_next(&c, &o) == 0 && o.type == MP_STR && o.len == 9 &&
          !memcmp(o.s, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 9), "surrogate");
    CHECK(c.p == c.end, "consumed");
    mpw_destroy(&w);
}

static void test_mp_round_trip(void)
{
    struct MpWriter w;
    mpw_init(&w);
    mpw_map(&w, 9);
    mpw_kv_uint(&w, "u", 300);
    mpw_kv_int(&w, "i", -70000);
    mpw_kv_double(&w, "f", 2.5);
    mpw_kv_bool(&w, "b", 1);
    mpw_kv_cstr(&w, "s", "héllo");
    mpw_cstr(&w, "n");
    mpw_nil(&w);
    mpw_cstr(&w, "bin");
    mpw_bin(&w, "\x00\x01\x02", 3);
    mpw_cstr(&w, "a");
    mpw_array(&w, 2);
    mpw_uint(&w, 1);
    mpw_array(&w, 0);
    mpw_cstr(&w, "big");
    mpw_uint(&w, UINT64_MAX);
    CHECK(!w.failed, "writer failed");
    char err[128];
    CHECK(mp_check(w.buf.data, w.buf.size, 4, err, sizeof err) == MP_OK, "%s", err);
    CHECK(mp_check(w.buf.data, w.buf.size, 1, err, sizeof err) == MP_EDEPTH, "depth 1 accepted");
    struct MpCursor c;
    struct MpObj o, k;
    mp_cursor_init(&c, w.buf.data, w.buf.size);
    CHECK(mp_next(&c, &o) == 0 && o.type == MP_MAP && o.v.n == 9, "map header");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(o.type == MP_UINT && o.v.u == 300, "u");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(o.type == MP_INT && o.v.i == -70000, "i");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(o.type == MP_FLOAT && o.v.f == 2.5, "f");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(o.type == MP_BOOL && o.v.b == 1, "b");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(o.type == MP_STR && o.len == 6 && !memcmp(o.s, "héllo", 6), "s");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(o.type == MP_NIL, "n");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(o.type == MP_BIN && o.len == 3 && o.s[2] == 2, "bin");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(o.type == MP_ARRAY && o.v.n == 2, "array");
    CHECK(mp_skip_body(&c, &o) == 0, "skip array body");
    mp_next(&c, &k); mp_next(&c, &o);
    CHECK(k.len == 3 && o.type == MP_UINT && o.v.u == UINT64_MAX, "big");
    CHECK(c.p == c.end, "consumed %zd of %zu", (ssize_t)(c.p - (const uint8_t *)w.buf.data),
          w.buf.size);
    /* every proper prefix is refused as truncated, never read past */
    int bad = 0;
    for (size_t n = 0; n < w.buf.size; n++) {
        char *copy = malloc(n ? n : 1);
        memcpy(copy, w.buf.data, n);
        if (mp_check(copy, n, 8, err, sizeof err) != MP_ETRUNC)
            bad++;
        free(copy);
    }
    CHECK(bad == 0, "%d truncations accepted", bad);
    mpw_destroy(&w);
}

static void test_mp_random_bytes(void)
{
    /* Random messages: mp_check either refuses them or they walk to the exact end. */
    int accepted = 0, inconsistent = 0;
    for (int t = 0; t < 20000; t++) {
        uint8_t buf[48];
        size_t n = 1 + next_rand() % sizeof buf;
        for (size_t i = 0; i < n; i++)
            buf[i] = (uint8_t)next_rand();
        if (t % 3 == 0)
            buf[0] = (uint8_t)(0x80 | (buf[0] & 0x1f));   /* often a map or array */
        char err[128];
        uint8_t *heap = malloc(n);   /* exact size, so any over-read would be visible to ASan */
        memcpy(heap, buf, n);
        if (mp_check(heap, n, 8, err, sizeof err) == MP_OK) {
            accepted++;
            struct MpCursor c;
            mp_cursor_init(&c, heap, n);
            if (mp_skip(&c) != MP_OK || c.p != c.end)
                inconsistent++;
        }
        free(heap);
    }
    printf("mp random: %d of 20000 accepted, %d inconsistent\n", accepted, inconsistent);
    CHECK(accepted > 100 && inconsistent == 0, "accepted %d inconsistent %d", accepted, inconsistent);
    /* a container claiming 2^32 - 1 elements is refused at once */
    uint8_t huge[] = { 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01 };
    char err[128];
    CHECK(mp_check(huge, sizeof huge, 8, err, sizeof err) == MP_ETRUNC, "huge array");
    CHECK(strstr(err, "4294967295") != NULL, "%s", err);
    /* nesting: 64 levels refused at 16, accepted at 64 */
    uint8_t deep[65];
    memset(deep, 0x91, 64);
    deep[64] = 0x01;
    CHECK(mp_check(deep, sizeof deep, 16, err, sizeof err) == MP_EDEPTH, "deep 16");
    CHECK(mp_check(deep, sizeof deep, 64, err, sizeof err) == MP_OK, "deep 64: %s", err);
}

static void test_wire(void)
{
    int32_t toks[5] = { 1, 0, 65535, 70000, 511 };
    const char *stop[2] = { "\n\n", "END" };
    size_t lens[2] = { 2, 3 };
    struct MpWriter w;
    mpw_init(&w);
    wire_job_encode(&w, toks, 5, 42, 0.7, 0.9, 1234567890123ull, stop, lens, 2, 1, NULL);
    struct WireJob j = { .job = 99 };
    char err[128];
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) == 0, "%s", err);
    CHECK(j.job == 99 && j.n_tokens == 5 && !memcmp(j.tokens, toks, sizeof toks), "tokens");
    CHECK(j.max_tokens == 42 && fabsf(j.temperature - 0.7f) < 1e-6 && fabsf(j.top_p - 0.9f) < 1e-6,
          "params");
    CHECK(j.seed == 1234567890123ull && j.stream == 1, "seed/stream");
    CHECK(j.n_stop == 2 && !strcmp(j.stop[0], "\n\n") && !strcmp(j.stop[1], "END"), "stop");
    CHECK(!j.self_check, "no self-check unless asked");
    wire_job_free(&j);
    /* the self-check request crosses */
    int32_t bare[3] = { 1, 2, 3 };
    struct WireGround g = { .self_check = 1, .bare = bare, .n_bare = 3 };
    mpw_reset(&w);
    wire_job_encode(&w, toks, 5, 42, 0.7, 0.9, 1, stop, lens, 2, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) == 0 && j.self_check == 1,
          "self-check asked: %s", err);
    CHECK(j.n_bare == 3 && !memcmp(j.bare, bare, sizeof bare), "the prompt without documents");
    CHECK(j.n_hidden == 0 && !j.hidden, "no hidden layers unless asked");
    wire_job_free(&j);
    /* the residual stream's layers cross; a negative one or too many are refused */
    int32_t layers[2] = { 14, 0 };
    struct WireGround gh = { .hidden = layers, .n_hidden = 2 };
    mpw_reset(&w);
    wire_job_encode(&w, toks, 5, 42, 0.7, 0.9, 1, stop, lens, 2, 0, &gh);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) == 0 && j.n_hidden == 2 &&
          j.hidden[0] == 14 && j.hidden[1] == 0, "hidden layers: %s", err);
    wire_job_free(&j);
    layers[1] = -1;
    mpw_reset(&w);
    wire_job_encode(&w, toks, 5, 42, 0.7, 0.9, 1, stop, lens, 2, 0, &gh);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0 &&
          strstr(err, "negative hidden layer"), "negative layer: %s", err);
    int32_t many[WIRE_MAX_HIDDEN + 1] = { 0 };
    gh = (struct WireGround){ .hidden = many, .n_hidden = WIRE_MAX_HIDDEN + 1 };
    mpw_reset(&w);
    wire_job_encode(&w, toks, 5, 42, 0.7, 0.9, 1, stop, lens, 2, 0, &gh);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0, "%d hidden layers",
          WIRE_MAX_HIDDEN + 1);
    /* a body that lies about its tokens is refused */
    mpw_reset(&w);
    mpw_map(&w, 2);
    mpw_cstr(&w, "tokens");
    mpw_bin(&w, "abc", 3);
    mpw_kv_int(&w, "max_tokens", 4);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0, "odd token bytes");

    struct WireResult r = { .job = 5, .finish = WF_DEADLINE, .text = "partial", .text_len = 7,
                            .prompt_tokens = 100, .completion_tokens = 3, .prefill_ms = 1.5,
                            .ttft_ms = 2.0, .decode_ms = 3.25 };
    mpw_reset(&w);
    wire_result_encode(&w, &r);
    struct WireResult back = { .job = 5 };
    CHECK(wire_result_decode(w.buf.data, w.buf.size, &back, err, sizeof err) == 0, "%s", err);
    CHECK(back.finish == WF_DEADLINE && back.text_len == 7 && !memcmp(back.text, "partial", 7) &&
          back.completion_tokens == 3 && back.decode_ms == 3.25 && !back.has_check, "result");
    /* the self-check's verdict, a log-odds of either sign */
    r.has_check = 1;
    r.check = -2.75f;
    r.has_reliance = 1;
    r.reliance = 0.625f;
    mpw_reset(&w);
    wire_result_encode(&w, &r);
    CHECK(wire_result_decode(w.buf.data, w.buf.size, &back, err, sizeof err) == 0 &&
          back.has_check && back.check == -2.75f && back.has_reliance &&
          back.reliance == 0.625f, "self-check verdict and reliance: %s", err);
    CHECK(back.n_hidden == 0 && !back.hidden, "no hidden rows unless sent");
    /* the residual stream's rows, as the worker sends them; a non-finite one is refused */
    float rows[6] = { 1.5f, -2.0f, 0.0f, 3.25f, 1e-3f, -7.0f };
    r.hidden = rows;
    r.n_hidden = 6;
    mpw_reset(&w);
    wire_result_encode(&w, &r);
    CHECK(wire_result_decode(w.buf.data, w.buf.size, &back, err, sizeof err) == 0 &&
          back.n_hidden == 6 && !memcmp(back.hidden, rows, sizeof rows), "hidden rows: %s", err);
    wire_result_free(&back);
    rows[4] = NAN;
    mpw_reset(&w);
    wire_result_encode(&w, &r);
    CHECK(wire_result_decode(w.buf.data, w.buf.size, &back, err, sizeof err) != 0 &&
          strstr(err, "hidden[4] is not finite"), "NaN row: %s", err);
    r.hidden = NULL;
    r.n_hidden = 0;
    struct WireResult e = { .finish = WF_ERROR, .code = "too_large", .code_len = 9,
                            .message = "too big", .message_len = 7 };
    mpw_reset(&w);
    wire_result_encode(&w, &e);
    CHECK(wire_result_decode(w.buf.data, w.buf.size, &back, err, sizeof err) == 0 &&
          back.finish == WF_ERROR && back.code_len == 9 && !memcmp(back.code, "too_large", 9),
          "error result");
    struct WireInfo info = { .model = "m", .vocab = 512, .n_ctx = 4096, .threads = 2, .kv_bytes = 77 };
    struct WireInfo ib;
    mpw_reset(&w);
    wire_info_encode(&w, &info);
    CHECK(wire_info_decode(w.buf.data, w.buf.size, &ib, err, sizeof err) == 0 &&
          ib.vocab == 512 && ib.n_ctx == 4096 && ib.kv_bytes == 77 && !strcmp(ib.model, "m"), "info");
    mpw_destroy(&w);
}

static void test_proto(void)
{
    struct Config cfg;
    config_defaults(&cfg);
    cfg.max_docs = 3;
    struct MpWriter w;
    mpw_init(&w);
    mpw_map(&w, 8);
    mpw_kv_uint(&w, "v", 1);
    mpw_kv_cstr(&w, "op", "query");
    mpw_kv_cstr(&w, "id", "abc");
    mpw_kv_cstr(&w, "question", "Where?");
    mpw_cstr(&w, "docs");
    mpw_array(&w, 2);
    mpw_map(&w, 1);
    mpw_kv_cstr(&w, "text", "first");
    mpw_map(&w, 2);
    mpw_kv_cstr(&w, "id", "x");
    mpw_kv_cstr(&w, "text", "second");
    mpw_cstr(&w, "stop");
    mpw_cstr(&w, "END");
    mpw_kv_uint(&w, "max_tokens", 9);
    mpw_kv_bool(&w, "stream", 1);
    struct RequestParams p;
    enum ErrCode code;
    char err[256];
    CHECK(proto_decode(w.buf.data, w.buf.size, &cfg, &p, &code, err, sizeof err) == 0, "%s", err);
    CHECK(p.op == OP_QUERY && p.n_docs == 2 && p.max_tokens == 9 && p.stream && p.n_stop == 1,
          "fields");
    CHECK(p.docs[0].id_len == 1 && p.docs[0].id[0] == '1' && p.docs[1].id[0] == 'x', "doc ids");
    CHECK(p.id_raw && p.id_len == 4 && p.id_raw[0] == 0xa3, "raw id");
    CHECK(p.top_k == 0 && p.max_context_tokens == config_default_context(&cfg), "defaults");
    proto_params_free(&p);
    /* a query's default budget: CONFIG_CPU_CONTEXT on CPU workers, the cap on GPU ones, never
     * above the cap; default_context_tokens when set */
    struct Config dc;
    config_defaults(&dc);
    dc.max_context_tokens = 20000;
    CHECK(config_default_context(&dc) == CONFIG_CPU_CONTEXT, "cpu default %ld",
          config_default_context(&dc));
    dc.gpu_workers = 1;
    CHECK(config_default_context(&dc) == 20000, "gpu default %ld", config_default_context(&dc));
    dc.gpu_workers = 0;
    dc.max_context_tokens = CONFIG_CPU_CONTEXT - 100;
    CHECK(config_default_context(&dc) == CONFIG_CPU_CONTEXT - 100, "capped default %ld",
          config_default_context(&dc));
    dc.default_context_tokens = 1000;
    CHECK(config_default_context(&dc) == 1000, "set default %ld", config_default_context(&dc));
    /* the id is echoed even when a later field is wrong */
    mpw_reset(&w);
    mpw_map(&w, 4);
    mpw_kv_uint(&w, "v", 1);
    mpw_kv_cstr(&w, "op", "query");
    mpw_kv_int(&w, "id", -7);
    mpw_kv_int(&w, "max_tokens", -1);
    CHECK(proto_decode(w.buf.data, w.buf.size, &cfg, &p, &code, err, sizeof err) != 0 &&
          code == EC_BAD_REQUEST && p.id_raw && p.id_raw[0] == 0xf9, "%s", err);
    proto_params_free(&p);
    mpw_destroy(&w);
    struct MpWriter e;
    mpw_init(&e);
    proto_error(&e, NULL, 0, EC_TOO_LARGE, "big");
    CHECK(mp_check(e.buf.data, e.buf.size, 4, err, sizeof err) == 0, "error reply is msgpack");
    CHECK(memmem(e.buf.data, e.buf.size, "too_large", 9) != NULL, "code in reply");
    mpw_destroy(&e);
}

/* A query with "history" and "system": the turns are read in order (unknown keys in a turn
 * ignored), and every malformed turn is refused with the turn named. */
enum HistCase { HC_OK, HC_ROLE_SYSTEM, HC_ROLE_OTHER, HC_CONTENT_INT, HC_CONTENT_EMPTY,
                HC_CONTENT_LONG, HC_NO_ROLE, HC_NO_CONTENT, HC_NOT_MAP, HC_NOT_ARRAY, HC_TOO_MANY,
                HC_SYSTEM_EMPTY, HC_SYSTEM_INT, HC_DUP_ROLE, HC_COUNT };

static void write_history_query(struct MpWriter *w, enum HistCase hc)
{
    mpw_reset(w);
    mpw_map(w, 7);
    mpw_kv_uint(w, "v", 1);
    mpw_kv_cstr(w, "op", "query");
    mpw_kv_cstr(w, "question", "And how long?");
    mpw_cstr(w, "docs");
    mpw_array(w, 1);
    mpw_map(w, 1);
    mpw_kv_cstr(w, "text", "The Rhine is 1,230 km long.");
    mpw_cstr(w, "system");
    if (hc == HC_SYSTEM_EMPTY)
        mpw_cstr(w, "");
    else if (hc == HC_SYSTEM_INT)
        mpw_uint(w, 3);
    else
        mpw_cstr(w, "Be brief.");
    mpw_kv_uint(w, "max_tokens", 4);
    mpw_cstr(w, "history");
    if (hc == HC_NOT_ARRAY) {
        mpw_cstr(w, "user: hi");
        return;
    }
    size_t n = hc == HC_TOO_MANY ? PROTO_MAX_HISTORY + 1 : 3;
    mpw_array(w, n);
    for (size_t i = 0; i < n; i++) {
        int last = i == n - 1;
        if (last && hc == HC_NOT_MAP) {
            mpw_cstr(w, "assistant");
            continue;
        }
        int no_role = last && hc == HC_NO_ROLE, no_content = last && hc == HC_NO_CONTENT;
        mpw_map(w, (no_role || no_content ? 1 : 2) + (i == 1) + (last && hc == HC_DUP_ROLE));
        if (!no_role) {
            const char *role = i % 2 ? "assistant" : "user";
            if (last && hc == HC_ROLE_SYSTEM)
                role = "system";
            else if (last && hc == HC_ROLE_OTHER)
                role = "tool";
            mpw_kv_cstr(w, "role", role);
        }
        if (last && hc == HC_DUP_ROLE)
            mpw_kv_cstr(w, "role", "user");
        if (!no_content) {
            if (last && hc == HC_CONTENT_INT)
                mpw_kv_uint(w, "content", 5);
            else if (last && hc == HC_CONTENT_EMPTY)
                mpw_kv_cstr(w, "content", "");
            else if (last && hc == HC_CONTENT_LONG)
                mpw_kv_cstr(w, "content", "this content is longer than the forty bytes allowed");
            else
                mpw_kv_cstr(w, "content", i == 0 ? "Where does the Rhine flow?" : "Into the sea.");
        }
        if (i == 1) {   /* an unknown key (here a map) is skipped */
            mpw_cstr(w, "name");
            mpw_map(w, 1);
            mpw_kv_cstr(w, "k", "v");
        }
    }
}

static void test_proto_history(void)
{
    struct Config cfg;
    config_defaults(&cfg);
    cfg.max_turn_bytes = 40;   /* system text and turns; the question has its own limit */
    struct MpWriter w;
    mpw_init(&w);
    struct RequestParams p;
    enum ErrCode code;
    char err[256];
    write_history_query(&w, HC_OK);
    CHECK(proto_decode(w.buf.data, w.buf.size, &cfg, &p, &code, err, sizeof err) == 0, "%s", err);
    CHECK(p.n_history == 3 && !p.history[0].assistant && p.history[1].assistant && !p.history[2].assistant &&
          p.history[0].len == 26 && !memcmp(p.history[0].text, "Where does the Rhine flow?", 26) &&
          p.history[1].len == 13 && !memcmp(p.history[1].text, "Into the sea.", 13) &&
          p.system.len == 9 && !memcmp(p.system.p, "Be brief.", 9) && p.max_tokens == 4,
          "history and system decoded, oldest first, the unknown key skipped");
    proto_params_free(&p);
    CHECK(p.history == NULL && p.n_history == 0, "freed");
    static const struct { enum HistCase hc; enum ErrCode code; const char *says; } bad[] = {
        { HC_ROLE_SYSTEM, EC_BAD_REQUEST, "history[2].role must be \"user\" or \"assistant\" (a system" },
        { HC_ROLE_OTHER, EC_BAD_REQUEST, "history[2].role must be \"user\" or \"assistant\"" },
        { HC_CONTENT_INT, EC_BAD_REQUEST, "history[2].content must be a string, not" },
        { HC_CONTENT_EMPTY, EC_BAD_REQUEST, "history[2].content is empty" },
        { HC_CONTENT_LONG, EC_TOO_LARGE, "history[2].content has 51 bytes; the limit is 40" },
        { HC_NO_ROLE, EC_BAD_REQUEST, "history[2] has no role" },
        { HC_NO_CONTENT, EC_BAD_REQUEST, "history[2] has no content" },
        { HC_NOT_MAP, EC_BAD_REQUEST, "history[2] must be a map" },
        { HC_NOT_ARRAY, EC_BAD_REQUEST, "history must be an array" },
        { HC_TOO_MANY, EC_TOO_LARGE, "history has 257 turns; the limit is 256" },
        { HC_SYSTEM_EMPTY, EC_BAD_REQUEST, "system is empty" },
        { HC_SYSTEM_INT, EC_BAD_REQUEST, "system must be a string" },
        { HC_DUP_ROLE, EC_BAD_REQUEST, "history[2].role appears twice" },
    };
    cfg.max_message_bytes = 1 << 20;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_history_query(&w, bad[i].hc);
        int rc = proto_decode(w.buf.data, w.buf.size, &cfg, &p, &code, err, sizeof err);
        CHECK(rc != 0 && code == bad[i].code && strstr(err, bad[i].says), "case %zu: %s (%s), wanted %s (%s)", i,
              ec_name(code), err, ec_name(bad[i].code), bad[i].says);
        proto_params_free(&p);
    }
    mpw_destroy(&w);
}

static void test_config(void)
{
    struct Config c;
    char err[256];
    config_defaults(&c);
    CHECK(c.max_message_bytes == 16u << 20 && c.workers == 1 && !strcmp(c.listen,
          "tcp://127.0.0.1:7400"), "defaults");
    CHECK(config_set(&c, "max-message-bytes", "1.5k", err, sizeof err) == 0 &&
          c.max_message_bytes == 1536, "1.5k: %s", err);
    CHECK(config_set(&c, "kv_budget_bytes", "2GiB", err, sizeof err) == 0 &&
          c.kv_budget_bytes == (size_t)2 << 30, "2GiB");
    CHECK(config_set(&c, "max_message_bytes", "-5", err, sizeof err) != 0, "negative size");
    CHECK(config_set(&c, "workers", "300", err, sizeof err) != 0 && strstr(err, "outside"), "%s", err);
    CHECK(config_set(&c, "drain_timeout", "2.5s", err, sizeof err) == 0 && c.drain_timeout == 2.5,
          "seconds");
    CHECK(config_set(&c, "nope", "1", err, sizeof err) != 0 && strstr(err, "unknown"), "%s", err);
    CHECK(config_validate(&c, err, sizeof err) == 0, "%s", err);
    config_set(&c, "listen", "localhost:7400", err, sizeof err);
    CHECK(config_validate(&c, err, sizeof err) != 0 && strstr(err, "listen"), "%s", err);
}

static void test_quote(void)
{
    char out[64];
    CHECK(!strcmp(dlog_quote(out, sizeof out, "abc", 3), "abc"), "%s", out);
    CHECK(!strcmp(dlog_quote(out, sizeof out, "a b\"c\n", 6), "\"a b\\\"c\\n\""), "%s", out);
    CHECK(!strcmp(dlog_quote(out, sizeof out, "", 0), "\"\""), "%s", out);
    char small[6];
    dlog_quote(small, sizeof small, "a long value with spaces", 24);
    CHECK(strlen(small) < sizeof small, "cut");
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static void test_keys(void)
{
    char dir[256], path[512], text[1024], err[512], got[41];
    snprintf(dir, sizeof dir, "%s/diffrag-keys-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    char pub[3][41], sec[3][41];
    unsigned char bin[32];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    for (int i = 0; i < 3; i++)
        CHECK(zmq_curve_keypair(pub[i], sec[i]) == 0, "keypair");
    /* a secret key file: comments and blank lines first; mode 0600 is not "loose" */
    snprintf(path, sizeof path, "%s/s.key", dir);
    snprintf(text, sizeof text, "# secret\n\n  %s\n", sec[0]);
    write_file(path, text);
    chmod(path, 0600);
    int loose = -1;
    CHECK(curve_key_read(path, got, &loose, err, sizeof err) == 0 && !strcmp(got, sec[0]) && loose == 0,
          "secret key: %s", err);
    char derived[41];
    CHECK(curve_public_of(got, derived) == 0 && !strcmp(derived, pub[0]), "public of secret");
    chmod(path, 0644);
    CHECK(curve_key_read(path, got, &loose, err, sizeof err) == 0 && loose == 1, "loose mode seen");
    write_file(path, "# only a comment\n");
    CHECK(curve_key_read(path, got, NULL, err, sizeof err) < 0 && strstr(err, "no CurveZMQ key"), "%s", err);
    write_file(path, "short\n");
    CHECK(curve_key_read(path, got, NULL, err, sizeof err) < 0 && strstr(err, "s.key:1:"), "%s", err);
    /* an allowed-keys file: labels after keys, duplicates, comments */
    snprintf(path, sizeof path, "%s/allowed", dir);
    snprintf(text, sizeof text, "# clients\n%s alice\n\n%s\tbob laptop\n%s alice again\n", pub[0],
             pub[1], pub[0]);
    write_file(path, text);
    struct ZapKeys *k = NULL;
    size_t n = 0;
    CHECK(zap_keys_load(path, &k, &n, err, sizeof err) == 0 && n == 2, "allowed file: %s (n %zu)", err, n);
    zmq_z85_decode(bin, pub[0]);
    CHECK(zap_keys_allow(k, bin), "alice allowed");
    zmq_z85_decode(bin, pub[1]);
    CHECK(zap_keys_allow(k, bin), "bob allowed");
    zmq_z85_decode(bin, pub[2]);
    CHECK(!zap_keys_allow(k, bin), "carol refused");
    CHECK(!zap_keys_allow(NULL, bin), "an absent set admits nobody");
    zap_keys_destroy(&k);
    CHECK(k == NULL, "destroy clears");
    /* one bad line rejects the whole list, naming the line */
    snprintf(text, sizeof text, "%s\n%.39s~\n", pub[0], pub[1]);
    write_file(path, text);
    CHECK(zap_keys_load(path, &k, &n, err, sizeof err) < 0 && k == NULL && strstr(err, "allowed:2:"),
          "bad line: %s", err);
    /* a directory of *.pub files; other files are ignored */
    char sub[300];
    snprintf(sub, sizeof sub, "%s/clients", dir);
    mkdir(sub, 0700);
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/c%d.pub", sub, i);
        snprintf(text, sizeof text, "%s\n", pub[i]);
        write_file(path, text);
    }
    snprintf(path, sizeof path, "%s/notes.txt", sub);
    write_file(path, "not a key\n");
    CHECK(zap_keys_load(sub, &k, &n, err, sizeof err) == 0 && n == 2, "directory: %s", err);
    zap_keys_destroy(&k);
    snprintf(path, sizeof path, "%s/missing", dir);
    CHECK(zap_keys_load(path, &k, &n, err, sizeof err) < 0 && strstr(err, "No such file"), "%s", err);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "cleanup");
}

static void test_faults(void)
{
    char err[256];
    setenv("DIFFRAGD_FAULTS", "worker_engine_error=3", 1);
    CHECK(fault_init(err, sizeof err) == 0 && fault_armed(), "fault_init: %s", err);
    int seq[7];
    for (int i = 0; i < 7; i++)
        seq[i] = fault_hit(FAULT_WORKER_ENGINE_ERROR);
    CHECK(!seq[0] && !seq[1] && seq[2] && !seq[3] && !seq[4] && seq[5] && !seq[6], "every 3rd pass");
    CHECK(!fault_hit(FAULT_WORKER_THREAD_EXIT), "an unarmed point never fires");
    CHECK(!fault_hit(FAULT_COUNT), "out-of-range point");
}

int main(void)
{
    test_mp_round_trip();
    test_mp_str_is_utf8();
    test_mp_random_bytes();
    test_wire();
    test_proto();
    test_proto_history();
    test_config();
    test_quote();
    test_keys();
    test_faults();
    return check_report("test_daemon_units");
}
