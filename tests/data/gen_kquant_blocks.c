/* Writes K-quant blocks quantised by ggml's own reference quantiser, and ggml's own
 * dequantisation of them, for tests/test_dequant.py (see gen-kquant-blocks.sh). For each type
 * T in Q2_K .. Q6_K: kquant-T.blocks (the blocks) and kquant-T.f32 (ggml's values, f32 little
 * endian). The input is a fixed deterministic array of N_BLOCKS super-blocks with the corner
 * cases of each format: zeros, a constant, tiny and large magnitudes, one sign, outliers. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ggml's (ggml/src/ggml-quants.h): the block pointers typed as bytes. */
void quantize_row_q2_K_ref(const float *x, void *y, int64_t k);
void quantize_row_q3_K_ref(const float *x, void *y, int64_t k);
void quantize_row_q4_K_ref(const float *x, void *y, int64_t k);
void quantize_row_q5_K_ref(const float *x, void *y, int64_t k);
void quantize_row_q6_K_ref(const float *x, void *y, int64_t k);
void dequantize_row_q2_K(const void *x, float *y, int64_t k);
void dequantize_row_q3_K(const void *x, float *y, int64_t k);
void dequantize_row_q4_K(const void *x, float *y, int64_t k);
void dequantize_row_q5_K(const void *x, float *y, int64_t k);
void dequantize_row_q6_K(const void *x, float *y, int64_t k);

enum { N_BLOCKS = 6, N = N_BLOCKS * 256 };

static const struct {
    const char *name;
    int bytes;
    void (*quantize)(const float *, void *, int64_t);
    void (*dequantize)(const void *, float *, int64_t);
} types[] = {
    {"q2_k", 84, quantize_row_q2_K_ref, dequantize_row_q2_K},
    {"q3_k", 110, quantize_row_q3_K_ref, dequantize_row_q3_K},
    {"q4_k", 144, quantize_row_q4_K_ref, dequantize_row_q4_K},
    {"q5_k", 176, quantize_row_q5_K_ref, dequantize_row_q5_K},
    {"q6_k", 210, quantize_row_q6_K_ref, dequantize_row_q6_K},
};

static void input(float *x)
{
    uint32_t s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 1664525u + 1013904223u;
        float u = (float)(s >> 8) / 16777216.f - 0.5f;       /* [-0.5, 0.5) */
        x[i] = 2.f * u + 0.3f * sinf(0.05f * (float)i);
    }
    for (int i = 0; i < 256; i++) {
        if (i < 64) x[i] = 0.f;                               /* zero sub-blocks */
        else if (i < 96) x[i] = 1.25f;                        /* constant sub-block */
        else if (i < 128) x[i] *= 1e-4f;                      /* tiny values */
    }
    for (int i = 256; i < 512; i++) x[i] = -fabsf(x[i]);      /* one sign */
    for (int i = 512; i < 768; i++) x[i] *= 300.f;            /* large values */
    x[800] = 25.f;                                            /* outliers */
    x[1100] = -40.f;
    for (int i = 1280; i < 1536; i++) x[i] = fabsf(x[i]) + 0.5f; /* positive, offset */
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    static float x[N], y[N];
    static uint8_t blocks[N_BLOCKS * 256];
    input(x);
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        memset(blocks, 0, sizeof blocks);
        types[t].quantize(x, blocks, N);
        types[t].dequantize(blocks, y, N);
        char path[4096];
        snprintf(path, sizeof path, "%s/kquant-%s.blocks", dir, types[t].name);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(blocks, (size_t)types[t].bytes, N_BLOCKS, f) != N_BLOCKS || fclose(f)) {
            fprintf(stderr, "gen_kquant_blocks: cannot write %s\n", path);
            return 1;
        }
        snprintf(path, sizeof path, "%s/kquant-%s.f32", dir, types[t].name);
        f = fopen(path, "wb");
        if (!f || fwrite(y, sizeof(float), N, f) != N || fclose(f)) {
            fprintf(stderr, "gen_kquant_blocks: cannot write %s\n", path);
            return 1;
        }
    }
    return 0;
}
