/* Internal to kernels/cpu: kernels shared between the CPU backend's files. */
#ifndef DIFFRAG_KERNELS_CPU_H
#define DIFFRAG_KERNELS_CPU_H

#include "kernels/backend.h"

void cpu_attention(struct ThreadPool *pool, const struct AttnArgs *a, float *scratch);
size_t cpu_attention_scratch(int head_dim, int group, int threads);

#endif
