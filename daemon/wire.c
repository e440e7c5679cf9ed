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

static const char *const sig_names[WS_N_FLOAT] = {
    "logprob", "entropy", "margin", "doc_mass", "gen_mass", "diff_doc_mass", "lookback",
};

const char *wire_sig_name(int i)
{
    return i >= 0 && i < WS_N_FLOAT ? sig_names[i] : NULL;
}

static void put_u32(uint8_t *p, uint32_t u)
{
    p[0] = (uint8_t)u;
    p[1] = (uint8_t)(u >> 8);
    p[2] = (uint8_t)(u >> 16);
    p[3] = (uint8_t)(u >> 24);
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* n 32-bit words (int32, uint32 or float) as a bin of little-endian words. */
static void put_words_bin(struct MpWriter *w, const void *words, size_t n)
{
    uint8_t *le = malloc(n * 4 + 1);
    if (!le) {
        w->failed = 1;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, (const char *)words + 4 * i, 4);
        put_u32(le + 4 * i, u);
    }
    mpw_bin(w, le, n * 4);
    free(le);
}

/* A bin of little-endian words into a fresh array of n words; NULL when out of memory. */
static void *get_words_bin(const struct MpObj *v, size_t n)
{
    uint32_t *out = malloc(n * 4 + 4);
    if (!out)
        return NULL;
    const uint8_t *p = (const uint8_t *)v->s;
    for (size_t i = 0; i < n; i++)
        out[i] = get_u32(p + 4 * i);
    return out;
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
    mpw_map(w, 7);
    mpw_kv_uint(w, "v", 1);
    mpw_kv_int(w, "max_running", info->max_running);
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
                    key_is(&k, "kv_bytes") || key_is(&k, "max_running")) && !num(&v, &d) &&
                   d >= 0 && d < 1e18) {
            if (key_is(&k, "vocab")) out->vocab = (int64_t)d;
            else if (key_is(&k, "max_running")) out->max_running = (int64_t)d;
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
    if (out->max_running == 0)
        out->max_running = 1;
    if (out->max_running > WIRE_MAX_RUNNING) {
        snprintf(err, errlen, "READY max_running %lld is over %d", (long long)out->max_running,
                 WIRE_MAX_RUNNING);
        return -1;
    }
    return 0;
bad:
    snprintf(err, errlen, "malformed READY body");
    return -1;
}

