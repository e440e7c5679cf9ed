/* Documents from local files, for `diffrag ingest` and `diffrag-store ingest`: walks the files
 * and folders given, reads a .txt or .md file as one document and a .jsonl file as one document
 * a line ({"id", "text", "title"?, "meta"?}), a PDF, DOCX or HTML file as one document of the
 * Markdown diffrag-extract makes of it (extract_run.h), and refuses what is not a text file.
 * Content decides: a file whose first bytes are a PDF's, a zip archive's or an HTML page's goes
 * through diffrag-extract whatever its name; a walk takes .pdf, .docx, .html, .htm and .xhtml
 * files besides .txt, .md and .jsonl.
 *
 * Document ids of text files: the name of the folder given, then the file's path inside it,
 * with '/' separators. For a folder whose real path is /home/u/notes:
 *   given as "notes", "./notes/", "/home/u/notes" or "." (from inside it):
 *       notes/a.txt -> "notes/a.txt", notes/sub/b.md -> "notes/sub/b.md"
 *   a file given directly: its folder's name and its own, "notes/a.txt" (the id it gets when
 *   its folder is ingested)
 * A folder is named by the last component of its real path, so the same file gets the same id
 * however the folder is spelled, and ingesting a folder again replaces its documents instead
 * of adding copies. A folder given as "/" adds no name.
 * The ids of .jsonl documents are their "id" fields.
 *
 * An id has at most DOCSRC_MAX_ID_BYTES: a walk skips a file whose id would be longer, with a
 * note naming it; a file given directly, or a .jsonl line, with such an id is an error.
 *
 * Symbolic links: a walk reads a link to a file inside the folder given (the link's path
 * gives the id) and skips, with a note naming its target, a link to a file outside it, so
 * that a folder cannot pull in files from elsewhere; it never follows a link to a folder. A
 * path given directly is followed wherever it points: naming it is the choice. A file that
 * changed since the walk saw it (another file, or a link, put in its place) is not read. */
#ifndef DIFFRAG_DOCSRC_H
#define DIFFRAG_DOCSRC_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "text/docformat.h"

/* The longest document id the store (INDEX_MAX_ID_BYTES) and the protocol take, in bytes. */
#define DOCSRC_MAX_ID_BYTES 256

enum DocsrcStatus {
    DOCSRC_OK = 0,
    DOCSRC_EFILE = -1,  /* this file cannot be a document (not a regular file, too large, empty,
                         * not UTF-8, a NUL byte, a name that is not UTF-8, an id over
                         * DOCSRC_MAX_ID_BYTES, replaced since the walk, its text could not be
                         * extracted): callers skip it when a folder walk found it and fail when
                         * it was named */
    DOCSRC_EINPUT = -2, /* a malformed .jsonl line, a missing or unusable path */
    DOCSRC_EIO = -3,    /* the operating system failed to read */
    DOCSRC_ENOMEM = -4,
    DOCSRC_ESTOP = -5,  /* the document callback returned non-zero */
};

/* DOCSRC_DOCUMENT: named .pdf, .docx, .html, .htm or .xhtml (its content still decides). */
enum DocsrcKind { DOCSRC_TEXT, DOCSRC_MARKDOWN, DOCSRC_JSONL, DOCSRC_DOCUMENT };

/* The extensions a walk takes, for messages. */
#define DOCSRC_KINDS ".txt, .md, .jsonl, .pdf, .docx or .html"

/* A PDF, DOCX or HTML file larger than this is refused unread; its text is held to
 * max_file_bytes. */
#define DOCSRC_MAX_EXTRACT_INPUT ((size_t)1 << 30)
/* Seconds diffrag-extract may take over a file when the options do not say. */
#define DOCSRC_EXTRACT_TIMEOUT_S 60

struct DocsrcOptions {
    /* A text file larger than this is refused before it is read; a .jsonl line longer than
     * max_line_bytes likewise. limit_hint follows the refusal: what to do instead. */
    size_t max_file_bytes, max_line_bytes;
    const char *limit_hint;
    /* Nesting allowed in a .jsonl line, the line's object counting 1 (0: JSON_MAX_DEPTH). */
    int max_depth;
    /* 1: a file named directly is read as text (or extracted, by its content) whatever its
     * name (the CLI); 0: only the DOCSRC_KINDS, others are an error. Folder walks take those
     * and skip the rest. */
    int any_named_file;
    /* Wall-clock seconds diffrag-extract may take over one file (0: DOCSRC_EXTRACT_TIMEOUT_S). */
    double extract_timeout_s;
    /* Notes about files a walk skipped go to notes, each line starting with prog; NULL: none.
     * Hidden files are passed over silently; files of other extensions are named, the first
     * DOCSRC_NAMED_OTHER of them, then one line says more were skipped. */
    FILE *notes;
    const char *prog;
};

