/* HTML to Markdown for diffrag-extract, over gumbo (an HTML5 parser: entities decoded, broken
 * markup repaired as browsers do): the <title>, headings, paragraphs, lists, tables with their
 * captions and preformatted text; scripts, styles, navigation, asides, footers, forms' controls
 * and embedded objects are left out. */
#include <gumbo.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clients/extract/extract.h"

/* Deeper than this, an element's text is taken without its structure (iteratively), so a page
 * of nested tags cannot exhaust the stack. */
#define HTML_MAX_DEPTH 200

struct Html {
    struct Md *m;
    char *title, *first_h1;
    int in_li;      /* inside a list item: blocks flow as text */
    int pre;        /* inside <pre>: white space kept */
    char indent[64];
    int oom;
};

static void walk(struct Html *h, const GumboNode *n, int depth);

static int dropped(GumboTag t)
{
    switch (t) {
    case GUMBO_TAG_SCRIPT: case GUMBO_TAG_STYLE: case GUMBO_TAG_NOSCRIPT: case GUMBO_TAG_TEMPLATE:
    case GUMBO_TAG_NAV: case GUMBO_TAG_ASIDE: case GUMBO_TAG_FOOTER: case GUMBO_TAG_BUTTON:
    case GUMBO_TAG_SELECT: case GUMBO_TAG_TEXTAREA: case GUMBO_TAG_IFRAME: case GUMBO_TAG_SVG:
    case GUMBO_TAG_CANVAS: case GUMBO_TAG_OBJECT: case GUMBO_TAG_EMBED: case GUMBO_TAG_MENU:
    case GUMBO_TAG_DATALIST: case GUMBO_TAG_NOFRAMES: case GUMBO_TAG_NOEMBED:
        return 1;
    default:
        return 0;
    }
}

static int block(GumboTag t)
{
    switch (t) {
    case GUMBO_TAG_P: case GUMBO_TAG_DIV: case GUMBO_TAG_SECTION: case GUMBO_TAG_ARTICLE:
    case GUMBO_TAG_MAIN: case GUMBO_TAG_HEADER: case GUMBO_TAG_ADDRESS: case GUMBO_TAG_BLOCKQUOTE:
    case GUMBO_TAG_FIGURE: case GUMBO_TAG_FIGCAPTION: case GUMBO_TAG_DT: case GUMBO_TAG_DD:
    case GUMBO_TAG_HR: case GUMBO_TAG_FORM: case GUMBO_TAG_FIELDSET:
    case GUMBO_TAG_LEGEND: case GUMBO_TAG_DETAILS: case GUMBO_TAG_SUMMARY: case GUMBO_TAG_BODY:
    case GUMBO_TAG_HGROUP: case GUMBO_TAG_CENTER:
        return 1;
    default:
        return 0;
    }
}

static void end_block(struct Html *h)
{
    if (h->in_li)
        h->m->space = 1;
    else
        md_block(h->m);
}

/* The text below n, in document order, without structure (an explicit stack: any depth). */
static void flat_text(struct Html *h, const GumboNode *root)
{
    size_t cap = 64, top = 0;
    const GumboNode **st = malloc(cap * sizeof *st);
    if (!st) {
        h->oom = 1;
        return;
    }
    st[top++] = root;
    while (top) {
        const GumboNode *n = st[--top];
        if (n->type == GUMBO_NODE_TEXT || n->type == GUMBO_NODE_WHITESPACE ||
            n->type == GUMBO_NODE_CDATA) {
            md_text(h->m, n->v.text.text, strlen(n->v.text.text));
            continue;
        }
        if (n->type != GUMBO_NODE_ELEMENT || dropped(n->v.element.tag))
            continue;
        const GumboVector *c = &n->v.element.children;
        if (top + c->length > cap) {
            size_t nc = cap;
            while (nc < top + c->length)
                nc *= 2;
            const GumboNode **p = realloc(st, nc * sizeof *p);
            if (!p) {
                h->oom = 1;
                break;
            }
            st = p;
            cap = nc;
        }
        for (unsigned i = c->length; i-- > 0;) /* pushed last first: popped in order */
            st[top++] = c->data[i];
        h->m->space = 1;
    }
    free(st);
}

