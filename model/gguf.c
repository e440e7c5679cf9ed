/* GGUF reader: maps a file read-only, validates every header field against the file size before
 * use, and indexes keys and tensor names in hash tables (arrays of strings get an offset table)
 * so every lookup is O(1). Also owns the ggml type layout table. */
#include "model/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "text/hash.h"

#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DIMS 4u
/* Smallest possible encodings, used to bound counts by the bytes left before allocating:
 * a key/value is key length (8) + type (4) + a 1-byte value; a tensor info is name length (8)
 * + n_dims (4) + one dimension (8) + type (4) + offset (8). */
#define GGUF_MIN_KV_BYTES 13u
#define GGUF_MIN_TENSOR_INFO_BYTES 32u

struct GgufKv {
    const uint8_t *key;            /* borrowed, key_len bytes, not NUL-terminated */
    size_t key_len;
    enum GgufValueType type;
    const uint8_t *val;            /* scalar bytes, string bytes, or the first array element */
    uint64_t len;                  /* string: bytes; array: element count */
    enum GgufValueType elem_type;  /* arrays only */
    uint64_t *str_off;             /* arrays of strings: offset from val of each length prefix */
};

struct GgufFile {
    char *path;
    const uint8_t *base;
    size_t size;
    int mapped;
    uint32_t version;
    struct GgufKv *kvs;
    uint64_t n_kv;
    struct GgufTensor *tensors;
    uint64_t n_tensors;
    struct HashTable kv_index;     /* hash_bytes of each key -> its index in kvs */
    struct HashTable tensor_index; /* hash_bytes of each tensor name -> its index in tensors */
    uint64_t alignment;
};

struct Parser {
    struct GgufFile *g;
    size_t pos;
    char *err;
    size_t errlen;
};

/* ---- type tables ---------------------------------------------------------------------- */

static const char *const ggml_type_names[] = {
    [0] = "F32", [1] = "F16", [2] = "Q4_0", [3] = "Q4_1", [6] = "Q5_0", [7] = "Q5_1",
    [8] = "Q8_0", [9] = "Q8_1", [10] = "Q2_K", [11] = "Q3_K", [12] = "Q4_K", [13] = "Q5_K",
    [14] = "Q6_K", [15] = "Q8_K", [16] = "IQ2_XXS", [17] = "IQ2_XS", [18] = "IQ3_XXS",
    [19] = "IQ1_S", [20] = "IQ4_NL", [21] = "IQ3_S", [22] = "IQ2_S", [23] = "IQ4_XS",
    [24] = "I8", [25] = "I16", [26] = "I32", [27] = "I64", [28] = "F64", [29] = "IQ1_M",
    [30] = "BF16", [34] = "TQ1_0", [35] = "TQ2_0", [39] = "MXFP4",
};

const char *ggml_type_name(uint32_t type)
{
    if (type < sizeof ggml_type_names / sizeof ggml_type_names[0] && ggml_type_names[type])
        return ggml_type_names[type];
    return "unknown";
}

size_t ggml_type_block_elems(uint32_t type)
{
    switch (type) {
    case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16:
        return 1;
    case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q8_0:
        return 32;
    case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K:
    case GGML_TYPE_Q6_K:
        return 256;
    default:
        return 0;
    }
}

size_t ggml_type_block_bytes(uint32_t type)
{
    switch (type) {
    case GGML_TYPE_F32: return 4;
    case GGML_TYPE_F16: return 2;
    case GGML_TYPE_BF16: return 2;
    case GGML_TYPE_Q4_0: return 18;
    case GGML_TYPE_Q4_1: return 20;
    case GGML_TYPE_Q5_0: return 22;
    case GGML_TYPE_Q5_1: return 24;
    case GGML_TYPE_Q8_0: return 34;
    case GGML_TYPE_Q2_K: return 84;
    case GGML_TYPE_Q3_K: return 110;
    case GGML_TYPE_Q4_K: return 144;
    case GGML_TYPE_Q5_K: return 176;
    case GGML_TYPE_Q6_K: return 210;
    default: return 0;
    }
}

