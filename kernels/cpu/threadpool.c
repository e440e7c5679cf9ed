/* Thread pool: workers sleep on a condition variable between jobs and pull task indices from
 * an atomic counter, so uneven tasks (causal attention rows) balance themselves. */
#include "kernels/threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

struct ThreadPool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    unsigned long generation; /* bumped per job so workers know a new one arrived */
    int quit;
    int active;               /* workers still inside the current job */
    pool_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next;
};

struct WorkerArg { struct ThreadPool *p; int id; };

static void pool_drain(struct ThreadPool *p, int thread)
{
    for (;;) {
        int t = atomic_fetch_add(&p->next, 1);
        if (t >= p->n_tasks) break;
        p->fn(p->ctx, t, thread);
    }
}

static void *pool_worker(void *arg)
{
    struct WorkerArg *wa = arg;
    struct ThreadPool *p = wa->p;
    int id = wa->id;
    free(wa);
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->quit && p->generation == seen) pthread_cond_wait(&p->wake, &p->mu);
        if (p->quit) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        pool_drain(p, id);
        pthread_mutex_lock(&p->mu);
        if (--p->active == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
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
    pthread_cond_init(&p->done, NULL);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    if (!p->threads) goto err;
    for (int i = 1; i < n_threads; i++) {
        struct WorkerArg *wa = malloc(sizeof *wa);
        if (!wa) goto err;
        wa->p = p;
        wa->id = i;
        if (pthread_create(&p->threads[i], NULL, pool_worker, wa) != 0) {
            free(wa);
            goto err;
        }
        p->n_threads = i + 1; /* so destroy joins only started threads */
    }
    p->n_threads = n_threads;
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
    p->quit = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    if (p->threads)
        for (int i = 1; i < p->n_threads; i++)
            if (p->threads[i]) pthread_join(p->threads[i], NULL);
    free(p->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
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
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    p->active = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    pool_drain(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->active > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
