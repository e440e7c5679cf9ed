/* The msgpack reader (bounds-checked, allocation-free cursor and whole-message check) and the
 * sticky-error writer over msgpack-c's packer. The reader is the first code to touch bytes
 * from the network, so every length is compared with the bytes left before it is used. */
#include "daemon/mp.h"

#include <stdio.h>
#include <string.h>

#include "text/utf8.h"

const char *mp_strerror(int status)
{
    switch (status) {
    case MP_OK: return "ok";
    case MP_ETRUNC: return "truncated msgpack";
    case MP_ETRAILING: return "trailing bytes after the msgpack value";
    case MP_EDEPTH: return "msgpack nesting too deep";
    case MP_EBYTE: return "invalid msgpack byte 0xc1";
    case MP_ETYPE: return "wrong msgpack type";
    case MP_ENOMEM: return "out of memory";
    }
    return "unknown msgpack error";
}

const char *mp_type_name(enum MpType t)
{
    static const char *const names[] = { "nil", "boolean", "integer", "integer", "float",
                                         "string", "binary", "array", "map", "extension" };
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

void mp_cursor_init(struct MpCursor *c, const void *buf, size_t len)
{
    c->p = buf;
    c->end = c->p + len;
}

static uint64_t be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* Takes n bytes for a fixed-size field; MP_ETRUNC when they are not there. */
static int take(struct MpCursor *c, size_t n, const uint8_t **out)
{
    if ((size_t)(c->end - c->p) < n)
        return MP_ETRUNC;
    *out = c->p;
    c->p += n;
    return MP_OK;
}

static int body(struct MpCursor *c, struct MpObj *o, enum MpType t, int len_bytes, int ext)
{
    const uint8_t *q;
    if (take(c, (size_t)len_bytes, &q))
        return MP_ETRUNC;
    uint64_t len = be(q, len_bytes);
    if (ext && take(c, 1, &q))   /* the ext type byte */
        return MP_ETRUNC;
    if ((uint64_t)(c->end - c->p) < len)
        return MP_ETRUNC;
    o->type = t;
    o->s = (const char *)c->p;
    o->len = (uint32_t)len;
    c->p += len;
    return MP_OK;
}

int mp_next(struct MpCursor *c, struct MpObj *o)
{
    const uint8_t *q;
    memset(o, 0, sizeof *o);
    o->start = c->p;
    if (take(c, 1, &q))
        return MP_ETRUNC;
    uint8_t b = q[0];
    if (b <= 0x7f) { o->type = MP_UINT; o->v.u = b; return MP_OK; }
    if (b >= 0xe0) { o->type = MP_INT; o->v.i = (int8_t)b; return MP_OK; }
    if (b <= 0x8f) { o->type = MP_MAP; o->v.n = b & 0x0f; return MP_OK; }
    if (b <= 0x9f) { o->type = MP_ARRAY; o->v.n = b & 0x0f; return MP_OK; }
    if (b <= 0xbf) {
        size_t len = b & 0x1f;
        if ((size_t)(c->end - c->p) < len)
            return MP_ETRUNC;
        o->type = MP_STR;
        o->s = (const char *)c->p;
        o->len = (uint32_t)len;
        c->p += len;
        return MP_OK;
    }
    switch (b) {
    case 0xc0: o->type = MP_NIL; return MP_OK;
    case 0xc1: return MP_EBYTE;
    case 0xc2: case 0xc3: o->type = MP_BOOL; o->v.b = b == 0xc3; return MP_OK;
    case 0xc4: return body(c, o, MP_BIN, 1, 0);
    case 0xc5: return body(c, o, MP_BIN, 2, 0);
    case 0xc6: return body(c, o, MP_BIN, 4, 0);
    case 0xc7: return body(c, o, MP_EXT, 1, 1);
    case 0xc8: return body(c, o, MP_EXT, 2, 1);
    case 0xc9: return body(c, o, MP_EXT, 4, 1);
    case 0xca: {
        if (take(c, 4, &q)) return MP_ETRUNC;
        uint32_t u = (uint32_t)be(q, 4);
        float f;
        memcpy(&f, &u, 4);
        o->type = MP_FLOAT;
        o->v.f = f;
        return MP_OK;
    }
    case 0xcb: {
        if (take(c, 8, &q)) return MP_ETRUNC;
        uint64_t u = be(q, 8);
        memcpy(&o->v.f, &u, 8);
        o->type = MP_FLOAT;
        return MP_OK;
    }
    case 0xcc: case 0xcd: case 0xce: case 0xcf: {
        int n = 1 << (b - 0xcc);
        if (take(c, (size_t)n, &q)) return MP_ETRUNC;
        o->type = MP_UINT;
        o->v.u = be(q, n);
        return MP_OK;
    }
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        int n = 1 << (b - 0xd0);
        if (take(c, (size_t)n, &q)) return MP_ETRUNC;
        uint64_t u = be(q, n);
        int64_t v;
        if (n == 8) {
            memcpy(&v, &u, 8);
        } else {
            uint64_t sign = 1ull << (8 * n - 1);
            v = (int64_t)((u ^ sign) - sign);   /* sign-extend without overflow */
        }
        if (v >= 0) { o->type = MP_UINT; o->v.u = (uint64_t)v; }
        else { o->type = MP_INT; o->v.i = v; }
        return MP_OK;
    }
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: {
        size_t n = (size_t)1 << (b - 0xd4);
        if (take(c, 1 + n, &q)) return MP_ETRUNC;
        o->type = MP_EXT;
        o->s = (const char *)q + 1;
        o->len = (uint32_t)n;
        return MP_OK;
    }
    case 0xd9: return body(c, o, MP_STR, 1, 0);
    case 0xda: return body(c, o, MP_STR, 2, 0);
    case 0xdb: return body(c, o, MP_STR, 4, 0);
    case 0xdc: case 0xdd: {
        int n = b == 0xdc ? 2 : 4;
        if (take(c, (size_t)n, &q)) return MP_ETRUNC;
        o->type = MP_ARRAY;
        o->v.n = (uint32_t)be(q, n);
        return MP_OK;
    }
    default: { /* 0xde, 0xdf */
        int n = b == 0xde ? 2 : 4;
        if (take(c, (size_t)n, &q)) return MP_ETRUNC;
        o->type = MP_MAP;
        o->v.n = (uint32_t)be(q, n);
        return MP_OK;
    }
    }
}

