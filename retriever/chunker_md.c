/* The Markdown structure of a document as the chunker sees it (chunker_md.h): page markers,
 * fenced code, ATX and setext headings and tables; heading paths (with a table's caption and header row
 * for the later parts of a split table) and the pages of chunks. */
#include "retriever/chunker_md.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/status.h"

uint32_t chunk_page_marker(const char *text, size_t ls, size_t le)
{
    static const char open[] = "<!-- page ", close[] = " -->";
    size_t ol = sizeof open - 1, cl = sizeof close - 1;
    while (le > ls && chunk_is_ws((unsigned char)text[le - 1]))
        le--;
    if (le - ls < ol + 1 + cl || memcmp(text + ls, open, ol) || memcmp(text + le - cl, close, cl))
        return 0;
    size_t a = ls + ol, b = le - cl;
    if (b - a > 9 || text[a] == '0')
        return 0;
    uint32_t n = 0;
    for (size_t i = a; i < b; i++) {
        if (!isdigit((unsigned char)text[i]))
            return 0;
        n = n * 10 + (uint32_t)(text[i] - '0');
    }
    return n;
}

int chunk_line_is_block(const char *text, size_t len, size_t i)
{
    if (i + 5 < len && memcmp(text + i, "<!-- ", 5) == 0) {
        const char *nl = memchr(text + i, '\n', len - i);
        if (chunk_page_marker(text, i, nl ? (size_t)(nl - text) : len))
            return 1;
    }
    while (i < len && (text[i] == ' ' || text[i] == '\t'))
        i++;
    if (i >= len)
        return 0;
    char c = text[i];
    if (c == '#' || c == '>' || c == '|')
        return 1;
    if ((c == '-' || c == '*' || c == '+') && i + 1 < len && text[i + 1] == ' ')
        return 1;
    if (isdigit((unsigned char)c)) {
        while (i < len && isdigit((unsigned char)text[i]))
            i++;
        return i + 1 < len && (text[i] == '.' || text[i] == ')') && text[i + 1] == ' ';
    }
    return 0;
}

/* A fence opening or closing line: up to 3 spaces, then 3 or more ` or ~. */
static size_t fence_run(const char *text, size_t ls, size_t le, char *ch)
{
    size_t i = ls;
    while (i < le && i - ls < 3 && text[i] == ' ')
        i++;
    if (i >= le || (text[i] != '`' && text[i] != '~'))
        return 0;
    size_t j = i;
    while (j < le && text[j] == text[i])
        j++;
    if (j - i < 3)
        return 0;
    *ch = text[i];
    if (text[i] == '`' && memchr(text + j, '`', le - j))
        return 0; /* a backtick fence's info string has no backticks */
    return j - i;
}


/* Grow *p (elements of size sz) to hold n + 1. */
static int grow(void **p, size_t *cap, size_t n, size_t sz)
{
    if (n < *cap)
        return RET_OK;
    size_t c = *cap ? *cap * 2 : 16;
    void *q = realloc(*p, c * sz);
    if (!q)
        return RET_ENOMEM;
    *p = q;
    *cap = c;
    return RET_OK;
}

/* The first non-blank byte of the line [ls, le) when it is within 3 spaces of its start. */
static size_t indent(const char *text, size_t ls, size_t le)
{
    size_t i = ls;
    while (i < le && i - ls < 3 && text[i] == ' ')
        i++;
    return i;
}

static size_t line_trim_end(const char *text, size_t ls, size_t le)
{
    while (le > ls && chunk_is_ws((unsigned char)text[le - 1]))
        le--;
    return le;
}

/* A table row: a line that starts with '|' (after up to 3 spaces), as diffrag-extract writes
 * them. */
static int pipe_row(const char *text, size_t ls, size_t le)
{
    size_t i = indent(text, ls, le);
    return i < le && text[i] == '|';
}

/* A table's separator row: '|' first, then only '|', '-', ':' and blanks, with a '-'. */
static int separator_row(const char *text, size_t ls, size_t le)
{
    if (!pipe_row(text, ls, le))
        return 0;
    int dash = 0;
    for (size_t i = indent(text, ls, le); i < le; i++) {
        char c = text[i];
        if (c == '-')
            dash = 1;
        else if (c != '|' && c != ':' && c != ' ' && c != '\t' && c != '\r')
            return 0;
    }
    return dash;
}

static size_t line_end(const char *text, size_t len, size_t ls)
{
    const char *nl = memchr(text + ls, '\n', len - ls);
    return nl ? (size_t)(nl - text) : len;
}

int chunk_at_line_start(const char *text, size_t s)
{
    while (s > 0 && (text[s - 1] == ' ' || text[s - 1] == '\t'))
        s--;
    return s == 0 || text[s - 1] == '\n';
}

