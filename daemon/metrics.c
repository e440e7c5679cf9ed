/* Counters, gauges and histograms of diffragd, their Prometheus text rendering, and the
 * libmicrohttpd server for /metrics, /healthz and /readyz. */
#include "daemon/metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "daemon/http.h"
#include "daemon/worker.h"
#include "model/engine_gpu.h"
#include "model/kvpool.h"
#include "retriever/store.h"

#define MAX_BUCKETS 20
/* The HTTP API's statuses and endpoints, as /metrics labels them. */
static const int http_statuses[] = { 200, 400, 401, 404, 405, 413, 429, 500, 503, 504 };
#define HTTP_N_STATUS (int)(sizeof http_statuses / sizeof http_statuses[0])
static const char *const http_endpoints[] = { "chat_completions", "models", "other" };
static const char *const finish_names[] = { "stop", "length", "cancelled", "deadline" };
/* The HTTP endpoint's limits (docs/security.md#the-metrics-endpoint). A scraper or a probe
 * needs one connection at a time and a few milliseconds. */
#define METRICS_MAX_CONNECTIONS 128     /* open at once, all clients */
#define METRICS_MAX_PER_IP 32           /* open at once from one IP address */
#define METRICS_REQUEST_DEADLINE_S 5.0  /* a whole request, first byte to last of the reply */
#define METRICS_IDLE_TIMEOUT_S 5u       /* no byte either way (kept as a second guard) */
#define METRICS_CONNECTION_MEMORY (16 * 1024)

struct Hist {
    const double *bounds;
    int n;
    uint64_t counts[MAX_BUCKETS + 1];   /* per bucket (not cumulative); last: +Inf */
    double sum;
    uint64_t count;
};

static const double b_duration[] = { .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1,
                                     2.5, 5, 10, 30, 60, 120, 300 };
static const double b_queue[] = { .0001, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1,
                                  2.5, 5, 10, 30, 60 };
static const double b_ttft[] = { .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20,
                                 30, 60, 120, 300 };
static const double b_tpot[] = { .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25,
                                 .5, 1, 2.5 };
static const double b_tokens[] = { 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                                   65536, 131072 };
static const double b_tps[] = { 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000,
                                100000, 250000 };
static const double b_retrieval[] = { .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1,
                                      .25, .5, 1, 2.5, 5 };
static const double b_ratio[] = { .1, .2, .3, .4, .5, .6, .7, .8, .9, 1 };
#define NB(a) (int)(sizeof a / sizeof a[0])

struct Metrics {
    pthread_mutex_t mu;
    char *version, *backend, *model, *architecture, *quantization;
    uint64_t requests[OP_COUNT][EC_COUNT];
    struct Hist duration[OP_COUNT];
    struct Hist queue_wait, ttft, tpot, context_tokens, prefill_tps, retrieval;
    uint64_t prompt_tokens, generated_tokens, worker_lost;
    uint64_t cache_queried, cache_hit;   /* prompt tokens of answered queries; from the cache */
    struct KvPool *kv_pool;     /* the in-process workers' KV pool; NULL: none */
    const struct Model *gpu_model; /* or the model whose GPU pool they use */
    struct WorkerStats *wstats; /* their batch schedulers' figures; NULL: none */
    uint64_t auth_ok, auth_refused;
    uint64_t finished[4];       /* queries answered, by finish reason (enum WireFinish) */
    uint64_t http[3][HTTP_N_STATUS]; /* HTTP API responses: endpoint x status */
    uint64_t http_disconnects;
    int http_open;
    int queue_depth, inflight, workers_idle, workers_busy, running;
    uint64_t kv_bytes;
    int model_loaded, store_open, draining;
    struct Store *store;        /* for its damaged mark; NULL: none */
    /* groundedness */
    char *calibration, *threshold;
    uint64_t g_checked, g_flagged, g_abstained, g_answer_tokens, g_flagged_tokens;
    struct Hist g_score, g_lookback, g_unsupported;
    uint64_t outcomes[MO_COUNT], declines[MD_COUNT];
};

static void hist_init(struct Hist *h, const double *bounds, int n)
{
    memset(h, 0, sizeof *h);
    h->bounds = bounds;
    h->n = n;
}

