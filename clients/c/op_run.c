/* The runner of the C client's ops: checks the arguments, packs the request from the op's
 * descriptor, makes the call, decodes the reply into the result struct and frees it again. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clients/c/client_internal.h"
#include "clients/c/json.h"
#include "clients/c/op_desc.h"


static void pstr(struct Req *q, const char *s, size_t n)
{
    q->fail |= msgpack_pack_str_with_body(&q->pk, s, n);
}

static void pkey(struct Req *q, const char *key)
{
    pstr(q, key, strlen(key));
}

static void pkv_str(struct Req *q, const char *key, const char *val)
{
    pkey(q, key);
    pstr(q, val, strlen(val));
}

void op_req_free(struct Req *q)
{
    msgpack_sbuffer_destroy(&q->sb);
}

/* "meta": the JSON object meta_json as a msgpack map; a bad one sets q->bad and says so. */
static void pack_meta(struct Req *q, size_t i, const char *meta_json, char *err, size_t errlen)
{
    char why[200];
    pkey(q, "meta");
    int rc = json_to_msgpack(meta_json, strlen(meta_json), &q->pk, META_MAX_DEPTH, why,
                             sizeof why);
    if (rc == -2) {
        q->fail = 1;
    } else if (rc) {
        snprintf(err, errlen, "docs[%zu].meta_json: %s", i, why);
        q->bad = 1;
    } else {
        const char *s = meta_json;
        while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')
            s++;
        if (*s != '{') {
            snprintf(err, errlen, "docs[%zu].meta_json: not a JSON object", i);
            q->bad = 1;
        }
    }
}

static void pack_files(struct Req *q, const DiffragFile *files, size_t n, char *err,
                       size_t errlen)
{
    q->fail |= msgpack_pack_array(&q->pk, (uint32_t)n);
    for (size_t i = 0; i < n && !q->bad && !q->fail; i++) {
        const DiffragFile *f = &files[i];
        q->fail |= msgpack_pack_map(&q->pk, 2 + (f->id != NULL) + (f->title != NULL) +
                                                (f->meta_json != NULL));
        pkv_str(q, "name", f->name);
        pkey(q, "bytes");
        q->fail |= msgpack_pack_bin(&q->pk, f->len) || msgpack_pack_bin_body(&q->pk, f->bytes, f->len);
        if (f->id)
            pkv_str(q, "id", f->id);
        if (f->title)
            pkv_str(q, "title", f->title);
        if (f->meta_json)
            pack_meta(q, i, f->meta_json, err, errlen);
    }
}

static void pack_docs(struct Req *q, const DiffragDoc *docs, size_t n, int with_meta,
                      char *err, size_t errlen)
{
    q->fail |= msgpack_pack_array(&q->pk, (uint32_t)n);
    for (size_t i = 0; i < n && !q->bad && !q->fail; i++) {
        const DiffragDoc *d = &docs[i];
        uint32_t nf = 1 + (d->id != NULL) + (d->title != NULL) + (with_meta && d->meta_json);
        q->fail |= msgpack_pack_map(&q->pk, nf);
        pkey(q, "text");
        pstr(q, d->text, d->text_len ? d->text_len : strlen(d->text));
        if (d->id)
            pkv_str(q, "id", d->id);
        if (d->title)
            pkv_str(q, "title", d->title);
        if (with_meta && d->meta_json)
            pack_meta(q, i, d->meta_json, err, errlen);
    }
}

static int req_has(const struct ReqField *f, const void *args)
{
    switch (f->kind) {
    case REQ_STR: return 1;
    case REQ_STR_OPT: return ARG(args, f->off, const char *) != NULL;
    case REQ_INT_OPT:
    case REQ_TRUE_OPT: return ARG(args, f->off, int) != 0;
    case REQ_U64_OPT: return ARG(args, f->off, uint64_t) != 0;
    case REQ_NUM_OPT: return ARG(args, f->off, double) != 0;
    case REQ_NUM_GIVEN: return ARG(args, f->count_off, int) != 0;
    case REQ_STRS:
    case REQ_DOCS:
    case REQ_DOCS_META:
    case REQ_FILES: return ARG(args, f->count_off, size_t) > 0;
    }
    return 0;
}