static const char *value_type_name(uint32_t t)
{
    static const char *const names[GGUF_TYPE_COUNT] = {
        "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string",
        "array", "uint64", "int64", "float64",
    };
    return t < GGUF_TYPE_COUNT ? names[t] : "unknown";
}

/* Bytes of a fixed-size value; 0 for string, array and unknown types. */
static size_t value_type_size(uint32_t t)
{
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

const char *gguf_strerror(int status)
{
    switch (status) {
    case GGUF_OK: return "ok";
    case GGUF_EIO: return "I/O error";
    case GGUF_EFORMAT: return "malformed GGUF file";
    case GGUF_EUNSUPPORTED: return "unsupported GGUF version or type";
    case GGUF_ENOTFOUND: return "not found";
    case GGUF_ETYPE: return "wrong type";
    case GGUF_ENOMEM: return "out of memory";
    default: return "unknown GGUF status";
    }
}

/* ---- little-endian loads ---------------------------------------------------------------- */

static uint16_t le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t le64(const uint8_t *p)
{
    return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32);
}

/* ---- errors ------------------------------------------------------------------------------ */

static void write_err(char *err, size_t errlen, const char *path, const char *fmt, va_list ap)
{
    if (!err || errlen == 0)
        return;
    int n = snprintf(err, errlen, "%s: ", path ? path : "(null)");
    if (n < 0 || (size_t)n >= errlen)
        return;
    vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
}

__attribute__((format(printf, 3, 4)))
static int fail(struct Parser *p, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    write_err(p->err, p->errlen, p->g->path, fmt, ap);
    va_end(ap);
    return code;
}

/* A printable, truncated rendering of a name read from the file, for error messages. */
struct NameBuf { char s[72]; };

static struct NameBuf show(const uint8_t *s, size_t len)
{
    struct NameBuf b;
    size_t n = len < 60 ? len : 60, i;
    for (i = 0; i < n; i++)
        b.s[i] = (s[i] >= 0x20 && s[i] < 0x7f) ? (char)s[i] : '?';
    if (n < len) {
        memcpy(b.s + i, "...", 3);
        i += 3;
    }
    b.s[i] = '\0';
    return b;
}

/* ---- bounded reads ------------------------------------------------------------------------ */

static int need(struct Parser *p, uint64_t n, const char *what)
{
    if (n > p->g->size - p->pos)
        return fail(p, GGUF_EFORMAT,
                    "truncated: %s needs %" PRIu64 " bytes at offset %zu, but the file has %zu bytes",
                    what, n, p->pos, p->g->size);
    return GGUF_OK;
}

static int read_u32(struct Parser *p, uint32_t *v, const char *what)
{
    int rc = need(p, 4, what);
    if (rc)
        return rc;
    *v = le32(p->g->base + p->pos);
    p->pos += 4;
    return GGUF_OK;
}

static int read_u64(struct Parser *p, uint64_t *v, const char *what)
{
    int rc = need(p, 8, what);
    if (rc)
        return rc;
    *v = le64(p->g->base + p->pos);
    p->pos += 8;
    return GGUF_OK;
}

static int read_str(struct Parser *p, const uint8_t **s, size_t *len, const char *what)
{
    uint64_t n;
    int rc = read_u64(p, &n, what);
    if (rc)
        return rc;
    if (n > p->g->size - p->pos)
        return fail(p, GGUF_EFORMAT,
                    "truncated: %s of %" PRIu64 " bytes at offset %zu runs past the end of the file "
                    "(size %zu)", what, n, p->pos, p->g->size);
    *s = p->g->base + p->pos;
    *len = (size_t)n;
    p->pos += (size_t)n;
    return GGUF_OK;
}

/* ---- hash indexes -------------------------------------------------------------------------- */

