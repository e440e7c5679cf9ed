/* JSON text from msgpack objects (replies shown to people and scripts) and msgpack from JSON
 * text (document meta given as JSON, the command line's .jsonl input). The reader is strict
 * (RFC 8259) and bounded in depth; it never trusts its input. */
#include "clients/c/json.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void json_buf_put(struct JsonBuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void json_buf_puts(struct JsonBuf *b, const char *s)
{
    json_buf_put(b, s, strlen(s));
}

void json_buf_free(struct JsonBuf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* Length of the valid UTF-8 sequence at s (n bytes left), or 0 when it is not valid. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t k;
    unsigned cp;
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf) { k = 2; cp = c & 0x1f; }
    else if (c >= 0xe0 && c <= 0xef) { k = 3; cp = c & 0x0f; }
    else if (c >= 0xf0 && c <= 0xf4) { k = 4; cp = c & 0x07; }
    else
        return 0;
    if (n < k)
        return 0;
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if ((k == 3 && cp < 0x800) || (k == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return k;
}

void json_buf_string(struct JsonBuf *b, const char *str, size_t n)
{
    const unsigned char *s = (const unsigned char *)str;
    json_buf_put(b, "\"", 1);
    size_t run = 0; /* bytes copied verbatim, flushed before each escape */
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        const char *esc = NULL;
        char tmp[8];
        size_t k = 1;
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c < 0x20 || c == 0x7f) {
            snprintf(tmp, sizeof tmp, "\\u%04x", c);
            esc = tmp;
        } else if (c >= 0x80) {
            k = utf8_seq(s + i, n - i);
            if (!k) {
                esc = "\xef\xbf\xbd"; /* U+FFFD */
                k = 1;
            }
        }
        if (esc) {
            json_buf_put(b, (const char *)s + i - run, run);
            run = 0;
            json_buf_puts(b, esc);
        } else {
            run += k;
        }
        i += k;
    }
    json_buf_put(b, (const char *)s + i - run, run);
    json_buf_put(b, "\"", 1);
}

void json_buf_double(struct JsonBuf *b, double v)
{
    char tmp[40];
    if (!isfinite(v)) {
        json_buf_puts(b, "null");
        return;
    }
    /* the shortest of 15 or 17 digits that reads back exactly */
    snprintf(tmp, sizeof tmp, "%.15g", v);
    if (strtod(tmp, NULL) != v)
        snprintf(tmp, sizeof tmp, "%.17g", v);
    json_buf_puts(b, tmp);
}

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

struct Reader {
    const char *s;
    size_t n, pos;
    int max_depth;
    msgpack_packer *pk;
    struct JsonBuf str; /* scratch for decoded strings */
    char *err;
    size_t errlen;
    int status;
};

static int rfail(struct Reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int rfail(struct Reader *r, const char *fmt, ...)
{
    if (r->status)
        return r->status;
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->errlen)
        snprintf(r->err, r->errlen, "JSON at byte %zu: %s", r->pos, msg);
    r->status = -1;
    return -1;
}

static int packed(struct Reader *r, int rc)
{
    if (rc) {
        r->status = -2;
        if (r->errlen)
            snprintf(r->err, r->errlen, "out of memory");
    }
    return rc ? -2 : 0;
}

static void skip_ws(struct Reader *r)
{
    while (r->pos < r->n && (r->s[r->pos] == ' ' || r->s[r->pos] == '\t' ||
                             r->s[r->pos] == '\n' || r->s[r->pos] == '\r'))
        r->pos++;
}

