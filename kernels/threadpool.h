/* A persistent pool of worker threads that runs "n tasks of one function" jobs; the calling
 * thread takes part, so a pool of n threads starts n - 1 workers. Used by every CPU kernel
 * that splits work; one pool per engine context (the daemon runs several contexts). Between
 * jobs a worker spins briefly (a forward pass issues hundreds of small jobs per token) and then
 * sleeps, so an idle context costs no CPU. */
#ifndef DIFFRAG_THREADPOOL_H
#define DIFFRAG_THREADPOOL_H

typedef void (*pool_task_fn)(void *ctx, int task, int thread);

struct ThreadPool;

/* Returns 0 or -1 (thread creation failed; *out = NULL). n_threads >= 1. */
int pool_new(int n_threads, struct ThreadPool **out);
void pool_destroy(struct ThreadPool **p);
int pool_threads(const struct ThreadPool *p);
/* Runs fn(ctx, task, thread) for task = 0..n_tasks-1 and returns when all are done. Tasks are
 * handed out dynamically in index order (put the longest first); `thread` is in
 * [0, pool_threads) and identifies per-thread scratch. A NULL pool runs everything on the
 * calling thread. Not reentrant: one caller thread at a time. */
void pool_run(struct ThreadPool *p, int n_tasks, pool_task_fn fn, void *ctx);

#endif