void wire_job_encode(struct MpWriter *w, const int32_t *tokens, size_t n_tokens, int max_tokens,
                     double temperature, double top_p, uint64_t seed, const char *const *stop,
                     const size_t *stop_lens, size_t n_stop, int stream,
                     const struct WireGround *g)
{
    int watch = g && g->watch, check = g && g->self_check, bare = g && g->bare && g->n_bare;
    int docs = g && g->docs[1] > g->docs[0], refs = g && g->chunk_refs && g->n_spans;
    int hidden = g && g->hidden && g->n_hidden;
    int leads = g && g->lead_tokens && g->doc_leads && g->n_spans;
    int ranks = g && g->doc_ranks && g->n_spans;
    int quote = g && g->quote;
    mpw_map(w, 8 + (watch ? 1 : 0) + (check ? 1 : 0) + (bare ? 1 : 0) + (docs ? 1 : 0) +
                   (refs ? 1 : 0) + (hidden ? 1 : 0) + (leads ? 2 : 0) + (ranks ? 1 : 0) +
                   (quote ? 1 : 0));
    /* int32 little-endian: the x86/arm in-memory layout, converted where it is not */
    mpw_cstr(w, "tokens");
    put_words_bin(w, tokens, n_tokens);
    mpw_kv_int(w, "max_tokens", max_tokens);
    mpw_kv_double(w, "temperature", temperature);
    mpw_kv_double(w, "top_p", top_p);
    mpw_kv_uint(w, "seed", seed);
    mpw_cstr(w, "stop");
    mpw_array(w, n_stop);
    for (size_t i = 0; i < n_stop; i++)
        mpw_str(w, stop[i], stop_lens[i]);
    mpw_kv_bool(w, "stream", stream);
    mpw_cstr(w, "doc_spans");
    put_words_bin(w, g ? g->doc_spans : NULL, g ? 2 * g->n_spans : 0);
    if (watch) {
        mpw_cstr(w, "watch");
        put_words_bin(w, g->watch, 2 * g->n_watch);
    }
    if (check)
        mpw_kv_bool(w, "self_check", 1);
    if (quote)
        mpw_kv_bool(w, "quote", 1);
    if (bare) {
        mpw_cstr(w, "bare");
        put_words_bin(w, g->bare, g->n_bare);
    }
    if (docs) {
        mpw_cstr(w, "docs");
        put_words_bin(w, g->docs, 2);
    }
    if (refs) {
        mpw_cstr(w, "chunk_refs");
        put_words_bin(w, g->chunk_refs, 2 * g->n_spans);
    }
    if (hidden) {
        mpw_cstr(w, "hidden");
        put_words_bin(w, g->hidden, g->n_hidden);
    }
    if (leads) {
        mpw_cstr(w, "lead_tokens");
        put_words_bin(w, g->lead_tokens, g->n_lead_tokens);
        mpw_cstr(w, "doc_leads");
        put_words_bin(w, g->doc_leads, 2 * g->n_spans);
    }
    if (ranks) {
        mpw_cstr(w, "doc_ranks");
        put_words_bin(w, g->doc_ranks, g->n_spans);
    }
}

void wire_job_free(struct WireJob *j)
{
    free(j->tokens);
    free(j->doc_spans);
    free(j->watch);
    free(j->bare);
    free(j->chunk_refs);
    free(j->hidden);
    free(j->lead_tokens);
    free(j->doc_leads);
    free(j->doc_ranks);
    for (size_t i = 0; i < j->n_stop; i++)
        free(j->stop[i]);
    free(j->stop);
    memset(j, 0, sizeof *j);
}

