/* diffragd's Prometheus metrics and its HTTP endpoint (libmicrohttpd): GET /metrics in the text
 * exposition format, /healthz (the process answers) and /readyz (model loaded, store open, at
 * least one worker ready). Observations come from the broker thread; the HTTP thread renders
 * under the same mutex. Names follow diffrag_<noun>_<unit>, counters end in _total, and no
 * label carries a per-request value. */
#ifndef DIFFRAG_METRICS_H
#define DIFFRAG_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/grounding.h"
#include "daemon/proto.h"

struct Metrics;

/* version, backend, model, architecture and quantization label diffrag_build_info (the model,
 * as startup.h's ServedModel names it); copied. 0 or -1 (out of memory). */
int metrics_new(const char *version, const char *backend, const char *model,
                const char *architecture, const char *quantization, struct Metrics **out);
void metrics_destroy(struct Metrics **m);

void metrics_request(struct Metrics *m, enum Op op, enum ErrCode code, double seconds);

/* One finished query (negative values: not observed, e.g. no token was generated). */
struct QueryObs {
    double queue_s, retrieval_s, ttft_s, tpot_s, prefill_tps;
    uint64_t prompt_tokens, generated_tokens, context_tokens;
    uint64_t cached_tokens;   /* of the prompt tokens, those taken from the prefix cache */
    int finish;               /* how it ended: enum WireFinish (stop, length, cancelled, deadline) */
};
void metrics_query(struct Metrics *m, const struct QueryObs *q);
void metrics_worker_lost(struct Metrics *m);
/* The groundedness figures of one answer (docs/groundedness.md#metrics). */
void metrics_grounding(struct Metrics *m, const struct GrSummary *g);
/* What the answer policy (unsupported) made of one answered query: enum MetricsOutcome, and
 * when declined, enum MetricsDecline (docs/groundedness.md#declining). */
enum MetricsOutcome { MO_ANSWERED, MO_FLAGGED, MO_DECLINED, MO_COUNT };
enum MetricsDecline { MD_NO_MATCH, MD_FLAGGED, MD_MODEL_REFUSED, MD_COUNT };
const char *metrics_outcome_name(int outcome);   /* "answered", "flagged", "declined" */
const char *metrics_decline_name(int reason);    /* "no_match", "flagged", "model_refused" */
void metrics_outcome(struct Metrics *m, int outcome, int decline_reason);
/* The detector in use, for diffrag_hallucination_detector_info: the calibration's name (or
 * "none") and its threshold as text (or "none"); copied. 0 or -1 (out of memory). */
int metrics_set_detector(struct Metrics *m, const char *calibration, const char *threshold);
/* The HTTP API (openai.c, any thread): a response by endpoint ("chat_completions", "models",
 * "other") and HTTP status; a client that left before its answer ended (its query cancelled);
 * the connections open now. */
void metrics_http_request(struct Metrics *m, const char *endpoint, int status);
void metrics_http_disconnect(struct Metrics *m);
void metrics_http_connections(struct Metrics *m, int open);
/* One CurveZMQ handshake decided by the ZAP handler (any thread). */
void metrics_auth(struct Metrics *m, int allowed);

void metrics_gauges(struct Metrics *m, int queue_depth, int inflight, int workers_idle,
                    int workers_busy, int running, uint64_t kv_cache_bytes);
/* Readiness parts; /readyz is 200 only when all hold and a worker is ready. */
void metrics_set_ready(struct Metrics *m, int model_loaded, int store_open);
/* The store whose damaged mark (store_damaged) /metrics shows as diffrag_store_damaged and
 * /readyz as "store: read-only (damaged)" (still ready: reads are served); borrowed, it must
 * outlive the HTTP server. */
struct Store;
void metrics_set_store(struct Metrics *m, struct Store *store);
/* The in-process workers' KV pool, whose pages /metrics shows (diffrag_kv_pool_*); borrowed,
 * NULL before it is freed. */
struct KvPool;
void metrics_set_kv_pool(struct Metrics *m, struct KvPool *pool);
/* The model whose GPU KV pool /metrics shows instead (workers on a GPU); borrowed, NULL before
 * the model leaves the device. */
struct Model;
void metrics_set_gpu_model(struct Metrics *m, const struct Model *model);
/* The in-process workers' batch figures (diffrag_preemptions_total, diffrag_step_tokens);
 * borrowed, it must outlive the HTTP server. */
struct WorkerStats;
void metrics_set_worker_stats(struct Metrics *m, struct WorkerStats *stats);
/* The compute backend label of diffrag_build_info, once the device setting is resolved. */
void metrics_set_backend(struct Metrics *m, const char *backend);
/* After SIGTERM /readyz answers 503 "draining", so balancers stop sending new work. */
void metrics_set_draining(struct Metrics *m);
/* 1 when ready; otherwise 0 and why (e.g. "no worker ready"). */
int metrics_is_ready(struct Metrics *m, char *why, size_t cap);

/* The exposition text, malloc'ed (caller frees); NULL when out of memory. */
char *metrics_render(struct Metrics *m, size_t *len);

struct MetricsHttp;
/* Serves m on "HOST:PORT" (an IPv4 or IPv6 literal, or "localhost") from one polling thread,
 * with a deadline for each whole request and limits on connections in total and per client
 * address, at which the longest-held connection is dropped for the new one (so probes get
 * through slow clients; docs/security.md#the-metrics-endpoint). 0, or -1 with err. */
int metrics_http_start(struct Metrics *m, const char *hostport, struct MetricsHttp **out,
                       char *err, size_t errlen);
void metrics_http_stop(struct MetricsHttp **h);

#endif
