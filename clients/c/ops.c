/* The operations of docs/protocol.md, one descriptor each: which request fields are packed from
 * the caller's arguments, which reply fields are decoded into the result structs of diffrag.h
 * (and freed from them). The runner (op_run.c) does validate -> pack -> call -> decode for every op but
 * query, which streams, cancels, and uses the same descriptors around its own exchange. */
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


static const struct ResultType PONG_TYPE = {
    .size = sizeof(DiffragPong), .json_off = offsetof(DiffragPong, json),
    .strs = { offsetof(DiffragPong, version), offsetof(DiffragPong, model) }, .n_strs = 2,
};
static const struct RepField PING_REP[] = {
    { "pong", REP_TRUE, 1, 0, 0, 0, 0, 0 },
    REP(DiffragPong, "version", REP_STR, 0, version),
    REP(DiffragPong, "model", REP_STR, 0, model),
    REP(DiffragPong, NULL, REP_CALL_MS, 0, rtt_ms),
};
static const struct OpDesc OP_PING = {
    .op = "ping", .type = &PONG_TYPE, .rep = PING_REP, .n_rep = COUNT(PING_REP),
};

/* cancel: the acknowledgement's state, copied into the caller's buffer */

struct CancelArgs {
    const char *target;
};
struct CancelResult {
    char *state;
};

static int check_cancel(DiffragClient *c, const void *args)
{
    const struct CancelArgs *a = args;
    if (!a->target || !*a->target)
        return op_bad_arg(c, "cancel needs the id of the query to stop");
    return DIFFRAG_OK;
}

static const struct ResultType CANCEL_TYPE = {
    .size = sizeof(struct CancelResult), .json_off = NO_JSON,
    .strs = { offsetof(struct CancelResult, state) }, .n_strs = 1,
};
static const struct ReqField CANCEL_REQ[] = { REQ(struct CancelArgs, "target", REQ_STR, target) };
static const struct RepField CANCEL_REP[] = {
    REP(struct CancelResult, "state", REP_STR, 1, state),
};
static const struct OpDesc OP_CANCEL = {
    .op = "cancel", .nested = 1, .check = check_cancel, .type = &CANCEL_TYPE,
    OP_TABLES(CANCEL_REQ, CANCEL_REP),
};

/* query */

struct QueryArgs {
    DiffragQuery q;
    int stream;
};

static int check_query(DiffragClient *c, const void *args)
{
    const DiffragQuery *qq = &((const struct QueryArgs *)args)->q;
    if (!qq->question || !*qq->question)
        return op_bad_arg(c, "a query needs a question");
    if (!qq->collection && !qq->n_docs)
        return op_bad_arg(c, "a query needs documents (docs) or a collection, or both");
    if (qq->n_docs && !qq->docs)
        return op_bad_arg(c, "docs is NULL");
    if (op_check_docs(c, qq->docs, qq->n_docs, 0) ||
        op_check_strings(c, "doc_ids", qq->doc_ids, qq->n_doc_ids) ||
        op_check_strings(c, "stop", qq->stop, qq->n_stop))
        return DIFFRAG_EINVAL;
    if (qq->id && (!*qq->id || strlen(qq->id) > CLIENT_ID_MAX))
        return op_bad_arg(c, "a query id has 1 to 256 bytes");
    return DIFFRAG_OK;
}

static void answer_free_more(void *res)
{
    DiffragAnswer *a = res;
    for (size_t i = 0; i < a->n_citations; i++) {
        free(a->citations[i].doc_id);
        free(a->citations[i].heading);
    }
    free(a->citations);
    free(a->decline_reason);
    free(a->attempt);
    free(a->answer_mode);
    for (size_t i = 0; i < a->n_quotes; i++) {
        free(a->quotes[i].doc_id);
        free(a->quotes[i].text);
    }
    free(a->quotes);
}

