/* llama.cpp as the reference for the engine's numerics: tokenises a text with llama.cpp's own
 * tokenizer (no BOS, no special tokens), evaluates the first N tokens in one context with
 * logits at every position and prints, per position, the top token, the negative
 * log-likelihood of the next token and the gap between the two best logits, as JSON on stdout.
 * Built against llama.h and llama.cpp's static libraries by bench/llama_oracle.py, which
 * writes the record tests/test_qwen_oracle.py reads; tests never build it.
 *
 * usage: llama_oracle MODEL TEXT_FILE N_TOKENS THREADS */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#define ORACLE_BATCH 512

static void quiet_log(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

static char *read_file(const char *path, long *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) != 0 || (*len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0)
        goto done;
    buf = malloc((size_t)*len + 1);
    if (buf && fread(buf, 1, (size_t)*len, f) != (size_t)*len) {
        free(buf);
        buf = NULL;
    }
    if (buf)
        buf[*len] = 0;
done:
    fclose(f);
    return buf;
}

/* One row of logits: the argmax (lowest id on ties), the gap to the second best logit, and the
 * NLL of `next` (when next >= 0), the log-sum-exp taken in double. */
static void score_row(const float *logits, int n_vocab, int next, int *top, double *margin,
                      double *nll)
{
    int best = 0;
    for (int v = 1; v < n_vocab; v++)
        if (logits[v] > logits[best])
            best = v;
    float second = -INFINITY;
    for (int v = 0; v < n_vocab; v++)
        if (v != best && logits[v] > second)
            second = logits[v];
    double sum = 0.0;
    for (int v = 0; v < n_vocab; v++)
        sum += exp((double)logits[v] - (double)logits[best]);
    *top = best;
    *margin = (double)logits[best] - (double)second;
    *nll = next >= 0 ? (double)logits[best] + log(sum) - (double)logits[next] : 0.0;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL TEXT_FILE N_TOKENS THREADS\n", argv[0]);
        return 2;
    }
    const char *model_path = argv[1];
    int n = atoi(argv[3]), threads = atoi(argv[4]);
    if (n < 2 || threads < 1) {
        fprintf(stderr, "llama_oracle: N_TOKENS must be >= 2 and THREADS >= 1\n");
        return 2;
    }
    long text_len = 0;
    char *text = read_file(argv[2], &text_len);
    if (!text) {
        fprintf(stderr, "llama_oracle: cannot read %s\n", argv[2]);
        return 1;
    }

    int rc = 1;
    struct llama_model *model = NULL;
    struct llama_context *ctx = NULL;
    llama_token *ids = NULL;
    int *top = NULL;
    double *nll = NULL, *margin = NULL;
    struct llama_batch batch = {0};
    int batch_made = 0;

    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        fprintf(stderr, "llama_oracle: cannot load %s\n", model_path);
        goto done;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);

    int cap = (int)text_len + 16;
    ids = malloc((size_t)cap * sizeof *ids);
    if (!ids)
        goto done;
    int n_text = llama_tokenize(vocab, text, (int32_t)text_len, ids, cap, false, false);
    if (n_text < n) {
        fprintf(stderr, "llama_oracle: the text has %d tokens, %d asked\n", n_text, n);
        goto done;
    }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n;
    cp.n_batch = ORACLE_BATCH;
    cp.n_ubatch = ORACLE_BATCH;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    /* The plain attention path (soft_max over K·Q in f32), as the reference: the CPU flash
     * attention accumulates V in f16. The KV cache stays f16, as the engine's default. */
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama_oracle: cannot open a context of %d tokens\n", n);
        goto done;
    }

    top = malloc((size_t)n * sizeof *top);
    nll = calloc((size_t)n, sizeof *nll);
    margin = malloc((size_t)n * sizeof *margin);
    if (!top || !nll || !margin)
        goto done;
    batch = llama_batch_init(ORACLE_BATCH, 0, 1);
    batch_made = 1;
    for (int start = 0; start < n; start += ORACLE_BATCH) {
        int len = n - start < ORACLE_BATCH ? n - start : ORACLE_BATCH;
        batch.n_tokens = len;
        for (int i = 0; i < len; i++) {
            batch.token[i] = ids[start + i];
            batch.pos[i] = start + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        int st = llama_decode(ctx, batch);
        if (st != 0) {
            fprintf(stderr, "llama_oracle: llama_decode at %d: %d\n", start, st);
            goto done;
        }
        for (int i = 0; i < len; i++) {
            int p = start + i;
            const float *row = llama_get_logits_ith(ctx, i);
            if (!row) {
                fprintf(stderr, "llama_oracle: no logits at %d\n", p);
                goto done;
            }
            score_row(row, n_vocab, p + 1 < n ? ids[p + 1] : -1, &top[p], &margin[p], &nll[p]);
        }
        fprintf(stderr, "llama_oracle: %d/%d\n", start + len, n);
    }

    double sum = 0.0;
    for (int p = 0; p + 1 < n; p++)
        sum += nll[p];
    /* Position p's entries describe the logits after tokens[0..p]: top[p] is the predicted
     * token, nll[p] the NLL of tokens[p + 1]; the last position has a top token only. */
    printf("{\"n_tokens\": %d, \"n_vocab\": %d, \"n_text_tokens\": %d, \"mean_nll\": %.8f, "
           "\"perplexity\": %.6f,\n", n, n_vocab, n_text, sum / (n - 1), exp(sum / (n - 1)));
    printf("\"system_info\": \"%s\",\n", llama_print_system_info());
    printf("\"tokens\": [");
    for (int p = 0; p < n; p++)
        printf("%s%d", p ? "," : "", ids[p]);
    printf("],\n\"top\": [");
    for (int p = 0; p < n; p++)
        printf("%s%d", p ? "," : "", top[p]);
    printf("],\n\"nll\": [");
    for (int p = 0; p + 1 < n; p++)
        printf("%s%.5f", p ? "," : "", nll[p]);
    printf("],\n\"margin\": [");
    for (int p = 0; p < n; p++)
        printf("%s%.4f", p ? "," : "", margin[p]);
    printf("]}\n");
    rc = fflush(stdout) == 0 ? 0 : 1;
done:
    if (batch_made)
        llama_batch_free(batch);
    free(margin);
    free(nll);
    free(top);
    free(ids);
    if (ctx)
        llama_free(ctx);
    if (model)
        llama_model_free(model);
    llama_backend_free();
    free(text);
    return rc;
}