/* An ATX heading on the line [ls, le): its title, level 0 when it is none. */
static struct ChunkHeading atx_heading(const char *text, size_t ls, size_t le)
{
    struct ChunkHeading none = { 0, 0, 0 };
    size_t i = indent(text, ls, le), h = i;
    while (i < le && text[i] == '#')
        i++;
    size_t level = i - h;
    if (level < 1 || level > CHUNK_MAX_DEPTH || i >= le || (text[i] != ' ' && text[i] != '\t'))
        return none;
    size_t ts = i, te = le;
    while (ts < te && chunk_is_ws((unsigned char)text[ts]))
        ts++;
    while (te > ts && chunk_is_ws((unsigned char)text[te - 1]))
        te--;
    size_t c = te; /* a closing run of #s after a space */
    while (c > ts && text[c - 1] == '#')
        c--;
    if (c < te && (c == ts || text[c - 1] == ' ' || text[c - 1] == '\t')) {
        te = c;
        while (te > ts && chunk_is_ws((unsigned char)text[te - 1]))
            te--;
    }
    if (te <= ts || te - ts > UINT32_MAX)
        return none;
    return (struct ChunkHeading){ ts, (uint32_t)(te - ts), (uint32_t)level };
}

/* A setext underline on the line [ls, le): up to 3 spaces, a run of '=' (level 1) or '-'
 * (level 2), trailing blanks; 0 when it is none. */
static uint32_t setext_level(const char *text, size_t ls, size_t le)
{
    size_t i = indent(text, ls, le), e = line_trim_end(text, ls, le);
    if (i - ls > 3 || i >= e || (text[i] != '=' && text[i] != '-'))
        return 0;
    for (size_t k = i; k < e; k++)
        if (text[k] != text[i])
            return 0;
    return text[i] == '=' ? 1 : 2;
}

void chunk_md_free(struct ChunkMd *md)
{
    free(md->heads);
    free(md->marks);
    free(md->tables);
    memset(md, 0, sizeof *md);
}

int chunk_md_scan(const char *text, size_t len, struct ChunkMd *md)
{
    memset(md, 0, sizeof *md);
    size_t hcap = 0, mcap = 0, tcap = 0;
    char fence = 0;
    size_t fence_len = 0;
    /* the caption candidate: the last non-blank line outside code, when it is a paragraph of
     * one plain line (after a blank or block line); prev_plain: the line before was plain */
    size_t cand = 0, cand_end = 0;
    int cand_ok = 0, prev_plain = 0;
    /* a setext heading: the line before, when it was a paragraph's first (and one line) */
    size_t para = 0, para_at = 0, para_end = 0;
    int para_ok = 0;
    for (size_t ls = 0; ls < len;) {
        size_t le = line_end(text, len, ls);
        char ch = 0;
        size_t run = fence_run(text, ls, le, &ch);
        int blank = line_trim_end(text, ls, le) == ls;
        if (fence) {
            if (run >= fence_len && ch == fence) {
                size_t k = ls;
                while (k < le && (text[k] == ' ' || text[k] == '`' || text[k] == '~'))
                    k++;
                while (k < le && chunk_is_ws((unsigned char)text[k]))
                    k++;
                if (k == le)
                    fence = 0;
            }
            cand_ok = 0;
            prev_plain = 1; /* code lines, as plain lines, start no unit after them */
        } else if (run) {
            fence = ch;
            fence_len = run;
            cand_ok = 0;
            prev_plain = 1;
        } else if (blank) {
            prev_plain = 0;
        } else if (chunk_page_marker(text, ls, le)) {
            if (grow((void **)&md->marks, &mcap, md->n_marks, sizeof *md->marks))
                goto nomem;
            md->marks[md->n_marks++] = (struct MdMark){ ls, le, chunk_page_marker(text, ls, le) };
            cand_ok = prev_plain = 0;
        } else if (pipe_row(text, ls, le) && le < len &&
                   separator_row(text, le + 1, line_end(text, len, le + 1))) {
            if (grow((void **)&md->tables, &tcap, md->n_tables, sizeof *md->tables))
                goto nomem;
            struct MdTable t;
            t.head = indent(text, ls, le);
            t.head_end = line_trim_end(text, t.head, le);
            t.cap = t.cap_end = t.start = t.head;
            if (cand_ok) {
                t.start = t.cap = cand;
                t.cap_end = cand_end;
            }
            size_t r = line_end(text, len, le + 1); /* the separator's end */
            t.end = line_trim_end(text, le + 1, r);
            t.body = r < len ? indent(text, r + 1, line_end(text, len, r + 1)) : len;
            while (r < len && pipe_row(text, r + 1, line_end(text, len, r + 1))) {
                size_t re = line_end(text, len, r + 1);
                t.end = line_trim_end(text, r + 1, re);
                r = re;
            }
            if (t.body > t.end)
                t.body = t.end;
            md->tables[md->n_tables++] = t;
            cand_ok = prev_plain = 0;
            le = r;
        } else {
            struct ChunkHeading h = atx_heading(text, ls, le);
            uint32_t setext = para_ok ? setext_level(text, ls, le) : 0;
            if (setext && para_end - para <= UINT32_MAX) {
                if (grow((void **)&md->heads, &hcap, md->n_heads, sizeof *md->heads))
                    goto nomem;
                md->heads[md->n_heads++] = (struct MdHead){
                    para_at, { para, (uint32_t)(para_end - para), setext } };
                cand_ok = prev_plain = para_ok = 0;
            } else if (h.level) {
                if (grow((void **)&md->heads, &hcap, md->n_heads, sizeof *md->heads))
                    goto nomem;
                md->heads[md->n_heads++] = (struct MdHead){ indent(text, ls, le), h };
                cand_ok = prev_plain = 0;
            } else if (chunk_line_is_block(text, len, ls)) {
                cand_ok = prev_plain = 0;
            } else {
                cand = indent(text, ls, le);
                while (cand < le && chunk_is_ws((unsigned char)text[cand]))
                    cand++;
                cand_end = line_trim_end(text, cand, le);
                cand_ok = !prev_plain && cand_end - cand <= CHUNK_MAX_CAPTION_BYTES;
                para_ok = !prev_plain;
                para_at = indent(text, ls, le);
                para = cand;
                para_end = cand_end;
                prev_plain = 1;
                ls = le + 1;
                continue;
            }
        }
        para_ok = 0;
        ls = le + 1;
    }
    return RET_OK;
nomem:
    chunk_md_free(md);
    return RET_ENOMEM;
}

