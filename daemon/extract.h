/* The daemon's side of diffrag-extract: a PDF, DOCX or HTML file given to `ingest` as bytes,
 * turned into its title and Markdown text by the sandboxed helper in a child process, on the
 * I/O thread that runs the ingest (never the broker's loop). The file goes to the helper as a
 * memory file on its stdin; the child runs in a process group of its own, which is killed at
 * the wall-clock limit. Its own runner, not the clients' (clients/ingest/extract_run.c): the
 * daemon is a layer below the clients, has many threads (posix_spawn, no fork), reads the
 * file from memory and names the helper in its configuration. */
#ifndef DIFFRAG_EXTRACT_H
#define DIFFRAG_EXTRACT_H

#include <stddef.h>

#include "text/docformat.h"

#define DEXTRACT_PROGRAM DOCFORMAT_HELPER

/* Why an extraction failed: the document (damaged, unsupported, too large, too slow: the
 * client's to fix) or the daemon (the helper missing or not working, memory). */
enum DextractFail { DEXTRACT_OK = 0, DEXTRACT_EDOC, DEXTRACT_EHELPER, DEXTRACT_ENOMEM };

struct DextractOpts {
    const char *helper;      /* configured path or name; "" or NULL: beside the running
                                program, else DEXTRACT_PROGRAM on PATH */
    size_t max_text;         /* most bytes of text (the store's document limit) */
    long timeout_ms;         /* wall clock, the helper and its children together */
    long limit_ms;           /* what the timeout comes from (extract_timeout_ms), for the
                                message; 0: timeout_ms */
};

/* Extracts bytes[0..len), a file named `name` (NUL-terminated; the helper's fallback title).
 * DEXTRACT_OK with *title (NUL-terminated) and *text (*text_len bytes, NUL-terminated)
 * malloc'd; else the kind of failure with err set to the reason (not naming the document). */
enum DextractFail dextract_run(const struct DextractOpts *o, const void *bytes, size_t len,
                               const char *name, char **title, char **text, size_t *text_len,
                               char *err, size_t errlen);

#endif
