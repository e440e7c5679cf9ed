/* Encoding and decoding of the broker <-> worker message bodies (READY info, JOB, RESULT).
 * Remote workers are peers on the network, so decoding checks every type and size. */
#include "daemon/wire.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const finish_names[] = { "stop", "length", "cancelled", "deadline", "error" };

const char *wire_finish_name(enum WireFinish f)
{
    return (unsigned)f <= WF_ERROR ? finish_names[f] : "error";
}

int wire_finish_parse(const char *s, size_t len)
{
    for (int i = 0; i <= WF_ERROR; i++)
        if (strlen(finish_names[i]) == len && !memcmp(finish_names[i], s, len))
            return i;
    return -1;
}

static int key_is(const struct MpObj *k, const char *name)
{
    return k->type == MP_STR && k->len == strlen(name) && !memcmp(k->s, name, k->len);
}

static int num(const struct MpObj *v, double *out)
{
    if (v->type == MP_UINT) *out = (double)v->v.u;
    else if (v->type == MP_INT) *out = (double)v->v.i;
    else if (v->type == MP_FLOAT) *out = v->v.f;
    else return -1;
    return isfinite(*out) ? 0 : -1;
}

/* Opens the single map a body must be. */
static int open_map(const void *buf, size_t len, struct MpCursor *c, uint32_t *n, char *err,
                    size_t errlen)
{
    if (mp_check(buf, len, 4, err, errlen))
        return -1;
    mp_cursor_init(c, buf, len);
    struct MpObj m;
    if (mp_next(c, &m) || m.type != MP_MAP) {
        snprintf(err, errlen, "body is not a map");
        return -1;
    }
    *n = m.v.n;
    return 0;
}

void wire_info_encode(struct MpWriter *w, const struct WireInfo *info)
{
    mpw_map(w, 6);
    mpw_kv_uint(w, "v", 1);
    mpw_kv_cstr(w, "model", info->model);
    mpw_kv_int(w, "vocab", info->vocab);
    mpw_kv_int(w, "n_ctx", info->n_ctx);
    mpw_kv_uint(w, "kv_bytes", info->kv_bytes);
    mpw_kv_int(w, "threads", info->threads);
}

int wire_info_decode(const void *buf, size_t len, struct WireInfo *out, char *err, size_t errlen)
{
    struct MpCursor c;
    uint32_t n;
    memset(out, 0, sizeof *out);
    if (open_map(buf, len, &c, &n, err, errlen))
        return -1;
    int have_v = 0;
    for (uint32_t i = 0; i < n; i++) {
        struct MpObj k, v;
        if (mp_next(&c, &k) || mp_next(&c, &v)) goto bad;
        double d;
        if (key_is(&k, "v")) {
            if (v.type != MP_UINT || v.v.u != 1) {
                snprintf(err, errlen, "worker speaks another protocol version");
                return -1;
            }
            have_v = 1;
        } else if (key_is(&k, "model") && v.type == MP_STR) {
            size_t l = v.len < sizeof out->model - 1 ? v.len : sizeof out->model - 1;
            memcpy(out->model, v.s, l);
            out->model[l] = 0;
        } else if ((key_is(&k, "vocab") || key_is(&k, "n_ctx") || key_is(&k, "threads") ||
                    key_is(&k, "kv_bytes")) && !num(&v, &d) && d >= 0 && d < 1e18) {
            if (key_is(&k, "vocab")) out->vocab = (int64_t)d;
            else if (key_is(&k, "n_ctx")) out->n_ctx = (int64_t)d;
            else if (key_is(&k, "threads")) out->threads = (int64_t)d;
            else out->kv_bytes = (uint64_t)d;
        }
        if (v.type == MP_ARRAY || v.type == MP_MAP)
            if (mp_skip_body(&c, &v)) goto bad;
    }
    if (!have_v || out->vocab <= 0 || out->n_ctx <= 0) {
        snprintf(err, errlen, "READY lacks v, vocab or n_ctx");
        return -1;
    }
    return 0;
bad:
    snprintf(err, errlen, "malformed READY body");
    return -1;
}

