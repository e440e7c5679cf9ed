/* Decoding and validation of client requests, and the error reply. A request is checked whole
 * (msgpack well-formed, nesting bounded) before any field is read, every field's type and
 * range is checked, and every count is compared with its limit before an array is sized.
 * The op's row in the op table (ops.c) names which of the per-op decoders below runs. */
#include "daemon/proto.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/ops.h"
#include "retriever/context.h"
#include "retriever/planner.h"
#include "text/utf8.h"

static const char *const ec_names[EC_COUNT] = { "ok", "bad_request", "too_large", "overloaded",
                                                "not_found", "deadline_exceeded", "cancelled",
                                                "shutting_down", "unsupported_version", "internal" };

const char *ec_name(enum ErrCode c)
{
    return (unsigned)c < EC_COUNT ? ec_names[c] : "internal";
}

/* The keys the protocol knows; values are found in a first pass, then decoded by name. */
enum Key { K_V, K_OP, K_ID, K_QUESTION, K_DOCS, K_COLLECTION, K_IDS, K_TOP_K, K_MAX_CONTEXT,
           K_MAX_TOKENS, K_TEMPERATURE, K_TOP_P, K_SEED, K_STOP, K_STREAM, K_DEADLINE, K_TARGET,
           K_DOC_ID, K_AFTER, K_LIMIT, K_INCLUDE, K_ORDER, K_RELEVANCE, K_HISTORY, K_SYSTEM,
           K_UNSUPPORTED, K_ANSWER_MODE, K_COUNT };
static const char *const key_names[K_COUNT] = {
    "v", "op", "id", "question", "docs", "collection", "ids", "top_k", "max_context_tokens",
    "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "deadline_ms", "target",
    "doc_id", "after", "limit", "include", "order", "relevance_floor", "history", "system",
    "unsupported", "answer_mode" };

struct ProtoDec {
    const uint8_t *end;
    const uint8_t *val[K_COUNT];   /* where each key's value starts; NULL: absent */
    const struct Config *cfg;
    struct RequestParams *p;
    enum ErrCode *code;
    char *err;
    size_t errlen;
};

#define FAIL(d, c, ...) do { *(d)->code = (c); snprintf((d)->err, (d)->errlen, __VA_ARGS__); return -1; } while (0)

static int read_at(struct ProtoDec *d, enum Key k, struct MpCursor *c, struct MpObj *o)
{
    c->p = d->val[k];
    c->end = d->end;
    return mp_next(c, o);  /* cannot fail: the message passed mp_check */
}

static int utf8_ok(const char *s, size_t len)
{
    return utf8_valid(s, len, NULL);
}

static int check_str(struct ProtoDec *d, const char *what, const struct MpObj *o, size_t min, size_t max,
                     enum ErrCode too_long, struct Slice *out)
{
    if (o->type != MP_STR)
        FAIL(d, EC_BAD_REQUEST, "%s must be a string, not %s", what, mp_type_name(o->type));
    if (o->len < min)
        FAIL(d, EC_BAD_REQUEST, "%s is empty", what);
    if (o->len > max)
        FAIL(d, too_long, "%s has %u bytes; the limit is %zu", what, o->len, max);
    if (!utf8_ok(o->s, o->len))
        FAIL(d, EC_BAD_REQUEST, "%s is not valid UTF-8", what);
    out->p = o->s;
    out->len = o->len;
    return 0;
}

static int get_str(struct ProtoDec *d, enum Key k, size_t min, size_t max, enum ErrCode too_long,
                   struct Slice *out)
{
    struct MpCursor c;
    struct MpObj o;
    if (!d->val[k])
        return 0;
    read_at(d, k, &c, &o);
    return check_str(d, key_names[k], &o, min, max, too_long, out);
}

/* An integer field: below min is a bad_request, above cap (the configured limit; < 0: none)
 * too_large, above max_bad (outside the field's meaning) a bad_request. */
static int get_int(struct ProtoDec *d, enum Key k, long min, long max_bad, long cap, long *out)
{
    struct MpCursor c;
    struct MpObj o;
    if (!d->val[k])
        return 0;
    read_at(d, k, &c, &o);
    if (o.type == MP_INT)
        FAIL(d, EC_BAD_REQUEST, "%s must not be negative (%lld)", key_names[k], (long long)o.v.i);
    if (o.type != MP_UINT)
        FAIL(d, EC_BAD_REQUEST, "%s must be an integer, not %s", key_names[k], mp_type_name(o.type));
    if (o.v.u < (uint64_t)min)
        FAIL(d, EC_BAD_REQUEST, "%s is %llu; it must be at least %ld", key_names[k],
             (unsigned long long)o.v.u, min);
    if (cap >= 0 && o.v.u > (uint64_t)cap)
        FAIL(d, EC_TOO_LARGE, "%s is %llu; the limit is %ld", key_names[k],
             (unsigned long long)o.v.u, cap);
    if (o.v.u > (uint64_t)max_bad)
        FAIL(d, EC_BAD_REQUEST, "%s is %llu; it must be at most %ld", key_names[k],
             (unsigned long long)o.v.u, max_bad);
    *out = (long)o.v.u;
    return 0;
}

