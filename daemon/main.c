/* diffragd: the order of start-up (model, store, sockets, I/O threads, workers, metrics, the
 * HTTP API; what each step resolves and checks is startup.c's), the signals, and the orderly
 * shutdown after the broker has drained. With --worker it runs only worker threads that join a
 * broker elsewhere over TCP. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "daemon/broker.h"
#include "daemon/config.h"
#include "daemon/fault.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/openai.h"
#include "daemon/prep.h"
#include "daemon/startup.h"
#include "daemon/worker.h"
#include "daemon/zap.h"
#include "daemon/zutil.h"
#include "kernels/gpu.h"
#include "model/chunkkv.h"
#include "model/engine_gpu.h"
#include "model/gguf.h"
#include "model/kvpool.h"
#include "model/model.h"
#include "model/model_ctx.h"
#include "model/tokenizer.h"
#include "retriever/store.h"
#include "model/tokcount_model.h"
#include "text/tokcount.h"

#define DIFFRAGD_VERSION "0.1.0"

static volatile sig_atomic_t sig_term, sig_hup;

static void on_signal(int s)
{
    if (s == SIGHUP)
        sig_hup = 1;
    else
        sig_term = 1;
}

static void install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

/* Threads started while these are blocked never run the handlers, so the broker thread
 * (which unblocks them) is the one whose poll a signal interrupts. */
static void block_signals(int block)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(block ? SIG_BLOCK : SIG_UNBLOCK, &set, NULL);
}

/* The KV page pool of the process's CPU workers: kv_pool_bytes, or (auto) a full context for
 * every request the workers run at once, at most half the machine's memory and at least one
 * context per worker; plus prefix_cache_bytes more for cached prefixes. Pages a finished
 * request leaves behind stay cached either way until a worker needs them. */
static int start_kv_pool(const struct Model *m, const struct Config *c, int n,
                         const struct EngineOpts *eo, struct KvPool **pool)
{
    size_t page = kvpool_page_bytes(&m->cfg, eo->kv_type);
    size_t per_ctx = kvpool_pages_for(eo->n_ctx), pages;
    if (c->kv_pool_bytes) {
        pages = c->kv_pool_bytes / page;
        if (pages < 1) {
            dlog(LL_ERROR, "msg=\"kv_pool_bytes holds no page\" kv_pool_bytes=%zu page_bytes=%zu",
                 c->kv_pool_bytes, page);
            return -1;
        }
    } else {
        long phys = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
        size_t half = phys > 0 && psize > 0 ? (size_t)phys * (size_t)psize / 2 / page : SIZE_MAX;
        pages = (size_t)n * (size_t)c->max_running * per_ctx;
        if (pages > half)
            pages = half;
        if (pages < (size_t)n * per_ctx)
            pages = (size_t)n * per_ctx;
    }
    pages += c->prefix_cache_bytes / page;
    char err[256];
    if (kvpool_new(m, eo->kv_type, pages, c->prefix_cache != 0, pool, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"cannot reserve the KV pool\" error=\"%s\"", err);
        return -1;
    }
    dlog(LL_INFO, "msg=\"KV pool\" pages=%zu page_bytes=%zu bytes=%zu prefix_cache=%s", pages,
         page, pages * page, c->prefix_cache ? "on" : "off");
    return 0;
}

/* The in-process workers' batch figures, for /metrics. */
static struct WorkerStats worker_stats;

