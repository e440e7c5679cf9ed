/* A small strict JSON reader for the admin tool's .jsonl ingest (one object per line, string
 * fields picked by name, everything else validated and skipped) and a JSON string writer. */
#ifndef DIFFRAG_JSON_H
#define DIFFRAG_JSON_H

#include <stddef.h>
#include <stdio.h>

#define JSON_MAX_DEPTH 64

/* Parse exactly one JSON object from text[0..len) (whitespace around it allowed). For each
 * wanted key present with a string value, out[i] receives a malloc'ed, unescaped,
 * NUL-terminated copy (the caller frees it) and lens[i] its length; absent keys leave
 * out[i] = NULL. A wanted key given twice or with a non-string value, malformed JSON, invalid
 * UTF-8 or a lone surrogate escape are errors. Returns RET_OK, RET_EINPUT (message gives the
 * byte offset), RET_ENOMEM; on error every out[i] is NULL. */
int json_object_strings(const char *text, size_t len, const char *const *keys, size_t n_keys,
                        char **out, size_t *lens, char *err, size_t errlen);

/* Write s[0..len) as a JSON string literal, quotes included. Bytes that are not valid UTF-8
 * are written as \ufffd. */
void json_write_string(FILE *f, const char *s, size_t len);

#endif
