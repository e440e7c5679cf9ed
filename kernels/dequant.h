/* Dequantisation of ggml tensor rows to f32 (CPU).
 *
 * Block layouts (little-endian, as ggml's ggml-common.h; d and m are IEEE half):
 *   F32   1 elem,   4 bytes | F16 1 elem, 2 bytes | BF16 1 elem, 2 bytes
 *   Q4_0 32 elems, 18 bytes: f16 d | u8 qs[16]                 x = (nibble - 8) * d
 *   Q4_1 32 elems, 20 bytes: f16 d | f16 m | u8 qs[16]         x = nibble * d + m
 *   Q5_0 32 elems, 22 bytes: f16 d | u8 qh[4] | u8 qs[16]      x = ((nibble | hbit << 4) - 16) * d
 *   Q5_1 32 elems, 24 bytes: f16 d | f16 m | u8 qh[4] | u8 qs[16]  x = (nibble | hbit << 4) * d + m
 *   Q8_0 32 elems, 34 bytes: f16 d | i8 qs[32]                 x = q * d
 * In the 4/5-bit formats element j < 16 takes the low nibble of qs[j] and element j + 16 its
 * high nibble; the fifth bit of element j is bit j of the little-endian u32 qh.
 * Type numbers are ggml's (enum GgmlType in model/gguf.h; repeated here because kernels/ does
 * not include model/). */
#ifndef DIFFRAG_DEQUANT_H
#define DIFFRAG_DEQUANT_H

#include <stddef.h>
#include <stdint.h>

enum DequantType {
    DQ_F32 = 0, DQ_F16 = 1, DQ_Q4_0 = 2, DQ_Q4_1 = 3, DQ_Q5_0 = 6, DQ_Q5_1 = 7, DQ_Q8_0 = 8,
    DQ_BF16 = 30,
};

enum DequantStatus {
    DEQUANT_OK = 0,
    DEQUANT_ETYPE = -1,   /* ggml type not handled by this kernel */
    DEQUANT_ELENGTH = -2, /* n_elems is not a multiple of the type's block size */
};

/* Decode `n_elems` consecutive elements of type `ggml_type` from `src` (any alignment; it must
 * hold n_elems / block_elems whole blocks) into `dst` (n_elems floats). Blocks are independent,
 * so a row, a tensor or any block-aligned slice can be decoded. Returns DEQUANT_OK,
 * DEQUANT_ETYPE or DEQUANT_ELENGTH; on error `dst` is untouched. */
int dequant_row(uint32_t ggml_type, const void *src, float *dst, size_t n_elems);

/* Elements and bytes per block of `ggml_type` (1 and the element size for F32/F16/BF16);
 * 0 for a type dequant_row does not handle. */
int dequant_block_elems(uint32_t ggml_type);
int dequant_block_bytes(uint32_t ggml_type);

#endif
