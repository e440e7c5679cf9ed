/* Tests for general.file_type by name (model/ftype.c): the table against llama.cpp's
 * llama_ftype numbering, the "guessed" flag, unknown values, and the quantisation of the model
 * files in models/ when present (run from the repo root). Files without general.file_type (the
 * tiny test models: "F32" from their weights) are checked end to end by tests/test_daemon.py. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "model/ftype.h"
#include "model/gguf.h"
#include "tests/check.h"

static int same(const char *a, const char *b)
{
    return a && b && !strcmp(a, b);
}

static void check_table(void)
{
    static const struct { uint32_t ft; const char *name; } want[] = {
        { 0, "F32" }, { 1, "F16" }, { 2, "Q4_0" }, { 3, "Q4_1" }, { 7, "Q8_0" }, { 8, "Q5_0" },
        { 9, "Q5_1" }, { 10, "Q2_K" }, { 11, "Q3_K_S" }, { 12, "Q3_K_M" }, { 13, "Q3_K_L" },
        { 14, "Q4_K_S" }, { 15, "Q4_K_M" }, { 16, "Q5_K_S" }, { 17, "Q5_K_M" }, { 18, "Q6_K" },
        { 21, "Q2_K_S" }, { 30, "IQ4_XS" }, { 32, "BF16" },
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        CHECK(same(ftype_name(want[i].ft), want[i].name), "file_type %u: %s, not %s",
              want[i].ft, ftype_name(want[i].ft) ? ftype_name(want[i].ft) : "NULL", want[i].name);
    CHECK(same(ftype_name(1024 | 15), "Q4_K_M"), "the guessed flag is ignored");
    /* 4..6 were removed from llama.cpp (Q4_1_SOME_F16, Q4_2, Q4_3); 33..35 never named */
    CHECK(ftype_name(4) == NULL && ftype_name(5) == NULL && ftype_name(33) == NULL,
          "retired values have no name");
    CHECK(ftype_name(1000) == NULL && ftype_name(UINT32_MAX) == NULL, "values past the table");
}

/* The quantisation of the file at path, "" when it does not open. */
static void describe(const char *path, char *out, size_t cap)
{
    struct GgufFile *g = NULL;
    char err[512];
    out[0] = 0;
    if (gguf_open(path, &g, err, sizeof err) == GGUF_OK)
        ftype_describe(g, out, cap);
    gguf_close(&g);
}

static void check_file(const char *path, const char *want)
{
    char q[32];
    if (access(path, R_OK)) {
        printf("  %s absent: not checked\n", path);
        return;
    }
    describe(path, q, sizeof q);
    CHECK(same(q, want), "%s: %s, not %s", path, q, want);
    printf("  %s: %s\n", path, q);
}

int main(void)
{
    check_table();
    check_file("models/SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1");
    check_file("models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", "Q4_K_M");
    return check_report("test_ftype");
}
