/* Reading the .jsonl data files (SQuAD passages and questions) shared by the C benchmarks. */
#ifndef DIFFRAG_BENCH_JSONL_H
#define DIFFRAG_BENCH_JSONL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/json.h"

/* The whole file, NUL-terminated (malloc'd), or NULL. */
static inline char *bench_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) b[n] = 0;
    *len = (size_t)n;
    return b;
}

/* A string field of o, or NULL. */
static inline const char *bench_jstr(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* Each line of a .jsonl file that parses, as an object, to fn; -1 when it cannot be read. */
static inline int bench_each_line(const char *path, void (*fn)(json_t *, void *), void *user)
{
    size_t len;
    char *b = bench_read_file(path, &len), err[256];
    if (!b) {
        fprintf(stderr, "cannot read %s\n", path);
        return -1;
    }
    for (char *p = b; p < b + len;) {
        char *e = memchr(p, '\n', (size_t)(b + len - p));
        if (!e) e = b + len;
        json_t *o = NULL;
        if (e > p && json_parse(p, (size_t)(e - p), JSON_MAX_DEPTH, &o, err, sizeof err) == 0) {
            fn(o, user);
            json_decref(o);
        }
        p = e + 1;
    }
    free(b);
    return 0;
}

#endif
