/* The configuration's readers over its key table (config_keys.c): embedded defaults, the
 * `key = value` file, the command line, cross-key validation, printing, and the SIGHUP reload
 * of the keys that can change while running. */
#include "daemon/config.h"
#include "daemon/config_keys.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/grounding.h"
#include "daemon/log.h"
#include "model/gguf.h"
#include "model/model_ctx.h"
#include "text/utf8.h"


int config_unsupported_parse(const char *name, size_t len)
{
    static const char *const names[] = { "answer", "mark", "decline" };
    for (int i = 0; i < 3; i++)
        if (len == strlen(names[i]) && !memcmp(name, names[i], len))
            return i;
    return -1;
}

int config_answer_mode_parse(const char *name, size_t len)
{
    if (len == 4 && !memcmp(name, "free", 4))
        return ANSWER_FREE;
    if (len == 5 && !memcmp(name, "quote", 5))
        return ANSWER_QUOTE;
    return -1;
}

static const struct Key *find_key(const char *name, size_t len)
{
    char norm[64];
    if (len >= sizeof norm)
        return NULL;
    for (size_t i = 0; i < len; i++)
        norm[i] = name[i] == '-' ? '_' : name[i];
    norm[len] = 0;
    for (size_t i = 0; i < config_n_keys; i++)
        if (!strcmp(config_keys[i].name, norm))
            return &config_keys[i];
    return NULL;
}

static int parse_size(const char *s, size_t *out)
{
    char *end;
    while (isspace((unsigned char)*s))
        s++;
    if (!isdigit((unsigned char)*s))
        return -1;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v) || v < 0)
        return -1;
    while (isspace((unsigned char)*end))
        end++;
    double mul = 1;
    static const struct { const char *suf; double mul; } sufs[] = {
        { "", 1 }, { "b", 1 }, { "k", 1024.0 }, { "kb", 1024.0 }, { "kib", 1024.0 },
        { "m", 1048576.0 }, { "mb", 1048576.0 }, { "mib", 1048576.0 },
        { "g", 1073741824.0 }, { "gb", 1073741824.0 }, { "gib", 1073741824.0 },
        { "t", 1099511627776.0 }, { "tb", 1099511627776.0 }, { "tib", 1099511627776.0 },
    };
    size_t i;
    for (i = 0; i < sizeof sufs / sizeof sufs[0]; i++)
        if (!strcasecmp(end, sufs[i].suf)) {
            mul = sufs[i].mul;
            break;
        }
    if (i == sizeof sufs / sizeof sufs[0])
        return -1;
    v *= mul;
    if (v > 1e18)
        return -1;
    if (v != floor(v))
        return -2;   /* 1.5 would silently become 1 byte; 1.5k (1536) is whole */
    *out = (size_t)v;
    return 0;
}

