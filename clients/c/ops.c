/* The operations of docs/protocol.md: each packs its request map, runs the exchange through
 * client.c and decodes the final reply into the plain result structs of diffrag.h (and frees
 * them). query also handles streaming, delta callbacks and cancellation. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clients/c/client_internal.h"
#include "clients/c/json.h"

#define META_MAX_DEPTH 16 /* the daemon's default max_depth: deeper meta would be refused */

struct Req {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    int fail;                   /* a packing call ran out of memory */
    char id[CLIENT_ID_MAX + 1];
};

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

static void pkv_int(struct Req *q, const char *key, int64_t v)
{
    pkey(q, key);
    q->fail |= msgpack_pack_int64(&q->pk, v);
}

/* Starts a request map of n_fields besides v, op and id. */
static void req_begin(struct Req *q, DiffragClient *c, const char *op, uint32_t n_fields,
                      const char *id)
{
    msgpack_sbuffer_init(&q->sb);
    msgpack_packer_init(&q->pk, &q->sb, msgpack_sbuffer_write);
    q->fail = 0;
    if (id)
        snprintf(q->id, sizeof q->id, "%s", id);
    else
        client_next_id(c, q->id, sizeof q->id);
    q->fail |= msgpack_pack_map(&q->pk, n_fields + 3);
    pkv_int(q, "v", DIFFRAG_PROTOCOL_VERSION);
    pkv_str(q, "op", op);
    pkv_str(q, "id", q->id);
}

static void req_free(struct Req *q)
{
    msgpack_sbuffer_destroy(&q->sb);
}

static int req_oom(DiffragClient *c, struct Req *q)
{
    req_free(q);
    return client_fail(c, DIFFRAG_ENOMEM, NULL, "out of memory");
}

static int bad_arg(DiffragClient *c, const char *what)
{
    return client_fail(c, DIFFRAG_EINVAL, NULL, "%s", what);
}

static int decoded(DiffragClient *c, struct Dec *d)
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

/* ---- ping ---- */

void diffrag_pong_free(DiffragPong **pp)
{
    DiffragPong *p = pp ? *pp : NULL;
    if (!p)
        return;
    free(p->version);
    free(p->model);
    free(p->json);
    free(p);
    *pp = NULL;
}

int diffrag_ping(DiffragClient *c, DiffragPong **out)
{
    if (!c || !out)
        return DIFFRAG_EINVAL;
    *out = NULL;
    client_begin(c);
    struct Req q;
    struct Reply *r;
    req_begin(&q, c, "ping", 0, NULL);
    if (q.fail)
        return req_oom(c, &q);
    double t0 = now_ms();
    int rc = client_call(c, q.id, &q.sb, c->timeout_ms, &r);
    double rtt = now_ms() - t0;
    req_free(&q);
    if (rc)
        return rc;
    struct Dec d = { 0 };
    DiffragPong *p = calloc(1, sizeof *p);
    if (!p) {
        dec_oom(&d);
    } else {
        if (!dec_bool(&d, r->map, "pong", 1))
            dec_bad(&d, "pong", "expected true");
        p->version = dec_str(&d, r->map, "version", 0, NULL);
        p->model = dec_str(&d, r->map, "model", 0, NULL);
        p->json = dec_json(&d, r->map);
        p->rtt_ms = rtt;
    }
    reply_free(&r);
    if (d.failed) {
        diffrag_pong_free(&p);
        return decoded(c, &d);
    }
    *out = p;
    return DIFFRAG_OK;
}

/* ---- query ---- */

void diffrag_answer_free(DiffragAnswer **pa)
{
    DiffragAnswer *a = pa ? *pa : NULL;
    if (!a)
        return;
    free(a->id);
    free(a->answer);
    free(a->finish_reason);
    for (size_t i = 0; i < a->n_citations; i++)
        free(a->citations[i].doc_id);
    free(a->citations);
    free(a->grounding.detector);
    free(a->json);
    free(a);
    *pa = NULL;
}

