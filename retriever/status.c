/* Names of the retriever status codes and the helper that formats an error message into a
 * caller's buffer. */
#include "retriever/status.h"


const char *ret_strerror(int status)
{
    switch (status) {
    case RET_OK: return "ok";
    case RET_EINPUT: return "invalid input";
    case RET_ENOTFOUND: return "not found";
    case RET_EIO: return "I/O or LMDB error";
    case RET_ENOMEM: return "out of memory";
    case RET_EVERSION: return "unsupported store schema version";
    case RET_ECORRUPT: return "corrupt store";
    case RET_ELIMIT: return "limit reached";
    case RET_ETOKEN: return "token counter failed";
    case RET_EBUDGET: return "token budget too small";
    case RET_EFULL: return "disk or store map full";
    default: return "unknown status";
    }
}

