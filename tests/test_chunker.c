/* The chunker and Markdown structure: a heading starts a chunk, a section that fits stays whole,
 * a long section is cut at paragraphs (and a long paragraph at sentences, never inside one),
 * headings in fenced code are text, bodiless headings join what follows, each chunk's heading
 * path, text without headings chunked as the sentence packer alone does, and the pages page
 * markers give each chunk. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/chunker.h"
#include "retriever/status.h"
#include "tests/check.h"

static struct TokenCounter tc;

static size_t chunks(const char *t, uint32_t target, uint32_t overlap, struct ChunkSpan **cs)
{
    struct ChunkOptions co = { target, overlap };
    size_t n = 0;
    char err[256];
    int rc = chunk_text(t, strlen(t), &co, &tc, cs, &n, err, sizeof err);
    CHECK(rc == RET_OK, "chunk_text: %s", err);
    return rc == RET_OK ? n : 0;
}

/* Does chunk c's text start with `head` and end with `tail`? */
static int span_is(const char *t, const struct ChunkSpan *c, const char *head, const char *tail)
{
    size_t len = c->end - c->start, hl = strlen(head), tl = strlen(tail);
    return len >= hl && len >= tl && memcmp(t + c->start, head, hl) == 0 &&
           memcmp(t + c->end - tl, tail, tl) == 0;
}

static const char *path(const char *t, const struct ChunkSpan *c, const char *title)
{
    static char buf[CHUNK_MAX_PATH_BYTES + 1];
    chunk_heading_path(t, c, title, title ? strlen(title) : 0, buf, sizeof buf);
    return buf;
}

