/* diffrag-extract's parts: the Markdown writer every format writes through (md.c), the three
 * readers (html.c, docx.c, pdf.c) and the sandbox (sandbox.c). Each reader fills a Md with the
 * document's Markdown and returns its title (malloc'd, or NULL for none), or sets err. */
#ifndef DIFFRAG_EXTRACT_H
#define DIFFRAG_EXTRACT_H

#include <stddef.h>

/* Exit statuses of diffrag-extract (docs/cli.md). */
enum ExtractExit {
    EXTRACT_OK = 0,
    EXTRACT_EBAD = 1,    /* the file cannot be read as its format: damaged, encrypted, no text */
    EXTRACT_EUSAGE = 2,
    EXTRACT_ETOOL = 3,   /* a program it needs (pdftotext) is missing or failed to start */
    EXTRACT_ELIMIT = 4,  /* a limit: the text or an archive entry too large, a child out of time */
    EXTRACT_ENOMEM = 5,
};

struct ExtractLimits {
    size_t max_output;   /* bytes of Markdown */
    size_t max_input;    /* bytes of the file read into memory (HTML, DOCX) */
    size_t max_entry;    /* bytes of one zip entry, uncompressed */
    double max_ratio;    /* a zip entry's uncompressed / compressed size (entries over 1 MiB) */
    unsigned cpu_seconds;
    size_t max_memory;   /* address space */
};

/* Markdown text under construction. Text goes in with white space collapsed (md_text) or as it
 * is (md_raw); blocks are separated by one blank line. Past `max` bytes `over` is set and the
 * rest is dropped; `oom` on allocation failure. */
struct Md {
    char *p;
    size_t n, cap, max;
    int over, oom;
    int space;       /* a collapsed space is pending */
    int line_start;  /* at the start of a line (md_raw sets it by what it wrote last) */
    const char *indent; /* written at the start of each line of the block (list nesting) */
};

void md_init(struct Md *m, size_t max);
void md_free(struct Md *m);
void md_raw(struct Md *m, const char *s, size_t n);
/* Inline text: runs of white space become one space; a '#' or '>' that would start a line is
 * escaped, so that text never turns into a heading. */
void md_text(struct Md *m, const char *s, size_t n);
/* Ends the current line (a <br>, a w:br). */
void md_newline(struct Md *m);
/* Ends the current block: what follows starts after one blank line. */
void md_block(struct Md *m);
/* Starts a heading of level 1..6 (ends the block before it); md_block ends it. */
void md_heading(struct Md *m, int level);
/* The text of m with white space collapsed and '|' escaped, fit for a table cell (malloc'd). */
char *md_cell(const struct Md *m);
/* One table row of n cells padded to cols; a separator row after the first (header) row when
 * header is set. */
void md_table_row(struct Md *m, char *const *cells, size_t n, size_t cols, int header);
/* s[0..n) with white space collapsed and trimmed (malloc'd): a title. */
char *md_one_line(const char *s, size_t n);

/* An HTML page's bytes in UTF-8 (charset.c): by a byte order mark (UTF-8), a <meta> charset
 * in its first 1024 bytes, else UTF-8 when they are valid UTF-8, else windows-1252 (Latin-1 and
 * ASCII labels too mean windows-1252). 0 with *out NULL: already UTF-8; 0 with *out set
 * (malloc'd, *out_len bytes): converted from `label`; EXTRACT_ENOMEM. */
int html_to_utf8(const char *buf, size_t len, char **out, size_t *out_len, char *label,
                 size_t label_cap);

/* The readers. path is for messages; the bytes are buf[0..len). */
int extract_html(const char *buf, size_t len, struct Md *out, char **title, char *err,
                 size_t errlen);
int extract_docx(int fd, const struct ExtractLimits *lim, struct Md *out, char **title,
                 char *err, size_t errlen);
/* fd is the PDF (kept open, its path /proc/self/fd/FD given to pdftotext and pdfinfo). */
int extract_pdf(int fd, const struct ExtractLimits *lim, struct Md *out, char **title,
                char *err, size_t errlen);

/* Limits on this process and the children it starts (rlimits), then the seccomp filter: no
 * sockets, no file opened for writing or created, removed or renamed; allow_exec 0 also forbids
 * execve. Returns 0, or -1 with err set. */
int sandbox_limits(const struct ExtractLimits *lim, char *err, size_t errlen);
int sandbox_filter(int allow_exec, char *err, size_t errlen);

#endif
