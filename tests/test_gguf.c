/* Tests for the GGUF reader (model/gguf.c), the f16/bf16 conversions (kernels/f16.h) and the CPU
 * dequantisation kernels (kernels/cpu/dequant.c).
 *
 * Usage:
 *   test_gguf                             run the unit tests: GGUF images built in memory and
 *                                         their getters, the malformed-file suite (every prefix,
 *                                         patched fields, random mutations), exhaustive f16/bf16
 *                                         checks, hand-built quantised blocks, and the default
 *                                         model when models/ holds it (run from the repo root)
 *   test_gguf --dump FILE TENSOR OUT.bin  write TENSOR of FILE dequantised as raw f32
 *   test_gguf --list FILE                 print every key (with its value) and tensor of FILE
 * The two helper modes serve tests/test_dequant.py, which checks them against the gguf Python
 * package; tests/test_gguf_asan.py runs all of this under AddressSanitizer. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/dequant.h"
#include "kernels/f16.h"
#include "model/gguf.h"
#include "tests/check.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- a small GGUF writer ------------------------------------------------------------------ */

struct Buf {
    uint8_t *p;
    size_t len, cap;
};

static void put(struct Buf *b, const void *d, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n)
            cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            fprintf(stderr, "test_gguf: out of memory\n");
            exit(2);
        }
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->len, d, n);
    b->len += n;
}

static void put_u8(struct Buf *b, uint8_t v) { put(b, &v, 1); }

