/* errmsg_set: a message into the caller's error buffer, the status returned. */
#include "text/errmsg.h"

#include <stdarg.h>
#include <stdio.h>

int errmsg_set(char *err, size_t errlen, int status, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return status;
}