static const struct ResultType ANSWER_TYPE = {
    .size = sizeof(DiffragAnswer), .json_off = offsetof(DiffragAnswer, json),
    .strs = { offsetof(DiffragAnswer, id), offsetof(DiffragAnswer, answer),
              offsetof(DiffragAnswer, finish_reason), offsetof(DiffragAnswer, grounding.detector) },
    .n_strs = 4, .free_more = answer_free_more,
};

#define QA struct QueryArgs
static const struct ReqField QUERY_REQ[] = {
    REQ(QA, "question", REQ_STR, q.question),
    REQ_N(QA, "docs", REQ_DOCS, q.docs, q.n_docs),
    REQ(QA, "collection", REQ_STR_OPT, q.collection),
    REQ_N(QA, "ids", REQ_STRS, q.doc_ids, q.n_doc_ids),
    REQ(QA, "top_k", REQ_INT_OPT, q.top_k),
    REQ(QA, "max_context_tokens", REQ_INT_OPT, q.max_context_tokens),
    REQ(QA, "max_tokens", REQ_INT_OPT, q.max_tokens),
    REQ(QA, "temperature", REQ_NUM_OPT, q.temperature),
    REQ(QA, "top_p", REQ_NUM_OPT, q.top_p),
    REQ(QA, "seed", REQ_U64_OPT, q.seed),
    REQ_N(QA, "stop", REQ_STRS, q.stop, q.n_stop),
    REQ(QA, "stream", REQ_TRUE_OPT, stream),
    REQ(QA, "deadline_ms", REQ_INT_OPT, q.deadline_ms),
    REQ(QA, "order", REQ_STR_OPT, q.order),
    REQ(QA, "unsupported", REQ_STR_OPT, q.unsupported),
    REQ(QA, "answer_mode", REQ_STR_OPT, q.answer_mode),
    REQ_N(QA, "relevance_floor", REQ_NUM_GIVEN, q.relevance_floor, q.relevance_floor_given),
};
#undef QA

static const struct RepField CITATION_REP[] = {
    REP(DiffragCitation, "doc_id", REP_STR, 1, doc_id),
    REP(DiffragCitation, "chunk", REP_INT, 1, chunk),
    REP2(DiffragCitation, "heading", REP_STR_LEN, 0, heading, heading_len),
    REP2(DiffragCitation, "page", REP_INT_PAIR_NIL, 0, page_first, page_last),
    REP(DiffragCitation, "score", REP_NUM, 1, score),
    REP2(DiffragCitation, "offsets", REP_INT_PAIR, 1, start, end),
    REP(DiffragCitation, "marker", REP_INT, 0, marker),
    REP(DiffragCitation, "cited", REP_BOOL, 0, cited),
    REP(DiffragCitation, "truncated", REP_BOOL, 0, truncated),
    REP(DiffragCitation, "whole", REP_BOOL, 0, whole),
};
static const struct RepField QUOTE_REP[] = {
    REP(DiffragQuote, "marker", REP_INT, 1, marker),
    REP(DiffragQuote, "doc_id", REP_STR, 1, doc_id),
    REP(DiffragQuote, "chunk", REP_INT, 1, chunk),
    REP2(DiffragQuote, "offsets", REP_INT_PAIR, 1, start, end),
    REP2(DiffragQuote, "text", REP_STR_LEN, 1, text, text_len),
};
static const struct RepField QUERY_REP[] = {
    REP2(DiffragAnswer, "answer", REP_STR_LEN, 1, answer, answer_len),
    REP(DiffragAnswer, "finish_reason", REP_STR, 1, finish_reason),
    REP_ARRAY(DiffragAnswer, "citations", 1, citations, n_citations, DiffragCitation,
              CITATION_REP),
    /* quote mode (a daemon before it sends neither: free, no quotes) */
    REP(DiffragAnswer, "answer_mode", REP_STR, 0, answer_mode),
    REP_ARRAY(DiffragAnswer, "quotes", 0, quotes, n_quotes, DiffragQuote, QUOTE_REP),
    REP_MAP("usage", 1),
    REP(DiffragAnswer, "prompt_tokens", REP_INT, 1, prompt_tokens),
    REP(DiffragAnswer, "context_tokens", REP_INT, 0, context_tokens),
    REP(DiffragAnswer, "completion_tokens", REP_INT, 1, completion_tokens),
    REP(DiffragAnswer, "cached_tokens", REP_INT, 0, cached_tokens),
    REP(DiffragAnswer, "reused_tokens", REP_INT, 0, reused_tokens),
    REP_END_MAP,
    REP_MAP("timings", 0),
    REP(DiffragAnswer, "queue_ms", REP_NUM, 0, queue_ms),
    REP(DiffragAnswer, "retrieve_ms", REP_NUM, 0, retrieve_ms),
    REP(DiffragAnswer, "prefill_ms", REP_NUM, 0, prefill_ms),
    REP(DiffragAnswer, "ttft_ms", REP_NUM, 0, ttft_ms),
    REP(DiffragAnswer, "decode_ms", REP_NUM, 0, decode_ms),
    REP(DiffragAnswer, "total_ms", REP_NUM, 0, total_ms),
    REP_END_MAP,
};

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

