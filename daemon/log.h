/* Level-gated logfmt lines on stderr (journald takes stderr as the service's log). The level
 * is checked before any formatting, so a disabled line costs one comparison. One call writes
 * one whole line with a single write(), so lines from several threads never interleave. */
#ifndef DIFFRAG_DLOG_H
#define DIFFRAG_DLOG_H

#include <stdatomic.h>
#include <stddef.h>

enum LogLevel { LL_ERROR = 0, LL_WARN = 1, LL_INFO = 2, LL_DEBUG = 3 };

extern volatile int dlog_level;

/* Parses "error", "warn", "info" or "debug"; returns the level or -1. */
int dlog_level_parse(const char *s);
const char *dlog_level_name(int level);

/* Writes "ts=... level=LEVEL " followed by the formatted fields and a newline. The format
 * should produce logfmt fields (key=value pairs, values quoted with dlog_quote when needed). */
void dlog_write(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define dlog(level, ...) do { if ((level) <= dlog_level) dlog_write((level), __VA_ARGS__); } while (0)

/* At most one line a second for an event a client can cause at will (a refused HTTP request, a
 * refused CurveZMQ handshake), so that a flood of them cannot flood the log. Start from
 * `struct DlogLimit l = { 0 };` (or zeroed memory); any thread may call dlog_limit_pass. */
struct DlogLimit {
    atomic_llong last_ms;           /* monotonic ms of the last line written; 0: none yet */
    atomic_ulong suppressed;        /* events held back since then */
};
/* 1 when this event may be logged, with *suppressed the events held back since the last line
 * (each event is either written or counted in exactly one later line); 0 when it is held back.
 * Check the level first (dlog_level), so that events not logged anyway count nowhere. */
int dlog_limit_pass(struct DlogLimit *l, unsigned long *suppressed);

/* A logfmt value: bare when it is non-empty and has only safe characters, otherwise quoted
 * with \" \\ \n \t and \xNN escapes; cut to fit cap (always NUL-terminated). Returns out. */
char *dlog_quote(char *out, size_t cap, const char *s, size_t len);

#endif