static int set_key(struct Config *c, const struct Key *k, const char *value, char *err, size_t errlen)
{
    char *dst = (char *)c + k->off;
    char *end;
    switch (k->type) {
    case K_STR: {
        size_t n = strlen(value);
        if (n >= k->cap) {
            snprintf(err, errlen, "%s: value longer than %zu bytes", k->name, k->cap - 1);
            return -1;
        }
        memcpy(dst, value, n + 1);
        /* ZeroMQ binds addresses and interface names, not host names: localhost would fail
         * with "No such device". Same length, so it fits wherever the name did. */
        if ((k->off == offsetof(struct Config, listen) ||
             k->off == offsetof(struct Config, worker_listen)) &&
            !strncmp(dst, "tcp://localhost:", 16))
            memcpy(dst + 6, "127.0.0.1", 9);
        return 0;
    }
    case K_LONG: {
        errno = 0;
        long v = strtol(value, &end, 10);
        while (end && isspace((unsigned char)*end))
            end++;
        if (errno || end == value || *end || !*value) {
            snprintf(err, errlen, "%s: not an integer: \"%s\"", k->name, value);
            return -1;
        }
        if (v < k->min || v > k->max) {
            snprintf(err, errlen, "%s: %ld is outside %.0f..%.0f", k->name, v, k->min, k->max);
            return -1;
        }
        memcpy(dst, &v, sizeof v);
        return 0;
    }
    case K_SIZE: {
        size_t v;
        int prc = parse_size(value, &v);
        if (prc == -2) {
            snprintf(err, errlen, "%s: \"%s\" is not a whole number of bytes", k->name, value);
            return -1;
        }
        if (prc) {
            snprintf(err, errlen, "%s: not a size (bytes, or with k/M/G/T): \"%s\"", k->name, value);
            return -1;
        }
        if ((double)v < k->min || (double)v > k->max) {
            snprintf(err, errlen, "%s: %zu is outside %.0f..%.0f", k->name, v, k->min, k->max);
            return -1;
        }
        memcpy(dst, &v, sizeof v);
        return 0;
    }
    case K_DOUBLE: {
        errno = 0;
        double v = strtod(value, &end);
        if (end && *end == 's')
            end++;
        if (errno || end == value || *end || !isfinite(v)) {
            snprintf(err, errlen, "%s: not a number: \"%s\"", k->name, value);
            return -1;
        }
        if (v < k->min || v > k->max) {
            snprintf(err, errlen, "%s: %g is outside %g..%g", k->name, v, k->min, k->max);
            return -1;
        }
        memcpy(dst, &v, sizeof v);
        return 0;
    }
    }
    return -1;
}

void config_defaults(struct Config *c)
{
    char err[256];
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < config_n_keys; i++)
        if (set_key(c, &config_keys[i], config_keys[i].def, err, sizeof err))
            dlog(LL_ERROR, "msg=\"bad embedded default\" detail=\"%s\"", err); /* a table bug */
}

int config_set(struct Config *c, const char *key, const char *value, char *err, size_t errlen)
{
    const struct Key *k = find_key(key, strlen(key));
    if (!k) {
        snprintf(err, errlen, "unknown key \"%s\"", key);
        return -1;
    }
    return set_key(c, k, value, err, errlen);
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1]))
        s[--n] = 0;
    return s;
}

int config_load_file(struct Config *c, const char *path, int must_exist, int *loaded, char *err,
                     size_t errlen)
{
    if (loaded)
        *loaded = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT && !must_exist)
            return 0;
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    char line[4096];
    int lineno = 0, rc = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n') {
            snprintf(err, errlen, "%s:%d: line too long", path, lineno);
            rc = -1;
            break;
        }
        char *s = trim(line);
        if (!*s || *s == '#' || *s == ';')
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            snprintf(err, errlen, "%s:%d: expected `key = value`", path, lineno);
            rc = -1;
            break;
        }
        *eq = 0;
        char *key = trim(s), *val = trim(eq + 1);
        if (*val == '"') {
            char *close = strrchr(val + 1, '"');
            if (!close) {
                snprintf(err, errlen, "%s:%d: unterminated quote", path, lineno);
                rc = -1;
                break;
            }
            char *rest = trim(close + 1);
            if (*rest && *rest != '#') {
                snprintf(err, errlen, "%s:%d: text after the quoted value", path, lineno);
                rc = -1;
                break;
            }
            *close = 0;
            val++;
        } else {
            /* a comment after the value needs whitespace before its # */
            for (char *h = val; *h; h++)
                if (*h == '#' && h > val && isspace((unsigned char)h[-1])) {
                    *h = 0;
                    val = trim(val);
                    break;
                }
        }
        char kerr[512];
        if (config_set(c, key, val, kerr, sizeof kerr)) {
            snprintf(err, errlen, "%s:%d: %s", path, lineno, kerr);
            rc = -1;
            break;
        }
    }
    if (rc == 0 && ferror(f)) {
        snprintf(err, errlen, "%s: read error", path);
        rc = -1;
    }
    fclose(f);
    if (rc == 0 && loaded)
        *loaded = 1;
    return rc;
}