static int start_workers(void *zctx, struct Model *m, const char *model_name,
                         const struct Config *c, int n, const char *endpoint,
                         const char *const curve[3], struct Store *store, struct Worker **workers,
                         enum EngineDevice *device, struct KvPool **pool)
{
    struct WorkerOpts wo;
    memset(&wo, 0, sizeof wo);
    wo.endpoint = endpoint;
    wo.model_name = model_name;
    if (curve) {
        wo.curve_server = curve[0];
        wo.curve_public = curve[1];
        wo.curve_secret = curve[2];
    }
    wo.heartbeat_ms = (int)c->heartbeat_ms;
    wo.liveness = (int)c->heartbeat_liveness;
    startup_engine_opts(c, n, &wo.engine);
    /* the device: with cuda the weights go to the GPU once, with a KV pool shared by every
     * worker's sequences: kv_pool_bytes (bf16 keys and values), or a full context for every
     * request the workers run at once */
    char note[512];
    enum EngineDevice dev;
    long gpu_positions = (long)n * (long)c->max_running * wo.engine.n_ctx;
    if (m && c->kv_pool_bytes) {
        /* the bytes of one device page (a one-position sequence takes one) */
        size_t page_bytes, scratch;
        gpu_seq_estimate(&m->cfg, 1, 1, &page_bytes, &scratch);
        gpu_positions = (long)(c->kv_pool_bytes / page_bytes) * GPU_PAGE;
    }
    if (gpu_positions < 1)
        gpu_positions = 1;
    if (engine_device_select(m, c->device, gpu_positions, c->prefix_cache != 0, &dev, note,
                             sizeof note)) {
        dlog(LL_ERROR, "msg=\"cannot use the compute device\" device=%s error=\"%s\"", c->device,
             note);
        return -1;
    }
    wo.engine.device = dev;
    if (c->prefill_chunk == 0)
        wo.engine.chunk = dev == ENGINE_CUDA ? 8192 : 512;
    wo.step_tokens = (int)c->step_tokens;
    wo.step_ms = (int)c->step_ms;
    wo.max_running = (int)c->max_running;
    wo.stats = &worker_stats;
    wo.lookup = (int)c->lookup_tokens;
    wo.kv_reuse = (int)c->kv_reuse;
    wo.kv_reuse_recompute = c->kv_reuse_recompute;
    wo.kv_reuse_full = (int)c->kv_reuse_full_chunks;
    wo.kv_reuse_bytes = c->kv_reuse_bytes;
    wo.kv_store = c->kv_reuse_store_bytes ? store : NULL;
    wo.kv_store_bytes = c->kv_reuse_store_bytes;
    if (wo.kv_reuse && wo.kv_store && m)
        wo.kv_identity = chunkkv_identity(m, wo.engine.kv_type, engine_numerics());
    if (device)
        *device = dev;
    dlog(LL_INFO, "msg=\"compute device\" setting=%s device=%s numerics=\"%s\" note=\"%s\"",
         c->device, dev == ENGINE_CUDA ? "cuda" : "cpu",
         dev == ENGINE_CUDA ? gpu_numerics() : engine_numerics(), note[0] ? note : "as configured");
    if (dev == ENGINE_CPU && n > 0) {
        if (start_kv_pool(m, c, n, &wo.engine, pool))
            return -1;
        wo.engine.kv_pool = *pool;
    }
    for (int i = 0; i < n; i++) {
        char err[512];
        wo.index = i;
        if (worker_start(zctx, m, &wo, &workers[i], err, sizeof err)) {
            dlog(LL_ERROR, "msg=\"cannot start a worker\" worker=%d error=\"%s\" hint=\"lower "
                 "max_context_tokens or max_tokens, or raise kv_budget_bytes\"", i, err);
            return -1;
        }
    }
    dlog(LL_INFO, "msg=\"workers started\" workers=%d n_ctx=%d threads=%d kv_bytes_each=%zu",
         n, wo.engine.n_ctx, wo.engine.n_threads, n ? worker_kv_bytes(workers[0]) : (size_t)0);
    return 0;
}

static void log_model_loaded(const struct ServedModel *s, double t0)
{
    dlog(LL_INFO, "msg=\"model loaded\" model=\"%s\" architecture=%s quantization=%s load_s=%.2f",
         s->name, s->architecture, s->quantization, (zu_now_ms() - t0) / 1e3);
}