static int get_double(struct ProtoDec *d, enum Key k, double lo, int lo_open, double hi, double *out)
{
    struct MpCursor c;
    struct MpObj o;
    if (!d->val[k])
        return 0;
    read_at(d, k, &c, &o);
    double v;
    if (o.type == MP_UINT) v = (double)o.v.u;
    else if (o.type == MP_INT) v = (double)o.v.i;
    else if (o.type == MP_FLOAT) v = o.v.f;
    else FAIL(d, EC_BAD_REQUEST, "%s must be a number, not %s", key_names[k], mp_type_name(o.type));
    if (!isfinite(v) || v < lo || (lo_open && v == lo) || v > hi)
        FAIL(d, EC_BAD_REQUEST, "%s is %g; it must be within %s%g..%g]", key_names[k], v,
             lo_open ? "(" : "[", lo, hi);
    *out = v;
    return 0;
}

static int get_bool(struct ProtoDec *d, enum Key k, int *out)
{
    struct MpCursor c;
    struct MpObj o;
    if (!d->val[k])
        return 0;
    read_at(d, k, &c, &o);
    if (o.type != MP_BOOL)
        FAIL(d, EC_BAD_REQUEST, "%s must be true or false, not %s", key_names[k], mp_type_name(o.type));
    *out = o.v.b;
    return 0;
}

static int check_collection(struct ProtoDec *d)
{
    struct Slice *s = &d->p->collection;
    if (get_str(d, K_COLLECTION, 1, INDEX_MAX_COLLECTION_BYTES, EC_BAD_REQUEST, s))
        return -1;
    for (size_t i = 0; i < s->len; i++) {
        unsigned char ch = (unsigned char)s->p[i];
        if (ch < 0x20 || ch == 0x7f)
            FAIL(d, EC_BAD_REQUEST, "collection has a control character");
    }
    return 0;
}

static int decode_ids(struct ProtoDec *d)
{
    struct MpCursor c;
    struct MpObj o;
    struct RequestParams *p = d->p;
    if (!d->val[K_IDS])
        return 0;
    read_at(d, K_IDS, &c, &o);
    if (o.type != MP_ARRAY)
        FAIL(d, EC_BAD_REQUEST, "ids must be an array of strings, not %s", mp_type_name(o.type));
    if (o.v.n > (uint64_t)d->cfg->max_docs)
        FAIL(d, EC_TOO_LARGE, "ids has %u entries; the limit is %ld", o.v.n, d->cfg->max_docs);
    if (o.v.n == 0)
        return 0;
    p->ids = calloc(o.v.n, sizeof *p->ids);
    if (!p->ids)
        FAIL(d, EC_INTERNAL, "out of memory");
    for (uint32_t i = 0; i < o.v.n; i++) {
        struct MpObj e;
        char what[32];
        mp_next(&c, &e);
        snprintf(what, sizeof what, "ids[%u]", i);
        if (check_str(d, what, &e, 1, INDEX_MAX_ID_BYTES, EC_BAD_REQUEST, &p->ids[i]))
            return -1;
        if (e.type == MP_ARRAY || e.type == MP_MAP)
            mp_skip_body(&c, &e);
        p->n_ids++;
    }
    return 0;
}

