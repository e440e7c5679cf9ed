/* libFuzzer target: the grounding calibration file's parser (daemon/grounding_file.c) on
 * arbitrary bytes. A file it refuses gets a message that names the origin; a file it accepts
 * holds what grounding.h promises of it, and what the daemon computes from it is a number:
 * every window score lies in [0, 1] for finite features at any context length, the length
 * offset is finite, the probe's logit is finite (NaN when the weights do not fit the rows'
 * dim; the reply clips it), and an answer's summary, over the calibration's windows, has a
 * score in [0, 1] that agrees with its flag and its tokens' scores. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/grounding.h"

static struct GrCalibration *g_cal;   /* 297 KiB: on the heap */
static float *g_rows;

/* One answer's signals, of a length that windows of every size meet: shorter, equal, longer. */
enum { N_TOK = 67 };
static float g_lp[N_TOK], g_ent[N_TOK], g_mar[N_TOK], g_doc[N_TOK], g_gen[N_TOK], g_diff[N_TOK],
    g_back[N_TOK], g_quote[N_TOK];
static uint32_t g_end[N_TOK];
static uint8_t g_uns[N_TOK];
static char g_text[N_TOK];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    g_cal = malloc(sizeof *g_cal);
    g_rows = malloc(GR_MAX_PROBE * sizeof *g_rows);
    if (!g_cal || !g_rows)
        exit(1);
    for (int i = 0; i < GR_MAX_PROBE; i++)   /* rows of a residual stream's size */
        g_rows[i] = (float)((i * 37 % 101) - 50) * 0.5f;
    for (int i = 0; i < N_TOK; i++) {
        g_lp[i] = -(float)(i % 9) * 1.5f;
        g_ent[i] = (float)(i % 5) * 0.7f;
        g_mar[i] = (float)(i % 4) * 0.3f;
        g_doc[i] = (float)(i % 3) * 0.2f;
        g_gen[i] = (float)(i % 2) * 0.4f;
        g_diff[i] = (float)(i % 7) * 0.1f - 0.3f;
        g_back[i] = (float)(i % 6) * 0.15f;
        g_quote[i] = (float)(i % 10) * 0.1f;
        g_end[i] = (uint32_t)(i + 1);
        g_uns[i] = i % 4 == 0;
        g_text[i] = (char)('a' + i % 26);
    }
    return 0;
}

static void check_accepted(const struct GrCalibration *c)
{
    if (c->window < 1 || c->window > GR_MAX_WINDOW || c->stride < 1 || c->stride > c->window)
        __builtin_trap();
    if (!(c->threshold >= 0 && c->threshold <= 1))
        __builtin_trap();
    if (c->n_watch < 1 || c->n_watch > GR_MAX_WATCH)
        __builtin_trap();
    if (c->n_features < 1 || c->n_features > GR_N_FEATURES)
        __builtin_trap();
    for (int j = 0; j < c->n_features; j++)
        if (c->feature[j] < 0 || c->feature[j] >= GR_N_FEATURES || !(c->scale[j] > 0))
            __builtin_trap();
    if (c->n_knots < 0 || c->n_knots > GR_MAX_KNOTS)
        __builtin_trap();
    for (int k = 1; k < c->n_knots; k++)
        if (!(c->knot_tokens[k] > c->knot_tokens[k - 1]))
            __builtin_trap();
    if (c->long_probe_from && c->short_probe_until && c->short_probe_until > c->long_probe_from)
        __builtin_trap();
    if ((c->long_probe_from && c->n_long_probe != c->n_probe) ||
        (c->short_probe_until && c->n_short_probe != c->n_probe))
        __builtin_trap();

    /* scores over finite features, at lengths from none to past every knot */
    static const double values[] = { 0.0, -1.0, 1.0, -30.0, 1e3 };
    static const double tokens[] = { 0, 1, 160, 2000, 16000, 1e6, 1e9 };
    double f[GR_N_FEATURES];
    for (size_t v = 0; v < sizeof values / sizeof values[0]; v++)
        for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++) {
            for (int j = 0; j < GR_N_FEATURES; j++)
                f[j] = values[(v + (size_t)j) % (sizeof values / sizeof values[0])];
            f[GR_SELF_CHECK] = NAN;   /* a self-check that did not run */
            f[GR_LOG_CONTEXT] = log1p(tokens[t]);
            double off = gr_length_offset(c, f[GR_LOG_CONTEXT]);
            if (!isfinite(off))
                __builtin_trap();
            double s = gr_window_score(c, f);
            if (!(s >= 0 && s <= 1))
                __builtin_trap();
        }

    /* the probe's logit, at the dims its weights could be rows of */
    if (c->probe_layer >= 0 && c->n_probe > 0) {
        static const size_t ctx[] = { 0, 100, 3999, 4000, 1000000 };
        for (int rows = 2; rows <= 3; rows++) {
            size_t dim = (size_t)c->n_probe / (size_t)rows;
            for (size_t i = 0; i < sizeof ctx / sizeof ctx[0]; i++) {
                double z = gr_probe_logit(c, g_rows, dim, ctx[i]);
                int fits = gr_probe_fits(c, dim);
                if (fits && !isfinite(z))
                    __builtin_trap();
                if (!fits && !isnan(z))
                    __builtin_trap();
            }
        }
    }
}

static void check_summary(const struct GrCalibration *c, size_t n, int quoted)
{
    struct GrSignals s = {
        .n = n, .logprob = g_lp, .entropy = g_ent, .margin = g_mar, .doc_mass = g_doc,
        .gen_mass = g_gen, .diff_doc_mass = g_diff, .lookback = g_back, .text_end = g_end,
        .unsupported = g_uns, .has_check = 1, .check = 3.5, .has_reliance = 1, .reliance = -0.7,
        .has_probe = 1, .probe = -12.0, .quote_removed = quoted ? g_quote : NULL,
        .context_tokens = 2000,
    };
    double ts[N_TOK];
    struct GrSummary sum;
    gr_summarize(c, c->threshold, &s, g_text, n, ts, &sum);
    if (!sum.scored)
        __builtin_trap();   /* every signal the features read is there */
    if (!(sum.score >= 0 && sum.score <= 1) || sum.flagged != (sum.score >= c->threshold) ||
        sum.flagged_tokens > n || (sum.flagged && sum.flagged_tokens == 0))
        __builtin_trap();
    double best = 0;
    for (size_t i = 0; i < n; i++) {
        if (!(ts[i] >= 0 && ts[i] <= sum.score))
            __builtin_trap();
        best = ts[i] > best ? ts[i] : best;
    }
    if (best != sum.score)
        __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512];
    err[0] = 0;
    if (gr_calibration_parse((const char *)data, size, "fuzz.grounding", g_cal, err,
                             sizeof err) != 0) {
        if (strncmp(err, "fuzz.grounding", 14) != 0)
            __builtin_trap();
        return 0;
    }
    check_accepted(g_cal);
    check_summary(g_cal, 1, 0);
    check_summary(g_cal, N_TOK, 1);
    return 0;
}