static int is_flag(const char *a, const char *name)
{
    return !strcmp(a, name);
}

int config_from_args(struct Config *c, struct ConfigCli *cli, int argc, char **argv, char *err,
                     size_t errlen)
{
    memset(cli, 0, sizeof *cli);
    /* First pass: flags, and where the file is. */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (is_flag(a, "--config") || is_flag(a, "-c")) {
            if (i + 1 >= argc) {
                snprintf(err, errlen, "%s needs a file", a);
                return -1;
            }
            cli->config_path = argv[++i];
        } else if (!strncmp(a, "--config=", 9)) {
            cli->config_path = a + 9;
        } else if (is_flag(a, "--check-config")) {
            cli->check = 1;
        } else if (is_flag(a, "--print-config")) {
            cli->print = 1;
        } else if (is_flag(a, "--worker")) {
            cli->worker = 1;
        } else if (is_flag(a, "--help") || is_flag(a, "-h")) {
            cli->help = 1;
        } else if (is_flag(a, "--version")) {
            cli->version = 1;
        } else if (!strncmp(a, "--", 2) && a[2]) {
            const char *eqs = strchr(a, '=');
            size_t klen = eqs ? (size_t)(eqs - a - 2) : strlen(a + 2);
            if (!find_key(a + 2, klen)) {
                snprintf(err, errlen, "unknown option %s", a);
                return -1;
            }
            if (!eqs) {
                if (i + 1 >= argc) {
                    snprintf(err, errlen, "%s needs a value", a);
                    return -1;
                }
                i++;
            }
        } else {
            snprintf(err, errlen, "unexpected argument \"%s\"", a);
            return -1;
        }
    }
    config_defaults(c);
    const char *path = cli->config_path ? cli->config_path : CONFIG_DEFAULT_PATH;
    if (config_load_file(c, path, cli->config_path != NULL, NULL, err, errlen))
        return -1;
    /* Second pass: keys override the file. */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (is_flag(a, "--config") || is_flag(a, "-c")) {
            i++;
            continue;
        }
        if (strncmp(a, "--", 2) || !a[2])
            continue;
        const char *eqs = strchr(a, '=');
        size_t klen = eqs ? (size_t)(eqs - a - 2) : strlen(a + 2);
        const struct Key *k = find_key(a + 2, klen);
        if (!k || !strncmp(a, "--config=", 9))
            continue;
        const char *val = eqs ? eqs + 1 : argv[++i];
        if (set_key(c, k, val, err, errlen))
            return -1;
    }
    return 0;
}