static void test_sections(void)
{
    const char *t =
        "# Protocol\n\nThe wire protocol of the daemon.\n\n"
        "## stats\n\nRequest: stats. Reply: counters of the daemon.\n\n"
        "## cancel\n\nRequest: cancel with a target. The worker stops at its next step.\n\n"
        "Not found: the error not_found.\n";
    struct ChunkSpan *cs;
    size_t n = chunks(t, 64, 16, &cs);
    CHECK(n == 3, "three sections, three chunks (got %zu)", n);
    if (n == 3) {
        CHECK(span_is(t, &cs[0], "# Protocol", "of the daemon."), "the title's own body");
        CHECK(span_is(t, &cs[1], "## stats", "of the daemon."), "stats whole");
        CHECK(span_is(t, &cs[2], "## cancel", "not_found."), "cancel whole, both paragraphs");
        CHECK(strcmp(path(t, &cs[0], NULL), "Protocol") == 0, "path 0: %s", path(t, &cs[0], NULL));
        CHECK(strcmp(path(t, &cs[1], NULL), "Protocol \xE2\x80\xBA stats") == 0, "path 1: %s",
              path(t, &cs[1], NULL));
        CHECK(strcmp(path(t, &cs[2], NULL), "Protocol \xE2\x80\xBA cancel") == 0, "path 2: %s",
              path(t, &cs[2], NULL));
        /* the outermost heading is left out where it is the document's title */
        CHECK(strcmp(path(t, &cs[2], "Protocol"), "cancel") == 0, "path without the title: %s",
              path(t, &cs[2], "Protocol"));
        CHECK(strcmp(path(t, &cs[0], "Protocol"), "") == 0, "the title alone: no path");
        CHECK(strcmp(path(t, &cs[2], "Other"), "Protocol \xE2\x80\xBA cancel") == 0,
              "another title keeps it");
    }
    free(cs);

    /* A heading with no body joins the chunk that follows; deeper levels nest and a sibling
     * closes them; closing #s are not part of the title. */
    const char *u =
        "# Guide\n## Setup ##\n### Linux\n\nInstall the package.\n\n### macOS\n\nUse brew.\n\n"
        "## Use\n\nRun it.\n";
    n = chunks(u, 64, 16, &cs);
    CHECK(n == 3, "three chunks with bodies (got %zu)", n);
    if (n == 3) {
        CHECK(span_is(u, &cs[0], "# Guide", "the package."), "bodiless headings joined");
        CHECK(strcmp(path(u, &cs[0], NULL), "Guide \xE2\x80\xBA Setup \xE2\x80\xBA Linux") == 0,
              "nested path: %s", path(u, &cs[0], NULL));
        CHECK(span_is(u, &cs[1], "### macOS", "brew."), "sibling");
        CHECK(strcmp(path(u, &cs[1], NULL), "Guide \xE2\x80\xBA Setup \xE2\x80\xBA macOS") == 0,
              "sibling path: %s", path(u, &cs[1], NULL));
        CHECK(strcmp(path(u, &cs[2], NULL), "Guide \xE2\x80\xBA Use") == 0, "closed levels: %s",
              path(u, &cs[2], NULL));
    }
    for (size_t i = 0; i < n; i++)
        CHECK(cs[i].end - cs[i].start > 12, "chunk %zu holds more than a heading", i);
    free(cs);

    /* Setext headings (a one-line paragraph underlined with = or -) are headings as ATX ones
     * are; a line of dashes after a blank line (a rule) and a paragraph of two lines are not. */
    const char *w =
        "Protocol\n========\n\nThe wire protocol of the daemon.\n\n"
        "stats\n-----\n\nRequest: stats. Reply: counters of the daemon.\n\n"
        "cancel\n---\nRequest: cancel with a target. The worker stops at its next step.\n\n"
        "Not found: the error not_found.\n\n---\n\nAfter a rule. Two lines\nof a paragraph\n---\n";
    n = chunks(w, 64, 16, &cs);
    CHECK(n == 3, "three setext sections, three chunks (got %zu)", n);
    if (n == 3) {
        CHECK(span_is(w, &cs[0], "Protocol\n===", "of the daemon."), "setext title's body");
        CHECK(span_is(w, &cs[1], "stats\n---", "of the daemon."), "setext stats whole");
        CHECK(span_is(w, &cs[2], "cancel\n---", "paragraph\n---"), "cancel, the rule and the rest");
        CHECK(strcmp(path(w, &cs[1], NULL), "Protocol \xE2\x80\xBA stats") == 0, "setext path 1: %s",
              path(w, &cs[1], NULL));
        CHECK(strcmp(path(w, &cs[2], NULL), "Protocol \xE2\x80\xBA cancel") == 0,
              "setext path 2: %s", path(w, &cs[2], NULL));
    }
    free(cs);

    /* Text before the first heading is a section of its own, with no path. */
    const char *v = "Some preface.\n\n## Part\n\nThe part.\n";
    n = chunks(v, 64, 0, &cs);
    CHECK(n == 2 && span_is(v, &cs[0], "Some", "preface.") && cs[0].n_heads == 0 &&
          span_is(v, &cs[1], "## Part", "part."), "preface then section");
    free(cs);
}

static void test_fences(void)
{
    const char *t =
        "## Build\n\nRun the script:\n\n```sh\n# install the tools\nmake deps\n## not a heading\n```\n\n"
        "~~~~\n# neither\n~~~\nstill code\n~~~~\n\nDone.\n\n## Next\n\nMore.\n";
    struct ChunkSpan *cs;
    size_t n = chunks(t, 128, 0, &cs);
    CHECK(n == 2, "lines with # in fenced code start no chunk (got %zu)", n);
    if (n == 2) {
        CHECK(span_is(t, &cs[0], "## Build", "Done."), "the code stays in its section");
        CHECK(strcmp(path(t, &cs[0], NULL), "Build") == 0 && strcmp(path(t, &cs[1], NULL), "Next") == 0,
              "paths ignore the code");
    }
    free(cs);
    /* not headings: no space after the #s, seven #s, indented four spaces */
    const char *u = "#hashtag and more words here.\n####### seven\n    # code\nEnd of it.\n";
    n = chunks(u, 64, 0, &cs);
    CHECK(n == 1 && cs[0].n_heads == 0, "no headings there (%zu chunks)", n);
    free(cs);
}

/* A sentence of `words` words: "Wn w w ... w." */
static size_t sentence(char *out, size_t cap, int id, int words)
{
    size_t n = (size_t)snprintf(out, cap, "S%d", id);
    for (int w = 1; w < words; w++)
        n += (size_t)snprintf(out + n, cap - n, " word");
    n += (size_t)snprintf(out + n, cap - n, ".");
    return n;
}