static void pack_docs(struct Req *q, const DiffragDoc *docs, size_t n, int with_meta,
                      char *err, size_t errlen, int *bad)
{
    q->fail |= msgpack_pack_array(&q->pk, (uint32_t)n);
    for (size_t i = 0; i < n && !*bad && !q->fail; i++) {
        const DiffragDoc *d = &docs[i];
        uint32_t nf = 1 + (d->id != NULL) + (d->title != NULL) + (with_meta && d->meta_json);
        q->fail |= msgpack_pack_map(&q->pk, nf);
        pkey(q, "text");
        pstr(q, d->text, d->text_len ? d->text_len : strlen(d->text));
        if (d->id)
            pkv_str(q, "id", d->id);
        if (d->title)
            pkv_str(q, "title", d->title);
        if (with_meta && d->meta_json) {
            char why[200];
            pkey(q, "meta");
            int rc = json_to_msgpack(d->meta_json, strlen(d->meta_json), &q->pk, META_MAX_DEPTH,
                                     why, sizeof why);
            if (rc == -2)
                q->fail = 1;
            else if (rc) {
                snprintf(err, errlen, "docs[%zu].meta_json: %s", i, why);
                *bad = 1;
            } else {
                const char *s = d->meta_json;
                while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')
                    s++;
                if (*s != '{') {
                    snprintf(err, errlen, "docs[%zu].meta_json: not a JSON object", i);
                    *bad = 1;
                }
            }
        }
    }
}

static void pack_strings(struct Req *q, const char *key, const char *const *v, size_t n)
{
    pkey(q, key);
    q->fail |= msgpack_pack_array(&q->pk, (uint32_t)n);
    for (size_t i = 0; i < n; i++)
        pstr(q, v[i], strlen(v[i]));
}

static int check_docs(DiffragClient *c, const DiffragDoc *docs, size_t n, int need_ids)
{
    for (size_t i = 0; i < n; i++) {
        if (!docs[i].text)
            return client_fail(c, DIFFRAG_EINVAL, NULL, "docs[%zu] has no text", i);
        if (need_ids && !docs[i].id)
            return client_fail(c, DIFFRAG_EINVAL, NULL, "docs[%zu] has no id", i);
    }
    return DIFFRAG_OK;
}

static int check_strings(DiffragClient *c, const char *what, const char *const *v, size_t n)
{
    if (n && !v)
        return client_fail(c, DIFFRAG_EINVAL, NULL, "%s is NULL", what);
    for (size_t i = 0; i < n; i++)
        if (!v[i])
            return client_fail(c, DIFFRAG_EINVAL, NULL, "%s[%zu] is NULL", what, i);
    return DIFFRAG_OK;
}

static int pack_query(DiffragClient *c, const DiffragQuery *qq, int stream, struct Req *q)
{
    uint32_t n = 1 + (qq->n_docs > 0) + (qq->collection != NULL) + (qq->n_doc_ids > 0) +
                 (qq->top_k != 0) + (qq->max_context_tokens != 0) + (qq->max_tokens != 0) +
                 (qq->temperature != 0) + (qq->top_p != 0) + (qq->seed != 0) +
                 (qq->n_stop > 0) + (stream != 0) + (qq->deadline_ms != 0);
    req_begin(q, c, "query", n, qq->id);
    pkv_str(q, "question", qq->question);
    int bad = 0;
    if (qq->n_docs) {
        pkey(q, "docs");
        pack_docs(q, qq->docs, qq->n_docs, 0, c->err, sizeof c->err, &bad);
    }
    if (qq->collection)
        pkv_str(q, "collection", qq->collection);
    if (qq->n_doc_ids)
        pack_strings(q, "ids", qq->doc_ids, qq->n_doc_ids);
    if (qq->top_k)
        pkv_int(q, "top_k", qq->top_k);
    if (qq->max_context_tokens)
        pkv_int(q, "max_context_tokens", qq->max_context_tokens);
    if (qq->max_tokens)
        pkv_int(q, "max_tokens", qq->max_tokens);
    if (qq->temperature != 0) {
        pkey(q, "temperature");
        q->fail |= msgpack_pack_double(&q->pk, qq->temperature);
    }
    if (qq->top_p != 0) {
        pkey(q, "top_p");
        q->fail |= msgpack_pack_double(&q->pk, qq->top_p);
    }
    if (qq->seed) {
        pkey(q, "seed");
        q->fail |= msgpack_pack_uint64(&q->pk, qq->seed);
    }
    if (qq->n_stop)
        pack_strings(q, "stop", qq->stop, qq->n_stop);
    if (stream) {
        pkey(q, "stream");
        q->fail |= msgpack_pack_true(&q->pk);
    }
    if (qq->deadline_ms)
        pkv_int(q, "deadline_ms", qq->deadline_ms);
    if (q->fail)
        return req_oom(c, q);
    if (bad) {
        req_free(q);
        snprintf(c->code, sizeof c->code, "invalid");
        return DIFFRAG_EINVAL;
    }
    return DIFFRAG_OK;
}