int config_validate(const struct Config *c, char *err, size_t errlen)
{
    if (config_check_zmq_endpoint("listen", c->listen, 1, err, errlen))
        return -1;
    if (c->worker_listen[0] && config_check_zmq_endpoint("worker_listen", c->worker_listen, 1, err, errlen))
        return -1;
    if (c->connect[0] && config_check_zmq_endpoint("connect", c->connect, 0, err, errlen))
        return -1;
    if (c->metrics_listen[0] && config_check_http_listen("metrics_listen", c->metrics_listen, err, errlen))
        return -1;
    if (c->http_listen[0] && config_check_http_listen("http_listen", c->http_listen, err, errlen))
        return -1;
    if (c->http_listen[0] && !c->http_api_key_file[0] && !c->http_allow_remote &&
        !config_endpoint_loopback(c->http_listen)) {
        snprintf(err, errlen, "http_listen %s is not on loopback: set http_api_key_file (clients "
                 "then send a key), or http_allow_remote = 1 when a proxy in front "
                 "authenticates", c->http_listen);
        return -1;
    }
    if (c->http_reserved_connections >= c->http_max_connections) {
        snprintf(err, errlen, "http_reserved_connections (%ld) must be below "
                 "http_max_connections (%ld): none would be left for answers",
                 c->http_reserved_connections, c->http_max_connections);
        return -1;
    }
    if (!c->http_tls_cert_file[0] != !c->http_tls_key_file[0]) {
        snprintf(err, errlen, "http_tls_cert_file and http_tls_key_file go together");
        return -1;
    }
    if (c->curve_allowed_keys[0] && !c->curve_secret_key_file[0]) {
        snprintf(err, errlen, "curve_allowed_keys needs curve_secret_key_file (the daemon's own "
                 "key): without it clients are not authenticated at all");
        return -1;
    }
    if (c->curve_secret_key_file[0] && c->worker_listen[0] && !c->curve_worker_keys[0]) {
        snprintf(err, errlen, "worker_listen %s with CurveZMQ needs curve_worker_keys (the public "
                 "keys of the workers allowed to join)", c->worker_listen);
        return -1;
    }
    if (c->curve_server_key[0] && !c->curve_secret_key_file[0]) {
        snprintf(err, errlen, "curve_server_key needs curve_secret_key_file (this worker's own key)");
        return -1;
    }
    if (strcmp(c->device, "auto") && strcmp(c->device, "cpu") && strcmp(c->device, "cuda")) {
        snprintf(err, errlen, "device: \"%s\" is not auto, cpu or cuda", c->device);
        return -1;
    }
    if (strcmp(c->kv_type, "f16") && strcmp(c->kv_type, "f32") && strcmp(c->kv_type, "q8")) {
        snprintf(err, errlen, "kv_type: \"%s\" is not one of f16, f32, q8", c->kv_type);
        return -1;
    }
    if (!strcmp(c->kv_type, "q8") && !strcmp(c->device, "cuda")) {
        snprintf(err, errlen, "kv_type q8 is for the CPU backend; device cuda keeps a bf16 cache");
        return -1;
    }
    if (config_unsupported_parse(c->unsupported, strlen(c->unsupported)) < 0) {
        snprintf(err, errlen, "unsupported: \"%s\" is not answer, mark or decline",
                 c->unsupported);
        return -1;
    }
    if (config_answer_mode_parse(c->answer_mode, strlen(c->answer_mode)) < 0) {
        snprintf(err, errlen, "answer_mode: \"%s\" is not free or quote", c->answer_mode);
        return -1;
    }
    if (!c->decline_text[0] || !utf8_valid(c->decline_text, strlen(c->decline_text), NULL)) {
        snprintf(err, errlen, "decline_text: must be a non-empty UTF-8 sentence");
        return -1;
    }
    if (dlog_level_parse(c->log_level) < 0) {
        snprintf(err, errlen, "log_level: \"%s\" is not error, warn, info or debug", c->log_level);
        return -1;
    }
    if (c->chunk_overlap >= c->chunk_tokens) {
        snprintf(err, errlen, "chunk_overlap (%ld) must be below chunk_tokens (%ld)",
                 c->chunk_overlap, c->chunk_tokens);
        return -1;
    }
    if (c->default_context_tokens > 0 && c->default_context_tokens < 64) {
        snprintf(err, errlen, "default_context_tokens: %ld is below 64 (0 chooses it)",
                 c->default_context_tokens);
        return -1;
    }
    if (c->max_context_tokens > 0 && c->max_context_tokens < 64) {
        snprintf(err, errlen, "max_context_tokens: %ld is below 64 (0 chooses it from the model)",
                 c->max_context_tokens);
        return -1;
    }
    if (strcmp(c->rope_scaling, "") && strcmp(c->rope_scaling, "none") &&
        strcmp(c->rope_scaling, "linear") && strcmp(c->rope_scaling, "yarn")) {
        snprintf(err, errlen, "rope_scaling: \"%s\" is not none, linear or yarn (or empty: the "
                 "file's)", c->rope_scaling);
        return -1;
    }
    if ((!strcmp(c->rope_scaling, "") || !strcmp(c->rope_scaling, "none")) &&
        (c->rope_factor != 0 || c->rope_orig_ctx != 0)) {
        snprintf(err, errlen, "rope_factor and rope_orig_ctx need rope_scaling linear or yarn");
        return -1;
    }
    if ((!strcmp(c->rope_scaling, "linear") || !strcmp(c->rope_scaling, "yarn")) &&
        !(c->rope_factor > 1)) {
        snprintf(err, errlen, "rope_scaling %s needs rope_factor above 1 (got %g)", c->rope_scaling,
                 c->rope_factor);
        return -1;
    }
    if (c->model_ctx > 0 && config_max_context(c) + c->max_tokens > c->model_ctx) {
        snprintf(err, errlen, "max_context_tokens %ld%s + max_tokens %ld = %ld exceeds the %ld-token "
                 "context of the model; lower them, or extend the context with rope_scaling and "
                 "rope_factor", config_max_context(c), c->max_context_tokens ? "" : " (auto)",
                 c->max_tokens, config_max_context(c) + c->max_tokens, c->model_ctx);
        return -1;
    }
    if (c->max_context_tokens + c->max_tokens > 131072) {
        snprintf(err, errlen, "max_context_tokens + max_tokens (%ld) exceeds 131072",
                 c->max_context_tokens + c->max_tokens);
        return -1;
    }
    if (!c->model[0]) {
        snprintf(err, errlen, "model: no file given");
        return -1;
    }
    if (!c->grounding_calibration[0]) {
        snprintf(err, errlen, "grounding_calibration: give a file, auto or none");
        return -1;
    }
    if (c->grounding_threshold[0]) {
        char *end;
        errno = 0;
        double t = strtod(c->grounding_threshold, &end);
        if (errno || end == c->grounding_threshold || *end || !(t >= 0 && t <= 1)) {
            snprintf(err, errlen, "grounding_threshold: \"%s\" is not a number from 0 to 1",
                     c->grounding_threshold);
            return -1;
        }
    }
    if (strcmp(c->grounding_heads, "auto")) {
        struct GrHead heads[GR_MAX_WATCH];
        int n;
        char herr[256];
        if (gr_parse_heads(c->grounding_heads, heads, GR_MAX_WATCH, &n, herr, sizeof herr)) {
            snprintf(err, errlen, "grounding_heads: %s", herr);
            return -1;
        }
    }
    {
        int layers[GR_MAX_HIDDEN], n;
        char herr[256];
        if (gr_parse_layers(c->grounding_hidden_layers, layers, GR_MAX_HIDDEN, &n, herr,
                            sizeof herr)) {
            snprintf(err, errlen, "grounding_hidden_layers: %s", herr);
            return -1;
        }
    }
    return 0;
}