static void children(struct Html *h, const GumboNode *n, int depth)
{
    const GumboVector *c = &n->v.element.children;
    for (unsigned i = 0; i < c->length; i++)
        walk(h, c->data[i], depth + 1);
}

/* The collapsed text of n's children into a string (a title, a cell). */
static char *text_of(struct Html *h, const GumboNode *n, int depth)
{
    struct Md sub, *saved = h->m;
    int saved_li = h->in_li;
    md_init(&sub, saved->max);
    h->m = &sub;
    h->in_li = 1; /* blocks inside flow as text */
    children(h, n, depth);
    h->m = saved;
    h->in_li = saved_li;
    char *s = md_cell(&sub);
    if (sub.oom || !s)
        h->oom = 1;
    md_free(&sub);
    return s;
}

struct Rows {
    struct Row { char **cells; size_t n; } *r;
    size_t n, cols;
};

static void add_row(struct Html *h, const GumboNode *tr, int depth, struct Rows *rows)
{
    const GumboVector *c = &tr->v.element.children;
    char **cells = calloc(c->length + 1, sizeof *cells);
    size_t n = 0;
    struct Row *r = realloc(rows->r, (rows->n + 1) * sizeof *r);
    if (r)
        rows->r = r;
    if (!cells || !r) {
        free(cells);
        h->oom = 1;
        return;
    }
    for (unsigned i = 0; i < c->length; i++) {
        const GumboNode *td = c->data[i];
        if (td->type != GUMBO_NODE_ELEMENT ||
            (td->v.element.tag != GUMBO_TAG_TD && td->v.element.tag != GUMBO_TAG_TH))
            continue;
        cells[n++] = text_of(h, td, depth + 1);
    }
    rows->r[rows->n++] = (struct Row){ cells, n };
    if (n > rows->cols)
        rows->cols = n;
}

static void table(struct Html *h, const GumboNode *t, int depth)
{
    struct Rows rows = { 0 };
    char *caption = NULL;
    const GumboVector *c = &t->v.element.children;
    for (unsigned i = 0; i < c->length && !h->oom; i++) {
        const GumboNode *k = c->data[i];
        if (k->type != GUMBO_NODE_ELEMENT)
            continue;
        GumboTag tag = k->v.element.tag;
        if (tag == GUMBO_TAG_CAPTION && !caption) {
            caption = text_of(h, k, depth + 1);
        } else if (tag == GUMBO_TAG_TR) {
            add_row(h, k, depth + 1, &rows);
        } else if (tag == GUMBO_TAG_THEAD || tag == GUMBO_TAG_TBODY || tag == GUMBO_TAG_TFOOT) {
            const GumboVector *g = &k->v.element.children;
            for (unsigned j = 0; j < g->length && !h->oom; j++) {
                const GumboNode *tr = g->data[j];
                if (tr->type == GUMBO_NODE_ELEMENT && tr->v.element.tag == GUMBO_TAG_TR)
                    add_row(h, tr, depth + 2, &rows);
            }
        }
    }
    md_block(h->m);
    if (caption && caption[0]) {
        md_text(h->m, caption, strlen(caption));
        md_block(h->m);
    }
    for (size_t i = 0; i < rows.n; i++) {
        if (rows.cols)
            md_table_row(h->m, rows.r[i].cells, rows.r[i].n, rows.cols, i == 0);
        for (size_t j = 0; j < rows.r[i].n; j++)
            free(rows.r[i].cells[j]);
        free(rows.r[i].cells);
    }
    md_block(h->m);
    free(rows.r);
    free(caption);
}

