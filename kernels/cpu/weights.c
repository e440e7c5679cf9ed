/* Weight matrices as the CPU backend keeps them: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 interleaved
 * by groups of 16 rows (layout in kernels/backend.h) so that the products read 16 outputs' weights as one
 * vector, other types in the file's row layout. Also the portable decoders of either layout:
 * one row (embedding lookups), a panel of rows for the prefill products, and the portable
 * one-token dot products, all giving exactly the values of the file's blocks. */
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/kquant.h"
#include "kernels/dequant.h"
#include "kernels/f16.h"

int cpu_weights_x16(uint32_t type)
{
    return type == DQ_Q4_0 || type == DQ_Q4_1 || type == DQ_Q5_0 || type == DQ_Q5_1 ||
           type == DQ_Q8_0;
}

int cpu_x16_header(uint32_t type)
{
    switch (type) {
    case DQ_Q4_1: return 64;   /* d[16] m[16] */
    case DQ_Q5_0: return 96;   /* d[16] hmask[32] */
    case DQ_Q5_1: return 128;  /* d[16] m[16] hmask[32] */
    default: return 32;        /* d[16] */
    }
}

static int has_offset(uint32_t type) { return type == DQ_Q4_1 || type == DQ_Q5_1; }
static int five_bit(uint32_t type) { return type == DQ_Q5_0 || type == DQ_Q5_1; }

size_t cpu_weights_bytes(uint32_t type, int rows, int cols)
{
    int be = dequant_block_elems(type), bb = dequant_block_bytes(type);
    if (be == 0 || rows < 1 || cols < 1 || cols % be) return 0;
    size_t r = cpu_weights_x16(type) ? (size_t)(rows + 15) / 16 * 16 : (size_t)rows;
    return r * (size_t)(cols / be) * (size_t)bb;
}

void cpu_weights_pack(uint32_t type, int rows, int cols, const void *src, void *dst,
                      struct Weights *out)
{
    int be = dequant_block_elems(type), bb = dequant_block_bytes(type);
    size_t row_bytes = (size_t)(cols / be) * bb;
    *out = (struct Weights){.type = type, .layout = WEIGHTS_ROWS, .rows = rows, .cols = cols,
                            .row_bytes = row_bytes, .data = dst};
    if (!cpu_weights_x16(type)) {
        memcpy(dst, src, row_bytes * (size_t)rows);
        return;
    }
    out->layout = WEIGHTS_X16;
    int nb = cols / 32, groups = (rows + 15) / 16, hdr = cpu_x16_header(type);
    int moff = has_offset(type) ? 2 : 0;              /* past the f16 offset m */
    int qoff = 2 + moff + (five_bit(type) ? 4 : 0);   /* quants inside a file block */
    uint8_t zero[34] = {0};
    for (int g = 0; g < groups; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *tile = (uint8_t *)dst + ((size_t)g * nb + b) * 16 * bb;
            if (five_bit(type)) memset(tile + hdr - 64, 0, 64);
            for (int j = 0; j < 16; j++) {
                int r = 16 * g + j;
                const uint8_t *blk = r < rows ? (const uint8_t *)src + (size_t)r * row_bytes +
                                                    (size_t)b * bb
                                              : zero;
                memcpy(tile + 2 * j, blk, 2);
                if (moff) memcpy(tile + 32 + 2 * j, blk + 2, 2);
                if (five_bit(type)) {
                    /* Column c's fifth bits of the 16 rows as one u16 mask, bit j for row j. */
                    uint32_t qh = (uint32_t)blk[2 + moff] | (uint32_t)blk[3 + moff] << 8 |
                                  (uint32_t)blk[4 + moff] << 16 | (uint32_t)blk[5 + moff] << 24;
                    uint8_t *hm = tile + hdr - 64;
                    for (int c = 0; c < 32; c++)
                        if ((qh >> c) & 1u) hm[2 * c + j / 8] |= (uint8_t)(1u << (j % 8));
                }
                int nq = type == DQ_Q8_0 ? 32 : 16;
                for (int i = 0; i < nq; i++) tile[hdr + 16 * i + j] = blk[qoff + i];
            }
        }
}

static float half_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* The 32 x 16 weights of one X16 tile, out[c * ld + j] for column c, row j of the group;
 * mul then add as separate statements, as in dequant.c, so values match the reference. */