/* Append a part of a heading path: the separator unless it is the first, s[0..l) with newlines
 * and tabs as spaces, then suffix; cut at a character boundary to limit. */
static void path_part(char *out, size_t *n, size_t limit, const char *s, size_t l, const char *suffix)
{
    size_t sep = strlen(CHUNK_PATH_SEPARATOR), sl = strlen(suffix);
    if (*n >= limit)
        return;
    if (*n) {
        if (*n + sep > limit)
            return;
        memcpy(out + *n, CHUNK_PATH_SEPARATOR, sep);
        *n += sep;
    }
    if (*n + l > limit) {
        l = limit - *n;
        while (l > 0 && ((unsigned char)s[l] & 0xC0) == 0x80)
            l--;
        sl = 0;
    } else if (*n + l + sl > limit) {
        sl = 0;
    }
    for (size_t k = 0; k < l; k++) {
        char c = s[k];
        out[(*n)++] = (c == '\n' || c == '\r' || c == '\t') ? ' ' : c;
    }
    memcpy(out + *n, suffix, sl);
    *n += sl;
}

size_t chunk_heading_path(const char *text, const struct ChunkSpan *span, const char *title,
                          size_t title_len, char *out, size_t cap)
{
    if (cap == 0)
        return 0;
    size_t limit = cap - 1 < CHUNK_MAX_PATH_BYTES ? cap - 1 : CHUNK_MAX_PATH_BYTES;
    size_t n = 0, sep = strlen(CHUNK_PATH_SEPARATOR);
    uint32_t first = 0;
    if (span->n_heads && span->heads[0].len == title_len &&
        memcmp(text + span->heads[0].start, title, title_len) == 0)
        first = 1;
    for (uint32_t i = first; i < span->n_heads && n < limit; i++)
        path_part(out, &n, limit, text + span->heads[i].start, span->heads[i].len, "");
    if (span->table_head_len) {
        if (span->table_cap_len)
            path_part(out, &n, limit, text + span->table_cap, span->table_cap_len, CHUNK_TABLE_CONT);
        path_part(out, &n, limit, text + span->table_head, span->table_head_len,
                  span->table_cap_len ? "" : CHUNK_TABLE_CONT);
    }
    while (n > 0 && out[n - 1] == ' ')
        n--;
    if (n >= sep && memcmp(out + n - (sep - 1), CHUNK_PATH_SEPARATOR, sep - 1) == 0)
        n -= sep - 1; /* a cut left a dangling separator */
    while (n > 0 && out[n - 1] == ' ')
        n--;
    out[n] = 0;
    return n;
}

void chunk_set_pages(struct ChunkSpan *cs, size_t n, const struct MdMark *m, size_t nm)
{
    size_t k = 0; /* markers before k start at or before the current chunk's start */
    for (size_t i = 0; i < n && nm; i++) {
        struct ChunkSpan *c = &cs[i];
        while (k > 0 && m[k - 1].at > c->start) /* overlap: a chunk may start before the last */
            k--;
        while (k < nm && m[k].at <= c->start)
            k++;
        uint32_t first = k ? m[k - 1].page : 0, last = first;
        for (size_t j = k; j < nm && m[j].at < c->end; j++)
            if (m[j].end < c->end) { /* text after it in the chunk */
                if (!first)
                    first = m[j].page;
                last = m[j].page;
            }
        c->page_first = first;
        c->page_last = first ? last : 0;
    }
}

int chunk_text_pages(const char *text, size_t len, uint32_t *first, uint32_t *last)
{
    struct ChunkMd md;
    struct ChunkSpan c = { 0 };
    c.end = len;
    int rc = chunk_md_scan(text, len, &md);
    if (rc == RET_OK) {
        while (c.end > 0 && chunk_is_ws((unsigned char)text[c.end - 1]))
            c.end--;
        chunk_set_pages(&c, 1, md.marks, md.n_marks);
    }
    *first = c.page_first;
    *last = c.page_last;
    chunk_md_free(&md);
    return rc;
}
