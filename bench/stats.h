/* Summary statistics shared by the C benchmarks. */
#ifndef DIFFRAG_BENCH_STATS_H
#define DIFFRAG_BENCH_STATS_H

#include <stdlib.h>

/* qsort order of doubles, ascending. */
static inline int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of v[0..n) (n > 0); sorts v in place. */
static inline double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#endif