/* grounding and context, read leniently */
static void decode_answer(struct Dec *d, const msgpack_object *map, const void *args, void *res)
{
    DiffragAnswer *a = res;
    (void)args;
    const msgpack_object *cx = mpo_get(map, "context");
    if (cx && cx->type == MSGPACK_OBJECT_MAP && !d->failed) {
        DiffragContextRead *r = &a->context;
        a->has_context = 1;
        r->documents = (int64_t)opt_num(cx, "documents", 0);
        r->doc_tokens = (int64_t)opt_num(cx, "doc_tokens", -1);
        r->placed_tokens = (int64_t)opt_num(cx, "placed_tokens", 0);
        r->chunks_matched = (int64_t)opt_num(cx, "chunks_matched", 0);
        r->chunks_placed = (int64_t)opt_num(cx, "chunks_placed", 0);
        r->chunks_left_out = (int64_t)opt_num(cx, "chunks_left_out", 0);
        r->chunks_below_floor = (int64_t)opt_num(cx, "chunks_below_floor", 0);
        r->whole = opt_bool(cx, "whole");
        r->window = opt_bool(cx, "window");
    }
    /* the answer policy's decline (a daemon before it sends none: not declined) */
    a->declined = opt_bool(map, "declined");
    const msgpack_object *why = mpo_get(map, "decline_reason");
    if (a->declined && why && why->type == MSGPACK_OBJECT_STR && !d->failed)
        a->decline_reason = dec_strdup(d, why->via.str.ptr, why->via.str.size);
    const msgpack_object *att = mpo_get(map, "attempt");
    if (a->declined && att && att->type == MSGPACK_OBJECT_STR && !d->failed) {
        a->attempt = dec_strdup(d, att->via.str.ptr, att->via.str.size);
        a->attempt_len = a->attempt ? att->via.str.size : 0;
    }
    if (!a->answer_mode && !d->failed)
        a->answer_mode = dec_strdup(d, "free", 4);
    const msgpack_object *g = mpo_get(map, "grounding");
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
        gr->self_check = opt_num(g, "self_check", NAN);
        gr->context_reliance = opt_num(g, "context_reliance", NAN);
        gr->hidden_probe = opt_num(g, "hidden_probe", NAN);
        gr->quote_removed = opt_num(g, "quote_removed", NAN);
        gr->answer_tokens = (int64_t)opt_num(g, "answer_tokens", 0);
        gr->flagged_tokens = (int64_t)opt_num(g, "flagged_tokens", 0);
        const msgpack_object *det = mpo_get(g, "detector");
        if (det && det->type == MSGPACK_OBJECT_STR)
            gr->detector = dec_strdup(d, det->via.str.ptr, det->via.str.size);
    }
}

