/* JSON for libdiffrag and the diffrag command line, between msgpack and JSON text: replies
 * (msgpack) written as JSON text, and JSON text (document meta, .jsonl lines) read into
 * msgpack. The parsing and the text writer are text/json.h's (jansson, strict RFC 8259). */
#ifndef DIFFRAG_CLIENTS_JSON_H
#define DIFFRAG_CLIENTS_JSON_H

#include <msgpack.h>
#include <stddef.h>

#include "text/json.h"

/* The object as JSON. Binary strings are written as strings, extension types as null,
 * non-string map keys as the string of their JSON text. */
void json_buf_msgpack(struct JsonBuf *b, const msgpack_object *o);

/* o as a malloc'd NUL-terminated JSON text, or NULL when out of memory. */
char *json_from_msgpack(const msgpack_object *o);

/* Parses the JSON text text[0..len) with json_parse (one value, blanks around it allowed,
 * at most max_depth nested arrays/objects, duplicate keys refused) and packs it with pk:
 * integers (which json_parse keeps to the signed 64-bit range) as msgpack integers, other
 * numbers as float64. Returns 0, or -1 with a message naming the byte offset in err (a syntax
 * error, nesting deeper than max_depth, invalid UTF-8...) or -2 when out of memory. */
int json_to_msgpack(const char *text, size_t len, msgpack_packer *pk, int max_depth,
                    char *err, size_t errlen);

#endif
