/* The calibration file's strict parser and loader (docs/groundedness.md "Calibration file"),
 * the model file's digest it is checked against, and the configuration's lists of watched heads
 * and captured layers. */
#include "daemon/grounding.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <openssl/evp.h>

/* Keys before CK_REQUIRED are required; the probe's three come together or not at all, and so
 * do the long and the short probe's three and the length offset's two. */
enum CalKey { CK_MAGIC, CK_NAME, CK_SHA, CK_WINDOW, CK_STRIDE, CK_THRESHOLD, CK_WATCH,
              CK_FEATURES, CK_MEAN, CK_SCALE, CK_WEIGHTS, CK_BIAS, CK_REQUIRED,
              CK_PROBE_LAYER = CK_REQUIRED, CK_PROBE_WEIGHTS, CK_PROBE_BIAS, CK_LENGTH_TOKENS,
              CK_LENGTH_OFFSET, CK_LONG_PROBE_FROM, CK_LONG_PROBE_WEIGHTS, CK_LONG_PROBE_BIAS,
              CK_SHORT_PROBE_UNTIL, CK_SHORT_PROBE_WEIGHTS, CK_SHORT_PROBE_BIAS, CK_COUNT };
static const char *const cal_keys[CK_COUNT] = {
    "diffrag-grounding", "name", "model_sha256", "window", "stride", "threshold", "watch",
    "features", "mean", "scale", "weights", "bias", "probe_layer", "probe_weights", "probe_bias",
    "length_tokens", "length_offset", "long_probe_from", "long_probe_weights", "long_probe_bias",
    "short_probe_until", "short_probe_weights", "short_probe_bias",
};

struct CalParse {
    const char *origin;
    int line;
    char *err;
    size_t errlen;
};

static int cal_fail(struct CalParse *p, int line, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line > 0)
        snprintf(p->err, p->errlen, "%s:%d: %s", p->origin, line, msg);
    else
        snprintf(p->err, p->errlen, "%s: %s", p->origin, msg);
    return -1;
}

/* The next whitespace-separated token of [*s, end): sets *t and *tl; 0 when none is left. */
static int next_token(const char **s, const char *end, const char **t, size_t *tl)
{
    const char *p = *s;
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    if (p == end)
        return 0;
    const char *q = p;
    while (q < end && *q != ' ' && *q != '\t')
        q++;
    *t = p;
    *tl = (size_t)(q - p);
    *s = q;
    return 1;
}

static int parse_number(const char *t, size_t tl, double *out)
{
    char buf[64];
    if (tl == 0 || tl >= sizeof buf)
        return -1;
    memcpy(buf, t, tl);
    buf[tl] = 0;
    char *e;
    errno = 0;
    double v = strtod(buf, &e);
    if (errno || *e || e == buf || !isfinite(v))
        return -1;
    *out = v;
    return 0;
}