static const struct OpDesc OP_QUERY = {
    .op = "query", .check = check_query, .type = &ANSWER_TYPE, .decode = decode_answer,
    OP_TABLES(QUERY_REQ, QUERY_REP),
};

/* ingest */

struct IngestArgs {
    const char *collection;
    const DiffragDoc *docs;
    size_t n_docs;
};

static int check_ingest(DiffragClient *c, const void *args)
{
    const struct IngestArgs *a = args;
    if (op_check_collection(c, a->collection))
        return DIFFRAG_EINVAL;
    if (!a->n_docs || !a->docs)
        return op_bad_arg(c, "ingest needs at least one document");
    return op_check_docs(c, a->docs, a->n_docs, 1);
}

static const struct ResultType INGEST_TYPE = {
    .size = sizeof(DiffragIngestResult), .json_off = offsetof(DiffragIngestResult, json),
    .strs = { offsetof(DiffragIngestResult, collection) }, .n_strs = 1,
};
static const struct ReqField INGEST_REQ[] = {
    REQ(struct IngestArgs, "collection", REQ_STR, collection),
    REQ_N(struct IngestArgs, "docs", REQ_DOCS_META, docs, n_docs),
};
static const struct RepField INGEST_REP[] = {
    REP(DiffragIngestResult, "collection", REP_STR, 0, collection),
    REP(DiffragIngestResult, "ingested", REP_INT, 1, ingested),
    REP(DiffragIngestResult, "bytes", REP_INT, 0, bytes),
    REP(DiffragIngestResult, "docs", REP_INT, 1, docs),
    REP(DiffragIngestResult, "chunks", REP_INT, 1, chunks),
    REP(DiffragIngestResult, "added", REP_INT, 0, added),
    REP(DiffragIngestResult, "changed", REP_INT, 0, changed),
    REP(DiffragIngestResult, "unchanged", REP_INT, 0, unchanged),
};
static const struct OpDesc OP_INGEST = {
    .op = "ingest", .check = check_ingest, .type = &INGEST_TYPE,
    OP_TABLES(INGEST_REQ, INGEST_REP),
};

/* ingest of files */

struct IngestFilesArgs {
    const char *collection;
    const DiffragFile *files;
    size_t n_files;
};

static int check_ingest_files(DiffragClient *c, const void *args)
{
    const struct IngestFilesArgs *a = args;
    if (op_check_collection(c, a->collection))
        return DIFFRAG_EINVAL;
    if (!a->n_files || !a->files)
        return op_bad_arg(c, "ingest needs at least one file");
    return op_check_files(c, a->files, a->n_files);
}

static const struct ReqField INGEST_FILES_REQ[] = {
    REQ(struct IngestFilesArgs, "collection", REQ_STR, collection),
    REQ_N(struct IngestFilesArgs, "docs", REQ_FILES, files, n_files),
};
static const struct OpDesc OP_INGEST_FILES = {
    .op = "ingest", .check = check_ingest_files, .type = &INGEST_TYPE,
    OP_TABLES(INGEST_FILES_REQ, INGEST_REP),
};

/* delete */

struct DeleteArgs {
    const char *collection;
    const char *const *ids;
    size_t n_ids;
};

static int check_delete(DiffragClient *c, const void *args)
{
    const struct DeleteArgs *a = args;
    if (op_check_collection(c, a->collection))
        return DIFFRAG_EINVAL;
    if (!a->n_ids)
        return op_bad_arg(c, "delete needs at least one id");
    return op_check_strings(c, "ids", a->ids, a->n_ids);
}