static void put_u16(struct Buf *b, uint16_t v)
{
    uint8_t x[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    put(b, x, 2);
}

static void put_u32(struct Buf *b, uint32_t v)
{
    uint8_t x[4];
    for (int i = 0; i < 4; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    put(b, x, 4);
}

static void put_u64(struct Buf *b, uint64_t v)
{
    uint8_t x[8];
    for (int i = 0; i < 8; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    put(b, x, 8);
}

static void put_f32(struct Buf *b, float f) { put_u32(b, f16_f32_bits(f)); }

static void put_f64(struct Buf *b, double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    put_u64(b, u);
}

static void put_str(struct Buf *b, const char *s)
{
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}

static void patch_u32(uint8_t *p, size_t off, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[off + (size_t)i] = (uint8_t)(v >> (8 * i));
}

static void patch_u64(uint8_t *p, size_t off, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[off + (size_t)i] = (uint8_t)(v >> (8 * i));
}

/* ---- the test image --------------------------------------------------------------------------
 * Tensors, in file order; their data is built from known quantised values so the decoded floats
 * can be predicted from the format description alone. The last tensor ends exactly at the end
 * of the file, so every proper prefix of the image is truncated somewhere that matters. */
enum { T_Q8, T_F32, T_Q41, T_F16, T_Q40, T_Q50, T_Q51, T_BF16, N_TENSORS };

struct TensorSpec {
    const char *name;
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[4];
};

static const struct TensorSpec specs[N_TENSORS] = {
    [T_Q8] = {"token_embd.weight", GGML_TYPE_Q8_0, 2, {64, 3, 1, 1}},
    [T_F32] = {"output_norm.weight", GGML_TYPE_F32, 1, {8, 1, 1, 1}},
    [T_Q41] = {"blk.0.ffn_up.weight", GGML_TYPE_Q4_1, 3, {32, 2, 2, 1}},
    [T_F16] = {"blk.0.attn_q.weight", GGML_TYPE_F16, 2, {6, 2, 1, 1}},
    [T_Q40] = {"q4_0.weight", GGML_TYPE_Q4_0, 1, {32, 1, 1, 1}},
    [T_Q50] = {"q5_0.weight", GGML_TYPE_Q5_0, 4, {32, 1, 1, 2}},
    [T_Q51] = {"q5_1.weight", GGML_TYPE_Q5_1, 1, {64, 1, 1, 1}},
    [T_BF16] = {"bf16.weight", GGML_TYPE_BF16, 1, {3, 1, 1, 1}},
};

static const uint16_t f16_samples[12] = {
    0x3c00, 0xc000, 0x0001, 0x7bff, 0x8000, 0x3555, 0x0400, 0x03ff, 0xfbff, 0x8001, 0x4248, 0x7c00,
};
static const uint16_t bf16_samples[3] = {0x3f80, 0xc049, 0x0001};

struct ImageOpts {
    uint32_t version;
    int alignment_kind;   /* 0: no general.alignment key; 1: u32 value; 2: string value */
    uint32_t alignment;
    int dup_key;
    int dup_tensor;
    uint32_t n_tokens;    /* entries in tokenizer.ggml.tokens */
};

struct Layout {
    size_t first_key_len;     /* u64 length of the first key */
    size_t first_type;        /* u32 value type of the first key/value */
    size_t arch_val_len;      /* u64 length of the general.architecture string */
    size_t tokens_etype;      /* u32 element type of tokenizer.ggml.tokens */
    size_t tokens_count;      /* u64 count of tokenizer.ggml.tokens */
    size_t token0_len;        /* u64 length of its first element */
    size_t types_count;       /* u64 count of the int32 array tokenizer.ggml.token_type */
    size_t last_kv_type;      /* u32 value type of the last key/value */
    size_t t_name[N_TENSORS], t_ndims[N_TENSORS], t_ne[N_TENSORS], t_type[N_TENSORS];
    size_t t_offset[N_TENSORS];
    uint64_t t_rel[N_TENSORS];  /* data offset relative to the data section */
    size_t data_start;
    uint32_t alignment;
};

static size_t spec_bytes(const struct TensorSpec *s)
{
    uint64_t n = s->ne[0] * s->ne[1] * s->ne[2] * s->ne[3];
    return (size_t)(n / ggml_type_block_elems(s->type) * ggml_type_block_bytes(s->type));
}

/* 5-bit (or 4-bit) test value for element j of block b of tensor t. */
static int qval(int t, int b, int j, int bits)
{
    return (j * 7 + b * 5 + t * 3 + 1) & ((1 << bits) - 1);
}

/* Scales are exact halves so that expected values are exact in f32. */
static const uint16_t scale_d[4] = {0x3800 /* 0.5 */, 0x2c00 /* 1/16 */, 0x4400 /* 4 */,
                                    0x1400 /* 2^-10 */};
static const uint16_t scale_m[4] = {0xbc00 /* -1 */, 0x3e00 /* 1.5 */, 0x0000, 0xc500 /* -5 */};

static double half_ref(uint16_t h)
{
    int sign = (h >> 15) ? -1 : 1, exp = (h >> 10) & 31, mant = h & 1023;
    if (exp == 31)
        return mant ? NAN : sign * INFINITY;
    if (exp == 0)
        return sign * ldexp(mant, -24);
    return sign * ldexp(1024 + mant, exp - 25);
}

static void put_tensor_data(struct Buf *b, int t)
{
    const struct TensorSpec *s = &specs[t];
    size_t nb = s->ne[0] * s->ne[1] * s->ne[2] * s->ne[3] / 32;
    switch (s->type) {
    case GGML_TYPE_F32:
        for (uint64_t i = 0; i < s->ne[0]; i++)
            put_f32(b, (float)i * 0.5f - 1.0f);
        return;
    case GGML_TYPE_F16:
        for (int i = 0; i < 12; i++)
            put_u16(b, f16_samples[i]);
        return;
    case GGML_TYPE_BF16:
        for (int i = 0; i < 3; i++)
            put_u16(b, bf16_samples[i]);
        return;
    default:
        break;
    }
    for (size_t k = 0; k < nb; k++) {
        int bits = (s->type == GGML_TYPE_Q5_0 || s->type == GGML_TYPE_Q5_1) ? 5 : 4;
        put_u16(b, scale_d[k % 4]);
        if (s->type == GGML_TYPE_Q4_1 || s->type == GGML_TYPE_Q5_1)
            put_u16(b, scale_m[k % 4]);
        if (s->type == GGML_TYPE_Q8_0) {
            for (int j = 0; j < 32; j++)
                put_u8(b, (uint8_t)(int8_t)((j * 37 + (int)k * 11) % 256 - 128));
            continue;
        }
        if (bits == 5) {
            uint32_t qh = 0;
            for (int j = 0; j < 32; j++)
                qh |= (uint32_t)(qval(t, (int)k, j, 5) >> 4) << j;
            put_u32(b, qh);
        }
        for (int j = 0; j < 16; j++)
            put_u8(b, (uint8_t)((qval(t, (int)k, j, bits) & 15) |
                                ((qval(t, (int)k, j + 16, bits) & 15) << 4)));
    }
}

/* Expected decoded value i of tensor t, from the format description. */
static double expected_value(int t, size_t i)
{
    const struct TensorSpec *s = &specs[t];
    size_t k = i / 32;
    int j = (int)(i % 32);
    double d = half_ref(scale_d[k % 4]), m = half_ref(scale_m[k % 4]);
    switch (s->type) {
    case GGML_TYPE_F32: return (double)i * 0.5 - 1.0;
    case GGML_TYPE_F16: return half_ref(f16_samples[i]);
    case GGML_TYPE_BF16: {
        uint32_t u = (uint32_t)bf16_samples[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    case GGML_TYPE_Q8_0: return (double)((j * 37 + (int)k * 11) % 256 - 128) * d;
    case GGML_TYPE_Q4_0: return (double)(qval(t, (int)k, j, 4) - 8) * d;
    case GGML_TYPE_Q4_1: return (double)qval(t, (int)k, j, 4) * d + m;
    case GGML_TYPE_Q5_0: return (double)(qval(t, (int)k, j, 5) - 16) * d;
    case GGML_TYPE_Q5_1: return (double)qval(t, (int)k, j, 5) * d + m;
    default: return NAN;
    }
}

static void put_kv_header(struct Buf *b, const char *key, uint32_t type)
{
    put_str(b, key);
    put_u32(b, type);
}

static void build_image(struct Buf *b, const struct ImageOpts *o, struct Layout *lay)
{
    memset(lay, 0, sizeof *lay);
    b->len = 0;
    uint32_t align = o->alignment_kind == 1 && o->alignment && !(o->alignment & (o->alignment - 1))
                         ? o->alignment : 32;
    lay->alignment = align;
    uint64_t n_kv = 18 + (o->alignment_kind ? 1 : 0) + (o->dup_key ? 1 : 0);
    put(b, "GGUF", 4);
    put_u32(b, o->version);
    put_u64(b, N_TENSORS);
    put_u64(b, n_kv);

    lay->first_key_len = b->len;
    put_str(b, "general.architecture");
    lay->first_type = b->len;
    put_u32(b, GGUF_TYPE_STRING);
    lay->arch_val_len = b->len;
    put_str(b, "llama");

    put_kv_header(b, "tokenizer.ggml.tokens", GGUF_TYPE_ARRAY);
    lay->tokens_etype = b->len;
    put_u32(b, GGUF_TYPE_STRING);
    lay->tokens_count = b->len;
    put_u64(b, o->n_tokens);
    lay->token0_len = b->len;
    for (uint32_t i = 0; i < o->n_tokens; i++) {
        char tok[32];
        if (i == 1)
            tok[0] = '\0';
        else
            snprintf(tok, sizeof tok, "tok%" PRIu32, i * 7);
        put_str(b, tok);
    }

    put_kv_header(b, "tokenizer.ggml.token_type", GGUF_TYPE_ARRAY);
    put_u32(b, GGUF_TYPE_INT32);
    lay->types_count = b->len;
    put_u64(b, 5);
    const int32_t types[5] = {1, 2, 3, -4, 5};
    for (int i = 0; i < 5; i++)
        put_u32(b, (uint32_t)types[i]);

    put_kv_header(b, "llama.block_count", GGUF_TYPE_UINT32);
    put_u32(b, 30);
    if (o->alignment_kind == 1) {
        put_kv_header(b, "general.alignment", GGUF_TYPE_UINT32);
        put_u32(b, o->alignment);
    } else if (o->alignment_kind == 2) {
        put_kv_header(b, "general.alignment", GGUF_TYPE_STRING);
        put_str(b, "32");
    }
    put_kv_header(b, "v.u8", GGUF_TYPE_UINT8);
    put_u8(b, 200);
    put_kv_header(b, "v.i8", GGUF_TYPE_INT8);
    put_u8(b, (uint8_t)-5);
    put_kv_header(b, "v.u16", GGUF_TYPE_UINT16);
    put_u16(b, 65535);
    put_kv_header(b, "v.i16", GGUF_TYPE_INT16);
    put_u16(b, (uint16_t)-300);
    put_kv_header(b, "v.i32", GGUF_TYPE_INT32);
    put_u32(b, (uint32_t)-70000);
    put_kv_header(b, "v.u64", GGUF_TYPE_UINT64);
    put_u64(b, 1ull << 40);
    put_kv_header(b, "v.i64", GGUF_TYPE_INT64);
    put_u64(b, (uint64_t)-(1ll << 40));
    put_kv_header(b, "v.u64max", GGUF_TYPE_UINT64);
    put_u64(b, UINT64_MAX);
    put_kv_header(b, "v.f32", GGUF_TYPE_FLOAT32);
    put_f32(b, 1.5f);
    put_kv_header(b, "v.f64", GGUF_TYPE_FLOAT64);
    put_f64(b, 0.1);
    put_kv_header(b, "v.true", GGUF_TYPE_BOOL);
    put_u8(b, 1);
    put_kv_header(b, "v.false", GGUF_TYPE_BOOL);
    put_u8(b, 0);
    put_kv_header(b, "v.empty_arr", GGUF_TYPE_ARRAY);
    put_u32(b, GGUF_TYPE_UINT8);
    put_u64(b, 0);
    if (o->dup_key) {
        put_kv_header(b, "llama.block_count", GGUF_TYPE_UINT32);
        put_u32(b, 31);
    }
    lay->last_kv_type = b->len + 8 + strlen("v.empty_str");
    put_kv_header(b, "v.empty_str", GGUF_TYPE_STRING);
    put_str(b, "");

    uint64_t rel = 0;
    for (int t = 0; t < N_TENSORS; t++) {
        const struct TensorSpec *s = &specs[t];
        lay->t_name[t] = b->len;
        put_str(b, o->dup_tensor && t == T_F16 ? specs[T_Q8].name : s->name);
        lay->t_ndims[t] = b->len;
        put_u32(b, s->n_dims);
        lay->t_ne[t] = b->len;
        for (uint32_t d = 0; d < s->n_dims; d++)
            put_u64(b, s->ne[d]);
        lay->t_type[t] = b->len;
        put_u32(b, s->type);
        lay->t_offset[t] = b->len;
        lay->t_rel[t] = rel;
        put_u64(b, rel);
        rel += (spec_bytes(s) + align - 1) / align * align;
    }
    while (b->len % align)
        put_u8(b, 0);
    lay->data_start = b->len;
    for (int t = 0; t < N_TENSORS; t++) {
        while (b->len < lay->data_start + lay->t_rel[t])
            put_u8(b, 0);
        put_tensor_data(b, t);
    }
}

static const struct ImageOpts default_opts = {.version = 3, .n_tokens = 5};

/* ---- valid images -------------------------------------------------------------------------- */

static int gguf_str_eq(struct GgufString s, const char *want)
{
    return s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0;
}

static void check_getters(const struct GgufFile *g)
{
    uint32_t u32 = 0;
    int64_t i64 = 0;
    float f = 0;
    int bv = -1;
    struct GgufString s = {0};
    enum GgufValueType et;
    uint64_t count = 0;
    const void *data = NULL;

    CHECK(gguf_has_key(g, "llama.block_count") == 1, "has_key");
    CHECK(gguf_has_key(g, "llama.block_coun") == 0, "has_key prefix");
    CHECK(gguf_has_key(g, "") == 0, "has_key empty");
    CHECK(gguf_get_u32(g, "llama.block_count", &u32) == GGUF_OK && u32 == 30, "u32 %u", u32);
    CHECK(gguf_get_u32(g, "v.u8", &u32) == GGUF_OK && u32 == 200, "u8 as u32 %u", u32);
    CHECK(gguf_get_u32(g, "v.u16", &u32) == GGUF_OK && u32 == 65535, "u16 as u32 %u", u32);
    CHECK(gguf_get_u32(g, "v.i8", &u32) == GGUF_ETYPE, "negative i8 as u32");
    CHECK(gguf_get_u32(g, "v.u64", &u32) == GGUF_ETYPE, "2^40 as u32");
    CHECK(gguf_get_u32(g, "v.f32", &u32) == GGUF_ETYPE, "f32 as u32");
    CHECK(gguf_get_u32(g, "v.true", &u32) == GGUF_ETYPE, "bool as u32");
    CHECK(gguf_get_u32(g, "nope", &u32) == GGUF_ENOTFOUND, "missing u32");
    CHECK(gguf_get_i64(g, "v.i8", &i64) == GGUF_OK && i64 == -5, "i8 %" PRId64, i64);
    CHECK(gguf_get_i64(g, "v.i16", &i64) == GGUF_OK && i64 == -300, "i16 %" PRId64, i64);
    CHECK(gguf_get_i64(g, "v.i32", &i64) == GGUF_OK && i64 == -70000, "i32 %" PRId64, i64);
    CHECK(gguf_get_i64(g, "v.i64", &i64) == GGUF_OK && i64 == -(1ll << 40), "i64 %" PRId64, i64);
    CHECK(gguf_get_i64(g, "v.u64", &i64) == GGUF_OK && i64 == (1ll << 40), "u64 %" PRId64, i64);
    CHECK(gguf_get_i64(g, "v.u64max", &i64) == GGUF_ETYPE, "u64 max as i64");
    CHECK(gguf_get_i64(g, "general.architecture", &i64) == GGUF_ETYPE, "string as i64");
    CHECK(gguf_get_f32(g, "v.f32", &f) == GGUF_OK && f == 1.5f, "f32 %g", f);
    CHECK(gguf_get_f32(g, "v.f64", &f) == GGUF_OK && f == (float)0.1, "f64 %g", f);
    CHECK(gguf_get_f32(g, "v.u8", &f) == GGUF_ETYPE, "u8 as f32");
    CHECK(gguf_get_bool(g, "v.true", &bv) == GGUF_OK && bv == 1, "true %d", bv);
    CHECK(gguf_get_bool(g, "v.false", &bv) == GGUF_OK && bv == 0, "false %d", bv);
    CHECK(gguf_get_bool(g, "v.u8", &bv) == GGUF_ETYPE, "u8 as bool");
    CHECK(gguf_get_str(g, "general.architecture", &s) == GGUF_OK && gguf_str_eq(s, "llama"),
          "architecture");
    CHECK(gguf_get_str(g, "v.empty_str", &s) == GGUF_OK && s.len == 0, "empty string");
    CHECK(gguf_get_str(g, "v.u8", &s) == GGUF_ETYPE, "u8 as string");
    CHECK(gguf_get_str(g, "tokenizer.ggml.tokens", &s) == GGUF_ETYPE, "array as string");

    CHECK(gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &count) == GGUF_OK &&
          et == GGUF_TYPE_STRING && count == 5, "tokens info %" PRIu64, count);
    CHECK(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 0, &s) == GGUF_OK &&
          gguf_str_eq(s, "tok0"), "token 0");
    CHECK(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 1, &s) == GGUF_OK && s.len == 0,
          "token 1 empty");
    CHECK(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 4, &s) == GGUF_OK &&
          gguf_str_eq(s, "tok28"), "token 4");
    CHECK(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 5, &s) == GGUF_ENOTFOUND, "token 5");
    CHECK(gguf_get_arr_str(g, "tokenizer.ggml.token_type", 0, &s) == GGUF_ETYPE, "int arr str");
    CHECK(gguf_get_arr_str(g, "v.u8", 0, &s) == GGUF_ETYPE, "scalar arr str");
    CHECK(gguf_get_arr_str(g, "nope", 0, &s) == GGUF_ENOTFOUND, "missing arr");
    CHECK(gguf_get_arr_data(g, "tokenizer.ggml.token_type", &et, &count, &data) == GGUF_OK &&
          et == GGUF_TYPE_INT32 && count == 5, "token_type data");
    if (data && count == 5) {
        int32_t v[5];
        memcpy(v, data, sizeof v);
        CHECK(v[0] == 1 && v[2] == 3 && v[3] == -4 && v[4] == 5, "token_type values");
    }
    CHECK(gguf_get_arr_data(g, "tokenizer.ggml.tokens", &et, &count, &data) == GGUF_ETYPE,
          "string array as data");
    CHECK(gguf_get_arr_data(g, "v.empty_arr", &et, &count, &data) == GGUF_OK && count == 0 &&
          et == GGUF_TYPE_UINT8, "empty array");
    CHECK(gguf_get_arr_info(g, "v.u8", &et, &count) == GGUF_ETYPE, "scalar as array");

    struct GgufString key;
    CHECK(gguf_n_kv(g) == 18, "n_kv %" PRIu64, gguf_n_kv(g));
    CHECK(gguf_kv_at(g, 0, &key, &et) == GGUF_OK && gguf_str_eq(key, "general.architecture") &&
          et == GGUF_TYPE_STRING, "kv_at 0");
    CHECK(gguf_kv_at(g, gguf_n_kv(g), &key, &et) == GGUF_ENOTFOUND, "kv_at past end");
}