static void test_long_section(void)
{
    /* A section of 6 paragraphs of 3 sentences (about 24 tokens each), then one paragraph of
     * 12 sentences (about 100 tokens), against a 64-token target. */
    size_t cap = 1 << 16, len = 0;
    char *t = malloc(cap);
    len += (size_t)snprintf(t, cap, "# Doc\n\n## Long\n\n");
    int id = 0;
    for (int p = 0; p < 6; p++) {
        for (int s = 0; s < 3; s++) {
            len += sentence(t + len, cap - len, id++, 7);
            t[len++] = s < 2 ? ' ' : '\n';
        }
        t[len++] = '\n';
    }
    size_t big_para = len;
    for (int s = 0; s < 12; s++) {
        len += sentence(t + len, cap - len, id++, 7);
        t[len++] = ' ';
    }
    t[len - 1] = '\n';
    len += (size_t)snprintf(t + len, cap - len, "\n## Short\n\nS%d word word.\n", id++);
    struct ChunkSpan *cs;
    size_t n = chunks(t, 64, 16, &cs);
    CHECK(n >= 5, "long section split (%zu chunks)", n);
    int ok = 1, whole_paras = 1, overlaps = 0;
    size_t max_tok = 0;
    for (size_t i = 0; i < n; i++) {
        size_t cnt;
        tokcount_count(&tc, t + cs[i].start, cs[i].end - cs[i].start, &cnt);
        max_tok = cnt > max_tok ? cnt : max_tok;
        /* every chunk starts at a sentence or heading and ends at a sentence's end */
        ok &= t[cs[i].start] == 'S' || t[cs[i].start] == '#';
        ok &= t[cs[i].end - 1] == '.';
        if (i + 1 < n && cs[i].end <= big_para) /* before the long paragraph: whole paragraphs */
            whole_paras &= t[cs[i].end] == '\n' && t[cs[i].end + 1] == '\n';
        if (i)
            overlaps += cs[i].start < cs[i - 1].end;
        const char *want = i + 1 < n ? "Doc \xE2\x80\xBA Long" : "Doc \xE2\x80\xBA Short";
        CHECK(strcmp(path(t, &cs[i], NULL), want) == 0, "chunk %zu path %s", i, path(t, &cs[i], NULL));
    }
    CHECK(ok, "chunks begin and end at sentence boundaries");
    CHECK(whole_paras, "paragraphs that fit are not cut");
    CHECK(max_tok <= 64 + 2, "largest chunk %zu tokens", max_tok);
    CHECK(overlaps > 0, "the long paragraph's pieces overlap");
    CHECK(n >= 2 && span_is(t, &cs[0], "# Doc", ".") && span_is(t, &cs[n - 1], "## Short", "word."),
          "the headings start the first and last chunks");
    CHECK(n >= 2 && cs[n - 1].start > cs[n - 2].end, "no overlap across a heading");
    free(cs);
    free(t);
}

/* Without headings the chunks are those of the sentence packer alone: a text of list lines and
 * paragraphs chunks exactly as the chunker before headings counted did (the spans it gave), and
 * its twin with the list lines made headings (block lines as well, so the sentence units are
 * the same) starts a chunk at each. */
