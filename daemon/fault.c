/* Fault points armed from DIFFRAGD_FAULTS ("name=period,..."): a per-point period and pass
 * counter, both atomics, so worker threads may pass through a point concurrently. */
#include "daemon/fault.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const point_names[FAULT_COUNT] = { "worker_thread_exit", "worker_engine_error",
                                                      "sched_overcommit" };
static _Atomic long period[FAULT_COUNT];
static _Atomic long passes[FAULT_COUNT];
static atomic_flag read_once = ATOMIC_FLAG_INIT;

int fault_init(char *err, size_t errlen)
{
    if (atomic_flag_test_and_set(&read_once))
        return 0;
    const char *env = getenv("DIFFRAGD_FAULTS");
    if (!env || !*env)
        return 0;
    long want[FAULT_COUNT] = { 0 };
    const char *p = env;
    while (*p) {
        const char *eq = strchr(p, '='), *comma = strchr(p, ',');
        const char *end = comma ? comma : p + strlen(p);
        if (!eq || eq > end) {
            snprintf(err, errlen, "DIFFRAGD_FAULTS: expected name=period in \"%.*s\"", (int)(end - p), p);
            return -1;
        }
        int found = -1;
        for (int i = 0; i < FAULT_COUNT; i++)
            if (strlen(point_names[i]) == (size_t)(eq - p) && !memcmp(point_names[i], p, (size_t)(eq - p)))
                found = i;
        char *num_end;
        long n = strtol(eq + 1, &num_end, 10);
        if (found < 0 || num_end != end || n < 1) {
            snprintf(err, errlen, "DIFFRAGD_FAULTS: \"%.*s\" is not a known point with a period >= 1",
                     (int)(end - p), p);
            return -1;
        }
        want[found] = n;
        p = comma ? comma + 1 : end;
    }
    for (int i = 0; i < FAULT_COUNT; i++)
        atomic_store_explicit(&period[i], want[i], memory_order_relaxed);
    return 0;
}

int fault_armed(void)
{
    for (int i = 0; i < FAULT_COUNT; i++)
        if (atomic_load_explicit(&period[i], memory_order_relaxed))
            return 1;
    return 0;
}

int fault_hit(enum FaultPoint p)
{
    if ((unsigned)p >= FAULT_COUNT)
        return 0;
    long n = atomic_load_explicit(&period[p], memory_order_relaxed);
    if (!n)
        return 0;
    long k = atomic_fetch_add_explicit(&passes[p], 1, memory_order_relaxed) + 1;
    return k % n == 0;
}