static int index_init(struct HashTable *ix, uint64_t n)
{
    return n <= SIZE_MAX && hash_init(ix, (size_t)n) == 0 ? GGUF_OK : GGUF_ENOMEM;
}

static void kv_key(const struct GgufFile *g, size_t i, const uint8_t **k, size_t *len)
{
    *k = g->kvs[i].key;
    *len = g->kvs[i].key_len;
}

static void tensor_key(const struct GgufFile *g, size_t i, const uint8_t **k, size_t *len)
{
    *k = (const uint8_t *)g->tensors[i].name;
    *len = strlen(g->tensors[i].name);
}

typedef void (*KeyOf)(const struct GgufFile *g, size_t i, const uint8_t **k, size_t *len);

/* The index of the entry whose key is k[0..len), or -1. */
static int64_t index_find(const struct HashTable *ix, const struct GgufFile *g, KeyOf key_of,
                          const uint8_t *k, size_t len)
{
    uint64_t h = hash_bytes(k, len);
    size_t pos;
    for (struct HashSlot *s = hash_find(ix, h, &pos); s; s = hash_next(ix, h, &pos)) {
        const uint8_t *ek;
        size_t elen;
        key_of(g, (size_t)s->value, &ek, &elen);
        if (elen == len && memcmp(ek, k, len) == 0)
            return (int64_t)s->value;
    }
    return -1;
}

/* Indexes entry i under its key: GGUF_OK, GGUF_EFORMAT when another entry has that key, or
 * GGUF_ENOMEM. */
static int index_add(struct HashTable *ix, const struct GgufFile *g, KeyOf key_of, size_t i)
{
    const uint8_t *k;
    size_t len;
    key_of(g, i, &k, &len);
    if (index_find(ix, g, key_of, k, len) >= 0)
        return GGUF_EFORMAT;
    return hash_insert(ix, hash_bytes(k, len), i) ? GGUF_OK : GGUF_ENOMEM;
}

static const struct GgufKv *find_kv(const struct GgufFile *g, const char *key)
{
    if (!g || !key || !g->kv_index.slots)
        return NULL;
    int64_t e = index_find(&g->kv_index, g, kv_key, (const uint8_t *)key, strlen(key));
    return e >= 0 ? &g->kvs[e] : NULL;
}

/* ---- metadata ------------------------------------------------------------------------------ */

static int parse_value(struct Parser *p, struct GgufKv *kv, const char *key)
{
    struct GgufFile *g = p->g;
    int rc;
    size_t esize = value_type_size(kv->type);
    if (esize) {
        if ((rc = need(p, esize, "metadata value")))
            return rc;
        kv->val = g->base + p->pos;
        p->pos += esize;
        return GGUF_OK;
    }
    if (kv->type == GGUF_TYPE_STRING) {
        size_t len;
        if ((rc = read_str(p, &kv->val, &len, "string value")))
            return rc;
        kv->len = len;
        return GGUF_OK;
    }
    /* GGUF_TYPE_ARRAY */
    uint32_t et;
    uint64_t count;
    if ((rc = read_u32(p, &et, "array element type")) || (rc = read_u64(p, &count, "array count")))
        return rc;
    if (et == GGUF_TYPE_ARRAY)
        return fail(p, GGUF_EUNSUPPORTED, "key '%s' is an array of arrays, which this reader "
                    "does not handle", key);
    if (et >= GGUF_TYPE_COUNT)
        return fail(p, GGUF_EFORMAT, "key '%s' is an array of unknown value type %" PRIu32, key, et);
    kv->elem_type = (enum GgufValueType)et;
    kv->len = count;
    kv->val = g->base + p->pos;
    size_t left = g->size - p->pos;
    esize = value_type_size(et);
    if (esize) {
        if (count > left / esize)
            return fail(p, GGUF_EFORMAT, "key '%s': array of %" PRIu64 " %s values at offset %zu "
                        "runs past the end of the file (size %zu)", key, count,
                        value_type_name(et), p->pos, g->size);
        p->pos += (size_t)count * esize;
        return GGUF_OK;
    }
    /* Strings: each needs at least its 8-byte length, which bounds the table we allocate. */
    if (count > left / 8)
        return fail(p, GGUF_EFORMAT, "key '%s': array of %" PRIu64 " strings at offset %zu "
                    "cannot fit in the %zu bytes left in the file", key, count, p->pos, left);
    if (count == 0)
        return GGUF_OK;
    kv->str_off = malloc((size_t)count * sizeof *kv->str_off);
    if (!kv->str_off)
        return fail(p, GGUF_ENOMEM, "key '%s': no memory for %" PRIu64 " string offsets", key,
                    count);
    for (uint64_t i = 0; i < count; i++) {
        const uint8_t *s;
        size_t len;
        kv->str_off[i] = (uint64_t)(p->pos - (size_t)(kv->val - g->base));
        if ((rc = read_str(p, &s, &len, "array string")))
            return rc;
    }
    return GGUF_OK;
}