/* The layer and attention-head counts of the model's header: {arch}.block_count and
 * {arch}.attention.head_count (a DIFF V2 head is one differential pair, as the engine counts). */
static int model_heads(const struct GgufFile *g, int *layers, int *heads, char *err, size_t errlen)
{
    struct GgufString a;
    char key[96];
    uint32_t v;
    if (gguf_get_str(g, "general.architecture", &a) != GGUF_OK || !a.len || a.len > 32) {
        snprintf(err, errlen, "model: %s: general.architecture missing", gguf_path(g));
        return -1;
    }
    snprintf(key, sizeof key, "%.*s.block_count", (int)a.len, a.ptr);
    if (gguf_get_u32(g, key, &v) != GGUF_OK || v < 1 || v > 65536) {
        snprintf(err, errlen, "model: %s: %s missing or out of range", gguf_path(g), key);
        return -1;
    }
    *layers = (int)v;
    snprintf(key, sizeof key, "%.*s.attention.head_count", (int)a.len, a.ptr);
    if (gguf_get_u32(g, key, &v) != GGUF_OK || v < 1 || v > 65536) {
        snprintf(err, errlen, "model: %s: %s missing or out of range", gguf_path(g), key);
        return -1;
    }
    *heads = (int)v;
    return 0;
}