static void list(struct Html *h, const GumboNode *n, int depth)
{
    int ordered = n->v.element.tag == GUMBO_TAG_OL;
    size_t il = strlen(h->indent);
    int nested = h->in_li > 0;
    if (!nested)
        md_block(h->m);
    h->in_li++;
    unsigned num = 1;
    const GumboVector *c = &n->v.element.children;
    for (unsigned i = 0; i < c->length; i++) {
        const GumboNode *li = c->data[i];
        if (li->type != GUMBO_NODE_ELEMENT || li->v.element.tag != GUMBO_TAG_LI) {
            walk(h, li, depth + 1);
            continue;
        }
        char mark[32];
        int ml = ordered ? snprintf(mark, sizeof mark, "%u. ", num++) : snprintf(mark, sizeof mark, "- ");
        md_newline(h->m);
        md_raw(h->m, h->indent, il);
        md_raw(h->m, mark, (size_t)ml);
        h->m->line_start = 0;
        h->m->space = 0;
        if (il + 3 < sizeof h->indent)
            memcpy(h->indent + il, "   ", 4); /* nested lists go under the item's text */
        children(h, li, depth + 1);
        h->indent[il] = 0;
    }
    h->in_li--;
    if (nested)
        md_newline(h->m);
    else
        md_block(h->m);
}

/* A definition list's items, each term with its definition in one paragraph ("-k, --keep: Keep
 * input files."), so that a chunk never ends between them: consecutive terms are joined by
 * commas, a term's first definition follows a colon, a further one starts a line. A <div>
 * that groups items (HTML5) is read through. *prev: what came last, 0 other, 1 a term, 2 a
 * definition. */
static void dlist(struct Html *h, const GumboNode *n, int depth, int *prev)
{
    const GumboVector *c = &n->v.element.children;
    for (unsigned i = 0; i < c->length && !h->oom && !h->m->over; i++) {
        const GumboNode *k = c->data[i];
        GumboTag t = k->type == GUMBO_NODE_ELEMENT ? k->v.element.tag : GUMBO_TAG_UNKNOWN;
        if (k->type == GUMBO_NODE_WHITESPACE || k->type == GUMBO_NODE_COMMENT)
            continue;
        if (t == GUMBO_TAG_DIV && depth < HTML_MAX_DEPTH) {
            dlist(h, k, depth + 1, prev);
            continue;
        }
        if (t != GUMBO_TAG_DT && t != GUMBO_TAG_DD) {
            end_block(h);
            walk(h, k, depth + 1);
            *prev = 0;
            continue;
        }
        if (*prev == 1) {
            h->m->space = 0;
            md_text(h->m, t == GUMBO_TAG_DT ? "," : ":", 1);
            h->m->space = 1;
        } else if (t == GUMBO_TAG_DD && *prev == 2) {
            md_newline(h->m);
        } else {
            end_block(h);
        }
        h->in_li++; /* blocks inside flow as text */
        children(h, k, depth + 1);
        h->in_li--;
        *prev = t == GUMBO_TAG_DT ? 1 : 2;
    }
}

static void pre(struct Html *h, const GumboNode *n, int depth)
{
    md_block(h->m);
    md_raw(h->m, "```\n", 4);
    h->pre++;
    children(h, n, depth);
    h->pre--;
    if (h->m->n && h->m->p[h->m->n - 1] != '\n')
        md_raw(h->m, "\n", 1);
    md_raw(h->m, "```", 3);
    h->m->line_start = 0;
    md_block(h->m);
}

static void head(struct Html *h, const GumboNode *n, int depth)
{
    const GumboVector *c = &n->v.element.children;
    for (unsigned i = 0; i < c->length; i++) {
        const GumboNode *k = c->data[i];
        if (k->type == GUMBO_NODE_ELEMENT && k->v.element.tag == GUMBO_TAG_TITLE && !h->title)
            h->title = text_of(h, k, depth + 1);
    }
}