static int decode_stop(struct ProtoDec *d)
{
    struct MpCursor c;
    struct MpObj o;
    struct RequestParams *p = d->p;
    if (!d->val[K_STOP])
        return 0;
    read_at(d, K_STOP, &c, &o);
    long max = d->cfg->max_stop < PROTO_MAX_STOP ? d->cfg->max_stop : PROTO_MAX_STOP;
    if (o.type == MP_STR) {
        if (max < 1)
            FAIL(d, EC_TOO_LARGE, "stop strings are not accepted (max_stop is 0)");
        if (check_str(d, "stop", &o, 1, PROTO_MAX_STOP_BYTES, EC_TOO_LARGE, &p->stop[0]))
            return -1;
        if (memchr(o.s, 0, o.len))
            FAIL(d, EC_BAD_REQUEST, "stop contains a NUL byte");
        p->n_stop = 1;
        return 0;
    }
    if (o.type != MP_ARRAY)
        FAIL(d, EC_BAD_REQUEST, "stop must be a string or an array of strings, not %s",
             mp_type_name(o.type));
    if (o.v.n > (uint64_t)max)
        FAIL(d, EC_TOO_LARGE, "stop has %u strings; the limit is %ld", o.v.n, max);
    for (uint32_t i = 0; i < o.v.n; i++) {
        struct MpObj e;
        char what[32];
        mp_next(&c, &e);
        snprintf(what, sizeof what, "stop[%u]", i);
        if (check_str(d, what, &e, 1, PROTO_MAX_STOP_BYTES, EC_TOO_LARGE, &p->stop[i]))
            return -1;
        if (memchr(e.s, 0, e.len))
            FAIL(d, EC_BAD_REQUEST, "%s contains a NUL byte", what);
        p->n_stop++;
    }
    return 0;
}

/* "include": optional parts of a query's reply, by name. */
static int decode_include(struct ProtoDec *d)
{
    struct MpCursor c;
    struct MpObj o;
    if (!d->val[K_INCLUDE])
        return 0;
    read_at(d, K_INCLUDE, &c, &o);
    if (o.type != MP_ARRAY)
        FAIL(d, EC_BAD_REQUEST, "include must be an array of strings, not %s", mp_type_name(o.type));
    if (o.v.n > PROTO_MAX_INCLUDE)
        FAIL(d, EC_BAD_REQUEST, "include has %u entries; at most %d", o.v.n, PROTO_MAX_INCLUDE);
    for (uint32_t i = 0; i < o.v.n; i++) {
        struct MpObj e;
        mp_next(&c, &e);
        if (e.type != MP_STR)
            FAIL(d, EC_BAD_REQUEST, "include[%u] must be a string, not %s", i, mp_type_name(e.type));
        if (e.len == 13 && !memcmp(e.s, "token_signals", 13)) {
            d->p->include_token_signals = 1;
        } else if (e.len == 13 && !memcmp(e.s, "hidden_states", 13)) {
            d->p->include_hidden_states = 1;
        } else {
            char shown[40];
            size_t n = e.len < 32 ? e.len : 32, j = 0;
            for (size_t k = 0; k < n; k++)
                shown[j++] = (e.s[k] >= 0x20 && e.s[k] < 0x7f) ? e.s[k] : '?';
            shown[j] = 0;
            FAIL(d, EC_BAD_REQUEST, "include[%u]: unknown part \"%s\" (known: token_signals, "
                 "hidden_states)", i,
                 shown);
        }
    }
    return 0;
}