void wire_job_encode(struct MpWriter *w, const int32_t *tokens, size_t n_tokens, int max_tokens,
                     double temperature, double top_p, uint64_t seed, const char *const *stop,
                     const size_t *stop_lens, size_t n_stop, int stream)
{
    mpw_map(w, 7);
    mpw_cstr(w, "tokens");
    /* int32 little-endian: the x86/arm in-memory layout, converted where it is not */
    uint8_t *le = malloc(n_tokens * 4 + 1);
    if (!le) {
        w->failed = 1;
        return;
    }
    for (size_t i = 0; i < n_tokens; i++) {
        uint32_t u = (uint32_t)tokens[i];
        le[4 * i] = (uint8_t)u;
        le[4 * i + 1] = (uint8_t)(u >> 8);
        le[4 * i + 2] = (uint8_t)(u >> 16);
        le[4 * i + 3] = (uint8_t)(u >> 24);
    }
    mpw_bin(w, le, n_tokens * 4);
    free(le);
    mpw_kv_int(w, "max_tokens", max_tokens);
    mpw_kv_double(w, "temperature", temperature);
    mpw_kv_double(w, "top_p", top_p);
    mpw_kv_uint(w, "seed", seed);
    mpw_cstr(w, "stop");
    mpw_array(w, n_stop);
    for (size_t i = 0; i < n_stop; i++)
        mpw_str(w, stop[i], stop_lens[i]);
    mpw_kv_bool(w, "stream", stream);
}

void wire_job_free(struct WireJob *j)
{
    free(j->tokens);
    for (size_t i = 0; i < j->n_stop; i++)
        free(j->stop[i]);
    free(j->stop);
    memset(j, 0, sizeof *j);
}

int wire_job_decode(const void *buf, size_t len, struct WireJob *out, char *err, size_t errlen)
{
    struct MpCursor c;
    uint32_t n;
    uint64_t job = out->job;
    memset(out, 0, sizeof *out);
    out->job = job;
    out->top_p = 1;
    if (open_map(buf, len, &c, &n, err, errlen))
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        struct MpObj k, v;
        double d;
        if (mp_next(&c, &k) || mp_next(&c, &v)) goto bad;
        if (key_is(&k, "tokens")) {
            if (v.type != MP_BIN || v.len % 4 || v.len == 0 || out->tokens) goto bad;
            out->n_tokens = v.len / 4;
            out->tokens = malloc(v.len);
            if (!out->tokens) goto nomem;
            const uint8_t *p = (const uint8_t *)v.s;
            for (size_t t = 0; t < out->n_tokens; t++)
                out->tokens[t] = (int32_t)((uint32_t)p[4 * t] | (uint32_t)p[4 * t + 1] << 8 |
                                           (uint32_t)p[4 * t + 2] << 16 | (uint32_t)p[4 * t + 3] << 24);
        } else if (key_is(&k, "max_tokens")) {
            if (num(&v, &d) || d < 1 || d > 1 << 20) goto bad;
            out->max_tokens = (int)d;
        } else if (key_is(&k, "temperature")) {
            if (num(&v, &d) || d < 0 || d > 100) goto bad;
            out->temperature = (float)d;
        } else if (key_is(&k, "top_p")) {
            if (num(&v, &d) || d <= 0 || d > 1) goto bad;
            out->top_p = (float)d;
        } else if (key_is(&k, "seed")) {
            if (v.type != MP_UINT) goto bad;
            out->seed = v.v.u;
        } else if (key_is(&k, "stream")) {
            if (v.type != MP_BOOL) goto bad;
            out->stream = v.v.b;
        } else if (key_is(&k, "stop")) {
            if (v.type != MP_ARRAY || v.v.n > WIRE_MAX_STOP || out->stop) goto bad;
            out->stop = calloc(v.v.n + 1, sizeof *out->stop);
            if (!out->stop) goto nomem;
            for (uint32_t s = 0; s < v.v.n; s++) {
                struct MpObj e;
                if (mp_next(&c, &e) || e.type != MP_STR || e.len == 0 ||
                    e.len > WIRE_MAX_STOP_BYTES || memchr(e.s, 0, e.len))
                    goto bad;
                out->stop[s] = malloc(e.len + 1);
                if (!out->stop[s]) goto nomem;
                memcpy(out->stop[s], e.s, e.len);
                out->stop[s][e.len] = 0;
                out->n_stop++;
            }
        } else if (v.type == MP_ARRAY || v.type == MP_MAP) {
            if (mp_skip_body(&c, &v)) goto bad;
        }
    }
    if (!out->tokens || out->max_tokens < 1) {
        snprintf(err, errlen, "JOB lacks tokens or max_tokens");
        wire_job_free(out);
        return -1;
    }
    return 0;
