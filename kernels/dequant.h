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
 *
 * K-quants: super-blocks of 256 elements in sub-blocks of 16 or 32 with small integer scales
 * (and mins) relative to the f16 super-block scale d (and dmin). Decoding follows ggml's
 * dequantize_row_q*_K operation for operation (each product and difference rounded to f32 in
 * ggml's order), so values match ggml's bit for bit.
 *   Q2_K 256 elems,  84 bytes: u8 scales[16] | u8 qs[64] | f16 d | f16 dmin
 *        16 sub-blocks of 16; scales[s] = scale (low nibble), min (high nibble);
 *        x = (d * sc) * q - (dmin * mn), q = 2 bits
 *   Q3_K 256 elems, 110 bytes: u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d
 *        16 sub-blocks of 16 with 6-bit scales: scale s = (s < 8 ? scales[s] & 15 :
 *        scales[s - 8] >> 4) | ((scales[8 + s % 4] >> 2 * (s / 4)) & 3) << 4;
 *        x = (d * (scale - 32)) * (q - (hbit ? 0 : 4)), q = 2 low bits
 *   Q4_K 256 elems, 144 bytes: f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
 *        8 sub-blocks of 32 with 6-bit scale and min: for s < 4 sc = scales[s] & 63,
 *        mn = scales[s + 4] & 63; else sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4,
 *        mn = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4; x = (d * sc) * q - (dmin * mn)
 *   Q5_K 256 elems, 176 bytes: f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
 *        as Q4_K with a fifth bit: element 32s + l has bit s of qh[l]
 *   Q6_K 256 elems, 210 bytes: u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
 *        16 sub-blocks of 16; x = (d * scale) * (q - 32), q = 4 low bits | 2 high bits << 4
 * In the 16-element sub-block formats element e uses scales[e / 16] (Q3_K: scale e / 16).
 * Where the 2/4-bit quants sit: in each half of 128 elements (Q2_K, Q3_K: 32 bytes of qs;
 * Q6_K: 64 bytes of ql and 32 of qh) element 32i + l (i < 4, l < 32) takes bits 2i..2i+1 of
 * qs[l] (Q2_K, Q3_K; hmask bit 4h + i of hmask[l] for half h), and for Q6_K the low nibble
 * of ql[l] (i = 0), of ql[32 + l] (i = 1), the high nibbles of those (i = 2, 3) with bits
 * 2i..2i+1 of qh[l]. Q4_K/Q5_K: each 64 elements take 32 bytes of qs, low nibbles first.
 * Type numbers are ggml's (enum GgmlType in model/gguf.h; repeated here because kernels/ does
 * not include model/). */
#ifndef DIFFRAG_DEQUANT_H
#define DIFFRAG_DEQUANT_H

#include <stddef.h>
#include <stdint.h>

enum DequantType {
    DQ_F32 = 0, DQ_F16 = 1, DQ_Q4_0 = 2, DQ_Q4_1 = 3, DQ_Q5_0 = 6, DQ_Q5_1 = 7, DQ_Q8_0 = 8,
    DQ_Q2_K = 10, DQ_Q3_K = 11, DQ_Q4_K = 12, DQ_Q5_K = 13, DQ_Q6_K = 14, DQ_BF16 = 30,
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
