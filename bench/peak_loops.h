/* Loops that run one instruction at its peak rate on the calling thread, for the ceilings of
 * `bench_kernels peaks`: each returns the operations it did (a multiply-add counts 2) and
 * leaves a value in *sink so that nothing is optimised away. Only where the processor has the
 * instruction (the caller checks: cpu_isa_supported, cpu_q8_vnni, cpu_amx_usable_once). */
#ifndef DIFFRAG_BENCH_PEAK_LOOPS_H
#define DIFFRAG_BENCH_PEAK_LOOPS_H

enum { FMA_ITERS = 4000000 };

double peak_fma_avx512(float *sink);   /* AVX-512 FMA, f32 */
double peak_fma_avx2(float *sink);     /* AVX2 FMA, f32 */
double peak_vnni(float *sink);         /* AVX-512 VNNI vpdpbusd, int8 */
double peak_amx_bf16(float *sink);     /* AMX tdpbf16ps, bf16 into f32 */

#endif
