/* diffrag-run: load a model, prefill a prompt in chunks, decode, print the continuation on
 * stdout and one logfmt timings line on stderr. Also the engine's test harness: raw token
 * input (--tokens/--tokens-file) and a dump of the last position's logits (--dump-logits).
 * Options are read with getopt_long; --help prints the usage, a bad option exits 2. */
#include <cblas.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "model/engine.h"
#include "model/engine_gpu.h"
#include "model/generate.h"
#include "model/model_ctx.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: diffrag-run -m MODEL (-p PROMPT | --tokens IDS | --tokens-file FILE) [options]\n"
        "  -m, --model FILE      GGUF model (llama, qwen2 or diffv2)\n"
        "  -p, --prompt TEXT     prompt text ('-' reads stdin)\n"
        "  -n, --n-predict N     tokens to generate (default 64)\n"
        "      --chat            wrap the prompt in the model's chat template\n"
        "      --system TEXT     system message for --chat\n"
        "      --ctx N           context size in tokens (default: prompt + n); at most the\n"
        "                        model's usable context: its context_length, or what its RoPE\n"
        "                        scaling extends it to (the file's, or --rope-scaling's)\n"
        "      --rope-scaling S  none, linear or yarn: override the file's RoPE scaling to run\n"
        "                        past the training context on purpose\n"
        "      --rope-factor F   scaling factor (> 1; e.g. 4: yarn x4 of 32768 = 131072)\n"
        "      --rope-orig-ctx N original context the factor multiplies (default: the file's\n"
        "                        context_length)\n"
        "      --chunk N         prefill chunk size (default 512; 8192 on a GPU)\n"
        "      --threads N       threads (default: online cores)\n"
        "      --kv f16|f32|q8   KV cache type (default f16; q8: int8 with a scale per position\n"
        "                        and head, CPU only; the GPU's cache is bf16)\n"
        "      --device D        auto (a GPU when one is visible), cpu or cuda (default auto)\n"
        "      --budget-mb N     refuse contexts needing more than N MiB (default: no limit)\n"
        "      --temp T          temperature (default 0: greedy)\n"
        "      --top-k N --top-p P --min-p P --seed S   sampling\n"
        "      --stop STR        stop string (repeatable)\n"
        "      --lookup N        prompt-lookup decoding: verify up to N tokens drafted from the\n"
        "                        prompt with each decode step (CPU; same output; default 0: off)\n"
        "      --tokens IDS      comma-separated token ids instead of a prompt\n"
        "      --tokens-file F   token ids (whitespace or comma separated) from a file\n"
        "      --dump-logits F   write the last prompt position's logits (f32) to F\n"
        "      --print-tokens    print the prompt's token ids on stderr\n"
        "      --watch SPEC      measure attention masses of heads: auto, or L:H[,L:H...]\n"
        "      --mark N          positions < N are the prompt's marked range (default: the\n"
        "                        whole prompt); positions >= N count as generated\n"
        "      --doc A-B         positions A..B-1 are document tokens (repeatable)\n"
        "      --dump-mass F     write the watched heads' masses to F, one block per token\n"
        "      --perplexity      score the prompt: perplexity of each token given its prefix\n"
        "      --batch           NUL-separated prompts on stdin; NUL-terminated answers out\n");
}

static int parse_ids(const char *s, int32_t **ids, size_t *n)
{
    size_t cap = 1024, k = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!v) return -1;
    const char *p = s;
    while (*p) {
        while (*p == ',' || *p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX) { free(v); return -1; }
        if (k == cap) {
            int32_t *nv = realloc(v, (cap *= 2) * sizeof *v);
            if (!nv) { free(v); return -1; }
            v = nv;
        }
        v[k++] = (int32_t)x;
        p = end;
    }
    *ids = v;
    *n = k;
    return 0;
}