static int decode_docs(struct ProtoDec *d, int need_ids)
{
    struct MpCursor c;
    struct MpObj o;
    struct RequestParams *p = d->p;
    if (!d->val[K_DOCS])
        return 0;
    read_at(d, K_DOCS, &c, &o);
    if (o.type != MP_ARRAY)
        FAIL(d, EC_BAD_REQUEST, "docs must be an array of maps, not %s", mp_type_name(o.type));
    if (o.v.n > (uint64_t)d->cfg->max_docs)
        FAIL(d, EC_TOO_LARGE, "docs has %u documents; the limit is %ld", o.v.n, d->cfg->max_docs);
    if (o.v.n == 0)
        return 0;
    p->docs = calloc(o.v.n, sizeof *p->docs);
    p->auto_ids = need_ids ? NULL : calloc(o.v.n, sizeof *p->auto_ids);
    if (!p->docs || (!need_ids && !p->auto_ids))
        FAIL(d, EC_INTERNAL, "out of memory");
    for (uint32_t i = 0; i < o.v.n; i++) {
        struct MpObj m;
        mp_next(&c, &m);
        if (m.type != MP_MAP)
            FAIL(d, EC_BAD_REQUEST, "docs[%u] must be a map, not %s", i, mp_type_name(m.type));
        struct StoreDoc *sd = &p->docs[i];
        struct Slice name = { NULL, 0 };
        int have_text = 0, have_id = 0, have_title = 0, have_meta = 0, have_bytes = 0,
            have_name = 0;
        for (uint32_t f = 0; f < m.v.n; f++) {
            struct MpObj k, v;
            mp_next(&c, &k);
            const uint8_t *vstart = c.p;
            mp_next(&c, &v);
            if (k.type != MP_STR)
                FAIL(d, EC_BAD_REQUEST, "docs[%u] has a key that is not a string", i);
            char what[48];
            struct Slice s;
            if (k.len == 4 && !memcmp(k.s, "text", 4)) {
                snprintf(what, sizeof what, "docs[%u].text", i);
                if (have_text++)
                    FAIL(d, EC_BAD_REQUEST, "%s appears twice", what);
                if (v.type != MP_STR)
                    FAIL(d, EC_BAD_REQUEST, "%s must be a string, not %s", what, mp_type_name(v.type));
                /* UTF-8 and emptiness are checked with the whole batch off the socket loop */
                sd->text = v.s;
                sd->text_len = v.len;
            } else if (k.len == 2 && !memcmp(k.s, "id", 2)) {
                snprintf(what, sizeof what, "docs[%u].id", i);
                if (have_id++)
                    FAIL(d, EC_BAD_REQUEST, "%s appears twice", what);
                if (check_str(d, what, &v, 1, INDEX_MAX_ID_BYTES, EC_BAD_REQUEST, &s))
                    return -1;
                sd->id = s.p;
                sd->id_len = s.len;
            } else if (k.len == 5 && !memcmp(k.s, "title", 5)) {
                snprintf(what, sizeof what, "docs[%u].title", i);
                if (have_title++)
                    FAIL(d, EC_BAD_REQUEST, "%s appears twice", what);
                if (check_str(d, what, &v, 0, INDEX_MAX_TITLE_BYTES, EC_TOO_LARGE, &s))
                    return -1;
                sd->title = s.p;
                sd->title_len = s.len;
            } else if (k.len == 5 && !memcmp(k.s, "bytes", 5)) {
                if (!need_ids)
                    FAIL(d, EC_BAD_REQUEST, "docs[%u].bytes: a query's documents are text; "
                         "ingest a file's bytes, then query the collection", i);
                if (have_bytes++)
                    FAIL(d, EC_BAD_REQUEST, "docs[%u].bytes appears twice", i);
                if (v.type != MP_BIN)
                    FAIL(d, EC_BAD_REQUEST, "docs[%u].bytes must be binary (msgpack bin), not %s",
                         i, mp_type_name(v.type));
                if (v.len > d->cfg->max_file_bytes)
                    FAIL(d, EC_TOO_LARGE, "docs[%u].bytes is %u bytes; the limit is %zu "
                         "(max_file_bytes)", i, v.len, d->cfg->max_file_bytes);
                if (!p->files && !(p->files = calloc(o.v.n, sizeof *p->files)))
                    FAIL(d, EC_INTERNAL, "out of memory");
                p->files[i].bytes = (const uint8_t *)v.s;
                p->files[i].len = v.len;
            } else if (k.len == 4 && !memcmp(k.s, "name", 4)) {
                snprintf(what, sizeof what, "docs[%u].name", i);
                if (have_name++)
                    FAIL(d, EC_BAD_REQUEST, "%s appears twice", what);
                if (check_str(d, what, &v, 1, INDEX_MAX_ID_BYTES, EC_BAD_REQUEST, &s))
                    return -1;
                if (memchr(s.p, 0, s.len))
                    FAIL(d, EC_BAD_REQUEST, "%s holds a NUL byte", what);
                name = s;
            } else if (k.len == 4 && !memcmp(k.s, "meta", 4)) {
                if (have_meta++)
                    FAIL(d, EC_BAD_REQUEST, "docs[%u].meta appears twice", i);
                if (v.type != MP_MAP)
                    FAIL(d, EC_BAD_REQUEST, "docs[%u].meta must be a map, not %s", i,
                         mp_type_name(v.type));
                mp_skip_body(&c, &v);
                if ((size_t)(c.p - vstart) > INDEX_MAX_META_BYTES)
                    FAIL(d, EC_TOO_LARGE, "docs[%u].meta is over %u bytes", i, INDEX_MAX_META_BYTES);
                sd->meta = vstart;
                sd->meta_len = (size_t)(c.p - vstart);
                continue;
            }
            if (v.type == MP_ARRAY || v.type == MP_MAP)
                mp_skip_body(&c, &v);
        }
        if (have_text && have_bytes)
            FAIL(d, EC_BAD_REQUEST, "docs[%u] has both text and bytes; give one", i);
        if (have_name && !have_bytes)
            FAIL(d, EC_BAD_REQUEST, "docs[%u].name names a file: it goes with bytes", i);
        if (!have_text && !have_bytes)
            FAIL(d, EC_BAD_REQUEST, "docs[%u] has no text%s", i, need_ids ? " (or bytes)" : "");
        if (have_bytes) {
            if (!have_name)
                FAIL(d, EC_BAD_REQUEST, "docs[%u] has bytes but no name (the file's name)", i);
            p->files[i].name = name;
            if (!have_id) {
                sd->id = name.p;
                sd->id_len = name.len;
                have_id = 1;
            }
        }
        if (!have_id) {
            if (need_ids)
                FAIL(d, EC_BAD_REQUEST, "docs[%u] has no id (ingest needs one per document)", i);
            int n = snprintf(p->auto_ids[i], sizeof p->auto_ids[i], "%u", i + 1);
            sd->id = p->auto_ids[i];
            sd->id_len = (size_t)n;
        }
        p->n_docs++;
    }
    return 0;
}

