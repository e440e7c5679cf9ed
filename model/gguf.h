/* GGUF reader: a bounds-checked view of a GGUF v2/v3 file mapped read-only.
 *
 * Byte layout (little-endian; see ggml docs/gguf.md):
 *   u32 magic "GGUF" | u32 version (2 or 3) | u64 n_tensors | u64 n_kv
 *   n_kv    x { string key | u32 value_type | value }
 *   n_tensors x { string name | u32 n_dims (1..4) | u64 ne[n_dims] | u32 ggml_type | u64 offset }
 *   padding to general.alignment (default 32) | tensor data (each offset relative to this
 *   section's start, aligned)
 *   string = u64 length | bytes (not NUL-terminated)
 *   array  = u32 element_type | u64 count | elements
 *
 * Every count, length, offset and size is checked against the file before use; a malformed
 * file yields GGUF_EFORMAT and a message naming the file and the problem, never a crash.
 * All pointers handed out (strings, tensor data) borrow the mapping: valid until gguf_close.
 * A GgufFile is immutable after open, so every getter may be called from several threads.
 * The mapping is only as stable as the file: truncating it while mapped faults on access. */
#ifndef DIFFRAG_GGUF_H
#define DIFFRAG_GGUF_H

#include <stddef.h>
#include <stdint.h>

enum GgufValueType {
    GGUF_TYPE_UINT8 = 0, GGUF_TYPE_INT8 = 1, GGUF_TYPE_UINT16 = 2, GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4, GGUF_TYPE_INT32 = 5, GGUF_TYPE_FLOAT32 = 6, GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8, GGUF_TYPE_ARRAY = 9, GGUF_TYPE_UINT64 = 10, GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT
};

/* ggml tensor types this reader knows the block layout of. */
enum GgmlType {
    GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6, GGML_TYPE_Q5_1 = 7, GGML_TYPE_Q8_0 = 8,
    /* K-quants: super-blocks of 256 elements (layouts in kernels/dequant.h). */
    GGML_TYPE_Q2_K = 10, GGML_TYPE_Q3_K = 11, GGML_TYPE_Q4_K = 12, GGML_TYPE_Q5_K = 13,
    GGML_TYPE_Q6_K = 14,
    GGML_TYPE_BF16 = 30,
};

enum GgufStatus {
    GGUF_OK = 0,
    GGUF_EIO = -1,       /* open/stat/mmap failed */
    GGUF_EFORMAT = -2,   /* malformed or truncated file */
    GGUF_EUNSUPPORTED = -3, /* well-formed but a version or type this reader does not handle */
    GGUF_ENOTFOUND = -4, /* key or tensor absent */
    GGUF_ETYPE = -5,     /* key present with a type the getter cannot convert */
    GGUF_ENOMEM = -6,
};
const char *gguf_strerror(int status);

struct GgufString { const char *ptr; uint64_t len; }; /* borrowed, not NUL-terminated */

struct GgufTensor {
    const char *name;     /* NUL-terminated copy owned by the GgufFile */
    uint32_t n_dims;
    uint64_t ne[4];       /* ne[0] is the contiguous (innermost) dimension; unused dims = 1 */
    enum GgmlType type;
    uint64_t offset;      /* relative to the data section */
    uint64_t n_elements;
    uint64_t n_bytes;
    const void *data;     /* borrowed from the mapping */
};

struct GgufFile;

/* Map and validate `path`. On failure returns a GGUF_E* code, *out = NULL and `err` holds a
 * message that names the file:
 *   GGUF_EIO          open/stat/mmap failed, or not a regular file;
 *   GGUF_EFORMAT      bad magic, truncation, a count or length larger than the file can hold,
 *                     unknown value type, n_dims outside 1..4, a zero or overflowing dimension,
 *                     ne[0] not a multiple of the block size, duplicate key or tensor name,
 *                     general.alignment not a power-of-two u32, a tensor offset not aligned or
 *                     its data running past the end (overlapping tensors are accepted);
 *   GGUF_EUNSUPPORTED version other than 2/3 (or a big-endian file), a tensor type outside
 *                     enum GgmlType, arrays of arrays;
 *   GGUF_ENOMEM. */
int gguf_open(const char *path, struct GgufFile **out, char *err, size_t errlen);
/* Same over caller memory (fuzzing, tests); `data` must outlive the GgufFile. */
int gguf_open_buffer(const void *data, size_t size, const char *name, struct GgufFile **out,
                     char *err, size_t errlen);
void gguf_close(struct GgufFile **g);

uint32_t gguf_version(const struct GgufFile *g);
const char *gguf_path(const struct GgufFile *g);

/* Enumeration in file order: key i (0 <= i < gguf_n_kv) as a borrowed string (it may hold any
 * bytes, NUL included) and its value type. Returns GGUF_OK or GGUF_ENOTFOUND past the end. */
uint64_t gguf_n_kv(const struct GgufFile *g);
int gguf_kv_at(const struct GgufFile *g, uint64_t i, struct GgufString *key,
               enum GgufValueType *type);

/* Key/value access. Integer getters accept any integer type whose value fits; the float
 * getter accepts F32/F64. All return GGUF_OK, GGUF_ENOTFOUND or GGUF_ETYPE. */
int gguf_has_key(const struct GgufFile *g, const char *key);
int gguf_get_u32(const struct GgufFile *g, const char *key, uint32_t *out);
int gguf_get_i64(const struct GgufFile *g, const char *key, int64_t *out);
int gguf_get_f32(const struct GgufFile *g, const char *key, float *out);
int gguf_get_bool(const struct GgufFile *g, const char *key, int *out);
int gguf_get_str(const struct GgufFile *g, const char *key, struct GgufString *out);
/* Arrays: element type and count; strings by index; numeric arrays as a borrowed pointer to
 * `count` packed little-endian elements of `elem_type` (possibly unaligned: memcpy them). */
int gguf_get_arr_info(const struct GgufFile *g, const char *key, enum GgufValueType *elem_type,
                      uint64_t *count);
/* gguf_get_arr_str is O(1) (offsets are indexed at open); i >= count gives GGUF_ENOTFOUND. */
int gguf_get_arr_str(const struct GgufFile *g, const char *key, uint64_t i, struct GgufString *out);
int gguf_get_arr_data(const struct GgufFile *g, const char *key, enum GgufValueType *elem_type,
                      uint64_t *count, const void **data);

/* Tensors. */
uint64_t gguf_n_tensors(const struct GgufFile *g);
const struct GgufTensor *gguf_tensor_at(const struct GgufFile *g, uint64_t i);
const struct GgufTensor *gguf_find_tensor(const struct GgufFile *g, const char *name);

/* Type layout: elements per block and bytes per block; 0 for a type this reader does not handle.
 * ggml_type_name also names ggml types the reader rejects (for messages); "unknown" otherwise. */
size_t ggml_type_block_elems(uint32_t type);
size_t ggml_type_block_bytes(uint32_t type);
const char *ggml_type_name(uint32_t type);

#endif