static void check_tensors(const struct GgufFile *g, const uint8_t *image, const struct Layout *lay)
{
    CHECK(gguf_n_tensors(g) == N_TENSORS, "n_tensors %" PRIu64, gguf_n_tensors(g));
    CHECK(gguf_tensor_at(g, N_TENSORS) == NULL, "tensor_at past end");
    CHECK(gguf_find_tensor(g, "missing.weight") == NULL, "find missing");
    CHECK(gguf_find_tensor(g, "token_embd") == NULL, "find prefix");
    double max_diff = 0;
    for (int t = 0; t < N_TENSORS && (uint64_t)t < gguf_n_tensors(g); t++) {
        const struct TensorSpec *s = &specs[t];
        const struct GgufTensor *x = gguf_tensor_at(g, (uint64_t)t);
        CHECK(x && strcmp(x->name, s->name) == 0, "tensor %d name", t);
        CHECK(gguf_find_tensor(g, s->name) == x, "find %s", s->name);
        CHECK(x->n_dims == s->n_dims && (uint32_t)x->type == s->type, "%s dims/type", s->name);
        for (int d = 0; d < 4; d++)
            CHECK(x->ne[d] == s->ne[d], "%s ne[%d] %" PRIu64, s->name, d, x->ne[d]);
        uint64_t n = s->ne[0] * s->ne[1] * s->ne[2] * s->ne[3];
        CHECK(x->n_elements == n, "%s n_elements", s->name);
        CHECK(x->n_bytes == spec_bytes(s), "%s n_bytes %" PRIu64, s->name, x->n_bytes);
        CHECK(x->offset == lay->t_rel[t], "%s offset", s->name);
        if (image)
            CHECK((const uint8_t *)x->data == image + lay->data_start + lay->t_rel[t],
                  "%s data pointer", s->name);
        float *out = malloc(n * sizeof *out);
        if (!out)
            exit(2);
        CHECK(dequant_row(s->type, x->data, out, n) == DEQUANT_OK, "%s dequant", s->name);
        for (uint64_t i = 0; i < n; i++) {
            double want = expected_value(t, i), got = out[i];
            int same = (isnan(want) && isnan(got)) || want == got;
            if (!same && !isnan(want) && !isnan(got) && fabs(want - got) > max_diff)
                max_diff = fabs(want - got);
            CHECK(same, "%s[%" PRIu64 "] = %.9g, expected %.9g", s->name, i, got, want);
        }
        free(out);
    }
    printf("hand-built blocks of 8 types: max |dequant - expected| = %g\n", max_diff);
}