static void decode_citation(struct Dec *d, const msgpack_object *o, size_t i, DiffragCitation *ct)
{
    char ctx[40];
    snprintf(ctx, sizeof ctx, "citations[%zu]", i);
    const char *saved = d->ctx;
    d->ctx = ctx;
    if (o->type != MSGPACK_OBJECT_MAP)
        dec_bad(d, NULL, "expected a map");
    ct->doc_id = dec_str(d, o, "doc_id", 1, NULL);
    ct->chunk = dec_int(d, o, "chunk", 1);
    ct->score = dec_num(d, o, "score", 1);
    const msgpack_object *off = dec_type(d, o, "offsets", MSGPACK_OBJECT_ARRAY, 1);
    if (off && off->via.array.size != 2)
        dec_bad(d, "offsets", "expected [start, end]");
    else if (off) {
        ct->start = dec_as_int(d, &off->via.array.ptr[0], "offsets[0]");
        ct->end = dec_as_int(d, &off->via.array.ptr[1], "offsets[1]");
    }
    ct->marker = dec_int(d, o, "marker", 0);
    ct->cited = dec_bool(d, o, "cited", 0);
    ct->truncated = dec_bool(d, o, "truncated", 0);
    d->ctx = saved;
}

/* A number, or `absent` when the key is missing, nil or of another type. */
static double opt_num(const msgpack_object *map, const char *key, double absent)
{
    const msgpack_object *o = mpo_get(map, key);
    if (!o)
        return absent;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return (double)o->via.u64;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return (double)o->via.i64;
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64)
        return o->via.f64;
    return absent;
}

static int opt_bool(const msgpack_object *map, const char *key)
{
    const msgpack_object *o = mpo_get(map, key);
    return o && o->type == MSGPACK_OBJECT_BOOLEAN && o->via.boolean;
}