static int hex4(struct Reader *r, unsigned *out)
{
    if (r->n - r->pos < 4)
        return rfail(r, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = r->s[r->pos + i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else
            return rfail(r, "bad \\u escape");
    }
    r->pos += 4;
    *out = v;
    return 0;
}

static void put_utf8(struct JsonBuf *b, unsigned cp)
{
    char u[4];
    size_t k;
    if (cp < 0x80) { u[0] = (char)cp; k = 1; }
    else if (cp < 0x800) { u[0] = (char)(0xc0 | cp >> 6); u[1] = (char)(0x80 | (cp & 0x3f)); k = 2; }
    else if (cp < 0x10000) {
        u[0] = (char)(0xe0 | cp >> 12); u[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        u[2] = (char)(0x80 | (cp & 0x3f)); k = 3;
    } else {
        u[0] = (char)(0xf0 | cp >> 18); u[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); u[3] = (char)(0x80 | (cp & 0x3f)); k = 4;
    }
    json_buf_put(b, u, k);
}

/* Reads a string (at the opening quote) into r->str. */
static int read_string(struct Reader *r)
{
    r->str.len = 0;
    json_buf_put(&r->str, "", 0);
    r->pos++;
    for (;;) {
        if (r->pos >= r->n)
            return rfail(r, "unterminated string");
        unsigned char c = (unsigned char)r->s[r->pos];
        if (c == '"') {
            r->pos++;
            break;
        }
        if (c < 0x20)
            return rfail(r, "control character in a string");
        if (c == '\\') {
            if (++r->pos >= r->n)
                return rfail(r, "unterminated string");
            char e = r->s[r->pos++];
            const char *lit = NULL;
            switch (e) {
            case '"': lit = "\""; break;
            case '\\': lit = "\\"; break;
            case '/': lit = "/"; break;
            case 'b': lit = "\b"; break;
            case 'f': lit = "\f"; break;
            case 'n': lit = "\n"; break;
            case 'r': lit = "\r"; break;
            case 't': lit = "\t"; break;
            case 'u': {
                unsigned cp, lo;
                if (hex4(r, &cp))
                    return -1;
                if (cp >= 0xdc00 && cp <= 0xdfff)
                    return rfail(r, "lone low surrogate");
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    if (r->n - r->pos < 2 || r->s[r->pos] != '\\' || r->s[r->pos + 1] != 'u')
                        return rfail(r, "lone high surrogate");
                    r->pos += 2;
                    if (hex4(r, &lo))
                        return -1;
                    if (lo < 0xdc00 || lo > 0xdfff)
                        return rfail(r, "bad surrogate pair");
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                }
                put_utf8(&r->str, cp);
                break;
            }
            default:
                r->pos--;
                return rfail(r, "bad escape \\%c", e);
            }
            if (lit)
                json_buf_put(&r->str, lit, 1);
            continue;
        }
        size_t k = utf8_seq((const unsigned char *)r->s + r->pos, r->n - r->pos);
        if (!k)
            return rfail(r, "invalid UTF-8");
        json_buf_put(&r->str, r->s + r->pos, k);
        r->pos += k;
    }
    if (r->str.oom) {
        r->status = -2;
        if (r->errlen)
            snprintf(r->err, r->errlen, "out of memory");
        return -2;
    }
    return 0;
}

static int read_number(struct Reader *r)
{
    size_t start = r->pos;
    int is_int = 1;
    if (r->s[r->pos] == '-')
        r->pos++;
    if (r->pos >= r->n || r->s[r->pos] < '0' || r->s[r->pos] > '9')
        return rfail(r, "bad number");
    if (r->s[r->pos] == '0')
        r->pos++;
    else
        while (r->pos < r->n && r->s[r->pos] >= '0' && r->s[r->pos] <= '9')
            r->pos++;
    if (r->pos < r->n && r->s[r->pos] == '.') {
        is_int = 0;
        r->pos++;
        if (r->pos >= r->n || r->s[r->pos] < '0' || r->s[r->pos] > '9')
            return rfail(r, "bad number");
        while (r->pos < r->n && r->s[r->pos] >= '0' && r->s[r->pos] <= '9')
            r->pos++;
    }
    if (r->pos < r->n && (r->s[r->pos] == 'e' || r->s[r->pos] == 'E')) {
        is_int = 0;
        r->pos++;
        if (r->pos < r->n && (r->s[r->pos] == '+' || r->s[r->pos] == '-'))
            r->pos++;
        if (r->pos >= r->n || r->s[r->pos] < '0' || r->s[r->pos] > '9')
            return rfail(r, "bad number");
        while (r->pos < r->n && r->s[r->pos] >= '0' && r->s[r->pos] <= '9')
            r->pos++;
    }
    char tmp[64];
    size_t len = r->pos - start;
    if (len >= sizeof tmp)
        is_int = 0; /* too long for 64 bits anyway; strtod below reads a copy */
    char *copy = len < sizeof tmp ? tmp : malloc(len + 1);
    if (!copy)
        return packed(r, -1);
    memcpy(copy, r->s + start, len);
    copy[len] = 0;
    int rc;
    errno = 0;
    if (is_int && copy[0] == '-') {
        long long v = strtoll(copy, NULL, 10);
        rc = errno ? msgpack_pack_double(r->pk, strtod(copy, NULL)) : msgpack_pack_int64(r->pk, v);
    } else if (is_int) {
        unsigned long long v = strtoull(copy, NULL, 10);
        rc = errno ? msgpack_pack_double(r->pk, strtod(copy, NULL)) : msgpack_pack_uint64(r->pk, v);
    } else {
        rc = msgpack_pack_double(r->pk, strtod(copy, NULL));
    }
    if (copy != tmp)
        free(copy);
    return packed(r, rc);
}

static int literal(struct Reader *r, const char *word)
{
    size_t k = strlen(word);
    if (r->n - r->pos < k || memcmp(r->s + r->pos, word, k))
        return rfail(r, "unexpected character '%c'", r->s[r->pos]);
    r->pos += k;
    return 0;
}

/* Counts the elements of the array or object at r->pos without packing (msgpack needs the
 * count first). Strings are skipped by their quotes and escapes only. */
static int count_elements(struct Reader *r, uint32_t *out)
{
    size_t p = r->pos + 1;
    int depth = 0;
    uint32_t n = 0;
    int any = 0;
    char close = r->s[r->pos] == '[' ? ']' : '}';
    for (; p < r->n; p++) {
        char c = r->s[p];
        if (c == '"') {
            for (p++; p < r->n && r->s[p] != '"'; p++)
                if (r->s[p] == '\\')
                    p++;
            if (depth == 0)
                any = 1;
            continue;
        }
        if (c == '[' || c == '{') {
            if (depth == 0)
                any = 1;
            depth++;
        } else if (c == ']' || c == '}') {
            if (depth == 0) {
                if (c != close)
                    break;
                *out = any ? n + 1 : 0;
                return 0;
            }
            depth--;
        } else if (c == ',' && depth == 0) {
            if (n == UINT32_MAX - 1)
                return rfail(r, "too many elements");
            n++;
        } else if (depth == 0 && c != ' ' && c != '\t' && c != '\n' && c != '\r') {
            any = 1;
        }
    }
    return rfail(r, "unterminated %s", close == ']' ? "array" : "object");
}

static int read_value(struct Reader *r, int depth)
{
    skip_ws(r);
    if (r->pos >= r->n)
        return rfail(r, "unexpected end");
    char c = r->s[r->pos];
    if (c == '{' || c == '[') {
        if (depth >= r->max_depth)
            return rfail(r, "nested deeper than %d", r->max_depth);
        uint32_t n = 0;
        if (count_elements(r, &n))
            return -1;
        int rc = c == '{' ? msgpack_pack_map(r->pk, n) : msgpack_pack_array(r->pk, n);
        if (packed(r, rc))
            return -2;
        r->pos++;
        for (uint32_t i = 0; i < n; i++) {
            if (i) {
                skip_ws(r);
                if (r->pos >= r->n || r->s[r->pos] != ',')
                    return rfail(r, "expected ','");
                r->pos++;
            }
            if (c == '{') {
                skip_ws(r);
                if (r->pos >= r->n || r->s[r->pos] != '"')
                    return rfail(r, "expected a string key");
                if (read_string(r) || packed(r, msgpack_pack_str_with_body(r->pk, r->str.p, r->str.len)))
                    return r->status;
                skip_ws(r);
                if (r->pos >= r->n || r->s[r->pos] != ':')
                    return rfail(r, "expected ':'");
                r->pos++;
            }
            if (read_value(r, depth + 1))
                return r->status;
        }
        skip_ws(r);
        if (r->pos >= r->n || r->s[r->pos] != (c == '{' ? '}' : ']'))
            return rfail(r, "expected '%c'", c == '{' ? '}' : ']');
        r->pos++;
        return 0;
    }
    if (c == '"') {
        if (read_string(r))
            return r->status;
        return packed(r, msgpack_pack_str_with_body(r->pk, r->str.p, r->str.len));
    }
    if (c == '-' || (c >= '0' && c <= '9'))
        return read_number(r);
    if (c == 't')
        return literal(r, "true") ? -1 : packed(r, msgpack_pack_true(r->pk));
    if (c == 'f')
        return literal(r, "false") ? -1 : packed(r, msgpack_pack_false(r->pk));
    if (c == 'n')
        return literal(r, "null") ? -1 : packed(r, msgpack_pack_nil(r->pk));
    return rfail(r, "unexpected character '%c'", c);
}

int json_to_msgpack(const char *text, size_t len, msgpack_packer *pk, int max_depth,
                    char *err, size_t errlen)
{
    struct Reader r = { .s = text, .n = len, .max_depth = max_depth, .pk = pk, .err = err,
                        .errlen = errlen };
    if (errlen)
        err[0] = 0;
    if (!text)
        return rfail(&r, "no text");
    if (read_value(&r, 0) == 0) {
        skip_ws(&r);
        if (r.pos != r.n)
            rfail(&r, "trailing characters");
    }
    json_buf_free(&r.str);
    return r.status;
}