static void test_valid_images(void)
{
    struct Buf b = {0};
    struct Layout lay;
    struct GgufFile *g = NULL;
    char err[256];

    build_image(&b, &default_opts, &lay);
    int rc = gguf_open_buffer(b.p, b.len, "mem.gguf", &g, err, sizeof err);
    CHECK(rc == GGUF_OK && g, "open valid image: %s", err);
    if (g) {
        CHECK(gguf_version(g) == 3, "version");
        CHECK(strcmp(gguf_path(g), "mem.gguf") == 0, "path");
        CHECK(err[0] == '\0', "err cleared on success");
        check_getters(g);
        check_tensors(g, b.p, &lay);
        gguf_close(&g);
        CHECK(g == NULL, "close clears the pointer");
    }
    gguf_close(&g); /* closing NULL is a no-op */

    /* Version 2, a custom alignment, and overlapping tensors are all valid. */
    struct ImageOpts o = default_opts;
    o.version = 2;
    o.alignment_kind = 1;
    o.alignment = 64;
    build_image(&b, &o, &lay);
    rc = gguf_open_buffer(b.p, b.len, "v2.gguf", &g, err, sizeof err);
    CHECK(rc == GGUF_OK, "open v2 aligned 64: %s", err);
    if (g) {
        CHECK(gguf_version(g) == 2, "version 2");
        CHECK(lay.data_start % 64 == 0 && gguf_tensor_at(g, 1)->offset % 64 == 0, "alignment 64");
        check_tensors(g, b.p, &lay);
        gguf_close(&g);
    }
    build_image(&b, &default_opts, &lay);
    patch_u64(b.p, lay.t_offset[T_F32], lay.t_rel[T_Q8]);
    rc = gguf_open_buffer(b.p, b.len, "overlap.gguf", &g, err, sizeof err);
    CHECK(rc == GGUF_OK, "overlapping tensors: %s", err);
    if (g) {
        CHECK(gguf_tensor_at(g, T_F32)->data == gguf_tensor_at(g, T_Q8)->data, "overlap data");
        gguf_close(&g);
    }

    /* A large string array: every element is reachable in O(1) and correct. */
    o = default_opts;
    o.n_tokens = 49152;
    build_image(&b, &o, &lay);
    rc = gguf_open_buffer(b.p, b.len, "vocab.gguf", &g, err, sizeof err);
    CHECK(rc == GGUF_OK, "open vocab image: %s", err);
    if (g) {
        int bad = 0;
        for (uint32_t k = 0; k < o.n_tokens; k++) {
            struct GgufString s;
            char want[32];
            if (k == 1)
                want[0] = '\0';
            else
                snprintf(want, sizeof want, "tok%" PRIu32, k * 7);
            if (gguf_get_arr_str(g, "tokenizer.ggml.tokens", k, &s) != GGUF_OK ||
                !gguf_str_eq(s, want))
                bad++;
        }
        CHECK(bad == 0, "%d wrong tokens", bad);
        /* Timed separately, in a scattered order: cost must not grow with the index. */
        uint64_t total = 0;
        double t0 = now_s();
        for (int pass = 0; pass < 20; pass++)
            for (uint32_t i = 0; i < o.n_tokens; i++) {
                struct GgufString s = {0};
                gguf_get_arr_str(g, "tokenizer.ggml.tokens", (i * 40503u) % o.n_tokens, &s);
                total += s.len;
            }
        double dt = now_s() - t0;
        double t1 = now_s();
        for (int pass = 0; pass < 20 * 64; pass++) {
            struct GgufString s = {0};
            gguf_get_arr_str(g, "tokenizer.ggml.tokens", 0, &s);
            total += s.len;
        }
        double dt0 = (now_s() - t1) / (20.0 * 64);
        double per = dt / (20.0 * o.n_tokens);
        CHECK(total > 0, "lengths");
        /* Generous bound (sanitizer builds and a loaded machine): a linear scan would take
         * tens of microseconds per lookup at this size. */
        CHECK(per < 2e-6, "gguf_get_arr_str takes %.0f ns", per * 1e9);
        printf("gguf_get_arr_str over a 49152-entry array: %.1f ns per scattered lookup, "
               "%.1f ns for index 0\n", per * 1e9, dt0 * 1e9);
        gguf_close(&g);
    }

    /* The same image through the file path. */
    build_image(&b, &default_opts, &lay);
    const char *tmpdir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char path[512];
    snprintf(path, sizeof path, "%s/test_gguf_XXXXXX", tmpdir);
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd >= 0) {
        CHECK(write(fd, b.p, b.len) == (ssize_t)b.len, "write temp file");
        close(fd);
        rc = gguf_open(path, &g, err, sizeof err);
        CHECK(rc == GGUF_OK, "gguf_open temp file: %s", err);
        if (g) {
            CHECK(strcmp(gguf_path(g), path) == 0, "file path");
            check_getters(g);
            check_tensors(g, NULL, &lay);
            gguf_close(&g);
        }
        /* An empty file is truncated, not an I/O error. */
        FILE *fp = fopen(path, "wb");
        if (fp)
            fclose(fp);
        rc = gguf_open(path, &g, err, sizeof err);
        CHECK(rc == GGUF_EFORMAT && g == NULL && strstr(err, path), "empty file: %d %s", rc, err);
        unlink(path);
    }
    rc = gguf_open("models/does-not-exist.gguf", &g, err, sizeof err);
    CHECK(rc == GGUF_EIO && g == NULL && strstr(err, "models/does-not-exist.gguf"),
          "missing file: %d %s", rc, err);
    rc = gguf_open(".", &g, err, sizeof err);
    CHECK(rc == GGUF_EIO && g == NULL && err[0] == '.', "directory: %d %s", rc, err);
    free(b.p);
}

/* ---- malformed images ---------------------------------------------------------------------- */

static int n_malformed;

/* Opens a private copy of exactly `len` bytes, so any read past the end is caught by ASan. */
static int open_copy(const uint8_t *img, size_t len, struct GgufFile **g, char *err, size_t errlen)
{
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy)
        exit(2);
    memcpy(copy, img, len);
    int rc = gguf_open_buffer(copy, len, "bad.gguf", g, err, errlen);
    if (rc == GGUF_OK) {
        /* Touch everything the reader hands out. */
        volatile uint8_t sink = 0;
        for (uint64_t i = 0; i < gguf_n_tensors(*g); i++) {
            const struct GgufTensor *t = gguf_tensor_at(*g, i);
            const uint8_t *d = t->data;
            for (uint64_t k = 0; k < t->n_bytes; k++)
                sink ^= d[k];
        }
        for (uint64_t i = 0; i < gguf_n_kv(*g); i++) {
            struct GgufString key;
            enum GgufValueType et;
            gguf_kv_at(*g, i, &key, &et);
            for (uint64_t k = 0; k < key.len; k++)
                sink ^= (uint8_t)key.ptr[k];
        }
        uint64_t count;
        enum GgufValueType et;
        if (gguf_get_arr_info(*g, "tokenizer.ggml.tokens", &et, &count) == GGUF_OK &&
            et == GGUF_TYPE_STRING)
            for (uint64_t i = 0; i < count; i++) {
                struct GgufString s;
                if (gguf_get_arr_str(*g, "tokenizer.ggml.tokens", i, &s) == GGUF_OK)
                    for (uint64_t k = 0; k < s.len; k++)
                        sink ^= (uint8_t)s.ptr[k];
            }
        (void)sink;
        gguf_close(g);
    }
    free(copy);
    return rc;
}

/* want: the exact code, or 0 for any error; needle: text the message must contain, or NULL. */
static void expect_fail(const uint8_t *img, size_t len, int want, const char *needle,
                        const char *label)
{
    struct GgufFile *g = NULL;
    char err[256];
    memset(err, 0, sizeof err);
    if (gguf_open_buffer(img, len, NULL, &g, NULL, 0) == GGUF_OK) /* a NULL err is accepted */
        gguf_close(&g);
    g = (struct GgufFile *)&n_malformed; /* any non-NULL value: failure must reset it */
    int rc = open_copy(img, len, &g, err, sizeof err);
    n_malformed++;
    CHECK(rc < 0 && (want == 0 || rc == want), "%s: rc %d (%s), want %d; message: %s", label, rc,
          gguf_strerror(rc), want, err);
    CHECK(g == NULL, "%s: out not NULL", label);
    CHECK(strncmp(err, "bad.gguf: ", 10) == 0 && strlen(err) > 12, "%s: message '%s'", label,
          err);
    if (needle)
        CHECK(strstr(err, needle) != NULL, "%s: message '%s' lacks '%s'", label, err, needle);
    if (getenv("TEST_GGUF_VERBOSE"))
        printf("  %-32s %-18s %s\n", label, gguf_strerror(rc), err);
}