static void test_no_headings(void)
{
    size_t cap = 1 << 16, len = 0;
    char *t = malloc(cap);
    int id = 0;
    for (int p = 0; p < 12; p++) {
        if (p % 4 == 0)
            len += (size_t)snprintf(t + len, cap - len, "- Part %d\n\n", p);
        for (int s = 0; s < 4; s++) {
            len += sentence(t + len, cap - len, id, 3 + (id * 7) % 11);
            id++;
            t[len++] = ' ';
        }
        t[len - 1] = '\n';
        t[len++] = '\n';
    }
    t[len] = 0;
    struct ChunkSpan *cs;
    size_t n = chunks(t, 64, 16, &cs);
    /* the packer's rule: a chunk ends before a unit that would pass the target or before a
     * paragraph once it holds half of it; the next repeats trailing sentences of its paragraph */
    static const uint64_t want[][2] = {
        {0, 165}, {167, 332}, {334, 456}, {458, 602}, {603, 743}, {744, 909}, {895, 1055},
        {1056, 1226}, {1187, 1301}, {1303, 1442}, {1444, 1578}, {1554, 1638}, {1640, 1789}, {1791, 1950},
    };
    size_t n_want = sizeof want / sizeof want[0];
    int same = n == n_want;
    for (size_t i = 0; same && i < n; i++)
        same &= cs[i].start == want[i][0] && cs[i].end == want[i][1];
    CHECK(same, "without headings: %zu chunks as before (%zu)", n, n_want);
    int straddles = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK(cs[i].n_heads == 0, "no heading path");
        for (size_t k = cs[i].start; k + 2 < cs[i].end; k++)
            straddles += t[k] == '\n' && t[k + 1] == '-';
    }
    CHECK(straddles > 0, "without headings chunks run across the list lines");
    char *h = strdup(t);
    for (size_t k = 0; k + 1 < len; k++)
        if ((k == 0 || h[k - 1] == '\n') && h[k] == '-' && h[k + 1] == ' ')
            h[k] = '#';
    struct ChunkSpan *hs;
    size_t hn = chunks(h, 64, 16, &hs);
    int starts = 0;
    for (size_t i = 0; i < hn; i++)
        starts += h[hs[i].start] == '#';
    CHECK(starts == 3, "with headings, three chunks start at them (got %d)", starts);
    free(hs);
    free(h);
    free(cs);
    free(t);
}

/* A three-page text as diffrag-extract writes a PDF: a title line, then each page's marker and
 * its sentences. Each chunk's first and last pages are those of the first and last sentence it
 * holds; without markers, or with markers that are not (in code, page 0, a leading zero), none. */
static void test_pages(void)
{
    static const char *const words[] = { "one", "two", "three" };
    char t[8192];
    size_t at = 0;
    size_t sent_at[60];
    uint32_t sent_page[60];
    size_t ns = 0;
    at += (size_t)snprintf(t + at, sizeof t - at, "# Quarterly report\n\n");
    for (uint32_t pg = 1; pg <= 3; pg++) {
        at += (size_t)snprintf(t + at, sizeof t - at, "<!-- page %u -->\n\n", pg);
        for (int para = 0; para < 2; para++) {
            for (int k = 0; k < 5; k++) {
                sent_at[ns] = at;
                sent_page[ns++] = pg;
                at += (size_t)snprintf(t + at, sizeof t - at, "Page %s sentence %d tells of %s things. ",
                                       words[pg - 1], para * 5 + k, k % 2 ? "small" : "other");
            }
            at += (size_t)snprintf(t + at, sizeof t - at, "\n\n");
        }
    }
    struct ChunkSpan *cs;
    size_t n = chunks(t, 4096, 0, &cs);
    CHECK(n == 1 && cs[0].page_first == 1 && cs[0].page_last == 3,
          "one chunk of the whole text: pp. 1-3 (got %zu chunks, %u-%u)", n,
          n ? cs[0].page_first : 0, n ? cs[0].page_last : 0);
    free(cs);
    int spans_any = 0;
    for (uint32_t target = 24; target <= 168; target += 48) {
        n = chunks(t, target, target / 4, &cs);
        int spans = 0, bad = 0;
        for (size_t i = 0; i < n; i++) {
            uint32_t lo = 0, hi = 0;
            for (size_t j = 0; j < ns; j++)
                if (sent_at[j] >= cs[i].start && sent_at[j] < cs[i].end) {
                    if (!lo)
                        lo = sent_page[j];
                    hi = sent_page[j];
                }
            if (cs[i].page_first != lo || cs[i].page_last != hi) {
                bad++;
                CHECK(0, "target %u chunk %zu: pages %u-%u, its sentences' %u-%u", target, i,
                      cs[i].page_first, cs[i].page_last, lo, hi);
            }
            spans += lo != hi;
        }
        CHECK(n >= 3 && !bad, "target %u: %zu chunks, each with its sentences' pages", target, n);
        spans_any += spans;
        free(cs);
    }
    CHECK(spans_any > 0, "some chunk spans two pages");
    /* a chunk that starts on a page and ends at the next marker stays on its page */
    const char *w = "<!-- page 4 -->\n\nThe end of it.\n\n<!-- page 5 -->\n";
    n = chunks(w, 64, 0, &cs);
    CHECK(n == 1 && cs[0].page_first == 4 && cs[0].page_last == 4, "a trailing marker adds no page");
    free(cs);
    /* a marker is never a chunk of its own: it starts the paragraph after it */
    n = chunks(t, 24, 0, &cs);
    for (size_t i = 0; i < n; i++)
        CHECK(strncmp(t + cs[i].start, "<!--", 4) || cs[i].end - cs[i].start > 20,
              "chunk %zu is more than a marker", i);
    free(cs);
    const char *none[] = {
        "# Notes\n\nNo markers here. Just text about page 3 and <!-- comments -->.\n",
        "```\n<!-- page 2 -->\n```\n\nCode shows a marker.\n",
        "<!-- page 0 -->\n\nPage zero is no page.\n\n<!-- page 02 -->\n\nNor is a leading zero.\n",
        "Text <!-- page 2 --> inside a line.\n",
    };
    for (size_t i = 0; i < sizeof none / sizeof none[0]; i++) {
        n = chunks(none[i], 64, 0, &cs);
        for (size_t j = 0; j < n; j++)
            CHECK(cs[j].page_first == 0 && cs[j].page_last == 0, "text %zu chunk %zu: no page (%u)",
                  i, j, cs[j].page_first);
        CHECK(n >= 1, "text %zu chunked", i);
        free(cs);
    }
}

