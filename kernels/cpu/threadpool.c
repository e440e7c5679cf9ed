/* Thread pool: the threads claim task indices from one atomic ticket, so uneven tasks (causal
 * attention rows) balance themselves, and the caller waits only for tasks that were claimed:
 * a worker that is asleep or has lost its core to another process (the daemon runs several
 * contexts on few cores) never holds a job up; the caller then simply runs more tasks itself.
 * The ticket carries the job's generation, so a late worker cannot claim tasks of a newer job
 * it has not read. Workers spin briefly between jobs (a forward pass issues hundreds of short
 * jobs per token, and a futex wake-up per job would cost more than the jobs), yield their core
 * while they wait longer, and then sleep on a condition variable. */
#include "kernels/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

enum {
    POOL_PAUSE_NS = 30000,    /* pure spinning after a job */
    POOL_SPIN_NS = 2000000,   /* spinning with sched_yield before sleeping */
};

struct ThreadPool {
    int n_threads;
    pthread_t *threads;
    int *started;                      /* threads[i] is valid */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_uint generation;            /* bumped once per job */
    atomic_int sleepers;               /* workers blocked (or about to block) on `wake` */
    atomic_int quit;
    /* The current job. Written by the caller before the generation is published; read by
     * workers, which only act on them through a ticket claim tagged with that generation. */
    _Atomic(pool_task_fn) fn;
    _Atomic(void *) ctx;
    atomic_int n_tasks;
    atomic_ullong ticket;              /* generation << 32 | tasks not yet claimed */
    atomic_int done;                   /* tasks of the current job finished */
};

struct WorkerArg { struct ThreadPool *p; int id; };

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Claims and runs tasks of job `gen` until none are left. A claim takes one from the count of
 * unclaimed tasks in the ticket, tagged with the job's generation, so it needs nothing but the
 * ticket. The job's fields are read only after a claim has succeeded: the job cannot finish
 * (and the caller cannot set up the next one) before the claimed task is done, so they are
 * this job's. (Read before the claim, they could already be the next job's while the ticket
 * still showed this one: a worker running late ran a task of the new job under the old ticket,
 * so a task ran twice and `done` counted one too many.) */
static void pool_drain(struct ThreadPool *p, unsigned gen, int thread)
{
    pool_task_fn fn = NULL;
    void *ctx = NULL;
    unsigned long long n = 0;
    unsigned long long t = atomic_load_explicit(&p->ticket, memory_order_relaxed);
    for (;;) {
        if ((unsigned)(t >> 32) != gen || (t & 0xffffffffULL) == 0) return;
        if (!atomic_compare_exchange_weak_explicit(&p->ticket, &t, t - 1, memory_order_acquire,
                                                   memory_order_relaxed))
            continue;
        if (!fn) {
            fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
            ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
            n = (unsigned long long)atomic_load_explicit(&p->n_tasks, memory_order_relaxed);
        }
        /* tasks in their order: the first claim takes task 0 */
        fn(ctx, (int)(n - (t & 0xffffffffULL)), thread);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
        t = atomic_load_explicit(&p->ticket, memory_order_relaxed);
    }
}

/* Waits until the generation differs from `seen` or quit is set; returns the generation. */
static unsigned wait_job(struct ThreadPool *p, unsigned seen)
{
    long long t0 = 0;
    for (unsigned i = 1;; i++) {
        unsigned g = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->quit, memory_order_relaxed)) return g;
        if ((i & 63) == 0) {
            long long t = now_ns();
            if (!t0) t0 = t;
            else if (t - t0 > POOL_SPIN_NS) break;
            else if (t - t0 > POOL_PAUSE_NS) sched_yield();
        }
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    unsigned g;
    while ((g = atomic_load(&p->generation)) == seen && !atomic_load(&p->quit))
        pthread_cond_wait(&p->wake, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *pool_worker(void *arg)
{
    struct WorkerArg *wa = arg;
    struct ThreadPool *p = wa->p;
    int id = wa->id;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        seen = wait_job(p, seen);
        if (atomic_load(&p->quit)) break;
        pool_drain(p, seen, id);
    }
    return NULL;
}

int pool_new(int n_threads, struct ThreadPool **out)
{
    *out = NULL;
    if (n_threads < 1) n_threads = 1;
    struct ThreadPool *p = calloc(1, sizeof *p);
    if (!p) return -1;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->quit, 0);
    atomic_init(&p->fn, NULL);
    atomic_init(&p->ctx, NULL);
    atomic_init(&p->n_tasks, 0);
    atomic_init(&p->ticket, 0);
    atomic_init(&p->done, 0);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    p->started = calloc((size_t)n_threads, sizeof *p->started);
    if (!p->threads || !p->started) goto err;
    for (int i = 1; i < n_threads; i++) {
        struct WorkerArg *wa = malloc(sizeof *wa);
        if (!wa) goto err;
        wa->p = p;
        wa->id = i;
        if (pthread_create(&p->threads[i], NULL, pool_worker, wa) != 0) {
            free(wa);
            goto err;
        }
        p->started[i] = 1;
    }
    *out = p;
    return 0;
err:
    pool_destroy(&p);
    return -1;
}

void pool_destroy(struct ThreadPool **pp)
{
    struct ThreadPool *p = *pp;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    if (p->threads && p->started)
        for (int i = 1; i < p->n_threads; i++)
            if (p->started[i]) pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p->started);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    free(p);
    *pp = NULL;
}

int pool_threads(const struct ThreadPool *p) { return p ? p->n_threads : 1; }

void pool_run(struct ThreadPool *p, int n_tasks, pool_task_fn fn, void *ctx)
{
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    unsigned gen = atomic_load_explicit(&p->generation, memory_order_relaxed) + 1;
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&p->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->ticket, (unsigned long long)gen << 32 | (unsigned)n_tasks,
                          memory_order_release);
    /* seq_cst publish, then the sleeper count: a worker that registered as a sleeper before
     * re-checking the generation is either seen here or sees the new generation itself. */
    atomic_store(&p->generation, gen);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    pool_drain(p, gen, 0);
    /* Every task is claimed now; wait for those still running elsewhere. */
    long long t0 = 0;
    for (unsigned i = 1; atomic_load_explicit(&p->done, memory_order_acquire) < n_tasks; i++) {
        if ((i & 63) == 0) {
            long long t = now_ns();
            if (!t0) t0 = t;
            else if (t - t0 > POOL_PAUSE_NS) sched_yield();
        }
        cpu_relax();
    }
}