static void expect_patched(const struct Buf *b, size_t off, int width, uint64_t v, int want,
                           const char *needle, const char *label)
{
    uint8_t *img = malloc(b->len);
    if (!img)
        exit(2);
    memcpy(img, b->p, b->len);
    if (width == 4)
        patch_u32(img, off, (uint32_t)v);
    else if (width == 8)
        patch_u64(img, off, v);
    else
        img[off] = (uint8_t)v;
    expect_fail(img, b->len, want, needle, label);
    free(img);
}

static void expect_built(const struct ImageOpts *o, int want, const char *needle,
                         const char *label)
{
    struct Buf b = {0};
    struct Layout lay;
    build_image(&b, o, &lay);
    expect_fail(b.p, b.len, want, needle, label);
    free(b.p);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_malformed(void)
{
    struct Buf b = {0};
    struct Layout L;
    build_image(&b, &default_opts, &L);
    const int EF = GGUF_EFORMAT, EU = GGUF_EUNSUPPORTED;

    /* Every proper prefix. */
    int before = n_malformed;
    for (size_t len = 0; len < b.len; len++) {
        char label[64];
        snprintf(label, sizeof label, "prefix of %zu bytes", len);
        expect_fail(b.p, len, EF, NULL, label);
    }
    printf("truncation: %d prefixes of a %zu-byte image rejected\n", n_malformed - before, b.len);

    expect_patched(&b, 0, 4, 0x58554747u, EF, "not a GGUF file", "magic GGUX");
    expect_patched(&b, 0, 4, 0, EF, "not a GGUF file", "magic zero");
    expect_patched(&b, 4, 4, 1, EU, "version 1", "version 1");
    expect_patched(&b, 4, 4, 99, EU, "version 99", "version 99");
    expect_patched(&b, 4, 4, 0, EU, "version 0", "version 0");
    expect_patched(&b, 4, 4, 0x03000000u, EU, "big-endian", "byte-swapped version");

    expect_patched(&b, 8, 8, 1ull << 62, EF, "n_tensors", "n_tensors 2^62");
    expect_patched(&b, 8, 8, UINT64_MAX, EF, "n_tensors", "n_tensors max");
    expect_patched(&b, 8, 8, N_TENSORS + 1, 0, NULL, "n_tensors + 1");
    expect_patched(&b, 16, 8, 1ull << 62, EF, "n_kv", "n_kv 2^62");
    expect_patched(&b, 16, 8, UINT64_MAX, EF, "n_kv", "n_kv max");
    expect_patched(&b, 16, 8, 19, 0, NULL, "n_kv + 1");
    expect_patched(&b, 16, 8, 17, 0, NULL, "n_kv - 1");

    expect_patched(&b, L.first_key_len, 8, 1ull << 63, EF, "metadata key", "key length 2^63");
    expect_patched(&b, L.first_key_len, 8, UINT64_MAX, EF, "metadata key", "key length max");
    expect_patched(&b, L.first_key_len, 8, b.len, EF, NULL, "key length = file size");
    expect_patched(&b, L.arch_val_len, 8, 1ull << 63, EF, "string value", "value length 2^63");
    expect_patched(&b, L.token0_len, 8, 1ull << 63, EF, "array string", "element length 2^63");
    expect_patched(&b, L.token0_len, 8, UINT64_MAX - 7, EF, NULL, "element length max-7");
    expect_patched(&b, L.tokens_count, 8, 1ull << 62, EF, "strings", "string array 2^62");
    expect_patched(&b, L.tokens_count, 8, UINT64_MAX, EF, "strings", "string array max");
    expect_patched(&b, L.types_count, 8, 1ull << 62, EF, "int32", "int32 array 2^62");
    expect_patched(&b, L.types_count, 8, (1ull << 62) + 1, EF, "int32", "int32 array wraps *4");

    expect_patched(&b, L.first_type, 4, GGUF_TYPE_COUNT, EF, "unknown value type 13",
                   "kv type 13");
    expect_patched(&b, L.first_type, 4, 0xffffffffu, EF, "unknown value type", "kv type max");
    expect_patched(&b, L.last_kv_type, 4, 77, EF, "unknown value type 77", "last kv type 77");
    expect_patched(&b, L.tokens_etype, 4, GGUF_TYPE_COUNT, EF, "unknown value type",
                   "array element type 13");
    expect_patched(&b, L.tokens_etype, 4, GGUF_TYPE_ARRAY, EU, "array of arrays",
                   "nested array");

    for (int t = 0; t < N_TENSORS; t += 3) {
        expect_patched(&b, L.t_ndims[t], 4, 0, EF, "0 dimensions", "n_dims 0");
        expect_patched(&b, L.t_ndims[t], 4, 5, EF, "5 dimensions", "n_dims 5");
        expect_patched(&b, L.t_ndims[t], 4, 0xffffffffu, EF, "dimensions", "n_dims max");
        expect_patched(&b, L.t_ne[t], 8, 0, EF, "ne[0] = 0", "ne[0] = 0");
        expect_patched(&b, L.t_type[t], 4, 16, EU, "type 16 (IQ2_XXS)", "tensor type IQ2_XXS");
        /* A K-quant is known, but these rows are shorter than its 256-element super-block. */
        expect_patched(&b, L.t_type[t], 4, 12, EF, "Q4_K block size 256", "tensor type Q4_K");
        expect_patched(&b, L.t_type[t], 4, 4, EU, "type 4", "tensor type 4 (removed)");
        expect_patched(&b, L.t_type[t], 4, 0xdeadbeefu, EU, "type 3735928559", "tensor type huge");
        expect_patched(&b, L.t_offset[t], 8, L.t_rel[t] + 1, EF, "not a multiple of the alignment",
                       "misaligned offset +1");
        expect_patched(&b, L.t_offset[t], 8, L.t_rel[t] + 16, EF, "alignment",
                       "misaligned offset +16");
        expect_patched(&b, L.t_offset[t], 8, 1ull << 63, EF, "runs past the end", "offset 2^63");
        expect_patched(&b, L.t_offset[t], 8, UINT64_MAX - 31, EF, "runs past the end",
                       "offset wraps");
        expect_patched(&b, L.t_offset[t], 8, (b.len - L.data_start + 31) / 32 * 32, EF,
                       "runs past the end", "offset at the end");
        expect_patched(&b, L.t_name[t] + 8, 1, 0, EF, "NUL", "NUL in tensor name");
    }
    /* The last tensor's data ends at the file's end: one more block runs past it. */
    expect_patched(&b, L.t_ne[T_BF16], 8, specs[T_BF16].ne[0] + 1, EF, "runs past the end",
                   "last tensor one element longer");
    expect_patched(&b, L.t_ne[T_Q8], 8, 33, EF, "not a multiple", "Q8_0 ne[0] = 33");
    expect_patched(&b, L.t_ne[T_Q41], 8, 48, EF, "not a multiple", "Q4_1 ne[0] = 48");
    expect_patched(&b, L.t_ne[T_F32], 8, 1ull << 63, EF, "overflows", "ne[0] = 2^63");
    expect_patched(&b, L.t_ne[T_F32], 8, 1ull << 62, EF, "byte size overflows", "F32 2^62 bytes");
    expect_patched(&b, L.t_ne[T_Q8], 8, 1ull << 62, EF, "overflows", "Q8_0 3 x 2^62 elements");
    expect_patched(&b, L.t_ne[T_Q41] + 8, 8, 1ull << 40, 0, NULL, "ne[1] = 2^40");
    {   /* ne[1] * ne[2] = 2^80 */
        uint8_t *img = malloc(b.len);
        if (!img)
            exit(2);
        memcpy(img, b.p, b.len);
        patch_u64(img, L.t_ne[T_Q41] + 8, 1ull << 40);
        patch_u64(img, L.t_ne[T_Q41] + 16, 1ull << 40);
        expect_fail(img, b.len, EF, "overflows", "ne product 2^85");
        free(img);
    }

    struct ImageOpts o = default_opts;
    o.dup_key = 1;
    expect_built(&o, EF, "duplicate key 'llama.block_count'", "duplicate key");
    o = default_opts;
    o.dup_tensor = 1;
    expect_built(&o, EF, "duplicate tensor name 'token_embd.weight'", "duplicate tensor");
    o = default_opts;
    o.alignment_kind = 1;
    o.alignment = 0;
    expect_built(&o, EF, "general.alignment 0", "alignment 0");
    o.alignment = 3;
    expect_built(&o, EF, "general.alignment 3", "alignment 3");
    o.alignment = 48;
    expect_built(&o, EF, "power of two", "alignment 48");
    o.alignment = 0x80000001u;
    expect_built(&o, EF, "power of two", "alignment 2^31+1");
    o.alignment_kind = 2;
    expect_built(&o, EF, "general.alignment must be a uint32", "alignment as string");
    o = default_opts;
    o.version = 2;
    o.dup_key = 1;
    expect_built(&o, EF, "duplicate", "v2 duplicate key");

    /* A tiny error buffer is filled but never overrun. */
    {
        char small[12];
        memset(small, 'x', sizeof small);
        struct GgufFile *g = NULL;
        uint8_t *img = malloc(b.len);
        if (!img)
            exit(2);
        memcpy(img, b.p, b.len);
        patch_u32(img, 4, 1);
        int rc = gguf_open_buffer(img, b.len, "bad.gguf", &g, small, 8);
        CHECK(rc == EU && small[7] == '\0' && small[8] == 'x' && strlen(small) == 7,
              "truncated message '%.8s'", small);
        free(img);
        n_malformed++;
    }

    /* Random mutations: each either opens (and everything it hands out is readable) or fails
     * with a message; ASan watches the reads. */
    int opened = 0, n_fuzz = 0;
    uint8_t *img = malloc(b.len);
    if (!img)
        exit(2);
    for (int iter = 0; iter < 6000; iter++) {
        memcpy(img, b.p, b.len);
        int flips = 1 + (int)(rng_next() % 4);
        size_t header_end = L.data_start;  /* mutate mostly the metadata */
        for (int k = 0; k < flips; k++) {
            size_t pos = (size_t)(rng_next() % header_end);
            uint64_t r = rng_next();
            if (r % 3 == 0)
                img[pos] ^= (uint8_t)(1u << (r >> 8) % 8);
            else if (r % 3 == 1)
                img[pos] = (uint8_t)(r >> 16);
            else
                img[pos] = (r >> 16) & 1 ? 0xff : 0x00;
        }
        size_t len = rng_next() % 8 == 0 ? (size_t)(rng_next() % b.len) : b.len;
        struct GgufFile *g = NULL;
        char err[256] = "";
        int rc = open_copy(img, len, &g, err, sizeof err);
        n_fuzz++;
        if (rc == GGUF_OK)
            opened++;
        else
            CHECK(strncmp(err, "bad.gguf: ", 10) == 0 && strlen(err) > 12, "fuzz message '%s'",
                  err);
        CHECK(g == NULL, "fuzz leaves out set");
    }
    free(img);
    printf("malformed: %d targeted cases rejected with a GGUF_E* code and a message naming the "
           "file; %d random mutations (%d still valid) handled\n", n_malformed, n_fuzz, opened);
    free(b.p);
}

/* ---- f16 / bf16 ------------------------------------------------------------------------------ */

static int same_f32(float a, float b)
{
    return (isnan(a) && isnan(b)) || f16_f32_bits(a) == f16_f32_bits(b);
}

/* Correct rounding of x to the formats: r is nearest among its neighbours, ties to even. */
static int is_rne_f16(float x, uint16_t r)
{
    double dx = x, dr = half_ref(r);
    if ((r & 0x7fff) == 0x7c00)     /* inf only for |x| >= 65520 */
        return fabs(dx) >= 65520.0 && (r >> 15) == (x < 0);
    if (isnan(dr))
        return 0;
    uint16_t mag = r & 0x7fff;
    double dist = fabs(dx - dr);
    double neighbours[2] = {mag > 0 ? half_ref((uint16_t)(mag - 1)) : -half_ref(1),
                            half_ref((uint16_t)(mag + 1))};
    for (int k = 0; k < 2; k++) {
        double dn = (r & 0x8000) ? -neighbours[k] : neighbours[k];
        if (isinf(dn))
            dn = (r & 0x8000) ? -65536.0 : 65536.0;
        double dd = fabs(dx - dn);
        if (dd < dist || (dd == dist && (r & 1)))
            return 0;
    }
    return 1;
}

static double bf16_ref(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static int is_rne_bf16(float x, uint16_t r)
{
    if ((r & 0x7fff) == 0x7f80)
        return fabs((double)x) >= ldexp(2.0 - ldexp(1, -8), 127) && (r >> 15) == (x < 0);
    uint16_t mag = r & 0x7fff;
    double dx = x, dr = bf16_ref(r), dist = fabs(dx - dr);
    double neighbours[2] = {mag > 0 ? bf16_ref((uint16_t)(mag - 1)) : -bf16_ref(1),
                            mag + 1 == 0x7f80 ? ldexp(1, 128) : bf16_ref((uint16_t)(mag + 1))};
    for (int k = 0; k < 2; k++) {
        double dn = (r & 0x8000) ? -neighbours[k] : neighbours[k];
        double dd = fabs(dx - dn);
        if (dd < dist || (dd == dist && (r & 1)))
            return 0;
    }
    return 1;
}

static void test_f16(void)
{
    int bad_decode = 0, bad_roundtrip = 0, bad_mid = 0, bad_random = 0, bad_bf16 = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float ref = (float)half_ref((uint16_t)h);
        float a = f16_to_f32((uint16_t)h), b = f16_to_f32_portable((uint16_t)h);
        if (!same_f32(a, ref) || !same_f32(b, ref))
            bad_decode++;
        if (!isnan(ref) && (f32_to_f16(ref) != h || f32_to_f16_portable(ref) != h))
            bad_roundtrip++;
        if (isnan(ref) && (((f32_to_f16(ref) & 0x7c00) != 0x7c00 || !(f32_to_f16(ref) & 0x3ff)) ||
                           ((f32_to_f16_portable(ref) & 0x7c00) != 0x7c00 ||
                            !(f32_to_f16_portable(ref) & 0x3ff))))
            bad_roundtrip++;
        /* Midpoints between h and h+1 (exact in f32) round to the even one. */
        if ((h & 0x7fff) < 0x7bff) {
            float mid = (float)((half_ref((uint16_t)h) + half_ref((uint16_t)(h + 1))) / 2);
            uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            float above = nextafterf(mid, (h & 0x8000) ? -INFINITY : INFINITY);
            float below = nextafterf(mid, 0.0f);
            if (f32_to_f16(mid) != even || f32_to_f16_portable(mid) != even ||
                f32_to_f16(above) != h + 1 || f32_to_f16_portable(above) != h + 1 ||
                f32_to_f16(below) != h || f32_to_f16_portable(below) != h)
                bad_mid++;
        }
        uint16_t bh = (uint16_t)h;
        float bf = bf16_to_f32(bh);
        if (f16_f32_bits(bf) != (uint32_t)h << 16)
            bad_bf16++;
        if (!isnan(bf) && f32_to_bf16(bf) != bh)
            bad_bf16++;
        if (isnan(bf) && !isnan(bf16_to_f32(f32_to_bf16(bf))))
            bad_bf16++;
        /* bf16 midpoints (low half exactly 0x8000) round to the even neighbour; one bit above
         * rounds away from zero, one below towards it. */
        if ((h & 0x7fff) < 0x7f7f) {
            uint16_t even = (h & 1) ? (uint16_t)(h + 1) : bh;
            uint32_t mid = ((uint32_t)h << 16) | 0x8000u;
            if (f32_to_bf16(f16_f32_from_bits(mid)) != even ||
                f32_to_bf16(f16_f32_from_bits(mid + 1)) != h + 1 ||
                f32_to_bf16(f16_f32_from_bits(mid - 1)) != h)
                bad_bf16++;
        }
    }
    CHECK(f32_to_f16(65520.0f) == 0x7c00 && f32_to_f16_portable(65520.0f) == 0x7c00, "65520");
    CHECK(f32_to_f16(nextafterf(65520.0f, 0)) == 0x7bff, "just below 65520");
    CHECK(f32_to_f16(-1e10f) == 0xfc00 && f32_to_f16_portable(-1e10f) == 0xfc00, "-1e10");
    CHECK(f32_to_f16_portable(ldexpf(1, -25)) == 0 && f32_to_f16(ldexpf(1, -25)) == 0, "2^-25");
    CHECK(f32_to_f16_portable(nextafterf(ldexpf(1, -25), 1)) == 1, "just above 2^-25");
    CHECK(f32_to_f16_portable(-0.0f) == 0x8000 && f32_to_f16(-0.0f) == 0x8000, "-0");
    CHECK(f32_to_bf16(f16_f32_from_bits(0x7f7fffffu)) == 0x7f80, "bf16 max float rounds to inf");
    CHECK(isnan(bf16_to_f32(f32_to_bf16(f16_f32_from_bits(0x7f800001u)))), "bf16 sNaN stays NaN");

    /* Random f32 bit patterns: fast == portable, and both are correctly rounded. */
    for (int i = 0; i < 400000; i++) {
        uint32_t u = (uint32_t)rng_next();
        if (i % 2) /* half the samples in the f16 range */
            u = (u & 0x80ffffffu) | ((uint32_t)(100 + rng_next() % 45) << 23);
        float x = f16_f32_from_bits(u);
        uint16_t a = f32_to_f16(x), p = f32_to_f16_portable(x), bb = f32_to_bf16(x);
        if (isnan(x)) {
            if (!isnan(half_ref(a)) || !isnan(half_ref(p)) || !isnan(bf16_to_f32(bb)))
                bad_random++;
            continue;
        }
        if (a != p || !is_rne_f16(x, p))
            bad_random++;
        if (!is_rne_bf16(x, bb))
            bad_bf16++;
    }
    CHECK(bad_decode == 0, "%d f16 decodes differ from the reference", bad_decode);
    CHECK(bad_roundtrip == 0, "%d f16 round trips failed", bad_roundtrip);
    CHECK(bad_mid == 0, "%d f16 midpoints misrounded", bad_mid);
    CHECK(bad_random == 0, "%d random f32 -> f16 conversions wrong", bad_random);
    CHECK(bad_bf16 == 0, "%d bf16 conversions wrong", bad_bf16);
    printf("f16/bf16: all 65536 patterns of each decoded, round-tripped and midpoint-checked; 400000 "
           "random f32 narrowed (%s); errors %d/%d/%d/%d/%d\n",
#if defined(__F16C__)
           "F16C vs portable",
#else
           "portable",
#endif
           bad_decode, bad_roundtrip, bad_mid, bad_random, bad_bf16);
}

static void test_dequant_api(void)
{
    uint8_t block[34] = {0};
    float out[64];
    for (int i = 0; i < 64; i++)
        out[i] = 42.0f;
    CHECK(dequant_row(16, block, out, 32) == DEQUANT_ETYPE && out[0] == 42.0f, "IQ2_XXS rejected");
    CHECK(dequant_row(12, block, out, 32) == DEQUANT_ELENGTH && out[0] == 42.0f,
          "Q4_K length 32 rejected");
    CHECK(dequant_row(4, block, out, 32) == DEQUANT_ETYPE, "type 4 rejected");
    CHECK(dequant_row(GGML_TYPE_Q8_0, block, out, 33) == DEQUANT_ELENGTH && out[0] == 42.0f,
          "Q8_0 length 33 rejected");
    CHECK(dequant_row(GGML_TYPE_Q4_1, block, out, 16) == DEQUANT_ELENGTH, "Q4_1 length 16");
    CHECK(dequant_row(GGML_TYPE_Q8_0, block, out, 0) == DEQUANT_OK && out[0] == 42.0f, "n = 0");
    /* An F16 row whose length is not a multiple of 8 exercises the vector tail. */
    uint16_t h[13];
    for (int i = 0; i < 13; i++)
        h[i] = (uint16_t)(0x3c00 + 37 * i);
    CHECK(dequant_row(GGML_TYPE_F16, h, out, 13) == DEQUANT_OK, "f16 row");
    int bad = 0;
    for (int i = 0; i < 13; i++)
        bad += !same_f32(out[i], (float)half_ref(h[i]));
    CHECK(bad == 0, "%d f16 row elements wrong", bad);
    /* Unaligned source: blocks start at odd addresses inside a file. */
    uint8_t raw[1 + 2 * 34];
    for (size_t i = 0; i < sizeof raw; i++)
        raw[i] = (uint8_t)(i * 13 + 1);
    raw[1] = 0x00;
    raw[2] = 0x3c; /* d = 1 */
    raw[35] = 0x00;
    raw[36] = 0xc0; /* d = -2 */
    CHECK(dequant_row(GGML_TYPE_Q8_0, raw + 1, out, 64) == DEQUANT_OK, "unaligned Q8_0");
    bad = 0;
    for (int j = 0; j < 32; j++) {
        bad += out[j] != (float)(int8_t)raw[3 + j];
        bad += out[32 + j] != -2.0f * (float)(int8_t)raw[37 + j];
    }
    CHECK(bad == 0, "%d unaligned Q8_0 elements wrong", bad);
}

/* ---- the default model --------------------------------------------------------------------- */

static void test_default_model(void)
{
    const char *path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (access(path, R_OK) != 0) {
        printf("default model: %s not present, model checks not run\n", path);
        return;
    }
    struct GgufFile *g = NULL;
    char err[512];
    double t0 = now_s();
    int rc = gguf_open(path, &g, err, sizeof err);
    double dt = now_s() - t0;
    CHECK(rc == GGUF_OK, "open default model: %s", err);
    if (!g)
        return;
    struct GgufString s = {0};
    uint32_t u = 0;
    float f = 0;
    CHECK(gguf_n_tensors(g) == 272, "272 tensors, got %" PRIu64, gguf_n_tensors(g));
    CHECK(gguf_get_str(g, "general.architecture", &s) == GGUF_OK && gguf_str_eq(s, "llama"),
          "architecture");
    CHECK(gguf_get_u32(g, "llama.block_count", &u) == GGUF_OK && u == 30, "block_count %u", u);
    CHECK(gguf_get_u32(g, "llama.embedding_length", &u) == GGUF_OK && u == 576, "d %u", u);
    CHECK(gguf_get_f32(g, "llama.rope.freq_base", &f) == GGUF_OK && f == 100000.0f, "rope %g", f);
    enum GgufValueType et;
    uint64_t n = 0;
    CHECK(gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &n) == GGUF_OK &&
          et == GGUF_TYPE_STRING && n == 49152, "tokens %" PRIu64, n);
    CHECK(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 0, &s) == GGUF_OK &&
          gguf_str_eq(s, "<|endoftext|>"), "token 0");
    CHECK(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 2, &s) == GGUF_OK &&
          gguf_str_eq(s, "<|im_end|>"), "token 2");
    CHECK(gguf_get_arr_info(g, "tokenizer.ggml.merges", &et, &n) == GGUF_OK && n == 48900,
          "merges %" PRIu64, n);

    int counts[31] = {0};
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct GgufTensor *t = gguf_tensor_at(g, i);
        if ((uint32_t)t->type < 31)
            counts[t->type]++;
        CHECK(gguf_find_tensor(g, t->name) == t, "find %s", t->name);
    }
    CHECK(counts[GGML_TYPE_Q8_0] == 1 && counts[GGML_TYPE_Q4_1] == 210 &&
          counts[GGML_TYPE_F32] == 61, "type counts Q8_0 %d Q4_1 %d F32 %d",
          counts[GGML_TYPE_Q8_0], counts[GGML_TYPE_Q4_1], counts[GGML_TYPE_F32]);
    const struct GgufTensor *emb = gguf_find_tensor(g, "token_embd.weight");
    const struct GgufTensor *down = gguf_find_tensor(g, "blk.0.ffn_down.weight");
    const struct GgufTensor *norm = gguf_find_tensor(g, "blk.0.attn_norm.weight");
    CHECK(emb && emb->type == GGML_TYPE_Q8_0 && emb->n_dims == 2 && emb->ne[0] == 576 &&
          emb->ne[1] == 49152, "token_embd layout");
    CHECK(down && down->type == GGML_TYPE_Q4_1 && down->ne[0] == 1536 && down->ne[1] == 576,
          "ffn_down layout");
    CHECK(norm && norm->type == GGML_TYPE_F32 && norm->ne[0] == 576, "attn_norm layout");
    if (emb) {
        float *row = malloc(576 * sizeof *row);
        if (!row)
            exit(2);
        const uint8_t *base = emb->data;
        int nonfinite = 0;
        double sumsq = 0;
        for (uint64_t r = 0; r < emb->ne[1]; r += 997) {
            CHECK(dequant_row(emb->type, base + r * (576 / 32 * 34), row, 576) == DEQUANT_OK,
                  "embd row");
            for (int i = 0; i < 576; i++) {
                nonfinite += !isfinite(row[i]);
                sumsq += (double)row[i] * row[i];
            }
        }
        CHECK(nonfinite == 0 && sumsq > 0, "embedding rows finite and non-zero");
        free(row);
    }
    /* Every tensor decodes, to finite values; the rate is what model loading will see. */
    float *buf = malloc((size_t)576 * 49152 * sizeof *buf);
    if (!buf)
        exit(2);
    uint64_t total = 0, nonfinite = 0;
    double t1 = now_s();
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct GgufTensor *t = gguf_tensor_at(g, i);
        if (t->n_elements > (uint64_t)576 * 49152) {
            CHECK(0, "%s larger than the embedding", t->name);
            continue;
        }
        CHECK(dequant_row(t->type, t->data, buf, t->n_elements) == DEQUANT_OK, "%s", t->name);
        for (uint64_t k = 0; k < t->n_elements; k++)
            nonfinite += !isfinite(buf[k]);
        total += t->n_elements;
    }
    double dq = now_s() - t1;
    CHECK(nonfinite == 0, "%" PRIu64 " non-finite weights", nonfinite);
    free(buf);
    printf("default model: opened in %.2f ms, 272 tensors, types as expected; all %" PRIu64
           " weights dequantised and checked in %.2f s\n", dt * 1e3, total, dq);
    gguf_close(&g);
}