/* Values still to read below a container: one per array element, two per map pair. */
static uint64_t children(const struct MpObj *o)
{
    if (o->type == MP_ARRAY) return o->v.n;
    if (o->type == MP_MAP) return 2ull * o->v.n;
    return 0;
}

static int skip_n(struct MpCursor *c, uint64_t left)
{
    /* No stack needed: each value read adds its children to the count. Every value takes at
     * least one byte, so a false count ends in MP_ETRUNC after at most len steps. */
    while (left) {
        struct MpObj o;
        int rc = mp_next(c, &o);
        if (rc)
            return rc;
        left += children(&o) - 1;
    }
    return MP_OK;
}

int mp_skip(struct MpCursor *c)
{
    return skip_n(c, 1);
}

int mp_skip_body(struct MpCursor *c, const struct MpObj *o)
{
    return skip_n(c, children(o));
}

int mp_check(const void *buf, size_t len, int max_depth, char *err, size_t errlen)
{
    uint64_t left[MP_MAX_DEPTH + 1];
    struct MpCursor c;
    mp_cursor_init(&c, buf, len);
    if (max_depth > MP_MAX_DEPTH)
        max_depth = MP_MAX_DEPTH;
    int top = 0;
    left[0] = 1;
    while (top >= 0) {
        if (left[top] == 0) {
            top--;
            continue;
        }
        left[top]--;
        struct MpObj o;
        size_t off = (size_t)(c.p - (const uint8_t *)buf);
        int rc = mp_next(&c, &o);
        if (rc) {
            snprintf(err, errlen, "%s at byte %zu", mp_strerror(rc), off);
            return rc;
        }
        if (o.type == MP_ARRAY || o.type == MP_MAP) {
            if (top + 1 > max_depth) {
                snprintf(err, errlen, "nesting deeper than %d levels at byte %zu", max_depth, off);
                return MP_EDEPTH;
            }
            uint64_t k = children(&o);
            if (k > (uint64_t)(c.end - c.p)) {
                snprintf(err, errlen, "%s at byte %zu: it claims %llu elements in %zu bytes",
                         mp_type_name(o.type), off, (unsigned long long)k, (size_t)(c.end - c.p));
                return MP_ETRUNC;
            }
            if (k)
                left[++top] = k;
        }
    }
    if (c.p != c.end) {
        snprintf(err, errlen, "%zu bytes after the msgpack value", (size_t)(c.end - c.p));
        return MP_ETRAILING;
    }
    return MP_OK;
}

/* ---- writer ---- */

void mpw_init(struct MpWriter *w)
{
    msgpack_sbuffer_init(&w->buf);
    msgpack_packer_init(&w->pk, &w->buf, msgpack_sbuffer_write);
    w->failed = 0;
}