/* Text without headings or tables chunks exactly as before tables counted: a mixed text (lists,
 * quotes, numbered items, lines with pipes that make no table, fenced code, page markers,
 * abbreviations, a paragraph longer than the target) gives the spans the chunker gave before. */
static const char *mixed_text(void)
{
    static char t[8192];
    size_t n = 0, cap = sizeof t;
    int id = 0;
    n += (size_t)snprintf(t + n, cap - n, "Report\n\n<!-- page 1 -->\n");
    for (int p = 0; p < 9; p++) {
        switch (p % 5) {
        case 0: n += (size_t)snprintf(t + n, cap - n, "- item %d of the list\n- next one\n\n", p); break;
        case 1: n += (size_t)snprintf(t + n, cap - n, "> Quoted by Dr. Smith, e.g. here.\n\n"); break;
        case 2: n += (size_t)snprintf(t + n, cap - n, "| a lone pipe line | without a separator |\n"
                                                         "| and another | row. Of text |\n\n"); break;
        case 3: n += (size_t)snprintf(t + n, cap - n, "```\n| x | y |\n|---|---|\n| 1 | 2 |\n```\n\n"); break;
        default: n += (size_t)snprintf(t + n, cap - n, "<!-- page %d -->\n1. first\n2. second\n\n", p); break;
        }
        for (int s = 0; s < 3 + (p == 4) * 12; s++) {
            n += sentence(t + n, cap - n, id, 3 + (id * 5) % 9);
            id++;
            t[n++] = ' ';
        }
        t[n - 1] = '\n';
        t[n++] = '\n';
    }
    t[n] = 0;
    return t;
}

static void test_tableless_unchanged(void)
{
    const char *t = mixed_text();
    struct ChunkSpan *cs;
    size_t n = chunks(t, 40, 8, &cs);
    static const uint64_t want[][2] = {
        {0, 55}, {57, 128}, {130, 232}, {233, 325}, {326, 386}, {387, 474}, {476, 568}, {569, 624},
        {626, 695}, {696, 775}, {776, 880}, {866, 940}, {921, 1010}, {1011, 1090}, {1091, 1180},
        {1182, 1269}, {1270, 1324}, {1326, 1395}, {1396, 1489}, {1490, 1551}, {1552, 1641},
        {1643, 1736}, {1737, 1756},
    };
    size_t n_want = sizeof want / sizeof want[0];
    int same = n == n_want;
    for (size_t i = 0; same && i < n; i++)
        same &= cs[i].start == want[i][0] && cs[i].end == want[i][1] && cs[i].n_heads == 0;
    CHECK(same, "headingless, tableless text: %zu chunks as before (%zu)", n, n_want);
    free(cs);
}

