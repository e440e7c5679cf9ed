/* Unit tests of the groundedness figures (daemon/grounding.c, docs/groundedness.md): a file's
 * SHA-256 (libcrypto) against the FIPS 180-4 test vectors, the calibration parser's errors,
 * windows, features, the logistic score against a direct evaluation of the formula, lexical support, abstention,
 * the request summary, and the signals on the broker <-> worker wire. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <openssl/sha.h>

#include "daemon/grounding.h"
#include "daemon/wire.h"
#include "tests/check.h"

/* ---- SHA-256 ---- */

/* The digest of data[0..len) through gr_file_sha256 (a temporary file), as hex. */
static void hex_of(const void *data, size_t len, char out[65])
{
    const char *dir = getenv("TMPDIR");
    char path[512], err[256];
    uint8_t d[32];
    snprintf(path, sizeof path, "%s/diffrag-sha-XXXXXX", dir && *dir ? dir : P_tmpdir);
    int fd = mkstemp(path);
    CHECK(fd >= 0 && write(fd, data, len) == (ssize_t)len, "temp file");
    close(fd);
    out[0] = 0;
    CHECK(gr_file_sha256(path, d, err, sizeof err) == 0, "%s", err);
    gr_sha256_hex(d, out);
    unlink(path);
}

static void test_sha256(void)
{
    char h[65];
    hex_of("", 0, h);
    CHECK(!strcmp(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"), "%s", h);
    hex_of("abc", 3, h);
    CHECK(!strcmp(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"), "%s", h);
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    hex_of(two, strlen(two), h);
    CHECK(!strcmp(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"), "%s", h);
    const char *four = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmno"
                       "pqklmnopqrlmnopqrsmnopqrstnopqrstu";
    hex_of(four, strlen(four), h);
    CHECK(!strcmp(h, "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"), "%s", h);
    /* a million 'a' */
    enum { BIG = 3 * (1 << 20) + 7 };    /* past the file reader's 1 MiB pieces */
    char *a = malloc(BIG);
    CHECK(a != NULL, "out of memory");
    if (!a)
        return;
    memset(a, 'a', BIG);
    hex_of(a, 1000000, h);
    CHECK(!strcmp(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"), "%s", h);
    /* a file read in several pieces agrees with libcrypto's one-shot digest of its bytes */
    for (size_t i = 0; i < BIG; i++)
        a[i] = (char)(i * 2654435761u >> 13);
    uint8_t one[32];
    char want[65];
    SHA256((const unsigned char *)a, BIG, one);
    gr_sha256_hex(one, want);
    hex_of(a, BIG, h);
    CHECK(!strcmp(h, want), "pieces %s, whole %s", h, want);
    char err[256];
    uint8_t d[32];
    CHECK(gr_file_sha256("/nonexistent/diffrag-model.gguf", d, err, sizeof err) != 0 &&
          strstr(err, "/nonexistent/diffrag-model.gguf"), "missing: %s", err);
    free(a);
}

/* ---- calibration ---- */

static const char *GOOD =
    "# a calibration\n"
    "diffrag-grounding 1\n"
    "name smollm2-135m-v1\n"
    "model_sha256 B179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53\n"
    "window 8\r\n"
    "stride 4   # half a window\n"
    "threshold 0.5\n"
    "watch 15:0 15:1 22:8\n"
    "features mean_logprob min_logprob mean_entropy mean_margin lookback diff_doc_mass unsupported_ratio\n"
    "mean 0 0 0 0 0 0 0\n"
    "scale 1 1 1 1 1 1 1\n"
    "weights -1.5 0 0 0 2e-1 0 3\n"
    "\n"
    "bias -0.25\n";

/* GOOD with line `line` (1-based) replaced by `repl` (NULL: removed). */
static void with_line(int line, const char *repl, char *out, size_t cap)
{
    const char *s = GOOD;
    size_t n = 0;
    for (int l = 1; *s; l++) {
        const char *nl = strchr(s, '\n');
        size_t len = (size_t)(nl - s) + 1;
        if (l == line) {
            if (repl)
                n += (size_t)snprintf(out + n, cap - n, "%s\n", repl);
        } else {
            memcpy(out + n, s, len);
            n += len;
        }
        s += len;
    }
    out[n] = 0;
}

static void bad_cal(int line, const char *repl, const char *want)
{
    char text[2048], err[512];
    struct GrCalibration c;
    with_line(line, repl, text, sizeof text);
    int rc = gr_calibration_parse(text, strlen(text), "x.grounding", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, want), "line %d \"%s\": want \"%s\", got \"%s\"", line,
          repl ? repl : "(removed)", want, rc ? err : "success");
}

static void test_calibration(void)
{
    struct GrCalibration c;
    char err[512];
    int rc = gr_calibration_parse(GOOD, strlen(GOOD), "x.grounding", &c, err, sizeof err);
    CHECK(rc == 0, "%s", err);
    CHECK(!strcmp(c.name, "smollm2-135m-v1") && c.window == 8 && c.stride == 4 &&
          c.threshold == 0.5 && c.bias == -0.25, "scalars");
    CHECK(c.model_sha256[0] == 0xb1 && c.model_sha256[31] == 0x53, "sha");
    CHECK(c.n_watch == 3 && c.watch[2].layer == 22 && c.watch[2].head == 8, "watch");
    CHECK(c.n_features == 7 && c.feature[4] == GR_LOOKBACK && c.weight[0] == -1.5 &&
          c.weight[4] == 0.2 && c.weight[6] == 3, "features");
    /* keys in another order, a subset of features in another order */
    const char *other = "bias 1\nweights 2 3\nscale 0.5 4\nmean 1 -1\n"
                        "features unsupported_ratio mean_logprob\nwatch 0:0\nthreshold 1\n"
                        "stride 8\nwindow 8\nmodel_sha256 "
                        "0000000000000000000000000000000000000000000000000000000000000000\n"
                        "name a.b_c\ndiffrag-grounding 1";
    rc = gr_calibration_parse(other, strlen(other), "y", &c, err, sizeof err);
    CHECK(rc == 0 && c.n_features == 2 && c.feature[0] == GR_UNSUPPORTED_RATIO &&
          c.feature[1] == GR_MEAN_LOGPROB && c.scale[1] == 4, "reordered: %s", rc ? err : "");

    bad_cal(2, "diffrag-grounding 2", "x.grounding:2: version 2");
    bad_cal(2, NULL, "diffrag-grounding is missing");
    bad_cal(3, "name two words", "x.grounding:3: name takes one value");
    bad_cal(3, "name a/b", "x.grounding:3: name may hold only");
    bad_cal(4, "model_sha256 b179", "x.grounding:4: model_sha256 must be 64 hex digits");
    bad_cal(4, "model_sha256 z179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "x.grounding:4: model_sha256 must be 64 hex digits");
    bad_cal(5, "window 0", "x.grounding:5: window must be an integer from 1");
    bad_cal(5, "window 8.5", "x.grounding:5: window must be an integer");
    bad_cal(6, "stride 9", "x.grounding:6: stride 9 exceeds window 8");
    bad_cal(7, "threshold 1.5", "x.grounding:7: threshold 1.5 is outside [0, 1]");
    bad_cal(7, "threshold nan", "x.grounding:7: threshold: \"nan\" is not a finite number");
    bad_cal(7, "threshold", "x.grounding:7: threshold has no value");
    bad_cal(8, "watch 15:0 15-1", "x.grounding:8: watch: \"15-1\" is not LAYER:HEAD");
    bad_cal(8, "watch 15:0 15:0", "x.grounding:8: watch lists 15:0 twice");
    bad_cal(8, "watch", "x.grounding:8: watch lists no head");
    bad_cal(9, "features mean_logprob bogus", "x.grounding:9: unknown feature \"bogus\"");
    bad_cal(9, "features lookback lookback", "x.grounding:9: feature lookback is named twice");
    bad_cal(10, "mean 0 0 0", "x.grounding:10: mean has 3 numbers; features names 7");
    bad_cal(11, "scale 1 1 1 1 0 1 1", "x.grounding:11: scale of lookback is 0");
    /* a weight over a tiny scale would make a window's logit infinite (NaN with two of them) */
    bad_cal(11, "scale 1 1 1 1 1e-13 1 1",
            "x.grounding:11: scale of lookback is 1e-13; it must be at least 1e-12");
    bad_cal(10, "mean 0 0 0 0 0 0 -2e12",
            "x.grounding:10: mean: \"-2e12\" is not a number from -1e+12 to 1e+12");
    bad_cal(12, "weights 0 0 0 0 1e300 0 0", "x.grounding:12: weights: \"1e300\" is not a number");
    bad_cal(12, "weights 0 0 0 0 inf 0 0", "x.grounding:12: weights: \"inf\" is not a number");
    bad_cal(12, "weights 0 0 0 0 0 0 0 0 0 0 0 0 0", "x.grounding:12: weights has more than 12");
    bad_cal(14, "bias 1x", "x.grounding:14: bias: \"1x\" is not a finite number");
    bad_cal(13, "window 4", "x.grounding:13: window appears twice (first on line 5)");
    bad_cal(13, "colour blue", "x.grounding:13: unknown key \"colour\"");
    bad_cal(14, NULL, "x.grounding: bias is missing");
    char nul[64] = "diffrag-grounding 1\nname a\0b\n";
    rc = gr_calibration_parse(nul, 28, "z", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "z:2: NUL byte"), "%s", err);
    CHECK(gr_calibration_load("/nonexistent/x.grounding", &c, err, sizeof err) != 0 &&
          strstr(err, "/nonexistent/x.grounding"), "%s", err);

    /* the hidden-state probe: three keys together, two or three rows of weights (first, mean,
     * last); the feature needs it */
    char text[4096];
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n",
             GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc == 0 && c.probe_layer == 14 && c.n_probe == 4 && c.probe_w[1] == -1.0f &&
          c.probe_bias == -3, "probe: %s", rc ? err : "");
    float rows[6] = { 2, 1, 4, -8, 100, 7 }; /* first, mean, last of dim 2 */
    double z = gr_probe_logit(&c, rows, 2, 0);
    CHECK(z == -3 + 0.5 * 2 - 1 * 1 + 2 * 4 + 0.25 * -8, "probe logit %g", z);
    CHECK(isnan(gr_probe_logit(&c, rows, 3, 0)), "a probe of another dim");
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 0.5 -1 2 0.25 0.125 -2\n"
             "probe_bias -3\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc == 0 && c.n_probe == 6, "probe of three rows: %s", rc ? err : "");
    z = gr_probe_logit(&c, rows, 2, 0);
    CHECK(z == -3 + 0.5 * 2 - 1 * 1 + 2 * 4 + 0.25 * -8 + 0.125 * 100 - 2 * 7,
          "three-row probe logit %g", z);
    rc = gr_calibration_parse(GOOD, strlen(GOOD), "x.grounding", &c, err, sizeof err);
    CHECK(rc == 0 && c.probe_layer == -1 && isnan(gr_probe_logit(&c, rows, 2, 0)),
          "no probe: %s", rc ? err : "");
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_bias 1\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "come together"), "a probe without weights: %s", err);
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 1 2 3 4 5\nprobe_bias 1\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "p:16: probe_weights has 5 numbers"), "odd weights: %s", err);
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 1 nan\nprobe_bias 1\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "\"nan\" is not a finite number"), "NaN weight: %s", err);
    bad_cal(9, "features mean_logprob min_logprob mean_entropy mean_margin lookback "
            "diff_doc_mass hidden_probe", "x.grounding:9: feature hidden_probe needs probe_layer");

    /* the long probe: three keys together, needs the probe and as many weights; from its token
     * count on it takes the probe's place */
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n"
             "long_probe_from 4000\nlong_probe_weights 1 1 -1 0.5\nlong_probe_bias 2\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc == 0 && c.long_probe_from == 4000 && c.n_long_probe == 4 &&
          c.long_probe_w[2] == -1.0f && c.long_probe_bias == 2, "long probe: %s", rc ? err : "");
    double zs = gr_probe_logit(&c, rows, 2, 3999), zl = gr_probe_logit(&c, rows, 2, 4000);
    CHECK(zs == -3 + 0.5 * 2 - 1 * 1 + 2 * 4 + 0.25 * -8, "below its length, the probe: %g", zs);
    CHECK(zl == 2 + 1 * 2 + 1 * 1 - 1 * 4 + 0.5 * -8, "from its length, the long probe: %g", zl);
    CHECK(gr_probe_logit(&c, rows, 2, 100000) == zl && isnan(gr_probe_logit(&c, rows, 3, 5000)),
          "the long probe beyond its length; of another dim");
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n"
             "long_probe_from 4000\nlong_probe_bias 2\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "long_probe_from, long_probe_weights and long_probe_bias come "
          "together"), "a long probe without weights: %s", err);
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n"
             "long_probe_from 4000\nlong_probe_weights 1 1 -1 0.5 1 1\nlong_probe_bias 2\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "p:19: long_probe_weights has 6 numbers; probe_weights has 4"),
          "long probe of other rows: %s", err);
    snprintf(text, sizeof text, "%slong_probe_from 4000\nlong_probe_weights 1 1 -1 0.5\n"
             "long_probe_bias 2\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "p:15: long_probe_from needs the probe"), "no probe: %s", err);
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n"
             "long_probe_from 0\nlong_probe_weights 1 1 -1 0.5\nlong_probe_bias 2\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "p:18: long_probe_from must be a token count"), "from 0: %s",
          err);

    /* the short probe: likewise, under its token count; not above the long probe's */
    snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n"
             "long_probe_from 4000\nlong_probe_weights 1 1 -1 0.5\nlong_probe_bias 2\n"
             "short_probe_until 500\nshort_probe_weights -1 0 0 1\nshort_probe_bias 0.5\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc == 0 && c.short_probe_until == 500 && c.n_short_probe == 4 &&
          c.short_probe_w[3] == 1.0f && c.short_probe_bias == 0.5, "short probe: %s",
          rc ? err : "");
    double zb = gr_probe_logit(&c, rows, 2, 499), zm = gr_probe_logit(&c, rows, 2, 500);
    CHECK(zb == 0.5 - 1 * 2 + 1 * -8 && gr_probe_logit(&c, rows, 2, 0) == zb,
          "under its length, the short probe: %g", zb);
    CHECK(zm == zs && gr_probe_logit(&c, rows, 2, 3999) == zs &&
          gr_probe_logit(&c, rows, 2, 4000) == zl, "from it, the probe, then the long one");
    static const struct { const char *keys, *msg; } bad_short[] = {
        { "short_probe_until 500\nshort_probe_bias 2\n",
          "short_probe_until, short_probe_weights and short_probe_bias come together" },
        { "short_probe_until 500\nshort_probe_weights 1 2\nshort_probe_bias 2\n",
          "p:19: short_probe_weights has 2 numbers; probe_weights has 4" },
        { "short_probe_until 0\nshort_probe_weights 1 2 3 4\nshort_probe_bias 2\n",
          "p:18: short_probe_until must be a token count" },
        { "long_probe_from 400\nlong_probe_weights 1 1 -1 0.5\nlong_probe_bias 2\n"
          "short_probe_until 500\nshort_probe_weights 1 2 3 4\nshort_probe_bias 2\n",
          "p:21: short_probe_until 500 is above long_probe_from 400" },
    };
    for (size_t i = 0; i < sizeof bad_short / sizeof *bad_short; i++) {
        snprintf(text, sizeof text, "%sprobe_layer 14\nprobe_weights 0.5 -1 2 0.25\n"
                 "probe_bias -3\n%s", GOOD, bad_short[i].keys);
        rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
        CHECK(rc != 0 && strstr(err, bad_short[i].msg), "bad short probe %zu: %s", i, err);
    }
    snprintf(text, sizeof text, "%sshort_probe_until 500\nshort_probe_weights 1 2 3 4\n"
             "short_probe_bias 2\n", GOOD);
    rc = gr_calibration_parse(text, strlen(text), "p", &c, err, sizeof err);
    CHECK(rc != 0 && strstr(err, "p:15: short_probe_until needs the probe"), "no probe: %s", err);

    /* the length offset: two keys together, knots strictly ascending, one offset per knot;
     * linear in ln(1 + tokens) between knots, the end knots' offsets beyond them */
    snprintf(text, sizeof text, "%slength_tokens 200 1700 15000\nlength_offset 0.5 -1.5 -1\n",
             GOOD);
    rc = gr_calibration_parse(text, strlen(text), "l", &c, err, sizeof err);
    CHECK(rc == 0 && c.n_knots == 3 && c.knot_tokens[1] == 1700 && c.knot_offset[2] == -1,
          "length offset: %s", rc ? err : "");
    CHECK(gr_length_offset(&c, log1p(0)) == 0.5 && gr_length_offset(&c, log1p(200)) == 0.5 &&
          gr_length_offset(&c, log1p(1700)) == -1.5 && gr_length_offset(&c, log1p(1e6)) == -1,
          "offsets at and beyond the knots");
    double mid = (log1p(1700) + log1p(15000)) / 2;
    CHECK(fabs(gr_length_offset(&c, mid) - -1.25) < 1e-12, "halfway in log tokens: %g",
          gr_length_offset(&c, mid));
    {
        double f[GR_N_FEATURES] = { 0 };
        for (int j = 0; j < c.n_features; j++)
            f[c.feature[j]] = c.mean[j];   /* every feature at its mean: bias + offset */
        f[GR_LOG_CONTEXT] = log1p(1700);
        CHECK(fabs(gr_window_score(&c, f) - 1 / (1 + exp(-(c.bias - 1.5)))) < 1e-12,
              "the offset enters the window score");
    }
    rc = gr_calibration_parse(GOOD, strlen(GOOD), "x.grounding", &c, err, sizeof err);
    CHECK(rc == 0 && c.n_knots == 0 && gr_length_offset(&c, 9.0) == 0, "no length offset");
    static const struct { const char *lines, *want; } bad_len[] = {
        { "length_tokens 200 1700\n", "length_tokens and length_offset come together" },
        { "length_tokens 200 1700\nlength_offset 1\n", "l:16: length_offset has 1 numbers; "
          "length_tokens has 2" },
        { "length_tokens 1700 200\nlength_offset 1 2\n", "l:15: length_tokens must be strictly "
          "ascending" },
        { "length_tokens 200 200\nlength_offset 1 2\n", "strictly ascending" },
        { "length_tokens -5\nlength_offset 1\n", "\"-5\" is not a token count" },
        { "length_tokens 5\nlength_offset nan\n", "length_offset: \"nan\" is not a number" },
        { "length_tokens 5\nlength_offset 1e9\n", "length_offset: \"1e9\" is not a number" },
        { "length_tokens\nlength_offset\n", "length_tokens has no value" },
        { "length_tokens 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17\nlength_offset 0\n",
          "length_tokens has more than 16 numbers" },
    };
    for (size_t i = 0; i < sizeof bad_len / sizeof bad_len[0]; i++) {
        snprintf(text, sizeof text, "%s%s", GOOD, bad_len[i].lines);
        rc = gr_calibration_parse(text, strlen(text), "l", &c, err, sizeof err);
        CHECK(rc != 0 && strstr(err, bad_len[i].want), "bad length offset %zu: want \"%s\", "
              "got \"%s\"", i, bad_len[i].want, rc ? err : "success");
    }

    int ls[8];
    int nl;
    CHECK(gr_parse_layers(" 4, 14,24", ls, 8, &nl, err, sizeof err) == 0 && nl == 3 && ls[1] == 14,
          "layers: %s", err);
    CHECK(gr_parse_layers("", ls, 8, &nl, err, sizeof err) == 0 && nl == 0, "no layers");
    CHECK(gr_parse_layers("4,4", ls, 8, &nl, err, sizeof err) != 0 && strstr(err, "twice"), "%s", err);
    CHECK(gr_parse_layers("4,x", ls, 8, &nl, err, sizeof err) != 0 &&
          strstr(err, "\"x\" is not a layer number"), "%s", err);
    CHECK(gr_parse_layers("1,2,3", ls, 2, &nl, err, sizeof err) != 0 && strstr(err, "more than 2"),
          "%s", err);
    CHECK(gr_parse_layers("1,", ls, 8, &nl, err, sizeof err) != 0, "trailing comma");

    struct GrHead h[4];
    int n;
    CHECK(gr_parse_heads("15:0, 15:1,22:8", h, 4, &n, err, sizeof err) == 0 && n == 3 &&
          h[1].layer == 15 && h[1].head == 1, "heads: %s", err);
    CHECK(gr_parse_heads("15:0,15:0", h, 4, &n, err, sizeof err) != 0 && strstr(err, "twice"), "%s", err);
    CHECK(gr_parse_heads("15", h, 4, &n, err, sizeof err) != 0, "no colon");
    CHECK(gr_parse_heads("1:1,", h, 4, &n, err, sizeof err) != 0, "trailing comma");
    CHECK(gr_parse_heads("1:1 2:2", h, 4, &n, err, sizeof err) != 0 &&
          strstr(err, "separate LAYER:HEAD pairs with commas"), "%s", err);
    CHECK(gr_parse_layers("1 2", ls, 8, &nl, err, sizeof err) != 0 &&
          strstr(err, "separate layers with commas"), "%s", err);
    CHECK(gr_parse_heads("1:1,2:2,3:3,4:4,5:5", h, 4, &n, err, sizeof err) != 0 &&
          strstr(err, "more than 4"), "%s", err);
}

