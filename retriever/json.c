/* Strict recursive-descent JSON: objects, arrays, strings (all escapes, surrogate pairs),
 * numbers by the RFC 8259 grammar, literals; depth-limited; string bytes checked as UTF-8. */
#include "retriever/json.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/status.h"
#include "retriever/text.h"

struct JsonParser {
    const char *s;
    size_t len, pos;
    char *err;
    size_t errlen;
};

static int jfail(struct JsonParser *p, const char *what)
{
    return ret_fail(p->err, p->errlen, RET_EINPUT, "invalid JSON at byte %zu: %s", p->pos, what);
}

static void skip_ws(struct JsonParser *p)
{
    while (p->pos < p->len && strchr(" \t\r\n", p->s[p->pos]) && p->s[p->pos])
        p->pos++;
}

static int hex4(struct JsonParser *p, unsigned *v)
{
    if (p->len - p->pos < 4)
        return jfail(p, "short \\u escape");
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->s[p->pos++];
        r <<= 4;
        if (c >= '0' && c <= '9') r |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') r |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') r |= (unsigned)(c - 'A' + 10);
        else return jfail(p, "bad hex digit in \\u escape");
    }
    *v = r;
    return RET_OK;
}

/* Parse a string at p->pos (the opening quote). With out != NULL, *out receives a malloc'ed
 * unescaped copy. */
static int parse_string(struct JsonParser *p, char **out, size_t *out_len)
{
    if (p->pos >= p->len || p->s[p->pos] != '"')
        return jfail(p, "expected a string");
    p->pos++;
    size_t cap = 0, n = 0;
    char *buf = NULL;
    if (out) {
        /* The unescaped string is never longer than the rest of the input. */
        cap = p->len - p->pos + 1;
        buf = malloc(cap);
        if (!buf)
            return ret_fail(p->err, p->errlen, RET_ENOMEM, "out of memory");
    }
    int st;
    while (1) {
        if (p->pos >= p->len) {
            st = jfail(p, "unterminated string");
            goto err;
        }
        unsigned char c = (unsigned char)p->s[p->pos];
        char enc[4];
        size_t m = 0;
        if (c == '"') {
            p->pos++;
            break;
        } else if (c < 0x20) {
            st = jfail(p, "control character in string");
            goto err;
        } else if (c == '\\') {
            p->pos++;
            if (p->pos >= p->len) {
                st = jfail(p, "unterminated escape");
                goto err;
            }
            char e = p->s[p->pos++];
            switch (e) {
            case '"': enc[0] = '"'; m = 1; break;
            case '\\': enc[0] = '\\'; m = 1; break;
            case '/': enc[0] = '/'; m = 1; break;
            case 'b': enc[0] = '\b'; m = 1; break;
            case 'f': enc[0] = '\f'; m = 1; break;
            case 'n': enc[0] = '\n'; m = 1; break;
            case 'r': enc[0] = '\r'; m = 1; break;
            case 't': enc[0] = '\t'; m = 1; break;
            case 'u': {
                unsigned u, lo;
                if ((st = hex4(p, &u)))
                    goto err;
                if (u >= 0xDC00 && u <= 0xDFFF) {
                    st = jfail(p, "lone low surrogate");
                    goto err;
                }
                if (u >= 0xD800 && u <= 0xDBFF) {
                    if (p->len - p->pos < 2 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
                        st = jfail(p, "lone high surrogate");
                        goto err;
                    }
                    p->pos += 2;
                    if ((st = hex4(p, &lo)))
                        goto err;
                    if (lo < 0xDC00 || lo > 0xDFFF) {
                        st = jfail(p, "bad surrogate pair");
                        goto err;
                    }
                    u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
                }
                m = utf8_encode(u, enc);
                break;
            }
            default:
                st = jfail(p, "unknown escape");
                goto err;
            }
        } else if (c < 0x80) {
            enc[0] = (char)c;
            m = 1;
            p->pos++;
        } else {
            size_t adv;
            if (utf8_decode((const unsigned char *)p->s + p->pos, p->len - p->pos, &adv) < 0) {
                st = jfail(p, "invalid UTF-8 in string");
                goto err;
            }
            if (buf) {
                if (n + adv > cap) {
                    st = jfail(p, "internal size error");
                    goto err;
                }
                memcpy(buf + n, p->s + p->pos, adv);
                n += adv;
            }
            p->pos += adv;
            continue;
        }
        if (buf) {
            if (n + m > cap) {
                st = jfail(p, "internal size error");
                goto err;
            }
            memcpy(buf + n, enc, m);
            n += m;
        }
    }
    if (buf) {
        buf[n] = 0;
        *out = buf;
        *out_len = n;
    }
    return RET_OK;
err:
    free(buf);
    return st;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

static int parse_number(struct JsonParser *p)
{
    if (p->pos < p->len && p->s[p->pos] == '-')
        p->pos++;
    if (p->pos >= p->len || !is_digit(p->s[p->pos]))
        return jfail(p, "bad number");
    if (p->s[p->pos] == '0')
        p->pos++;
    else
        while (p->pos < p->len && is_digit(p->s[p->pos]))
            p->pos++;
    if (p->pos < p->len && p->s[p->pos] == '.') {
        p->pos++;
        if (p->pos >= p->len || !is_digit(p->s[p->pos]))
            return jfail(p, "bad fraction");
        while (p->pos < p->len && is_digit(p->s[p->pos]))
            p->pos++;
    }
    if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
        p->pos++;
        if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-'))
            p->pos++;
        if (p->pos >= p->len || !is_digit(p->s[p->pos]))
            return jfail(p, "bad exponent");
        while (p->pos < p->len && is_digit(p->s[p->pos]))
            p->pos++;
    }
    return RET_OK;
}

