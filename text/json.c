/* JSON over jansson: the strict parse entry (depth limit, duplicate keys, error offsets), the
 * string fields of one object, and the one JSON string escaper behind the buffer and FILE
 * writers. */
#include "text/json.h"

#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "text/utf8.h"

static int json_fail(char *err, size_t errlen, int status, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int json_fail(char *err, size_t errlen, int status, size_t at, const char *fmt, ...)
{
    if (!err || !errlen)
        return status;
    if (status == JSON_ENOMEM) {
        snprintf(err, errlen, "out of memory");
        return status;
    }
    char why[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    snprintf(err, errlen, "invalid JSON at byte %zu: %s", at, why);
    return status;
}

/* Whether the tree v (at depth 1) nests deeper than max_depth. jansson's own limit (2048)
 * bounds the recursion. */
static int json_tree_too_deep(const json_t *v, int depth, int max_depth)
{
    if (depth > max_depth)
        return 1;
    if (json_is_array(v)) {
        size_t n = json_array_size(v);
        for (size_t i = 0; i < n; i++) {
            const json_t *e = json_array_get(v, i);
            if ((json_is_array(e) || json_is_object(e)) && json_tree_too_deep(e, depth + 1, max_depth))
                return 1;
        }
    } else if (json_is_object(v)) {
        const char *key;
        json_t *e;
        json_object_foreach((json_t *)v, key, e)
            if ((json_is_array(e) || json_is_object(e)) && json_tree_too_deep(e, depth + 1, max_depth))
                return 1;
    }
    return 0;
}

/* The offset of the first '[' or '{' nested deeper than max_depth in text jansson accepted
 * (strings skipped by their quotes and escapes): 0 when there is none. */
static size_t json_too_deep_at(const char *s, size_t n, int max_depth)
{
    int depth = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '"') {
            for (i++; i < n && s[i] != '"'; i++)
                if (s[i] == '\\')
                    i++;
        } else if (c == '[' || c == '{') {
            if (++depth > max_depth)
                return i;
        } else if (c == ']' || c == '}') {
            depth--;
        }
    }
    return 0;
}

int json_parse(const char *text, size_t len, int max_depth, json_t **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!text)
        return json_fail(err, errlen, JSON_EINPUT, 0, "no text");
    json_error_t e;
    json_t *v = json_loadb(text, len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &e);
    if (v) {
        if ((json_is_array(v) || json_is_object(v)) && json_tree_too_deep(v, 1, max_depth)) {
            json_decref(v);
            return json_fail(err, errlen, JSON_EINPUT, json_too_deep_at(text, len, max_depth),
                             "nested deeper than %d", max_depth);
        }
        *out = v;
        return JSON_OK;
    }
    if (json_error_code(&e) == json_error_stack_overflow) { /* past jansson's own limit */
        int limit = max_depth < JSON_PARSER_MAX_DEPTH ? max_depth : JSON_PARSER_MAX_DEPTH;
        return json_fail(err, errlen, JSON_EINPUT, json_too_deep_at(text, len, limit),
                         "nested deeper than %d", limit);
    }
    size_t pos = e.position > 0 ? (size_t)e.position : 0;
    const char *near;
    switch (json_error_code(&e)) {
    case json_error_out_of_memory:
        return json_fail(err, errlen, JSON_ENOMEM, pos, "out of memory");
    case json_error_numeric_overflow:
        /* jansson says "too big integer near '...'" or "real number overflow near '...'" */
        near = strstr(e.text, " near ");
        if (strncmp(e.text, "too big", 7) == 0)
            return json_fail(err, errlen, JSON_EINPUT, pos,
                             "integer outside the signed 64-bit range%s; quote it, or write it "
                             "with a fraction or an exponent", near ? near : "");
        return json_fail(err, errlen, JSON_EINPUT, pos, "number beyond the range of a double%s",
                         near ? near : "");
    default:
        return json_fail(err, errlen, JSON_EINPUT, pos, "%s", e.text);
    }
}