void mpw_destroy(struct MpWriter *w)
{
    msgpack_sbuffer_destroy(&w->buf);
    memset(w, 0, sizeof *w);
}

void mpw_reset(struct MpWriter *w)
{
    msgpack_sbuffer_clear(&w->buf);
    w->failed = 0;
}

#define MPW(call) do { if (!w->failed && (call) != 0) w->failed = 1; } while (0)

void mpw_map(struct MpWriter *w, size_t n) { MPW(msgpack_pack_map(&w->pk, n)); }
void mpw_array(struct MpWriter *w, size_t n) { MPW(msgpack_pack_array(&w->pk, n)); }
/* s[0..len) with every byte that is not part of well-formed UTF-8 as U+FFFD, as the JSON
 * escaper (text/json.c) writes it: a msgpack str must be UTF-8, and a client's decoder fails
 * on one that is not. */
static void mpw_str_repaired(struct MpWriter *w, const char *s, size_t len)
{
    static const char fffd[3] = { '\xef', '\xbf', '\xbd' };
    const unsigned char *u = (const unsigned char *)s;
    size_t out = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t k = u[i] < 0x80 ? 1 : utf8_decode(u + i, len - i, &cp);
        if (u[i] >= 0x80 && cp == UTF8_INVALID) {
            out += sizeof fffd;
            k = 1;
        } else {
            out += k;
        }
        i += k;
    }
    MPW(msgpack_pack_str(&w->pk, out));
    size_t run = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t k = u[i] < 0x80 ? 1 : utf8_decode(u + i, len - i, &cp);
        if (u[i] >= 0x80 && cp == UTF8_INVALID) {
            if (i > run)
                MPW(msgpack_pack_str_body(&w->pk, s + run, i - run));
            MPW(msgpack_pack_str_body(&w->pk, fffd, sizeof fffd));
            run = ++i;
            continue;
        }
        i += k;
    }
    if (len > run)
        MPW(msgpack_pack_str_body(&w->pk, s + run, len - run));
}

void mpw_str(struct MpWriter *w, const char *s, size_t len)
{
    if (len && !utf8_valid(s, len, NULL)) {
        mpw_str_repaired(w, s, len);
        return;
    }
    MPW(msgpack_pack_str(&w->pk, len));
    if (len)
        MPW(msgpack_pack_str_body(&w->pk, s, len));
}
void mpw_cstr(struct MpWriter *w, const char *s)
{
    if (s)
        mpw_str(w, s, strlen(s));
    else
        mpw_nil(w);
}
void mpw_bin(struct MpWriter *w, const void *p, size_t len)
{
    MPW(msgpack_pack_bin(&w->pk, len));
    if (len)
        MPW(msgpack_pack_bin_body(&w->pk, p, len));
}
void mpw_uint(struct MpWriter *w, uint64_t v) { MPW(msgpack_pack_uint64(&w->pk, v)); }
void mpw_int(struct MpWriter *w, int64_t v) { MPW(msgpack_pack_int64(&w->pk, v)); }
void mpw_double(struct MpWriter *w, double v) { MPW(msgpack_pack_double(&w->pk, v)); }
void mpw_float(struct MpWriter *w, float v) { MPW(msgpack_pack_float(&w->pk, v)); }
void mpw_bool(struct MpWriter *w, int v)
{
    if (v)
        MPW(msgpack_pack_true(&w->pk));
    else
        MPW(msgpack_pack_false(&w->pk));
}
void mpw_nil(struct MpWriter *w) { MPW(msgpack_pack_nil(&w->pk)); }
void mpw_raw(struct MpWriter *w, const void *p, size_t len)
{
    if (len)
        MPW(msgpack_sbuffer_write(&w->buf, p, len));
}

void mpw_kv_str(struct MpWriter *w, const char *key, const char *s, size_t len)
{
    mpw_cstr(w, key);
    mpw_str(w, s, len);
}
void mpw_kv_cstr(struct MpWriter *w, const char *key, const char *s)
{
    mpw_cstr(w, key);
    mpw_cstr(w, s);
}
void mpw_kv_uint(struct MpWriter *w, const char *key, uint64_t v)
{
    mpw_cstr(w, key);
    mpw_uint(w, v);
}
void mpw_kv_int(struct MpWriter *w, const char *key, int64_t v)
{
    mpw_cstr(w, key);
    mpw_int(w, v);
}
void mpw_kv_double(struct MpWriter *w, const char *key, double v)
{
    mpw_cstr(w, key);
    mpw_double(w, v);
}
void mpw_kv_bool(struct MpWriter *w, const char *key, int v)
{
    mpw_cstr(w, key);
    mpw_bool(w, v);
}
