/* The int8 prefill products, portably: which weight types take part and how their blocks
 * split into unsigned quants, a factor and an offset; the rounding of input rows to 8 bits
 * (GGML's quantize_row_q8_0 as its x86 build computes it, and quantize_row_q8_K); the int8
 * panel; and the product itself, in the same order of f32 operations as the AVX-512 path so
 * the two can be compared exactly. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/kquant.h"
#include "kernels/dequant.h"
#include "kernels/f16.h"

int cpu_q8_type(uint32_t type, struct Q8Type *t)
{
    struct Q8Type v;
    switch (type) {
    case DQ_Q4_0: v = (struct Q8Type){Q8_ACT_32, 32, 3, 15}; break;
    case DQ_Q4_1: v = (struct Q8Type){Q8_ACT_32, 32, -1, 15}; break;
    case DQ_Q5_0: v = (struct Q8Type){Q8_ACT_32, 32, 4, 31}; break;
    case DQ_Q5_1: v = (struct Q8Type){Q8_ACT_32, 32, -1, 31}; break;
    case DQ_Q8_0: v = (struct Q8Type){Q8_ACT_32, 32, 7, 255}; break;
    case DQ_Q2_K: v = (struct Q8Type){Q8_ACT_K, 16, -1, 3}; break;
    case DQ_Q3_K: v = (struct Q8Type){Q8_ACT_K, 16, 2, 7}; break;
    case DQ_Q4_K: v = (struct Q8Type){Q8_ACT_K, 32, -1, 15}; break;
    case DQ_Q5_K: v = (struct Q8Type){Q8_ACT_K, 32, -1, 31}; break;
    case DQ_Q6_K: v = (struct Q8Type){Q8_ACT_K, 16, 5, 63}; break;
    default: return 0;
    }
    if (t) *t = v;
    return 1;
}

/* The scale, minus the sum and the scaled sum of each sub-block of row i inside the rounding
 * block that starts at element c0 (`block` elements, scale d). */
static void block_sums(const struct Q8Rows *r, int i, int c0, int block, float d)
{
    const int8_t *q = r->q + (size_t)i * r->q_stride;
    for (int s = c0 / r->g; s < (c0 + block) / r->g; s++) {
        int32_t sum = 0;
        for (int c = 0; c < r->g; c++) sum += q[s * r->g + c];
        r->d[(size_t)i * r->s_stride + s] = d;
        r->nx[(size_t)i * r->s_stride + s] = -sum;
        r->dx[(size_t)i * r->s_stride + s] = d * (float)sum;
    }
}

void cpu_q8_quantize_row(enum Q8Act act, const float *x, int k, const struct Q8Rows *r, int i)
{
    int8_t *q = r->q + (size_t)i * r->q_stride;
    int block = act == Q8_ACT_32 ? 32 : QK_K;
    for (int c0 = 0; c0 < k; c0 += block) {
        const float *xb = x + c0;
        int8_t *qb = q + c0;
        float amax = 0.f, max = 0.f, d;
        for (int c = 0; c < block; c++) {
            float ax = fabsf(xb[c]);
            if (ax > amax) { amax = ax; max = xb[c]; }
        }
        if (act == Q8_ACT_32) {
            /* x86 GGML: the scale is kept as f16, the rounding uses 127 / amax. */
            d = f16_to_f32(f32_to_f16(amax / 127.f));
            float id = amax != 0.f ? 127.f / amax : 0.f;
            for (int c = 0; c < block; c++) qb[c] = (int8_t)nearbyintf(xb[c] * id);
        } else if (amax == 0.f) {
            d = 0.f;
            memset(qb, 0, (size_t)block);
        } else {
            float iscale = -127.f / max;
            for (int c = 0; c < block; c++) {
                float v = nearbyintf(iscale * xb[c]);
                qb[c] = (int8_t)(v > 127.f ? 127.f : v);
            }
            d = 1.f / iscale;
        }
        block_sums(r, i, c0, block, d);
    }
}

/* Row rr of w as unsigned quants u[k] with a factor and offset per sub-block of t.g, in the
 * order of the elements (rows past w's give zeros). */