/* "history": earlier turns {"role": "user" | "assistant", "content": str}, oldest first.
 * Unknown keys in a turn are ignored, as in a request. */
static int decode_history(struct ProtoDec *d)
{
    struct MpCursor c;
    struct MpObj o;
    struct RequestParams *p = d->p;
    if (!d->val[K_HISTORY])
        return 0;
    read_at(d, K_HISTORY, &c, &o);
    if (o.type != MP_ARRAY)
        FAIL(d, EC_BAD_REQUEST, "history must be an array of maps {\"role\", \"content\"}, not %s",
             mp_type_name(o.type));
    if (o.v.n > PROTO_MAX_HISTORY)
        FAIL(d, EC_TOO_LARGE, "history has %u turns; the limit is %d", o.v.n, PROTO_MAX_HISTORY);
    if (o.v.n == 0)
        return 0;
    p->history = calloc(o.v.n, sizeof *p->history);
    if (!p->history)
        FAIL(d, EC_INTERNAL, "out of memory");
    for (uint32_t i = 0; i < o.v.n; i++) {
        struct MpObj m;
        mp_next(&c, &m);
        if (m.type != MP_MAP)
            FAIL(d, EC_BAD_REQUEST, "history[%u] must be a map {\"role\", \"content\"}, not %s", i,
                 mp_type_name(m.type));
        struct CtxTurn *t = &p->history[i];
        int have_role = 0, have_content = 0;
        for (uint32_t f = 0; f < m.v.n; f++) {
            struct MpObj k, v;
            mp_next(&c, &k);
            mp_next(&c, &v);
            if (k.type != MP_STR)
                FAIL(d, EC_BAD_REQUEST, "history[%u] has a key that is not a string", i);
            char what[48];
            if (k.len == 4 && !memcmp(k.s, "role", 4)) {
                snprintf(what, sizeof what, "history[%u].role", i);
                if (have_role++)
                    FAIL(d, EC_BAD_REQUEST, "%s appears twice", what);
                if (v.type != MP_STR)
                    FAIL(d, EC_BAD_REQUEST, "%s must be a string, not %s", what, mp_type_name(v.type));
                if (v.len == 4 && !memcmp(v.s, "user", 4))
                    t->assistant = 0;
                else if (v.len == 9 && !memcmp(v.s, "assistant", 9))
                    t->assistant = 1;
                else if (v.len == 6 && !memcmp(v.s, "system", 6))
                    FAIL(d, EC_BAD_REQUEST, "%s must be \"user\" or \"assistant\" (a system "
                         "message goes in the query's \"system\")", what);
                else
                    FAIL(d, EC_BAD_REQUEST, "%s must be \"user\" or \"assistant\"", what);
            } else if (k.len == 7 && !memcmp(k.s, "content", 7)) {
                struct Slice s;
                snprintf(what, sizeof what, "history[%u].content", i);
                if (have_content++)
                    FAIL(d, EC_BAD_REQUEST, "%s appears twice", what);
                if (check_str(d, what, &v, 1, d->cfg->max_turn_bytes, EC_TOO_LARGE, &s))
                    return -1;
                t->text = s.p;
                t->len = s.len;
            }
            if (v.type == MP_ARRAY || v.type == MP_MAP)
                mp_skip_body(&c, &v);
        }
        if (!have_role)
            FAIL(d, EC_BAD_REQUEST, "history[%u] has no role", i);
        if (!have_content)
            FAIL(d, EC_BAD_REQUEST, "history[%u] has no content", i);
        p->n_history++;
    }
    return 0;
}

int proto_decode_ping(struct ProtoDec *d)
{
    (void)d;
    return 0;
}