int config_check_heads(const char *list, int layers, int heads, char *err, size_t errlen)
{
    struct GrHead parsed[GR_MAX_WATCH];
    char herr[256];
    int n;
    if (!strcmp(list, "auto"))
        return 0;
    if (gr_parse_heads(list, parsed, GR_MAX_WATCH, &n, herr, sizeof herr)) {
        snprintf(err, errlen, "grounding_heads: %s", herr);
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (parsed[i].layer >= layers || parsed[i].head >= heads) {
            snprintf(err, errlen, "grounding_heads: %d:%d is outside the model (%d layers of %d "
                     "heads, both counted from 0)", parsed[i].layer, parsed[i].head, layers, heads);
            return -1;
        }
    return 0;
}

int config_check_model(const struct Config *c, char *err, size_t errlen)
{
    struct GgufFile *g = NULL;
    char merr[512];
    int layers, heads;
    if (gguf_open(c->model, &g, merr, sizeof merr)) {
        snprintf(err, errlen, "model: %s", merr);
        return -1;
    }
    int rc = model_heads(g, &layers, &heads, err, errlen) ||
             config_check_heads(c->grounding_heads, layers, heads, err, errlen);
    gguf_close(&g);
    if (rc)
        return -1;
    int hl[GR_MAX_HIDDEN], nh = 0;
    if (!gr_parse_layers(c->grounding_hidden_layers, hl, GR_MAX_HIDDEN, &nh, merr, sizeof merr))
        for (int i = 0; i < nh; i++)
            if (hl[i] > layers) {
                snprintf(err, errlen, "grounding_hidden_layers: layer %d is outside the model "
                         "(0..%d)", hl[i], layers);
                return -1;
            }
    struct ModelConfig mc;
    if (model_ctx_read(c->model, &mc, merr, sizeof merr) ||
        model_ctx_override(&mc, c->rope_scaling, (float)c->rope_factor, (int)c->rope_orig_ctx, merr,
                           sizeof merr)) {
        snprintf(err, errlen, "model: %s", merr);
        return -1;
    }
    long usable = model_ctx_usable(&mc);
    if (c->max_context_tokens && c->max_context_tokens + c->max_tokens > usable) {
        char why[192];
        model_ctx_describe(&mc, why, sizeof why);
        snprintf(err, errlen, "max_context_tokens %ld + max_tokens %ld = %ld exceeds the "
                 "%ld-token context of the model (%s); lower them, or extend the context with "
                 "rope_scaling and rope_factor", c->max_context_tokens, c->max_tokens,
                 c->max_context_tokens + c->max_tokens, usable, why);
        return -1;
    }
    return 0;
}

long config_max_context(const struct Config *c)
{
    return c->max_context_tokens ? c->max_context_tokens : c->ctx_auto;
}

long config_default_context(const struct Config *c)
{
    long cap = config_max_context(c);
    long d = c->default_context_tokens ? c->default_context_tokens
             : c->gpu_workers ? cap : CONFIG_CPU_CONTEXT;
    return cap > 0 && d > cap ? cap : d;
}

static void print_value(const struct Config *c, const struct Key *k, FILE *f)
{
    const char *src = (const char *)c + k->off;
    switch (k->type) {
    case K_STR: {
        const char *s = src;
        int quote = !*s || strchr(s, '#') || isspace((unsigned char)s[0]) ||
                    isspace((unsigned char)s[strlen(s) - 1]);
        fprintf(f, quote ? "\"%s\"" : "%s", s);
        break;
    }
    case K_LONG: { long v; memcpy(&v, src, sizeof v); fprintf(f, "%ld", v); break; }
    case K_SIZE: {
        size_t v;
        memcpy(&v, src, sizeof v);
        if (v && v % 1073741824u == 0) fprintf(f, "%zuGiB", v / 1073741824u);
        else if (v && v % 1048576u == 0) fprintf(f, "%zuMiB", v / 1048576u);
        else if (v && v % 1024u == 0) fprintf(f, "%zuKiB", v / 1024u);
        else fprintf(f, "%zu", v);
        break;
    }
    case K_DOUBLE: { double v; memcpy(&v, src, sizeof v); fprintf(f, "%g", v); break; }
    }
}

void config_print(const struct Config *c, FILE *f, int with_help)
{
    for (size_t i = 0; i < config_n_keys; i++) {
        if (with_help)
            fprintf(f, "%s# %s%s\n", i ? "\n" : "", config_keys[i].help,
                    config_keys[i].reload ? " (SIGHUP reloads it)" : "");
        fprintf(f, "%s = ", config_keys[i].name);
        print_value(c, &config_keys[i], f);
        fputc('\n', f);
    }
}

static void append(char *dst, size_t cap, const char *name)
{
    size_t n = strlen(dst);
    snprintf(dst + n, cap - n, "%s%s", n ? "," : "", name);
}

/* Whether the comma-separated list names `name`. */
static int listed(const char *list, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = list; (p = strstr(p, name)); p += n)
        if ((p == list || p[-1] == ',') && (p[n] == ',' || !p[n]))
            return 1;
    return 0;
}

