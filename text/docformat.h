/* What a file holds, by its first bytes: PDF, a zip archive (a DOCX document when it holds
 * word/document.xml: diffrag-extract looks), HTML, or anything else (text). Shared by the ingest
 * (which files go through diffrag-extract), by diffrag-extract itself and by the daemon's ingest
 * of a file's bytes. A pure function of the bytes. */
#ifndef DIFFRAG_TEXT_DOCFORMAT_H
#define DIFFRAG_TEXT_DOCFORMAT_H

#include <stddef.h>

enum DocFormat { DOCFMT_TEXT = 0, DOCFMT_PDF, DOCFMT_ZIP, DOCFMT_HTML };

/* How many leading bytes docformat_sniff looks at: give it at least this many when the file
 * has them. */
#define DOCFORMAT_SNIFF_BYTES 1024

/* The format of a file that starts with head[0..n): "%PDF-" within its first 1024 bytes (as
 * readers accept), "PK\3\4", or, after an optional byte order mark, white space, an <?xml ...?>
 * declaration and comments, a tag <!doctype html, <html, <head or <body (any case). */
enum DocFormat docformat_sniff(const unsigned char *head, size_t n);

/* The format a name's extension suggests: .pdf, .docx, .html/.htm/.xhtml (any case); DOCFMT_TEXT
 * for any other. */
enum DocFormat docformat_of_name(const char *name);

/* "PDF", "DOCX", "HTML", "text". */
const char *docformat_name(enum DocFormat f);

/* The extraction helper (clients/extract), shared by the two that run it: the ingest commands
 * and the daemon's ingest of a file's bytes. */
#define DOCFORMAT_HELPER "diffrag-extract"

/* Where to run the helper from: `configured` when given (non-empty), else the one beside the
 * running program when it is there, else its bare name (found on PATH). */
void docformat_helper_path(const char *configured, char *out, size_t cap);

/* The helper's reason for a failure, from its stderr: the last line that is not empty, without
 * its "diffrag-extract: -: " prefix ("no reason given" when there is none). */
void docformat_helper_reason(const char *errtext, char *err, size_t errlen);

/* What a child process wrote on its two pipes, read until both close, the deadline passes or
 * its output passes the cap (docformat_drain). */
struct HelperOutput {
    char *out;            /* stdout, NUL-terminated (malloc'd; NULL when it wrote nothing) */
    size_t out_len;
    char errtext[2048];   /* the first bytes of stderr, NUL-terminated */
    int timed_out;        /* the deadline passed first */
    int too_long;         /* stdout passed max_out bytes (then out holds less) */
    int oom;              /* out could not grow */
    int cut_short;        /* any of the three: the child may still run and should be killed */
};

/* Reads out_fd (stdout) and err_fd (stderr) of a child for at most timeout_ms milliseconds,
 * keeping at most max_out bytes of stdout and the start of stderr; closes both descriptors. */
void docformat_drain(int out_fd, int err_fd, double timeout_ms, size_t max_out,
                     struct HelperOutput *r);

#endif