/* ---- windows, features, score ---- */

static void test_windows(void)
{
    struct GrWindow w[64];
    CHECK(gr_windows(0, 8, 4, w, 64) == 0, "empty answer: no window");
    CHECK(gr_windows(5, 8, 4, w, 64) == 1 && w[0].start == 0 && w[0].end == 5, "short");
    CHECK(gr_windows(8, 8, 4, w, 64) == 1 && w[0].end == 8, "exactly one window");
    CHECK(gr_windows(10, 8, 4, w, 64) == 2 && w[1].start == 2 && w[1].end == 10, "10");
    CHECK(gr_windows(16, 8, 4, w, 64) == 3 && w[1].start == 4 && w[2].start == 8, "16");
    CHECK(gr_windows(17, 8, 4, w, 64) == 4 && w[2].start == 8 && w[3].start == 9 &&
          w[3].end == 17, "17");
    CHECK(gr_windows(16, 8, 8, w, 64) == 2 && w[1].start == 8, "stride = window");
    CHECK(gr_windows(17, 8, 4, w, 2) == 4, "total beyond cap");
    /* for many shapes: starts increase, ends never decrease, every token is covered, each
     * window has min(n, window) tokens, the last ends at n */
    for (int win = 1; win <= 9; win++)
        for (int st = 1; st <= win; st++)
            for (size_t n = 1; n <= 40; n++) {
                size_t k = gr_windows(n, win, st, w, 64), covered = 0;
                int ok = k >= 1 && k <= 64 && w[0].start == 0 && w[k - 1].end == n;
                for (size_t i = 0; ok && i < k; i++) {
                    ok = w[i].end - w[i].start == (n < (size_t)win ? n : (size_t)win) &&
                         w[i].start <= covered && (i == 0 || (w[i].start > w[i - 1].start &&
                                                              w[i].end >= w[i - 1].end));
                    if (w[i].end > covered)
                        covered = w[i].end;
                }
                CHECK(ok && covered == n, "window %d stride %d n %zu", win, st, n);
            }
}

