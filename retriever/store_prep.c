/* The part of a write that needs no transaction: chunking (token counting) and analysing each
 * chunk into its term frequencies, spread over worker threads for large batches. The write
 * transaction then only merges the prepared terms into posting blocks. */
#include "retriever/store_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "retriever/status.h"

#define PREP_MAX_THREADS 8
#define PREP_MIN_BYTES_PER_THREAD (256u << 10) /* below this, threads cost more than they save */

void store_prep_free(struct PreDoc *pre, size_t n)
{
    for (size_t i = 0; pre && i < n; i++) {
        free(pre[i].spans);
        free(pre[i].term_first);
        free(pre[i].chunk_len);
        free(pre[i].terms);
        free(pre[i].arena);
        memset(&pre[i], 0, sizeof pre[i]);
    }
}

static int prep_one(const struct StoreDoc *d, const struct IndexOptions *o, const struct TokenCounter *tc,
                    struct Analyzer *an, struct TermBag *bag, struct PreDoc *p, char *err, size_t errlen)
{
    int st = chunk_text(d->text, d->text_len, &o->chunk, tc, &p->spans, &p->n_spans, err, errlen);
    if (st)
        return st;
    p->term_first = malloc((p->n_spans + 1) * sizeof *p->term_first);
    p->chunk_len = malloc((p->n_spans ? p->n_spans : 1) * sizeof *p->chunk_len);
    if (!p->term_first || !p->chunk_len)
        goto nomem;
    for (size_t j = 0; j < p->n_spans; j++) {
        char heading[CHUNK_MAX_PATH_BYTES + 1];
        size_t hl = chunk_heading_path(d->text, &p->spans[j], d->title, d->title_len, heading,
                                       sizeof heading);
        if ((st = index_chunk_terms(an, o->index_flags, d->title, d->title_len, heading, hl,
                                    d->text + p->spans[j].start, p->spans[j].end - p->spans[j].start,
                                    bag)))
            goto nomem;
        if (bag->total > UINT32_MAX || p->n_terms + bag->n > UINT32_MAX)
            return ret_fail(err, errlen, RET_ELIMIT, "a chunk has too many terms");
        p->term_first[j] = (uint32_t)p->n_terms;
        p->chunk_len[j] = (uint32_t)bag->total;
        if (p->n_terms + bag->n > p->cap_terms) {
            size_t c = p->cap_terms ? p->cap_terms * 2 : 256;
            while (c < p->n_terms + bag->n)
                c *= 2;
            struct PreTerm *t = realloc(p->terms, c * sizeof *t);
            if (!t)
                goto nomem;
            p->terms = t;
            p->cap_terms = c;
        }
        if (p->arena_len + bag->arena_len > p->arena_cap) {
            size_t c = p->arena_cap ? p->arena_cap * 2 : 4096;
            while (c < p->arena_len + bag->arena_len)
                c *= 2;
            char *a = realloc(p->arena, c);
            if (!a)
                goto nomem;
            p->arena = a;
            p->arena_cap = c;
        }
        memcpy(p->arena + p->arena_len, bag->arena, bag->arena_len);
        for (size_t i = 0; i < bag->n; i++)
            p->terms[p->n_terms++] = (struct PreTerm){ (uint32_t)(p->arena_len + bag->items[i].off),
                                                       bag->items[i].len, bag->items[i].count };
        p->arena_len += bag->arena_len;
    }
    p->term_first[p->n_spans] = (uint32_t)p->n_terms;
    return RET_OK;
nomem:
    return ret_fail(err, errlen, RET_ENOMEM, "out of memory preparing a document");
}

struct PrepJob {
    const struct StoreDoc *docs;
    struct PreDoc *pre;
    size_t n;
    const struct IndexOptions *o;
    const struct TokenCounter *tc;
    atomic_size_t next;
    pthread_mutex_t lock;
    int status;          /* first failure */
    char err[512];
};

static void *prep_worker(void *arg)
{
    struct PrepJob *j = arg;
    struct Analyzer *an = NULL;
    struct TermBag bag;
    termbag_init(&bag);
    char err[512];
    int st = analyzer_new(j->o->analyzer_flags, &an, err, sizeof err);
    for (;;) {
        if (st)
            break;
        size_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n)
            break;
        st = prep_one(&j->docs[i], j->o, j->tc, an, &bag, &j->pre[i], err, sizeof err);
    }
    if (st) {
        atomic_store(&j->next, j->n); /* stop the others early */
        pthread_mutex_lock(&j->lock);
        if (!j->status) {
            j->status = st;
            memcpy(j->err, err, sizeof err);
        }
        pthread_mutex_unlock(&j->lock);
    }
    termbag_free(&bag);
    analyzer_destroy(&an);
    return NULL;
}

int store_prep_docs(const struct StoreDoc *docs, size_t n, const struct IndexOptions *o,
                    const struct TokenCounter *tc, struct PreDoc *pre, char *err, size_t errlen)
{
    size_t bytes = 0;
    for (size_t i = 0; i < n; i++)
        bytes += docs[i].text_len;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t n_threads = cpus > 0 ? (size_t)cpus : 1;
    if (n_threads > PREP_MAX_THREADS)
        n_threads = PREP_MAX_THREADS;
    if (n_threads > bytes / PREP_MIN_BYTES_PER_THREAD + 1)
        n_threads = bytes / PREP_MIN_BYTES_PER_THREAD + 1;
    if (n_threads > n)
        n_threads = n ? n : 1;
    struct PrepJob j = { .docs = docs, .pre = pre, .n = n, .o = o, .tc = tc, .status = 0 };
    atomic_init(&j.next, 0);
    pthread_mutex_init(&j.lock, NULL);
    pthread_t th[PREP_MAX_THREADS];
    size_t started = 0;
    for (size_t t = 1; t < n_threads; t++) {
        if (pthread_create(&th[started], NULL, prep_worker, &j))
            break; /* fewer helpers: the calling thread still does the work */
        started++;
    }
    prep_worker(&j);
    for (size_t t = 0; t < started; t++)
        pthread_join(th[t], NULL);
    pthread_mutex_destroy(&j.lock);
    if (j.status) {
        store_prep_free(pre, n);
        return ret_fail(err, errlen, j.status, "%s", j.err);
    }
    return RET_OK;
}