static void req_field(struct Req *q, DiffragClient *c, const struct ReqField *f, const void *args)
{
    pkey(q, f->key);
    switch (f->kind) {
    case REQ_STR:
    case REQ_STR_OPT: {
        const char *s = ARG(args, f->off, const char *);
        pstr(q, s, strlen(s));
        break;
    }
    case REQ_INT_OPT: q->fail |= msgpack_pack_int64(&q->pk, ARG(args, f->off, int)); break;
    case REQ_U64_OPT: q->fail |= msgpack_pack_uint64(&q->pk, ARG(args, f->off, uint64_t)); break;
    case REQ_NUM_OPT:
    case REQ_NUM_GIVEN: q->fail |= msgpack_pack_double(&q->pk, ARG(args, f->off, double)); break;
    case REQ_TRUE_OPT: q->fail |= msgpack_pack_true(&q->pk); break;
    case REQ_STRS: {
        const char *const *v = ARG(args, f->off, const char *const *);
        size_t n = ARG(args, f->count_off, size_t);
        q->fail |= msgpack_pack_array(&q->pk, (uint32_t)n);
        for (size_t i = 0; i < n; i++)
            pstr(q, v[i], strlen(v[i]));
        break;
    }
    case REQ_DOCS:
    case REQ_DOCS_META:
        pack_docs(q, ARG(args, f->off, const DiffragDoc *), ARG(args, f->count_off, size_t),
                  f->kind == REQ_DOCS_META, c->err, sizeof c->err);
        break;
    case REQ_FILES:
        pack_files(q, ARG(args, f->off, const DiffragFile *), ARG(args, f->count_off, size_t),
                   c->err, sizeof c->err);
        break;
    }
}

/* Packs op's request {"v", "op", "id", fields present in args} under id (NULL: a fresh one).
 * DIFFRAG_OK with q to free with op_req_free, or ENOMEM, or EINVAL for a bad meta_json. */
int op_req_pack(DiffragClient *c, const struct OpDesc *op, const void *args, const char *id,
                    struct Req *q)
{
    uint32_t n = 3;
    for (size_t i = 0; i < op->n_req; i++)
        n += (uint32_t)req_has(&op->req[i], args);
    msgpack_sbuffer_init(&q->sb);
    msgpack_packer_init(&q->pk, &q->sb, msgpack_sbuffer_write);
    q->fail = q->bad = 0;
    if (id)
        snprintf(q->id, sizeof q->id, "%s", id);
    else
        client_next_id(c, q->id, sizeof q->id);
    q->fail |= msgpack_pack_map(&q->pk, n);
    pkey(q, "v");
    q->fail |= msgpack_pack_int64(&q->pk, DIFFRAG_PROTOCOL_VERSION);
    pkv_str(q, "op", op->op);
    pkv_str(q, "id", q->id);
    for (size_t i = 0; i < op->n_req && !q->bad; i++)
        if (req_has(&op->req[i], args))
            req_field(q, c, &op->req[i], args);
    if (q->fail) {
        op_req_free(q);
        return client_fail(c, DIFFRAG_ENOMEM, NULL, "out of memory");
    }
    if (q->bad) {
        op_req_free(q);
        snprintf(c->code, sizeof c->code, "invalid");
        return DIFFRAG_EINVAL;
    }
    return DIFFRAG_OK;
}

/* Starts a call of op: clears the last error, checks the arguments and packs the request. */
int op_start(DiffragClient *c, const struct OpDesc *op, const void *args, const char *id,
                    struct Req *q)
{
    if (op->nested)
        client_clear(c);
    else
        client_begin(c);
    if (op->check) {
        int rc = op->check(c, args);
        if (rc)
            return rc;
    }
    return op_req_pack(c, op, args, id, q);
}

/* ---- replies ---- */

static void rep_fields(struct Dec *d, const msgpack_object *map, const struct RepField *f,
                       size_t n, void *res, double call_ms);

/* An array of strings (into a char ** and a count), read as far as it is well-formed. */
static void rep_strs(struct Dec *d, const msgpack_object *m, const struct RepField *f, void *res)
{
    const msgpack_object *a = dec_type(d, m, f->key, MSGPACK_OBJECT_ARRAY, f->required);
    if (!a || !a->via.array.size)
        return;
    char **v = calloc(a->via.array.size, sizeof *v);
    RES(res, f->off, char **) = v;
    if (!v)
        dec_oom(d);
    for (uint32_t i = 0; v && i < a->via.array.size && !d->failed; i++) {
        const msgpack_object *s = &a->via.array.ptr[i];
        if (s->type != MSGPACK_OBJECT_STR) {
            dec_bad(d, f->key, "expected an array of strings");
            break;
        }
        v[i] = dec_strdup(d, s->via.str.ptr, s->via.str.size);
        RES(res, f->off2, size_t) = i + 1;
    }
}