#define NTOK 12
static float lp[NTOK] = { -0.1f, -2.0f, -0.5f, -0.3f, -4.0f, -0.2f, -0.1f, -0.6f, -1.0f, -0.05f, -3.0f, -0.4f };
static float en[NTOK] = { 1, 2, 0.5f, 0.2f, 3, 0.1f, 0.3f, 1.5f, 2.5f, 0.2f, 2.8f, 0.9f };
static float mg[NTOK] = { .9f, .1f, .5f, .7f, .05f, .8f, .95f, .3f, .2f, .99f, .02f, .6f };
static float dm[NTOK] = { .2f, .1f, .3f, 0, 0, .25f, .4f, .1f, .05f, .3f, .02f, .2f };
static float gm[NTOK] = { 0, .1f, .2f, 0, 0, .3f, .1f, .2f, .4f, .1f, .5f, .2f };
static float dd[NTOK] = { .2f, -.1f, .3f, 0, 0, .25f, .4f, .1f, .05f, .3f, .02f, .2f };
static float lb[NTOK] = { 1, .5f, .6f, 0, 0, .45f, .8f, .33f, .11f, .75f, .04f, .5f };
static uint8_t un[NTOK] = { 0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 1, 0 };
static uint32_t te[NTOK] = { 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24 };

