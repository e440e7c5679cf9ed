/* The descriptor of a protocol op for the C client (what is packed from the caller's
 * arguments, what is decoded into the result structs of diffrag.h) and the runner that carries
 * every op out from its descriptor (op_run.c). The tables themselves are in ops.c. */
#ifndef DIFFRAG_CLIENT_OP_DESC_H
#define DIFFRAG_CLIENT_OP_DESC_H

#include <stddef.h>
#include <stdint.h>

#include "clients/c/client_internal.h"

#define META_MAX_DEPTH 16 /* the daemon's default max_depth: deeper meta would be refused */

/* The member at byte offset off of an argument struct (read) or a result struct (written). */
#define ARG(args, off, T) (*(T const *)(const void *)((const char *)(args) + (off)))
#define RES(res, off, T) (*(T *)(void *)((char *)(res) + (off)))
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* ---- descriptors ---- */

/* How a request field is read from the op's argument struct (the value at off, an element
 * count at count_off) and when it is left out of the request. */
enum ReqKind {
    REQ_STR,       /* const char *, always sent (the op's check made sure it is set) */
    REQ_STR_OPT,   /* const char *, left out when NULL */
    REQ_INT_OPT,   /* int, left out when 0 */
    REQ_U64_OPT,   /* uint64_t, left out when 0 */
    REQ_NUM_OPT,   /* double, left out when 0 */
    REQ_NUM_GIVEN, /* double, sent when the int at count_off is not 0 */
    REQ_TRUE_OPT,  /* int, sent as true when not 0 */
    REQ_STRS,      /* const char *const [count], left out when count is 0 */
    REQ_DOCS,      /* const DiffragDoc [count], left out when count is 0; meta_json ignored */
    REQ_DOCS_META, /* the same with each document's meta_json */
    REQ_FILES,     /* const DiffragFile [count], left out when count is 0 */
};

struct ReqField {
    const char *key;
    enum ReqKind kind;
    size_t off, count_off;
};

/* How a reply field is stored in the result struct: at off, and at off2 what goes with it. */
enum RepKind {
    REP_STR,      /* char *, a copy */
    REP_STR_LEN,  /* char * and its length (size_t at off2) */
    REP_STR_NIL,  /* char *, NULL for nil */
    REP_INT,      /* int64_t */
    REP_INT_PAIR, /* [a, b]: int64_t a at off, b at off2 */
    REP_INT_PAIR_NIL, /* the same or nil (0, 0 for nil or, not required, absent) */
    REP_NUM,      /* double */
    REP_BOOL,     /* int */
    REP_TRUE,     /* a boolean that must be true; nothing stored */
    REP_JSON_MAP, /* a map, stored as JSON text (char *); NULL when absent */
    REP_STRS,     /* an array of strings: char ** at off, its count (size_t) at off2 */
    REP_MAPS,     /* an array of maps, each read with the table elem into a struct of
                   * elem_size: the array at off, its count (size_t) at off2 */
    REP_ENTER,    /* the fields up to REP_LEAVE are read from this map (skipped when it is
                   * absent and not required); messages name it */
    REP_LEAVE,
    REP_CALL_MS,  /* no key: how long the exchange took (double) */
};

struct RepField {
    const char *key;
    enum RepKind kind;
    int required;
    size_t off, off2;
    const struct RepField *elem;
    size_t n_elem, elem_size;
};

/* A result struct of diffrag.h: its size, where its `json` goes (NO_JSON: it has none), the
 * strings it owns, and a function freeing what else it owns (arrays). */
#define NO_JSON SIZE_MAX
struct ResultType {
    size_t size;
    size_t json_off;
    size_t strs[4];
    size_t n_strs;
    void (*free_more)(void *res);
};

struct OpDesc {
    const char *op;
    int nested;           /* may run inside another call (a delta callback): interrupts for
                           * that call stay pending */
    int (*check)(DiffragClient *c, const void *args); /* DIFFRAG_OK or EINVAL with a message */
    const struct ReqField *req;
    size_t n_req;
    const struct ResultType *type;
    const struct RepField *rep;
    size_t n_rep;
    /* what the table cannot say (variants, arrays, defaults); runs after it; may be NULL */
    void (*decode)(struct Dec *d, const msgpack_object *map, const void *args, void *res);
};

/* A request being packed. */
struct Req {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    int fail;                   /* a packing call ran out of memory */
    int bad;                    /* a document's meta_json is not a JSON object (c->err) */
    char id[CLIENT_ID_MAX + 1];
};

/* Table rows: a request field, a reply field, a nested map. */
#define REQ(T, key, kind, member) { key, kind, offsetof(T, member), 0 }
#define REQ_N(T, key, kind, member, count) { key, kind, offsetof(T, member), offsetof(T, count) }
#define REP(T, key, kind, required, member) { key, kind, required, offsetof(T, member), 0, 0, 0, 0 }
#define REP2(T, key, kind, required, member, member2) \
    { key, kind, required, offsetof(T, member), offsetof(T, member2), 0, 0, 0 }
#define REP_ARRAY(T, key, required, member, count, ET, elem) \
    { key, REP_MAPS, required, offsetof(T, member), offsetof(T, count), elem, COUNT(elem), sizeof(ET) }
#define REP_MAP(key, required) { key, REP_ENTER, required, 0, 0, 0, 0, 0 }
#define REP_END_MAP { NULL, REP_LEAVE, 0, 0, 0, 0, 0, 0 }
#define OP_TABLES(reqs, reps) .req = reqs, .n_req = COUNT(reqs), .rep = reps, .n_rep = COUNT(reps)

/* ping */

/* The runner (op_run.c). */
int op_start(DiffragClient *c, const struct OpDesc *op, const void *args, const char *id,
                    struct Req *q);
int op_run(DiffragClient *c, const struct OpDesc *op, const void *args, void **out);
int op_bad_arg(DiffragClient *c, const char *what);
int op_check_collection(DiffragClient *c, const char *collection);
int op_check_docs(DiffragClient *c, const DiffragDoc *docs, size_t n, int need_ids);
int op_check_files(DiffragClient *c, const DiffragFile *files, size_t n);
int op_check_strings(DiffragClient *c, const char *what, const char *const *v, size_t n);
int op_decoded(DiffragClient *c, struct Dec *d);
void op_req_free(struct Req *q);
int op_req_pack(DiffragClient *c, const struct OpDesc *op, const void *args, const char *id,
                    struct Req *q);
void *op_result_decode(struct Dec *d, const struct OpDesc *op, const msgpack_object *map,
                           const void *args, double call_ms);
void op_result_free(const struct ResultType *t, void *res);

#endif