/* An array of maps, each read with f->elem; messages name the element ("docs[3].id"). */
static void rep_maps(struct Dec *d, const msgpack_object *m, const struct RepField *f, void *res)
{
    const msgpack_object *a = dec_type(d, m, f->key, MSGPACK_OBJECT_ARRAY, f->required);
    if (!a || !a->via.array.size)
        return;
    char *v = calloc(a->via.array.size, f->elem_size);
    RES(res, f->off, void *) = v;
    if (!v)
        dec_oom(d);
    const char *outer = d->ctx;
    char ctx[48];
    for (uint32_t i = 0; v && i < a->via.array.size && !d->failed; i++) {
        const msgpack_object *o = &a->via.array.ptr[i];
        snprintf(ctx, sizeof ctx, "%s[%u]", f->key, i);
        d->ctx = ctx;
        RES(res, f->off2, size_t) = i + 1;
        if (o->type != MSGPACK_OBJECT_MAP)
            dec_bad(d, NULL, "expected a map");
        rep_fields(d, o, f->elem, f->n_elem, v + i * f->elem_size, 0);
    }
    d->ctx = outer;
}

static void rep_fields(struct Dec *d, const msgpack_object *map, const struct RepField *f,
                       size_t n, void *res, double call_ms)
{
    const msgpack_object *m = map;
    const char *saved = d->ctx;
    for (size_t i = 0; i < n; i++, f++) {
        switch (f->kind) {
        case REP_STR: RES(res, f->off, char *) = dec_str(d, m, f->key, f->required, NULL); break;
        case REP_STR_LEN:
            RES(res, f->off, char *) = dec_str(d, m, f->key, f->required,
                                               &RES(res, f->off2, size_t));
            break;
        case REP_STR_NIL: RES(res, f->off, char *) = dec_str_or_nil(d, m, f->key); break;
        case REP_INT: RES(res, f->off, int64_t) = dec_int(d, m, f->key, f->required); break;
        case REP_INT_PAIR_NIL:
        case REP_INT_PAIR: {
            const msgpack_object *a = NULL;
            if (f->kind == REP_INT_PAIR_NIL) {
                RES(res, f->off, int64_t) = RES(res, f->off2, int64_t) = 0;
                const msgpack_object *o = d->failed ? NULL : mpo_get(m, f->key);
                if (o && o->type == MSGPACK_OBJECT_NIL)
                    break;
            }
            a = dec_type(d, m, f->key, MSGPACK_OBJECT_ARRAY, f->required);
            char k0[40], k1[40];
            snprintf(k0, sizeof k0, "%s[0]", f->key);
            snprintf(k1, sizeof k1, "%s[1]", f->key);
            if (a && a->via.array.size != 2) {
                dec_bad(d, f->key, "expected [start, end]");
            } else if (a) {
                RES(res, f->off, int64_t) = dec_as_int(d, &a->via.array.ptr[0], k0);
                RES(res, f->off2, int64_t) = dec_as_int(d, &a->via.array.ptr[1], k1);
                if (f->kind == REP_INT_PAIR_NIL && !d->failed &&
                    (RES(res, f->off, int64_t) < 1 ||
                     RES(res, f->off2, int64_t) < RES(res, f->off, int64_t)))
                    dec_bad(d, f->key, "expected [first, last] with 1 <= first <= last");
            }
            break;
        }
        case REP_STRS: rep_strs(d, m, f, res); break;
        case REP_MAPS: rep_maps(d, m, f, res); break;
        case REP_NUM: RES(res, f->off, double) = dec_num(d, m, f->key, f->required); break;
        case REP_BOOL: RES(res, f->off, int) = dec_bool(d, m, f->key, f->required); break;
        case REP_TRUE:
            if (!dec_bool(d, m, f->key, f->required))
                dec_bad(d, f->key, "expected true");
            break;
        case REP_JSON_MAP:
            RES(res, f->off, char *) =
                dec_json(d, dec_type(d, m, f->key, MSGPACK_OBJECT_MAP, f->required));
            break;
        case REP_ENTER:
            m = dec_type(d, map, f->key, MSGPACK_OBJECT_MAP, f->required);
            d->ctx = f->key;
            while (!m && i + 1 < n && f[1].kind != REP_LEAVE) { /* absent: skip its fields */
                i++;
                f++;
            }
            break;
        case REP_LEAVE:
            m = map;
            d->ctx = saved;
            break;
        case REP_CALL_MS: RES(res, f->off, double) = call_ms; break;
        }
    }
    d->ctx = saved;
}

