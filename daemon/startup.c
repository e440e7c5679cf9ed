/* What diffragd resolves and checks at start-up, before it serves (startup.h): the engine
 * options, the context for the model against kv_budget_bytes, the groundedness calibration and
 * watched heads, the store's start-up check, the CurveZMQ keys, and --check-config. */
#include "daemon/startup.h"

#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "daemon/log.h"
#include "daemon/zutil.h"
#include "model/engine.h"
#include "model/ftype.h"
#include "model/gguf.h"
#include "model/model.h"
#include "model/model_ctx.h"
#include "retriever/status.h"
#include "retriever/store.h"

int startup_served_model(const char *path, struct ServedModel *out, char *err, size_t errlen)
{
    struct GgufFile *g = NULL;
    struct GgufString arch;
    memset(out, 0, sizeof *out);
    if (gguf_open(path, &g, err, errlen))
        return -1;
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    size_t n = strlen(base);
    if (n > 5 && !strcasecmp(base + n - 5, ".gguf"))
        n -= 5;
    snprintf(out->name, sizeof out->name, "%.*s", (int)(n < 127 ? n : 127), base);
    if (gguf_get_str(g, "general.architecture", &arch) == GGUF_OK && arch.len)
        snprintf(out->architecture, sizeof out->architecture, "%.*s",
                 (int)(arch.len < 31 ? arch.len : 31), arch.ptr);
    else
        snprintf(out->architecture, sizeof out->architecture, "unknown");
    ftype_describe(g, out->quantization, sizeof out->quantization);
    gguf_close(&g);
    return 0;
}

void startup_engine_opts(const struct Config *c, int n_workers, struct EngineOpts *o)
{
    engine_opts_default(o);
    o->n_ctx = (int)(config_max_context(c) + c->max_tokens);
    o->chunk = (int)c->prefill_chunk;
    o->kv_type = !strcmp(c->kv_type, "f32") ? KV_F32 : !strcmp(c->kv_type, "q8") ? KV_Q8 : KV_F16;
    o->mem_budget = c->kv_budget_bytes;
    long threads = c->threads;
    if (threads == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        threads = cores > 0 ? cores / (n_workers > 0 ? n_workers : 1) : 1;
        if (threads < 1)
            threads = 1;
    }
    o->n_threads = (int)threads;
}

/* ---- the context: max_context_tokens against the model's usable context ---- */

/* Whether engine_device_select's auto would try a GPU (its first test: a visible driver). */
static int gpu_visible(void)
{
    return access("/proc/driver/nvidia/version", R_OK) == 0 || access("/dev/nvidia0", F_OK) == 0;
}

