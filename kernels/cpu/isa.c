/* Run-time choice of the CPU kernels' instruction-set path and prefill product engine: what
 * the processor supports, optionally narrowed by DIFFRAG_CPU_ISA / DIFFRAG_GEMM (for
 * benchmarks and for checking each path on one machine). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

static const char *const isa_names[CPU_ISA_COUNT] = {"scalar", "avx2", "avx512"};
static const char *const gemm_names[] = {"native", "openblas", "q8"};   /* enum CpuGemm */

const char *cpu_gemm_name(enum CpuGemm g)
{
    return g >= CPU_GEMM_NATIVE && g <= CPU_GEMM_Q8 ? gemm_names[g] : "unknown";
}

const char *cpu_isa_name(enum CpuIsa isa)
{
    return isa >= 0 && isa < CPU_ISA_COUNT ? isa_names[isa] : "unknown";
}

int cpu_isa_supported(enum CpuIsa isa)
{
    switch (isa) {
    case CPU_ISA_SCALAR: return 1;
#if defined(__x86_64__) && defined(__GNUC__)
    case CPU_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case CPU_ISA_AVX512:
        __builtin_cpu_init();
        return cpu_isa_supported(CPU_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq");
#endif
    default: return 0;
    }
}

int cpu_q8_vnni(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return cpu_isa_supported(CPU_ISA_AVX512) && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static int amx_ok, amx_default;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT, amx_default_once = PTHREAD_ONCE_INIT;
static void check_amx(void) { amx_ok = cpu_amx_usable(); }

int cpu_amx_usable_once(void)
{
    pthread_once(&amx_once, check_amx);
    return amx_ok;
}

/* Decided once per process, as the instruction-set path is (every attention call asks). */
static void choose_attn(void)
{
    const char *want = getenv("DIFFRAG_ATTN");
    amx_default = !(want && !strcmp(want, "f32")) && cpu_isa_best() == CPU_ISA_AVX512 &&
                  cpu_amx_usable_once();
}

int cpu_attn_amx_default(void)
{
    pthread_once(&amx_default_once, choose_attn);
    return amx_default;
}

static enum CpuIsa best_isa;
static enum CpuGemm default_gemm;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

static void choose(void)
{
    best_isa = CPU_ISA_SCALAR;
    for (int i = CPU_ISA_COUNT - 1; i > 0; i--)
        if (cpu_isa_supported((enum CpuIsa)i)) { best_isa = (enum CpuIsa)i; break; }
    const char *want = getenv("DIFFRAG_CPU_ISA");
    if (want)
        for (int i = 0; i < CPU_ISA_COUNT; i++)
            if (!strcmp(want, isa_names[i]) && cpu_isa_supported((enum CpuIsa)i))
                best_isa = (enum CpuIsa)i;
    /* The AVX-512 and AVX2 microkernels beat OpenBLAS's sgemm on the prefill shapes
     * (bench_kernels shapes; docs/performance.md); without either, OpenBLAS's kernels for the
     * machine beat the portable loops by far. */
    default_gemm = best_isa == CPU_ISA_SCALAR ? CPU_GEMM_OPENBLAS : CPU_GEMM_NATIVE;
    /* The int8 products by default where the AVX-512 path has VNNI and on the AVX2 path; on
     * AVX-512 without VNNI the f32 products, twice as wide there, stay the default
     * (docs/performance.md). */
    enum CpuIsa q8 = cpu_q8_kernel(best_isa);
    if (q8 == best_isa) default_gemm = CPU_GEMM_Q8;
    const char *g = getenv("DIFFRAG_GEMM");
    for (int i = CPU_GEMM_NATIVE; g && i <= CPU_GEMM_Q8; i++)
        if (!strcmp(g, gemm_names[i]) && (i != CPU_GEMM_Q8 || q8 != CPU_ISA_SCALAR))
            default_gemm = (enum CpuGemm)i;
}

enum CpuIsa cpu_q8_kernel(enum CpuIsa isa)
{
    if (isa == CPU_ISA_AVX512 && cpu_q8_vnni()) return CPU_ISA_AVX512;
    if (isa >= CPU_ISA_AVX2 && cpu_isa_supported(CPU_ISA_AVX2)) return CPU_ISA_AVX2;
    return CPU_ISA_SCALAR;
}

enum CpuIsa cpu_isa_best(void)
{
    pthread_once(&choose_once, choose);
    return best_isa;
}

enum CpuGemm cpu_gemm_default(void)
{
    pthread_once(&choose_once, choose);
    return default_gemm;
}