static DiffragAnswer *decode_answer(struct Dec *d, const struct Reply *r, const char *id)
{
    DiffragAnswer *a = calloc(1, sizeof *a);
    if (!a) {
        dec_oom(d);
        return NULL;
    }
    a->id = dec_strdup(d, id, strlen(id));
    a->answer = dec_str(d, r->map, "answer", 1, &a->answer_len);
    a->finish_reason = dec_str(d, r->map, "finish_reason", 1, NULL);
    const msgpack_object *cites = dec_type(d, r->map, "citations", MSGPACK_OBJECT_ARRAY, 1);
    if (cites && cites->via.array.size) {
        a->citations = calloc(cites->via.array.size, sizeof *a->citations);
        if (!a->citations)
            dec_oom(d);
        for (uint32_t i = 0; a->citations && i < cites->via.array.size && !d->failed; i++) {
            decode_citation(d, &cites->via.array.ptr[i], i, &a->citations[i]);
            a->n_citations = i + 1;
        }
    }
    const msgpack_object *usage = dec_type(d, r->map, "usage", MSGPACK_OBJECT_MAP, 1);
    d->ctx = "usage";
    a->prompt_tokens = dec_int(d, usage, "prompt_tokens", 1);
    a->context_tokens = dec_int(d, usage, "context_tokens", 0);
    a->completion_tokens = dec_int(d, usage, "completion_tokens", 1);
    d->ctx = NULL;
    const msgpack_object *t = dec_type(d, r->map, "timings", MSGPACK_OBJECT_MAP, 0);
    if (t) {
        d->ctx = "timings";
        a->queue_ms = dec_num(d, t, "queue_ms", 0);
        a->retrieve_ms = dec_num(d, t, "retrieve_ms", 0);
        a->prefill_ms = dec_num(d, t, "prefill_ms", 0);
        a->ttft_ms = dec_num(d, t, "ttft_ms", 0);
        a->decode_ms = dec_num(d, t, "decode_ms", 0);
        a->total_ms = dec_num(d, t, "total_ms", 0);
        d->ctx = NULL;
    }
    const msgpack_object *g = mpo_get(r->map, "grounding");
    if (g && g->type == MSGPACK_OBJECT_MAP && !d->failed) {
        /* informational and still evolving: a field of another type is skipped, never a
         * reason to lose the answer (json keeps everything) */
        DiffragGrounding *gr = &a->grounding;
        a->has_grounding = 1;
        gr->score = opt_num(g, "score", NAN);
        gr->flagged = opt_bool(g, "flagged");
        gr->abstained = opt_bool(g, "abstained");
        gr->lookback_ratio = opt_num(g, "lookback_ratio", NAN);
        gr->unsupported_token_ratio = opt_num(g, "unsupported_token_ratio", NAN);
        gr->mean_logprob = opt_num(g, "mean_logprob", NAN);
        gr->min_logprob = opt_num(g, "min_logprob", NAN);
        gr->answer_tokens = (int64_t)opt_num(g, "answer_tokens", 0);
        gr->flagged_tokens = (int64_t)opt_num(g, "flagged_tokens", 0);
        const msgpack_object *det = mpo_get(g, "detector");
        if (det && det->type == MSGPACK_OBJECT_STR)
            gr->detector = dec_strdup(d, det->via.str.ptr, det->via.str.size);
    }
    a->json = dec_json(d, r->map);
    return a;
}

/* Sends {"op": "cancel", "target": target} without waiting: the query's own reply says how
 * it ended, and the acknowledgement is dropped when it comes (its id is not registered). */
static int send_cancel(DiffragClient *c, const char *target)
{
    struct Req q;
    req_begin(&q, c, "cancel", 1, NULL);
    pkv_str(&q, "target", target);
    if (q.fail)
        return req_oom(c, &q);
    int rc = client_send(c, q.sb.data, q.sb.size);
    req_free(&q);
    return rc;
}

