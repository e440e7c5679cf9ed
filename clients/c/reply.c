/* Replies from the daemon, trusted in nothing: a bounds and depth check of the raw msgpack
 * before msgpack-c allocates for it, the envelope rules of docs/protocol.md (one map with an
 * "id"; "ok" or "delta"), and typed field readers that name the field a reply got wrong. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clients/c/client_internal.h"
#include "clients/c/json.h"

static int scan_fail(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int scan_fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static uint64_t be(const unsigned char *p, int k)
{
    uint64_t v = 0;
    for (int i = 0; i < k; i++)
        v = v << 8 | p[i];
    return v;
}

int reply_scan(const unsigned char *p, size_t n, int max_depth, char *err, size_t errlen)
{
    /* left[d]: objects still to read at depth d (a map counts keys and values) */
    uint64_t left[64];
    int depth = 0;
    size_t pos = 0;
    if (max_depth > 63)
        max_depth = 63;
    left[0] = 1;
    while (depth >= 0) {
        if (left[depth] == 0) {
            depth--;
            continue;
        }
        left[depth]--;
        if (pos >= n)
            return scan_fail(err, errlen, "truncated msgpack (%zu bytes)", n);
        unsigned b = p[pos++];
        uint64_t skip = 0, count = 0;
        int container = 0, lenbytes = 0;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            skip = 0;
        } else if (b >= 0x80 && b <= 0x8f) {
            container = 1; count = 2 * (uint64_t)(b & 0x0f);
        } else if (b >= 0x90 && b <= 0x9f) {
            container = 1; count = b & 0x0f;
        } else if (b >= 0xa0 && b <= 0xbf) {
            skip = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4: case 0xd9: lenbytes = 1; break;
            case 0xc5: case 0xda: lenbytes = 2; break;
            case 0xc6: case 0xdb: lenbytes = 4; break;
            case 0xc7: lenbytes = 1; skip = 1; break;
            case 0xc8: lenbytes = 2; skip = 1; break;
            case 0xc9: lenbytes = 4; skip = 1; break;
            case 0xca: skip = 4; break;
            case 0xcb: skip = 8; break;
            case 0xcc: case 0xd0: skip = 1; break;
            case 0xcd: case 0xd1: skip = 2; break;
            case 0xce: case 0xd2: skip = 4; break;
            case 0xcf: case 0xd3: skip = 8; break;
            case 0xd4: skip = 2; break;
            case 0xd5: skip = 3; break;
            case 0xd6: skip = 5; break;
            case 0xd7: skip = 9; break;
            case 0xd8: skip = 17; break;
            case 0xdc: container = 1; lenbytes = 2; break;
            case 0xdd: container = 1; lenbytes = 4; break;
            case 0xde: container = 2; lenbytes = 2; break;
            case 0xdf: container = 2; lenbytes = 4; break;
            default:
                return scan_fail(err, errlen, "byte 0x%02x at offset %zu is not msgpack", b, pos - 1);
            }
            if (lenbytes) {
                if (n - pos < (size_t)lenbytes)
                    return scan_fail(err, errlen, "truncated msgpack (%zu bytes)", n);
                uint64_t v = be(p + pos, lenbytes);
                pos += (size_t)lenbytes;
                if (container)
                    count = container == 2 ? 2 * v : v;
                else
                    skip += v;
            }
        }
        if (container) {
            /* every element takes at least one byte: a claim beyond the bytes left is a lie */
            if (count > n - pos)
                return scan_fail(err, errlen, "msgpack container at offset %zu claims %llu "
                                 "elements with %zu bytes left", pos, (unsigned long long)count, n - pos);
            if (count == 0)
                continue;
            if (depth + 1 >= max_depth)
                return scan_fail(err, errlen, "msgpack nested deeper than %d", max_depth);
            left[++depth] = count;
        } else {
            if (skip > n - pos)
                return scan_fail(err, errlen, "truncated msgpack (%zu bytes)", n);
            pos += (size_t)skip;
        }
    }
    if (pos != n)
        return scan_fail(err, errlen, "%zu bytes after the msgpack object", n - pos);
    return 0;
}