static int parse_kvs(struct Parser *p)
{
    struct GgufFile *g = p->g;
    int rc;
    if (g->n_kv > (g->size - p->pos) / GGUF_MIN_KV_BYTES)
        return fail(p, GGUF_EFORMAT, "n_kv %" PRIu64 " cannot fit in the %zu bytes left after "
                    "the header", g->n_kv, g->size - p->pos);
    if (g->n_kv) {
        g->kvs = calloc((size_t)g->n_kv, sizeof *g->kvs);
        if (!g->kvs)
            return fail(p, GGUF_ENOMEM, "no memory for %" PRIu64 " metadata entries", g->n_kv);
    }
    if ((rc = index_init(&g->kv_index, g->n_kv)))
        return fail(p, rc, "no memory for the key index");
    for (uint64_t i = 0; i < g->n_kv; i++) {
        struct GgufKv *kv = &g->kvs[i];
        uint32_t type;
        if ((rc = read_str(p, &kv->key, &kv->key_len, "metadata key")))
            return rc;
        struct NameBuf key = show(kv->key, kv->key_len);
        if ((rc = read_u32(p, &type, "metadata value type")))
            return rc;
        if (type >= GGUF_TYPE_COUNT)
            return fail(p, GGUF_EFORMAT, "key '%s' has unknown value type %" PRIu32, key.s, type);
        kv->type = (enum GgufValueType)type;
        if ((rc = parse_value(p, kv, key.s)))
            return rc;
        if ((rc = index_add(&g->kv_index, g, kv_key, (size_t)i)) == GGUF_EFORMAT)
            return fail(p, rc, "duplicate key '%s'", key.s);
        if (rc)
            return fail(p, rc, "no memory for the key index");
    }
    return GGUF_OK;
}

/* ---- tensors ------------------------------------------------------------------------------- */