static struct GrSignals sigs(size_t n)
{
    return (struct GrSignals){ .n = n, .logprob = lp, .entropy = en, .margin = mg, .doc_mass = dm,
                               .gen_mass = gm, .diff_doc_mass = dd, .lookback = lb,
                               .text_end = te, .unsupported = un };
}

static void test_features_and_score(void)
{
    struct GrSignals s = sigs(NTOK);
    double f[GR_N_FEATURES];
    gr_window_features(&s, 1, 5, f);   /* tokens 1..4 */
    CHECK(fabs(f[GR_MEAN_LOGPROB] - (-2.0 - 0.5 - 0.3 - 4.0) / 4) < 1e-6, "mean lp %g", f[0]);
    CHECK(fabs(f[GR_MIN_LOGPROB] + 4.0) < 1e-6, "min lp");
    CHECK(fabs(f[GR_MEAN_ENTROPY] - (2 + 0.5 + 0.2 + 3) / 4.0) < 1e-6, "entropy");
    CHECK(fabs(f[GR_MEAN_MARGIN] - (.1 + .5 + .7 + .05) / 4) < 1e-6, "margin");
    CHECK(fabs(f[GR_LOOKBACK] - (.1 + .3) / (.1 + .3 + .1 + .2)) < 1e-6, "lookback %g", f[4]);
    CHECK(fabs(f[GR_DIFF_DOC_MASS] - (-.1 + .3) / 4) < 1e-6, "diff");
    CHECK(fabs(f[GR_UNSUPPORTED_RATIO] - 0.5) < 1e-12, "unsupported");
    CHECK(isnan(f[GR_QUOTE_REMOVED]), "a free-text answer has no removed mass");
    CHECK(f[GR_LOG_CONTEXT] == 0, "no documents: ln(1 + 0)");
    {
        /* a quoted answer: the window mean of the removed mass; the documents' length */
        float qr[NTOK];
        for (int i = 0; i < NTOK; i++)
            qr[i] = 0.1f * (float)i;
        struct GrSignals sq = s;
        sq.quote_removed = qr;
        sq.context_tokens = 16383;
        gr_window_features(&sq, 1, 5, f);
        CHECK(fabs(f[GR_QUOTE_REMOVED] - 0.25) < 1e-6, "removed mass %g", f[GR_QUOTE_REMOVED]);
        CHECK(fabs(f[GR_LOG_CONTEXT] - log(16384.0)) < 1e-12, "log context %g", f[GR_LOG_CONTEXT]);
        struct GrSummary sum;
        gr_summarize(NULL, 0.5, &sq, "x", 1, NULL, &sum);
        double mean = 0;
        for (int i = 0; i < NTOK; i++)
            mean += qr[i];
        CHECK(sum.has_quote && fabs(sum.quote_removed - mean / NTOK) < 1e-6, "summary %g",
              sum.quote_removed);
    }
    gr_window_features(&s, 3, 5, f);   /* no mass at all */
    CHECK(f[GR_LOOKBACK] == 0, "lookback of no mass is 0");
    /* the self-check: missing (NaN) unless it ran; its log-odds clipped to +-20 */
    CHECK(isnan(f[GR_SELF_CHECK]), "no self-check: NaN");
    {
        struct GrSignals sc = s;
        sc.has_check = 1;
        sc.check = -1.25;
        gr_window_features(&sc, 0, 4, f);
        CHECK(f[GR_SELF_CHECK] == -1.25, "self-check %g", f[GR_SELF_CHECK]);
        sc.check = 300;
        gr_window_features(&sc, 0, 4, f);
        CHECK(f[GR_SELF_CHECK] == GR_CHECK_CLIP, "self-check clipped %g", f[GR_SELF_CHECK]);
        /* a calibration that weighs it: missing adds nothing, present moves the score */
        struct GrCalibration k;
        memset(&k, 0, sizeof k);
        k.n_features = 1;
        k.feature[0] = GR_SELF_CHECK;
        k.mean[0] = 0.5; k.scale[0] = 2; k.weight[0] = -1; k.bias = 0.25;
        sc.check = -3.5;
        gr_window_features(&sc, 0, 4, f);
        double z = 0.25 - 1 * (-3.5 - 0.5) / 2;
        CHECK(fabs(gr_window_score(&k, f) - 1 / (1 + exp(-z))) < 1e-12, "self-check score");
        sc.has_check = 0;
        gr_window_features(&sc, 0, 4, f);
        CHECK(fabs(gr_window_score(&k, f) - 1 / (1 + exp(-0.25))) < 1e-12, "missing: bias only");
        struct GrSummary gs;
        sc.has_check = 1;
        sc.check = 0;
        gr_summarize(NULL, 0.5, &sc, "abcdefgh", 8, NULL, &gs);
        CHECK(gs.has_check && fabs(gs.self_check - 0.5) < 1e-12, "P(yes) of log-odds 0");
        /* the probe's logit: a feature when present; a calibration that weighs it does not
         * score an answer without it */
        k.feature[0] = GR_PROBE;
        k.window = 4;
        k.stride = 2;
        sc.has_probe = 1;
        sc.probe = -3.5;
        gr_window_features(&sc, 0, 4, f);
        CHECK(f[GR_PROBE] == -3.5 && fabs(gr_window_score(&k, f) - 1 / (1 + exp(-z))) < 1e-12,
              "probe score");
        gr_summarize(&k, 0.5, &sc, "abcdefgh", 8, NULL, &gs);
        CHECK(gs.scored && gs.has_probe && fabs(gs.hidden_probe - 1 / (1 + exp(3.5))) < 1e-12,
              "scored with the probe");
        sc.has_probe = 0;
        gr_window_features(&sc, 0, 4, f);
        CHECK(isnan(f[GR_PROBE]), "no probe: NaN");
        gr_summarize(&k, 0.5, &sc, "abcdefgh", 8, NULL, &gs);
        CHECK(!gs.scored && !gs.flagged && !gs.has_probe, "not scored without the probe");
    }
    gr_window_features(&s, 3, 5, f);

    struct GrCalibration c;
    memset(&c, 0, sizeof c);
    snprintf(c.name, sizeof c.name, "t");
    c.window = 4;
    c.stride = 2;
    c.threshold = 0.6;
    c.n_features = 3;
    c.feature[0] = GR_UNSUPPORTED_RATIO;
    c.feature[1] = GR_MEAN_LOGPROB;
    c.feature[2] = GR_LOOKBACK;
    c.mean[0] = 0.2; c.scale[0] = 0.5; c.weight[0] = 2.0;
    c.mean[1] = -0.5; c.scale[1] = 1.0; c.weight[1] = -1.0;
    c.mean[2] = 0.5; c.scale[2] = 0.25; c.weight[2] = -0.5;
    c.bias = -0.3;
    /* windows of 12 tokens: [0,4) [2,6) [4,8) [6,10) [8,12); score each directly */
    double want[5], best = 0;
    size_t starts[5] = { 0, 2, 4, 6, 8 };
    for (int k = 0; k < 5; k++) {
        double u = 0, l = 0, d = 0, g = 0;
        for (size_t i = starts[k]; i < starts[k] + 4; i++) {
            u += un[i];
            l += lp[i];
            d += dm[i];
            g += gm[i];
        }
        double z = -0.3 + 2.0 * (u / 4 - 0.2) / 0.5 - 1.0 * (l / 4 + 0.5) / 1.0 -
                   0.5 * ((d + g > 0 ? d / (d + g) : 0) - 0.5) / 0.25;
        want[k] = 1 / (1 + exp(-z));
        gr_window_features(&s, starts[k], starts[k] + 4, f);
        double got = gr_window_score(&c, f);
        CHECK(fabs(got - want[k]) < 1e-12, "window %d: %.15g vs %.15g", k, got, want[k]);
        if (want[k] > best)
            best = want[k];
    }
    double ts[NTOK];
    struct GrSummary sum;
    const char *answer = "abcdefghijklmnopqrstuvwx";
    gr_summarize(&c, c.threshold, &s, answer, 24, ts, &sum);
    CHECK(sum.scored && fabs(sum.score - best) < 1e-12, "score %g vs %g", sum.score, best);
    for (size_t i = 0; i < NTOK; i++) {
        double m = 0;
        for (int k = 0; k < 5; k++)
            if (i >= starts[k] && i < starts[k] + 4 && want[k] > m)
                m = want[k];
        CHECK(fabs(ts[i] - m) < 1e-12, "token %zu score %g vs %g", i, ts[i], m);
    }
    size_t flagged = 0;
    for (size_t i = 0; i < NTOK; i++) {
        int in = 0;
        for (int k = 0; k < 5; k++)
            in |= i >= starts[k] && i < starts[k] + 4 && want[k] >= c.threshold;
        flagged += (size_t)in;
    }
    CHECK(sum.flagged == (best >= c.threshold), "flagged");
    CHECK(sum.flagged && flagged > 0 && flagged < NTOK, "the example flags part of the answer "
          "(%zu tokens)", flagged);
    CHECK(sum.flagged_tokens == flagged, "flagged tokens %zu vs %zu", sum.flagged_tokens, flagged);
    CHECK(sum.answer_tokens == NTOK && sum.has_ratios, "counts");
    double d = 0, g = 0, l = 0, mn = 0;
    for (size_t i = 0; i < NTOK; i++) {
        d += dm[i];
        g += gm[i];
        l += lp[i];
        mn = lp[i] < mn ? lp[i] : mn;
    }
    CHECK(fabs(sum.lookback_ratio - (d / NTOK) / (d / NTOK + g / NTOK)) < 1e-9, "lookback ratio");
    CHECK(fabs(sum.mean_logprob - l / NTOK) < 1e-9 && sum.min_logprob == mn, "logprobs");
    CHECK(fabs(sum.unsupported_token_ratio - 4.0 / NTOK) < 1e-12, "unsupported ratio");
    /* a higher threshold than any window: scored, not flagged, no flagged tokens */
    gr_summarize(&c, 0.9999, &s, answer, 24, NULL, &sum);
    CHECK(sum.scored && !sum.flagged && sum.flagged_tokens == 0, "threshold");
    /* an abstained answer is never flagged */
    const char *refusal = "  i CANNOT find the answer in the provided documents   ";
    uint32_t te2[NTOK];
    for (size_t i = 0; i < NTOK; i++)
        te2[i] = (uint32_t)(i + 1 == NTOK ? strlen(refusal) : i);
    s.text_end = te2;
    gr_summarize(&c, c.threshold, &s, refusal, strlen(refusal), NULL, &sum);
    CHECK(sum.abstained && sum.scored && !sum.flagged && sum.flagged_tokens == 0, "abstained");
    s.text_end = te;
    /* no calibration: signals only */
    gr_summarize(NULL, 0.5, &s, answer, 24, NULL, &sum);
    CHECK(!sum.scored && !sum.flagged && sum.flagged_tokens == 0 && sum.has_ratios, "no detector");
    /* no answer token: nothing to score, no ratio */
    struct GrSignals none = sigs(0);
    gr_summarize(&c, 0.5, &none, "", 0, NULL, &sum);
    CHECK(!sum.scored && !sum.has_ratios && sum.answer_tokens == 0, "empty answer");
}

