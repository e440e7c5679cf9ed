/* SHA-256 (FIPS 180-4), for binding a grounding calibration to the model file it was fitted
 * on. Streaming: init, update any number of times, final. */
#ifndef DIFFRAG_SHA256_H
#define DIFFRAG_SHA256_H

#include <stddef.h>
#include <stdint.h>

struct Sha256 {
    uint32_t h[8];
    uint64_t bytes;        /* message length so far */
    uint8_t block[64];
    size_t fill;           /* bytes waiting in block */
};

void sha256_init(struct Sha256 *s);
void sha256_update(struct Sha256 *s, const void *data, size_t len);
void sha256_final(struct Sha256 *s, uint8_t digest[32]);

/* The digest of a whole file, read in pieces. 0, or -1 with err naming the file and errno. */
int sha256_file(const char *path, uint8_t digest[32], char *err, size_t errlen);

/* 64 lowercase hex digits and a NUL into out (65 bytes). */
void sha256_hex(const uint8_t digest[32], char out[65]);

#endif