/* Is no chunk boundary (a start or an end) strictly inside [a, b)? */
static int uncut(const struct ChunkSpan *cs, size_t n, size_t a, size_t b)
{
    for (size_t i = 0; i < n; i++)
        if ((cs[i].start > a && cs[i].start < b) || (cs[i].end > a && cs[i].end < b))
            return 0;
    return 1;
}

/* A table that fits the target is one unit with its caption (the line before it, as
 * diffrag-extract writes an HTML caption) and, when both fit, the paragraph that introduces
 * it; with headings or without, wherever the packer would have cut. */
static void test_small_table(void)
{
    static char t[4096];
    const char *table = "Table 1: Sizes of the models\n\n| Model | Size |\n|---|---|\n"
                        "| alpha | 1 GB. Big |\n| beta | 2 GB. Bigger |\n| gamma | 3 GB |";
    for (int heads = 0; heads < 2; heads++) {
        for (int lead = 0; lead < 12; lead++) {
            size_t n = (size_t)snprintf(t, sizeof t, "%s", heads ? "# Doc\n\n## Sizes\n\n" : "");
            for (int s = 0; s < lead; s++) {
                n += sentence(t + n, sizeof t - n, s, 6);
                t[n++] = s % 3 == 2 ? '\n' : ' ';
                if (s % 3 == 2)
                    t[n++] = '\n';
            }
            n += (size_t)snprintf(t + n, sizeof t - n, "\n\nThe sizes follow.\n\n%s\n\nAfter it. ", table);
            for (int s = 0; s < 4; s++)
                n += sentence(t + n, sizeof t - n, 100 + s, 5), t[n++] = ' ';
            t[n] = 0;
            struct ChunkSpan *cs;
            size_t k = chunks(t, 64, 8, &cs);
            size_t a = (size_t)(strstr(t, "Table 1") - t), b = a + strlen(table);
            size_t intro = (size_t)(strstr(t, "The sizes") - t);
            CHECK(uncut(cs, k, a, b), "headings %d lead %d: the table and its caption in one chunk", heads, lead);
            CHECK(uncut(cs, k, intro, b), "headings %d lead %d: with its introduction", heads, lead);
            for (size_t i = 0; i < k; i++)
                CHECK(cs[i].table_head_len == 0 && cs[i].n_tokens <= 64, "no later parts, within the target");
            free(cs);
        }
    }
}

/* A long table is cut between rows only: its first part holds the caption and header row,
 * every part is within the target, and each later part's heading path carries the caption
 * (marked continued) and the header row. A row longer than the target is cut as a long
 * sentence is, within the target. After the table the chunks go on as before. */
