/* The Markdown writer of diffrag-extract (extract.h): collapsed inline text, blocks, headings,
 * table rows, all within an output limit. */
#include <stdlib.h>
#include <string.h>

#include "clients/extract/extract.h"

void md_init(struct Md *m, size_t max)
{
    memset(m, 0, sizeof *m);
    m->max = max;
    m->line_start = 1;
    m->indent = "";
}

void md_free(struct Md *m)
{
    free(m->p);
    m->p = NULL;
    m->n = m->cap = 0;
}

void md_raw(struct Md *m, const char *s, size_t n)
{
    if (m->over || m->oom || !n)
        return;
    if (m->n + n > m->max) {
        m->over = 1;
        return;
    }
    if (m->n + n + 1 > m->cap) {
        size_t cap = m->cap ? m->cap : 4096;
        while (cap < m->n + n + 1)
            cap *= 2;
        char *p = realloc(m->p, cap);
        if (!p) {
            m->oom = 1;
            return;
        }
        m->p = p;
        m->cap = cap;
    }
    memcpy(m->p + m->n, s, n);
    m->n += n;
    m->p[m->n] = 0;
    m->line_start = s[n - 1] == '\n';
}

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* A no-break space (U+00A0) is white space to a reader too. */
static size_t space_len(const char *s, size_t n)
{
    if (is_space(s[0]))
        return 1;
    if (n >= 2 && (unsigned char)s[0] == 0xC2 && (unsigned char)s[1] == 0xA0)
        return 2;
    return 0;
}

void md_text(struct Md *m, const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        size_t sp = space_len(s + i, n - i);
        if (sp) {
            m->space = 1;
            i += sp;
            continue;
        }
        size_t j = i;
        while (j < n && !space_len(s + j, n - j))
            j++;
        if (m->line_start) {
            md_raw(m, m->indent, strlen(m->indent));
            if (s[i] == '#' || s[i] == '>')
                md_raw(m, "\\", 1);
            m->line_start = 0;
        } else if (m->space) {
            md_raw(m, " ", 1);
        }
        m->space = 0;
        md_raw(m, s + i, j - i);
        i = j;
    }
}

void md_newline(struct Md *m)
{
    if (!m->line_start)
        md_raw(m, "\n", 1);
    m->line_start = 1;
    m->space = 0;
}

void md_block(struct Md *m)
{
    md_newline(m);
    if (m->n && !(m->n >= 2 && m->p[m->n - 1] == '\n' && m->p[m->n - 2] == '\n'))
        md_raw(m, "\n", 1);
}

void md_heading(struct Md *m, int level)
{
    static const char hashes[] = "###### ";
    md_block(m);
    if (level < 1)
        level = 1;
    if (level > 6)
        level = 6;
    md_raw(m, hashes + 6 - level, (size_t)level + 1);
    m->line_start = 0;
    m->space = 0;
}

char *md_cell(const struct Md *m)
{
    const char *s = m->p ? m->p : "";
    size_t n = m->n, o = 0;
    char *c = malloc(2 * n + 1);
    if (!c)
        return NULL;
    int space = 0;
    for (size_t i = 0; i < n; i++) {
        if (is_space(s[i])) {
            space = o > 0;
            continue;
        }
        if (space)
            c[o++] = ' ';
        space = 0;
        if (s[i] == '|')
            c[o++] = '\\';
        c[o++] = s[i];
    }
    c[o] = 0;
    return c;
}

void md_table_row(struct Md *m, char *const *cells, size_t n, size_t cols, int header)
{
    md_newline(m);
    for (size_t i = 0; i < cols; i++) {
        md_raw(m, i ? " | " : "| ", i ? 3 : 2);
        const char *c = i < n && cells[i] ? cells[i] : "";
        md_raw(m, c, strlen(c));
    }
    md_raw(m, " |\n", 3);
    if (header) {
        for (size_t i = 0; i < cols; i++)
            md_raw(m, "|---", 4);
        md_raw(m, "|\n", 2);
    }
    m->line_start = 1;
    m->space = 0;
}

char *md_one_line(const char *s, size_t n)
{
    struct Md m;
    md_init(&m, n + 1);
    md_text(&m, s, n);
    char *out = m.p ? m.p : strdup("");
    if (out && out[0] == '\\' && (out[1] == '#' || out[1] == '>'))
        memmove(out, out + 1, strlen(out));
    return out;
}