static int parse_tensor_info(struct Parser *p, uint64_t i)
{
    struct GgufFile *g = p->g;
    struct GgufTensor *t = &g->tensors[i];
    const uint8_t *name;
    size_t name_len;
    uint32_t n_dims, type;
    int rc;
    if ((rc = read_str(p, &name, &name_len, "tensor name")))
        return rc;
    struct NameBuf nm = show(name, name_len);
    if (memchr(name, '\0', name_len))
        return fail(p, GGUF_EFORMAT, "tensor name '%s' contains a NUL byte", nm.s);
    char *copy = malloc(name_len + 1);
    if (!copy)
        return fail(p, GGUF_ENOMEM, "no memory for tensor name '%s'", nm.s);
    memcpy(copy, name, name_len);
    copy[name_len] = '\0';
    t->name = copy;

    if ((rc = read_u32(p, &n_dims, "tensor n_dims")))
        return rc;
    if (n_dims == 0 || n_dims > GGUF_MAX_DIMS)
        return fail(p, GGUF_EFORMAT, "tensor '%s' has %" PRIu32 " dimensions (1 to %u allowed)",
                    nm.s, n_dims, GGUF_MAX_DIMS);
    t->n_dims = n_dims;
    uint64_t n_elements = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d >= n_dims)
            continue;
        if ((rc = read_u64(p, &t->ne[d], "tensor dimension")))
            return rc;
        if (t->ne[d] == 0)
            return fail(p, GGUF_EFORMAT, "tensor '%s' has ne[%" PRIu32 "] = 0", nm.s, d);
        if (__builtin_mul_overflow(n_elements, t->ne[d], &n_elements) || n_elements > INT64_MAX)
            return fail(p, GGUF_EFORMAT, "tensor '%s': element count overflows at ne[%" PRIu32
                        "] = %" PRIu64, nm.s, d, t->ne[d]);
    }
    t->n_elements = n_elements;

    if ((rc = read_u32(p, &type, "tensor type")))
        return rc;
    size_t blk = ggml_type_block_elems(type);
    if (blk == 0)
        return fail(p, GGUF_EUNSUPPORTED, "tensor '%s' has ggml type %" PRIu32 " (%s), which "
                    "this reader does not handle", nm.s, type, ggml_type_name(type));
    t->type = (enum GgmlType)type;
    if (t->ne[0] % blk != 0)
        return fail(p, GGUF_EFORMAT, "tensor '%s': ne[0] = %" PRIu64 " is not a multiple of the "
                    "%s block size %zu", nm.s, t->ne[0], ggml_type_name(type), blk);
    if (__builtin_mul_overflow(n_elements / blk, (uint64_t)ggml_type_block_bytes(type),
                               &t->n_bytes))
        return fail(p, GGUF_EFORMAT, "tensor '%s': byte size overflows", nm.s);
    if ((rc = read_u64(p, &t->offset, "tensor offset")))
        return rc;

    if ((rc = index_add(&g->tensor_index, g, tensor_key, (size_t)i)) == GGUF_EFORMAT)
        return fail(p, rc, "duplicate tensor name '%s'", nm.s);
    if (rc)
        return fail(p, rc, "no memory for the tensor index");
    return GGUF_OK;
}

static int read_alignment(struct Parser *p)
{
    struct GgufFile *g = p->g;
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    if (!gguf_has_key(g, "general.alignment"))
        return GGUF_OK;
    uint32_t a;
    if (gguf_get_u32(g, "general.alignment", &a) != GGUF_OK)
        return fail(p, GGUF_EFORMAT, "general.alignment must be a uint32 (it is a %s)",
                    value_type_name(find_kv(g, "general.alignment")->type));
    if (a == 0 || (a & (a - 1)) != 0)
        return fail(p, GGUF_EFORMAT, "general.alignment %" PRIu32 " is not a power of two", a);
    g->alignment = a;
    return GGUF_OK;
}

static int parse_tensors(struct Parser *p)
{
    struct GgufFile *g = p->g;
    int rc;
    if (g->n_tensors > (g->size - p->pos) / GGUF_MIN_TENSOR_INFO_BYTES)
        return fail(p, GGUF_EFORMAT, "n_tensors %" PRIu64 " cannot fit in the %zu bytes left "
                    "after the metadata", g->n_tensors, g->size - p->pos);
    if (g->n_tensors) {
        g->tensors = calloc((size_t)g->n_tensors, sizeof *g->tensors);
        if (!g->tensors)
            return fail(p, GGUF_ENOMEM, "no memory for %" PRIu64 " tensors", g->n_tensors);
    }
    if ((rc = index_init(&g->tensor_index, g->n_tensors)))
        return fail(p, rc, "no memory for the tensor index");
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if ((rc = parse_tensor_info(p, i)))
            return rc;

    /* The data section starts at the next multiple of the alignment. */
    uint64_t a = g->alignment;
    uint64_t start = ((uint64_t)p->pos + a - 1) / a * a;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct GgufTensor *t = &g->tensors[i];
        if (t->offset % a != 0)
            return fail(p, GGUF_EFORMAT, "tensor '%s' offset %" PRIu64 " is not a multiple of "
                        "the alignment %" PRIu64, t->name, t->offset, a);
        if (start > g->size || t->offset > g->size - start ||
            t->n_bytes > g->size - start - t->offset)
            return fail(p, GGUF_EFORMAT, "tensor '%s' data [offset %" PRIu64 ", %" PRIu64
                        " bytes] runs past the end of the file (data section at %" PRIu64
                        ", size %zu)", t->name, t->offset, t->n_bytes, start, g->size);
        t->data = g->base + start + t->offset;
    }
    return GGUF_OK;
}

