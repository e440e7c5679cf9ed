/* The groundedness figures of an answer, as docs/groundedness.md defines each one: the
 * documents' word set and lexical support, the windows and their features, the calibrated
 * logistic score, abstention, the request summary; and the calibration file. Pure functions
 * over arrays: nothing here touches a socket or the engine, so all of it is unit-tested. */
#ifndef DIFFRAG_GROUNDING_H
#define DIFFRAG_GROUNDING_H

#include <stddef.h>
#include <stdint.h>

#include "text/words.h"

/* ---- calibration ---- */

enum GrFeature {
    GR_MEAN_LOGPROB, GR_MIN_LOGPROB, GR_MEAN_ENTROPY, GR_MEAN_MARGIN, GR_LOOKBACK,
    GR_DIFF_DOC_MASS, GR_UNSUPPORTED_RATIO, GR_SELF_CHECK, GR_RELIANCE, GR_PROBE,
    GR_QUOTE_REMOVED, GR_LOG_CONTEXT, GR_N_FEATURES
};
/* The self-check feature's log-odds are clipped to [-GR_CHECK_CLIP, GR_CHECK_CLIP]. */
#define GR_CHECK_CLIP 20.0
/* The hidden-state probe's logit is clipped to [-GR_PROBE_CLIP, GR_PROBE_CLIP]. */
#define GR_PROBE_CLIP 40.0
const char *gr_feature_name(int f);   /* "mean_logprob", ...; NULL out of range */

#define GR_MAX_WATCH 1024          /* = ENGINE_MAX_WATCH */
#define GR_MAX_NAME 64
#define GR_MAX_WINDOW 4096
#define GR_MAX_FILE_BYTES (1 << 20)
#define GR_MAX_PROBE 24576                /* probe weights: three rows of a dim up to 8192 */
#define GR_MAX_KNOTS 16                   /* length_tokens / length_offset */
#define GR_MAX_COEF 1e12                  /* |mean|, |weights| at most this */
#define GR_MIN_SCALE 1e-12                /* every scale at least this */

struct GrHead { int layer, head; };

struct GrCalibration {
    char name[GR_MAX_NAME + 1];        /* [A-Za-z0-9._-]+ */
    uint8_t model_sha256[32];
    int window, stride;                /* 1 <= stride <= window <= GR_MAX_WINDOW */
    double threshold;                  /* [0, 1] */
    struct GrHead watch[GR_MAX_WATCH]; /* distinct (layer, head) pairs */
    int n_watch;                       /* >= 1 */
    int n_features;                    /* 1..GR_N_FEATURES */
    int feature[GR_N_FEATURES];        /* enum GrFeature, in the file's order, distinct */
    /* |mean|, |weight| <= GR_MAX_COEF; scale >= GR_MIN_SCALE */
    double mean[GR_N_FEATURES], scale[GR_N_FEATURES], weight[GR_N_FEATURES];
    double bias;
    /* The length offset (optional): added to every window's logit, linear in ln(1 + the
     * documents' tokens) between the knots and constant beyond them, so that one threshold
     * means the same at every context length. */
    int n_knots;                       /* 0: none; else 1..GR_MAX_KNOTS */
    double knot_tokens[GR_MAX_KNOTS];  /* documents' tokens, strictly ascending */
    double knot_offset[GR_MAX_KNOTS];  /* the logit offset at each knot */
    /* The hidden-state probe (optional; the feature hidden_probe needs it): its logit is
     * probe_bias + probe_w . [the residual stream entering probe_layer at the prompt's last
     * position ; its mean over the positions that gave the answer tokens (; at the last
     * position, when the weights have a third row)]. */
    int probe_layer;                   /* -1: none */
    int n_probe;                       /* 2 or 3 times the model's dim */
    float probe_w[GR_MAX_PROBE];
    double probe_bias;
    /* A probe for long prompts (optional; needs the probe): from long_probe_from documents'
     * tokens on, its weights (as many as the probe's, over the same layer and rows) and bias
     * take the probe's place. */
    size_t long_probe_from;            /* 0: none */
    int n_long_probe;
    float long_probe_w[GR_MAX_PROBE];
    double long_probe_bias;
    /* A probe for short prompts (optional; needs the probe): below short_probe_until
     * documents' tokens (at most long_probe_from when both are given), its weights and bias
     * take the probe's place, as the long probe's do above. */
    size_t short_probe_until;          /* 0: none */
    int n_short_probe;
    float short_probe_w[GR_MAX_PROBE];
    double short_probe_bias;
};

/* Parses a calibration file's text (len bytes; need not be NUL-terminated). 0, or -1 with
 * "ORIGIN:LINE: what is wrong" in err (ORIGIN: a file name for the message). */
int gr_calibration_parse(const char *text, size_t len, const char *origin,
                         struct GrCalibration *out, char *err, size_t errlen);
/* Reads and parses a file (at most GR_MAX_FILE_BYTES). 0, or -1 with err as above, or naming
 * the file and errno when it cannot be read. */
int gr_calibration_load(const char *path, struct GrCalibration *out, char *err, size_t errlen);

/* The SHA-256 of a whole file (a calibration is bound to the model file's digest), read in
 * pieces through libcrypto. 0, or -1 with err naming the file and errno. */
int gr_file_sha256(const char *path, uint8_t digest[32], char *err, size_t errlen);
/* 64 lowercase hex digits and a NUL into out (65 bytes). */
void gr_sha256_hex(const uint8_t digest[32], char out[65]);

