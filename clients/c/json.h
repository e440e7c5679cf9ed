/* JSON for libdiffrag and the diffrag command line: replies (msgpack) written as JSON text, and
 * JSON text (document meta, .jsonl lines) read into msgpack. Strict RFC 8259 on input. */
#ifndef DIFFRAG_JSON_H
#define DIFFRAG_JSON_H

#include <msgpack.h>
#include <stddef.h>

/* A growing text buffer; oom is set on the first failed allocation and later writes are
 * dropped. p is NUL-terminated while not oom. */
struct JsonBuf {
    char *p;
    size_t len, cap;
    int oom;
};

void json_buf_put(struct JsonBuf *b, const char *s, size_t n);
void json_buf_puts(struct JsonBuf *b, const char *s);
/* s[0..n) as a quoted JSON string; invalid UTF-8 becomes U+FFFD. */
void json_buf_string(struct JsonBuf *b, const char *s, size_t n);
/* A number: integers exactly; NaN and infinities (which JSON lacks) as null. */
void json_buf_double(struct JsonBuf *b, double v);
/* The object as JSON. Binary strings are written as strings, extension types as null,
 * non-string map keys as the string of their JSON text. */
void json_buf_msgpack(struct JsonBuf *b, const msgpack_object *o);
void json_buf_free(struct JsonBuf *b);

/* o as a malloc'd NUL-terminated JSON text, or NULL when out of memory. */
char *json_from_msgpack(const msgpack_object *o);

/* Parses the JSON text text[0..len) (one value, blanks around it allowed) and packs it with
 * pk: integers that fit 64 bits as msgpack integers, other numbers as float64. Returns 0, or
 * -1 with a message naming the byte offset in err (a syntax error, nesting deeper than
 * max_depth, invalid UTF-8) or -2 when out of memory. */
int json_to_msgpack(const char *text, size_t len, msgpack_packer *pk, int max_depth,
                    char *err, size_t errlen);

#endif