/* ---- open / close -------------------------------------------------------------------------- */

static int parse(struct Parser *p)
{
    struct GgufFile *g = p->g;
    int rc;
    if ((rc = need(p, 4, "magic")))
        return rc;
    if (memcmp(g->base, "GGUF", 4) != 0)
        return fail(p, GGUF_EFORMAT, "not a GGUF file (magic %02x %02x %02x %02x, expected "
                    "\"GGUF\")", g->base[0], g->base[1], g->base[2], g->base[3]);
    p->pos = 4;
    if ((rc = read_u32(p, &g->version, "version")))
        return rc;
    if (g->version != 2 && g->version != 3) {
        uint32_t v = g->version;
        uint32_t swapped = (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
        if (swapped == 2 || swapped == 3)
            return fail(p, GGUF_EUNSUPPORTED, "big-endian GGUF files are not supported");
        return fail(p, GGUF_EUNSUPPORTED, "GGUF version %" PRIu32 " is not supported (only 2 "
                    "and 3)", v);
    }
    if ((rc = read_u64(p, &g->n_tensors, "n_tensors")) || (rc = read_u64(p, &g->n_kv, "n_kv")))
        return rc;
    if ((rc = parse_kvs(p)) || (rc = read_alignment(p)) || (rc = parse_tensors(p)))
        return rc;
    return GGUF_OK;
}

static int open_common(struct GgufFile *g, struct GgufFile **out, char *err, size_t errlen)
{
    struct Parser p = {.g = g, .pos = 0, .err = err, .errlen = errlen};
    int rc = parse(&p);
    if (rc) {
        gguf_close(&g);
        return rc;
    }
    if (err && errlen)
        err[0] = '\0';
    *out = g;
    return GGUF_OK;
}

static void report(char *err, size_t errlen, const char *path, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    write_err(err, errlen, path, fmt, ap);
    va_end(ap);
}

/* Stands in for the mapping of an empty file (mmap refuses length 0). */
static const uint8_t empty_file[1];

int gguf_open_buffer(const void *data, size_t size, const char *name, struct GgufFile **out,
                     char *err, size_t errlen)
{
    if (!name)
        name = "<buffer>";
    *out = NULL;
    struct GgufFile *g = calloc(1, sizeof *g);
    if (!g || !(g->path = strdup(name))) {
        free(g);
        report(err, errlen, name, "out of memory");
        return GGUF_ENOMEM;
    }
    g->base = data && size ? data : empty_file;
    g->size = data ? size : 0;
    return open_common(g, out, err, errlen);
}

int gguf_open(const char *path, struct GgufFile **out, char *err, size_t errlen)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        report(err, errlen, path, "cannot open: %s", strerror(errno));
        return GGUF_EIO;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        report(err, errlen, path, "cannot stat: %s", strerror(errno));
        close(fd);
        return GGUF_EIO;
    }
    if (!S_ISREG(st.st_mode)) {
        report(err, errlen, path, "not a regular file");
        close(fd);
        return GGUF_EIO;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        report(err, errlen, path, "file too large to map");
        close(fd);
        return GGUF_EIO;
    }
    struct GgufFile *g = calloc(1, sizeof *g);
    if (!g || !(g->path = strdup(path))) {
        free(g);
        close(fd);
        report(err, errlen, path, "out of memory");
        return GGUF_ENOMEM;
    }
    g->size = (size_t)st.st_size;
    g->base = empty_file;
    if (g->size) {
        void *m = mmap(NULL, g->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            report(err, errlen, path, "cannot mmap %zu bytes: %s", g->size, strerror(errno));
            close(fd);
            g->size = 0;
            gguf_close(&g);
            return GGUF_EIO;
        }
        g->base = m;
        g->mapped = 1;
    }
    close(fd);
    return open_common(g, out, err, errlen);
}

