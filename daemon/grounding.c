/* The groundedness figures of docs/groundedness.md: content words and lexical support (over
 * text/words.h's splitter and word set), windows, features, the logistic score and the request
 * summary. The calibration file's parser is grounding_file.c. */
#include "daemon/grounding.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/prompt.h"
#include "text/words.h"

static const char *const feature_names[GR_N_FEATURES] = {
    "mean_logprob", "min_logprob", "mean_entropy", "mean_margin", "lookback", "diff_doc_mass",
    "unsupported_ratio", "self_check", "context_reliance", "hidden_probe", "quote_removed",
    "log_context_tokens",
};

const char *gr_feature_name(int f)
{
    return f >= 0 && f < GR_N_FEATURES ? feature_names[f] : NULL;
}

/* ---- content words ---- */

/* Function words that carry no fact of their own. */
static const char *const stop_words[] = {
    "a", "about", "after", "all", "also", "am", "an", "and", "any", "are", "as", "at", "be",
    "because", "been", "before", "being", "between", "both", "but", "by", "can", "could",
    "did", "do", "does", "during", "each", "for", "from", "had", "has", "have", "he", "her",
    "here", "hers", "him", "his", "how", "i", "if", "in", "into", "is", "it", "its", "just",
    "me", "more", "most", "my", "no", "nor", "not", "of", "on", "once", "only", "or", "other",
    "our", "out", "over", "own", "same", "she", "should", "so", "some", "such", "than", "that",
    "the", "their", "them", "then", "there", "these", "they", "this", "those", "through", "to",
    "too", "under", "until", "up", "very", "was", "we", "were", "what", "when", "where",
    "which", "while", "who", "whom", "why", "will", "with", "would", "you", "your",
};

static int is_stop_word(const char *w, size_t len)
{
    for (size_t i = 0; i < sizeof stop_words / sizeof stop_words[0]; i++)
        if (strlen(stop_words[i]) == len && !memcmp(stop_words[i], w, len))
            return 1;
    return 0;
}

int gr_is_content(const struct Word *w)
{
    return w->digit || w->capital || !is_stop_word(w->lower, w->lower_len);
}

/* ---- lexical support ---- */

struct LexCtx {
    const struct WordSet *docs;
    const char *text;
    size_t len;
    const uint32_t *text_end;
    size_t n, tok;     /* tok: the first token that may overlap the next word */
    uint8_t *unsupported;
};

static int citation_char(char ch) { return (ch >= '0' && ch <= '9') || ch == ',' || ch == ' '; }

/* The number of a citation marker: inside brackets that hold only numbers, commas and spaces
 * ("[2]", "[1, 3]"). The prompt asks for these; they are not claims about the documents. */
static int in_citation(const struct LexCtx *c, const struct Word *w)
{
    for (size_t i = w->start; i < w->end; i++)
        if (c->text[i] < '0' || c->text[i] > '9')
            return 0;
    size_t a = w->start, b = w->end;
    while (a > 0 && citation_char(c->text[a - 1]))
        a--;
    while (b < c->len && citation_char(c->text[b]))
        b++;
    return a > 0 && c->text[a - 1] == '[' && b < c->len && c->text[b] == ']';
}

static int lex_word(void *ctx, const struct Word *w)
{
    struct LexCtx *c = ctx;
    if (!gr_is_content(w) || in_citation(c, w) || (c->docs && words_set_has(c->docs, w->lower, w->lower_len)))
        return 0;
    /* tokens [ts, te) with ts < w->end and w->start < te; words come in text order */
    while (c->tok < c->n && c->text_end[c->tok] <= w->start)
        c->tok++;
    for (size_t t = c->tok; t < c->n; t++) {
        size_t ts = t ? c->text_end[t - 1] : 0;
        if (ts >= w->end)
            break;
        if (c->text_end[t] > ts)
            c->unsupported[t] = 1;
    }
    return 0;
}

void gr_lexical(const struct WordSet *docs, const char *answer, size_t len,
                const uint32_t *text_end, size_t n, uint8_t *unsupported)
{
    struct LexCtx c = { .docs = docs, .text = answer, .len = len, .text_end = text_end, .n = n,
                        .unsupported = unsupported };
    memset(unsupported, 0, n);
    words_split(answer, len, lex_word, &c);
}