const msgpack_object *mpo_get(const msgpack_object *map, const char *key)
{
    if (!map || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t k = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *o = &map->via.map.ptr[i].key;
        if (o->type == MSGPACK_OBJECT_STR && o->via.str.size == k && !memcmp(o->via.str.ptr, key, k))
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

int reply_parse(char *data, size_t len, struct Reply **out, char *err, size_t errlen)
{
    *out = NULL;
    if (len == 0) {
        free(data);
        return scan_fail(err, errlen, "empty reply frame");
    }
    if (reply_scan((const unsigned char *)data, len, REPLY_MAX_DEPTH, err, errlen)) {
        free(data);
        return -1;
    }
    struct Reply *r = calloc(1, sizeof *r);
    if (!r) {
        free(data);
        return -2;
    }
    r->data = data;
    r->len = len;
    msgpack_unpacked_init(&r->up);
    size_t off = 0;
    msgpack_unpack_return ur = msgpack_unpack_next(&r->up, data, len, &off);
    if (ur == MSGPACK_UNPACK_NOMEM_ERROR) {
        reply_free(&r);
        return -2;
    }
    if (ur != MSGPACK_UNPACK_SUCCESS || off != len) {
        reply_free(&r);
        return scan_fail(err, errlen, "reply is not one msgpack object");
    }
    r->map = &r->up.data;
    if (r->map->type != MSGPACK_OBJECT_MAP) {
        reply_free(&r);
        return scan_fail(err, errlen, "reply is not a msgpack map");
    }
    for (uint32_t i = 0; i < r->map->via.map.size; i++)
        if (r->map->via.map.ptr[i].key.type != MSGPACK_OBJECT_STR) {
            reply_free(&r);
            return scan_fail(err, errlen, "reply has a key that is not a string");
        }
    const msgpack_object *id = mpo_get(r->map, "id");
    if (!id) {
        reply_free(&r);
        return scan_fail(err, errlen, "reply has no \"id\"");
    }
    r->id = id->type == MSGPACK_OBJECT_NIL ? NULL : id;
    const msgpack_object *ok = mpo_get(r->map, "ok");
    if (ok) {
        if (ok->type != MSGPACK_OBJECT_BOOLEAN) {
            reply_free(&r);
            return scan_fail(err, errlen, "reply field \"ok\" is not a boolean");
        }
        r->final = 1;
        r->ok = ok->via.boolean;
    } else {
        const msgpack_object *delta = mpo_get(r->map, "delta");
        if (!delta || delta->type != MSGPACK_OBJECT_STR) {
            reply_free(&r);
            return scan_fail(err, errlen, "reply has neither \"ok\" nor a string \"delta\"");
        }
    }
    *out = r;
    return 0;
}

void reply_free(struct Reply **pr)
{
    struct Reply *r = *pr;
    if (!r)
        return;
    msgpack_unpacked_destroy(&r->up);
    free(r->data);
    free(r);
    *pr = NULL;
}

int reply_id_is(const struct Reply *r, const char *id)
{
    return r->id && r->id->type == MSGPACK_OBJECT_STR && r->id->via.str.size == strlen(id) &&
           !memcmp(r->id->via.str.ptr, id, r->id->via.str.size);
}

/* ---- field readers ---- */

static void dec_fail(struct Dec *d, int status, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void dec_fail(struct Dec *d, int status, const char *key, const char *fmt, ...)
{
    if (d->failed)
        return;
    d->failed = status;
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (status == DIFFRAG_ENOMEM)
        snprintf(d->err, sizeof d->err, "out of memory");
    else
        snprintf(d->err, sizeof d->err, "reply field %s%s%s: %s", d->ctx ? d->ctx : "",
                 d->ctx && key ? "." : "", key ? key : "", what);
}

static const char *type_name(msgpack_object_type t)
{
    switch (t) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "a boolean";
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "an integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "a float";
    case MSGPACK_OBJECT_STR: return "a string";
    case MSGPACK_OBJECT_BIN: return "binary";
    case MSGPACK_OBJECT_ARRAY: return "an array";
    case MSGPACK_OBJECT_MAP: return "a map";
    default: return "an extension";
    }
}

static const msgpack_object *field(struct Dec *d, const msgpack_object *map, const char *key,
                                   int required)
{
    if (d->failed)
        return NULL;
    const msgpack_object *o = mpo_get(map, key);
    if (!o && required)
        dec_fail(d, DIFFRAG_EPROTOCOL, key, "missing");
    return o;
}

void dec_oom(struct Dec *d)
{
    dec_fail(d, DIFFRAG_ENOMEM, NULL, "out of memory");
}

void dec_bad(struct Dec *d, const char *key, const char *what)
{
    dec_fail(d, DIFFRAG_EPROTOCOL, key, "%s", what);
}

char *dec_strdup(struct Dec *d, const char *s, size_t len)
{
    if (d->failed)
        return NULL;
    char *p = malloc(len + 1);
    if (!p) {
        dec_oom(d);
        return NULL;
    }
    memcpy(p, s, len);
    p[len] = 0;
    return p;
}

char *dec_str(struct Dec *d, const msgpack_object *map, const char *key, int required,
              size_t *len)
{
    const msgpack_object *o = field(d, map, key, required);
    if (!o)
        return NULL;
    if (o->type != MSGPACK_OBJECT_STR) {
        dec_fail(d, DIFFRAG_EPROTOCOL, key, "expected a string, got %s", type_name(o->type));
        return NULL;
    }
    if (len)
        *len = o->via.str.size;
    return dec_strdup(d, o->via.str.ptr, o->via.str.size);
}

char *dec_str_or_nil(struct Dec *d, const msgpack_object *map, const char *key)
{
    const msgpack_object *o = field(d, map, key, 0);
    if (!o || o->type == MSGPACK_OBJECT_NIL)
        return NULL;
    return dec_str(d, map, key, 1, NULL);
}

int64_t dec_int(struct Dec *d, const msgpack_object *map, const char *key, int required)
{
    const msgpack_object *o = field(d, map, key, required);
    return o ? dec_as_int(d, o, key) : 0;
}

int64_t dec_as_int(struct Dec *d, const msgpack_object *o, const char *key)
{
    if (d->failed)
        return 0;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX)
        return (int64_t)o->via.u64;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return o->via.i64;
    dec_fail(d, DIFFRAG_EPROTOCOL, key, "expected an integer, got %s", type_name(o->type));
    return 0;
}

double dec_num(struct Dec *d, const msgpack_object *map, const char *key, int required)
{
    const msgpack_object *o = field(d, map, key, required);
    if (!o)
        return 0;
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return (double)o->via.u64;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return (double)o->via.i64;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return o->via.f64;
    default:
        dec_fail(d, DIFFRAG_EPROTOCOL, key, "expected a number, got %s", type_name(o->type));
        return 0;
    }
}

int dec_bool(struct Dec *d, const msgpack_object *map, const char *key, int required)
{
    const msgpack_object *o = field(d, map, key, required);
    if (!o)
        return 0;
    if (o->type != MSGPACK_OBJECT_BOOLEAN) {
        dec_fail(d, DIFFRAG_EPROTOCOL, key, "expected a boolean, got %s", type_name(o->type));
        return 0;
    }
    return o->via.boolean;
}

const msgpack_object *dec_type(struct Dec *d, const msgpack_object *map, const char *key,
                               msgpack_object_type type, int required)
{
    const msgpack_object *o = field(d, map, key, required);
    if (!o)
        return NULL;
    if (o->type != type) {
        dec_fail(d, DIFFRAG_EPROTOCOL, key, "expected %s, got %s", type_name(type),
                 type_name(o->type));
        return NULL;
    }
    return o;
}

char *dec_json(struct Dec *d, const msgpack_object *o)
{
    if (d->failed || !o)
        return NULL;
    char *s = json_from_msgpack(o);
    if (!s)
        dec_fail(d, DIFFRAG_ENOMEM, NULL, "out of memory");
    return s;
}