void cpu_q8_decode_row(const struct Weights *w, int rr, uint8_t *u, float *a, float *off)
{
    struct Q8Type tt = {Q8_ACT_32, 32, -1, 0};
    cpu_q8_type(w->type, &tt);
    const struct Q8Type *t = &tt;
    int k = w->cols, ns = k / t->g;
    if (rr >= w->rows) {
        memset(u, 0, (size_t)k);
        for (int s = 0; s < ns; s++) a[s] = off[s] = 0.f;
        return;
    }
    if (w->layout == WEIGHTS_X16) {
        int j = rr % 16, hdr = cpu_x16_header(w->type);
        for (int b = 0; b < k / 32; b++) {
            const uint8_t *tile = cpu_x16_tile(w, rr / 16, b), *q = tile + hdr;
            float d = kquant_half(tile + 2 * j);
            uint8_t *ub = u + 32 * b;
            for (int c = 0; c < 32; c++) {
                if (w->type == DQ_Q8_0) {
                    ub[c] = (uint8_t)(q[16 * c + j] ^ 0x80);
                    continue;
                }
                int v = c < 16 ? q[16 * c + j] & 0x0f : q[16 * (c - 16) + j] >> 4;
                if (w->type == DQ_Q5_0 || w->type == DQ_Q5_1)
                    v |= ((q[-64 + 2 * c + j / 8] >> (j % 8)) & 1) << 4;
                ub[c] = (uint8_t)v;
            }
            a[b] = d;
            off[b] = t->shift >= 0 ? -d * (float)(1 << t->shift) : kquant_half(tile + 32 + 2 * j);
        }
        return;
    }
    const uint8_t *src = (const uint8_t *)w->data + (size_t)rr * w->row_bytes;
    for (int sb = 0; sb < k / QK_K; sb++, u += QK_K) {
        int s0 = sb * QK_K / t->g;
        switch (w->type) {
        case DQ_Q4_K:
        case DQ_Q5_K: {
            int five = w->type == DQ_Q5_K;
            const uint8_t *blk = src + (size_t)sb * (five ? 176 : 144);
            float d = kquant_half(blk), dmin = kquant_half(blk + 2);
            const uint8_t *qh = blk + 16, *q = blk + (five ? 48 : 16);
            for (int s = 0; s < 8; s++) {
                uint8_t sc, mn;
                kquant_scale_min(s, blk + 4, &sc, &mn);
                a[s0 + s] = d * (float)sc;
                off[s0 + s] = -(dmin * (float)mn);
                for (int l = 0; l < 32; l++) {
                    int v = s % 2 ? q[32 * (s / 2) + l] >> 4 : q[32 * (s / 2) + l] & 0x0f;
                    if (five) v |= ((qh[l] >> s) & 1) << 4;
                    u[32 * s + l] = (uint8_t)v;
                }
            }
            break;
        }
        case DQ_Q6_K: {
            const uint8_t *blk = src + (size_t)sb * 210, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(const void *)(blk + 192);
            float d = kquant_half(blk + 208);
            for (int s = 0; s < 16; s++) {
                a[s0 + s] = d * (float)sc[s];
                off[s0 + s] = -a[s0 + s] * 32.f;
            }
            for (int h = 0; h < 2; h++, ql += 64, qh += 32)
                for (int l = 0; l < 32; l++) {
                    uint8_t *o = u + 128 * h;
                    o[l] = (uint8_t)((ql[l] & 0x0f) | ((qh[l] >> 0) & 3) << 4);
                    o[l + 32] = (uint8_t)((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4);
                    o[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
                    o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
                }
            break;
        }
        case DQ_Q2_K: {
            const uint8_t *blk = src + (size_t)sb * 84, *q = blk + 16;
            float d = kquant_half(blk + 80), dmin = kquant_half(blk + 82);
            for (int s = 0; s < 16; s++) {
                a[s0 + s] = d * (float)(blk[s] & 0x0f);
                off[s0 + s] = -(dmin * (float)(blk[s] >> 4));
            }
            for (int e = 0; e < QK_K; e++) {
                int h = e / 128, i = e % 128 / 32, l = e % 32;
                u[e] = (uint8_t)((q[32 * h + l] >> (2 * i)) & 3);
            }
            break;
        }
        default: { /* Q3_K */
            const uint8_t *blk = src + (size_t)sb * 110, *hm = blk, *q = blk + 32;
            int8_t sc[16];
            kquant_q3_scales(blk + 96, sc);
            float d = kquant_half(blk + 108);
            for (int s = 0; s < 16; s++) {
                a[s0 + s] = d * (float)sc[s];
                off[s0 + s] = -a[s0 + s] * 4.f;
            }
            for (int e = 0; e < QK_K; e++) {
                int h = e / 128, i = e % 128 / 32, l = e % 32;
                int v = (q[32 * h + l] >> (2 * i)) & 3;
                if ((hm[l] >> (4 * h + i)) & 1) v += 4;
                u[e] = (uint8_t)v;
            }
            break;
        }
        }
    }
}

size_t cpu_q8_panel_bytes(int k, int g) { return (size_t)(k / g) * ((size_t)g * 32 + 256); }

size_t cpu_q8_panel_work(int k)
{
    size_t row = ((size_t)k + 63) / 64 * 64 + 2 * sizeof(float) * (size_t)(k / 16);
    return row > 32 * QK_K ? row : 32 * QK_K; /* the AVX-512 builder: 32 super-block rows */
}

void cpu_q8_panel(const struct Weights *w, int r0, int mb, uint8_t *panel, uint8_t *work)
{
    struct Q8Type t = {Q8_ACT_32, 32, -1, 0};
    cpu_q8_type(w->type, &t);
    int k = w->cols, ns = k / t.g;
    size_t sbs = (size_t)t.g * 32 + 256;
    uint8_t *u = work;
    float *a = (float *)(void *)(work + ((size_t)k + 63) / 64 * 64), *off = a + ns;
    for (int j = 0; j < 32; j++) {
        cpu_q8_decode_row(w, j < mb ? r0 + j : w->rows, u, a, off);
        for (int c = 0; c < k; c++) {
            int s = c / t.g, in = c % t.g;
            panel[(size_t)s * sbs + (size_t)(in / 4) * 128 + (size_t)(j / 16) * 64 +
                  4 * (j % 16) + in % 4] = u[c];
        }
        for (int s = 0; s < ns; s++) {
            float *fa = (float *)(void *)(panel + (size_t)s * sbs + (size_t)t.g * 32);
            fa[j] = a[s];
            fa[32 + j] = off[s];
        }
    }
}

void cpu_q8_gemm_block(const struct Q8Block *b)
{
    const struct Q8Rows *x = b->x;
    int g = x->g, ns = b->k / g;
    size_t sbs = (size_t)g * 32 + 256;
    for (int i = 0; i < b->n; i++) {
        size_t row = (size_t)(b->i0 + i);
        const int8_t *q = x->q + row * x->q_stride;
        for (int j = 0; j < b->m_blk; j++) {
            float acc = 0.f;
            for (int s = 0; s < ns; s++) {
                const uint8_t *ps = b->panel + (size_t)s * sbs;
                const float *fa = (const float *)(const void *)(ps + (size_t)g * 32);
                int32_t S = b->shift >= 0 ? x->nx[row * x->s_stride + s] * (1 << b->shift) : 0;
                for (int c = 0; c < g; c++)
                    S += (int32_t)ps[(c / 4) * 128 + (j / 16) * 64 + 4 * (j % 16) + c % 4] *
                         q[s * g + c];
                float ad = fa[j] * x->d[row * x->s_stride + s];
                acc = fmaf((float)S, ad, acc);
                if (b->shift < 0) acc = fmaf(fa[32 + j], x->dx[row * x->s_stride + s], acc);
            }
            float *dst = b->y + (size_t)i * b->y_stride + j;
            *dst = b->accumulate ? acc + *dst : acc;
        }
    }
}
