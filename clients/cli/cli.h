/* What the diffrag command line's files share: the parsed arguments, the exit codes, and the
 * helpers that connect, report errors and read files. */
#ifndef DIFFRAG_CLI_H
#define DIFFRAG_CLI_H

#include <stddef.h>
#include <stdio.h>

#include "clients/c/diffrag.h"

/* Exit codes (documented in `diffrag --help`). */
enum {
    CLI_EXIT_OK = 0,
    CLI_EXIT_SERVER = 1,      /* the daemon answered with an error */
    CLI_EXIT_USAGE = 2,       /* bad options or arguments */
    CLI_EXIT_CONNECT = 3,     /* no connection (nothing listens, or CurveZMQ refused) */
    CLI_EXIT_TIMEOUT = 4,     /* connected, but no reply in time */
    CLI_EXIT_PROTOCOL = 5,    /* a malformed reply */
    CLI_EXIT_LOCAL = 6,       /* a local file could not be read or written, out of memory */
    CLI_EXIT_INTERRUPTED = 130,
};

#define CLI_DEFAULT_ENDPOINT "tcp://127.0.0.1:7400"
#define CLI_DEFAULT_COLLECTION "docs"

struct CliArgs {
    const char *cmd;
    const char *endpoint, *collection, *server_key, *key_file;
    int collection_given;
    int timeout_ms, connect_timeout_ms; /* 0: the library's defaults */
    int json, stream, progress, quiet, force, yes, sync;
    int max_tokens, top_k, max_context_tokens, limit, batch, deadline_ms;
    double temperature, top_p;
    double relevance_floor;      /* ask --relevance-floor, when relevance_floor_given */
    int relevance_floor_given;
    unsigned long long seed;
    const char *after, *out;
    const char *order;           /* ask --order: NULL, "rank", "nearest" or "document" */
    const char *unsupported;     /* ask --unsupported: NULL, "answer", "mark" or "decline" */
    const char *answer_mode;     /* ask --answer-mode: NULL, "free" or "quote" */
    const char **doc_files;
    size_t n_doc_files;
    const char **doc_ids;
    size_t n_doc_ids;
    const char **stops;
    size_t n_stops;
    char **pos; /* arguments after the subcommand */
    size_t n_pos;
};

/* Connects (lazily: the first call reports a missing daemon) with the endpoint, timeouts and
 * keys of a; on failure prints why and returns the exit code. Registers the client with the
 * SIGINT handler so that Ctrl-C interrupts its calls. */
int cli_connect(const struct CliArgs *a, DiffragClient **out);
void cli_disconnect(DiffragClient **c);
/* Prints the failure of a call on c (to stderr; with --json also {"ok": false, "error": ...}
 * to stdout) and returns its exit code. */
int cli_fail(const struct CliArgs *a, DiffragClient *c, int status);
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Reads a whole file (or stdin for "-") into a NUL-terminated buffer: 0, or -1 with errno. */
int cli_read_file(const char *path, char **out, size_t *len);
/* Is s[0..n) valid UTF-8 (without NUL bytes)? */
int cli_utf8_ok(const char *s, size_t n);
/* Prints s[0..len) on stdout: as it is, or, when stdout is a terminal, with the characters a
 * terminal would act on written as escapes (`\x1b`, `\u009b`: text/termsafe.h), so that ids,
 * titles and texts from a store cannot drive the user's terminal. layout: tabs and newlines are
 * the text's own (a document's text, an answer) and pass through; otherwise (an id, a title)
 * they are escaped too. Returns the bytes written. */
size_t cli_print_safe(const char *s, size_t len, int layout);
/* cli_print_safe(s) (no layout), then spaces up to width bytes, as printf's "%-*s" pads. */
void cli_print_padded(const char *s, size_t width);
/* "s" unless n is 1: "%lld document%s" reads "1 document", "2 documents". */
static inline const char *cli_s(long long n)
{
    return n == 1 ? "" : "s";
}
/* Sets once by SIGINT; long loops (ingest) check it between calls. */
extern volatile int cli_interrupted;

int cmd_ask(const struct CliArgs *a);
int cmd_ingest(const struct CliArgs *a);
int cmd_delete(const struct CliArgs *a);
int cmd_drop(const struct CliArgs *a);
int cmd_get(const struct CliArgs *a);
int cmd_ls(const struct CliArgs *a);
int cmd_stats(const struct CliArgs *a);
int cmd_ping(const struct CliArgs *a);
int cmd_keygen(const struct CliArgs *a);

#endif