/* How many files of other extensions a walk names in its notes before it only counts them. */
#define DOCSRC_NAMED_OTHER 20

/* A file to read, in walk order (each folder's entries sorted by name). */
struct DocsrcFile {
    char *path;   /* to open: the folder as given joined with the names below it */
    char *id;     /* the id of its document, for all but .jsonl */
    int named;    /* given directly, not found by walking a folder */
    enum DocsrcKind kind;
    dev_t dev;    /* the file the walk saw (a link's target): what is opened must be it */
    ino_t ino;
};

struct DocsrcList {
    struct DocsrcFile *files;
    size_t n, cap;
    size_t skipped; /* files a walk passed over: other extensions, not regular, bad names,
                     * ids too long, links out of the folder */
    size_t other_kind; /* of those, the files of other extensions (the first DOCSRC_NAMED_OTHER noted) */
};

/* "skipped N files (why)" for an ingest's summary, into buf: `skipped` files in all, of which
 * `other_kind` had other extensions (all were named in notes). Returns buf. */
const char *docsrc_skip_summary(size_t skipped, size_t other_kind, char *buf, size_t cap);

/* Collects the files of paths[0..n_paths) into *list (start from `struct DocsrcList l = {0}`;
 * it may be called again to add more). Returns DOCSRC_OK, DOCSRC_EINPUT (a path that does not
 * exist or cannot be walked, a named file of another kind; err names it), DOCSRC_EFILE (a
 * named file that is not a regular file, a name that is not UTF-8, or an id that would be over
 * DOCSRC_MAX_ID_BYTES), DOCSRC_ENOMEM. */
int docsrc_collect(const struct DocsrcOptions *o, const char *const *paths, size_t n_paths,
                   struct DocsrcList *list, char *err, size_t errlen);
void docsrc_list_free(struct DocsrcList *list);

/* The start of the ids of the files a walk of folder `dir` finds: its name and a '/'
 * ("notes/"), "" for "/" (malloc'd into *prefix). DOCSRC_OK, DOCSRC_EINPUT (no such folder),
 * DOCSRC_EFILE (a name that is not UTF-8), DOCSRC_ENOMEM. */
int docsrc_folder_prefix(const char *dir, char **prefix, char *err, size_t errlen);

/* 1 when a walk gives a file at `path` (relative to the folder, '/' separators) an id of its
 * own: no hidden or empty component, and a .txt, .md, .pdf, .docx or .html name (not .jsonl,
 * whose lines carry their own ids). */
int docsrc_walk_takes(const char *path);

/* One document; every string is malloc'd, NUL-terminated and valid UTF-8. title and meta_json
 * (the "meta" object of a .jsonl line as compact JSON text) may be NULL. */
struct DocsrcDoc {
    char *id, *title, *text, *meta_json;
    size_t id_len, title_len, text_len;
    size_t line; /* the line of a .jsonl file (from 1); 0 for a text file */
};

/* Called once per document; it takes the strings (docsrc_doc_free releases what it leaves).
 * Non-zero stops the file: docsrc_read then returns DOCSRC_ESTOP. */
typedef int (*docsrc_doc_fn)(void *ctx, struct DocsrcDoc *doc);

/* The document of a PDF, DOCX or HTML file open at fd (`size` bytes; fmt: its format by its
 * first bytes, DOCFMT_TEXT to let the helper judge by `path`'s name), as the Markdown
 * diffrag-extract writes and its title, into *d (id left NULL; fd left open): what docsrc_read
 * does for such a file. Returns DOCSRC_OK, DOCSRC_EFILE (err "PATH: a PDF: REASON", as
 * docsrc_read's) or DOCSRC_ENOMEM. */
int docsrc_extract(const struct DocsrcOptions *o, const char *path, int fd, uint64_t size,
                   enum DocFormat fmt, struct DocsrcDoc *d, char *err, size_t errlen);

/* Reads file f and calls fn for each of its documents. *stop is checked before each .jsonl
 * line (a Ctrl-C flag; NULL: never). Returns DOCSRC_OK, DOCSRC_EFILE (a file that cannot be a
 * document: err names it and says why, for a PDF, DOCX or HTML file "PATH: a PDF: REASON",
 * REASON what diffrag-extract said or how it failed: a crash, a limit, the timeout), DOCSRC_EINPUT (a .jsonl line: err starts
 * with "PATH:LINE: "; the lines before it were given to fn), DOCSRC_EIO, DOCSRC_ENOMEM,
 * DOCSRC_ESTOP. */
int docsrc_read(const struct DocsrcOptions *o, const struct DocsrcFile *f, docsrc_doc_fn fn,
                void *ctx, volatile int *stop, char *err, size_t errlen);

void docsrc_doc_free(struct DocsrcDoc *doc);

#endif
