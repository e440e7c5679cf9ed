/* The configuration's key table (config_keys.c), which the readers in config.c walk: each key's
 * type, place in struct Config, embedded default, bounds, whether SIGHUP may change it, and its
 * line of help. Internal to daemon/config*.c. */
#ifndef DIFFRAG_CONFIG_KEYS_H
#define DIFFRAG_CONFIG_KEYS_H

#include <stddef.h>

#include "daemon/config.h"

enum KeyType { K_STR, K_LONG, K_SIZE, K_DOUBLE };

struct Key {
    const char *name;
    enum KeyType type;
    size_t off, cap;
    const char *def;
    double min, max;
    int reload;          /* SIGHUP applies it */
    const char *help;
};

extern const struct Key config_keys[];
extern const size_t config_n_keys;

#endif
