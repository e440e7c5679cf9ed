/* Running diffrag-extract for the ingest (docsrc.c): a PDF, DOCX or HTML file's Markdown text
 * and title, from the helper found beside the running program, else on PATH, with a wall-clock
 * limit. */
#ifndef DIFFRAG_EXTRACT_RUN_H
#define DIFFRAG_EXTRACT_RUN_H

#include <stddef.h>

#include "text/docformat.h"

/* The helper's program name, looked for beside /proc/self/exe, then on PATH. */
#define EXTRACT_PROGRAM DOCFORMAT_HELPER

/* Extracts the open regular file fd (given to the helper as its stdin; `path` names it in
 * messages and gives the title when the document has none): at most max_text bytes of text,
 * within timeout_s seconds (the helper and what it started are killed after). Returns 0 with
 * *title and *text malloc'd (text NUL-terminated, *text_len bytes), or -1 with err set to the
 * reason (without the path); *oom set when memory ran out. */
int extract_run(int fd, const char *path, size_t max_text, double timeout_s, char **title,
                char **text, size_t *text_len, int *oom, char *err, size_t errlen);

#endif