int diffrag_query(DiffragClient *c, const DiffragQuery *qq, DiffragDeltaFn on_delta, void *user,
                  DiffragAnswer **out)
{
    if (!c || !out)
        return DIFFRAG_EINVAL;
    *out = NULL;
    client_begin(c);
    if (!qq || !qq->question || !*qq->question)
        return bad_arg(c, "a query needs a question");
    if (!qq->collection && !qq->n_docs)
        return bad_arg(c, "a query needs documents (docs) or a collection, or both");
    if (qq->n_docs && !qq->docs)
        return bad_arg(c, "docs is NULL");
    if (check_docs(c, qq->docs, qq->n_docs, 0) ||
        check_strings(c, "doc_ids", qq->doc_ids, qq->n_doc_ids) ||
        check_strings(c, "stop", qq->stop, qq->n_stop))
        return DIFFRAG_EINVAL;
    if (qq->id && (!*qq->id || strlen(qq->id) > CLIENT_ID_MAX))
        return bad_arg(c, "a query id has 1 to 256 bytes");
    struct Req q;
    int rc = pack_query(c, qq, on_delta != NULL, &q);
    if (rc)
        return rc;
    int timeout = qq->timeout_ms > 0 ? qq->timeout_ms : c->query_timeout_ms;
    rc = client_register(c, q.id);
    if (rc) {
        req_free(&q);
        return rc;
    }
    rc = client_send(c, q.sb.data, q.sb.size);
    req_free(&q);
    struct Reply *r = NULL;
    size_t n_deltas = 0, text_cap = 0;
    char *text = NULL; /* the delta handed to on_delta, NUL-terminated */
    int cancel_sent = 0;
    while (rc == DIFFRAG_OK) {
        rc = client_recv(c, q.id, timeout, &r);
        if (rc == DIFFRAG_EINTERRUPTED && !cancel_sent) {
            /* the first interrupt cancels on the daemon and waits for the query's end */
            client_clear(c);
            cancel_sent = 1;
            rc = send_cancel(c, q.id);
            continue;
        }
        if (rc)
            break;
        if (r->final)
            break;
        n_deltas++;
        const msgpack_object *delta = mpo_get(r->map, "delta");
        size_t len = delta->via.str.size;
        if (on_delta && !cancel_sent && len + 1 > text_cap) {
            char *p = realloc(text, len + 1);
            if (!p) {
                rc = client_fail(c, DIFFRAG_ENOMEM, NULL, "out of memory");
                break;
            }
            text = p;
            text_cap = len + 1;
        }
        if (on_delta && !cancel_sent) {
            memcpy(text, delta->via.str.ptr, len);
            text[len] = 0;
            if (on_delta(user, text, len) != 0) {
                /* the callback may itself have called into this client: start over clean */
                client_clear(c);
                cancel_sent = 1;
                rc = send_cancel(c, q.id);
            }
        }
        reply_free(&r);
    }
    free(text);
    if (rc == DIFFRAG_OK && !r->ok)
        rc = client_server_error(c, r);
    if (rc == DIFFRAG_OK) {
        struct Dec d = { 0 };
        DiffragAnswer *a = decode_answer(&d, r, q.id);
        if (d.failed) {
            diffrag_answer_free(&a);
            rc = decoded(c, &d);
        } else {
            a->n_deltas = n_deltas;
            *out = a;
            client_clear(c); /* a cancel from the callback may have left its own error */
        }
    }
    reply_free(&r);
    client_unregister(c, q.id);
    return rc;
}

int diffrag_cancel(DiffragClient *c, const char *target, char *state, size_t state_len)
{
    if (!c)
        return DIFFRAG_EINVAL;
    client_clear(c);
    if (state && state_len)
        state[0] = 0;
    if (!target || !*target)
        return bad_arg(c, "cancel needs the id of the query to stop");
    struct Req q;
    struct Reply *r;
    req_begin(&q, c, "cancel", 1, NULL);
    pkv_str(&q, "target", target);
    if (q.fail)
        return req_oom(c, &q);
    int rc = client_call(c, q.id, &q.sb, c->timeout_ms, &r);
    req_free(&q);
    if (rc)
        return rc;
    struct Dec d = { 0 };
    size_t len = 0;
    char *s = dec_str(&d, r->map, "state", 1, &len);
    reply_free(&r);
    if (d.failed)
        return decoded(c, &d);
    if (state && state_len)
        snprintf(state, state_len, "%s", s);
    free(s);
    return DIFFRAG_OK;
}

/* ---- documents ---- */

static int check_collection(DiffragClient *c, const char *collection)
{
    if (!collection || !*collection)
        return bad_arg(c, "no collection");
    return DIFFRAG_OK;
}

void diffrag_ingest_result_free(DiffragIngestResult **pr)
{
    DiffragIngestResult *r = pr ? *pr : NULL;
    if (!r)
        return;
    free(r->collection);
    free(r->json);
    free(r);
    *pr = NULL;
}