static void test_abstained(void)
{
    CHECK(gr_abstained("I cannot find the answer in the provided documents.", 51), "exact");
    CHECK(gr_abstained("\n I cannot find the answer in the provided documents", 52), "no period");
    CHECK(gr_abstained("I CANNOT FIND THE ANSWER IN THE PROVIDED DOCUMENTS!", 51), "case");
    CHECK(!gr_abstained("I cannot find the answer", 24), "prefix of the phrase");
    CHECK(!gr_abstained("The answer: I cannot find the answer in the provided documents.", 63),
          "not at the start");
    CHECK(!gr_abstained("", 0), "empty");
}

/* ---- words and lexical support ---- */

struct Collected { char words[16][WORDS_MAX_BYTES + 1]; size_t start[16], end[16]; int cap[16], dig[16], n; };

static int collect(void *ctx, const struct Word *w)
{
    struct Collected *c = ctx;
    if (c->n < 16) {
        memcpy(c->words[c->n], w->lower, w->lower_len);
        c->words[c->n][w->lower_len] = 0;
        c->start[c->n] = w->start;
        c->end[c->n] = w->end;
        c->cap[c->n] = w->capital;
        c->dig[c->n] = w->digit;
    }
    c->n++;
    return 0;
}

static void test_words(void)
{
    struct Collected c = { .n = 0 };
    const char *t = "Don't call Norman's ÉCOLE x2-b; 東京 café’s";
    words_split(t, strlen(t), collect, &c);
    CHECK(c.n == 9, "%d words", c.n);
    CHECK(!strcmp(c.words[0], "dont") && c.cap[0] && c.start[0] == 0 && c.end[0] == 5, "%s", c.words[0]);
    CHECK(!strcmp(c.words[2], "norman") && c.cap[2] && c.end[2] == 19, "%s %zu", c.words[2], c.end[2]);
    CHECK(!strcmp(c.words[3], "école") && c.cap[3], "%s", c.words[3]);
    CHECK(!strcmp(c.words[4], "x2") && c.dig[4] && !c.cap[4], "%s", c.words[4]);
    CHECK(!strcmp(c.words[6], "東") && !strcmp(c.words[7], "京"), "ideographs");
    CHECK(!strcmp(c.words[8], "café") && c.end[8] == strlen(t), "%s", c.words[8]);
    /* a long word is cut at a character boundary */
    char longw[300];
    for (int i = 0; i < 100; i++)
        memcpy(longw + 2 * i, "é", 2);
    c.n = 0;
    words_split(longw, 200, collect, &c);
    CHECK(c.n == 1 && strlen(c.words[0]) == 64 && c.end[0] == 200, "long word %zu", strlen(c.words[0]));
    struct Word w = { .lower = "the", .lower_len = 3 };
    CHECK(!gr_is_content(&w), "stop word");
    w.capital = 1;
    CHECK(gr_is_content(&w), "capitalised");
    w = (struct Word){ .lower = "river", .lower_len = 5 };
    CHECK(gr_is_content(&w), "content");
}