/* ---- windows, features, score ---- */

size_t gr_windows(size_t n, int window, int stride, struct GrWindow *out, size_t cap)
{
    size_t w = (size_t)window, k = 0;
    if (n == 0 || window < 1 || stride < 1)
        return 0;
    if (n <= w) {
        if (cap)
            out[0] = (struct GrWindow){ 0, n };
        return 1;
    }
    for (size_t s = 0; s + w < n; s += (size_t)stride, k++)
        if (k < cap)
            out[k] = (struct GrWindow){ s, s + w };
    if (k < cap)
        out[k] = (struct GrWindow){ n - w, n };
    return k + 1;
}

void gr_window_features(const struct GrSignals *s, size_t a, size_t b, double f[GR_N_FEATURES])
{
    double lp = 0, lp_min = INFINITY, ent = 0, mar = 0, doc = 0, gen = 0, diff = 0, uns = 0;
    double qr = 0;
    for (size_t i = a; i < b; i++) {
        if (s->quote_removed)
            qr += s->quote_removed[i];
        lp += s->logprob[i];
        if (s->logprob[i] < lp_min)
            lp_min = s->logprob[i];
        ent += s->entropy[i];
        mar += s->margin[i];
        doc += s->doc_mass[i];
        gen += s->gen_mass[i];
        diff += s->diff_doc_mass[i];
        uns += s->unsupported[i] ? 1 : 0;
    }
    double k = (double)(b - a);
    f[GR_MEAN_LOGPROB] = lp / k;
    f[GR_MIN_LOGPROB] = lp_min;
    f[GR_MEAN_ENTROPY] = ent / k;
    f[GR_MEAN_MARGIN] = mar / k;
    f[GR_LOOKBACK] = doc + gen != 0 ? doc / (doc + gen) : 0;
    f[GR_DIFF_DOC_MASS] = diff / k;
    f[GR_UNSUPPORTED_RATIO] = uns / k;
    f[GR_SELF_CHECK] = !s->has_check ? NAN
                       : s->check > GR_CHECK_CLIP ? GR_CHECK_CLIP
                       : s->check < -GR_CHECK_CLIP ? -GR_CHECK_CLIP : s->check;
    f[GR_RELIANCE] = s->has_reliance ? s->reliance : NAN;
    f[GR_PROBE] = s->has_probe ? s->probe : NAN;
    f[GR_QUOTE_REMOVED] = s->quote_removed ? qr / k : NAN;
    f[GR_LOG_CONTEXT] = log1p((double)s->context_tokens);
}

double gr_length_offset(const struct GrCalibration *c, double log_context)
{
    int n = c->n_knots;
    if (n == 0)
        return 0;
    if (log_context <= log1p(c->knot_tokens[0]))
        return c->knot_offset[0];
    for (int i = 1; i < n; i++) {
        double a = log1p(c->knot_tokens[i - 1]), b = log1p(c->knot_tokens[i]);
        if (log_context <= b)
            return c->knot_offset[i - 1] +
                   (c->knot_offset[i] - c->knot_offset[i - 1]) * (log_context - a) / (b - a);
    }
    return c->knot_offset[n - 1];
}

double gr_window_score(const struct GrCalibration *c, const double f[GR_N_FEATURES])
{
    double z = c->bias + gr_length_offset(c, f[GR_LOG_CONTEXT]);
    for (int j = 0; j < c->n_features; j++)
        if (!isnan(f[c->feature[j]]))
            z += c->weight[j] * (f[c->feature[j]] - c->mean[j]) / c->scale[j];
    return 1.0 / (1.0 + exp(-z));
}

int gr_abstained(const char *answer, size_t len)
{
    const char *phrase = PROMPT_REFUSAL;
    size_t pl = strlen(phrase);
    while (pl && ispunct((unsigned char)phrase[pl - 1]))
        pl--;
    size_t i = 0;
    while (i < len && isspace((unsigned char)answer[i]))
        i++;
    if (len - i < pl)
        return 0;
    for (size_t k = 0; k < pl; k++)
        if (tolower((unsigned char)answer[i + k]) != tolower((unsigned char)phrase[k]))
            return 0;
    return 1;
}