int proto_decode_query(struct ProtoDec *d)
{
    struct RequestParams *p = d->p;
    const struct Config *cfg = d->cfg;
    if (!d->val[K_QUESTION])
        FAIL(d, EC_BAD_REQUEST, "query needs a question");
    if (get_str(d, K_QUESTION, 1, cfg->max_question_bytes, EC_TOO_LARGE, &p->question) ||
        check_collection(d) || decode_ids(d) || decode_stop(d) || decode_docs(d, 0) ||
        decode_include(d) || decode_history(d) ||
        get_str(d, K_SYSTEM, 1, cfg->max_turn_bytes, EC_TOO_LARGE, &p->system))
        return -1;
    if (p->n_docs == 0 && p->collection.len == 0)
        FAIL(d, EC_BAD_REQUEST, "query needs docs (inline documents) or a collection");
    if (p->n_ids && p->collection.len == 0)
        FAIL(d, EC_BAD_REQUEST, "ids filters a collection: give the collection too");
    if (d->val[K_MAX_CONTEXT] && cfg->model_ctx > 0) {
        /* past the model's own context: say so, not just "over the daemon's cap" */
        struct MpCursor c;
        struct MpObj o;
        read_at(d, K_MAX_CONTEXT, &c, &o);
        if (o.type == MP_UINT && o.v.u > (uint64_t)cfg->model_ctx)
            FAIL(d, EC_TOO_LARGE, "max_context_tokens is %llu, longer than the %ld-token "
                 "context of the model this daemon serves (its limit for a prompt is %ld, "
                 "leaving room for max_tokens %ld)", (unsigned long long)o.v.u,
                 cfg->model_ctx, config_max_context(cfg), cfg->max_tokens);
    }
    if (get_int(d, K_TOP_K, 1, 1000000, cfg->max_top_k, &p->top_k) ||
        get_int(d, K_MAX_CONTEXT, 64, 1L << 30, config_max_context(cfg), &p->max_context_tokens) ||
        get_int(d, K_MAX_TOKENS, 1, 1L << 30, cfg->max_tokens, &p->max_tokens) ||
        get_double(d, K_TEMPERATURE, 0, 0, 10, &p->temperature) ||
        get_double(d, K_TOP_P, 0, 1, 1, &p->top_p) ||
        get_double(d, K_RELEVANCE, 0, 0, 1, &p->relevance_floor) ||
        get_bool(d, K_STREAM, &p->stream) ||
        get_int(d, K_DEADLINE, 1, PROTO_MAX_DEADLINE_MS, -1, &p->deadline_ms))
        return -1;
    struct Slice order = {0};
    if (get_str(d, K_ORDER, 1, 16, EC_BAD_REQUEST, &order))
        return -1;
    if (order.len == 8 && !memcmp(order.p, "document", 8))
        p->order = CTX_ORDER_DOCUMENT;
    else if (order.len == 7 && !memcmp(order.p, "nearest", 7))
        p->order = CTX_ORDER_NEAREST;
    else if (order.len && !(order.len == 4 && !memcmp(order.p, "rank", 4)))
        FAIL(d, EC_BAD_REQUEST, "order must be \"rank\", \"document\" or \"nearest\"");
    else if (!order.len) {
        p->order = plan_default_order(cfg->kv_reuse != 0);
        p->window = !cfg->kv_reuse;  /* a blend reuses chunks; a window, the prefix cache */
    }
    struct Slice unsup = {0};
    if (get_str(d, K_UNSUPPORTED, 1, 16, EC_BAD_REQUEST, &unsup))
        return -1;
    if (unsup.len) {
        int u = config_unsupported_parse(unsup.p, unsup.len);
        if (u < 0)
            FAIL(d, EC_BAD_REQUEST, "unsupported must be \"answer\", \"mark\" or \"decline\"");
        p->unsupported = u;
    }
    struct Slice mode = {0};
    if (get_str(d, K_ANSWER_MODE, 1, 16, EC_BAD_REQUEST, &mode))
        return -1;
    if (mode.len) {
        int m = config_answer_mode_parse(mode.p, mode.len);
        if (m < 0)
            FAIL(d, EC_BAD_REQUEST, "answer_mode must be \"free\" or \"quote\"");
        p->answer_mode = m;
    }
    if (d->val[K_SEED]) {
        struct MpCursor c;
        struct MpObj o;
        read_at(d, K_SEED, &c, &o);
        if (o.type != MP_UINT)
            FAIL(d, EC_BAD_REQUEST, "seed must be a non-negative integer");
        p->seed = o.v.u;
    }
    return 0;
}

int proto_decode_ingest(struct ProtoDec *d)
{
    if (!d->val[K_COLLECTION] || !d->val[K_DOCS])
        FAIL(d, EC_BAD_REQUEST, "ingest needs a collection and docs");
    if (check_collection(d) || decode_docs(d, 1))
        return -1;
    if (d->p->n_docs == 0)
        FAIL(d, EC_BAD_REQUEST, "docs is empty");
    return 0;
}

int proto_decode_delete(struct ProtoDec *d)
{
    if (!d->val[K_COLLECTION] || !d->val[K_IDS])
        FAIL(d, EC_BAD_REQUEST, "delete needs a collection and ids");
    if (check_collection(d) || decode_ids(d))
        return -1;
    if (d->p->n_ids == 0)
        FAIL(d, EC_BAD_REQUEST, "ids is empty");
    return 0;
}