nomem:
    snprintf(err, errlen, "out of memory");
    wire_job_free(out);
    return -1;
bad:
    snprintf(err, errlen, "malformed JOB body");
    wire_job_free(out);
    return -1;
}

void wire_result_encode(struct MpWriter *w, const struct WireResult *r)
{
    int is_err = r->finish == WF_ERROR;
    mpw_map(w, 7 + (is_err ? 2 : 0));
    mpw_kv_cstr(w, "finish", wire_finish_name(r->finish));
    mpw_kv_str(w, "text", r->text ? r->text : "", r->text ? r->text_len : 0);
    mpw_kv_int(w, "prompt_tokens", r->prompt_tokens);
    mpw_kv_int(w, "completion_tokens", r->completion_tokens);
    mpw_kv_double(w, "prefill_ms", r->prefill_ms);
    mpw_kv_double(w, "ttft_ms", r->ttft_ms);
    mpw_kv_double(w, "decode_ms", r->decode_ms);
    if (is_err) {
        mpw_kv_str(w, "code", r->code ? r->code : "internal", r->code ? r->code_len : 8);
        mpw_kv_str(w, "message", r->message ? r->message : "", r->message ? r->message_len : 0);
    }
}

int wire_result_decode(const void *buf, size_t len, struct WireResult *out, char *err, size_t errlen)
{
    struct MpCursor c;
    uint32_t n;
    uint64_t job = out->job;
    memset(out, 0, sizeof *out);
    out->job = job;
    int have_finish = 0;
    if (open_map(buf, len, &c, &n, err, errlen))
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        struct MpObj k, v;
        double d;
        if (mp_next(&c, &k) || mp_next(&c, &v)) goto bad;
        if (key_is(&k, "finish")) {
            int f = v.type == MP_STR ? wire_finish_parse(v.s, v.len) : -1;
            if (f < 0) goto bad;
            out->finish = (enum WireFinish)f;
            have_finish = 1;
        } else if (key_is(&k, "text")) {
            if (v.type != MP_STR) goto bad;
            out->text = v.s;
            out->text_len = v.len;
        } else if (key_is(&k, "code") && v.type == MP_STR) {
            out->code = v.s;
            out->code_len = v.len;
        } else if (key_is(&k, "message") && v.type == MP_STR) {
            out->message = v.s;
            out->message_len = v.len;
        } else if (!num(&v, &d) && d >= 0 && d < 1e15) {
            if (key_is(&k, "prompt_tokens")) out->prompt_tokens = (int64_t)d;
            else if (key_is(&k, "completion_tokens")) out->completion_tokens = (int64_t)d;
            else if (key_is(&k, "prefill_ms")) out->prefill_ms = d;
            else if (key_is(&k, "ttft_ms")) out->ttft_ms = d;
            else if (key_is(&k, "decode_ms")) out->decode_ms = d;
        } else if (v.type == MP_ARRAY || v.type == MP_MAP) {
            if (mp_skip_body(&c, &v)) goto bad;
        }
    }
    if (!have_finish)
        goto bad;
    return 0;
bad:
    snprintf(err, errlen, "malformed RESULT body");
    return -1;
}
