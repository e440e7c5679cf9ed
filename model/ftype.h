/* The quantisation of a GGUF model file by name, as model files are named ("Q4_K_M", "Q8_0",
 * "F16"): general.file_type, numbered as llama.cpp's llama_ftype, or for a file without that
 * key the tensor type that holds most of its weights. */
#ifndef DIFFRAG_FTYPE_H
#define DIFFRAG_FTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"

/* The name of a general.file_type value (the "guessed" flag, 1024, ignored); NULL for a value
 * this table does not know. The string is a constant. */
const char *ftype_name(uint32_t file_type);

/* The quantisation of g into out (NUL-terminated, cut to cap): ftype_name of its
 * general.file_type, "unknown" for a value without a name; without the key (or with one that
 * is not an integer), the ggml type name of the most elements among its tensors of two or
 * more dimensions ("F32" for a file of f32 weights), "unknown" when it has none. */
void ftype_describe(const struct GgufFile *g, char *out, size_t cap);

#endif
