/* score_positions: the engine's per-position scores of a token sequence, for comparison with
 * an outside reference (tests/test_qwen_oracle.py against llama.cpp's record). Evaluates the
 * tokens in one CPU context through engine_score_positions and prints one line per position
 * i in 0..n-2: "i nll top gap" (the NLL of tokens[i+1], natural log, the argmax at i and its
 * logit less the second largest), after a summary line "score: n=... scored=... mean_nll=...
 * perplexity=... arch=... attention=amx|f32" (attention: the prefill's attention path,
 * kernels/cpu/attention_amx.c or the f32 paths).
 *
 * usage: score_positions -m MODEL --tokens-file FILE [-n N] [--threads T] [--chunk C]
 *        [--kv f16|f32|q8]   (FILE: token ids separated by commas or white space; -n keeps
 *        the first N) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "model/engine.h"
#include "model/model.h"

static int read_tokens(const char *path, int32_t **out, size_t *n)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t cap = 4096, len = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    long v;
    int c;
    while (ids) {
        while ((c = fgetc(f)) == ',' || c == ' ' || c == '\n' || c == '\t' || c == '\r')
            ;
        if (c == EOF)
            break;
        ungetc(c, f);
        if (fscanf(f, "%ld", &v) != 1 || v < 0 || v > INT32_MAX) {
            free(ids);
            ids = NULL;
            break;
        }
        if (len == cap) {
            int32_t *grown = realloc(ids, 2 * cap * sizeof *ids);
            if (!grown) {
                free(ids);
                ids = NULL;
                break;
            }
            ids = grown;
            cap *= 2;
        }
        ids[len++] = (int32_t)v;
    }
    fclose(f);
    *out = ids;
    *n = len;
    return ids ? 0 : -1;
}

int main(int argc, char **argv)
{
    const char *model_path = NULL, *tokens_path = NULL;
    long keep = 0;
    struct EngineOpts o;
    engine_opts_default(&o);
    o.n_threads = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            goto usage;
        if (!strcmp(a, "-m"))
            model_path = v;
        else if (!strcmp(a, "--tokens-file"))
            tokens_path = v;
        else if (!strcmp(a, "-n"))
            keep = atol(v);
        else if (!strcmp(a, "--threads"))
            o.n_threads = atoi(v);
        else if (!strcmp(a, "--chunk"))
            o.chunk = atoi(v);
        else if (!strcmp(a, "--kv")) {
            if (!strcmp(v, "f16"))
                o.kv_type = KV_F16;
            else if (!strcmp(v, "f32"))
                o.kv_type = KV_F32;
            else if (!strcmp(v, "q8"))
                o.kv_type = KV_Q8;
            else
                goto usage;
        } else
            goto usage;
        i++;
    }
    if (!model_path || !tokens_path || o.n_threads < 1 || o.chunk < 1 || keep < 0)
        goto usage;

    char err[512] = "";
    int32_t *tokens = NULL;
    size_t n = 0;
    if (read_tokens(tokens_path, &tokens, &n) != 0) {
        fprintf(stderr, "score_positions: %s: unreadable or not a list of token ids\n", tokens_path);
        return 1;
    }
    if (keep > 0 && (size_t)keep < n)
        n = (size_t)keep;
    if (n < 2 || n > ENGINE_MAX_CTX) {
        fprintf(stderr, "score_positions: %zu tokens (2..%d scored)\n", n, ENGINE_MAX_CTX);
        free(tokens);
        return 1;
    }

    int rc = 1;
    struct Model *m = NULL;
    struct Engine *e = NULL;
    float *nll = malloc(n * sizeof *nll);
    int32_t *top = malloc(n * sizeof *top);
    float *gap = malloc(n * sizeof *gap);
    if (!nll || !top || !gap) {
        fprintf(stderr, "score_positions: out of memory\n");
        goto done;
    }
    if (model_load(model_path, &m, err, sizeof err) != 0) {
        fprintf(stderr, "score_positions: %s\n", err);
        goto done;
    }
    o.n_ctx = (int)n;
    if (engine_new(m, &o, &e, err, sizeof err) != ENGINE_OK) {
        fprintf(stderr, "score_positions: %s\n", err);
        goto done;
    }
    int st = engine_score_positions(e, tokens, n, nll, top, gap, err, sizeof err);
    if (st != ENGINE_OK) {
        fprintf(stderr, "score_positions: %s (%s)\n", err, engine_strerror(st));
        goto done;
    }
    double sum = 0.0;
    for (size_t i = 0; i + 1 < n; i++)
        sum += nll[i];
    printf("score: n=%zu scored=%zu mean_nll=%.8f perplexity=%.6f arch=%s attention=%s\n", n,
           n - 1, sum / (double)(n - 1), exp(sum / (double)(n - 1)), model_arch_name(m->cfg.arch),
           cpu_attn_amx_default() ? "amx" : "f32");
    for (size_t i = 0; i + 1 < n; i++)
        printf("%zu %.6f %d %.6f\n", i, nll[i], top[i], gap[i]);
    rc = fflush(stdout) == 0 ? 0 : 1;
done:
    engine_destroy(&e);
    model_destroy(&m);
    free(gap);
    free(top);
    free(nll);
    free(tokens);
    return rc;

usage:
    fprintf(stderr, "usage: %s -m MODEL --tokens-file FILE [-n N] [--threads T] [--chunk C] "
            "[--kv f16|f32|q8]\n", argv[0]);
    return 2;
}
