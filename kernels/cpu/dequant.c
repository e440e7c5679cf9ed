/* CPU dequantisation of ggml rows (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the
 * K-quants through dequant_k.c) to f32.
 * Blocks are read with memcpy because quantised blocks (18, 20, 22, 34 bytes) leave the scales
 * unaligned. Affine types compute d*q and then add m as separate statements, so no compiler
 * fuses them into an FMA and the result matches the reference decoder bit for bit. */
#include "kernels/dequant.h"

#include <string.h>

#include "kernels/cpu/kquant.h"
#include "kernels/f16.h"

#define QK 32 /* elements per block of every quantised type here */

static uint16_t load_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t load_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void dequant_f16(const uint8_t *src, float *dst, size_t n)
{
    size_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; i++)
        dst[i] = f16_to_f32(load_u16(src + 2 * i));
}

static void dequant_bf16(const uint8_t *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = bf16_to_f32(load_u16(src + 2 * i));
}

static void dequant_q4_0(const uint8_t *src, float *dst, size_t nb)
{
    for (size_t b = 0; b < nb; b++, src += 18, dst += QK) {
        float d = f16_to_f32(load_u16(src));
        const uint8_t *qs = src + 2;
        for (int j = 0; j < QK / 2; j++) {
            dst[j] = (float)((qs[j] & 0x0f) - 8) * d;
            dst[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
        }
    }
}

static void dequant_q4_1(const uint8_t *src, float *dst, size_t nb)
{
    for (size_t b = 0; b < nb; b++, src += 20, dst += QK) {
        float d = f16_to_f32(load_u16(src));
        float m = f16_to_f32(load_u16(src + 2));
        const uint8_t *qs = src + 4;
        for (int j = 0; j < QK / 2; j++) {
            float lo = (float)(qs[j] & 0x0f) * d;
            float hi = (float)(qs[j] >> 4) * d;
            dst[j] = lo + m;
            dst[j + QK / 2] = hi + m;
        }
    }
}

static void dequant_q5_0(const uint8_t *src, float *dst, size_t nb)
{
    for (size_t b = 0; b < nb; b++, src += 22, dst += QK) {
        float d = f16_to_f32(load_u16(src));
        uint32_t qh = load_u32(src + 2);
        const uint8_t *qs = src + 6;
        for (int j = 0; j < QK / 2; j++) {
            int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
            int hi = (qs[j] >> 4) | (int)(((qh >> (j + QK / 2)) & 1u) << 4);
            dst[j] = (float)(lo - 16) * d;
            dst[j + QK / 2] = (float)(hi - 16) * d;
        }
    }
}

static void dequant_q5_1(const uint8_t *src, float *dst, size_t nb)
{
    for (size_t b = 0; b < nb; b++, src += 24, dst += QK) {
        float d = f16_to_f32(load_u16(src));
        float m = f16_to_f32(load_u16(src + 2));
        uint32_t qh = load_u32(src + 4);
        const uint8_t *qs = src + 8;
        for (int j = 0; j < QK / 2; j++) {
            int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
            int hi = (qs[j] >> 4) | (int)(((qh >> (j + QK / 2)) & 1u) << 4);
            float dlo = (float)lo * d;
            float dhi = (float)hi * d;
            dst[j] = dlo + m;
            dst[j + QK / 2] = dhi + m;
        }
    }
}

static void dequant_q8_0(const uint8_t *src, float *dst, size_t nb)
{
    for (size_t b = 0; b < nb; b++, src += 34, dst += QK) {
        float d = f16_to_f32(load_u16(src));
        const int8_t *qs = (const int8_t *)(const void *)(src + 2);
        for (int j = 0; j < QK; j++)
            dst[j] = (float)qs[j] * d;
    }
}

int dequant_block_elems(uint32_t ggml_type)
{
    switch (ggml_type) {
    case DQ_F32: case DQ_F16: case DQ_BF16: return 1;
    case DQ_Q4_0: case DQ_Q4_1: case DQ_Q5_0: case DQ_Q5_1: case DQ_Q8_0: return QK;
    case DQ_Q2_K: case DQ_Q3_K: case DQ_Q4_K: case DQ_Q5_K: case DQ_Q6_K: return QK_K;
    default: return 0;
    }
}

int dequant_block_bytes(uint32_t ggml_type)
{
    switch (ggml_type) {
    case DQ_F32: return 4;
    case DQ_F16: case DQ_BF16: return 2;
    case DQ_Q4_0: return 18;
    case DQ_Q4_1: return 20;
    case DQ_Q5_0: return 22;
    case DQ_Q5_1: return 24;
    case DQ_Q8_0: return 34;
    case DQ_Q2_K: return 84;
    case DQ_Q3_K: return 110;
    case DQ_Q4_K: return 144;
    case DQ_Q5_K: return 176;
    case DQ_Q6_K: return 210;
    default: return 0;
    }
}

int dequant_row(uint32_t ggml_type, const void *src, float *dst, size_t n_elems)
{
    const uint8_t *s = src;
    switch (ggml_type) {
    case 0: /* F32 */
        memcpy(dst, s, n_elems * sizeof(float));
        return DEQUANT_OK;
    case 1: /* F16 */
        dequant_f16(s, dst, n_elems);
        return DEQUANT_OK;
    case 30: /* BF16 */
        dequant_bf16(s, dst, n_elems);
        return DEQUANT_OK;
    case 2: case 3: case 6: case 7: case 8:
        break;
    case DQ_Q2_K: case DQ_Q3_K: case DQ_Q4_K: case DQ_Q5_K: case DQ_Q6_K:
        if (n_elems % QK_K != 0)
            return DEQUANT_ELENGTH;
        kquant_decode(ggml_type, s, dst, n_elems / QK_K);
        return DEQUANT_OK;
    default:
        return DEQUANT_ETYPE;
    }
    if (n_elems % QK != 0)
        return DEQUANT_ELENGTH;
    size_t nb = n_elems / QK;
    switch (ggml_type) {
    case 2: dequant_q4_0(s, dst, nb); break;
    case 3: dequant_q4_1(s, dst, nb); break;
    case 6: dequant_q5_0(s, dst, nb); break;
    case 7: dequant_q5_1(s, dst, nb); break;
    default: dequant_q8_0(s, dst, nb); break;
    }
    return DEQUANT_OK;
}
