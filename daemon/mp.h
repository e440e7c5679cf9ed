/* msgpack for the wire: a reader that never allocates (a bounds-checked cursor over one
 * message, so every count a peer claims is checked against the bytes left before anything is
 * sized from it), and a writer over msgpack-c's packer with a sticky error flag.
 *
 * Reading a peer's message: mp_check() it once (one complete value, no trailing bytes, nesting
 * within a limit, no reserved byte), then walk it with mp_next()/mp_skip(). Strings and binary
 * values are borrowed from the message buffer: valid while it lives. */
#ifndef DIFFRAG_MP_H
#define DIFFRAG_MP_H

#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#define MP_MAX_DEPTH 64   /* mp_check refuses deeper nesting whatever the caller asks */

enum MpStatus {
    MP_OK = 0,
    MP_ETRUNC = -1,     /* the message ends inside a value */
    MP_ETRAILING = -2,  /* bytes after the one value */
    MP_EDEPTH = -3,     /* nesting deeper than allowed */
    MP_EBYTE = -4,      /* 0xc1, the byte msgpack never uses */
    MP_ETYPE = -5,      /* a value of another type than the caller needs */
    MP_ENOMEM = -6,
};
const char *mp_strerror(int status);

enum MpType { MP_NIL, MP_BOOL, MP_UINT, MP_INT, MP_FLOAT, MP_STR, MP_BIN, MP_ARRAY, MP_MAP, MP_EXT };
const char *mp_type_name(enum MpType t);

/* One value's header. For MP_STR/MP_BIN/MP_EXT the body is consumed and borrowed in s/len;
 * for MP_ARRAY/MP_MAP only the header is consumed and n is the element (pair) count.
 * MP_INT holds negative integers only; non-negative ones are MP_UINT. */
struct MpObj {
    enum MpType type;
    union { int b; uint64_t u; int64_t i; double f; uint32_t n; } v;
    const char *s;
    uint32_t len;
    const uint8_t *start;   /* first byte of the value in the message */
};

struct MpCursor { const uint8_t *p, *end; };
void mp_cursor_init(struct MpCursor *c, const void *buf, size_t len);

/* Check that buf[0..len) is exactly one msgpack value nested at most max_depth deep (a scalar
 * has depth 0, [1] has depth 1). Runs in O(len) whatever the counts claim.
 * Returns MP_OK, MP_ETRUNC, MP_ETRAILING, MP_EDEPTH or MP_EBYTE, with `err` saying where. */
int mp_check(const void *buf, size_t len, int max_depth, char *err, size_t errlen);

/* Read one header at the cursor and advance past it (MP_OK, MP_ETRUNC, MP_EBYTE). */
int mp_next(struct MpCursor *c, struct MpObj *o);
/* Skip one complete value, containers included (MP_OK, MP_ETRUNC, MP_EBYTE). */
int mp_skip(struct MpCursor *c);
/* Skip the rest of a container whose header `o` was just read. */
int mp_skip_body(struct MpCursor *c, const struct MpObj *o);

/* The writer: every call appends to buf; after a failed allocation `failed` stays set and
 * later calls do nothing, so a reply is built without checking each call. */
struct MpWriter {
    msgpack_sbuffer buf;
    msgpack_packer pk;
    int failed;
};
void mpw_init(struct MpWriter *w);
void mpw_destroy(struct MpWriter *w);
void mpw_reset(struct MpWriter *w);
void mpw_map(struct MpWriter *w, size_t n);
void mpw_array(struct MpWriter *w, size_t n);
/* A str: UTF-8 always (the protocol's strings are); a byte of s that is not part of
 * well-formed UTF-8 is written as U+FFFD, as the JSON writer does, so that no reply carries
 * bytes a client cannot decode as text, whatever reached it. */
void mpw_str(struct MpWriter *w, const char *s, size_t len);
void mpw_cstr(struct MpWriter *w, const char *s);      /* NUL-terminated; NULL writes nil */
void mpw_bin(struct MpWriter *w, const void *p, size_t len);
void mpw_uint(struct MpWriter *w, uint64_t v);
void mpw_int(struct MpWriter *w, int64_t v);
void mpw_double(struct MpWriter *w, double v);
void mpw_float(struct MpWriter *w, float v);      /* float 32 */
void mpw_bool(struct MpWriter *w, int v);
void mpw_nil(struct MpWriter *w);
/* Append bytes that already are one encoded msgpack value (e.g. an id echoed verbatim). */
void mpw_raw(struct MpWriter *w, const void *p, size_t len);
/* key + value shorthands for maps */
void mpw_kv_str(struct MpWriter *w, const char *key, const char *s, size_t len);
void mpw_kv_cstr(struct MpWriter *w, const char *key, const char *s);
void mpw_kv_uint(struct MpWriter *w, const char *key, uint64_t v);
void mpw_kv_int(struct MpWriter *w, const char *key, int64_t v);
void mpw_kv_double(struct MpWriter *w, const char *key, double v);
void mpw_kv_bool(struct MpWriter *w, const char *key, int v);

#endif
