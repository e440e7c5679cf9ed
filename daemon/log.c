/* Logging for diffragd: the level gate, timestamps, logfmt quoting and one write per line. */
#include "daemon/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

volatile int dlog_level = LL_INFO;

static const char *const level_names[] = { "error", "warn", "info", "debug" };

int dlog_level_parse(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, level_names[i]))
            return i;
    if (!strcmp(s, "warning"))
        return LL_WARN;
    return -1;
}

const char *dlog_level_name(int level)
{
    return level >= 0 && level < 4 ? level_names[level] : "?";
}

void dlog_write(int level, const char *fmt, ...)
{
    char line[4096];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, dlog_level_name(level));
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w; /* nowhere to report a failed log write */
}

int dlog_limit_pass(struct DlogLimit *l, unsigned long *suppressed)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long now = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + 1;   /* never 0 */
    long long last = atomic_load(&l->last_ms);
    if ((last && now - last < 1000) || !atomic_compare_exchange_strong(&l->last_ms, &last, now)) {
        atomic_fetch_add(&l->suppressed, 1);
        return 0;
    }
    *suppressed = atomic_exchange(&l->suppressed, 0);
    return 1;
}

char *dlog_quote(char *out, size_t cap, const char *s, size_t len)
{
    if (cap == 0)
        return out;
    int bare = len > 0;
    for (size_t i = 0; i < len && bare; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c <= ' ' || c == '"' || c == '=' || c == '\\' || c >= 0x7f)
            bare = 0;
    }
    size_t o = 0;
    if (bare) {
        for (size_t i = 0; i < len && o + 1 < cap; i++)
            out[o++] = s[i];
        out[o] = 0;
        return out;
    }
    if (o + 1 < cap)
        out[o++] = '"';
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        size_t el;
        if (c == '"' || c == '\\') { esc[0] = '\\'; esc[1] = (char)c; el = 2; }
        else if (c == '\n') { memcpy(esc, "\\n", 2); el = 2; }
        else if (c == '\t') { memcpy(esc, "\\t", 2); el = 2; }
        else if (c < 0x20 || c == 0x7f) { snprintf(esc, sizeof esc, "\\x%02x", c); el = 4; }
        else { esc[0] = (char)c; el = 1; }
        if (o + el + 2 > cap)
            break;
        memcpy(out + o, esc, el);
        o += el;
    }
    if (o + 1 < cap)
        out[o++] = '"';
    out[o] = 0;
    return out;
}