static const struct ResultType DELETE_TYPE = {
    .size = sizeof(DiffragDeleteResult), .json_off = offsetof(DiffragDeleteResult, json),
};
static const struct ReqField DELETE_REQ[] = {
    REQ(struct DeleteArgs, "collection", REQ_STR, collection),
    REQ_N(struct DeleteArgs, "ids", REQ_STRS, ids, n_ids),
};
static const struct RepField DELETE_REP[] = {
    REP(DiffragDeleteResult, "deleted", REP_INT, 1, deleted),
    REP(DiffragDeleteResult, "docs", REP_INT, 0, docs),
    REP(DiffragDeleteResult, "chunks", REP_INT, 0, chunks),
};
static const struct OpDesc OP_DELETE = {
    .op = "delete", .check = check_delete, .type = &DELETE_TYPE,
    OP_TABLES(DELETE_REQ, DELETE_REP),
};

/* drop */

struct CollectionArgs {
    const char *collection;
};

static int check_drop(DiffragClient *c, const void *args)
{
    return op_check_collection(c, ((const struct CollectionArgs *)args)->collection);
}

/* A reply without "collection" names the one asked about. */
static void decode_drop(struct Dec *d, const msgpack_object *map, const void *args, void *res)
{
    DiffragDropResult *r = res;
    const char *name = ((const struct CollectionArgs *)args)->collection;
    (void)map;
    if (!r->collection && !d->failed)
        r->collection = dec_strdup(d, name, strlen(name));
}

static const struct ResultType DROP_TYPE = {
    .size = sizeof(DiffragDropResult), .json_off = offsetof(DiffragDropResult, json),
    .strs = { offsetof(DiffragDropResult, collection) }, .n_strs = 1,
};
static const struct ReqField DROP_REQ[] = {
    REQ(struct CollectionArgs, "collection", REQ_STR, collection),
};
static const struct RepField DROP_REP[] = {
    REP(DiffragDropResult, "collection", REP_STR, 0, collection),
    REP(DiffragDropResult, "dropped", REP_INT, 1, dropped),
};
static const struct OpDesc OP_DROP = {
    .op = "drop", .check = check_drop, .type = &DROP_TYPE, .decode = decode_drop,
    OP_TABLES(DROP_REQ, DROP_REP),
};

/* get */

struct GetArgs {
    const char *collection;
    const char *doc_id;
};

static int check_get(DiffragClient *c, const void *args)
{
    const struct GetArgs *a = args;
    if (op_check_collection(c, a->collection))
        return DIFFRAG_EINVAL;
    if (!a->doc_id || !*a->doc_id)
        return op_bad_arg(c, "get needs a document id");
    return DIFFRAG_OK;
}

/* A document without a title has "" as its title. */
static void decode_document(struct Dec *d, const msgpack_object *map, const void *args, void *res)
{
    DiffragDocument *doc = res;
    (void)map, (void)args;
    if (!doc->title && !d->failed)
        doc->title = dec_strdup(d, "", 0);
}

static const struct ResultType DOCUMENT_TYPE = {
    .size = sizeof(DiffragDocument), .json_off = offsetof(DiffragDocument, json),
    .strs = { offsetof(DiffragDocument, id), offsetof(DiffragDocument, title),
              offsetof(DiffragDocument, text), offsetof(DiffragDocument, meta_json) },
    .n_strs = 4,
};
static const struct ReqField GET_REQ[] = {
    REQ(struct GetArgs, "collection", REQ_STR, collection),
    REQ(struct GetArgs, "doc_id", REQ_STR, doc_id),
};
static const struct RepField GET_REP[] = {
    REP_MAP("doc", 1),
    REP(DiffragDocument, "id", REP_STR, 1, id),
    REP(DiffragDocument, "title", REP_STR, 0, title),
    REP2(DiffragDocument, "text", REP_STR_LEN, 1, text, text_len),
    REP(DiffragDocument, "chunks", REP_INT, 0, chunks),
    REP(DiffragDocument, "meta", REP_JSON_MAP, 0, meta_json),
    REP_END_MAP,
};
static const struct OpDesc OP_GET = {
    .op = "get", .check = check_get, .type = &DOCUMENT_TYPE, .decode = decode_document,
    OP_TABLES(GET_REQ, GET_REP),
};