int proto_decode_drop(struct ProtoDec *d)
{
    if (!d->val[K_COLLECTION])
        FAIL(d, EC_BAD_REQUEST, "drop needs a collection");
    return check_collection(d);
}

int proto_decode_get(struct ProtoDec *d)
{
    if (!d->val[K_COLLECTION] || !d->val[K_DOC_ID])
        FAIL(d, EC_BAD_REQUEST, "get needs a collection and a doc_id");
    return check_collection(d) ||
           get_str(d, K_DOC_ID, 1, INDEX_MAX_ID_BYTES, EC_BAD_REQUEST, &d->p->doc_id) ? -1 : 0;
}

int proto_decode_list(struct ProtoDec *d)
{
    struct RequestParams *p = d->p;
    if (check_collection(d) ||
        get_str(d, K_AFTER, 0, INDEX_MAX_ID_BYTES, EC_BAD_REQUEST, &p->after) ||
        get_int(d, K_LIMIT, 1, 1L << 30, PROTO_MAX_LIST_LIMIT, &p->limit))
        return -1;
    if (p->after.len && !p->collection.len)
        FAIL(d, EC_BAD_REQUEST, "after pages through a collection: give the collection too");
    return 0;
}

int proto_decode_stats(struct ProtoDec *d)
{
    return check_collection(d);
}

int proto_decode_cancel(struct ProtoDec *d)
{
    if (!d->val[K_TARGET])
        FAIL(d, EC_BAD_REQUEST, "cancel needs a target (the id of the request to stop)");
    struct MpCursor c;
    struct MpObj o;
    read_at(d, K_TARGET, &c, &o);
    if (o.type == MP_STR) {
        struct Slice s;
        if (check_str(d, "target", &o, 0, PROTO_MAX_ID_BYTES, EC_BAD_REQUEST, &s))
            return -1;
    } else if (o.type != MP_UINT && o.type != MP_INT) {
        FAIL(d, EC_BAD_REQUEST, "target must be a string or an integer, not %s",
             mp_type_name(o.type));
    }
    d->p->target_raw = d->val[K_TARGET];
    d->p->target_len = (size_t)(c.p - d->val[K_TARGET]);
    return 0;
}