static void test_long_table(void)
{
    size_t cap = 1 << 16, n = 0;
    char *t = malloc(cap);
    n += (size_t)snprintf(t + n, cap - n, "# Report\n\n## Results\n\nMeasured on one machine.\n\n"
                                          "Table 2: Latency by model\n\n| Model | p50 | Note |\n|---|---:|---|\n");
    size_t long_row = 0;
    for (int r = 0; r < 200; r++) {
        if (r == 150) {
            long_row = n;
            n += (size_t)snprintf(t + n, cap - n, "| wide |");
            for (int w = 0; w < 120; w++)
                n += (size_t)snprintf(t + n, cap - n, " cell");
            n += (size_t)snprintf(t + n, cap - n, " |\n");
            continue;
        }
        n += (size_t)snprintf(t + n, cap - n, "| m%d | %d ms. Fast | Dr. Who said so. Yes |\n", r, r * 3);
    }
    size_t tend = n - 1;
    n += (size_t)snprintf(t + n, cap - n, "\nAfter the table. More text here.\n");
    t[n] = 0;
    struct ChunkSpan *cs;
    size_t k = chunks(t, 64, 16, &cs);
    size_t cap_at = (size_t)(strstr(t, "Table 2") - t);
    int first = -1, parts = 0, rows_ok = 1, paths_ok = 1, within = 1, in_row = 0;
    for (size_t i = 0; i < k; i++) {
        if (cs[i].end <= cap_at || cs[i].start >= tend)
            continue;
        parts++;
        if (first < 0)
            first = (int)i;
        size_t cnt = 0;
        tokcount_count(&tc, t + cs[i].start, cs[i].end - cs[i].start, &cnt);
        within &= cs[i].n_tokens <= 64 && cnt <= 64 + 2;
        int cut_row = (cs[i].start > long_row && cs[i].start < long_row + 600) ||
                      (cs[i].end > long_row && cs[i].end < long_row + 600);
        in_row += cut_row;
        if (!cut_row && (int)i != first)
            rows_ok &= t[cs[i].start] == '|' && t[cs[i].start - 1] == '\n' &&
                       (t[cs[i].end] == '\n' || cs[i].end == tend);
        if ((int)i != first)
            paths_ok &= strcmp(path(t, &cs[i], "Report"),
                               "Results \xE2\x80\xBA Table 2: Latency by model (cont.) \xE2\x80\xBA "
                               "| Model | p50 | Note |") == 0;
    }
    CHECK(parts >= 10, "the long table in %d parts", parts);
    CHECK(first >= 0 && span_is(t, &cs[first], "Table 2: Latency by model\n\n| Model | p50 | Note |\n|---|---:|---|\n| m0 |", "|"),
          "the first part: caption, header row, rows");
    CHECK(first >= 0 && strcmp(path(t, &cs[first], "Report"), "Results") == 0 && cs[first].table_head_len == 0,
          "the first part's path is its section's: %s", first >= 0 ? path(t, &cs[first], "Report") : "");
    CHECK(rows_ok, "later parts start and end at row boundaries");
    CHECK(paths_ok, "later parts' paths carry the caption and header row");
    CHECK(within, "every part within the target");
    CHECK(in_row >= 2, "the row longer than the target is cut (%d boundaries in it)", in_row);
    CHECK(k > 0 && span_is(t, &cs[k - 1], "After the table.", "here.") && cs[k - 1].table_head_len == 0,
          "the text after the table starts a chunk of its own, with its section's path");
    /* the same table without a caption (a one-line paragraph right before a table is one):
     * later parts carry the header row, marked continued */
    for (char *c = strstr(t, "Measured"); c < strstr(t, "| Model"); c++)
        if (*c != '\n')
            *c = ' ';
    struct ChunkSpan *ns;
    size_t nk = chunks(t, 64, 16, &ns);
    int later = 0;
    for (size_t i = 0; i < nk; i++)
        if (ns[i].table_head_len) {
            later++;
            CHECK(strcmp(path(t, &ns[i], "Report"), "Results \xE2\x80\xBA | Model | p50 | Note | (cont.)") == 0,
                  "without a caption: %s", path(t, &ns[i], "Report"));
        }
    CHECK(later >= 10, "without a caption, %d later parts", later);
    free(ns);
    free(cs);
    free(t);
}

/* Rows in fenced code are code: no table units, no table paths; sentence ends inside them cut
 * as they did before. */
static void test_fenced_table(void)
{
    size_t cap = 1 << 15, n = 0;
    char *t = malloc(cap);
    n += (size_t)snprintf(t + n, cap - n, "Table 3: In code\n\n```\n| Model | p50 |\n|---|---|\n");
    for (int r = 0; r < 120; r++)
        n += (size_t)snprintf(t + n, cap - n, "| m%d | %d ms. Fast and. Quick |\n", r, r);
    n += (size_t)snprintf(t + n, cap - n, "```\n");
    t[n] = 0;
    struct ChunkSpan *cs;
    size_t k = chunks(t, 40, 0, &cs);
    int mid_row = 0, paths = 0;
    for (size_t i = 0; i < k; i++) {
        mid_row += t[cs[i].start] != '|' && t[cs[i].start - (i > 0)] != '\n';
        paths += cs[i].table_head_len != 0;
    }
    CHECK(k > 5 && paths == 0, "fenced rows: %zu chunks, %d with a table path", k, paths);
    CHECK(mid_row > 0, "fenced rows are cut at sentences as before (%d mid-row starts)", mid_row);
    free(cs);
    free(t);
}

int main(void)
{
    tokcount_simple(&tc);
    test_sections();
    test_fences();
    test_long_section();
    test_no_headings();
    test_pages();
    test_tableless_unchanged();
    test_small_table();
    test_long_table();
    test_fenced_table();
    return check_report("test_chunker");
}
