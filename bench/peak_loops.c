/* The instruction-peak loops of bench/peak_loops.h. */
#include "bench/peak_loops.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* Independent accumulator chains (more than latency x ports) with distinct starting values,
 * and x made opaque each step so the compiler can neither merge nor fold chains. Returns
 * FLOPs done. */
__attribute__((target("avx512f"))) double peak_fma_avx512(float *sink)
{
    enum { N = 16 };
    __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(1e-7f), a[N];
    for (int j = 0; j < N; j++) a[j] = _mm512_set1_ps((float)j * 1e-3f);
    for (long i = 0; i < FMA_ITERS; i++) {
        __asm__ volatile("" : "+v"(x));
#pragma GCC unroll 16
        for (int j = 0; j < N; j++) a[j] = _mm512_fmadd_ps(a[j], x, y);
    }
    float s = 0.f;
    for (int j = 0; j < N; j++) s += _mm512_reduce_add_ps(a[j]);
    *sink = s;
    return (double)FMA_ITERS * N * 16 * 2;
}

/* The int8 products' instruction (vpdpbusd: 64 multiply-adds of u8 x s8 into int32 per
 * instruction), 16 independent chains; returns the operations done (a multiply-add is 2). */
__attribute__((target("avx512f,avx512vnni"))) double peak_vnni(float *sink)
{
    enum { N = 16 };
    __m512i x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x02020202), a[N];
    for (int j = 0; j < N; j++) a[j] = _mm512_set1_epi32(j);
    for (long i = 0; i < FMA_ITERS; i++) {
        __asm__ volatile("" : "+v"(x));
#pragma GCC unroll 16
        for (int j = 0; j < N; j++) a[j] = _mm512_dpbusd_epi32(a[j], x, y);
    }
    int s = 0;
    for (int j = 0; j < N; j++) s += _mm512_reduce_add_epi32(a[j]);
    *sink = (float)s;
    return (double)FMA_ITERS * N * 64 * 2;
}

/* The AMX bf16 tile product (tdpbf16ps: 16 x 16 outputs of 32-term dot products, 16,384
 * FLOPs per instruction) into 4 independent accumulators; returns the FLOPs done. */
struct AmxCfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
__attribute__((target("amx-tile,amx-bf16"))) double peak_amx_bf16(float *sink)
{
    static _Thread_local uint16_t ab[2][16 * 32];
    static _Thread_local float c[16 * 16];
    struct AmxCfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    for (int i = 0; i < 16 * 32; i++) { ab[0][i] = 0x3c00; ab[1][i] = 0x3c00; }
    _tile_loadconfig(&cfg);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, ab[0], 64);
    _tile_loadd(5, ab[1], 64);
    long iters = FMA_ITERS / 8;
    for (long i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, 64);
    _tile_release();
    *sink = c[0];
    return (double)iters * 4 * 16384;
}

__attribute__((target("avx2,fma"))) double peak_fma_avx2(float *sink)
{
    enum { N = 12 };
    __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(1e-7f), a[N];
    for (int j = 0; j < N; j++) a[j] = _mm256_set1_ps((float)j * 1e-3f);
    for (long i = 0; i < FMA_ITERS; i++) {
        __asm__ volatile("" : "+x"(x));
#pragma GCC unroll 12
        for (int j = 0; j < N; j++) a[j] = _mm256_fmadd_ps(a[j], x, y);
    }
    float v[8], s = 0.f;
    for (int j = 0; j < N; j++) {
        _mm256_storeu_ps(v, a[j]);
        s += v[0] + v[7];
    }
    *sink = s;
    return (double)FMA_ITERS * N * 8 * 2;
}
#else
double peak_fma_avx512(float *sink) { *sink = 0; return 0; }
double peak_fma_avx2(float *sink) { *sink = 0; return 0; }
double peak_vnni(float *sink) { *sink = 0; return 0; }
double peak_amx_bf16(float *sink) { *sink = 0; return 0; }
#endif