static void hist_observe(struct Hist *h, double v)
{
    int i = 0;
    while (i < h->n && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

int metrics_new(const char *version, const char *backend, const char *model,
                const char *architecture, const char *quantization, struct Metrics **out)
{
    struct Metrics *m = calloc(1, sizeof *m);
    *out = NULL;
    if (!m)
        return -1;
    pthread_mutex_init(&m->mu, NULL);
    m->version = strdup(version);
    m->backend = strdup(backend);
    m->model = strdup(model);
    m->architecture = strdup(architecture);
    m->quantization = strdup(quantization);
    m->calibration = strdup("none");
    m->threshold = strdup("none");
    if (!m->version || !m->backend || !m->model || !m->architecture || !m->quantization ||
        !m->calibration || !m->threshold) {
        metrics_destroy(&m);
        return -1;
    }
    for (int i = 0; i < OP_COUNT; i++)
        hist_init(&m->duration[i], b_duration, NB(b_duration));
    hist_init(&m->queue_wait, b_queue, NB(b_queue));
    hist_init(&m->ttft, b_ttft, NB(b_ttft));
    hist_init(&m->tpot, b_tpot, NB(b_tpot));
    hist_init(&m->context_tokens, b_tokens, NB(b_tokens));
    hist_init(&m->prefill_tps, b_tps, NB(b_tps));
    hist_init(&m->retrieval, b_retrieval, NB(b_retrieval));
    hist_init(&m->g_score, b_ratio, NB(b_ratio));
    hist_init(&m->g_lookback, b_ratio, NB(b_ratio));
    hist_init(&m->g_unsupported, b_ratio, NB(b_ratio));
    *out = m;
    return 0;
}

void metrics_destroy(struct Metrics **mp)
{
    struct Metrics *m = mp ? *mp : NULL;
    if (!m)
        return;
    pthread_mutex_destroy(&m->mu);
    free(m->version);
    free(m->backend);
    free(m->model);
    free(m->architecture);
    free(m->quantization);
    free(m->calibration);
    free(m->threshold);
    free(m);
    *mp = NULL;
}

void metrics_request(struct Metrics *m, enum Op op, enum ErrCode code, double seconds)
{
    if ((unsigned)op >= OP_COUNT || (unsigned)code >= EC_COUNT)
        return;
    pthread_mutex_lock(&m->mu);
    m->requests[op][code]++;
    hist_observe(&m->duration[op], seconds);
    pthread_mutex_unlock(&m->mu);
}

void metrics_query(struct Metrics *m, const struct QueryObs *q)
{
    pthread_mutex_lock(&m->mu);
    if (q->queue_s >= 0) hist_observe(&m->queue_wait, q->queue_s);
    if (q->retrieval_s >= 0) hist_observe(&m->retrieval, q->retrieval_s);
    if (q->ttft_s >= 0) hist_observe(&m->ttft, q->ttft_s);
    if (q->tpot_s >= 0) hist_observe(&m->tpot, q->tpot_s);
    if (q->prefill_tps >= 0) hist_observe(&m->prefill_tps, q->prefill_tps);
    hist_observe(&m->context_tokens, (double)q->context_tokens);
    m->prompt_tokens += q->prompt_tokens;
    m->cache_queried += q->prompt_tokens;
    m->cache_hit += q->cached_tokens;
    m->generated_tokens += q->generated_tokens;
    if (q->finish >= 0 && q->finish < 4)
        m->finished[q->finish]++;
    pthread_mutex_unlock(&m->mu);
}

const char *metrics_outcome_name(int outcome)
{
    static const char *const names[MO_COUNT] = { "answered", "flagged", "declined" };
    return outcome >= 0 && outcome < MO_COUNT ? names[outcome] : "answered";
}

const char *metrics_decline_name(int reason)
{
    static const char *const names[MD_COUNT] = { "no_match", "flagged", "model_refused" };
    return reason >= 0 && reason < MD_COUNT ? names[reason] : "no_match";
}

void metrics_outcome(struct Metrics *m, int outcome, int decline_reason)
{
    if (outcome < 0 || outcome >= MO_COUNT)
        return;
    pthread_mutex_lock(&m->mu);
    m->outcomes[outcome]++;
    if (outcome == MO_DECLINED && decline_reason >= 0 && decline_reason < MD_COUNT)
        m->declines[decline_reason]++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_grounding(struct Metrics *m, const struct GrSummary *g)
{
    pthread_mutex_lock(&m->mu);
    if (g->scored) {
        m->g_checked++;
        hist_observe(&m->g_score, g->score);
    }
    m->g_flagged += g->flagged ? 1 : 0;
    m->g_abstained += g->abstained ? 1 : 0;
    m->g_answer_tokens += g->answer_tokens;
    m->g_flagged_tokens += g->flagged_tokens;
    if (g->has_ratios) {
        hist_observe(&m->g_lookback, g->lookback_ratio);
        hist_observe(&m->g_unsupported, g->unsupported_token_ratio);
    }
    pthread_mutex_unlock(&m->mu);
}

int metrics_set_detector(struct Metrics *m, const char *calibration, const char *threshold)
{
    char *c = strdup(calibration), *t = strdup(threshold);
    if (!c || !t) {
        free(c);
        free(t);
        return -1;
    }
    pthread_mutex_lock(&m->mu);
    free(m->calibration);
    free(m->threshold);
    m->calibration = c;
    m->threshold = t;
    pthread_mutex_unlock(&m->mu);
    return 0;
}

void metrics_http_request(struct Metrics *m, const char *endpoint, int status)
{
    int e = 0, k = -1, fallback = status >= 500 ? 500 : 400;   /* an unlisted status */
    while (e < 2 && strcmp(endpoint, http_endpoints[e]))
        e++;
    for (int i = 0; i < HTTP_N_STATUS && k < 0; i++)
        if (http_statuses[i] == status)
            k = i;
    for (int i = 0; i < HTTP_N_STATUS && k < 0; i++)
        if (http_statuses[i] == fallback)
            k = i;
    pthread_mutex_lock(&m->mu);
    m->http[e][k]++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_http_disconnect(struct Metrics *m)
{
    pthread_mutex_lock(&m->mu);
    m->http_disconnects++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_http_connections(struct Metrics *m, int open)
{
    pthread_mutex_lock(&m->mu);
    m->http_open = open;
    pthread_mutex_unlock(&m->mu);
}

void metrics_worker_lost(struct Metrics *m)
{
    pthread_mutex_lock(&m->mu);
    m->worker_lost++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_auth(struct Metrics *m, int allowed)
{
    pthread_mutex_lock(&m->mu);
    if (allowed)
        m->auth_ok++;
    else
        m->auth_refused++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_gauges(struct Metrics *m, int queue_depth, int inflight, int workers_idle,
                    int workers_busy, int running, uint64_t kv_cache_bytes)
{
    pthread_mutex_lock(&m->mu);
    m->running = running;
    m->queue_depth = queue_depth;
    m->inflight = inflight;
    m->workers_idle = workers_idle;
    m->workers_busy = workers_busy;
    m->kv_bytes = kv_cache_bytes;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_backend(struct Metrics *m, const char *backend)
{
    char *b = strdup(backend);
    if (!b)
        return;
    pthread_mutex_lock(&m->mu);
    free(m->backend);
    m->backend = b;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_ready(struct Metrics *m, int model_loaded, int store_open)
{
    pthread_mutex_lock(&m->mu);
    m->model_loaded = model_loaded;
    m->store_open = store_open;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_kv_pool(struct Metrics *m, struct KvPool *pool)
{
    pthread_mutex_lock(&m->mu);
    m->kv_pool = pool;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_gpu_model(struct Metrics *m, const struct Model *model)
{
    pthread_mutex_lock(&m->mu);
    m->gpu_model = model;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_worker_stats(struct Metrics *m, struct WorkerStats *stats)
{
    pthread_mutex_lock(&m->mu);
    m->wstats = stats;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_store(struct Metrics *m, struct Store *store)
{
    pthread_mutex_lock(&m->mu);
    m->store = store;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_draining(struct Metrics *m)
{
    pthread_mutex_lock(&m->mu);
    m->draining = 1;
    pthread_mutex_unlock(&m->mu);
}

int metrics_is_ready(struct Metrics *m, char *why, size_t cap)
{
    pthread_mutex_lock(&m->mu);
    const char *reason = m->draining ? "draining"
                       : !m->model_loaded ? "model not loaded"
                       : !m->store_open ? "store not open"
                       : m->workers_idle + m->workers_busy == 0 ? "no worker ready" : NULL;
    int damaged = m->store && store_damaged(m->store, NULL, 0);
    pthread_mutex_unlock(&m->mu);
    snprintf(why, cap, "%s%s", reason ? reason : "ready", damaged ? "; store: read-only (damaged)" : "");
    return reason == NULL;
}

static void label_value(FILE *f, const char *s)
{
    for (; *s; s++) {
        if (*s == '\\' || *s == '"') fputc('\\', f), fputc(*s, f);
        else if (*s == '\n') fputs("\\n", f);
        else fputc(*s, f);
    }
}

static void head(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void hist_write(FILE *f, const char *name, const char *labels, const struct Hist *h)
{
    uint64_t cum = 0;
    const char *sep = labels[0] ? "," : "";
    for (int i = 0; i <= h->n; i++) {
        cum += h->counts[i];
        if (i < h->n)
            fprintf(f, "%s_bucket{%s%sle=\"%.10g\"} %llu\n", name, labels, sep, h->bounds[i],
                    (unsigned long long)cum);
        else
            fprintf(f, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep,
                    (unsigned long long)cum);
    }
    if (labels[0]) {
        fprintf(f, "%s_sum{%s} %.9g\n", name, labels, h->sum);
        fprintf(f, "%s_count{%s} %llu\n", name, labels, (unsigned long long)h->count);
    } else {
        fprintf(f, "%s_sum %.9g\n", name, h->sum);
        fprintf(f, "%s_count %llu\n", name, (unsigned long long)h->count);
    }
}

char *metrics_render(struct Metrics *m, size_t *len)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f)
        return NULL;
    pthread_mutex_lock(&m->mu);
    head(f, "diffrag_build_info", "gauge",
         "Version, compute backend and model (file, architecture, quantization) of this daemon.");
    fputs("diffrag_build_info{version=\"", f);
    label_value(f, m->version);
    fputs("\",backend=\"", f);
    label_value(f, m->backend);
    fputs("\",model=\"", f);
    label_value(f, m->model);
    fputs("\",architecture=\"", f);
    label_value(f, m->architecture);
    fputs("\",quantization=\"", f);
    label_value(f, m->quantization);
    fputs("\"} 1\n", f);

    head(f, "diffrag_requests_total", "counter", "Requests answered, by operation and reply code.");
    for (int op = 0; op < OP_COUNT; op++)
        for (int c = 0; c < EC_COUNT; c++)
            if (m->requests[op][c] || (op != OP_NONE && (c == EC_OK || c == EC_BAD_REQUEST)))
                fprintf(f, "diffrag_requests_total{op=\"%s\",code=\"%s\"} %llu\n", op_name(op),
                        ec_name(c), (unsigned long long)m->requests[op][c]);

    head(f, "diffrag_request_duration_seconds", "histogram",
         "Time from receiving a request to its final reply, by operation.");
    for (int op = 0; op < OP_COUNT; op++) {
        char labels[32];
        snprintf(labels, sizeof labels, "op=\"%s\"", op_name(op));
        hist_write(f, "diffrag_request_duration_seconds", labels, &m->duration[op]);
    }
    head(f, "diffrag_queue_wait_seconds", "histogram",
         "Time a query waited for an I/O thread and for a worker.");
    hist_write(f, "diffrag_queue_wait_seconds", "", &m->queue_wait);
    head(f, "diffrag_retrieval_duration_seconds", "histogram",
         "Retrieval and context assembly time of a query.");
    hist_write(f, "diffrag_retrieval_duration_seconds", "", &m->retrieval);
    head(f, "diffrag_time_to_first_token_seconds", "histogram",
         "Time from receiving a query to its first generated token.");
    hist_write(f, "diffrag_time_to_first_token_seconds", "", &m->ttft);
    head(f, "diffrag_time_per_output_token_seconds", "histogram",
         "Mean decode time per generated token after the first, per query.");
    hist_write(f, "diffrag_time_per_output_token_seconds", "", &m->tpot);
    head(f, "diffrag_context_tokens", "histogram", "Prompt tokens per query (frame, documents, question).");
    hist_write(f, "diffrag_context_tokens", "", &m->context_tokens);
    head(f, "diffrag_prefill_tokens_per_second", "histogram", "Prefill throughput per query.");
    hist_write(f, "diffrag_prefill_tokens_per_second", "", &m->prefill_tps);

    head(f, "diffrag_prompt_tokens_total", "counter",
         "Prompt tokens of queries, those from the prefix cache included.");
    fprintf(f, "diffrag_prompt_tokens_total %llu\n", (unsigned long long)m->prompt_tokens);
    head(f, "diffrag_generated_tokens_total", "counter", "Tokens generated.");
    fprintf(f, "diffrag_generated_tokens_total %llu\n", (unsigned long long)m->generated_tokens);
    head(f, "diffrag_prefix_cache_queried_tokens_total", "counter",
         "Prompt tokens of answered queries, looked up in the prefix cache.");
    fprintf(f, "diffrag_prefix_cache_queried_tokens_total %llu\n",
            (unsigned long long)m->cache_queried);
    head(f, "diffrag_prefix_cache_hit_tokens_total", "counter",
         "Of them, tokens whose keys and values came from the prefix cache.");
    fprintf(f, "diffrag_prefix_cache_hit_tokens_total %llu\n", (unsigned long long)m->cache_hit);
    head(f, "diffrag_query_finish_total", "counter",
         "Queries answered with generation, by how the answer ended (stop, length, cancelled, "
         "deadline).");
    for (int i = 0; i < 4; i++)
        fprintf(f, "diffrag_query_finish_total{reason=\"%s\"} %llu\n", finish_names[i],
                (unsigned long long)m->finished[i]);
    head(f, "diffrag_http_requests_total", "counter",
         "Responses of the OpenAI-compatible HTTP API, by endpoint and status.");
    for (int e = 0; e < 3; e++)
        for (int k = 0; k < HTTP_N_STATUS; k++)
            if (m->http[e][k] || (e == 0 && http_statuses[k] == 200))
                fprintf(f, "diffrag_http_requests_total{endpoint=\"%s\",status=\"%d\"} %llu\n",
                        http_endpoints[e], http_statuses[k], (unsigned long long)m->http[e][k]);
    head(f, "diffrag_http_client_disconnects_total", "counter",
         "HTTP API clients that left before their answer ended; each one's query was cancelled.");
    fprintf(f, "diffrag_http_client_disconnects_total %llu\n",
            (unsigned long long)m->http_disconnects);
    head(f, "diffrag_http_connections", "gauge", "HTTP API connections open.");
    fprintf(f, "diffrag_http_connections %d\n", m->http_open);
    head(f, "diffrag_worker_lost_total", "counter", "Workers presumed dead (silent past the heartbeat timeout, or gone).");
    fprintf(f, "diffrag_worker_lost_total %llu\n", (unsigned long long)m->worker_lost);
    head(f, "diffrag_auth_handshakes_total", "counter",
         "CurveZMQ client handshakes the ZAP handler decided, by result.");
    fprintf(f, "diffrag_auth_handshakes_total{result=\"allowed\"} %llu\n", (unsigned long long)m->auth_ok);
    fprintf(f, "diffrag_auth_handshakes_total{result=\"refused\"} %llu\n",
            (unsigned long long)m->auth_refused);

    head(f, "diffrag_grounding_checked_requests_total", "counter",
         "Answers scored by a calibrated groundedness detector.");
    fprintf(f, "diffrag_grounding_checked_requests_total %llu\n", (unsigned long long)m->g_checked);
    head(f, "diffrag_hallucination_flagged_requests_total", "counter",
         "Answers the detector flagged as likely not resting on the documents (a detector's flag "
         "rate, not a ground-truth hallucination rate).");
    fprintf(f, "diffrag_hallucination_flagged_requests_total %llu\n",
            (unsigned long long)m->g_flagged);
    head(f, "diffrag_abstained_requests_total", "counter",
         "Answers that gave the prompt's refusal phrase.");
    fprintf(f, "diffrag_abstained_requests_total %llu\n", (unsigned long long)m->g_abstained);
    head(f, "diffrag_answers_total", "counter",
         "Answered queries by what the answer policy (unsupported) made of them: answered, "
         "flagged (returned with grounding.flagged) or declined (the fixed decline_text).");
    for (int i = 0; i < MO_COUNT; i++)
        fprintf(f, "diffrag_answers_total{outcome=\"%s\"} %llu\n", metrics_outcome_name(i),
                (unsigned long long)m->outcomes[i]);
    head(f, "diffrag_declined_answers_total", "counter",
         "Declined answers by why: no_match (retrieval found nothing; nothing generated), "
         "flagged (the detector flagged the attempt) or model_refused (the model refused).");
    for (int i = 0; i < MD_COUNT; i++)
        fprintf(f, "diffrag_declined_answers_total{reason=\"%s\"} %llu\n",
                metrics_decline_name(i), (unsigned long long)m->declines[i]);
    head(f, "diffrag_answer_tokens_total", "counter",
         "Answer tokens (generated tokens without the control token that ends the turn).");
    fprintf(f, "diffrag_answer_tokens_total %llu\n", (unsigned long long)m->g_answer_tokens);
    head(f, "diffrag_hallucination_flagged_tokens_total", "counter",
         "Answer tokens of flagged answers inside a window scored at or above the threshold.");
    fprintf(f, "diffrag_hallucination_flagged_tokens_total %llu\n",
            (unsigned long long)m->g_flagged_tokens);
    head(f, "diffrag_hallucination_score", "histogram",
         "Groundedness detector score per scored answer (maximum over windows, 0..1).");
    hist_write(f, "diffrag_hallucination_score", "", &m->g_score);
    head(f, "diffrag_lookback_ratio", "histogram",
         "Attention lookback ratio per answer: document mass / (document + generated mass).");
    hist_write(f, "diffrag_lookback_ratio", "", &m->g_lookback);
    head(f, "diffrag_unsupported_token_ratio", "histogram",
         "Fraction of an answer's tokens in content words the documents do not contain.");
    hist_write(f, "diffrag_unsupported_token_ratio", "", &m->g_unsupported);
    head(f, "diffrag_hallucination_detector_info", "gauge",
         "The groundedness detector: model, calibration (\"none\": signals only) and threshold.");
    fputs("diffrag_hallucination_detector_info{model=\"", f);
    label_value(f, m->model);
    fputs("\",calibration=\"", f);
    label_value(f, m->calibration);
    fputs("\",threshold=\"", f);
    label_value(f, m->threshold);
    fputs("\"} 1\n", f);

    head(f, "diffrag_queue_depth", "gauge", "Queries retrieved and waiting for a worker.");
    fprintf(f, "diffrag_queue_depth %d\n", m->queue_depth);
    head(f, "diffrag_inflight_requests", "gauge", "Requests admitted and not yet answered.");
    fprintf(f, "diffrag_inflight_requests %d\n", m->inflight);
    head(f, "diffrag_requests_running", "gauge",
         "Queries handed to workers and not yet answered (sequences being batched).");
    fprintf(f, "diffrag_requests_running %d\n", m->running);
    head(f, "diffrag_workers", "gauge", "Workers known to the broker, by state.");
    fprintf(f, "diffrag_workers{state=\"idle\"} %d\n", m->workers_idle);
    fprintf(f, "diffrag_workers{state=\"busy\"} %d\n", m->workers_busy);
    head(f, "diffrag_kv_cache_bytes", "gauge", "KV cache memory of the ready workers.");
    fprintf(f, "diffrag_kv_cache_bytes %llu\n", (unsigned long long)m->kv_bytes);
    /* the CPU workers' pool, or the GPU's (the same bookkeeping, model/kvpool.h) */
    struct KvPool *pool = m->kv_pool ? m->kv_pool
                          : m->gpu_model ? model_gpu_pool(m->gpu_model) : NULL;
    if (pool) {
        struct KvPoolStats ks;
        kvpool_stats(pool, &ks);
        head(f, "diffrag_kv_pool_pages", "gauge",
             "Pages of the in-process workers' KV pool (64 positions each; on the GPU when they "
             "compute there), by state: used by a request, cached (a prefix kept for reuse), "
             "free.");
        fprintf(f, "diffrag_kv_pool_pages{state=\"used\"} %zu\n", ks.pages_used);
        fprintf(f, "diffrag_kv_pool_pages{state=\"cached\"} %zu\n", ks.pages_cached);
        fprintf(f, "diffrag_kv_pool_pages{state=\"free\"} %zu\n",
                ks.pages - ks.pages_used - ks.pages_cached);
        head(f, "diffrag_kv_pool_usage_ratio", "gauge",
             "Share of the KV pool's pages used by requests (cached pages not counted).");
        fprintf(f, "diffrag_kv_pool_usage_ratio %.6f\n", (double)ks.pages_used / (double)ks.pages);
        head(f, "diffrag_kv_pool_evicted_pages_total", "counter",
             "Cached pages evicted (least recently used) for new requests.");
        fprintf(f, "diffrag_kv_pool_evicted_pages_total %llu\n",
                (unsigned long long)ks.evicted_pages);
    }
    if (m->wstats) {
        struct WorkerStats *ws = m->wstats;
        head(f, "diffrag_preemptions_total", "counter",
             "Requests preempted when the KV pool ran out of pages (freed, recomputed later).");
        fprintf(f, "diffrag_preemptions_total %llu\n",
                (unsigned long long)atomic_load(&ws->preemptions));
        head(f, "diffrag_lookup_tokens_total", "counter",
             "Prompt lookup (lookup_tokens): tokens drafted from requests' own prompts and "
             "answers and verified in decode steps, and those the model kept.");
        fprintf(f, "diffrag_lookup_tokens_total{kind=\"drafted\"} %llu\n",
                (unsigned long long)atomic_load(&ws->lookup_drafted));
        fprintf(f, "diffrag_lookup_tokens_total{kind=\"accepted\"} %llu\n",
                (unsigned long long)atomic_load(&ws->lookup_accepted));
        head(f, "diffrag_step_tokens", "histogram",
             "Tokens per engine step (decode tokens of running requests plus prefill chunks).");
        uint64_t cum = 0;
        for (int b = 0; b < WORKER_STEP_BUCKETS; b++) {
            cum += atomic_load(&ws->step_bucket[b]);
            if (b < WORKER_STEP_BUCKETS - 1)
                fprintf(f, "diffrag_step_tokens_bucket{le=\"%d\"} %llu\n", 1 << b,
                        (unsigned long long)cum);
        }
        fprintf(f, "diffrag_step_tokens_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
        fprintf(f, "diffrag_step_tokens_sum %llu\n",
                (unsigned long long)atomic_load(&ws->step_tokens));
        fprintf(f, "diffrag_step_tokens_count %llu\n", (unsigned long long)atomic_load(&ws->steps));
        head(f, "diffrag_kv_reuse_tokens_total", "counter",
             "Document tokens of blended prompts (kv_reuse): whose stored chunk KV stayed "
             "(reused), computed in the blend (recomputed), kept from a chunk copy made for "
             "the same prompt (made).");
        fprintf(f, "diffrag_kv_reuse_tokens_total{kind=\"reused\"} %llu\n",
                (unsigned long long)atomic_load(&ws->kv_reused));
        fprintf(f, "diffrag_kv_reuse_tokens_total{kind=\"recomputed\"} %llu\n",
                (unsigned long long)atomic_load(&ws->kv_recomputed));
        fprintf(f, "diffrag_kv_reuse_tokens_total{kind=\"made\"} %llu\n",
                (unsigned long long)atomic_load(&ws->kv_fresh));
        head(f, "diffrag_kv_reuse_read_bytes_total", "counter",
             "Stored chunk KV bytes placed into prompts.");
        fprintf(f, "diffrag_kv_reuse_read_bytes_total %llu\n",
                (unsigned long long)atomic_load(&ws->kv_bytes_read));
        head(f, "diffrag_kv_reuse_chunks_total", "counter",
             "Chunks of blended prompts whose KV was in the store (hit) or was made (miss).");
        fprintf(f, "diffrag_kv_reuse_chunks_total{result=\"hit\"} %llu\n",
                (unsigned long long)atomic_load(&ws->kv_hits));
        fprintf(f, "diffrag_kv_reuse_chunks_total{result=\"miss\"} %llu\n",
                (unsigned long long)atomic_load(&ws->kv_misses));
        head(f, "diffrag_kv_reuse_store_bytes", "gauge",
             "Bytes the workers' chunk KV stores hold (kv_reuse_bytes each at most).");
        fprintf(f, "diffrag_kv_reuse_store_bytes %llu\n",
                (unsigned long long)atomic_load(&ws->kv_store_bytes));
        head(f, "diffrag_kv_reuse_store_chunks", "gauge", "Chunks the workers' chunk KV stores hold.");
        fprintf(f, "diffrag_kv_reuse_store_chunks %llu\n",
                (unsigned long long)atomic_load(&ws->kv_store_chunks));
        head(f, "diffrag_kv_reuse_records_total", "counter",
             "Chunk KV records of the document store (kv_reuse_store_bytes): copies taken from "
             "them (loaded), records written, reads and writes that failed (error).");
        fprintf(f, "diffrag_kv_reuse_records_total{op=\"loaded\"} %llu\n",
                (unsigned long long)atomic_load(&ws->kv_loaded));
        fprintf(f, "diffrag_kv_reuse_records_total{op=\"written\"} %llu\n",
                (unsigned long long)atomic_load(&ws->kv_written));
        fprintf(f, "diffrag_kv_reuse_records_total{op=\"error\"} %llu\n",
                (unsigned long long)atomic_load(&ws->kv_store_errors));
        uint64_t kv_bytes = 0, kv_records = 0;
        struct StoreReader *rd = NULL;
        if (m->store && !store_read_begin(m->store, &rd, NULL, 0)) {
            store_kv_usage(rd, &kv_bytes, &kv_records, NULL, 0);
            store_read_end(&rd);
        }
        head(f, "diffrag_kv_reuse_records_bytes", "gauge",
             "Bytes of the chunk KV records the document store holds.");
        fprintf(f, "diffrag_kv_reuse_records_bytes %llu\n", (unsigned long long)kv_bytes);
        head(f, "diffrag_kv_reuse_records", "gauge", "Chunk KV records the document store holds.");
        fprintf(f, "diffrag_kv_reuse_records %llu\n", (unsigned long long)kv_records);
    }
    head(f, "diffrag_store_damaged", "gauge",
         "1 when the store was found damaged and is served read-only, else 0.");
    fprintf(f, "diffrag_store_damaged %d\n", m->store && store_damaged(m->store, NULL, 0));
    pthread_mutex_unlock(&m->mu);
    if (fclose(f)) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

/* ---- HTTP ---- */

/* One polling thread serves every socket (epoll where available), so held sockets cost no
 * thread; the guard (http.h) drops slow clients. */
struct MetricsHttp {
    struct MHD_Daemon *d;
    struct Metrics *m;
    struct HttpGuard *guard;
};

/* A request ended (answered, or cut): the next one on this connection gets a fresh deadline. */
static void request_done(void *cls, struct MHD_Connection *c, void **state,
                         enum MHD_RequestTerminationCode toe)
{
    (void)state;
    (void)toe;
    struct MetricsHttp *h = cls;
    http_guard_request_done(h->guard, c);
}

static enum MHD_Result respond(struct MHD_Connection *c, unsigned status, char *body, size_t len,
                               const char *type)
{
    struct MHD_Response *r = body ? MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE)
                                  : NULL;
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    if (status == 400 || status == 501)   /* framing not to be trusted: no next request */
        MHD_add_response_header(r, "Connection", "close");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **state)
{
    (void)upload;
    struct MetricsHttp *h = cls;
    const char *text = "text/plain; charset=utf-8";
    if (*state == NULL) {   /* first call per request: headers only */
        *state = h;
        char why[160];
        unsigned bad = http_framing_check(c, method, version, why, sizeof why - 1);
        if (bad) {
            strcat(why, "\n");
            return respond(c, bad, strdup(why), strlen(why), text);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (strcmp(method, "GET") && strcmp(method, "HEAD"))
        return respond(c, 405, strdup("method not allowed\n"), 19, text);
    if (!strcmp(url, "/metrics")) {
        size_t len = 0;
        char *body = metrics_render(h->m, &len);
        if (!body)
            return respond(c, 500, strdup("out of memory\n"), 14, text);
        return respond(c, 200, body, len, "text/plain; version=0.0.4; charset=utf-8");
    }
    if (!strcmp(url, "/healthz"))
        return respond(c, 200, strdup("ok\n"), 3, text);
    if (!strcmp(url, "/readyz")) {
        char why[64], *body = malloc(80);
        int ready = metrics_is_ready(h->m, why, sizeof why);
        if (!body)
            return MHD_NO;
        int n = snprintf(body, 80, "%s\n", why);
        return respond(c, ready ? 200 : 503, body, (size_t)n, text);
    }
    return respond(c, 404, strdup("not found\n"), 10, text);
}

int metrics_http_start(struct Metrics *m, const char *hostport, struct MetricsHttp **out,
                       char *err, size_t errlen)
{
    *out = NULL;
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD;
    int fd;
    char why[256];
    if (http_bind("metrics_listen", hostport, &fd, &flags, why, sizeof why)) {
        snprintf(err, errlen, "cannot serve metrics: %s", why);
        return -1;
    }
    struct MetricsHttp *h = calloc(1, sizeof *h);
    if (!h) {
        snprintf(err, errlen, "out of memory");
        close(fd);
        return -1;
    }
    h->m = m;
    if (http_guard_new(METRICS_MAX_CONNECTIONS, METRICS_MAX_PER_IP, 0, METRICS_REQUEST_DEADLINE_S,
                       &h->guard, why, sizeof why)) {
        snprintf(err, errlen, "cannot serve metrics: %s", why);
        close(fd);
        free(h);
        return -1;
    }
    /* The endpoint reads no request body, so 16 KiB a connection is plenty. */
    h->d = MHD_start_daemon(flags, 0, NULL, NULL, handle, h, MHD_OPTION_LISTEN_SOCKET, fd,
                            MHD_OPTION_CONNECTION_LIMIT, http_guard_slots(h->guard),
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)METRICS_CONNECTION_MEMORY,
                            MHD_OPTION_CONNECTION_TIMEOUT, METRICS_IDLE_TIMEOUT_S,
                            MHD_OPTION_NOTIFY_CONNECTION, http_guard_notify, h->guard,
                            MHD_OPTION_NOTIFY_COMPLETED, request_done, h, MHD_OPTION_END);
    if (!h->d) {
        snprintf(err, errlen, "cannot serve metrics on %s: the HTTP server did not start", hostport);
        close(fd);
        http_guard_destroy(&h->guard);
        free(h);
        return -1;
    }
    *out = h;
    return 0;
}

void metrics_http_stop(struct MetricsHttp **hp)
{
    struct MetricsHttp *h = hp ? *hp : NULL;
    if (!h)
        return;
    MHD_stop_daemon(h->d);
    http_guard_destroy(&h->guard);
    free(h);
    *hp = NULL;
}