static int run_worker_mode(struct Config *c)
{
    char err[1024] = "";
    struct Model *m = NULL;
    struct ServedModel served;
    int n = c->workers > 0 ? (int)c->workers : 1;
    struct Worker **workers = calloc((size_t)n, sizeof *workers);
    double t0 = zu_now_ms();
    if (!workers || model_load(c->model, &m, err, sizeof err) ||
        startup_served_model(c->model, &served, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"cannot load the model\" error=\"%s\"", workers ? err : "out of memory");
        model_destroy(&m);
        free(workers);
        return 1;
    }
    log_model_loaded(&served, t0);
    if (model_rope_override(m, c->rope_scaling, (float)c->rope_factor, (int)c->rope_orig_ctx, err,
                            sizeof err) || startup_resolve_context(c, &m->cfg, m, n)) {
        if (err[0])
            dlog(LL_ERROR, "msg=\"bad RoPE override\" error=\"%s\"", err);
        model_destroy(&m);
        free(workers);
        return 1;
    }
    /* CurveZMQ toward the broker: its public key, and this worker's own key pair */
    char server[CURVE_KEY_Z85_LEN + 1], public_key[CURVE_KEY_Z85_LEN + 1], secret[CURVE_KEY_Z85_LEN + 1];
    const char *curve[3] = { server, public_key, secret };
    int loose = 0;
    if (c->curve_server_key[0] &&
        (curve_key_read(c->curve_server_key, server, NULL, err, sizeof err) ||
         curve_key_read(c->curve_secret_key_file, secret, &loose, err, sizeof err) ||
         curve_public_of(secret, public_key))) {
        dlog(LL_ERROR, "msg=\"cannot load the CurveZMQ keys\" error=\"%s\"", err);
        model_destroy(&m);
        free(workers);
        return 1;
    }
    if (c->curve_server_key[0])
        dlog(LL_INFO, "msg=\"CurveZMQ toward the broker\" public_key=%s", public_key);
    if (loose)
        dlog(LL_WARN, "msg=\"the CurveZMQ secret key file is readable by other users; chmod 600 it\"");
    block_signals(1);
    void *zctx = zmq_ctx_new();
    if (zctx && config_endpoint_ipv6(c->connect))
        zmq_ctx_set(zctx, ZMQ_IPV6, 1);
    struct KvPool *pool = NULL;
    int rc = start_workers(zctx, m, served.name, c, n, c->connect,
                           c->curve_server_key[0] ? curve : NULL, NULL, workers, NULL, &pool);
    memset(secret, 0, sizeof secret);
    block_signals(0);
    if (rc == 0) {
        sd_notify(0, "READY=1\nSTATUS=worker: joining the broker");
        dlog(LL_INFO, "msg=\"worker mode\" connect=%s workers=%d", c->connect, n);
        while (!sig_term) {
            struct timespec ts = { 0, 100 * 1000 * 1000 };
            nanosleep(&ts, NULL);
        }
        sd_notify(0, "STOPPING=1");
    }
    for (int i = 0; i < n; i++)
        worker_stop(&workers[i]);
    kvpool_destroy(&pool);
    zmq_ctx_term(zctx);
    free(workers);
    model_destroy(&m);
    dlog(LL_INFO, "msg=\"stopped\"");
    return rc ? 1 : 0;
}