/* ---- helper modes -------------------------------------------------------------------------- */

static int dump_tensor(const char *path, const char *name, const char *out_path)
{
    struct GgufFile *g = NULL;
    char err[512];
    int rc = gguf_open(path, &g, err, sizeof err);
    if (rc) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    const struct GgufTensor *t = gguf_find_tensor(g, name);
    if (!t) {
        fprintf(stderr, "%s: no tensor '%s'\n", path, name);
        gguf_close(&g);
        return 1;
    }
    float *out = malloc(t->n_elements * sizeof *out);
    FILE *fp = NULL;
    int status = 1;
    if (!out) {
        fprintf(stderr, "out of memory\n");
        goto done;
    }
    if ((rc = dequant_row(t->type, t->data, out, t->n_elements)) != DEQUANT_OK) {
        fprintf(stderr, "%s: dequant_row failed (%d)\n", name, rc);
        goto done;
    }
    fp = fopen(out_path, "wb");
    if (!fp || fwrite(out, sizeof *out, t->n_elements, fp) != t->n_elements) {
        fprintf(stderr, "%s: cannot write\n", out_path);
        goto done;
    }
    status = 0;
done:
    if (fp && fclose(fp) != 0)
        status = 1;
    free(out);
    gguf_close(&g);
    return status;
}

