/* The check macro of the C unit tests, written once. CHECK(cond, fmt, ...) counts a check;
 * when cond is false it prints "FAIL file:line: (cond) message" on stderr and counts a failure.
 * A test's main ends with `return check_report("test_name");`, which prints
 * "test_name: N checks, F failed" on stdout and returns the exit status (1 when any failed).
 * The wrappers read this: test_c_units.py the exit status, test_valgrind_units.py the lines
 * that start with FAIL (those that state a time are timing checks), test_clients_c.py and
 * test_gguf_asan.py the "N checks, 0 failed" line. */
#ifndef DIFFRAG_TESTS_CHECK_H
#define DIFFRAG_TESTS_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int check_count __attribute__((unused));
static int check_failures __attribute__((unused));

#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        check_count++;                                                       \
        if (!(cond)) {                                                       \
            check_failures++;                                                \
            fprintf(stderr, "FAIL %s:%d: (%s) ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                    \
            fputc('\n', stderr);                                             \
        }                                                                    \
    } while (0)

/* Whether DIFFRAG_TEST_SCALE=small asks for shorter inputs (slower machines, the sanitizer and
 * valgrind passes; tests/conftest.py). A test that takes them says so on stdout. */
static inline int check_small_scale(void)
{
    const char *scale = getenv("DIFFRAG_TEST_SCALE");
    return scale && !strcmp(scale, "small");
}

/* Prints the count line and returns main's exit status. */
static inline int check_report(const char *name)
{
    printf("%s: %d checks, %d failed\n", name, check_count, check_failures);
    fflush(stdout);
    return check_failures ? 1 : 0;
}

/* max |a - b| / max |b| over n values (max |a - b| when b is all zero): the relative error
 * the engine checks state their tolerances in. */
static inline double check_rel_diff(const float *a, const float *b, int n)
{
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        num = d > num ? d : num;
        den = fabs(b[i]) > den ? fabs(b[i]) : den;
    }
    return den > 0 ? num / den : num;
}

#endif
