/* Scratch stores for the C tests of the document store: a fresh directory, its removal, and a
 * document from C strings. */
#ifndef DIFFRAG_TESTS_STORE_UTIL_H
#define DIFFRAG_TESTS_STORE_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "retriever/index.h"

/* A new empty directory under /tmp (malloc'd path); exits when none can be made. */
static inline char *temp_dir(void)
{
    char *d = strdup("/tmp/diffrag-store-XXXXXX");
    if (!d || !mkdtemp(d)) {
        perror("mkdtemp");
        exit(1);
    }
    return d;
}

/* Removes a store's files and its directory. */
static inline void rm_store(const char *dir)
{
    char p[2048];
    snprintf(p, sizeof p, "%s/data.mdb", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/lock.mdb", dir);
    unlink(p);
    rmdir(dir);
}

static inline struct StoreDoc mkdoc(const char *id, const char *title, const char *text)
{
    return (struct StoreDoc){ id, strlen(id), text, strlen(text), title, title ? strlen(title) : 0,
                              NULL, 0 };
}

#endif