static void test_lexical(void)
{
    struct WordSet *ws = NULL;
    CHECK(words_set_new(&ws) == 0, "new");
    const char *doc = "The Rhine flows 1,230 km from the Swiss Alps to the North Sea. France's rivers";
    CHECK(words_set_add_text(ws, doc, strlen(doc)) == 0, "add");
    CHECK(words_set_has(ws, "rhine", 5) && words_set_has(ws, "230", 3) &&
          words_set_has(ws, "france", 6) && !words_set_has(ws, "Rhine", 5), "lookups");
    /* many words: the set grows and keeps them all */
    char buf[32];
    for (int i = 0; i < 5000; i++) {
        int n = snprintf(buf, sizeof buf, "w%d", i);
        words_set_add_text(ws, buf, (size_t)n);
    }
    int all = 1;
    for (int i = 0; i < 5000; i++) {
        int n = snprintf(buf, sizeof buf, "w%d", i);
        all &= words_set_has(ws, buf, (size_t)n);
    }
    CHECK(all && !words_set_has(ws, "w5000", 5), "grown set");
    /* tokens: "It" " flows" " 1" ",2" "40" " km" " to" " Paris" "." ; 240 and Paris are not in
     * the documents, "It" is capitalised and absent; "to" is a stop word */
    const char *ans = "It flows 1,240 km to Paris.";
    uint32_t end[9] = { 2, 8, 10, 12, 14, 17, 20, 26, 27 };
    uint8_t u[9];
    gr_lexical(ws, ans, strlen(ans), end, 9, u);
    uint8_t want[9] = { 1, 0, 0, 1, 1, 0, 0, 1, 0 };
    CHECK(!memcmp(u, want, 9), "%d%d%d%d%d%d%d%d%d", u[0], u[1], u[2], u[3], u[4], u[5], u[6],
          u[7], u[8]);
    /* an empty token (text held back) overlaps nothing */
    uint32_t end2[3] = { 0, 2, 27 };
    gr_lexical(ws, ans, strlen(ans), end2, 3, u);
    CHECK(u[0] == 0 && u[1] == 1 && u[2] == 1, "empty token");
    /* citation markers are not claims: "[1]" and "[2, 3]" need no support, "[x7]" and a
     * bare 7 do */
    const char *cited = "Paris [1] is [2, 3] 7 [x7]";
    uint32_t end3[9] = { 5, 7, 8, 9, 12, 19, 21, 23, 26 };
    gr_lexical(ws, cited, strlen(cited), end3, 9, u);
    uint8_t want3[9] = { 1, 0, 0, 0, 0, 0, 1, 0, 1 };
    CHECK(!memcmp(u, want3, 9), "citations %d%d%d%d%d%d%d%d%d", u[0], u[1], u[2], u[3], u[4],
          u[5], u[6], u[7], u[8]);
    /* no documents: every content word is unsupported */
    gr_lexical(NULL, ans, strlen(ans), end, 9, u);
    CHECK(u[1] == 1 && u[6] == 0 && u[8] == 0, "no documents");
    words_set_destroy(&ws);
    CHECK(ws == NULL, "destroy");
}