int config_reload(struct Config *live, int argc, char **argv, char *changed, size_t changed_len,
                  char *ignored, size_t ignored_len, char *err, size_t errlen)
{
    struct Config fresh;
    struct ConfigCli cli;
    if (changed_len) changed[0] = 0;
    if (ignored_len) ignored[0] = 0;
    if (config_from_args(&fresh, &cli, argc, argv, err, errlen) ||
        config_validate(&fresh, err, errlen))
        return -1;
    struct Config next = *live;
    for (size_t i = 0; i < config_n_keys; i++) {
        const struct Key *k = &config_keys[i];
        const char *a = (const char *)live + k->off, *b = (const char *)&fresh + k->off;
        int differs = k->type == K_STR ? strcmp(a, b) != 0 : memcmp(a, b, k->cap) != 0;
        if (!differs)
            continue;
        if (k->reload) {
            memcpy((char *)&next + k->off, b, k->cap);
            append(changed, changed_len, k->name);
        } else {
            append(ignored, ignored_len, k->name);
        }
    }
    /* The mixture must hold together too (e.g. a reloaded default against a kept cap). */
    if (config_validate(&next, err, errlen))
        return -1;
    /* A new model (or a new reading of it) applies at the next start: a value that start would
     * refuse is refused now, not left to fail the restart it sets up. */
    static const char *const model_keys[] = { "model", "rope_scaling", "rope_factor",
                                               "rope_orig_ctx", "grounding_heads" };
    for (size_t i = 0; i < sizeof model_keys / sizeof model_keys[0]; i++)
        if (listed(ignored, model_keys[i])) {
            char merr[768];
            if (config_check_model(&fresh, merr, sizeof merr)) {
                snprintf(err, errlen, "%s (needs_restart=\"%s\")", merr, ignored);
                return -1;
            }
            break;
        }
    *live = next;
    return 0;
}

void config_usage(FILE *f)
{
    fprintf(f,
        "usage: diffragd [--config FILE] [--KEY VALUE ...] [--check-config | --print-config]\n"
        "       diffragd --worker --connect tcp://HOST:PORT [--model FILE] [--workers N]\n"
        "  --config FILE     key = value file (default %s when it exists)\n"
        "  --check-config    validate the configuration (and that the model file opens), exit\n"
        "  --print-config    print the effective configuration, exit\n"
        "  --worker          run only workers that join the broker at --connect\n"
        "  --version         print the version, exit\n"
        "keys (each also works as --key value):\n", CONFIG_DEFAULT_PATH);
    for (size_t i = 0; i < config_n_keys; i++)
        fprintf(f, "  %-20s %s (default: %s)\n", config_keys[i].name, config_keys[i].help,
                config_keys[i].def[0] ? config_keys[i].def : "\"\"");
}
