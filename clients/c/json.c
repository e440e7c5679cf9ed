/* JSON text from msgpack objects (replies shown to people and scripts) and msgpack from JSON
 * text (document meta given as JSON, the command line's .jsonl input), over text/json.h: the
 * parse is json_parse's (strict, bounded in depth), this file only walks its tree. */
#include "clients/c/json.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void json_buf_msgpack(struct JsonBuf *b, const msgpack_object *o)
{
    char tmp[32];
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        json_buf_puts(b, "null");
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        json_buf_puts(b, o->via.boolean ? "true" : "false");
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        snprintf(tmp, sizeof tmp, "%" PRIu64, o->via.u64);
        json_buf_puts(b, tmp);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        snprintf(tmp, sizeof tmp, "%" PRId64, o->via.i64);
        json_buf_puts(b, tmp);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        json_buf_double(b, o->via.f64);
        break;
    case MSGPACK_OBJECT_STR:
        json_buf_string(b, o->via.str.ptr, o->via.str.size);
        break;
    case MSGPACK_OBJECT_BIN:
        json_buf_string(b, o->via.bin.ptr, o->via.bin.size);
        break;
    case MSGPACK_OBJECT_ARRAY:
        json_buf_put(b, "[", 1);
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            if (i)
                json_buf_put(b, ", ", 2);
            json_buf_msgpack(b, &o->via.array.ptr[i]);
        }
        json_buf_put(b, "]", 1);
        break;
    case MSGPACK_OBJECT_MAP:
        json_buf_put(b, "{", 1);
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            const msgpack_object_kv *kv = &o->via.map.ptr[i];
            if (i)
                json_buf_put(b, ", ", 2);
            if (kv->key.type == MSGPACK_OBJECT_STR) {
                json_buf_string(b, kv->key.via.str.ptr, kv->key.via.str.size);
            } else {
                struct JsonBuf k = { 0 };
                json_buf_msgpack(&k, &kv->key);
                if (k.oom)
                    b->oom = 1;
                else
                    json_buf_string(b, k.p, k.len);
                json_buf_free(&k);
            }
            json_buf_put(b, ": ", 2);
            json_buf_msgpack(b, &kv->val);
        }
        json_buf_put(b, "}", 1);
        break;
    default: /* extension types carry nothing a JSON reader could use */
        json_buf_puts(b, "null");
        break;
    }
}

char *json_from_msgpack(const msgpack_object *o)
{
    struct JsonBuf b = { 0 };
    json_buf_msgpack(&b, o);
    if (b.oom) {
        json_buf_free(&b);
        return NULL;
    }
    return b.p;
}

/* ---- JSON text to msgpack ---- */

/* Packs the tree v (json_parse bounded its depth, so the recursion is bounded too). Returns 0
 * or a msgpack-c failure (out of memory). */
static int json_tree_pack(msgpack_packer *pk, const json_t *v)
{
    int rc = 0;
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *key;
        size_t key_len;
        json_t *val;
        rc = msgpack_pack_map(pk, json_object_size(v));
        json_object_keylen_foreach((json_t *)v, key, key_len, val) {
            if (rc)
                break;
            rc = msgpack_pack_str_with_body(pk, key, key_len);
            if (!rc)
                rc = json_tree_pack(pk, val);
        }
        return rc;
    }
    case JSON_ARRAY: {
        size_t n = json_array_size(v);
        rc = msgpack_pack_array(pk, n);
        for (size_t i = 0; i < n && !rc; i++)
            rc = json_tree_pack(pk, json_array_get(v, i));
        return rc;
    }
    case JSON_STRING:
        return msgpack_pack_str_with_body(pk, json_string_value(v), json_string_length(v));
    case JSON_INTEGER:
        return msgpack_pack_int64(pk, json_integer_value(v));
    case JSON_REAL:
        return msgpack_pack_double(pk, json_real_value(v));
    case JSON_TRUE:
        return msgpack_pack_true(pk);
    case JSON_FALSE:
        return msgpack_pack_false(pk);
    case JSON_NULL:
    default:
        return msgpack_pack_nil(pk);
    }
}

int json_to_msgpack(const char *text, size_t len, msgpack_packer *pk, int max_depth,
                    char *err, size_t errlen)
{
    json_t *root = NULL;
    if (errlen)
        err[0] = 0;
    int st = json_parse(text, len, max_depth, &root, err, errlen);
    if (st)
        return st == JSON_ENOMEM ? -2 : -1;
    int rc = json_tree_pack(pk, root);
    json_decref(root);
    if (rc) {
        if (errlen)
            snprintf(err, errlen, "out of memory");
        return -2;
    }
    return 0;
}