/* "auto" is not a list: parses LAYER:HEAD pairs separated by commas (spaces allowed), at
 * most cap, distinct, at least one. 0, or -1 with err. */
int gr_parse_heads(const char *s, struct GrHead *out, int cap, int *n, char *err, size_t errlen);
/* Layer numbers separated by commas (spaces allowed), at most cap, distinct; "" is none. 0, or
 * -1 with err. */
#define GR_MAX_HIDDEN 8                   /* = ENGINE_MAX_CAPTURE */
int gr_parse_layers(const char *s, int *out, int cap, int *n, char *err, size_t errlen);

/* ---- per-token signals ---- */

/* The answer tokens' signals (struct of arrays, each of n; borrowed). Token i covers the
 * answer bytes [text_end[i-1], text_end[i]) (text_end[-1] = 0). */
struct GrSignals {
    size_t n;
    const float *logprob, *entropy, *margin;
    const float *doc_mass, *gen_mass, *diff_doc_mass, *lookback;
    const uint32_t *text_end;
    const uint8_t *unsupported;        /* 0/1, from gr_lexical */
    int has_check;                     /* the self-check ran */
    double check;                      /* its log P(yes) - log P(no) */
    int has_reliance;                  /* context reliance was measured */
    double reliance;                   /* mean log-probability with the documents - without */
    int has_probe;                     /* the hidden-state probe ran */
    double probe;                      /* its logit (gr_probe_logit) */
    const float *quote_removed;        /* quote decoding: the mass the constraint removed at
                                          each token; NULL: a free-text answer */
    size_t context_tokens;             /* the documents' tokens in the prompt (feature
                                          log_context_tokens = ln(1 + it)) */
};

/* ---- words and lexical support ---- */

/* Words come from text/words.h (the analyzer's splitting, lowercased). */

/* A content word: not a stop word, or has a digit, or starts with a capital letter. */
int gr_is_content(const struct Word *w);

/* unsupported[i] = 1 when token i's bytes overlap a content word of the answer whose
 * lowercased form is not in docs (NULL: no documents, every content word unsupported).
 * text_end must be non-decreasing and at most len. */
void gr_lexical(const struct WordSet *docs, const char *answer, size_t len,
                const uint32_t *text_end, size_t n, uint8_t *unsupported);

/* ---- windows, features, score ---- */

struct GrWindow { size_t start, end; };   /* answer tokens [start, end) */
/* The windows of an n-token answer (none when n = 0). Fills out[0..min(total, cap)) and
 * returns the total. */
size_t gr_windows(size_t n, int window, int stride, struct GrWindow *out, size_t cap);
/* The features of tokens [a, b), a < b <= s->n, in enum GrFeature order. The self-check and
 * the context reliance are the answer's, the same in every window, and NaN when not measured. */
void gr_window_features(const struct GrSignals *s, size_t a, size_t b,
                        double f[GR_N_FEATURES]);
/* sigma(bias + length offset + sum_j weight_j (f_j - mean_j) / scale_j) over the calibration's
 * features; a NaN feature (a self-check that did not run) adds nothing, as if it were at its
 * mean. The length offset is read at f[GR_LOG_CONTEXT]. */
double gr_window_score(const struct GrCalibration *c, const double f[GR_N_FEATURES]);
/* The calibration's length offset at log_context = ln(1 + the documents' tokens): 0 without
 * knots; the first or last knot's offset outside them; linear in log_context between two. */
double gr_length_offset(const struct GrCalibration *c, double log_context);

/* The answer, whitespace-trimmed, begins with the prompt's refusal phrase (case-insensitive,
 * its final punctuation optional). */
int gr_abstained(const char *answer, size_t len);

struct GrSummary {
    int scored;                   /* a calibration scored the answer (it has >= 1 token) */
    double score;                 /* scored: max over windows, in [0, 1] */
    int flagged;                  /* scored, score >= threshold and not abstained */
    int abstained;
    int has_ratios;               /* answer_tokens > 0: the four figures below are defined */
    double lookback_ratio, unsupported_token_ratio, mean_logprob, min_logprob;
    int has_check;
    double self_check;            /* has_check: P(yes) / (P(yes) + P(no)) of the self-check */
    int has_reliance;
    double context_reliance;      /* has_reliance: GrSignals.reliance */
    int has_probe;
    double hidden_probe;          /* has_probe: sigma(GrSignals.probe) */
    int has_quote;                /* a quoted answer of >= 1 token */
    double quote_removed;         /* has_quote: mean of GrSignals.quote_removed */
    size_t answer_tokens, flagged_tokens;
};

/* The probe's logit (GrCalibration.probe_*; long_probe_* when the prompt's documents'
 * context_tokens reach long_probe_from, short_probe_* when they are under short_probe_until)
 * over the rows of its layer: first, mean and last, each of dim floats, one after the other;
 * NAN when the calibration has no probe or its weights are not two or three rows of this dim. */
double gr_probe_logit(const struct GrCalibration *c, const float *rows, size_t dim,
                      size_t context_tokens);
/* Whether the calibration's probe weights are two or three rows of dim. */
int gr_probe_fits(const struct GrCalibration *c, size_t dim);

/* Everything a reply reports about one answer. cal NULL: no detector (score and flag not
 * claimed); nor are they when the calibration's features include hidden_probe and the answer
 * has no probe logit. token_score (n entries, may be NULL) receives, with a calibration, each token's
 * highest window score. Allocates nothing. */
void gr_summarize(const struct GrCalibration *cal, double threshold, const struct GrSignals *s,
                  const char *answer, size_t len, double *token_score, struct GrSummary *out);

#endif