/* list */

struct ListArgs {
    const char *collection;
    const char *after;
    int limit;
};

static int check_list(DiffragClient *c, const void *args)
{
    const struct ListArgs *a = args;
    if (a->collection && !*a->collection)
        return op_bad_arg(c, "empty collection name");
    if (!a->collection && (a->after || a->limit))
        return op_bad_arg(c, "after and limit page through a collection's documents");
    return DIFFRAG_OK;
}

static void list_free_more(void *res)
{
    DiffragList *l = res;
    for (size_t i = 0; i < l->n_collections; i++)
        free(l->collections[i]);
    free(l->collections);
    for (size_t i = 0; i < l->n_docs; i++) {
        free(l->docs[i].id);
        free(l->docs[i].title);
    }
    free(l->docs);
}

static const struct RepField DOC_INFO_REP[] = {
    REP(DiffragDocInfo, "id", REP_STR, 1, id),
    REP(DiffragDocInfo, "title", REP_STR, 0, title),
    REP(DiffragDocInfo, "bytes", REP_INT, 0, bytes),
    REP(DiffragDocInfo, "chunks", REP_INT, 0, chunks),
};
static const struct RepField LIST_NAMES_REP[] = {
    REP2(DiffragList, "collections", REP_STRS, 1, collections, n_collections),
};
static const struct RepField LIST_DOCS_REP[] = {
    REP_ARRAY(DiffragList, "docs", 1, docs, n_docs, DiffragDocInfo, DOC_INFO_REP),
    REP(DiffragList, "next", REP_STR_NIL, 0, next),
};

static const struct ResultType LIST_TYPE = {
    .size = sizeof(DiffragList), .json_off = offsetof(DiffragList, json),
    .strs = { offsetof(DiffragList, next) }, .n_strs = 1, .free_more = list_free_more,
};
static const struct ReqField LIST_REQ[] = {
    REQ(struct ListArgs, "collection", REQ_STR_OPT, collection),
    REQ(struct ListArgs, "after", REQ_STR_OPT, after),
    REQ(struct ListArgs, "limit", REQ_INT_OPT, limit),
};
/* without a collection: its names; with one: a page of its documents */
static const struct OpDesc OP_LIST_NAMES = {
    .op = "list", .check = check_list, .type = &LIST_TYPE, OP_TABLES(LIST_REQ, LIST_NAMES_REP),
};
static const struct OpDesc OP_LIST_DOCS = {
    .op = "list", .check = check_list, .type = &LIST_TYPE, OP_TABLES(LIST_REQ, LIST_DOCS_REP),
};

/* stats: of a collection, or of the daemon */

static int check_stats(DiffragClient *c, const void *args)
{
    const char *collection = ((const struct CollectionArgs *)args)->collection;
    if (collection && !*collection)
        return op_bad_arg(c, "empty collection name");
    return DIFFRAG_OK;
}

