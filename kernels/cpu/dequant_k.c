/* Portable decoding of the K-quants (Q2_K .. Q6_K, 256-element super-blocks) to f32, the
 * reference every vector path is checked against. Each value is computed with ggml's
 * operations in ggml's order (dequantize_row_q*_K): the sub-block factor d * sc is rounded to
 * f32 first, then multiplied by the quant, then the min term subtracted, with no fused
 * multiply-add (the build's -std=c11 keeps the compiler from contracting). */
#include "kernels/cpu/kquant.h"
#include "kernels/dequant.h"

static void dequant_q2_k(const uint8_t *src, float *dst, size_t nb)
{
    for (size_t b = 0; b < nb; b++, src += 84) {
        const uint8_t *scales = src, *q = src + 16;
        float d = kquant_half(src + 80), dmin = kquant_half(src + 82);
        int s = 0;
        for (int h = 0; h < 2; h++, q += 32)
            for (int shift = 0; shift < 8; shift += 2)
                for (int half = 0; half < 2; half++, s++) {
                    float dl = d * (float)(scales[s] & 0x0f);
                    float ml = dmin * (float)(scales[s] >> 4);
                    const uint8_t *qq = q + 16 * half;
                    for (int l = 0; l < 16; l++) {
                        float v = dl * (float)((qq[l] >> shift) & 3);
                        *dst++ = v - ml;
                    }
                }
    }
}

static void dequant_q3_k(const uint8_t *src, float *dst, size_t nb)
{
    for (size_t b = 0; b < nb; b++, src += 110) {
        const uint8_t *hm = src, *q = src + 32;
        int8_t sc[16];
        kquant_q3_scales(src + 96, sc);
        float d = kquant_half(src + 108);
        int s = 0;
        uint8_t m = 1;
        for (int h = 0; h < 2; h++, q += 32)
            for (int shift = 0; shift < 8; shift += 2, m = (uint8_t)(m << 1))
                for (int half = 0; half < 2; half++, s++) {
                    float dl = d * (float)sc[s];
                    const uint8_t *qq = q + 16 * half, *hh = hm + 16 * half;
                    for (int l = 0; l < 16; l++) {
                        int v = ((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4);
                        *dst++ = dl * (float)v;
                    }
                }
    }
}

/* Q4_K and Q5_K: 8 sub-blocks of 32; qh is NULL for Q4_K. */
static void dequant_q45_k(const uint8_t *src, float *dst, size_t nb, int five)
{
    size_t bb = five ? 176 : 144;
    for (size_t b = 0; b < nb; b++, src += bb) {
        float d = kquant_half(src), dmin = kquant_half(src + 2);
        const uint8_t *scales = src + 4, *qh = five ? src + 16 : NULL;
        const uint8_t *q = src + (five ? 48 : 16);
        for (int s = 0; s < 8; s += 2, q += 32) {
            uint8_t sc, mn;
            kquant_scale_min(s, scales, &sc, &mn);
            float d1 = d * (float)sc, m1 = dmin * (float)mn;
            kquant_scale_min(s + 1, scales, &sc, &mn);
            float d2 = d * (float)sc, m2 = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                int v = q[l] & 0x0f;
                if (qh) v += (qh[l] >> s) & 1 ? 16 : 0;
                float t = d1 * (float)v;
                *dst++ = t - m1;
            }
            for (int l = 0; l < 32; l++) {
                int v = q[l] >> 4;
                if (qh) v += (qh[l] >> (s + 1)) & 1 ? 16 : 0;
                float t = d2 * (float)v;
                *dst++ = t - m2;
            }
        }
    }
}


static void dequant_q6_k(const uint8_t *src, float *dst, size_t nb)
{
    for (size_t b = 0; b < nb; b++, src += 210) {
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t *sc = (const int8_t *)(const void *)(src + 192);
        float d = kquant_half(src + 208);
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, dst += 128)
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0x0f) | ((qh[l] >> 0) & 3) << 4) - 32;
                int q2 = ((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4) - 32;
                int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                float s1 = d * (float)sc[is], s2 = d * (float)sc[is + 2];
                float s3 = d * (float)sc[is + 4], s4 = d * (float)sc[is + 6];
                dst[l] = s1 * (float)q1;
                dst[l + 32] = s2 * (float)q2;
                dst[l + 64] = s3 * (float)q3;
                dst[l + 96] = s4 * (float)q4;
            }
    }
}

void kquant_decode(uint32_t type, const uint8_t *src, float *dst, size_t nb)
{
    switch (type) {
    case DQ_Q2_K: dequant_q2_k(src, dst, nb); break;
    case DQ_Q3_K: dequant_q3_k(src, dst, nb); break;
    case DQ_Q4_K: dequant_q45_k(src, dst, nb, 0); break;
    case DQ_Q5_K: dequant_q45_k(src, dst, nb, 1); break;
    default: dequant_q6_k(src, dst, nb); break;
    }
}
