/* general.file_type by name (ftype.h): llama.cpp's llama_ftype values as the files that carry
 * them are named, and, for files without the key, the type of most of the weights. */
#include "model/ftype.h"

#include <stdio.h>

#define FTYPE_GUESSED 1024u   /* llama.cpp's flag: the type was guessed when the file was made */

static const char *const ftype_names[] = {
    [0] = "F32", [1] = "F16", [2] = "Q4_0", [3] = "Q4_1", [7] = "Q8_0", [8] = "Q5_0",
    [9] = "Q5_1", [10] = "Q2_K", [11] = "Q3_K_S", [12] = "Q3_K_M", [13] = "Q3_K_L",
    [14] = "Q4_K_S", [15] = "Q4_K_M", [16] = "Q5_K_S", [17] = "Q5_K_M", [18] = "Q6_K",
    [19] = "IQ2_XXS", [20] = "IQ2_XS", [21] = "Q2_K_S", [22] = "IQ3_XS", [23] = "IQ3_XXS",
    [24] = "IQ1_S", [25] = "IQ4_NL", [26] = "IQ3_S", [27] = "IQ3_M", [28] = "IQ2_S",
    [29] = "IQ2_M", [30] = "IQ4_XS", [31] = "IQ1_M", [32] = "BF16", [36] = "TQ1_0",
    [37] = "TQ2_0", [38] = "MXFP4_MOE",
};

const char *ftype_name(uint32_t file_type)
{
    file_type &= ~FTYPE_GUESSED;
    if (file_type < sizeof ftype_names / sizeof ftype_names[0])
        return ftype_names[file_type];
    return NULL;
}

/* The ggml type of the most elements among g's matrices (norms and biases, one-dimensional,
 * stay f32 in every quantisation); -1 when g has none. */
static long dominant_type(const struct GgufFile *g)
{
    enum { N_TYPES = 64 };
    uint64_t elems[N_TYPES] = { 0 };
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct GgufTensor *t = gguf_tensor_at(g, i);
        if (t && t->n_dims >= 2 && (uint32_t)t->type < N_TYPES)
            elems[t->type] += t->n_elements;
    }
    long best = -1;
    for (long k = 0; k < N_TYPES; k++)
        if (elems[k] && (best < 0 || elems[k] > elems[best]))
            best = k;
    return best;
}

void ftype_describe(const struct GgufFile *g, char *out, size_t cap)
{
    uint32_t ft;
    const char *name = NULL;
    if (gguf_get_u32(g, "general.file_type", &ft) == GGUF_OK) {
        name = ftype_name(ft);
    } else {
        long t = dominant_type(g);
        if (t >= 0)
            name = ggml_type_name((uint32_t)t);
    }
    snprintf(out, cap, "%s", name ? name : "unknown");
}