static int skip_value(struct JsonParser *p, int depth);

static int skip_container(struct JsonParser *p, int depth, char close, int object)
{
    if (depth > JSON_MAX_DEPTH)
        return jfail(p, "nested too deeply");
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        return RET_OK;
    }
    for (;;) {
        int st;
        if (object) {
            skip_ws(p);
            if ((st = parse_string(p, NULL, NULL)))
                return st;
            skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':')
                return jfail(p, "expected ':'");
            p->pos++;
        }
        if ((st = skip_value(p, depth + 1)))
            return st;
        skip_ws(p);
        if (p->pos < p->len && p->s[p->pos] == ',') {
            p->pos++;
            continue;
        }
        if (p->pos < p->len && p->s[p->pos] == close) {
            p->pos++;
            return RET_OK;
        }
        return jfail(p, object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int literal(struct JsonParser *p, const char *lit)
{
    size_t n = strlen(lit);
    if (p->len - p->pos < n || memcmp(p->s + p->pos, lit, n) != 0)
        return jfail(p, "unexpected character");
    p->pos += n;
    return RET_OK;
}

static int skip_value(struct JsonParser *p, int depth)
{
    skip_ws(p);
    if (p->pos >= p->len)
        return jfail(p, "expected a value");
    char c = p->s[p->pos];
    switch (c) {
    case '{': return skip_container(p, depth, '}', 1);
    case '[': return skip_container(p, depth, ']', 0);
    case '"': return parse_string(p, NULL, NULL);
    case 't': return literal(p, "true");
    case 'f': return literal(p, "false");
    case 'n': return literal(p, "null");
    default: return parse_number(p);
    }
}

int json_object_strings(const char *text, size_t len, const char *const *keys, size_t n_keys,
                        char **out, size_t *lens, char *err, size_t errlen)
{
    struct JsonParser p = { text, len, 0, err, errlen };
    for (size_t i = 0; i < n_keys; i++) {
        out[i] = NULL;
        lens[i] = 0;
    }
    int st;
    char *key = NULL;
    skip_ws(&p);
    if (p.pos >= p.len || p.s[p.pos] != '{') {
        st = jfail(&p, "expected an object");
        goto err;
    }
    p.pos++;
    skip_ws(&p);
    if (p.pos < p.len && p.s[p.pos] == '}') {
        p.pos++;
    } else {
        for (;;) {
            size_t klen;
            skip_ws(&p);
            if ((st = parse_string(&p, &key, &klen)))
                goto err;
            skip_ws(&p);
            if (p.pos >= p.len || p.s[p.pos] != ':') {
                st = jfail(&p, "expected ':'");
                goto err;
            }
            p.pos++;
            size_t w = n_keys;
            for (size_t i = 0; i < n_keys; i++)
                if (strlen(keys[i]) == klen && memcmp(keys[i], key, klen) == 0)
                    w = i;
            free(key);
            key = NULL;
            skip_ws(&p);
            if (w < n_keys) {
                if (out[w]) {
                    st = jfail(&p, "duplicate key");
                    goto err;
                }
                if (p.pos >= p.len || p.s[p.pos] != '"') {
                    st = ret_fail(err, errlen, RET_EINPUT, "invalid JSON at byte %zu: \"%s\" must be a string",
                                  p.pos, keys[w]);
                    goto err;
                }
                if ((st = parse_string(&p, &out[w], &lens[w])))
                    goto err;
            } else if ((st = skip_value(&p, 1))) {
                goto err;
            }
            skip_ws(&p);
            if (p.pos < p.len && p.s[p.pos] == ',') {
                p.pos++;
                continue;
            }
            if (p.pos < p.len && p.s[p.pos] == '}') {
                p.pos++;
                break;
            }
            st = jfail(&p, "expected ',' or '}'");
            goto err;
        }
    }
    skip_ws(&p);
    if (p.pos != p.len) {
        st = jfail(&p, "trailing characters after the object");
        goto err;
    }
    return RET_OK;
err:
    free(key);
    for (size_t i = 0; i < n_keys; i++) {
        free(out[i]);
        out[i] = NULL;
        lens[i] = 0;
    }
    return st;
}

void json_write_string(FILE *f, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    putc('"', f);
    size_t i = 0;
    while (i < len) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x80) {
            size_t adv;
            if (utf8_decode((const unsigned char *)s + i, len - i, &adv) < 0) {
                fputs("\\ufffd", f);
                i++;
            } else {
                fwrite(s + i, 1, adv, f);
                i += adv;
            }
            continue;
        }
        switch (c) {
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        case '\n': fputs("\\n", f); break;
        case '\r': fputs("\\r", f); break;
        case '\t': fputs("\\t", f); break;
        default:
            if (c < 0x20) {
                fputs("\\u00", f);
                putc(hex[c >> 4], f);
                putc(hex[c & 15], f);
            } else {
                putc(c, f);
            }
        }
        i++;
    }
    putc('"', f);
}
