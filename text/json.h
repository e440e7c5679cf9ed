/* JSON for every layer, over jansson: a strict parse into a jansson tree, the string fields of
 * one object (a .jsonl line), and a writer for JSON text (a growing buffer, or a FILE). */
#ifndef DIFFRAG_TEXT_JSON_H
#define DIFFRAG_TEXT_JSON_H

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>

/* Return codes. They have the values of RET_OK, RET_EINPUT and RET_ENOMEM in
 * retriever/status.h, so the retriever passes them on unchanged. */
enum JsonStatus {
    JSON_OK = 0,
    JSON_EINPUT = -1, /* not JSON, or JSON this reader refuses; err names the byte offset */
    JSON_ENOMEM = -4,
};

/* Nesting allowed in a .jsonl line read by json_object_strings (the object itself counts 1). */
#define JSON_MAX_DEPTH 64

/* Parses exactly one JSON value from text[0..len), blanks (space, tab, CR, LF) around it
 * allowed, strictly by RFC 8259: invalid UTF-8, lone surrogate escapes, control characters in
 * strings, duplicate object keys, integers outside the signed 64-bit range, numbers beyond
 * double range and more than max_depth nested arrays/objects (the outermost counts 1) are
 * refused. "\u0000" is allowed (json_string_length gives the length). Integers stay jansson
 * integers (json_integer_value), other numbers are reals.
 * On JSON_OK *out owns the tree (release it with json_decref); on error *out is NULL and err
 * holds "invalid JSON at byte N: why" (N counts from 0). Returns JSON_OK, JSON_EINPUT or
 * JSON_ENOMEM. */
int json_parse(const char *text, size_t len, int max_depth, json_t **out, char *err, size_t errlen);

/* Counts the values json_parse would build from text[0..len) (each object, array, string,
 * number, true, false and null; an object's keys count as strings), without building anything
 * or allocating, and stops once the count passes max_values: returns the count, or
 * max_values + 1. A tree costs jansson a hundred bytes and more a value, so a caller can refuse
 * a body whose tree would cost too much before parsing it. The text is not checked: a malformed
 * one is counted as far as its tokens go, and json_parse then refuses it. */
size_t json_measure(const char *text, size_t len, size_t max_values);

/* Parses exactly one JSON object from text[0..len) (as json_parse, at most JSON_MAX_DEPTH deep).
 * For each wanted key present with a string value, out[i] receives a malloc'ed, unescaped,
 * NUL-terminated copy (the caller frees it) and lens[i] its length; absent keys leave
 * out[i] = NULL. A value that is not an object, a wanted key with a non-string value, or
 * anything json_parse refuses (a key given twice among them) is an error. Returns JSON_OK,
 * JSON_EINPUT (the message gives the byte offset where there is one) or JSON_ENOMEM; on error
 * every out[i] is NULL. */
int json_object_strings(const char *text, size_t len, const char *const *keys, size_t n_keys,
                        char **out, size_t *lens, char *err, size_t errlen);

/* A growing text buffer; oom is set on the first failed allocation and later writes are
 * dropped. p is NUL-terminated while not oom (NULL while nothing was written). Start from
 * `struct JsonBuf b = { 0 };`, end with json_buf_free. */
struct JsonBuf {
    char *p;
    size_t len, cap;
    int oom;
};

void json_buf_put(struct JsonBuf *b, const char *s, size_t n);
void json_buf_puts(struct JsonBuf *b, const char *s);
/* s[0..n) as a quoted JSON string: '"' '\\' and control characters (and DEL) escaped, valid
 * UTF-8 copied as is, each byte that is not part of valid UTF-8 written as U+FFFD. */
void json_buf_string(struct JsonBuf *b, const char *s, size_t n);
/* A number: integers exactly, others in the shortest of 15 or 17 digits that reads back
 * exactly; NaN and infinities (which JSON lacks) as null. */
void json_buf_double(struct JsonBuf *b, double v);
/* Frees the text and zeroes *b, ready for reuse. */
void json_buf_free(struct JsonBuf *b);

/* Writes s[0..len) to f as json_buf_string would. */
void json_write_string(FILE *f, const char *s, size_t len);

#endif
