/* libFuzzer target: the GGUF reader over arbitrary bytes, then every getter on what it
 * accepted (keys, arrays, tensors). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "model/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    struct GgufFile *g = NULL;
    if (gguf_open_buffer(data, size, "fuzz.gguf", &g, err, sizeof err) != GGUF_OK) return 0;
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        struct GgufString key;
        enum GgufValueType t;
        if (gguf_kv_at(g, i, &key, &t) != GGUF_OK) continue;
        char k[128];
        snprintf(k, sizeof k, "%.*s", (int)(key.len < 120 ? key.len : 120), key.ptr);
        uint32_t u;
        int64_t l;
        float f;
        int b;
        struct GgufString s;
        enum GgufValueType et;
        uint64_t n;
        const void *p;
        gguf_get_u32(g, k, &u);
        gguf_get_i64(g, k, &l);
        gguf_get_f32(g, k, &f);
        gguf_get_bool(g, k, &b);
        gguf_get_str(g, k, &s);
        if (gguf_get_arr_info(g, k, &et, &n) == GGUF_OK) {
            gguf_get_arr_data(g, k, &et, &n, &p);
            for (uint64_t j = 0; j < n && j < 64; j++) gguf_get_arr_str(g, k, j, &s);
            gguf_get_arr_str(g, k, n, &s);
        }
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct GgufTensor *t = gguf_tensor_at(g, i);
        if (t && gguf_find_tensor(g, t->name) == NULL) __builtin_trap();
    }
    gguf_close(&g);
    return 0;
}