int diffrag_ingest(DiffragClient *c, const char *collection, const DiffragDoc *docs,
                   size_t n_docs, DiffragIngestResult **out)
{
    if (!c || !out)
        return DIFFRAG_EINVAL;
    *out = NULL;
    client_begin(c);
    if (check_collection(c, collection))
        return DIFFRAG_EINVAL;
    if (!n_docs || !docs)
        return bad_arg(c, "ingest needs at least one document");
    if (check_docs(c, docs, n_docs, 1))
        return DIFFRAG_EINVAL;
    struct Req q;
    struct Reply *r;
    int bad = 0;
    req_begin(&q, c, "ingest", 2, NULL);
    pkv_str(&q, "collection", collection);
    pkey(&q, "docs");
    pack_docs(&q, docs, n_docs, 1, c->err, sizeof c->err, &bad);
    if (q.fail)
        return req_oom(c, &q);
    if (bad) {
        req_free(&q);
        snprintf(c->code, sizeof c->code, "invalid");
        return DIFFRAG_EINVAL;
    }
    int rc = client_call(c, q.id, &q.sb, c->timeout_ms, &r);
    req_free(&q);
    if (rc)
        return rc;
    struct Dec d = { 0 };
    DiffragIngestResult *res = calloc(1, sizeof *res);
    if (!res)
        dec_oom(&d);
    else {
        res->collection = dec_str(&d, r->map, "collection", 0, NULL);
        res->ingested = dec_int(&d, r->map, "ingested", 1);
        res->bytes = dec_int(&d, r->map, "bytes", 0);
        res->docs = dec_int(&d, r->map, "docs", 1);
        res->chunks = dec_int(&d, r->map, "chunks", 1);
        res->json = dec_json(&d, r->map);
    }
    reply_free(&r);
    if (d.failed) {
        diffrag_ingest_result_free(&res);
        return decoded(c, &d);
    }
    *out = res;
    return DIFFRAG_OK;
}

void diffrag_delete_result_free(DiffragDeleteResult **pr)
{
    DiffragDeleteResult *r = pr ? *pr : NULL;
    if (!r)
        return;
    free(r->json);
    free(r);
    *pr = NULL;
}

int diffrag_delete(DiffragClient *c, const char *collection, const char *const *ids, size_t n_ids,
                   DiffragDeleteResult **out)
{
    if (!c || !out)
        return DIFFRAG_EINVAL;
    *out = NULL;
    client_begin(c);
    if (check_collection(c, collection))
        return DIFFRAG_EINVAL;
    if (!n_ids)
        return bad_arg(c, "delete needs at least one id");
    if (check_strings(c, "ids", ids, n_ids))
        return DIFFRAG_EINVAL;
    struct Req q;
    struct Reply *r;
    req_begin(&q, c, "delete", 2, NULL);
    pkv_str(&q, "collection", collection);
    pack_strings(&q, "ids", ids, n_ids);
    if (q.fail)
        return req_oom(c, &q);
    int rc = client_call(c, q.id, &q.sb, c->timeout_ms, &r);
    req_free(&q);
    if (rc)
        return rc;
    struct Dec d = { 0 };
    DiffragDeleteResult *res = calloc(1, sizeof *res);
    if (!res)
        dec_oom(&d);
    else {
        res->deleted = dec_int(&d, r->map, "deleted", 1);
        res->docs = dec_int(&d, r->map, "docs", 0);
        res->chunks = dec_int(&d, r->map, "chunks", 0);
        res->json = dec_json(&d, r->map);
    }
    reply_free(&r);
    if (d.failed) {
        diffrag_delete_result_free(&res);
        return decoded(c, &d);
    }
    *out = res;
    return DIFFRAG_OK;
}

void diffrag_document_free(DiffragDocument **pd)
{
    DiffragDocument *d = pd ? *pd : NULL;
    if (!d)
        return;
    free(d->id);
    free(d->title);
    free(d->text);
    free(d->meta_json);
    free(d->json);
    free(d);
    *pd = NULL;
}