static const struct ResultType STATS_TYPE = {
    .size = sizeof(DiffragStats), .json_off = offsetof(DiffragStats, json),
    .strs = { offsetof(DiffragStats, collection), offsetof(DiffragStats, version),
              offsetof(DiffragStats, model) }, .n_strs = 3,
};
static const struct ReqField STATS_REQ[] = {
    REQ(struct CollectionArgs, "collection", REQ_STR_OPT, collection),
};
static const struct RepField STATS_COLLECTION_REP[] = {
    REP(DiffragStats, "collection", REP_STR, 0, collection),
    REP(DiffragStats, "docs", REP_INT, 1, docs),
    REP(DiffragStats, "chunks", REP_INT, 1, chunks),
    REP(DiffragStats, "terms", REP_INT, 0, terms),
    REP(DiffragStats, "text_bytes", REP_INT, 0, text_bytes),
    REP(DiffragStats, "avg_chunk_terms", REP_NUM, 0, avg_chunk_terms),
    REP(DiffragStats, "chunk_tokens", REP_INT, 0, chunk_tokens),
};
static const struct RepField STATS_DAEMON_REP[] = {
    REP(DiffragStats, "version", REP_STR, 1, version),
    REP(DiffragStats, "model", REP_STR, 0, model),
    REP(DiffragStats, "uptime_s", REP_NUM, 0, uptime_s),
    REP_MAP("workers", 0),
    REP(DiffragStats, "idle", REP_INT, 0, workers_idle),
    REP(DiffragStats, "busy", REP_INT, 0, workers_busy),
    REP_END_MAP,
    REP(DiffragStats, "queue_depth", REP_INT, 0, queue_depth),
    REP(DiffragStats, "inflight", REP_INT, 0, inflight),
    REP(DiffragStats, "kv_cache_bytes", REP_INT, 0, kv_cache_bytes),
    REP(DiffragStats, "draining", REP_BOOL, 0, draining),
};

/* A reply without "collection" names the one asked about. */
static void decode_collection_stats(struct Dec *d, const msgpack_object *map, const void *args,
                                    void *res)
{
    DiffragStats *s = res;
    const char *name = ((const struct CollectionArgs *)args)->collection;
    (void)map;
    if (!s->collection && !d->failed)
        s->collection = dec_strdup(d, name, strlen(name));
}

static const struct OpDesc OP_STATS_COLLECTION = {
    .op = "stats", .check = check_stats, .type = &STATS_TYPE, .decode = decode_collection_stats,
    OP_TABLES(STATS_REQ, STATS_COLLECTION_REP),
};
static const struct OpDesc OP_STATS_DAEMON = {
    .op = "stats", .check = check_stats, .type = &STATS_TYPE,
    OP_TABLES(STATS_REQ, STATS_DAEMON_REP),
};

/* ---- the public calls ---- */

/* Runs op and hands its result to the caller's typed pointer. */
#define RUN(c, op, args, out)                             \
    do {                                                  \
        if (!(c) || !(out))                               \
            return DIFFRAG_EINVAL;                        \
        void *res_;                                       \
        int rc_ = op_run((c), (op), (args), &res_);       \
        *(out) = res_;                                    \
        return rc_;                                       \
    } while (0)

/* The free function of a result type: frees *p and sets it to NULL. */
#define DEFINE_FREE(name, T, type)   \
    void name(T **p)                 \
    {                                \
        if (!p)                      \
            return;                  \
        op_result_free(&(type), *p);    \
        *p = NULL;                   \
    }

DEFINE_FREE(diffrag_pong_free, DiffragPong, PONG_TYPE)
DEFINE_FREE(diffrag_answer_free, DiffragAnswer, ANSWER_TYPE)
DEFINE_FREE(diffrag_ingest_result_free, DiffragIngestResult, INGEST_TYPE)
DEFINE_FREE(diffrag_delete_result_free, DiffragDeleteResult, DELETE_TYPE)
DEFINE_FREE(diffrag_drop_result_free, DiffragDropResult, DROP_TYPE)
DEFINE_FREE(diffrag_document_free, DiffragDocument, DOCUMENT_TYPE)
DEFINE_FREE(diffrag_list_free, DiffragList, LIST_TYPE)
DEFINE_FREE(diffrag_stats_free, DiffragStats, STATS_TYPE)

int diffrag_ping(DiffragClient *c, DiffragPong **out)
{
    RUN(c, &OP_PING, NULL, out);
}

int diffrag_ingest(DiffragClient *c, const char *collection, const DiffragDoc *docs,
                   size_t n_docs, DiffragIngestResult **out)
{
    struct IngestArgs a = { collection, docs, n_docs };
    RUN(c, &OP_INGEST, &a, out);
}

