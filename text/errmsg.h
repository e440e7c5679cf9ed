/* The one way a failing call writes its message: into the caller's `char *err, size_t errlen`
 * buffer (LMDB- and redis-style), returning the status so that callers can write
 * `return errmsg_set(err, errlen, RET_EINPUT, "...", ...)`. */
#ifndef DIFFRAG_TEXT_ERRMSG_H
#define DIFFRAG_TEXT_ERRMSG_H

#include <stddef.h>

/* snprintf into err when err is non-NULL and errlen > 0 (cut to fit); returns status. */
int errmsg_set(char *err, size_t errlen, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