int gr_probe_fits(const struct GrCalibration *c, size_t dim)
{
    return dim && ((size_t)c->n_probe == 2 * dim || (size_t)c->n_probe == 3 * dim);
}

double gr_probe_logit(const struct GrCalibration *c, const float *rows, size_t dim,
                      size_t context_tokens)
{
    if (!c || c->probe_layer < 0 || !gr_probe_fits(c, dim))
        return NAN;
    const float *w = c->probe_w;
    double z = c->probe_bias;
    if (c->long_probe_from && context_tokens >= c->long_probe_from) {
        w = c->long_probe_w;
        z = c->long_probe_bias;
    } else if (context_tokens < c->short_probe_until) {
        w = c->short_probe_w;
        z = c->short_probe_bias;
    }
    for (size_t i = 0; i < (size_t)c->n_probe; i++)
        z += (double)w[i] * rows[i];
    return z;
}

void gr_summarize(const struct GrCalibration *cal, double threshold, const struct GrSignals *s,
                  const char *answer, size_t len, double *token_score, struct GrSummary *out)
{
    memset(out, 0, sizeof *out);
    out->answer_tokens = s->n;
    out->abstained = gr_abstained(answer, len);
    out->has_check = s->has_check;
    if (s->has_check)
        out->self_check = 1.0 / (1.0 + exp(-s->check));
    out->has_reliance = s->has_reliance;
    out->context_reliance = s->reliance;
    out->has_probe = s->has_probe;
    out->hidden_probe = 1.0 / (1.0 + exp(-s->probe));
    size_t n = s->n;
    if (n > 0) {
        double doc = 0, gen = 0, lp = 0, lp_min = INFINITY, uns = 0;
        for (size_t i = 0; i < n; i++) {
            doc += s->doc_mass[i];
            gen += s->gen_mass[i];
            lp += s->logprob[i];
            if (s->logprob[i] < lp_min)
                lp_min = s->logprob[i];
            uns += s->unsupported[i] ? 1 : 0;
        }
        out->has_ratios = 1;
        if (s->quote_removed) {
            double qr = 0;
            for (size_t i = 0; i < n; i++)
                qr += s->quote_removed[i];
            out->has_quote = 1;
            out->quote_removed = qr / (double)n;
        }
        /* mean(doc) / (mean(doc) + mean(gen)): the n cancels */
        out->lookback_ratio = doc + gen != 0 ? doc / (doc + gen) : 0;
        out->unsupported_token_ratio = uns / (double)n;
        out->mean_logprob = lp / (double)n;
        out->min_logprob = lp_min;
    }
    if (!cal || n == 0)
        return;
    /* a probe's weights were fitted with it: without its rows the answer is not scored */
    for (int j = 0; j < cal->n_features; j++)
        if (cal->feature[j] == GR_PROBE && !s->has_probe)
            return;
    if (token_score)
        for (size_t i = 0; i < n; i++)
            token_score[i] = 0;
    /* Windows start in increasing order and their ends never decrease, so the flagged
     * windows' union is counted in one pass. */
    size_t W = (size_t)cal->window, S = (size_t)cal->stride;
    size_t nw = gr_windows(n, cal->window, cal->stride, NULL, 0), covered = 0, flagged = 0;
    double best = 0;
    for (size_t k = 0; k < nw; k++) {
        struct GrWindow w = n <= W ? (struct GrWindow){ 0, n }
                          : k + 1 == nw ? (struct GrWindow){ n - W, n }
                          : (struct GrWindow){ k * S, k * S + W };
        double f[GR_N_FEATURES];
        gr_window_features(s, w.start, w.end, f);
        double sc = gr_window_score(cal, f);
        if (sc > best)
            best = sc;
        if (token_score)
            for (size_t i = w.start; i < w.end; i++)
                if (sc > token_score[i])
                    token_score[i] = sc;
        if (sc >= threshold) {
            size_t from = w.start > covered ? w.start : covered;
            if (w.end > from)
                flagged += w.end - from;
            if (w.end > covered)
                covered = w.end;
        }
    }
    out->scored = 1;
    out->score = best;
    out->flagged = best >= threshold && !out->abstained;
    out->flagged_tokens = out->flagged ? flagged : 0;
}