int wire_job_decode(const void *buf, size_t len, struct WireJob *out, char *err, size_t errlen)
{
    struct MpCursor c;
    uint32_t n;
    size_t n_refs = 0, n_leads = 0, n_ranks = 0;
    int leads_given = 0;
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
            out->tokens = get_words_bin(&v, out->n_tokens);
            if (!out->tokens) goto nomem;
        } else if (key_is(&k, "doc_spans")) {
            if (v.type != MP_BIN || v.len % 8 || out->doc_spans) goto bad;
            out->n_spans = v.len / 8;
            out->doc_spans = get_words_bin(&v, 2 * out->n_spans);
            if (!out->doc_spans) goto nomem;
        } else if (key_is(&k, "watch")) {
            if (v.type != MP_BIN || v.len % 8 || v.len / 8 > WIRE_MAX_WATCH || out->watch_given)
                goto bad;
            out->n_watch = v.len / 8;
            out->watch = get_words_bin(&v, 2 * out->n_watch);
            out->watch_given = 1;
            if (!out->watch) goto nomem;
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
        } else if (key_is(&k, "self_check")) {
            if (v.type != MP_BOOL) goto bad;
            out->self_check = v.v.b;
        } else if (key_is(&k, "quote")) {
            if (v.type != MP_BOOL) goto bad;
            out->quote = v.v.b;
        } else if (key_is(&k, "docs")) {
            if (v.type != MP_BIN || v.len != 8 || out->docs[1]) goto bad;
            uint32_t *d2 = get_words_bin(&v, 2);
            if (!d2) goto nomem;
            out->docs[0] = d2[0];
            out->docs[1] = d2[1];
            free(d2);
            if (out->docs[1] <= out->docs[0]) goto bad;
        } else if (key_is(&k, "chunk_refs")) {
            if (v.type != MP_BIN || v.len % 8 || out->chunk_refs) goto bad;
            n_refs = v.len / 8;
            out->chunk_refs = get_words_bin(&v, 2 * n_refs);
            if (!out->chunk_refs) goto nomem;
        } else if (key_is(&k, "lead_tokens")) {
            if (v.type != MP_BIN || v.len % 4 || leads_given & 1) goto bad;
            leads_given |= 1;
            out->n_lead_tokens = v.len / 4;
            out->lead_tokens = get_words_bin(&v, out->n_lead_tokens);
            if (!out->lead_tokens) goto nomem;
        } else if (key_is(&k, "doc_ranks")) {
            if (v.type != MP_BIN || v.len % 4 || out->doc_ranks) goto bad;
            n_ranks = v.len / 4;
            out->doc_ranks = get_words_bin(&v, n_ranks);
            if (!out->doc_ranks) goto nomem;
        } else if (key_is(&k, "doc_leads")) {
            if (v.type != MP_BIN || v.len % 8 || leads_given & 2) goto bad;
            leads_given |= 2;
            n_leads = v.len / 8;
            out->doc_leads = get_words_bin(&v, 2 * n_leads);
            if (!out->doc_leads) goto nomem;
        } else if (key_is(&k, "hidden")) {
            if (v.type != MP_BIN || v.len % 4 || v.len == 0 || v.len / 4 > WIRE_MAX_HIDDEN ||
                out->hidden)
                goto bad;
            out->n_hidden = v.len / 4;
            out->hidden = get_words_bin(&v, out->n_hidden);
            if (!out->hidden) goto nomem;
        } else if (key_is(&k, "bare")) {
            if (v.type != MP_BIN || v.len % 4 || v.len == 0 || out->bare) goto bad;
            out->n_bare = v.len / 4;
            out->bare = get_words_bin(&v, out->n_bare);
            if (!out->bare) goto nomem;
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
    for (size_t i = 0; i < out->n_spans; i++)
        if (out->doc_spans[2 * i] > out->doc_spans[2 * i + 1] ||
            out->doc_spans[2 * i + 1] > out->n_tokens ||
            (out->docs[1] && (out->doc_spans[2 * i] < out->docs[0] ||
                              out->doc_spans[2 * i + 1] > out->docs[1] ||
                              (i && out->doc_spans[2 * i] < out->doc_spans[2 * i - 1])))) {
            snprintf(err, errlen, "JOB document span %zu is outside the prompt or its documents, "
                     "or out of order", i);
            wire_job_free(out);
            return -1;
        }
    if (out->chunk_refs && (n_refs != out->n_spans || !out->docs[1])) {
        snprintf(err, errlen, "JOB chunk_refs has %zu entries for %zu document spans, or comes "
                 "without docs", n_refs, out->n_spans);
        wire_job_free(out);
        return -1;
    }
    if (leads_given && (leads_given != 3 || n_leads != out->n_spans ||
                        out->n_lead_tokens > out->n_tokens)) {
        snprintf(err, errlen, "JOB leads come without their ranges, have %zu ranges for %zu "
                 "document spans, or %zu tokens for a prompt of %zu", n_leads, out->n_spans,
                 out->n_lead_tokens, out->n_tokens);
        wire_job_free(out);
        return -1;
    }
    if (out->doc_ranks && n_ranks != out->n_spans) {
        snprintf(err, errlen, "JOB has %zu ranks for %zu document spans", n_ranks, out->n_spans);
        wire_job_free(out);
        return -1;
    }
    for (size_t i = 0; i < n_leads; i++)
        if (out->doc_leads[2 * i] > out->doc_leads[2 * i + 1] ||
            out->doc_leads[2 * i + 1] > out->n_lead_tokens) {
            snprintf(err, errlen, "JOB lead %zu is outside the lead tokens", i);
            wire_job_free(out);
            return -1;
        }
    for (size_t i = 0; i < out->n_lead_tokens; i++)
        if (out->lead_tokens[i] < 0) {
            snprintf(err, errlen, "JOB has a negative lead token");
            wire_job_free(out);
            return -1;
        }
    if (out->docs[1] > out->n_tokens) {
        snprintf(err, errlen, "JOB documents end past the prompt");
        wire_job_free(out);
        return -1;
    }
    for (size_t i = 0; i < out->n_watch; i++)
        if (out->watch[2 * i] < 0 || out->watch[2 * i + 1] < 0) {
            snprintf(err, errlen, "JOB watches a negative layer or head");
            wire_job_free(out);
            return -1;
        }
    for (size_t i = 0; i < out->n_hidden; i++)
        if (out->hidden[i] < 0) {
            snprintf(err, errlen, "JOB asks for a negative hidden layer");
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
    mpw_map(w, 8 + (is_err ? 2 : 0) + (r->has_signals ? 1 : 0) + (r->has_check ? 1 : 0) +
               (r->has_reliance ? 1 : 0) + (r->reused_tokens > 0 ? 1 : 0) +
               (r->n_hidden > 0 ? 1 : 0) + (r->n_quotes > 0 ? 1 : 0));
    mpw_kv_cstr(w, "finish", wire_finish_name(r->finish));
    mpw_kv_str(w, "text", r->text ? r->text : "", r->text ? r->text_len : 0);
    mpw_kv_int(w, "prompt_tokens", r->prompt_tokens);
    mpw_kv_int(w, "completion_tokens", r->completion_tokens);
    mpw_kv_int(w, "cached_tokens", r->cached_tokens);
    if (r->reused_tokens > 0)
        mpw_kv_int(w, "reused_tokens", r->reused_tokens);
    mpw_kv_double(w, "prefill_ms", r->prefill_ms);
    mpw_kv_double(w, "ttft_ms", r->ttft_ms);
    mpw_kv_double(w, "decode_ms", r->decode_ms);
    if (r->has_check)
        mpw_kv_double(w, "self_check", r->check);
    if (r->has_reliance)
        mpw_kv_double(w, "reliance", r->reliance);
    if (r->has_signals) {
        mpw_cstr(w, "signals");
        mpw_map(w, WS_N_FLOAT + 2 + (r->sig.quote_removed ? 1 : 0));
        mpw_kv_uint(w, "n", r->sig.n);
        for (int i = 0; i < WS_N_FLOAT; i++) {
            mpw_cstr(w, sig_names[i]);
            put_words_bin(w, r->sig.f[i], r->sig.n);
        }
        mpw_cstr(w, "text_end");
        put_words_bin(w, r->sig.text_end, r->sig.n);
        if (r->sig.quote_removed) {
            mpw_cstr(w, "quote_removed");
            put_words_bin(w, r->sig.quote_removed, r->sig.n);
        }
    }
    if (r->n_quotes > 0) {
        mpw_cstr(w, "quotes");
        put_words_bin(w, r->quotes, 3 * r->n_quotes);
    }
    if (r->n_hidden > 0) {
        mpw_cstr(w, "hidden");
        put_words_bin(w, r->hidden, r->n_hidden);
    }
    if (is_err) {
        mpw_kv_str(w, "code", r->code ? r->code : "internal", r->code ? r->code_len : 8);
        mpw_kv_str(w, "message", r->message ? r->message : "", r->message ? r->message_len : 0);
    }
}

void wire_result_free(struct WireResult *r)
{
    for (int i = 0; i < WS_N_FLOAT; i++) {
        free(r->sig.f[i]);
        r->sig.f[i] = NULL;
    }
    free(r->sig.text_end);
    r->sig.text_end = NULL;
    free(r->sig.quote_removed);
    r->sig.quote_removed = NULL;
    r->sig.n = 0;
    r->has_signals = 0;
    free(r->quotes);
    r->quotes = NULL;
    r->n_quotes = 0;
    free(r->hidden);
    r->hidden = NULL;
    r->n_hidden = 0;
}

/* The signals map: every array present once, n words long, floats finite. */
static int signals_decode(struct MpCursor *c, const struct MpObj *m, struct WireSignals *sg,
                          char *err, size_t errlen)
{
    const struct MpObj *arrays[WS_N_FLOAT + 2] = { 0 };   /* the floats, text_end, quote_removed */
    struct MpObj vals[WS_N_FLOAT + 2];
    int have_n = 0;
    uint64_t n = 0;
    for (uint32_t i = 0; i < m->v.n; i++) {
        struct MpObj k, v;
        if (mp_next(c, &k) || mp_next(c, &v))
            goto bad;
        int slot = -1;
        if (key_is(&k, "n")) {
            if (v.type != MP_UINT || have_n || v.v.u > (1u << 24))
                goto bad;
            n = v.v.u;
            have_n = 1;
        } else if (key_is(&k, "text_end")) {
            slot = WS_N_FLOAT;
        } else if (key_is(&k, "quote_removed")) {
            slot = WS_N_FLOAT + 1;
        } else {
            for (int s = 0; s < WS_N_FLOAT; s++)
                if (key_is(&k, sig_names[s]))
                    slot = s;
        }
        if (slot >= 0) {
            if (v.type != MP_BIN || arrays[slot])
                goto bad;
            vals[slot] = v;
            arrays[slot] = &vals[slot];
        } else if (v.type == MP_ARRAY || v.type == MP_MAP) {
            if (mp_skip_body(c, &v))
                goto bad;
        }
    }
    if (!have_n)
        goto bad;
    for (int s = 0; s <= WS_N_FLOAT; s++)
        if (!arrays[s] || arrays[s]->len != n * 4) {
            snprintf(err, errlen, "RESULT signals: %s is not %llu values long",
                     s < WS_N_FLOAT ? sig_names[s] : "text_end", (unsigned long long)n);
            return -1;
        }
    sg->n = (size_t)n;
    for (int s = 0; s <= WS_N_FLOAT; s++) {
        void *a = get_words_bin(arrays[s], sg->n);
        if (!a) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        if (s < WS_N_FLOAT)
            sg->f[s] = a;
        else
            sg->text_end = a;
    }
    for (int s = 0; s < WS_N_FLOAT; s++)
        for (size_t i = 0; i < sg->n; i++)
            if (!isfinite(sg->f[s][i])) {
                snprintf(err, errlen, "RESULT signals: %s[%zu] is not finite", sig_names[s], i);
                return -1;
            }
    if (arrays[WS_N_FLOAT + 1]) {
        if (arrays[WS_N_FLOAT + 1]->len != n * 4) {
            snprintf(err, errlen, "RESULT signals: quote_removed is not %llu values long",
                     (unsigned long long)n);
            return -1;
        }
        sg->quote_removed = get_words_bin(arrays[WS_N_FLOAT + 1], sg->n);
        if (!sg->quote_removed && sg->n) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        for (size_t i = 0; i < sg->n; i++)
            if (!(sg->quote_removed[i] >= 0 && sg->quote_removed[i] <= 1)) {
                snprintf(err, errlen, "RESULT signals: quote_removed[%zu] is not in [0, 1]", i);
                return -1;
            }
    }
    return 0;
bad:
    snprintf(err, errlen, "malformed RESULT signals");
    return -1;
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
        } else if (key_is(&k, "self_check")) {
            /* a log-odds: any finite number (num refuses the others) */
            if (num(&v, &d) || fabs(d) > 1e6 || out->has_check) goto bad;
            out->has_check = 1;
            out->check = (float)d;
        } else if (key_is(&k, "reliance")) {
            if (num(&v, &d) || fabs(d) > 1e6 || out->has_reliance) goto bad;
            out->has_reliance = 1;
            out->reliance = (float)d;
        } else if (key_is(&k, "hidden")) {
            if (v.type != MP_BIN || v.len % 4 || v.len == 0 ||
                v.len / 4 > WIRE_MAX_HIDDEN_FLOATS || out->hidden)
                goto bad;
            out->n_hidden = v.len / 4;
            out->hidden = get_words_bin(&v, out->n_hidden);
            if (!out->hidden) {
                snprintf(err, errlen, "out of memory");
                wire_result_free(out);
                return -1;
            }
            for (size_t j = 0; j < out->n_hidden; j++)
                if (!isfinite(out->hidden[j])) {
                    snprintf(err, errlen, "RESULT hidden[%zu] is not finite", j);
                    wire_result_free(out);
                    return -1;
                }
        } else if (key_is(&k, "quotes")) {
            if (v.type != MP_BIN || v.len % 12 || v.len == 0 || v.len / 12 > WIRE_MAX_QUOTES ||
                out->quotes)
                goto bad;
            out->n_quotes = v.len / 12;
            out->quotes = get_words_bin(&v, 3 * out->n_quotes);
            if (!out->quotes) {
                snprintf(err, errlen, "out of memory");
                wire_result_free(out);
                return -1;
            }
            for (size_t j = 0; j < out->n_quotes; j++)
                if (out->quotes[3 * j + 1] >= out->quotes[3 * j + 2]) {
                    snprintf(err, errlen, "RESULT quotes[%zu] is empty or reversed", j);
                    wire_result_free(out);
                    return -1;
                }
        } else if (key_is(&k, "signals")) {
            if (v.type != MP_MAP || out->has_signals) goto bad;
            out->has_signals = 1;
            if (signals_decode(&c, &v, &out->sig, err, errlen)) {
                wire_result_free(out);
                return -1;
            }
        } else if (!num(&v, &d) && d >= 0 && d < 1e15) {
            if (key_is(&k, "prompt_tokens")) out->prompt_tokens = (int64_t)d;
            else if (key_is(&k, "completion_tokens")) out->completion_tokens = (int64_t)d;
            else if (key_is(&k, "cached_tokens")) out->cached_tokens = (int64_t)d;
            else if (key_is(&k, "reused_tokens")) out->reused_tokens = (int64_t)d;
            else if (key_is(&k, "prefill_ms")) out->prefill_ms = d;
            else if (key_is(&k, "ttft_ms")) out->ttft_ms = d;
            else if (key_is(&k, "decode_ms")) out->decode_ms = d;
        } else if (v.type == MP_ARRAY || v.type == MP_MAP) {
            if (mp_skip_body(&c, &v)) goto bad;
        }
    }
    if (!have_finish)
        goto bad;
    if (out->has_signals) {
        /* token i owns text[text_end[i-1] .. text_end[i]): in order, on character boundaries,
         * covering the whole text */
        const struct WireSignals *sg = &out->sig;
        const uint8_t *t = (const uint8_t *)out->text;
        uint32_t prev = 0;
        const char *why = NULL;
        if ((int64_t)sg->n > out->completion_tokens)
            why = "more signals than completion tokens";
        for (size_t i = 0; !why && i < sg->n; i++) {
            uint32_t e = sg->text_end[i];
            if (e < prev || e > out->text_len)
                why = "text_end out of order or past the text";
            else if (e < out->text_len && (t[e] & 0xC0) == 0x80)
                why = "text_end inside a character";
            prev = e;
        }
        if (!why && sg->n && prev != out->text_len)
            why = "text_end does not reach the end of the text";
        if (why) {
            snprintf(err, errlen, "RESULT signals: %s", why);
            wire_result_free(out);
            return -1;
        }
    }
    return 0;
bad:
    snprintf(err, errlen, "malformed RESULT body");
    wire_result_free(out);
    return -1;
}