void gguf_close(struct GgufFile **gp)
{
    if (!gp || !*gp)
        return;
    struct GgufFile *g = *gp;
    for (uint64_t i = 0; g->kvs && i < g->n_kv; i++)
        free(g->kvs[i].str_off);
    free(g->kvs);
    for (uint64_t i = 0; g->tensors && i < g->n_tensors; i++)
        free((void *)g->tensors[i].name);
    free(g->tensors);
    hash_free(&g->kv_index);
    hash_free(&g->tensor_index);
    if (g->mapped)
        munmap((void *)g->base, g->size);
    free(g->path);
    free(g);
    *gp = NULL;
}

uint32_t gguf_version(const struct GgufFile *g)
{
    return g->version;
}

const char *gguf_path(const struct GgufFile *g)
{
    return g->path;
}

/* ---- getters ------------------------------------------------------------------------------- */

uint64_t gguf_n_kv(const struct GgufFile *g)
{
    return g->n_kv;
}

int gguf_kv_at(const struct GgufFile *g, uint64_t i, struct GgufString *key,
               enum GgufValueType *type)
{
    if (i >= g->n_kv)
        return GGUF_ENOTFOUND;
    key->ptr = (const char *)g->kvs[i].key;
    key->len = g->kvs[i].key_len;
    *type = g->kvs[i].type;
    return GGUF_OK;
}

int gguf_has_key(const struct GgufFile *g, const char *key)
{
    return find_kv(g, key) != NULL;
}

/* Integer value as magnitude + sign, so every integer type converts without overflow. */
static int kv_integer(const struct GgufKv *kv, uint64_t *mag, int *negative)
{
    const uint8_t *v = kv->val;
    int64_t s;
    *negative = 0;
    switch (kv->type) {
    case GGUF_TYPE_UINT8: *mag = v[0]; return GGUF_OK;
    case GGUF_TYPE_UINT16: *mag = le16(v); return GGUF_OK;
    case GGUF_TYPE_UINT32: *mag = le32(v); return GGUF_OK;
    case GGUF_TYPE_UINT64: *mag = le64(v); return GGUF_OK;
    case GGUF_TYPE_INT8: s = (int8_t)v[0]; break;
    case GGUF_TYPE_INT16: s = (int16_t)le16(v); break;
    case GGUF_TYPE_INT32: s = (int32_t)le32(v); break;
    case GGUF_TYPE_INT64: s = (int64_t)le64(v); break;
    default: return GGUF_ETYPE;
    }
    *negative = s < 0;
    *mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
    return GGUF_OK;
}

int gguf_get_u32(const struct GgufFile *g, const char *key, uint32_t *out)
{
    const struct GgufKv *kv = find_kv(g, key);
    uint64_t mag;
    int neg;
    if (!kv)
        return GGUF_ENOTFOUND;
    if (kv_integer(kv, &mag, &neg) != GGUF_OK || (neg && mag != 0) || mag > UINT32_MAX)
        return GGUF_ETYPE;
    *out = (uint32_t)mag;
    return GGUF_OK;
}

int gguf_get_i64(const struct GgufFile *g, const char *key, int64_t *out)
{
    const struct GgufKv *kv = find_kv(g, key);
    uint64_t mag;
    int neg;
    if (!kv)
        return GGUF_ENOTFOUND;
    if (kv_integer(kv, &mag, &neg) != GGUF_OK)
        return GGUF_ETYPE;
    if (neg) {
        if (mag > (uint64_t)INT64_MAX + 1)
            return GGUF_ETYPE;
        *out = mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag;
    } else {
        if (mag > INT64_MAX)
            return GGUF_ETYPE;
        *out = (int64_t)mag;
    }
    return GGUF_OK;
}