static void print_hex(const char *p, uint64_t len)
{
    if (len == 0)
        fputc('-', stdout);
    for (uint64_t i = 0; i < len; i++)
        printf("%02x", (unsigned char)p[i]);
}

/* Prints one value of a numeric array element or scalar; `p` points at its little-endian bytes. */
static void print_number(enum GgufValueType t, const uint8_t *p)
{
    uint64_t u = 0;
    size_t size = t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_INT8 || t == GGUF_TYPE_BOOL ? 1
                  : t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_INT16                    ? 2
                  : t == GGUF_TYPE_UINT32 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_FLOAT32 ? 4
                                                                                      : 8;
    for (size_t i = 0; i < size; i++)
        u |= (uint64_t)p[i] << (8 * i);
    switch (t) {
    case GGUF_TYPE_INT8: printf("%d", (int8_t)u); break;
    case GGUF_TYPE_INT16: printf("%d", (int16_t)u); break;
    case GGUF_TYPE_INT32: printf("%" PRId32, (int32_t)u); break;
    case GGUF_TYPE_INT64: printf("%" PRId64, (int64_t)u); break;
    case GGUF_TYPE_FLOAT32: printf("%.9g", (double)f16_f32_from_bits((uint32_t)u)); break;
    case GGUF_TYPE_FLOAT64: {
        double d;
        memcpy(&d, &u, sizeof d);
        printf("%.17g", d);
        break;
    }
    default: printf("%" PRIu64, u); break;
    }
}