static int parse_int(const char *t, size_t tl, long lo, long hi, long *out)
{
    if (tl == 0 || tl > 9)
        return -1;
    long v = 0;
    for (size_t i = 0; i < tl; i++) {
        if (t[i] < '0' || t[i] > '9')
            return -1;
        v = v * 10 + (t[i] - '0');
    }
    if (v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The numbers of a mean/scale/weights line: each within GR_MAX_COEF of 0, and a scale at
 * least GR_MIN_SCALE, so that a window's logit over finite features is a finite number (a
 * weight over a tiny scale would make it infinite, and two such terms of opposite signs NaN). */
static int parse_vector(struct CalParse *p, const char *key, const char *s, const char *end,
                        double *v, int *n)
{
    const char *t;
    size_t tl;
    *n = 0;
    while (next_token(&s, end, &t, &tl)) {
        if (*n == GR_N_FEATURES)
            return cal_fail(p, p->line, "%s has more than %d numbers", key, GR_N_FEATURES);
        if (parse_number(t, tl, &v[*n]) || fabs(v[*n]) > GR_MAX_COEF)
            return cal_fail(p, p->line, "%s: \"%.*s\" is not a number from -%g to %g", key,
                            (int)(tl < 40 ? tl : 40), t, GR_MAX_COEF, GR_MAX_COEF);
        (*n)++;
    }
    return 0;
}

/* A probe's weights (key probe_weights, long_probe_weights or short_probe_weights, into w and
 * *n): two or three
 * rows of the model's dim (checked against the model where it is loaded), at most
 * GR_MAX_PROBE numbers. */
static int parse_probe(struct CalParse *p, const char *key, float *w, int *n, const char *s,
                       const char *end)
{
    const char *t;
    size_t tl;
    double v;
    *n = 0;
    while (next_token(&s, end, &t, &tl)) {
        if (*n == GR_MAX_PROBE)
            return cal_fail(p, p->line, "%s has more than %d numbers", key, GR_MAX_PROBE);
        if (parse_number(t, tl, &v) || fabs(v) > 1e30)
            return cal_fail(p, p->line, "%s: \"%.*s\" is not a finite number", key,
                            (int)(tl < 40 ? tl : 40), t);
        w[(*n)++] = (float)v;
    }
    if (*n == 0 || (*n % 2 && *n % 3))
        return cal_fail(p, p->line, "%s has %d numbers; it needs two or three rows of the "
                        "model's dim", key, *n);
    return 0;
}

/* The length offset's knots: documents' token counts, strictly ascending; or their offsets. */
static int parse_knots(struct CalParse *p, struct GrCalibration *c, int tokens, const char *s,
                       const char *end, int *n)
{
    const char *key = tokens ? "length_tokens" : "length_offset", *t;
    size_t tl;
    *n = 0;
    while (next_token(&s, end, &t, &tl)) {
        if (*n == GR_MAX_KNOTS)
            return cal_fail(p, p->line, "%s has more than %d numbers", key, GR_MAX_KNOTS);
        long iv;
        double v;
        if (tokens) {
            if (parse_int(t, tl, 0, 100000000, &iv))
                return cal_fail(p, p->line, "length_tokens: \"%.*s\" is not a token count from 0 "
                                "to 100000000", (int)(tl < 40 ? tl : 40), t);
            if (*n > 0 && (double)iv <= c->knot_tokens[*n - 1])
                return cal_fail(p, p->line, "length_tokens must be strictly ascending");
            c->knot_tokens[*n] = (double)iv;
        } else {
            if (parse_number(t, tl, &v) || fabs(v) > 1e3)
                return cal_fail(p, p->line, "length_offset: \"%.*s\" is not a number from -1000 "
                                "to 1000", (int)(tl < 40 ? tl : 40), t);
            c->knot_offset[*n] = v;
        }
        (*n)++;
    }
    if (*n == 0)
        return cal_fail(p, p->line, "%s has no value", key);
    return 0;
}

/* The words after a key: exactly one expected. */
static int one_token(struct CalParse *p, const char *key, const char *s, const char *end,
                     const char **t, size_t *tl)
{
    const char *x;
    size_t xl;
    if (!next_token(&s, end, t, tl))
        return cal_fail(p, p->line, "%s has no value", key);
    if (next_token(&s, end, &x, &xl))
        return cal_fail(p, p->line, "%s takes one value", key);
    return 0;
}

static int parse_watch(struct CalParse *p, struct GrCalibration *c, const char *s, const char *end)
{
    const char *t;
    size_t tl;
    c->n_watch = 0;
    while (next_token(&s, end, &t, &tl)) {
        const char *colon = memchr(t, ':', tl);
        long l, h;
        if (!colon || parse_int(t, (size_t)(colon - t), 0, 65535, &l) ||
            parse_int(colon + 1, tl - (size_t)(colon - t) - 1, 0, 65535, &h))
            return cal_fail(p, p->line, "watch: \"%.*s\" is not LAYER:HEAD", (int)(tl < 40 ? tl : 40), t);
        if (c->n_watch == GR_MAX_WATCH)
            return cal_fail(p, p->line, "watch lists more than %d heads", GR_MAX_WATCH);
        for (int i = 0; i < c->n_watch; i++)
            if (c->watch[i].layer == l && c->watch[i].head == h)
                return cal_fail(p, p->line, "watch lists %ld:%ld twice", l, h);
        c->watch[c->n_watch++] = (struct GrHead){ (int)l, (int)h };
    }
    if (c->n_watch == 0)
        return cal_fail(p, p->line, "watch lists no head");
    return 0;
}

static int parse_features(struct CalParse *p, struct GrCalibration *c, const char *s, const char *end)
{
    const char *t;
    size_t tl;
    c->n_features = 0;
    while (next_token(&s, end, &t, &tl)) {
        int f;
        for (f = 0; f < GR_N_FEATURES; f++)
            if (strlen(gr_feature_name(f)) == tl && !memcmp(gr_feature_name(f), t, tl))
                break;
        if (f == GR_N_FEATURES)
            return cal_fail(p, p->line, "unknown feature \"%.*s\"", (int)(tl < 40 ? tl : 40), t);
        for (int j = 0; j < c->n_features; j++)
            if (c->feature[j] == f)
                return cal_fail(p, p->line, "feature %s is named twice", gr_feature_name(f));
        c->feature[c->n_features++] = f;
    }
    if (c->n_features == 0)
        return cal_fail(p, p->line, "features names none");
    return 0;
}

static int parse_line(struct CalParse *p, struct GrCalibration *c, const char *s, const char *end,
                      int *lines, int *n_vec, int *n_knots)
{
    const char *t;
    size_t tl;
    if (!next_token(&s, end, &t, &tl))
        return 0;
    int k;
    for (k = 0; k < CK_COUNT; k++)
        if (strlen(cal_keys[k]) == tl && !memcmp(cal_keys[k], t, tl))
            break;
    if (k == CK_COUNT)
        return cal_fail(p, p->line, "unknown key \"%.*s\"", (int)(tl < 40 ? tl : 40), t);
    if (lines[k])
        return cal_fail(p, p->line, "%s appears twice (first on line %d)", cal_keys[k], lines[k]);
    lines[k] = p->line;
    const char *key = cal_keys[k];
    long iv;
    double dv;
    switch (k) {
    case CK_MAGIC:
        if (one_token(p, key, s, end, &t, &tl))
            return -1;
        if (tl != 1 || t[0] != '1')
            return cal_fail(p, p->line, "version %.*s: this daemon reads diffrag-grounding 1",
                            (int)(tl < 20 ? tl : 20), t);
        return 0;
    case CK_NAME:
        if (one_token(p, key, s, end, &t, &tl))
            return -1;
        if (tl > GR_MAX_NAME)
            return cal_fail(p, p->line, "name is longer than %d characters", GR_MAX_NAME);
        for (size_t i = 0; i < tl; i++)
            if (!isalnum((unsigned char)t[i]) && t[i] != '.' && t[i] != '_' && t[i] != '-')
                return cal_fail(p, p->line, "name may hold only letters, digits, '.', '_' and '-'");
        memcpy(c->name, t, tl);
        c->name[tl] = 0;
        return 0;
    case CK_SHA:
        if (one_token(p, key, s, end, &t, &tl))
            return -1;
        if (tl != 64)
            return cal_fail(p, p->line, "model_sha256 must be 64 hex digits (has %zu characters)", tl);
        for (int i = 0; i < 32; i++) {
            int hi = hexval(t[2 * i]), lo = hexval(t[2 * i + 1]);
            if (hi < 0 || lo < 0)
                return cal_fail(p, p->line, "model_sha256 must be 64 hex digits");
            c->model_sha256[i] = (uint8_t)(hi << 4 | lo);
        }
        return 0;
    case CK_WINDOW:
    case CK_STRIDE:
        if (one_token(p, key, s, end, &t, &tl))
            return -1;
        if (parse_int(t, tl, 1, GR_MAX_WINDOW, &iv))
            return cal_fail(p, p->line, "%s must be an integer from 1 to %d", key, GR_MAX_WINDOW);
        *(k == CK_WINDOW ? &c->window : &c->stride) = (int)iv;
        return 0;
    case CK_THRESHOLD:
    case CK_BIAS:
    case CK_PROBE_BIAS:
    case CK_LONG_PROBE_BIAS:
    case CK_SHORT_PROBE_BIAS:
        if (one_token(p, key, s, end, &t, &tl))
            return -1;
        if (parse_number(t, tl, &dv))
            return cal_fail(p, p->line, "%s: \"%.*s\" is not a finite number", key,
                            (int)(tl < 40 ? tl : 40), t);
        if (k == CK_THRESHOLD && (dv < 0 || dv > 1))
            return cal_fail(p, p->line, "threshold %g is outside [0, 1]", dv);
        *(k == CK_THRESHOLD ? &c->threshold : k == CK_BIAS ? &c->bias :
          k == CK_PROBE_BIAS ? &c->probe_bias :
          k == CK_LONG_PROBE_BIAS ? &c->long_probe_bias : &c->short_probe_bias) = dv;
        return 0;
    case CK_LONG_PROBE_FROM:
    case CK_SHORT_PROBE_UNTIL:
        if (one_token(p, key, s, end, &t, &tl))
            return -1;
        if (parse_int(t, tl, 1, 100000000, &iv))
            return cal_fail(p, p->line, "%s must be a token count from 1 to 100000000", key);
        *(k == CK_LONG_PROBE_FROM ? &c->long_probe_from : &c->short_probe_until) = (size_t)iv;
        return 0;
    case CK_PROBE_LAYER:
        if (one_token(p, key, s, end, &t, &tl))
            return -1;
        if (parse_int(t, tl, 0, 65535, &iv))
            return cal_fail(p, p->line, "probe_layer must be an integer from 0 to 65535");
        c->probe_layer = (int)iv;
        return 0;
    case CK_PROBE_WEIGHTS:
        return parse_probe(p, key, c->probe_w, &c->n_probe, s, end);
    case CK_LONG_PROBE_WEIGHTS:
        return parse_probe(p, key, c->long_probe_w, &c->n_long_probe, s, end);
    case CK_SHORT_PROBE_WEIGHTS:
        return parse_probe(p, key, c->short_probe_w, &c->n_short_probe, s, end);
    case CK_WATCH:
        return parse_watch(p, c, s, end);
    case CK_FEATURES:
        return parse_features(p, c, s, end);
    case CK_MEAN:
        return parse_vector(p, key, s, end, c->mean, &n_vec[0]);
    case CK_SCALE:
        return parse_vector(p, key, s, end, c->scale, &n_vec[1]);
    case CK_WEIGHTS:
        return parse_vector(p, key, s, end, c->weight, &n_vec[2]);
    case CK_LENGTH_TOKENS:
    case CK_LENGTH_OFFSET:
        return parse_knots(p, c, k == CK_LENGTH_TOKENS, s, end, &n_knots[k == CK_LENGTH_OFFSET]);
    }
    return cal_fail(p, p->line, "key %s is not handled", key);
}

/* A probe for a range of prompt lengths: its three keys (its bound, weights and bias, from
 * `first` on in CalKey) come together, need the probe, and have as many weights as it. 1 when
 * the calibration has them, 0 when not, -1 (with the message) when they are wrong. */
static int ranged_probe_check(struct CalParse *p, const int *lines, enum CalKey first,
                              int probe_keys, int n_weights, int n_probe)
{
    int n = !!lines[first] + !!lines[first + 1] + !!lines[first + 2];
    if (n == 0)
        return 0;
    if (n != 3)
        return cal_fail(p, 0, "%s, %s and %s come together", cal_keys[first],
                        cal_keys[first + 1], cal_keys[first + 2]);
    if (!probe_keys)
        return cal_fail(p, lines[first], "%s needs the probe (probe_layer, probe_weights, "
                        "probe_bias)", cal_keys[first]);
    if (n_weights != n_probe)
        return cal_fail(p, lines[first + 1], "%s has %d numbers; probe_weights has %d",
                        cal_keys[first + 1], n_weights, n_probe);
    return 1;
}

int gr_calibration_parse(const char *text, size_t len, const char *origin,
                         struct GrCalibration *out, char *err, size_t errlen)
{
    struct CalParse p = { .origin = origin ? origin : "calibration", .err = err, .errlen = errlen };
    int lines[CK_COUNT] = { 0 }, n_vec[3] = { 0 }, n_knots[2] = { 0 };
    memset(out, 0, sizeof *out);
    out->probe_layer = -1;
    if (len > GR_MAX_FILE_BYTES)
        return cal_fail(&p, 0, "larger than %d bytes", GR_MAX_FILE_BYTES);
    const char *s = text, *end = text + len;
    while (s < end) {
        p.line++;
        const char *nl = memchr(s, '\n', (size_t)(end - s));
        const char *le = nl ? nl : end;
        if (memchr(s, 0, (size_t)(le - s)))
            return cal_fail(&p, p.line, "NUL byte");
        const char *hash = memchr(s, '#', (size_t)(le - s));
        const char *ce = hash ? hash : le;
        while (ce > s && (ce[-1] == '\r' || ce[-1] == ' ' || ce[-1] == '\t'))
            ce--;
        for (const char *q = s; q < ce; q++)
            if ((unsigned char)*q < 0x20 && *q != '\t')
                return cal_fail(&p, p.line, "control character 0x%02x", (unsigned char)*q);
        if (parse_line(&p, out, s, ce, lines, n_vec, n_knots))
            return -1;
        s = nl ? nl + 1 : end;
    }
    for (int k = 0; k < CK_REQUIRED; k++)
        if (!lines[k])
            return cal_fail(&p, 0, "%s is missing (every key is required)", cal_keys[k]);
    int probe_keys = !!lines[CK_PROBE_LAYER] + !!lines[CK_PROBE_WEIGHTS] + !!lines[CK_PROBE_BIAS];
    if (probe_keys != 0 && probe_keys != 3)
        return cal_fail(&p, 0, "probe_layer, probe_weights and probe_bias come together");
    int long_keys = ranged_probe_check(&p, lines, CK_LONG_PROBE_FROM, probe_keys,
                                       out->n_long_probe, out->n_probe);
    int short_keys = ranged_probe_check(&p, lines, CK_SHORT_PROBE_UNTIL, probe_keys,
                                        out->n_short_probe, out->n_probe);
    if (long_keys < 0 || short_keys < 0)
        return -1;
    if (long_keys && short_keys && out->short_probe_until > out->long_probe_from)
        return cal_fail(&p, lines[CK_SHORT_PROBE_UNTIL], "short_probe_until %zu is above "
                        "long_probe_from %zu", out->short_probe_until, out->long_probe_from);
    if (!!lines[CK_LENGTH_TOKENS] != !!lines[CK_LENGTH_OFFSET])
        return cal_fail(&p, 0, "length_tokens and length_offset come together");
    if (n_knots[0] != n_knots[1])
        return cal_fail(&p, lines[CK_LENGTH_OFFSET], "length_offset has %d numbers; "
                        "length_tokens has %d", n_knots[1], n_knots[0]);
    out->n_knots = n_knots[0];
    for (int j = 0; j < out->n_features; j++)
        if (out->feature[j] == GR_PROBE && !probe_keys)
            return cal_fail(&p, lines[CK_FEATURES], "feature hidden_probe needs probe_layer, "
                            "probe_weights and probe_bias");
    if (out->stride > out->window)
        return cal_fail(&p, lines[CK_STRIDE], "stride %d exceeds window %d (every token must be "
                        "in a window)", out->stride, out->window);
    static const enum CalKey vec_keys[3] = { CK_MEAN, CK_SCALE, CK_WEIGHTS };
    for (int v = 0; v < 3; v++)
        if (n_vec[v] != out->n_features)
            return cal_fail(&p, lines[vec_keys[v]], "%s has %d numbers; features names %d",
                            cal_keys[vec_keys[v]], n_vec[v], out->n_features);
    for (int j = 0; j < out->n_features; j++)
        if (!(out->scale[j] >= GR_MIN_SCALE))
            return cal_fail(&p, lines[CK_SCALE], "scale of %s is %g; it must be at least %g",
                            gr_feature_name(out->feature[j]), out->scale[j], GR_MIN_SCALE);
    return 0;
}

int gr_calibration_load(const char *path, struct GrCalibration *out, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    char *buf = malloc(GR_MAX_FILE_BYTES + 1);
    if (!buf) {
        fclose(f);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    size_t n = fread(buf, 1, GR_MAX_FILE_BYTES + 1, f);
    int bad = ferror(f);
    fclose(f);
    int rc;
    if (bad) {
        snprintf(err, errlen, "%s: read error", path);
        rc = -1;
    } else {
        rc = gr_calibration_parse(buf, n, path, out, err, errlen);
    }
    free(buf);
    return rc;
}

int gr_file_sha256(const char *path, uint8_t digest[32], char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    enum { PIECE = 1 << 20 };
    uint8_t *buf = malloc(PIECE);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    int rc = -1;
    if (!buf || !md || !EVP_DigestInit_ex(md, EVP_sha256(), NULL)) {
        snprintf(err, errlen, "%s: cannot set up SHA-256 (out of memory)", path);
        goto out;
    }
    size_t n;
    int ok = 1;
    while (ok && (n = fread(buf, 1, PIECE, f)) > 0)
        ok = EVP_DigestUpdate(md, buf, n);
    unsigned int dlen = 0;
    if (ferror(f))
        snprintf(err, errlen, "%s: read error", path);
    else if (!ok || !EVP_DigestFinal_ex(md, digest, &dlen) || dlen != 32)
        snprintf(err, errlen, "%s: SHA-256 failed", path);
    else
        rc = 0;
out:
    EVP_MD_CTX_free(md);
    free(buf);
    fclose(f);
    return rc;
}

void gr_sha256_hex(const uint8_t digest[32], char out[65])
{
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        out[2 * i] = hex[digest[i] >> 4];
        out[2 * i + 1] = hex[digest[i] & 15];
    }
    out[64] = 0;
}

/* The comma-separated lists of the settings: the next item at *pp (spaces before it skipped),
 * which ends at a comma, a space or the end. */
static void list_item(const char **pp, const char **t, size_t *tl)
{
    const char *p = *pp;
    while (*p == ' ')
        p++;
    *t = p;
    while (*p && *p != ',' && *p != ' ')
        p++;
    *tl = (size_t)(p - *t);
    *pp = p;
}

/* After an item: 1 at the end of the list, 0 past the comma before the next item, -1 (err
 * set) on anything else. */
static int list_next(const char **pp, const char *what, char *err, size_t errlen)
{
    const char *p = *pp;
    while (*p == ' ')
        p++;
    if (!*p)
        return 1;
    if (*p != ',') {
        snprintf(err, errlen, "separate %s with commas", what);
        return -1;
    }
    *pp = p + 1;
    return 0;
}

int gr_parse_heads(const char *s, struct GrHead *out, int cap, int *n, char *err, size_t errlen)
{
    *n = 0;
    const char *p = s;
    for (;;) {
        const char *t;
        size_t tl;
        list_item(&p, &t, &tl);
        const char *colon = memchr(t, ':', tl);
        long l, h;
        if (!colon || parse_int(t, (size_t)(colon - t), 0, 65535, &l) ||
            parse_int(colon + 1, tl - (size_t)(colon - t) - 1, 0, 65535, &h)) {
            snprintf(err, errlen, "\"%.*s\" is not LAYER:HEAD (expected auto or LAYER:HEAD,...)",
                     (int)(tl < 40 ? tl : 40), t);
            return -1;
        }
        if (*n == cap) {
            snprintf(err, errlen, "more than %d heads", cap);
            return -1;
        }
        for (int i = 0; i < *n; i++)
            if (out[i].layer == l && out[i].head == h) {
                snprintf(err, errlen, "%ld:%ld is listed twice", l, h);
                return -1;
            }
        out[(*n)++] = (struct GrHead){ (int)l, (int)h };
        int end = list_next(&p, "LAYER:HEAD pairs", err, errlen);
        if (end)
            return end > 0 ? 0 : -1;
    }
}

int gr_parse_layers(const char *s, int *out, int cap, int *n, char *err, size_t errlen)
{
    *n = 0;
    const char *p = s;
    while (*p == ' ')
        p++;
    if (!*p)
        return 0;
    for (;;) {
        const char *t;
        size_t tl;
        list_item(&p, &t, &tl);
        long l;
        if (parse_int(t, tl, 0, 65535, &l)) {
            snprintf(err, errlen, "\"%.*s\" is not a layer number", (int)(tl < 40 ? tl : 40), t);
            return -1;
        }
        if (*n == cap) {
            snprintf(err, errlen, "more than %d layers", cap);
            return -1;
        }
        for (int i = 0; i < *n; i++)
            if (out[i] == l) {
                snprintf(err, errlen, "layer %ld is listed twice", l);
                return -1;
            }
        out[(*n)++] = (int)l;
        int end = list_next(&p, "layers", err, errlen);
        if (end)
            return end > 0 ? 0 : -1;
    }
}