static void x16_tile(uint32_t type, const uint8_t *tile, float *out, size_t ld)
{
    float d[16], m[16];
    for (int j = 0; j < 16; j++) {
        d[j] = half_at(tile + 2 * j);
        m[j] = has_offset(type) ? half_at(tile + 32 + 2 * j) : 0.f;
    }
    const uint8_t *q = tile + cpu_x16_header(type);
    if (five_bit(type)) {
        const uint8_t *hm = q - 64;
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++) {
                int lo = (q[16 * i + j] & 0x0f) | ((hm[2 * i + j / 8] >> (j % 8)) & 1) << 4;
                int hi = (q[16 * i + j] >> 4) | ((hm[2 * (i + 16) + j / 8] >> (j % 8)) & 1) << 4;
                if (type == DQ_Q5_0) {
                    out[(size_t)i * ld + j] = (float)(lo - 16) * d[j];
                    out[(size_t)(i + 16) * ld + j] = (float)(hi - 16) * d[j];
                } else {
                    float wl = (float)lo * d[j], wh = (float)hi * d[j];
                    out[(size_t)i * ld + j] = wl + m[j];
                    out[(size_t)(i + 16) * ld + j] = wh + m[j];
                }
            }
        return;
    }
    if (type == DQ_Q8_0) {
        for (int c = 0; c < 32; c++)
            for (int j = 0; j < 16; j++)
                out[(size_t)c * ld + j] = (float)(int8_t)q[16 * c + j] * d[j];
        return;
    }
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            uint8_t byte = q[16 * i + j];
            if (type == DQ_Q4_0) {
                out[(size_t)i * ld + j] = (float)((byte & 0x0f) - 8) * d[j];
                out[(size_t)(i + 16) * ld + j] = (float)((byte >> 4) - 8) * d[j];
            } else {
                float lo = (float)(byte & 0x0f) * d[j];
                float hi = (float)(byte >> 4) * d[j];
                out[(size_t)i * ld + j] = lo + m[j];
                out[(size_t)(i + 16) * ld + j] = hi + m[j];
            }
        }
}

const uint8_t *cpu_x16_tile(const struct Weights *w, int group, int block)
{
    size_t tile_bytes = 16 * (size_t)dequant_block_bytes(w->type);
    return (const uint8_t *)w->data + ((size_t)group * (w->cols / 32) + block) * tile_bytes;
}

void cpu_weights_row(const struct Weights *w, int r, float *dst)
{
    if (w->layout == WEIGHTS_ROWS) {
        dequant_row(w->type, (const uint8_t *)w->data + (size_t)r * w->row_bytes, dst,
                    (size_t)w->cols);
        return;
    }
    float tile[32 * 16];
    for (int b = 0; b < w->cols / 32; b++) {
        x16_tile(w->type, cpu_x16_tile(w, r / 16, b), tile, 16);
        for (int c = 0; c < 32; c++) dst[32 * b + c] = tile[16 * c + r % 16];
    }
}

void cpu_decode_rows(const struct Weights *w, int r0, int nr, float *dst)
{
    for (int r = 0; r < nr; r++) cpu_weights_row(w, r0 + r, dst + (size_t)r * w->cols);
}

void cpu_decode_rows_with(enum CpuIsa isa, const struct Weights *w, int r0, int nr, float *dst)
{
    if (w->layout == WEIGHTS_ROWS && kquant_is_k(w->type) && isa != CPU_ISA_SCALAR) {
        for (int r = 0; r < nr; r++) {
            const uint8_t *row = (const uint8_t *)w->data + (size_t)(r0 + r) * w->row_bytes;
            float *out = dst + (size_t)r * w->cols;
            if (isa == CPU_ISA_AVX512) cpu_decode_k_avx512(w->type, row, out, w->cols / QK_K);
            else cpu_decode_k_avx2(w->type, row, out, w->cols / QK_K);
        }
        return;
    }
    cpu_decode_rows(w, r0, nr, dst);
}

void cpu_panel_x16(const struct Weights *w, int r0, int width, float *panel)
{
    int k = w->cols, groups = (w->rows + 15) / 16;
    for (int h = 0; h < width / 16; h++) {
        int g = r0 / 16 + h;
        if (g >= groups) {
            for (int c = 0; c < k; c++) memset(panel + (size_t)c * width + 16 * h, 0, 16 * sizeof(float));
            continue;
        }
        for (int b = 0; b < k / 32; b++)
            x16_tile(w->type, cpu_x16_tile(w, g, b), panel + (size_t)32 * b * width + 16 * h,
                     (size_t)width);
    }
}

void cpu_matvec_x16_portable(const struct Weights *w, int g0, int g1, const float *x, float *y)
{
    float tile[32 * 16];
    for (int g = g0; g < g1; g++) {
        float acc[16] = {0};
        for (int b = 0; b < w->cols / 32; b++) {
            x16_tile(w->type, cpu_x16_tile(w, g, b), tile, 16);
            for (int c = 0; c < 32; c++)
                for (int j = 0; j < 16; j++) acc[j] += tile[16 * c + j] * x[32 * b + c];
        }
        memcpy(y + (size_t)(g - g0) * 16, acc, sizeof acc);
    }
}
