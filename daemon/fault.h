/* Fault injection for the fault-tolerance tests: named points in the daemon that fail on
 * purpose when the environment variable DIFFRAGD_FAULTS asks them to, e.g.
 *
 *   DIFFRAGD_FAULTS="worker_thread_exit=3,worker_engine_error=5"
 *
 * makes every 3rd job end its worker's compute thread and every 5th job fail as if the engine
 * had. Unset (the normal case) every point is a relaxed atomic load of 0. Only the operator's
 * environment can set it; nothing a client sends reaches it. */
#ifndef DIFFRAG_FAULT_H
#define DIFFRAG_FAULT_H

#include <stddef.h>

enum FaultPoint {
    FAULT_WORKER_THREAD_EXIT,   /* the compute thread returns on receiving a job, unanswered */
    FAULT_WORKER_ENGINE_ERROR,  /* the job fails as if the engine had */
    FAULT_SCHED_OVERCOMMIT,     /* a scheduler step admits new requests on their first prompt
                                   chunk's pages (as if their answers took no room), so a small
                                   KV pool runs out and preempts: the preemption tests' pressure */
    FAULT_COUNT
};

/* Reads DIFFRAGD_FAULTS once (later calls do nothing). Returns 0, or -1 with err naming an
 * unknown point or a bad period; the points stay off then. */
int fault_init(char *err, size_t errlen);

/* Whether any point is armed (for a warning at start-up). */
int fault_armed(void);

/* Counts one pass through point p; 1 when this pass is to fail. Thread-safe. */
int fault_hit(enum FaultPoint p);

#endif