/* ---- the wire ---- */

static void test_wire_signals(void)
{
    struct MpWriter w;
    char err[256];
    mpw_init(&w);
    int32_t toks[6] = { 1, 2, 3, 4, 5, 6 };
    uint32_t spans[4] = { 1, 3, 4, 6 };
    int32_t watch[4] = { 15, 0, 22, 8 };
    struct WireGround g = { .doc_spans = spans, .n_spans = 2, .watch = watch, .n_watch = 2 };
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    struct WireJob j = { .job = 1 };
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) == 0, "%s", err);
    CHECK(j.n_spans == 2 && j.doc_spans[2] == 4 && j.doc_spans[3] == 6, "spans");
    CHECK(j.watch_given && j.n_watch == 2 && j.watch[2] == 22 && j.watch[3] == 8, "watch");
    wire_job_free(&j);
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, NULL);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) == 0 && !j.watch_given &&
          j.n_spans == 0, "no grounding: %s", err);
    wire_job_free(&j);
    uint32_t past[2] = { 2, 7 };   /* past the prompt */
    g = (struct WireGround){ .doc_spans = past, .n_spans = 1 };
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0 &&
          strstr(err, "span"), "span past the prompt: %s", err);
    /* the documents' range (chunk KV reuse) crosses; spans outside it, or out of order, and a
     * range past the prompt are refused */
    g = (struct WireGround){ .doc_spans = spans, .n_spans = 2, .docs = { 1, 6 } };
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) == 0 && j.docs[0] == 1 &&
          j.docs[1] == 6, "documents range: %s", err);
    wire_job_free(&j);
    uint32_t docs_bad[][2] = { { 2, 6 }, { 1, 5 }, { 0, 7 } };
    for (int i = 0; i < 3; i++) {
        g = (struct WireGround){ .doc_spans = spans, .n_spans = 2,
                                 .docs = { docs_bad[i][0], docs_bad[i][1] } };
        mpw_reset(&w);
        wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
        CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0,
              "documents %u..%u refused", docs_bad[i][0], docs_bad[i][1]);
    }
    uint32_t swapped[4] = { 4, 6, 1, 3 };
    g = (struct WireGround){ .doc_spans = swapped, .n_spans = 2, .docs = { 1, 6 } };
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0 &&
          strstr(err, "order"), "spans out of order: %s", err);

    /* the spans' leads (what each chunk's KV copy is made after) cross; leads outside their
     * tokens, more lead tokens than the prompt has, a negative one, leads without their
     * ranges or with another count than the spans are refused */
    int32_t lead_tok[3] = { 7, 8, 9 };
    uint32_t lead_rng[4] = { 0, 2, 2, 3 };
    g = (struct WireGround){ .doc_spans = spans, .n_spans = 2, .docs = { 1, 6 },
                             .lead_tokens = lead_tok, .n_lead_tokens = 3, .doc_leads = lead_rng };
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) == 0 &&
          j.n_lead_tokens == 3 && j.lead_tokens[2] == 9 && j.doc_leads[1] == 2 &&
          j.doc_leads[3] == 3, "leads: %s", err);
    wire_job_free(&j);
    uint32_t lead_past[4] = { 0, 2, 2, 4 };
    g.doc_leads = lead_past;
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0 &&
          strstr(err, "lead"), "a lead past its tokens: %s", err);
    int32_t lead_many[7] = { 1, 2, 3, 4, 5, 6, 7 }, lead_neg[3] = { 7, -1, 9 };
    g.doc_leads = lead_rng;
    g.lead_tokens = lead_many;
    g.n_lead_tokens = 7;
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0 &&
          strstr(err, "lead"), "7 lead tokens for 6 prompt tokens: %s", err);
    g.lead_tokens = lead_neg;
    g.n_lead_tokens = 3;
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0 &&
          strstr(err, "negative lead"), "a negative lead token: %s", err);
    /* the spans' retrieval ranks cross; a count other than the spans' is refused */
    uint32_t ranks[2] = { 1, 0 };
    g = (struct WireGround){ .doc_spans = spans, .n_spans = 2, .docs = { 1, 6 },
                             .doc_ranks = ranks };
    mpw_reset(&w);
    wire_job_encode(&w, toks, 6, 8, 0, 1, 0, NULL, NULL, 0, 0, &g);
    CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) == 0 && j.doc_ranks &&
          j.doc_ranks[0] == 1 && j.doc_ranks[1] == 0, "ranks: %s", err);
    wire_job_free(&j);
    for (int variant = 0; variant < 3; variant++) {
        /* by hand: lead tokens alone, ranges for one span of two, one rank for two spans */
        static const uint8_t tok_le[24] = { 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0,
                                            4, 0, 0, 0, 5, 0, 0, 0, 6, 0, 0, 0 };
        static const uint8_t span_le[16] = { 1, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, 6, 0, 0, 0 };
        static const uint8_t lead_le[8] = { 0, 0, 0, 0, 1, 0, 0, 0 };
        static const char *const what[3] = { "lead tokens without ranges",
                                             "one lead for two spans", "one rank for two spans" };
        mpw_reset(&w);
        mpw_map(&w, variant == 1 ? 5 : 4);
        mpw_cstr(&w, "tokens");
        mpw_bin(&w, tok_le, sizeof tok_le);
        mpw_kv_int(&w, "max_tokens", 8);
        mpw_cstr(&w, "doc_spans");
        mpw_bin(&w, span_le, sizeof span_le);
        mpw_cstr(&w, variant == 2 ? "doc_ranks" : "lead_tokens");
        mpw_bin(&w, lead_le, 4);
        if (variant == 1) {
            mpw_cstr(&w, "doc_leads");
            mpw_bin(&w, lead_le, sizeof lead_le);
        }
        CHECK(wire_job_decode(w.buf.data, w.buf.size, &j, err, sizeof err) != 0 &&
              strstr(err, variant == 2 ? "ranks" : "lead"), "%s: %s", what[variant], err);
    }

    /* "añb.": tokens "a", "ñ", "b." */
    float vals[WS_N_FLOAT][3];
    for (int k = 0; k < WS_N_FLOAT; k++)
        for (int i = 0; i < 3; i++)
            vals[k][i] = (float)(k + 1) * 0.1f * (float)(i + 1) - 0.25f;
    uint32_t tend[3] = { 1, 3, 5 };
    struct WireResult r = { .job = 3, .finish = WF_STOP, .text = "a\xc3\xb1" "b.", .text_len = 5,
                            .completion_tokens = 4, .has_signals = 1 };
    r.sig.n = 3;
    for (int k = 0; k < WS_N_FLOAT; k++)
        r.sig.f[k] = vals[k];
    r.sig.text_end = tend;
    mpw_reset(&w);
    wire_result_encode(&w, &r);
    struct WireResult back = { .job = 3 };
    CHECK(wire_result_decode(w.buf.data, w.buf.size, &back, err, sizeof err) == 0, "%s", err);
    int same = back.has_signals && back.sig.n == 3 && !memcmp(back.sig.text_end, tend, sizeof tend);
    for (int k = 0; same && k < WS_N_FLOAT; k++)
        same = !memcmp(back.sig.f[k], vals[k], sizeof vals[k]);
    CHECK(same, "signals round trip");
    wire_result_free(&back);
    CHECK(back.sig.text_end == NULL && !back.has_signals, "freed");

    /* what a broken or hostile worker might send is refused */
    struct { uint32_t te[3]; int64_t completion; float bad; const char *want; } cases[] = {
        { { 1, 2, 5 }, 4, 0, "inside a character" },
        { { 1, 3, 4 }, 4, 0, "does not reach the end" },
        { { 3, 1, 5 }, 4, 0, "out of order" },
        { { 1, 3, 6 }, 4, 0, "past the text" },
        { { 1, 3, 5 }, 2, 0, "more signals than completion tokens" },
        { { 1, 3, 5 }, 4, NAN, "not finite" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct WireResult x = r;
        memcpy(tend, cases[c].te, sizeof tend);
        x.completion_tokens = cases[c].completion;
        float keep = vals[WS_MARGIN][1];
        if (cases[c].bad != 0 || isnan(cases[c].bad))
            vals[WS_MARGIN][1] = cases[c].bad;
        mpw_reset(&w);
        wire_result_encode(&w, &x);
        vals[WS_MARGIN][1] = keep;
        back = (struct WireResult){ .job = 3 };
        int rc = wire_result_decode(w.buf.data, w.buf.size, &back, err, sizeof err);
        CHECK(rc != 0 && strstr(err, cases[c].want), "case %zu: %s", c, rc ? err : "accepted");
        CHECK(back.sig.text_end == NULL, "nothing kept after a refusal");
    }
    /* an array of the wrong length */
    mpw_reset(&w);
    mpw_map(&w, 3);
    mpw_kv_cstr(&w, "finish", "stop");
    mpw_kv_int(&w, "completion_tokens", 9);
    mpw_cstr(&w, "signals");
    mpw_map(&w, WS_N_FLOAT + 2);
    mpw_kv_uint(&w, "n", 2);
    for (int k = 0; k < WS_N_FLOAT; k++) {
        mpw_cstr(&w, wire_sig_name(k));
        mpw_bin(&w, "\0\0\0\0\0\0\0\0", k == 3 ? 4 : 8);
    }
    mpw_cstr(&w, "text_end");
    mpw_bin(&w, "\0\0\0\0\0\0\0\0", 8);
    back = (struct WireResult){ .job = 3 };
    CHECK(wire_result_decode(w.buf.data, w.buf.size, &back, err, sizeof err) != 0 &&
          strstr(err, "doc_mass is not 2 values"), "%s", err);
    mpw_destroy(&w);
}

int main(void)
{
    test_sha256();
    test_calibration();
    test_windows();
    test_features_and_score();
    test_abstained();
    test_words();
    test_lexical();
    test_wire_signals();
    return check_report("test_grounding_units");
}