int diffrag_ingest_files(DiffragClient *c, const char *collection, const DiffragFile *files,
                         size_t n_files, DiffragIngestResult **out)
{
    struct IngestFilesArgs a = { collection, files, n_files };
    RUN(c, &OP_INGEST_FILES, &a, out);
}

int diffrag_delete(DiffragClient *c, const char *collection, const char *const *ids, size_t n_ids,
                   DiffragDeleteResult **out)
{
    struct DeleteArgs a = { collection, ids, n_ids };
    RUN(c, &OP_DELETE, &a, out);
}

int diffrag_drop(DiffragClient *c, const char *collection, DiffragDropResult **out)
{
    struct CollectionArgs a = { collection };
    RUN(c, &OP_DROP, &a, out);
}

int diffrag_get(DiffragClient *c, const char *collection, const char *doc_id,
                DiffragDocument **out)
{
    struct GetArgs a = { collection, doc_id };
    RUN(c, &OP_GET, &a, out);
}

int diffrag_list(DiffragClient *c, const char *collection, const char *after, int limit,
                 DiffragList **out)
{
    struct ListArgs a = { collection, after, limit };
    RUN(c, collection ? &OP_LIST_DOCS : &OP_LIST_NAMES, &a, out);
}

int diffrag_stats(DiffragClient *c, const char *collection, DiffragStats **out)
{
    struct CollectionArgs a = { collection };
    RUN(c, collection ? &OP_STATS_COLLECTION : &OP_STATS_DAEMON, &a, out);
}

int diffrag_cancel(DiffragClient *c, const char *target, char *state, size_t state_len)
{
    if (!c)
        return DIFFRAG_EINVAL;
    if (state && state_len)
        state[0] = 0;
    struct CancelArgs a = { target };
    void *res;
    int rc = op_run(c, &OP_CANCEL, &a, &res);
    if (rc)
        return rc;
    struct CancelResult *r = res;
    if (state && state_len)
        snprintf(state, state_len, "%s", r->state);
    op_result_free(&CANCEL_TYPE, r);
    return DIFFRAG_OK;
}

/* Sends {"op": "cancel", "target": target} without waiting: the query's own reply says how
 * it ended, and the acknowledgement is dropped when it comes (its id is not registered). */
static int send_cancel(DiffragClient *c, const char *target)
{
    struct Req q;
    struct CancelArgs a = { target };
    int rc = op_req_pack(c, &OP_CANCEL, &a, NULL, &q);
    if (rc)
        return rc;
    rc = client_send(c, q.sb.data, q.sb.size);
    op_req_free(&q);
    return rc;
}

int diffrag_query(DiffragClient *c, const DiffragQuery *qq, DiffragDeltaFn on_delta, void *user,
                  DiffragAnswer **out)
{
    if (!c || !out)
        return DIFFRAG_EINVAL;
    *out = NULL;
    if (!qq) {
        client_begin(c);
        return op_bad_arg(c, "a query needs a question");
    }
    struct QueryArgs args = { *qq, on_delta != NULL };
    struct Req q;
    int rc = op_start(c, &OP_QUERY, &args, qq->id, &q);
    if (rc)
        return rc;
    int timeout = qq->timeout_ms > 0 ? qq->timeout_ms : c->query_timeout_ms;
    rc = client_register(c, q.id);
    if (rc) {
        op_req_free(&q);
        return rc;
    }
    rc = client_send(c, q.sb.data, q.sb.size);
    op_req_free(&q);
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
        DiffragAnswer *a = op_result_decode(&d, &OP_QUERY, r->map, &args, 0);
        if (a)
            a->id = dec_strdup(&d, q.id, strlen(q.id));
        if (d.failed) {
            op_result_free(&ANSWER_TYPE, a);
            rc = op_decoded(c, &d);
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
