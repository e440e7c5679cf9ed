/* CurveZMQ for the client socket: key files, the set of client public keys allowed to connect,
 * and the ZAP handler (ZeroMQ RFC 27) that libzmq asks about every CURVE handshake.
 *
 * Key files are Z85 text: one key of 40 characters on a line; blank lines and lines starting
 * with `#` are skipped (what `diffrag keygen` writes: NAME.key holds the secret key, NAME.pub
 * the public one). An allowed-keys source is either such a file with one public key per line
 * (text after the key on its line, e.g. a name, is ignored) or a directory whose `*.pub` files
 * each hold one. */
#ifndef DIFFRAG_ZAP_H
#define DIFFRAG_ZAP_H

#include <stddef.h>

#include "daemon/metrics.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define ZAP_DOMAIN "diffrag"                 /* clients */
#define ZAP_DOMAIN_WORKERS "diffrag-workers"   /* remote workers on worker_listen */
#define CURVE_KEY_Z85_LEN 40
#define ZAP_MAX_KEYS 1000000

/* Reads the first key of a key file into out (NUL-terminated Z85). `group_readable` (optional)
 * receives 1 when the file's mode lets its group or others read it (a secret key should not).
 * 0, or -1 with err naming the file and the problem. */
int curve_key_read(const char *path, char out[CURVE_KEY_Z85_LEN + 1], int *group_readable,
                   char *err, size_t errlen);

/* The public key (Z85) of a secret key (Z85). 0 or -1. */
int curve_public_of(const char *secret_z85, char out[CURVE_KEY_Z85_LEN + 1]);

/* An immutable set of allowed client public keys. */
struct ZapKeys;

/* Loads a file or directory as described above. Every line that is not blank or a comment must
 * hold a valid key (a typo must not silently lock a client out or in). 0, or -1 with err
 * ("FILE:LINE: ..."). *out owns the set; *n_keys (optional) receives the number of keys. */
int zap_keys_load(const char *path, struct ZapKeys **out, size_t *n_keys, char *err, size_t errlen);
void zap_keys_destroy(struct ZapKeys **k);
/* Whether the 32-byte public key is in the set. */
int zap_keys_allow(const struct ZapKeys *k, const unsigned char key[32]);

struct Zap;

/* Binds ZAP_ENDPOINT in zctx (before any CURVE socket binds) and starts the handler thread.
 * *clients and *workers move into the handler: the keys admitted in ZAP_DOMAIN and in
 * ZAP_DOMAIN_WORKERS. NULL *clients admits every client that completes the handshake (it
 * knows the server's public key); NULL *workers admits no worker. m (borrowed, may be NULL)
 * counts decisions and must outlive the handler. 0, or -1 with err. */
int zap_start(void *zctx, struct ZapKeys **clients, struct ZapKeys **workers, struct Metrics *m,
              struct Zap **out, char *err, size_t errlen);
/* Replaces the keys of one domain (SIGHUP); *keys moves in. Handshakes after the call see
 * them; connections already made stay. */
void zap_set_keys(struct Zap *z, int workers, struct ZapKeys **keys);
/* Stops and joins the handler. NULL or *z == NULL: no-op; *z is set to NULL. */
void zap_stop(struct Zap **z);

#endif