/* The longest context (1..usable) whose estimate on `dev` fits kv_budget_bytes; 0: none. */
static long budget_ctx_on(const struct Model *m, const struct Config *c, int n_workers,
                          enum EngineDevice dev, long usable)
{
    struct EngineOpts o;
    startup_engine_opts(c, n_workers, &o);
    o.device = dev;
    o.chunk = c->prefill_chunk ? (int)c->prefill_chunk : dev == ENGINE_CUDA ? 8192 : 512;
    long lo = 0, hi = usable;
    while (lo < hi) {
        long mid = lo + (hi - lo + 1) / 2;
        struct EngineMemory mem;
        o.n_ctx = (int)mid;
        engine_estimate(m, &o, &mem);
        if (mem.context_bytes <= c->kv_budget_bytes) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* The longest context (1..usable) kv_budget_bytes holds on the device the workers will use
 * (auto with a visible GPU: the smaller of the CPU's and CUDA's estimates). */
static long budget_ctx(const struct Model *m, const struct Config *c, int n_workers, long usable)
{
    int cuda = !strcmp(c->device, "cuda"), cpu = !strcmp(c->device, "cpu");
    long fit = budget_ctx_on(m, c, n_workers, cuda ? ENGINE_CUDA : ENGINE_CPU, usable);
    if (!cuda && !cpu && gpu_visible()) {
        long g = budget_ctx_on(m, c, n_workers, ENGINE_CUDA, usable);
        if (g < fit) fit = g;
    }
    return fit;
}

int startup_resolve_context(struct Config *c, const struct ModelConfig *mc, const struct Model *m,
                            int n_workers)
{
    char why[192], err[512], budget[96] = "none", over[96] = "";
    long usable = model_ctx_usable(mc), n_ctx = usable;
    model_ctx_describe(mc, why, sizeof why);
    if (c->rope_scaling[0]) {
        if (strcmp(c->rope_scaling, "none"))
            snprintf(over, sizeof over, "%s x%g of %ld", c->rope_scaling, c->rope_factor,
                     c->rope_orig_ctx ? c->rope_orig_ctx : (long)mc->rope.orig_ctx);
        else
            snprintf(over, sizeof over, "none: the file's scaling off");
    }
    if (m && c->kv_budget_bytes && n_workers > 0) {
        long fit = budget_ctx(m, c, n_workers, usable);
        snprintf(budget, sizeof budget, "%ld", fit);
        if (fit < n_ctx) n_ctx = fit;
    }
    c->model_ctx = usable;
    c->ctx_auto = n_ctx - c->max_tokens;
    const char *chose = !c->max_context_tokens
        ? (n_ctx < usable ? "auto: what kv_budget_bytes holds minus max_tokens"
                          : "auto: the model's context minus max_tokens")
        : "as configured";
    if (!c->max_context_tokens && c->ctx_auto < 64) {
        dlog(LL_ERROR, "msg=\"no room for a prompt\" model_ctx=%ld source=\"%s\" budget_ctx=%s "
             "max_tokens=%ld error=\"a context of %ld tokens leaves %ld for the prompt after "
             "max_tokens; at least 64 are needed: lower max_tokens or raise kv_budget_bytes\"",
             usable, why, budget, c->max_tokens, n_ctx, c->ctx_auto);
        return -1;
    }
    if (config_validate(c, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"the context does not fit the model\" model_ctx=%ld source=\"%s\" "
             "rope_override=\"%s\" error=\"%s\"", usable, why, over, err);
        return -1;
    }
    dlog(LL_INFO, "msg=\"context\" model_ctx=%ld source=\"%s\" rope_override=\"%s\" "
         "budget_ctx=%s max_context_tokens=%ld max_tokens=%ld n_ctx=%ld chose=\"%s\"", usable,
         why, over, budget, config_max_context(c), c->max_tokens,
         config_max_context(c) + c->max_tokens, chose);
    return 0;
}

/* ---- groundedness: the calibration for the loaded model and the watched heads ---- */

static int is_explicit_calibration(const struct Config *c)
{
    return strcmp(c->grounding_calibration, "auto") && strcmp(c->grounding_calibration, "none");
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The first *.grounding file of dir (by name) whose model_sha256 is the model's; a file that
 * does not parse is skipped with a warning (nobody chose it). 1 when found. */
static int find_calibration(const char *dir, const uint8_t sha[32], struct GrCalibration *out,
                            char *found, size_t found_len)
{
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l <= 10 || strcmp(e->d_name + l - 10, ".grounding"))
            continue;
        if (n == cap) {
            char **nn = realloc(names, (cap = cap ? 2 * cap : 16) * sizeof *nn);
            if (!nn)
                break;
            names = nn;
        }
        if (!(names[n] = strdup(e->d_name)))
            break;
        n++;
    }
    closedir(d);
    if (n)
        qsort(names, n, sizeof *names, by_name);
    int hit = 0;
    for (size_t i = 0; i < n; i++) {
        char path[PATH_MAX + 256], err[512];
        int fits = (size_t)snprintf(path, sizeof path, "%s/%s", dir, names[i]) < sizeof path;
        if (!hit && fits) {
            if (gr_calibration_load(path, out, err, sizeof err)) {
                dlog(LL_WARN, "msg=\"grounding calibration skipped\" error=\"%s\"", err);
            } else if (!memcmp(out->model_sha256, sha, 32)) {
                snprintf(found, found_len, "%s", path);
                hit = 1;
            }
        }
        free(names[i]);
    }
    free(names);
    return hit;
}

/* Where `auto` looks for calibrations, in order: deploy/grounding under the working directory,
 * then beside the executable: the source tree its build directory lies in (build/diffragd or
 * build/asan/diffragd: ../deploy/grounding, ../../deploy/grounding), then the installed files
 * (PREFIX/share/diffrag/grounding beside PREFIX/bin). Returns how many it wrote into dirs. */
enum { CAL_DIRS = 4, CAL_DIR_LEN = PATH_MAX };
static int calibration_dirs(char dirs[CAL_DIRS][CAL_DIR_LEN])
{
    int n = 0;
    snprintf(dirs[n++], CAL_DIR_LEN, "deploy/grounding");
    char exe[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0)
        return n;
    exe[len] = 0;
    char *slash = strrchr(exe, '/');
    if (!slash)
        return n;
    *slash = 0;
    static const char *const rel[] = {"../deploy/grounding", "../../deploy/grounding",
                                      "../share/diffrag/grounding"};
    for (size_t i = 0; i < sizeof rel / sizeof *rel; i++) {
        char path[PATH_MAX], real[PATH_MAX];
        if ((size_t)snprintf(path, sizeof path, "%s/%s", exe, rel[i]) >= sizeof path)
            continue;
        /* the log names the folder without its dot-dots where it exists */
        snprintf(dirs[n++], CAL_DIR_LEN, "%s", realpath(path, real) ? real : path);
    }
    return n;
}

int startup_grounding(const struct Config *c, const struct Model *m, struct Grounding *g)
{
    char err[1024], found[PATH_MAX + 256] = "";
    memset(g, 0, sizeof *g);
    if (strcmp(c->grounding_calibration, "none")) {
        uint8_t sha[32];
        char hex[65];
        double t0 = zu_now_ms();
        if (gr_file_sha256(c->model, sha, err, sizeof err)) {
            dlog(LL_ERROR, "msg=\"cannot hash the model\" error=\"%s\"", err);
            return -1;
        }
        gr_sha256_hex(sha, hex);
        dlog(LL_DEBUG, "msg=\"model hashed\" sha256=%s hash_ms=%.0f", hex, zu_now_ms() - t0);
        if (is_explicit_calibration(c)) {
            if (gr_calibration_load(c->grounding_calibration, &g->cal, err, sizeof err)) {
                dlog(LL_ERROR, "msg=\"bad grounding calibration\" error=\"%s\"", err);
                return -1;
            }
            if (memcmp(g->cal.model_sha256, sha, 32)) {
                char want[65];
                gr_sha256_hex(g->cal.model_sha256, want);
                dlog(LL_WARN, "msg=\"grounding calibration is for another model; answers get "
                     "signals but no score\" calibration=\"%s\" calibration_sha256=%s "
                     "model_sha256=%s", c->grounding_calibration, want, hex);
            } else {
                g->calibrated = 1;
                snprintf(found, sizeof found, "%s", c->grounding_calibration);
            }
        } else {
            char dirs[CAL_DIRS][CAL_DIR_LEN], looked[CAL_DIRS * (CAL_DIR_LEN + 2)] = "";
            int nd = calibration_dirs(dirs);
            for (int i = 0; i < nd && !g->calibrated; i++) {
                g->calibrated = find_calibration(dirs[i], sha, &g->cal, found, sizeof found);
                size_t at = strlen(looked);
                snprintf(looked + at, sizeof looked - at, "%s%s", i ? ", " : "", dirs[i]);
            }
            if (!g->calibrated)
                dlog(LL_INFO, "msg=\"no grounding calibration for this model; answers get "
                     "signals but no score\" model_sha256=%s looked_in=\"%s\"", hex, looked);
        }
    }
    if (g->calibrated) {
        g->threshold = g->cal.threshold;
        for (int i = 0; i < g->cal.n_watch; i++) {
            g->watch[2 * i] = g->cal.watch[i].layer;
            g->watch[2 * i + 1] = g->cal.watch[i].head;
        }
        g->n_watch = (size_t)g->cal.n_watch;
        g->watch_given = 1;
    } else if (strcmp(c->grounding_heads, "auto")) {
        struct GrHead heads[GR_MAX_WATCH];
        int n;
        if (gr_parse_heads(c->grounding_heads, heads, GR_MAX_WATCH, &n, err, sizeof err)) {
            dlog(LL_ERROR, "msg=\"bad grounding_heads\" error=\"%s\"", err);
            return -1;
        }
        for (int i = 0; i < n; i++) {
            g->watch[2 * i] = heads[i].layer;
            g->watch[2 * i + 1] = heads[i].head;
        }
        g->n_watch = (size_t)n;
        g->watch_given = 1;
    }
    if (c->grounding_threshold[0])
        g->threshold = strtod(c->grounding_threshold, NULL);   /* validated with the config */
    int layers[GR_MAX_HIDDEN], nl;
    if (gr_parse_layers(c->grounding_hidden_layers, layers, GR_MAX_HIDDEN, &nl, err, sizeof err)) {
        dlog(LL_ERROR, "msg=\"bad grounding_hidden_layers\" error=\"%s\"", err);
        return -1;
    }
    for (int i = 0; i < nl; i++) {
        if (m && layers[i] > m->cfg.n_layer) {
            dlog(LL_ERROR, "msg=\"grounding_hidden_layers: layer outside the model\" layer=%d "
                 "layers=%d", layers[i], m->cfg.n_layer);
            return -1;
        }
        g->hidden[g->n_hidden++] = layers[i];
    }
    /* the probe's layer is captured for every answer */
    if (g->calibrated && g->cal.probe_layer >= 0) {
        if (m && (g->cal.probe_layer > m->cfg.n_layer ||
                  !gr_probe_fits(&g->cal, (size_t)m->cfg.dim))) {
            dlog(LL_ERROR, "msg=\"grounding calibration's probe does not fit the model\" "
                 "file=\"%s\" probe_layer=%d probe_weights=%d layers=%d dim=%d", found,
                 g->cal.probe_layer, g->cal.n_probe, m->cfg.n_layer, m->cfg.dim);
            return -1;
        }
        size_t i = 0;
        while (i < g->n_hidden && g->hidden[i] != g->cal.probe_layer)
            i++;
        if (i == g->n_hidden) {
            if (g->n_hidden == GR_MAX_HIDDEN) {
                dlog(LL_ERROR, "msg=\"grounding_hidden_layers leaves no room for the "
                     "calibration's probe layer\" layers=%d", GR_MAX_HIDDEN);
                return -1;
            }
            g->hidden[g->n_hidden++] = g->cal.probe_layer;
        }
    }
    if (m && g->watch_given) {
        int layers = m->cfg.n_layer;
        int heads = m->cfg.arch == ARCH_DIFFV2 ? m->cfg.n_head : m->cfg.n_q_head;
        /* a calibration's heads take grounding_heads' place, but a value naming heads the
         * model lacks is wrong either way (--check-config refuses it too) */
        if (g->calibrated && config_check_heads(c->grounding_heads, layers, heads, err, sizeof err)) {
            dlog(LL_ERROR, "msg=\"bad grounding_heads\" error=\"%s\"", err);
            return -1;
        }
        for (size_t i = 0; i < g->n_watch; i++)
            if (g->watch[2 * i] >= layers || g->watch[2 * i + 1] >= heads) {
                dlog(LL_ERROR, "msg=\"watched head outside the model\" head=%d:%d layers=%d "
                     "heads=%d source=\"%s\"", g->watch[2 * i], g->watch[2 * i + 1], layers, heads,
                     g->calibrated ? found : "grounding_heads");
                return -1;
            }
    }
    if (g->calibrated)
        dlog(LL_INFO, "msg=\"grounding detector\" calibration=%s file=\"%s\" threshold=%g "
             "window=%d stride=%d watched_heads=%zu length_knots=%d long_probe_from=%zu "
             "short_probe_until=%zu", g->cal.name, found, g->threshold, g->cal.window,
             g->cal.stride, g->n_watch, g->cal.n_knots, g->cal.long_probe_from,
             g->cal.short_probe_until);
    return 0;
}

int startup_check_store(const struct Config *c, char *damaged, size_t cap)
{
    struct StoreVerifyReport rep;
    char err[1024], q[1200], dir[600], hint[1200], qhint[1300];
    double t0 = zu_now_ms();
    damaged[0] = 0;
    int st = store_check_file(c->data_dir, err, sizeof err), file_ok = st == RET_OK;
    if (file_ok)
        st = store_check_isolated(c->data_dir, NULL, STORE_CHECK_SAMPLE, NULL, 60.0, &rep, err,
                                  sizeof err);
    dlog_quote(q, sizeof q, err, strlen(err));
    dlog_quote(dir, sizeof dir, c->data_dir, strlen(c->data_dir));
    if (st == RET_OK) {
        dlog(LL_INFO, "msg=\"store checked\" data_dir=%s collections=%llu records=%llu check_ms=%.0f",
             dir, (unsigned long long)rep.collections,
             (unsigned long long)(rep.docs + rep.chunks + rep.postings), zu_now_ms() - t0);
        return 0;
    }
    if (st != RET_ECORRUPT) {
        /* not a finding (e.g. another schema version): opening the store reports it */
        if (st != RET_EVERSION)
            dlog(LL_WARN, "msg=\"store not checked\" data_dir=%s error=%s", dir, q);
        return 0;
    }
    snprintf(hint, sizeof hint, "run diffrag-store --data-dir %s verify; restore a backup or "
             "rebuild the store%s", c->data_dir, file_ok && !c->allow_damaged_store
             ? " (allow_damaged_store = 1 serves it read-only meanwhile)" : "");
    dlog_quote(qhint, sizeof qhint, hint, strlen(hint));
    if (!file_ok || !c->allow_damaged_store) {
        dlog(LL_ERROR, "msg=\"the store is damaged; not starting\" data_dir=%s error=%s hint=%s",
             dir, q, qhint);
        return -1;
    }
    dlog(LL_WARN, "msg=\"the store is damaged; serving it read-only (allow_damaged_store)\" "
         "data_dir=%s error=%s hint=%s", dir, q, qhint);
    snprintf(damaged, cap, "%s", err);
    return 0;
}

int startup_load_curve(const struct Config *c, char secret[CURVE_KEY_Z85_LEN + 1],
                       char public_key[CURVE_KEY_Z85_LEN + 1], struct ZapKeys **keys,
                       size_t *n_keys, struct ZapKeys **worker_keys, size_t *n_worker_keys,
                       char *err, size_t errlen)
{
    int loose = 0;
    *keys = *worker_keys = NULL;
    *n_keys = *n_worker_keys = 0;
    if (!c->curve_secret_key_file[0])
        return 0;
    if (curve_key_read(c->curve_secret_key_file, secret, &loose, err, errlen))
        return -1;
    if (curve_public_of(secret, public_key)) {
        snprintf(err, errlen, "%s: not a CurveZMQ secret key", c->curve_secret_key_file);
        return -1;
    }
    if (loose)
        dlog(LL_WARN, "msg=\"the CurveZMQ secret key file is readable by other users; chmod 600 it\" "
             "file=\"%s\"", c->curve_secret_key_file);
    if (c->curve_allowed_keys[0] && zap_keys_load(c->curve_allowed_keys, keys, n_keys, err, errlen))
        return -1;
    if (c->curve_worker_keys[0] && c->worker_listen[0] &&
        zap_keys_load(c->curve_worker_keys, worker_keys, n_worker_keys, err, errlen)) {
        zap_keys_destroy(keys);
        return -1;
    }
    if (c->curve_server_key[0]) {
        char server[CURVE_KEY_Z85_LEN + 1];
        if (curve_key_read(c->curve_server_key, server, NULL, err, errlen)) {
            zap_keys_destroy(keys);
            zap_keys_destroy(worker_keys);
            return -1;
        }
    }
    return 0;
}

/* What start-up refuses about kv_budget_bytes, said before it: no room for a prompt
 * (max_context_tokens 0) or an explicit context the budget cannot hold. 0, or 1 after saying
 * why on stderr. */
static int check_budget(const struct Config *c, int n_workers)
{
    char err[1024];
    struct Model *m = NULL;
    if (model_load(c->model, &m, err, sizeof err) ||
        model_rope_override(m, c->rope_scaling, (float)c->rope_factor, (int)c->rope_orig_ctx, err,
                            sizeof err)) {
        fprintf(stderr, "diffragd: model: %s\n", err);
        model_destroy(&m);
        return 1;
    }
    long usable = model_usable_ctx(m), fit = budget_ctx(m, c, n_workers, usable);
    long need = c->max_context_tokens ? c->max_context_tokens + c->max_tokens : 64 + c->max_tokens;
    model_destroy(&m);
    if (fit >= need)
        return 0;
    if (c->max_context_tokens)
        fprintf(stderr, "diffragd: kv_budget_bytes %zu holds a context of %ld tokens; "
                "max_context_tokens %ld + max_tokens %ld = %ld do not fit: lower them, or raise "
                "kv_budget_bytes\n", c->kv_budget_bytes, fit, c->max_context_tokens, c->max_tokens,
                need);
    else
        fprintf(stderr, "diffragd: kv_budget_bytes %zu holds a context of %ld tokens: after "
                "max_tokens %ld that leaves under the 64 a prompt needs; lower max_tokens or "
                "raise kv_budget_bytes\n", c->kv_budget_bytes, fit, c->max_tokens);
    return 1;
}

int startup_check_config(const struct Config *c, int worker_mode)
{
    char err[1024];
    char secret[CURVE_KEY_Z85_LEN + 1], public_key[CURVE_KEY_Z85_LEN + 1];
    struct ZapKeys *keys = NULL, *worker_keys = NULL;
    size_t n_keys, n_worker_keys;
    if (startup_load_curve(c, secret, public_key, &keys, &n_keys, &worker_keys, &n_worker_keys,
                           err, sizeof err)) {
        fprintf(stderr, "diffragd: CurveZMQ: %s\n", err);
        return 2;
    }
    zap_keys_destroy(&keys);
    zap_keys_destroy(&worker_keys);
    memset(secret, 0, sizeof secret);
    /* the header: the file opens, grounding_heads names heads it has, the context fits */
    if (config_check_model(c, err, sizeof err)) {
        fprintf(stderr, "diffragd: %s\n", err);
        return 1;
    }
    /* kv_budget_bytes: the memory of a context needs the loaded model's estimate */
    int n_workers = worker_mode ? (c->workers > 0 ? (int)c->workers : 1) : (int)c->workers;
    if (c->kv_budget_bytes && n_workers > 0 && check_budget(c, n_workers))
        return 1;
    if (!worker_mode && is_explicit_calibration(c)) {
        struct GrCalibration *cal = malloc(sizeof *cal);
        if (!cal || gr_calibration_load(c->grounding_calibration, cal, err, sizeof err)) {
            fprintf(stderr, "diffragd: grounding_calibration: %s\n", cal ? err : "out of memory");
            free(cal);
            return 2;
        }
        free(cal);
    }
    if (worker_mode && !c->connect[0]) {
        fprintf(stderr, "diffragd: --worker needs connect (the broker's worker endpoint)\n");
        return 1;
    }
    printf("diffragd: configuration ok\n");
    return 0;
}