static int run_daemon(struct Config *c, int argc, char **argv)
{
    char err[1024];
    struct Model *m = NULL;
    enum EngineDevice device = ENGINE_CPU;
    struct GgufFile *g = NULL;
    struct Tokenizer *tok_only = NULL;
    const struct Tokenizer *tok;
    struct TokCountModel *tcm = NULL;
    struct Store *store = NULL;
    struct Metrics *metrics = NULL;
    struct MetricsHttp *http = NULL;
    struct OpenAi *api = NULL;
    struct Broker *broker = NULL;
    struct PrepPool *prep = NULL;
    struct Grounding *ground = calloc(1, sizeof *ground);
    struct Zap *zap = NULL;
    struct ZapKeys *keys = NULL, *worker_keys = NULL;   /* until the ZAP handler owns them */
    size_t n_keys = 0, n_worker_keys = 0;
    char secret[CURVE_KEY_Z85_LEN + 1], public_key[CURVE_KEY_Z85_LEN + 1];
    void *zctx = NULL;
    int n_workers = (int)c->workers, rc = 1;
    struct Worker **workers = calloc((size_t)(n_workers > 0 ? n_workers : 1), sizeof *workers);
    struct KvPool *kv_pool = NULL;
    struct ServedModel served;

    dlog(LL_INFO, "msg=\"starting\" version=%s listen=%s worker_listen=\"%s\" workers=%d model=\"%s\" "
         "data_dir=\"%s\"", DIFFRAGD_VERSION, c->listen, c->worker_listen, n_workers, c->model,
         c->data_dir);
    double t0 = zu_now_ms();
    if (!workers || !ground)
        goto out;
    if (n_workers > 0) {
        if (model_load(c->model, &m, err, sizeof err)) {
            dlog(LL_ERROR, "msg=\"cannot load the model\" error=\"%s\"", err);
            goto out;
        }
        tok = m->tok;
    } else {
        /* remote workers only: the broker needs just the tokenizer for context assembly */
        if (gguf_open(c->model, &g, err, sizeof err) || tok_load_gguf(g, &tok_only, err, sizeof err)) {
            dlog(LL_ERROR, "msg=\"cannot load the tokenizer\" error=\"%s\"", err);
            goto out;
        }
        tok = tok_only;
    }
    if (startup_served_model(c->model, &served, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"cannot load the model\" error=\"%s\"", err);
        goto out;
    }
    log_model_loaded(&served, t0);
    if (m && model_rope_override(m, c->rope_scaling, (float)c->rope_factor, (int)c->rope_orig_ctx,
                                 err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"bad RoPE override\" error=\"%s\"", err);
        goto out;
    }
    if (m && startup_resolve_context(c, &m->cfg, m, n_workers))
        goto out;
    if (!m) {
        /* remote workers only: they check their own memory budget; here the model's context */
        struct ModelConfig mc;
        if (model_ctx_read(c->model, &mc, err, sizeof err) ||
            model_ctx_override(&mc, c->rope_scaling, (float)c->rope_factor, (int)c->rope_orig_ctx,
                               err, sizeof err)) {
            dlog(LL_ERROR, "msg=\"cannot read the model's context\" error=\"%s\"", err);
            goto out;
        }
        if (startup_resolve_context(c, &mc, NULL, 0))
            goto out;
    }
    if (startup_grounding(c, m, ground))
        goto out;
    struct StoreOptions so;
    store_options_default(&so);
    char damaged[512];
    if (startup_check_store(c, damaged, sizeof damaged))
        goto out;
    if (store_open(c->data_dir, &so, &store, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"cannot open the store\" data_dir=\"%s\" error=\"%s\"", c->data_dir, err);
        goto out;
    }
    if (damaged[0])
        store_mark_damaged(store, damaged);
    if (tokcount_model_new(tok, &tcm)) {
        dlog(LL_ERROR, "msg=\"out of memory\"");
        goto out;
    }
    struct PrepShared shared = { .store = store, .data_dir = c->data_dir,
                                 .max_doc_bytes = so.max_doc_bytes,
                                 .extract_helper = c->extract_helper };
    tokcount_model_counter(tcm, &shared.tc);
    if (metrics_new(DIFFRAGD_VERSION, c->device, served.name, served.architecture,
                    served.quantization, &metrics)) {
        dlog(LL_ERROR, "msg=\"out of memory\"");
        goto out;
    }
    metrics_set_ready(metrics, 1, 1);
    metrics_set_store(metrics, store);
    char threshold[32];
    snprintf(threshold, sizeof threshold, "%g", ground->threshold);
    if (metrics_set_detector(metrics, ground->calibrated ? ground->cal.name : "none",
                             ground->calibrated ? threshold : "none")) {
        dlog(LL_ERROR, "msg=\"out of memory\"");
        goto out;
    }

    if (startup_load_curve(c, secret, public_key, &keys, &n_keys, &worker_keys, &n_worker_keys,
                           err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"cannot load the CurveZMQ keys\" error=\"%s\"", err);
        goto out;
    }
    int curve = c->curve_secret_key_file[0] != 0;
    if (curve)
        dlog(LL_INFO, "msg=\"CurveZMQ on the client socket\" public_key=%s allowed_keys=%s", public_key,
             c->curve_allowed_keys[0] ? "listed" : "any");
    if (curve && !c->curve_allowed_keys[0])
        dlog(LL_WARN, "msg=\"curve_allowed_keys is empty: any client with the daemon's public key "
             "may connect\"");
    if (curve && c->curve_allowed_keys[0])
        dlog(LL_INFO, "msg=\"allowed client keys loaded\" keys=%zu", n_keys);
    if (curve && c->worker_listen[0])
        dlog(LL_INFO, "msg=\"CurveZMQ on the worker socket\" worker_keys=%zu", n_worker_keys);
    if (!curve && c->worker_listen[0] && !config_endpoint_loopback(c->worker_listen))
        dlog(LL_WARN, "msg=\"remote workers on %s are not authenticated: any peer that connects "
             "receives prompts; set curve_secret_key_file and curve_worker_keys\"", c->worker_listen);
    if (!curve && !config_endpoint_loopback(c->listen))
        dlog(LL_WARN, "msg=\"clients on %s are neither authenticated nor encrypted; set "
             "curve_secret_key_file (docs/security.md)\"", c->listen);
    if (c->metrics_listen[0] && !config_endpoint_loopback(c->metrics_listen))
        dlog(LL_WARN, "msg=\"metrics on %s are served to anyone who can reach it, without "
             "authentication; keep it on loopback or behind a firewall\"", c->metrics_listen);

    block_signals(1);
    zctx = zmq_ctx_new();
    /* the HTTP API opens a socket per request in flight, beside the daemon's own */
    if (zctx && c->http_listen[0])
        zmq_ctx_set(zctx, ZMQ_MAX_SOCKETS, 1024 + (int)c->http_max_connections);
    /* sockets made afterwards inherit it; IPv4 addresses still bind */
    if (zctx && (config_endpoint_ipv6(c->listen) || config_endpoint_ipv6(c->worker_listen)))
        zmq_ctx_set(zctx, ZMQ_IPV6, 1);
    if (zctx && curve && zap_start(zctx, &keys, &worker_keys, metrics, &zap, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"cannot start CurveZMQ authentication\" error=\"%s\"", err);
        block_signals(0);
        goto out;
    }
    struct BrokerOpts bo = {
        .cfg = c, .argc = argc, .argv = argv, .zctx = zctx, .metrics = metrics,
        .model_name = served.name, .model_architecture = served.architecture,
        .model_quantization = served.quantization, .vocab = tok_n_vocab(tok),
        .inproc_workers = n_workers,
        .io_threads = (int)c->io_threads, .version = DIFFRAGD_VERSION,
        .sig_term = &sig_term, .sig_hup = &sig_hup,
        .calibration = ground->calibrated ? &ground->cal : NULL, .threshold = ground->threshold,
        .watch = ground->watch_given ? ground->watch : NULL, .n_watch = ground->n_watch,
        .hidden = ground->hidden, .n_hidden = ground->n_hidden,
        .curve_secret = curve ? secret : NULL, .zap = zap,
    };
    int broker_rc = !zctx ? -1 : broker_new(&bo, &broker, err, sizeof err);
    memset(secret, 0, sizeof secret);   /* libzmq holds its own copy now */
    if (broker_rc) {
        dlog(LL_ERROR, "msg=\"cannot start the broker\" error=\"%s\"", zctx ? err : "zmq context");
        block_signals(0);
        goto out;
    }
    if (prep_start(zctx, BROKER_PREP_INPROC, (int)c->io_threads, &shared, &prep, err, sizeof err) ||
        start_workers(zctx, m, served.name, c, n_workers, BROKER_WORKERS_INPROC, NULL, store,
                      workers, &device, &kv_pool)) {
        if (prep)
            dlog(LL_ERROR, "msg=\"start-up failed\"");
        else
            dlog(LL_ERROR, "msg=\"cannot start the I/O threads\" error=\"%s\"", err);
        /* exit() only before ready: threads may be mid-start and cannot be joined cleanly */
        exit(1);
    }
    c->gpu_workers = n_workers > 0 && device == ENGINE_CUDA;
    if (n_workers > 0)
        metrics_set_backend(metrics, device == ENGINE_CUDA ? "cuda" : "cpu");
    metrics_set_kv_pool(metrics, kv_pool);
    if (c->gpu_workers)
        metrics_set_gpu_model(metrics, m);
    metrics_set_worker_stats(metrics, &worker_stats);
    if (c->metrics_listen[0] && metrics_http_start(metrics, c->metrics_listen, &http, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"cannot serve metrics\" error=\"%s\"", err);
        exit(1);
    }
    if (c->http_listen[0]) {
        struct OpenAiOpts ao = {
            .listen = c->http_listen, .api_key_file = c->http_api_key_file,
            .tls_cert_file = c->http_tls_cert_file, .tls_key_file = c->http_tls_key_file,
            .max_connections = (int)c->http_max_connections,
            .reserved_connections = (int)c->http_reserved_connections,
            .timeout_s = c->http_timeout,
            .max_body_bytes = c->http_max_body_bytes < c->max_message_bytes
                              ? c->http_max_body_bytes : c->max_message_bytes,
            .max_body_key = c->http_max_body_bytes < c->max_message_bytes
                            ? "http_max_body_bytes" : "max_message_bytes",
            .max_json_values = (size_t)c->http_max_json_values,
            .parse_slots = (int)c->http_parse_slots, .max_turn_bytes = c->max_turn_bytes,
            .default_collection = c->default_collection,
            .model_name = served.name, .model_architecture = served.architecture,
            .model_quantization = served.quantization, .zctx = zctx, .metrics = metrics,
        };
        if (openai_start(&ao, &api, err, sizeof err)) {
            dlog(LL_ERROR, "msg=\"cannot serve the HTTP API\" error=\"%s\"", err);
            exit(1);
        }
        if (!config_endpoint_loopback(c->http_listen) && !c->http_tls_cert_file[0])
            dlog(LL_WARN, "msg=\"the HTTP API on %s is plain HTTP: API keys and documents cross "
                 "the network in clear; set http_tls_cert_file or put a TLS proxy in front\"",
                 c->http_listen);
    }
    block_signals(0);
    dlog(LL_INFO, "msg=\"listening\" listen=%s metrics=\"%s\" http=\"%s\" io_threads=%ld", c->listen,
         c->metrics_listen, c->http_listen, c->io_threads);
    broker_run(broker);
    openai_stop(&api);
    metrics_http_stop(&http);
    for (int i = 0; i < n_workers; i++)
        worker_stop(&workers[i]);
    metrics_set_kv_pool(metrics, NULL);
    metrics_set_gpu_model(metrics, NULL);
    kvpool_destroy(&kv_pool);
    broker_farewell(broker);
    prep_join(&prep);
    broker_destroy(&broker);
    rc = 0;
out:
    zap_stop(&zap);
    zap_keys_destroy(&keys);
    zap_keys_destroy(&worker_keys);
    if (zctx)
        zmq_ctx_term(zctx);
    metrics_destroy(&metrics);
    tokcount_model_destroy(&tcm);
    store_close(&store);
    tok_destroy(&tok_only);
    gguf_close(&g);
    model_destroy(&m);
    free(workers);
    free(ground);
    if (rc == 0)
        dlog(LL_INFO, "msg=\"stopped\" store=closed");
    return rc;
}