void op_result_free(const struct ResultType *t, void *res)
{
    if (!res)
        return;
    for (size_t i = 0; i < t->n_strs; i++)
        free(RES(res, t->strs[i], char *));
    if (t->json_off != NO_JSON)
        free(RES(res, t->json_off, char *));
    if (t->free_more)
        t->free_more(res);
    free(res);
}

/* A new result of op's type op_decoded from the reply map; check d->failed. */
void *op_result_decode(struct Dec *d, const struct OpDesc *op, const msgpack_object *map,
                           const void *args, double call_ms)
{
    void *res = calloc(1, op->type->size);
    if (!res) {
        dec_oom(d);
        return NULL;
    }
    rep_fields(d, map, op->rep, op->n_rep, res, call_ms);
    if (op->decode)
        op->decode(d, map, args, res);
    if (op->type->json_off != NO_JSON)
        RES(res, op->type->json_off, char *) = dec_json(d, map);
    return res;
}

int op_decoded(DiffragClient *c, struct Dec *d)
{
    if (d->failed == DIFFRAG_ENOMEM)
        return client_fail(c, DIFFRAG_ENOMEM, NULL, "out of memory");
    return client_fail(c, DIFFRAG_EPROTOCOL, NULL, "malformed reply from %s: %s", c->endpoint,
                       d->err);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The whole call of a request-reply op: DIFFRAG_OK with *out, a result of op's type. */
int op_run(DiffragClient *c, const struct OpDesc *op, const void *args, void **out)
{
    struct Req q;
    struct Reply *r;
    *out = NULL;
    int rc = op_start(c, op, args, NULL, &q);
    if (rc)
        return rc;
    double t0 = now_ms();
    rc = client_call(c, q.id, &q.sb, c->timeout_ms, &r);
    double call_ms = now_ms() - t0;
    op_req_free(&q);
    if (rc)
        return rc;
    struct Dec d = { 0 };
    void *res = op_result_decode(&d, op, r->map, args, call_ms);
    reply_free(&r);
    if (d.failed) {
        op_result_free(op->type, res);
        return op_decoded(c, &d);
    }
    *out = res;
    return DIFFRAG_OK;
}

/* ---- argument checks ---- */

int op_bad_arg(DiffragClient *c, const char *what)
{
    return client_fail(c, DIFFRAG_EINVAL, NULL, "%s", what);
}

int op_check_docs(DiffragClient *c, const DiffragDoc *docs, size_t n, int need_ids)
{
    for (size_t i = 0; i < n; i++) {
        if (!docs[i].text)
            return client_fail(c, DIFFRAG_EINVAL, NULL, "docs[%zu] has no text", i);
        if (need_ids && !docs[i].id)
            return client_fail(c, DIFFRAG_EINVAL, NULL, "docs[%zu] has no id", i);
    }
    return DIFFRAG_OK;
}

int op_check_files(DiffragClient *c, const DiffragFile *files, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!files[i].name || !*files[i].name)
            return client_fail(c, DIFFRAG_EINVAL, NULL, "files[%zu] has no name", i);
        if (!files[i].bytes || !files[i].len)
            return client_fail(c, DIFFRAG_EINVAL, NULL, "files[%zu] (%s) has no bytes", i,
                               files[i].name);
        if (files[i].len > UINT32_MAX)
            return client_fail(c, DIFFRAG_EINVAL, NULL, "files[%zu] (%s) is over 4 GiB", i,
                               files[i].name);
    }
    return DIFFRAG_OK;
}

int op_check_strings(DiffragClient *c, const char *what, const char *const *v, size_t n)
{
    if (n && !v)
        return client_fail(c, DIFFRAG_EINVAL, NULL, "%s is NULL", what);
    for (size_t i = 0; i < n; i++)
        if (!v[i])
            return client_fail(c, DIFFRAG_EINVAL, NULL, "%s[%zu] is NULL", what, i);
    return DIFFRAG_OK;
}

int op_check_collection(DiffragClient *c, const char *collection)
{
    if (!collection || !*collection)
        return op_bad_arg(c, "no collection");
    return DIFFRAG_OK;
}