int gguf_get_f32(const struct GgufFile *g, const char *key, float *out)
{
    const struct GgufKv *kv = find_kv(g, key);
    if (!kv)
        return GGUF_ENOTFOUND;
    if (kv->type == GGUF_TYPE_FLOAT32) {
        uint32_t u = le32(kv->val);
        memcpy(out, &u, sizeof *out);
        return GGUF_OK;
    }
    if (kv->type == GGUF_TYPE_FLOAT64) {
        uint64_t u = le64(kv->val);
        double d;
        memcpy(&d, &u, sizeof d);
        *out = (float)d;
        return GGUF_OK;
    }
    return GGUF_ETYPE;
}

int gguf_get_bool(const struct GgufFile *g, const char *key, int *out)
{
    const struct GgufKv *kv = find_kv(g, key);
    if (!kv)
        return GGUF_ENOTFOUND;
    if (kv->type != GGUF_TYPE_BOOL)
        return GGUF_ETYPE;
    *out = kv->val[0] != 0;
    return GGUF_OK;
}

int gguf_get_str(const struct GgufFile *g, const char *key, struct GgufString *out)
{
    const struct GgufKv *kv = find_kv(g, key);
    if (!kv)
        return GGUF_ENOTFOUND;
    if (kv->type != GGUF_TYPE_STRING)
        return GGUF_ETYPE;
    out->ptr = (const char *)kv->val;
    out->len = kv->len;
    return GGUF_OK;
}

int gguf_get_arr_info(const struct GgufFile *g, const char *key, enum GgufValueType *elem_type,
                      uint64_t *count)
{
    const struct GgufKv *kv = find_kv(g, key);
    if (!kv)
        return GGUF_ENOTFOUND;
    if (kv->type != GGUF_TYPE_ARRAY)
        return GGUF_ETYPE;
    *elem_type = kv->elem_type;
    *count = kv->len;
    return GGUF_OK;
}

int gguf_get_arr_str(const struct GgufFile *g, const char *key, uint64_t i, struct GgufString *out)
{
    const struct GgufKv *kv = find_kv(g, key);
    if (!kv)
        return GGUF_ENOTFOUND;
    if (kv->type != GGUF_TYPE_ARRAY || kv->elem_type != GGUF_TYPE_STRING)
        return GGUF_ETYPE;
    if (i >= kv->len)
        return GGUF_ENOTFOUND;
    const uint8_t *e = kv->val + kv->str_off[i];
    out->len = le64(e);
    out->ptr = (const char *)(e + 8);
    return GGUF_OK;
}

int gguf_get_arr_data(const struct GgufFile *g, const char *key, enum GgufValueType *elem_type,
                      uint64_t *count, const void **data)
{
    const struct GgufKv *kv = find_kv(g, key);
    if (!kv)
        return GGUF_ENOTFOUND;
    if (kv->type != GGUF_TYPE_ARRAY || kv->elem_type == GGUF_TYPE_STRING)
        return GGUF_ETYPE;
    *elem_type = kv->elem_type;
    *count = kv->len;
    *data = kv->val;
    return GGUF_OK;
}

uint64_t gguf_n_tensors(const struct GgufFile *g)
{
    return g->n_tensors;
}

const struct GgufTensor *gguf_tensor_at(const struct GgufFile *g, uint64_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const struct GgufTensor *gguf_find_tensor(const struct GgufFile *g, const char *name)
{
    if (!g || !name || !g->tensor_index.slots)
        return NULL;
    int64_t e = index_find(&g->tensor_index, g, tensor_key, (const uint8_t *)name, strlen(name));
    return e >= 0 ? &g->tensors[e] : NULL;
}
