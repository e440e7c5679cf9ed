/* `ingest --sync`: which documents of a collection came from the folders an ingest walked and
 * are to go because their files are gone. Used by `diffrag ingest --sync` (over the daemon's
 * list and delete ops) and `diffrag-store ingest --sync` (on the store).
 *
 * The rule: a document is removed when all of these hold
 *   - its id lies under a folder's prefix: the folder's name and '/' ("notes/"), the start
 *     docsrc gives the ids of the files a walk of it finds (docsrc.h), and the rest is a path
 *     a walk takes a document from: no hidden component, a .txt, .md, .pdf, .docx, .html,
 *     .htm or .xhtml name (docsrc_walk_takes);
 *   - no document of this ingest had the id (a .jsonl line inside the folder may name any id);
 *   - no file is at its path: the folder as given joined with the rest of the id
 *     ("notes/sub/a.md" -> NOTES_AS_GIVEN/sub/a.md) does not exist (lstat says ENOENT or
 *     ENOTDIR; any other failure keeps the document), under every folder given that has the
 *     same prefix.
 * So a document from another folder (another name), one sent as .jsonl under an id that is not
 * such a path, or one whose file is still there but was skipped (unreadable, too large, not
 * text) is never removed. A .jsonl document whose id mimics a file's ("notes/x.txt") is
 * indistinguishable from that file's and goes when no such file is there. Every path given must be a folder other than "/" (whose prefix would be every id). */
#ifndef DIFFRAG_DOCSYNC_H
#define DIFFRAG_DOCSYNC_H

#include <stddef.h>

struct DocsyncRoot {
    char *dir;        /* the folder as given */
    char *prefix;     /* "name/" */
    int first;        /* the first root with this prefix (list each prefix once) */
};

struct Docsync {
    struct DocsyncRoot *roots;
    size_t n_roots;
    char **seen;      /* ids of this ingest's documents */
    size_t n_seen, cap_seen;
    int sorted;
};

/* One root per path. DOCSRC_OK; DOCSRC_EINPUT (err says which path is not a folder, or is
 * "/"); DOCSRC_EFILE (a folder name that is not UTF-8); DOCSRC_ENOMEM. */
int docsync_init(struct Docsync *s, const char *const *paths, size_t n, char *err,
                 size_t errlen);
void docsync_free(struct Docsync *s);

/* Notes an id this ingest stored (copied). DOCSRC_OK or DOCSRC_ENOMEM. */
int docsync_seen(struct Docsync *s, const char *id, size_t len);

/* 1 when the document `id` is to be removed by the rule above, else 0. */
int docsync_gone(struct Docsync *s, const char *id, size_t len);

/* 1 when id (len bytes) starts with prefix. */
int docsync_under(const char *prefix, const char *id, size_t len);

#endif