static void walk(struct Html *h, const GumboNode *n, int depth)
{
    if (h->oom || h->m->over)
        return;
    if (n->type == GUMBO_NODE_TEXT || n->type == GUMBO_NODE_WHITESPACE ||
        n->type == GUMBO_NODE_CDATA) {
        const char *t = n->v.text.text;
        if (h->pre) {
            md_raw(h->m, t, strlen(t));
            h->m->line_start = 0;
        } else {
            md_text(h->m, t, strlen(t));
        }
        return;
    }
    if (n->type != GUMBO_NODE_ELEMENT && n->type != GUMBO_NODE_DOCUMENT)
        return;
    if (n->type == GUMBO_NODE_DOCUMENT) {
        children(h, n, depth);
        return;
    }
    GumboTag t = n->v.element.tag;
    if (dropped(t))
        return;
    if (depth > HTML_MAX_DEPTH) {
        flat_text(h, n);
        return;
    }
    if (t == GUMBO_TAG_HEAD) {
        head(h, n, depth);
    } else if (t == GUMBO_TAG_TITLE) {
        if (!h->title)
            h->title = text_of(h, n, depth);
    } else if (t >= GUMBO_TAG_H1 && t <= GUMBO_TAG_H6 && !h->in_li && !h->pre) {
        char *s = text_of(h, n, depth);
        if (s && s[0]) {
            md_heading(h->m, 1 + (int)(t - GUMBO_TAG_H1));
            md_text(h->m, s, strlen(s));
            md_block(h->m);
            if (t == GUMBO_TAG_H1 && !h->first_h1) {
                h->first_h1 = s;
                s = NULL;
            }
        }
        free(s);
    } else if (t == GUMBO_TAG_UL || t == GUMBO_TAG_OL) {
        list(h, n, depth);
    } else if (t == GUMBO_TAG_DL) {
        int prev = 0;
        end_block(h);
        dlist(h, n, depth, &prev);
        end_block(h);
    } else if (t == GUMBO_TAG_TABLE) {
        table(h, n, depth);
    } else if (t == GUMBO_TAG_PRE && !h->pre && !h->in_li) {
        pre(h, n, depth);
    } else if (t == GUMBO_TAG_BR) {
        if (h->pre)
            md_raw(h->m, "\n", 1);
        else if (h->in_li)
            h->m->space = 1;
        else
            md_newline(h->m);
    } else if (t == GUMBO_TAG_IMG) {
        /* an image's words: its alt text, when it has one */
        GumboAttribute *alt = gumbo_get_attribute(&n->v.element.attributes, "alt");
        if (alt && alt->value[0]) {
            h->m->space = 1;
            md_text(h->m, alt->value, strlen(alt->value));
            h->m->space = 1;
        }
    } else if (block(t) || t == GUMBO_TAG_LI || t == GUMBO_TAG_TR || t == GUMBO_TAG_CAPTION) {
        end_block(h);
        children(h, n, depth);
        end_block(h);
    } else {
        int cellish = t == GUMBO_TAG_TD || t == GUMBO_TAG_TH;
        if (cellish)
            h->m->space = 1;
        children(h, n, depth);
        if (cellish)
            h->m->space = 1;
    }
}

int extract_html(const char *buf, size_t len, struct Md *out, char **title, char *err,
                 size_t errlen)
{
    char label[64], *utf8 = NULL;
    size_t utf8_len = 0;
    if (html_to_utf8(buf, len, &utf8, &utf8_len, label, sizeof label)) {
        snprintf(err, errlen, "out of memory converting the HTML from %s", label);
        return EXTRACT_ENOMEM;
    }
    if (utf8) {
        buf = utf8;
        len = utf8_len;
    }
    if (len >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3)) { /* a byte order mark is not text */
        buf += 3;
        len -= 3;
    }
    GumboOptions opt = kGumboDefaultOptions;
    opt.max_errors = 0; /* the parse errors are not reported: keep none */
    GumboOutput *g = gumbo_parse_with_options(&opt, buf, len);
    free(utf8);
    if (!g) {
        snprintf(err, errlen, "out of memory parsing the HTML");
        return EXTRACT_ENOMEM;
    }
    struct Html h = { .m = out };
    walk(&h, g->document, 0);
    gumbo_destroy_output(&opt, g);
    md_block(out);
    if (h.oom || out->oom) {
        free(h.title);
        free(h.first_h1);
        snprintf(err, errlen, "out of memory");
        return EXTRACT_ENOMEM;
    }
    if (h.title && !h.title[0]) {
        free(h.title);
        h.title = NULL;
    }
    *title = h.title ? h.title : h.first_h1;
    if (h.title)
        free(h.first_h1);
    return EXTRACT_OK;
}
