/* Status codes shared by the retriever modules (store, chunker, index, context assembly).
 * Every call returns 0 or one of these negatives and writes a message into the caller's
 * `char *err, size_t errlen` buffer (which may be NULL when errlen is 0). */
#ifndef DIFFRAG_RETRIEVER_STATUS_H
#define DIFFRAG_RETRIEVER_STATUS_H

#include <stddef.h>

#include "text/errmsg.h"

enum RetStatus {
    RET_OK = 0,
    RET_EINPUT = -1,    /* invalid argument or input (bad UTF-8, empty text, oversize id...) */
    RET_ENOTFOUND = -2, /* unknown collection or document */
    RET_EIO = -3,       /* the operating system or LMDB failed */
    RET_ENOMEM = -4,
    RET_EVERSION = -5,  /* the store has a schema version this build does not read */
    RET_ECORRUPT = -6,  /* a record in the store is malformed, or verify found a fault */
    RET_ELIMIT = -7,    /* a fixed limit was reached (chunk ids, map size ceiling) */
    RET_ETOKEN = -8,    /* the token counter failed */
    RET_EBUDGET = -9,   /* the fixed part of a prompt does not fit the token budget */
    RET_EFULL = -10,    /* the disk holding the store, or the store's map, is full: nothing was
                         * written */
};

const char *ret_strerror(int status);

/* snprintf into err when err is non-NULL; returns `status` so callers can `return ret_fail(...)`
 * (text/errmsg.h). */
#define ret_fail(...) errmsg_set(__VA_ARGS__)

#endif