int proto_decode(const void *buf, size_t len, const struct Config *cfg, struct RequestParams *p,
                 enum ErrCode *code, char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    p->op = OP_NONE;
    p->top_k = cfg->top_k < cfg->max_top_k ? cfg->top_k : cfg->max_top_k;
    p->max_context_tokens = config_default_context(cfg);
    p->max_tokens = cfg->default_max_tokens < cfg->max_tokens ? cfg->default_max_tokens
                                                              : cfg->max_tokens;
    p->top_p = 1;
    p->relevance_floor = cfg->relevance_floor;
    int unsup = config_unsupported_parse(cfg->unsupported, strlen(cfg->unsupported));
    p->unsupported = unsup < 0 ? UNSUP_MARK : unsup;
    int mode = config_answer_mode_parse(cfg->answer_mode, strlen(cfg->answer_mode));
    p->answer_mode = mode < 0 ? ANSWER_FREE : mode;
    p->limit = 100;
    struct ProtoDec d = { .end = (const uint8_t *)buf + len, .cfg = cfg, .p = p, .code = code,
                     .err = err, .errlen = errlen };
    *code = EC_OK;
    if (len == 0)
        FAIL(&d, EC_BAD_REQUEST, "empty message");
    if (len > cfg->max_message_bytes)
        FAIL(&d, EC_TOO_LARGE, "the message has %zu bytes; the limit is %zu", len,
             cfg->max_message_bytes);
    char merr[160];
    int rc = mp_check(buf, len, (int)cfg->max_depth, merr, sizeof merr);
    if (rc)
        FAIL(&d, EC_BAD_REQUEST, "not one msgpack value: %s", merr);
    struct MpCursor c;
    struct MpObj top;
    mp_cursor_init(&c, buf, len);
    mp_next(&c, &top);
    if (top.type != MP_MAP)
        FAIL(&d, EC_BAD_REQUEST, "a request is a msgpack map, not %s", mp_type_name(top.type));
    int bad_key = 0, dup = -1;
    for (uint32_t i = 0; i < top.v.n; i++) {
        struct MpObj k, v;
        mp_next(&c, &k);
        const uint8_t *vstart = c.p;
        mp_next(&c, &v);
        if (v.type == MP_ARRAY || v.type == MP_MAP)
            mp_skip_body(&c, &v);
        if (k.type != MP_STR) {
            bad_key = 1;
            if (k.type == MP_ARRAY || k.type == MP_MAP) {
                /* a container key: its body sits before the value we just read; restart the
                 * walk properly after it */
                struct MpCursor kc = { k.start, d.end };
                mp_skip(&kc);
                c = kc;
                mp_skip(&c);
            }
            continue;
        }
        for (int j = 0; j < K_COUNT; j++)
            if (strlen(key_names[j]) == k.len && !memcmp(key_names[j], k.s, k.len)) {
                if (d.val[j])
                    dup = j;
                else
                    d.val[j] = vstart;
                break;
            }
    }
    if (d.val[K_ID]) {
        struct MpCursor ic;
        struct MpObj o;
        read_at(&d, K_ID, &ic, &o);
        int ok = o.type == MP_UINT || o.type == MP_INT ||
                 (o.type == MP_STR && o.len <= PROTO_MAX_ID_BYTES && utf8_ok(o.s, o.len));
        if (!ok)
            FAIL(&d, EC_BAD_REQUEST, "id must be a string (at most %d bytes of UTF-8) or an integer",
                 PROTO_MAX_ID_BYTES);
        if (dup != K_ID) {
            p->id_raw = d.val[K_ID];
            p->id_len = (size_t)(ic.p - d.val[K_ID]);
        }
    }
    if (bad_key)
        FAIL(&d, EC_BAD_REQUEST, "request keys must be strings");
    if (dup >= 0)
        FAIL(&d, EC_BAD_REQUEST, "key \"%s\" appears twice", key_names[dup]);
    if (!d.val[K_V])
        FAIL(&d, EC_BAD_REQUEST, "missing \"v\" (the protocol version, %d)", PROTO_VERSION);
    {
        struct MpCursor vc;
        struct MpObj o;
        read_at(&d, K_V, &vc, &o);
        if (o.type == MP_INT)
            FAIL(&d, EC_UNSUPPORTED_VERSION, "protocol version %lld is not supported (this daemon "
                 "speaks %d)", (long long)o.v.i, PROTO_VERSION);
        if (o.type != MP_UINT)
            FAIL(&d, EC_BAD_REQUEST, "v must be an integer, not %s", mp_type_name(o.type));
        if (o.v.u != PROTO_VERSION)
            FAIL(&d, EC_UNSUPPORTED_VERSION, "protocol version %llu is not supported (this daemon "
                 "speaks %d)", (unsigned long long)o.v.u, PROTO_VERSION);
    }
    if (!d.val[K_OP])
        FAIL(&d, EC_BAD_REQUEST, "missing \"op\"");
    {
        struct MpCursor oc;
        struct MpObj o;
        read_at(&d, K_OP, &oc, &o);
        if (o.type != MP_STR)
            FAIL(&d, EC_BAD_REQUEST, "op must be a string, not %s", mp_type_name(o.type));
        p->op = ops_find(o.s, o.len);
        if (p->op == OP_NONE) {
            char shown[40];
            size_t n = o.len < 32 ? o.len : 32;
            size_t j = 0;
            for (size_t i = 0; i < n; i++)
                shown[j++] = (o.s[i] >= 0x20 && o.s[i] < 0x7f) ? o.s[i] : '?';
            shown[j] = 0;
            FAIL(&d, EC_BAD_REQUEST, "unknown op \"%s\"", shown);
        }
    }
    return ops_get(p->op)->decode(&d);
}

void proto_params_free(struct RequestParams *p)
{
    free(p->docs);
    free(p->auto_ids);
    free(p->files);
    free(p->ids);
    free(p->history);
    p->docs = NULL;
    p->auto_ids = NULL;
    p->files = NULL;
    p->ids = NULL;
    p->history = NULL;
    p->n_docs = p->n_ids = p->n_history = 0;
}

void proto_reply_head(struct MpWriter *w, size_t n_fields, const uint8_t *id, size_t id_len, int ok)
{
    mpw_map(w, n_fields + 2);
    mpw_cstr(w, "id");
    if (id)
        mpw_raw(w, id, id_len);
    else
        mpw_nil(w);
    mpw_kv_bool(w, "ok", ok);
}

void proto_error(struct MpWriter *w, const uint8_t *id, size_t id_len, enum ErrCode code,
                 const char *message)
{
    proto_reply_head(w, 1, id, id_len, 0);
    mpw_cstr(w, "error");
    mpw_map(w, 2);
    mpw_kv_cstr(w, "code", ec_name(code));
    mpw_kv_cstr(w, "message", message ? message : "");
}
