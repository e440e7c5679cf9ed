/* The KV page pool's bookkeeping (kernels/gpu_plan.h): a stack of free page ids under a
 * mutex. The device memory itself is allocated by the caller through the GPU table. */
#include <stdlib.h>

#include "kernels/gpu_plan.h"

int gpu_pool_init(struct GpuKvPool *p, void *base, size_t page_bytes, int n_pages)
{
    if (n_pages < 0) return -1;
    p->free_list = malloc((size_t)(n_pages > 0 ? n_pages : 1) * sizeof *p->free_list);
    if (!p->free_list) return -1;
    pthread_mutex_init(&p->mu, NULL);
    p->base = base;
    p->page_bytes = page_bytes;
    p->n_pages = n_pages;
    p->n_free = n_pages;
    /* lowest ids on top, so a lone sequence gets pages in address order */
    for (int i = 0; i < n_pages; i++) p->free_list[i] = n_pages - 1 - i;
    return 0;
}

void gpu_pool_fini(struct GpuKvPool *p)
{
    if (!p->free_list) return;
    pthread_mutex_destroy(&p->mu);
    free(p->free_list);
    p->free_list = NULL;
}

int gpu_pool_take(struct GpuKvPool *p, int n, int32_t *out)
{
    if (n < 0) return -1;
    pthread_mutex_lock(&p->mu);
    int ok = n <= p->n_free;
    if (ok)
        for (int i = 0; i < n; i++) out[i] = p->free_list[--p->n_free];
    pthread_mutex_unlock(&p->mu);
    return ok ? 0 : -1;
}

void gpu_pool_give(struct GpuKvPool *p, int n, const int32_t *pages)
{
    pthread_mutex_lock(&p->mu);
    for (int i = n - 1; i >= 0; i--)
        if (pages[i] >= 0 && pages[i] < p->n_pages && p->n_free < p->n_pages)
            p->free_list[p->n_free++] = pages[i];
    pthread_mutex_unlock(&p->mu);
}

int gpu_pool_free_pages(struct GpuKvPool *p)
{
    pthread_mutex_lock(&p->mu);
    int n = p->n_free;
    pthread_mutex_unlock(&p->mu);
    return n;
}