static int list_file(const char *path)
{
    struct GgufFile *g = NULL;
    char err[512];
    if (gguf_open(path, &g, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    printf("version %" PRIu32 "\n", gguf_version(g));
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        struct GgufString key;
        enum GgufValueType t;
        gguf_kv_at(g, i, &key, &t);
        char *k = strndup(key.ptr, key.len);
        if (!k)
            return 1;
        printf("kv %s %d ", k, (int)t);
        if (t == GGUF_TYPE_STRING) {
            struct GgufString s;
            gguf_get_str(g, k, &s);
            print_hex(s.ptr, s.len);
            printf("\n");
        } else if (t == GGUF_TYPE_ARRAY) {
            enum GgufValueType et;
            uint64_t n;
            gguf_get_arr_info(g, k, &et, &n);
            printf("%d %" PRIu64 "\n", (int)et, n);
            const void *data;
            if (et != GGUF_TYPE_STRING && gguf_get_arr_data(g, k, &et, &n, &data) == GGUF_OK) {
                size_t es = et == GGUF_TYPE_UINT8 || et == GGUF_TYPE_INT8 || et == GGUF_TYPE_BOOL ? 1
                            : et == GGUF_TYPE_UINT16 || et == GGUF_TYPE_INT16 ? 2
                            : et == GGUF_TYPE_UINT32 || et == GGUF_TYPE_INT32 ||
                                      et == GGUF_TYPE_FLOAT32 ? 4 : 8;
                for (uint64_t j = 0; j < n; j++) {
                    printf("e ");
                    print_number(et, (const uint8_t *)data + j * es);
                    printf("\n");
                }
            }
            for (uint64_t j = 0; et == GGUF_TYPE_STRING && j < n; j++) {
                struct GgufString s;
                gguf_get_arr_str(g, k, j, &s);
                printf("e ");
                print_hex(s.ptr, s.len);
                printf("\n");
            }
        } else {
            /* Scalars: print through the typed getters, which is what callers use. */
            if (t == GGUF_TYPE_FLOAT32 || t == GGUF_TYPE_FLOAT64) {
                float f;
                gguf_get_f32(g, k, &f);
                printf("%.9g\n", (double)f);
            } else if (t == GGUF_TYPE_BOOL) {
                int b;
                gguf_get_bool(g, k, &b);
                printf("%d\n", b);
            } else {
                int64_t v;
                if (gguf_get_i64(g, k, &v) == GGUF_OK)
                    printf("%" PRId64 "\n", v);
                else
                    printf("?\n"); /* a u64 above INT64_MAX */
            }
        }
        free(k);
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct GgufTensor *t = gguf_tensor_at(g, i);
        printf("tensor %s %d %" PRIu32, t->name, (int)t->type, t->n_dims);
        for (int d = 0; d < 4; d++)
            printf(" %" PRIu64, t->ne[d]);
        printf(" %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", t->offset, t->n_elements, t->n_bytes);
    }
    gguf_close(&g);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--dump") == 0)
        return dump_tensor(argv[2], argv[3], argv[4]);
    if (argc == 3 && strcmp(argv[1], "--list") == 0)
        return list_file(argv[2]);
    if (argc != 1) {
        fprintf(stderr, "usage: %s [--dump FILE TENSOR OUT.bin | --list FILE]\n", argv[0]);
        return 2;
    }
    test_valid_images();
    test_malformed();
    test_f16();
    test_dequant_api();
    test_default_model();
    return check_report("test_gguf");
}