size_t json_measure(const char *text, size_t len, size_t max_values)
{
    size_t n = 0;
    for (size_t i = 0; i < len && n <= max_values; i++) {
        char c = text[i];
        if (c == '{' || c == '[') {
            n++;
        } else if (c == '"') {
            n++;
            for (i++; i < len && text[i] != '"'; i++)
                i += text[i] == '\\';
        } else if (c == '-' || (c >= '0' && c <= '9') || c == 't' || c == 'f' || c == 'n') {
            n++;   /* a number or a literal: one value, whatever its length */
            while (i + 1 < len && (isalnum((unsigned char)text[i + 1]) || text[i + 1] == '.' ||
                                   text[i + 1] == '+' || text[i + 1] == '-'))
                i++;
        }
    }
    return n;
}

int json_object_strings(const char *text, size_t len, const char *const *keys, size_t n_keys,
                        char **out, size_t *lens, char *err, size_t errlen)
{
    for (size_t i = 0; i < n_keys; i++) {
        out[i] = NULL;
        lens[i] = 0;
    }
    json_t *root = NULL;
    int st = json_parse(text, len, JSON_MAX_DEPTH, &root, err, errlen);
    if (st)
        return st;
    if (!json_is_object(root)) {
        size_t at = 0;
        while (at < len && strchr(" \t\r\n", text[at]) && text[at])
            at++;
        st = json_fail(err, errlen, JSON_EINPUT, at, "expected an object");
        goto err;
    }
    for (size_t i = 0; i < n_keys; i++) {
        json_t *v = json_object_get(root, keys[i]);
        if (!v)
            continue;
        if (!json_is_string(v)) {
            st = JSON_EINPUT;
            if (err && errlen)
                snprintf(err, errlen, "invalid JSON: \"%s\" must be a string", keys[i]);
            goto err;
        }
        size_t n = json_string_length(v);
        out[i] = malloc(n + 1);
        if (!out[i]) {
            st = json_fail(err, errlen, JSON_ENOMEM, 0, "out of memory");
            goto err;
        }
        memcpy(out[i], json_string_value(v), n);
        out[i][n] = 0;
        lens[i] = n;
    }
    json_decref(root);
    return JSON_OK;
err:
    json_decref(root);
    for (size_t i = 0; i < n_keys; i++) {
        free(out[i]);
        out[i] = NULL;
        lens[i] = 0;
    }
    return st;
}

/* ---- writing ---- */

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

typedef void (*json_sink)(void *ctx, const char *s, size_t n);

/* The one escaper: runs of bytes that need no escape go to put in one piece. */
static void json_escape(const char *str, size_t n, json_sink put, void *ctx)
{
    const unsigned char *s = (const unsigned char *)str;
    put(ctx, "\"", 1);
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
            uint32_t cp;
            k = utf8_decode(s + i, n - i, &cp);
            if (cp == UTF8_INVALID) {
                esc = "\xef\xbf\xbd"; /* U+FFFD, one for each byte */
                k = 1;
            }
        }
        if (esc) {
            put(ctx, (const char *)s + i - run, run);
            run = 0;
            put(ctx, esc, strlen(esc));
        } else {
            run += k;
        }
        i += k;
    }
    put(ctx, (const char *)s + i - run, run);
    put(ctx, "\"", 1);
}

static void json_sink_buf(void *ctx, const char *s, size_t n)
{
    json_buf_put(ctx, s, n);
}

static void json_sink_file(void *ctx, const char *s, size_t n)
{
    if (n)
        fwrite(s, 1, n, ctx);
}

void json_buf_string(struct JsonBuf *b, const char *s, size_t n)
{
    json_escape(s, n, json_sink_buf, b);
}

void json_write_string(FILE *f, const char *s, size_t len)
{
    json_escape(s, len, json_sink_file, f);
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