int diffrag_get(DiffragClient *c, const char *collection, const char *doc_id,
                DiffragDocument **out)
{
    if (!c || !out)
        return DIFFRAG_EINVAL;
    *out = NULL;
    client_begin(c);
    if (check_collection(c, collection))
        return DIFFRAG_EINVAL;
    if (!doc_id || !*doc_id)
        return bad_arg(c, "get needs a document id");
    struct Req q;
    struct Reply *r;
    req_begin(&q, c, "get", 2, NULL);
    pkv_str(&q, "collection", collection);
    pkv_str(&q, "doc_id", doc_id);
    if (q.fail)
        return req_oom(c, &q);
    int rc = client_call(c, q.id, &q.sb, c->timeout_ms, &r);
    req_free(&q);
    if (rc)
        return rc;
    struct Dec d = { 0 };
    DiffragDocument *doc = calloc(1, sizeof *doc);
    if (!doc)
        dec_oom(&d);
    else {
        const msgpack_object *m = dec_type(&d, r->map, "doc", MSGPACK_OBJECT_MAP, 1);
        d.ctx = "doc";
        doc->id = dec_str(&d, m, "id", 1, NULL);
        doc->title = dec_str(&d, m, "title", 0, NULL);
        if (!doc->title && !d.failed)
            doc->title = dec_strdup(&d, "", 0);
        doc->text = dec_str(&d, m, "text", 1, &doc->text_len);
        doc->chunks = dec_int(&d, m, "chunks", 0);
        const msgpack_object *meta = dec_type(&d, m, "meta", MSGPACK_OBJECT_MAP, 0);
        doc->meta_json = dec_json(&d, meta);
        d.ctx = NULL;
        doc->json = dec_json(&d, r->map);
    }
    reply_free(&r);
    if (d.failed) {
        diffrag_document_free(&doc);
        return decoded(c, &d);
    }
    *out = doc;
    return DIFFRAG_OK;
}

void diffrag_list_free(DiffragList **pl)
{
    DiffragList *l = pl ? *pl : NULL;
    if (!l)
        return;
    for (size_t i = 0; i < l->n_collections; i++)
        free(l->collections[i]);
    free(l->collections);
    for (size_t i = 0; i < l->n_docs; i++) {
        free(l->docs[i].id);
        free(l->docs[i].title);
    }
    free(l->docs);
    free(l->next);
    free(l->json);
    free(l);
    *pl = NULL;
}

int diffrag_list(DiffragClient *c, const char *collection, const char *after, int limit,
                 DiffragList **out)
{
    if (!c || !out)
        return DIFFRAG_EINVAL;
    *out = NULL;
    client_begin(c);
    if (collection && !*collection)
        return bad_arg(c, "empty collection name");
    if (!collection && (after || limit))
        return bad_arg(c, "after and limit page through a collection's documents");
    struct Req q;
    struct Reply *r;
    req_begin(&q, c, "list", (collection != NULL) + (after != NULL) + (limit != 0), NULL);
    if (collection)
        pkv_str(&q, "collection", collection);
    if (after)
        pkv_str(&q, "after", after);
    if (limit)
        pkv_int(&q, "limit", limit);
    if (q.fail)
        return req_oom(c, &q);
    int rc = client_call(c, q.id, &q.sb, c->timeout_ms, &r);
    req_free(&q);
    if (rc)
        return rc;
    struct Dec d = { 0 };
    DiffragList *l = calloc(1, sizeof *l);
    if (!l) {
        dec_oom(&d);
    } else if (!collection) {
        const msgpack_object *a = dec_type(&d, r->map, "collections", MSGPACK_OBJECT_ARRAY, 1);
        if (a && a->via.array.size) {
            l->collections = calloc(a->via.array.size, sizeof *l->collections);
            if (!l->collections)
                dec_oom(&d);
            for (uint32_t i = 0; l->collections && i < a->via.array.size && !d.failed; i++) {
                const msgpack_object *s = &a->via.array.ptr[i];
                if (s->type != MSGPACK_OBJECT_STR) {
                    dec_bad(&d, "collections", "expected an array of strings");
                    break;
                }
                l->collections[i] = dec_strdup(&d, s->via.str.ptr, s->via.str.size);
                l->n_collections = i + 1;
            }
        }
    } else {
        const msgpack_object *a = dec_type(&d, r->map, "docs", MSGPACK_OBJECT_ARRAY, 1);
        if (a && a->via.array.size) {
            l->docs = calloc(a->via.array.size, sizeof *l->docs);
            if (!l->docs)
                dec_oom(&d);
            for (uint32_t i = 0; l->docs && i < a->via.array.size && !d.failed; i++) {
                const msgpack_object *o = &a->via.array.ptr[i];
                char ctx[32];
                snprintf(ctx, sizeof ctx, "docs[%u]", i);
                d.ctx = ctx;
                if (o->type != MSGPACK_OBJECT_MAP) {
                    dec_bad(&d, NULL, "expected a map");
                    break;
                }
                l->docs[i].id = dec_str(&d, o, "id", 1, NULL);
                l->docs[i].title = dec_str(&d, o, "title", 0, NULL);
                l->docs[i].bytes = dec_int(&d, o, "bytes", 0);
                l->docs[i].chunks = dec_int(&d, o, "chunks", 0);
                l->n_docs = i + 1;
            }
            d.ctx = NULL;
        }
        l->next = dec_str_or_nil(&d, r->map, "next");
    }
    if (l)
        l->json = dec_json(&d, r->map);
    reply_free(&r);
    if (d.failed) {
        diffrag_list_free(&l);
        return decoded(c, &d);
    }
    *out = l;
    return DIFFRAG_OK;
}