int main(int argc, char **argv)
{
    struct Config cfg;
    struct ConfigCli cli;
    char err[1024];
    if (config_from_args(&cfg, &cli, argc, argv, err, sizeof err)) {
        fprintf(stderr, "diffragd: %s\n", err);
        return 2;
    }
    if (cli.help) {
        config_usage(stdout);
        return 0;
    }
    if (cli.version) {
        printf("diffragd %s\n", DIFFRAGD_VERSION);
        return 0;
    }
    if (config_validate(&cfg, err, sizeof err)) {
        fprintf(stderr, "diffragd: %s\n", err);
        return 2;
    }
    if (cli.print) {
        config_print(&cfg, stdout, 1);
        return 0;
    }
    if (cli.check)
        return startup_check_config(&cfg, cli.worker);
    dlog_level = dlog_level_parse(cfg.log_level);
    if (fault_init(err, sizeof err)) {
        fprintf(stderr, "diffragd: %s\n", err);
        return 2;
    }
    if (fault_armed()) {
        const char *f = getenv("DIFFRAGD_FAULTS");
        char q[256];
        dlog(LL_WARN, "msg=\"fault injection is armed (DIFFRAGD_FAULTS); for tests only\" faults=%s",
             dlog_quote(q, sizeof q, f, strlen(f)));
    }
    install_signals();
    if (cli.worker) {
        if (!cfg.connect[0]) {
            fprintf(stderr, "diffragd: --worker needs --connect tcp://HOST:PORT\n");
            return 2;
        }
        return run_worker_mode(&cfg);
    }
    return run_daemon(&cfg, argc, argv);
}