static char *read_all(FILE *f, size_t *len)
{
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    if (!b) return NULL;
    size_t r;
    while ((r = fread(b + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (cap - n - 1 == 0) {
            char *nb = realloc(b, cap *= 2);
            if (!nb) { free(b); return NULL; }
            b = nb;
        }
    }
    b[n] = 0;
    *len = n;
    return b;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static size_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, res = 0;
    if (!f) return 0;
    if (fscanf(f, "%ld %ld", &pages, &res) != 2) res = 0;
    fclose(f);
    return (size_t)res * (size_t)sysconf(_SC_PAGESIZE);
}

static void write_mass(FILE *f, int step, const struct AttnWatch *w, const struct AttnMass *ms,
                       int n)
{
    fprintf(f, "step %d\n", step);
    for (int i = 0; i < n; i++)
        fprintf(f, "%d %d %.9g %.9g %.9g %.9g %.9g %.9g %.9g\n", w[i].layer, w[i].head, ms[i].doc,
                ms[i].gen, ms[i].doc2, ms[i].gen2, ms[i].sig, ms[i].diff_doc, ms[i].diff_gen);
}

struct RunWatch {
    FILE *f;
    const struct AttnWatch *w;
};

static int on_token(void *user, const struct GenToken *t)
{
    struct RunWatch *rw = user;
    if (rw && rw->f && t->mass) write_mass(rw->f, t->index, rw->w, t->mass, t->n_mass);
    if (t->text_len) {
        fwrite(t->text, 1, t->text_len, stdout);
        fflush(stdout);
    }
    return 0;
}

#define MAX_STOP 16

/* Wraps text in the chat template when asked and encodes it; *ids is malloc'd. */
static int encode_prompt(const struct Model *m, const char *text, size_t len, int chat,
                         const char *system, int32_t **ids, size_t *n_ids)
{
    char *wrapped = NULL;
    if (chat) {
        struct ChatMessage msgs[2];
        size_t nm = 0, need;
        if (system) msgs[nm++] = (struct ChatMessage){CHAT_SYSTEM, system, strlen(system)};
        msgs[nm++] = (struct ChatMessage){CHAT_USER, text, len};
        tok_chat_format(m->tok, msgs, nm, 1, NULL, 0, &need);
        wrapped = malloc(need + 1);
        if (!wrapped || tok_chat_format(m->tok, msgs, nm, 1, wrapped, need + 1, &need) != TOK_OK) {
            free(wrapped);
            return -1;
        }
        text = wrapped;
        len = need;
    }
    unsigned flags = chat ? TOK_PARSE_SPECIAL : TOK_ADD_BOS;
    tok_encode(m->tok, text, len, flags, NULL, 0, n_ids);
    *ids = malloc((*n_ids ? *n_ids : 1) * sizeof **ids);
    if (!*ids) { free(wrapped); return -1; }
    tok_encode(m->tok, text, len, flags, *ids, *n_ids, n_ids);
    free(wrapped);
    return 0;
}

/* --device: where the context computes. Scoring (--perplexity) needs every position's logits,
 * which GPU contexts do not return, so it stays on the CPU under auto. */
static int pick_device(struct Model *m, const char *device, int perplexity, int chunk_given,
                       struct EngineOpts *eo)
{
    char note[512];
    if (perplexity && !strcmp(device, "cuda")) {
        fprintf(stderr, "diffrag-run: --perplexity runs on the CPU only\n");
        return -1;
    }
    if (perplexity) device = "cpu";
    enum EngineDevice d;
    /* the GPU's pool caches prefixes as a CPU context's own pool does */
    if (engine_device_select(m, device, eo->n_ctx, 1, &d, note, sizeof note)) {
        fprintf(stderr, "diffrag-run: %s\n", note);
        return -1;
    }
    eo->device = d;
    if (d == ENGINE_CUDA && !chunk_given) eo->chunk = 8192;
    if (d == ENGINE_CUDA || (note[0] && !strstr(note, "no NVIDIA driver")))
        fprintf(stderr, "diffrag-run: %s\n", note);
    return 0;
}

/* --batch: NUL-separated prompts on stdin, each answered with a fresh sequence in one context;
 * each answer is written to stdout followed by a NUL byte. */
static int run_batch(const struct Model *m, struct EngineOpts *eo, const struct GenParams *gp,
                     int chat, const char *system)
{
    char err[512];
    size_t len;
    char *all = read_all(stdin, &len);
    struct Engine *e = NULL;
    if (!all) { fprintf(stderr, "diffrag-run: cannot read stdin\n"); return 1; }
    if (engine_new(m, eo, &e, err, sizeof err) != ENGINE_OK) {
        fprintf(stderr, "diffrag-run: %s\n", err);
        free(all);
        return 1;
    }
    int status = 0;
    for (size_t off = 0; off < len;) {
        size_t rl = strnlen(all + off, len - off);
        int32_t *ids = NULL;
        size_t n_ids = 0;
        struct GenResult res = {0};
        if (encode_prompt(m, all + off, rl, chat, system, &ids, &n_ids) != 0) { status = 1; break; }
        int rc = generate(e, ids, n_ids, gp, NULL, NULL, &res, err, sizeof err);
        free(ids);
        if (rc) {
            fprintf(stderr, "diffrag-run: prompt at byte %zu: %s\n", off, err);
            fputc(0, stdout);
        } else {
            fwrite(res.text, 1, res.text_len, stdout);
            fputc(0, stdout);
            free(res.text);
        }
        off += rl + 1;
    }
    fflush(stdout);
    engine_destroy(&e);
    free(all);
    return status;
}

int main(int argc, char **argv)
{
    const char *model_path = NULL, *prompt = NULL, *tokens_arg = NULL, *tokens_file = NULL;
    const char *dump = NULL, *system = NULL;
    const char *stop[MAX_STOP];
    size_t n_stop = 0;
    int n_predict = 64, chat = 0, ctx = 0, print_tokens = 0, batch = 0, perplexity = 0;
    const char *watch_spec = NULL, *dump_mass = NULL;
    long mark = -1;
    enum { MAX_DOC = 64 };
    long doc_a[MAX_DOC], doc_b[MAX_DOC];
    int n_doc = 0;
    long budget_mb = 0;
    const char *device = "auto";
    int chunk_given = 0;
    const char *rope_scaling = NULL;
    float rope_factor = 0.f;
    long rope_orig_ctx = 0;
    struct EngineOpts eo;
    engine_opts_default(&eo);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    eo.n_threads = cores > 0 ? (int)cores : 1;
    struct GenParams gp = {0};
    sampler_params_default(&gp.sampler);

    enum {
        O_CHAT = 256, O_SYSTEM, O_CTX, O_ROPE_SCALING, O_ROPE_FACTOR, O_ROPE_ORIG_CTX, O_CHUNK,
        O_THREADS, O_KV, O_BUDGET_MB, O_DEVICE, O_TEMP, O_TOP_K, O_TOP_P, O_MIN_P, O_SEED, O_STOP,
        O_TOKENS, O_TOKENS_FILE, O_DUMP_LOGITS, O_PRINT_TOKENS, O_WATCH, O_MARK, O_DUMP_MASS,
        O_DOC, O_BATCH, O_PERPLEXITY, O_LOOKUP,
    };
    static const struct option longs[] = {
        { "help", no_argument, NULL, 'h' }, { "model", required_argument, NULL, 'm' },
        { "prompt", required_argument, NULL, 'p' }, { "n-predict", required_argument, NULL, 'n' },
        { "chat", no_argument, NULL, O_CHAT }, { "system", required_argument, NULL, O_SYSTEM },
        { "ctx", required_argument, NULL, O_CTX },
        { "rope-scaling", required_argument, NULL, O_ROPE_SCALING },
        { "rope-factor", required_argument, NULL, O_ROPE_FACTOR },
        { "rope-orig-ctx", required_argument, NULL, O_ROPE_ORIG_CTX },
        { "chunk", required_argument, NULL, O_CHUNK }, { "threads", required_argument, NULL, O_THREADS },
        { "kv", required_argument, NULL, O_KV }, { "budget-mb", required_argument, NULL, O_BUDGET_MB },
        { "device", required_argument, NULL, O_DEVICE }, { "temp", required_argument, NULL, O_TEMP },
        { "top-k", required_argument, NULL, O_TOP_K }, { "top-p", required_argument, NULL, O_TOP_P },
        { "min-p", required_argument, NULL, O_MIN_P }, { "seed", required_argument, NULL, O_SEED },
        { "stop", required_argument, NULL, O_STOP }, { "tokens", required_argument, NULL, O_TOKENS },
        { "tokens-file", required_argument, NULL, O_TOKENS_FILE },
        { "dump-logits", required_argument, NULL, O_DUMP_LOGITS },
        { "print-tokens", no_argument, NULL, O_PRINT_TOKENS },
        { "watch", required_argument, NULL, O_WATCH }, { "mark", required_argument, NULL, O_MARK },
        { "dump-mass", required_argument, NULL, O_DUMP_MASS },
        { "doc", required_argument, NULL, O_DOC }, { "batch", no_argument, NULL, O_BATCH },
        { "perplexity", no_argument, NULL, O_PERPLEXITY },
        { "lookup", required_argument, NULL, O_LOOKUP }, { 0 },
    };
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":hm:p:n:", longs, NULL)) != -1) {
        const char *v = optarg;
        char *end;
        switch (c) {
        case 'h': usage(stdout); return 0;
        case 'm': model_path = v; break;
        case 'p': prompt = v; break;
        case 'n': n_predict = atoi(v); break;
        case O_CHAT: chat = 1; break;
        case O_SYSTEM: system = v; break;
        case O_CTX: ctx = atoi(v); break;
        case O_ROPE_SCALING: rope_scaling = v; break;
        case O_ROPE_FACTOR:
            rope_factor = strtof(v, &end);
            if (end == v || *end) { fprintf(stderr, "diffrag-run: --rope-factor takes a number\n"); return 2; }
            break;
        case O_ROPE_ORIG_CTX:
            rope_orig_ctx = strtol(v, &end, 10);
            if (end == v || *end || rope_orig_ctx < 1 || rope_orig_ctx > ENGINE_MAX_CTX) {
                fprintf(stderr, "diffrag-run: --rope-orig-ctx takes 1..%d\n", ENGINE_MAX_CTX);
                return 2;
            }
            break;
        case O_CHUNK: eo.chunk = atoi(v); chunk_given = 1; break;
        case O_THREADS: eo.n_threads = atoi(v); break;
        case O_KV:
            if (!strcmp(v, "f16")) eo.kv_type = KV_F16;
            else if (!strcmp(v, "f32")) eo.kv_type = KV_F32;
            else if (!strcmp(v, "q8")) eo.kv_type = KV_Q8;
            else { fprintf(stderr, "diffrag-run: --kv must be f16, f32 or q8\n"); return 2; }
            break;
        case O_BUDGET_MB: budget_mb = atol(v); break;
        case O_DEVICE: device = v; break;
        case O_TEMP: gp.sampler.temperature = strtof(v, NULL); break;
        case O_TOP_K: gp.sampler.top_k = atoi(v); break;
        case O_TOP_P: gp.sampler.top_p = strtof(v, NULL); break;
        case O_MIN_P: gp.sampler.min_p = strtof(v, NULL); break;
        case O_SEED: gp.sampler.seed = strtoull(v, NULL, 10); break;
        case O_STOP:
            if (n_stop == MAX_STOP) { fprintf(stderr, "diffrag-run: at most %d --stop\n", MAX_STOP); return 2; }
            stop[n_stop++] = v;
            break;
        case O_TOKENS: tokens_arg = v; break;
        case O_TOKENS_FILE: tokens_file = v; break;
        case O_DUMP_LOGITS: dump = v; break;
        case O_PRINT_TOKENS: print_tokens = 1; break;
        case O_WATCH: watch_spec = v; break;
        case O_MARK: mark = atol(v); break;
        case O_DUMP_MASS: dump_mass = v; break;
        case O_DOC:
            if (n_doc == MAX_DOC) { fprintf(stderr, "diffrag-run: at most %d --doc\n", MAX_DOC); return 2; }
            doc_a[n_doc] = strtol(v, &end, 10);
            if (*end != '-' || doc_a[n_doc] < 0) { fprintf(stderr, "diffrag-run: --doc takes A-B\n"); return 2; }
            doc_b[n_doc] = strtol(end + 1, &end, 10);
            if (*end || doc_b[n_doc] < doc_a[n_doc]) { fprintf(stderr, "diffrag-run: --doc takes A-B with A <= B\n"); return 2; }
            n_doc++;
            break;
        case O_BATCH: batch = 1; break;
        case O_PERPLEXITY: perplexity = 1; break;
        case O_LOOKUP:
            gp.lookup = (int)strtol(v, &end, 10);
            if (*end || gp.lookup < 0) {
                fprintf(stderr, "diffrag-run: --lookup takes a count >= 0\n");
                return 2;
            }
            break;
        case ':':
            fprintf(stderr, "diffrag-run: %s needs a value\n", argv[optind - 1]);
            usage(stderr);
            return 2;
        default:
            if (optopt > 0 && optopt < 256) fprintf(stderr, "diffrag-run: unknown option -%c\n", optopt);
            else fprintf(stderr, "diffrag-run: unknown option %s\n", argv[optind - 1]);
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "diffrag-run: unexpected argument %s\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (!model_path || (!prompt && !tokens_arg && !tokens_file && !batch)) { usage(stderr); return 2; }
    if (n_predict < 0 || eo.chunk < 1 || eo.n_threads < 1 || ctx < 0 || budget_mb < 0) {
        fprintf(stderr, "diffrag-run: -n, --chunk, --threads, --ctx and --budget-mb must be positive\n");
        return 2;
    }
    if (!rope_scaling && (rope_factor != 0.f || rope_orig_ctx)) {
        fprintf(stderr, "diffrag-run: --rope-factor and --rope-orig-ctx need --rope-scaling\n");
        return 2;
    }
    gp.max_tokens = n_predict;
    gp.stop = stop;
    gp.n_stop = n_stop;

    char err[512] = "";
    FILE *mass_f = NULL;
    struct Model *m = NULL;
    struct Engine *e = NULL;
    int32_t *ids = NULL;
    char *text = NULL;
    size_t n_ids = 0;
    int status = 1;
    double t_load = now_s();
    if (model_load(model_path, &m, err, sizeof err) != MODEL_OK) {
        fprintf(stderr, "diffrag-run: %s\n", err);
        return 1;
    }
    t_load = now_s() - t_load;
    if (model_rope_override(m, rope_scaling, rope_factor, (int)rope_orig_ctx, err, sizeof err)) {
        fprintf(stderr, "diffrag-run: %s\n", err);
        model_destroy(&m);
        return 2;
    }
    int usable = model_usable_ctx(m);
    if (ctx && model_ctx_check(&m->cfg, ctx, err, sizeof err)) {
        fprintf(stderr, "diffrag-run: --ctx: %s\n", err);
        model_destroy(&m);
        return 1;
    }
    if (batch) {
        eo.n_ctx = ctx ? ctx : usable < 4096 ? usable : 4096;
        eo.mem_budget = (size_t)budget_mb << 20;
        if (pick_device(m, device, 0, chunk_given, &eo)) {
            model_destroy(&m);
            return 1;
        }
        status = run_batch(m, &eo, &gp, chat, system);
        model_destroy(&m);
        return status;
    }

    if (tokens_arg || tokens_file) {
        char *src = NULL;
        size_t len;
        if (tokens_file) {
            FILE *f = fopen(tokens_file, "r");
            if (!f || !(src = read_all(f, &len))) {
                fprintf(stderr, "diffrag-run: cannot read %s: %s\n", tokens_file, strerror(errno));
                if (f) fclose(f);
                goto out;
            }
            fclose(f);
        }
        int bad = parse_ids(src ? src : tokens_arg, &ids, &n_ids);
        free(src);
        if (bad) { fprintf(stderr, "diffrag-run: token ids must be non-negative integers\n"); goto out; }
    } else {
        size_t len;
        if (!strcmp(prompt, "-")) {
            if (!(text = read_all(stdin, &len))) { fprintf(stderr, "diffrag-run: cannot read stdin\n"); goto out; }
        } else if (!(text = strdup(prompt))) goto out;
        if (encode_prompt(m, text, strlen(text), chat, system, &ids, &n_ids) != 0) {
            fprintf(stderr, "diffrag-run: cannot encode the prompt\n");
            goto out;
        }
    }
    if (n_ids == 0) { fprintf(stderr, "diffrag-run: the prompt is empty\n"); goto out; }
    if (print_tokens) {
        fprintf(stderr, "tokens:");
        for (size_t i = 0; i < n_ids; i++) fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, "\n");
    }

    long want = ctx ? ctx : (long)n_ids + n_predict;
    if (!ctx && model_ctx_check(&m->cfg, want, err, sizeof err)) {
        fprintf(stderr, "diffrag-run: the prompt (%zu tokens) plus -n %d: %s\n", n_ids, n_predict,
                err);
        goto out;
    }
    eo.n_ctx = (int)want;
    eo.mem_budget = (size_t)budget_mb << 20;
    if (pick_device(m, device, perplexity, chunk_given, &eo)) goto out;
    struct EngineMemory mem;
    engine_estimate(m, &eo, &mem);

    /* Touch OpenBLAS's buffers before measuring, so the context's resident size below is the
     * context's own. Single-threaded, as the engine calls it (inside its own pool's tasks):
     * OpenBLAS threads would only spin on the cores the engine is about to use. */
    {
        int k = m->cfg.dim, n = m->cfg.ffn_dim, rows = eo.chunk < 64 ? eo.chunk : 64;
        float *a = calloc((size_t)rows * k, sizeof(float)), *c = malloc((size_t)rows * n * sizeof(float));
        float *b = calloc((size_t)n * k, sizeof(float));
        openblas_set_num_threads(1);
        if (a && b && c) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, k, 1.f, a,
                                     k, b, k, 0.f, c, n);
        free(a);
        free(b);
        free(c);
    }
    size_t rss_base = rss_bytes();
    int rc = engine_new(m, &eo, &e, err, sizeof err);
    if (rc != ENGINE_OK) { fprintf(stderr, "diffrag-run: %s\n", err); status = rc == ENGINE_EBUDGET ? 3 : 1; goto out; }

    struct AttnWatch watch[ENGINE_MAX_WATCH];
    int n_watch = 0;
    struct RunWatch rw = {0};
    if (watch_spec) {
        if (!strcmp(watch_spec, "auto")) {
            n_watch = engine_default_watch(m, watch, ENGINE_MAX_WATCH);
        } else {
            const char *p = watch_spec;
            while (*p) {
                char *end;
                long l = strtol(p, &end, 10), h;
                if (end == p || *end != ':') { n_watch = -1; break; }
                p = end + 1;
                h = strtol(p, &end, 10);
                if (end == p || (*end && *end != ',') || n_watch == ENGINE_MAX_WATCH) { n_watch = -1; break; }
                watch[n_watch++] = (struct AttnWatch){(int)l, (int)h};
                p = *end ? end + 1 : end;
            }
            if (n_watch < 0) { fprintf(stderr, "diffrag-run: --watch takes auto or L:H[,L:H...]\n"); goto out; }
        }
        if (engine_watch(e, watch, n_watch, err, sizeof err)) { fprintf(stderr, "diffrag-run: %s\n", err); goto out; }
        size_t nm = mark >= 0 ? (size_t)mark : n_ids;
        uint8_t *cls = calloc(nm ? nm : 1, 1);
        if (!cls) goto out;
        for (int i = 0; i < n_doc; i++)
            for (long j = doc_a[i]; j < doc_b[i] && (size_t)j < nm; j++) cls[j] = ATTN_DOC;
        rc = engine_set_spans(e, cls, nm, err, sizeof err);
        free(cls);
        if (rc) { fprintf(stderr, "diffrag-run: %s\n", err); goto out; }
        if (dump_mass && !(mass_f = fopen(dump_mass, "w"))) {
            fprintf(stderr, "diffrag-run: cannot write %s: %s\n", dump_mass, strerror(errno));
            goto out;
        }
        rw.f = mass_f;
        rw.w = watch;
    }

    double prefill_s = 0, decode_s = 0;
    int n_gen = 0;
    if (perplexity) {
        double nll;
        size_t scored;
        double t0 = now_s();
        rc = engine_score(e, ids, n_ids, &nll, &scored, err, sizeof err);
        prefill_s = now_s() - t0;
        if (rc) { fprintf(stderr, "diffrag-run: %s\n", err); goto out; }
        printf("perplexity: ppl=%.4f tokens=%zu nll=%.4f\n", exp(nll / scored), scored, nll);
        n_predict = 0;
    } else if (dump || n_predict == 0) {
        double t0 = now_s();
        rc = engine_prefill(e, ids, n_ids, err, sizeof err);
        prefill_s = now_s() - t0;
        if (rc) { fprintf(stderr, "diffrag-run: %s\n", err); goto out; }
        if (dump) {
            const float *lg = engine_logits(e);
            if (!lg) {
                fprintf(stderr, "diffrag-run: the logits could not be read from the device\n");
                rc = ENGINE_EDEVICE;
                goto out;
            }
            FILE *f = fopen(dump, "wb");
            if (!f || fwrite(lg, sizeof(float), (size_t)m->cfg.vocab, f) != (size_t)m->cfg.vocab) {
                fprintf(stderr, "diffrag-run: cannot write %s\n", dump);
                if (f) fclose(f);
                goto out;
            }
            fclose(f);
        }
        int nm;
        const struct AttnMass *ms = engine_attn_mass(e, &nm);
        if (mass_f && n_predict == 0 && ms) write_mass(mass_f, 0, watch, ms, nm);
    }
    size_t rss_ctx = rss_bytes() - rss_base;
    if (n_predict > 0) {
        struct GenResult res;
        gp.prefilled = dump != NULL;
        rc = generate(e, ids, n_ids, &gp, on_token, &rw, &res, err, sizeof err);
        if (rc) { fprintf(stderr, "diffrag-run: %s\n", err); goto out; }
        printf("\n");
        if (!gp.prefilled) prefill_s = res.prefill_ms / 1e3;
        decode_s = res.decode_ms / 1e3;
        n_gen = res.n_generated;
        size_t r2 = rss_bytes() - rss_base;
        if (r2 > rss_ctx) rss_ctx = r2;
        fprintf(stderr, "finish: reason=%s\n", finish_reason_name(res.finish));
        if (gp.lookup > 0)
            fprintf(stderr, "lookup: drafted=%d accepted=%d\n", res.n_drafted, res.n_accepted);
        free(res.text);
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fprintf(stderr, "memory: weights_mb=%.1f context_estimate_mb=%.2f kv_mb=%.2f "
            "activations_mb=%.2f context_rss_mb=%.2f\n",
            mem.weight_bytes / 1048576.0, mem.context_bytes / 1048576.0,
            mem.kv_bytes / 1048576.0, mem.scratch_bytes / 1048576.0, rss_ctx / 1048576.0);
    /* Decode speed counts the steps after the first token (which comes from the prefill). */
    fprintf(stderr, "timings: prompt_tokens=%zu prefill_tok_s=%.1f decode_tok_s=%.1f "
            "peak_rss_mb=%.1f load_s=%.2f generated=%d\n",
            n_ids, prefill_s > 0 ? n_ids / prefill_s : 0.0,
            decode_s > 0 && n_gen > 1 ? (n_gen - 1) / decode_s : 0.0, ru.ru_maxrss / 1024.0,
            t_load, n_gen);
    status = 0;
out:
    if (mass_f && fclose(mass_f)) { fprintf(stderr, "diffrag-run: cannot write %s\n", dump_mass); status = 1; }
    engine_destroy(&e);
    model_destroy(&m);
    free(ids);
    free(text);
    return status;
}