void diffrag_stats_free(DiffragStats **ps)
{
    DiffragStats *s = ps ? *ps : NULL;
    if (!s)
        return;
    free(s->collection);
    free(s->version);
    free(s->model);
    free(s->json);
    free(s);
    *ps = NULL;
}

int diffrag_stats(DiffragClient *c, const char *collection, DiffragStats **out)
{
    if (!c || !out)
        return DIFFRAG_EINVAL;
    *out = NULL;
    client_begin(c);
    if (collection && !*collection)
        return bad_arg(c, "empty collection name");
    struct Req q;
    struct Reply *r;
    req_begin(&q, c, "stats", collection != NULL, NULL);
    if (collection)
        pkv_str(&q, "collection", collection);
    if (q.fail)
        return req_oom(c, &q);
    int rc = client_call(c, q.id, &q.sb, c->timeout_ms, &r);
    req_free(&q);
    if (rc)
        return rc;
    struct Dec d = { 0 };
    DiffragStats *s = calloc(1, sizeof *s);
    if (!s) {
        dec_oom(&d);
    } else if (collection) {
        s->collection = dec_str(&d, r->map, "collection", 0, NULL);
        if (!s->collection && !d.failed)
            s->collection = dec_strdup(&d, collection, strlen(collection));
        s->docs = dec_int(&d, r->map, "docs", 1);
        s->chunks = dec_int(&d, r->map, "chunks", 1);
        s->terms = dec_int(&d, r->map, "terms", 0);
        s->text_bytes = dec_int(&d, r->map, "text_bytes", 0);
        s->avg_chunk_terms = dec_num(&d, r->map, "avg_chunk_terms", 0);
        s->chunk_tokens = dec_int(&d, r->map, "chunk_tokens", 0);
    } else {
        s->version = dec_str(&d, r->map, "version", 1, NULL);
        s->model = dec_str(&d, r->map, "model", 0, NULL);
        s->uptime_s = dec_num(&d, r->map, "uptime_s", 0);
        const msgpack_object *w = dec_type(&d, r->map, "workers", MSGPACK_OBJECT_MAP, 0);
        d.ctx = "workers";
        s->workers_idle = dec_int(&d, w, "idle", 0);
        s->workers_busy = dec_int(&d, w, "busy", 0);
        d.ctx = NULL;
        s->queue_depth = dec_int(&d, r->map, "queue_depth", 0);
        s->inflight = dec_int(&d, r->map, "inflight", 0);
        s->kv_cache_bytes = dec_int(&d, r->map, "kv_cache_bytes", 0);
        s->draining = dec_bool(&d, r->map, "draining", 0);
    }
    if (s)
        s->json = dec_json(&d, r->map);
    reply_free(&r);
    if (d.failed) {
        diffrag_stats_free(&s);
        return decoded(c, &d);
    }
    *out = s;
    return DIFFRAG_OK;
}
