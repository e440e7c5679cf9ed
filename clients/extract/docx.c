/* DOCX (Office Open XML) to Markdown for diffrag-extract, over libzip and libxml2: the body of
 * word/document.xml in order: paragraphs (a Title or Heading1..6 style, by id or by the name
 * word/styles.xml gives it, becomes a heading; list paragraphs items, "1. " where
 * word/numbering.xml numbers their level (counted per abstract list, as Word does) and "- "
 * where it bullets it, indented by level),
 * tables as Markdown rows; the title from docProps/core.xml (dc:title). Zip entries are checked before they are
 * inflated (uncompressed size, compression ratio) and counted while they are. */
#include <errno.h>
#include <libxml/parser.h>
#include <libxml/tree.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <zip.h>

#include "clients/extract/extract.h"

#define W_NS "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
/* Entries smaller than this are not held to the ratio (small XML compresses well). */
#define RATIO_FLOOR (1u << 20)
/* Nesting of tables within tables followed; deeper ones give their text flat. */
#define DOCX_MAX_DEPTH 64

/* List levels followed (Word's are 0..8). */
#define DOCX_LIST_LEVELS 9

/* An abstract list of numbering.xml (a w:abstractNum): each level's format (numbered, or a
 * bullet) and start, and the number its last item took. Every list (w:num) made from it
 * shares these counts, as Word numbers them: a second list of the same abstract list goes on
 * where the first stopped unless it overrides the level's start. */
struct AbsList {
    long abstract_id;
    size_t order;
    unsigned char numbered[DOCX_LIST_LEVELS], started[DOCX_LIST_LEVELS];
    long start[DOCX_LIST_LEVELS], cur[DOCX_LIST_LEVELS];
};

/* A list (a w:num): its abstract list, and per level what its w:lvlOverride says: a start
 * that restarts the level at the list's first item there (w:startOverride, or the w:start of
 * a w:lvl given in the override), and a format (w:numFmt of that w:lvl). */
struct NumList {
    long num_id, abstract_id;
    size_t order;         /* its place in numbering.xml: of two lists with one id, the first */
    long abs;             /* index of its abstract list in Docx.abs, -1: none */
    unsigned char has_start[DOCX_LIST_LEVELS], restarted[DOCX_LIST_LEVELS];
    signed char numbered[DOCX_LIST_LEVELS];   /* -1: the abstract list's format */
    long start[DOCX_LIST_LEVELS];
};

struct Docx {
    struct Md *m;
    char **style_id;  /* heading levels by style id, from styles.xml: id -> level */
    int *style_level;
    size_t n_styles;
    struct NumList *lists;
    size_t n_lists;
    struct AbsList *abs;
    size_t n_abs;
    char *first_title;
    int oom;
};

/* Reads entry `name` whole; 0, or an EXTRACT_* status with err set. ENOENT-like absence:
 * *out NULL and 0 when optional. */
static int read_entry(zip_t *z, const char *name, const struct ExtractLimits *lim, int optional,
                      char **out, size_t *len, char *err, size_t errlen)
{
    *out = NULL;
    *len = 0;
    zip_stat_t st;
    zip_stat_init(&st);
    if (zip_stat(z, name, 0, &st)) {
        if (optional)
            return EXTRACT_OK;
        snprintf(err, errlen, "a zip archive without %s: not a DOCX document", name);
        return EXTRACT_EBAD;
    }
    if (!(st.valid & ZIP_STAT_SIZE) || !(st.valid & ZIP_STAT_COMP_SIZE)) {
        snprintf(err, errlen, "%s: its size is not recorded in the archive", name);
        return EXTRACT_EBAD;
    }
    if (st.size > lim->max_entry) {
        snprintf(err, errlen, "%s unpacks to %.1f MiB, over the %.0f MiB an entry may have "
                 "(a zip bomb?)", name, st.size / 1048576.0, lim->max_entry / 1048576.0);
        return EXTRACT_ELIMIT;
    }
    if (st.size >= RATIO_FLOOR && (st.comp_size == 0 || st.size / (double)st.comp_size > lim->max_ratio)) {
        snprintf(err, errlen, "%s is compressed %.0f to 1, over the %.0f to 1 allowed (a zip "
                 "bomb?)", name, st.comp_size ? st.size / (double)st.comp_size : 0.0,
                 lim->max_ratio);
        return EXTRACT_ELIMIT;
    }
    zip_file_t *f = zip_fopen_index(z, st.index, 0);
    if (!f) {
        snprintf(err, errlen, "%s: %s", name, zip_strerror(z));
        return EXTRACT_EBAD;
    }
    size_t cap = (size_t)st.size, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) {
        zip_fclose(f);
        snprintf(err, errlen, "out of memory");
        return EXTRACT_ENOMEM;
    }
    for (;;) {
        /* one byte more than declared is read to catch an entry longer than it says */
        zip_int64_t r = zip_fread(f, buf + n, cap + 1 - n);
        if (r < 0) {
            snprintf(err, errlen, "%s: damaged (%s)", name, zip_error_strerror(zip_file_get_error(f)));
            zip_fclose(f);
            free(buf);
            return EXTRACT_EBAD;
        }
        if (r == 0)
            break;
        n += (size_t)r;
        if (n > cap) {
            snprintf(err, errlen, "%s holds more than the %zu bytes the archive records", name, cap);
            zip_fclose(f);
            free(buf);
            return EXTRACT_EBAD;
        }
    }
    zip_fclose(f);
    buf[n] = 0;
    *out = buf;
    *len = n;
    return EXTRACT_OK;
}

static xmlDocPtr parse_xml(const char *buf, size_t len)
{
    /* no network, no DTD loading, no entity substitution */
    return xmlReadMemory(buf, (int)len, NULL, NULL, XML_PARSE_NONET | XML_PARSE_NOERROR |
                         XML_PARSE_NOWARNING);
}

static int is_w(const xmlNode *n, const char *name)
{
    return n->type == XML_ELEMENT_NODE && n->ns && n->ns->href &&
           !strcmp((const char *)n->ns->href, W_NS) && !strcmp((const char *)n->name, name);
}

static const xmlNode *child_w(const xmlNode *n, const char *name)
{
    for (const xmlNode *c = n ? n->children : NULL; c; c = c->next)
        if (is_w(c, name))
            return c;
    return NULL;
}

/* w:val (in the w namespace, or without one). malloc'd by libxml2. */
static xmlChar *w_val(const xmlNode *n)
{
    if (!n)
        return NULL;
    xmlChar *v = xmlGetNsProp(n, (const xmlChar *)"val", (const xmlChar *)W_NS);
    return v ? v : xmlGetProp(n, (const xmlChar *)"val");
}

/* A heading level from a style's id or name: Title 1, "heading N"/HeadingN N; else 0. */
static int level_of_name(const char *s)
{
    if (!strcasecmp(s, "title"))
        return 1;
    if (strncasecmp(s, "heading", 7))
        return 0;
    s += 7;
    if (*s == ' ')
        s++;
    return s[0] >= '1' && s[0] <= '6' && !s[1] ? s[0] - '0' : 0;
}

static void load_styles(struct Docx *d, const char *buf, size_t len)
{
    xmlDocPtr doc = parse_xml(buf, len);
    const xmlNode *root = doc ? xmlDocGetRootElement(doc) : NULL;
    for (const xmlNode *s = root ? root->children : NULL; s && !d->oom; s = s->next) {
        if (!is_w(s, "style"))
            continue;
        xmlChar *id = xmlGetNsProp(s, (const xmlChar *)"styleId", (const xmlChar *)W_NS);
        xmlChar *name = w_val(child_w(s, "name"));
        int level = name ? level_of_name((const char *)name) : 0;
        if (!level) { /* an outline level in the style's paragraph properties */
            xmlChar *ol = w_val(child_w(child_w(s, "pPr"), "outlineLvl"));
            if (ol && ol[0] >= '0' && ol[0] <= '5' && !ol[1])
                level = ol[0] - '0' + 1;
            xmlFree(ol);
        }
        if (id && level) {
            char **ids = realloc(d->style_id, (d->n_styles + 1) * sizeof *ids);
            int *lv = realloc(d->style_level, (d->n_styles + 1) * sizeof *lv);
            if (ids)
                d->style_id = ids;
            if (lv)
                d->style_level = lv;
            char *copy = strdup((const char *)id);
            if (!ids || !lv || !copy) {
                free(copy);
                d->oom = 1;
            } else {
                d->style_id[d->n_styles] = copy;
                d->style_level[d->n_styles++] = level;
            }
        }
        xmlFree(id);
        xmlFree(name);
    }
    if (doc)
        xmlFreeDoc(doc);
}

/* A decimal w:val, or def when absent or not a number. */
static long w_long(const xmlNode *n, long def)
{
    xmlChar *v = w_val(n);
    char *end = NULL;
    long x = v ? strtol((const char *)v, &end, 10) : def;
    if (v && (end == (char *)v || *end))
        x = def;
    xmlFree(v);
    return x;
}

/* Whether a w:lvl numbers its items: unless its w:numFmt is bullet or none (-1: no numFmt). */
static int lvl_numbered(const xmlNode *lv)
{
    const xmlNode *f = child_w(lv, "numFmt");
    if (!f)
        return -1;
    xmlChar *fmt = w_val(f);
    int numbered = fmt && strcmp((const char *)fmt, "bullet") && strcmp((const char *)fmt, "none");
    xmlFree(fmt);
    return numbered;
}

static long lvl_index(const xmlNode *lv)
{
    xmlChar *il = xmlGetNsProp(lv, (const xmlChar *)"ilvl", (const xmlChar *)W_NS);
    long k = il ? strtol((const char *)il, NULL, 10) : -1;
    xmlFree(il);
    return k >= 0 && k < DOCX_LIST_LEVELS ? k : -1;
}

static int cmp_long(long x, long y) { return (x > y) - (x < y); }
static int cmp_size(size_t x, size_t y) { return (x > y) - (x < y); }

static int cmp_abs_id(const void *x, const void *y)
{
    return cmp_long(((const struct AbsList *)x)->abstract_id, ((const struct AbsList *)y)->abstract_id);
}

static int cmp_abs(const void *x, const void *y)
{
    int c = cmp_abs_id(x, y);
    return c ? c : cmp_size(((const struct AbsList *)x)->order, ((const struct AbsList *)y)->order);
}

static int cmp_num_id(const void *x, const void *y)
{
    return cmp_long(((const struct NumList *)x)->num_id, ((const struct NumList *)y)->num_id);
}

static int cmp_num(const void *x, const void *y)
{
    int c = cmp_num_id(x, y);
    return c ? c : cmp_size(((const struct NumList *)x)->order, ((const struct NumList *)y)->order);
}

/* Keeps the first element of each run that cmp_id finds equal in a sorted array of n; returns
 * how many are left. */
static size_t keep_first(void *base, size_t n, size_t size, int (*cmp_id)(const void *, const void *))
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        char *x = (char *)base + i * size;
        if (m && !cmp_id((char *)base + (m - 1) * size, x))
            continue;
        if (m != i)
            memcpy((char *)base + m * size, x, size);
        m++;
    }
    return m;
}

static void *grow(struct Docx *d, void *arr, size_t n, size_t size)
{
    void *p = realloc(arr, (n + 1) * size);
    if (!p)
        d->oom = 1;
    return p;
}

/* word/numbering.xml: the abstract lists' levels, and each w:num's abstract list and
 * overrides. */
static void load_numbering(struct Docx *d, const char *buf, size_t len)
{
    xmlDocPtr doc = parse_xml(buf, len);
    const xmlNode *root = doc ? xmlDocGetRootElement(doc) : NULL;
    for (const xmlNode *n = root ? root->children : NULL; n && !d->oom; n = n->next) {
        if (is_w(n, "abstractNum")) {
            struct AbsList *a = grow(d, d->abs, d->n_abs, sizeof *a);
            if (!a)
                break;
            d->abs = a;
            memset(&a[d->n_abs], 0, sizeof *a);
            a[d->n_abs].order = d->n_abs;
            a = &d->abs[d->n_abs++];
            xmlChar *id = xmlGetNsProp(n, (const xmlChar *)"abstractNumId", (const xmlChar *)W_NS);
            a->abstract_id = id ? strtol((const char *)id, NULL, 10) : -2;
            xmlFree(id);
            for (int k = 0; k < DOCX_LIST_LEVELS; k++)
                a->start[k] = 1;
            for (const xmlNode *lv = n->children; lv; lv = lv->next) {
                long k = is_w(lv, "lvl") ? lvl_index(lv) : -1;
                if (k < 0)
                    continue;
                a->numbered[k] = lvl_numbered(lv) == 1;
                a->start[k] = w_long(child_w(lv, "start"), 1);
            }
        } else if (is_w(n, "num")) {
            struct NumList *l = grow(d, d->lists, d->n_lists, sizeof *l);
            if (!l)
                break;
            d->lists = l;
            memset(&l[d->n_lists], 0, sizeof *l);
            l[d->n_lists].order = d->n_lists;
            l = &d->lists[d->n_lists++];
            memset(l->numbered, -1, sizeof l->numbered);
            xmlChar *id = xmlGetNsProp(n, (const xmlChar *)"numId", (const xmlChar *)W_NS);
            l->num_id = id ? strtol((const char *)id, NULL, 10) : -1;
            xmlFree(id);
            l->abstract_id = w_long(child_w(n, "abstractNumId"), -1);
            for (const xmlNode *o = n->children; o; o = o->next) {
                long k = is_w(o, "lvlOverride") ? lvl_index(o) : -1;
                if (k < 0)
                    continue;
                const xmlNode *so = child_w(o, "startOverride"), *lv = child_w(o, "lvl");
                if (lv) {
                    l->numbered[k] = (signed char)lvl_numbered(lv);
                    if (child_w(lv, "start")) {
                        l->has_start[k] = 1;
                        l->start[k] = w_long(child_w(lv, "start"), 1);
                    }
                }
                if (so) {
                    l->has_start[k] = 1;
                    l->start[k] = w_long(so, 1);
                }
            }
        }
    }
    if (doc)
        xmlFreeDoc(doc);
    /* sorted by id, the first of equal ids kept, each list pointing at its abstract list */
    qsort(d->abs, d->n_abs, sizeof *d->abs, cmp_abs);
    d->n_abs = keep_first(d->abs, d->n_abs, sizeof *d->abs, cmp_abs_id);
    qsort(d->lists, d->n_lists, sizeof *d->lists, cmp_num);
    d->n_lists = keep_first(d->lists, d->n_lists, sizeof *d->lists, cmp_num_id);
    for (size_t i = 0; i < d->n_lists; i++) {
        struct AbsList key = {.abstract_id = d->lists[i].abstract_id};
        const struct AbsList *a = d->n_abs ? bsearch(&key, d->abs, d->n_abs, sizeof *d->abs,
                                                     cmp_abs_id) : NULL;
        d->lists[i].abs = a ? (long)(a - d->abs) : -1;
    }
}

/* The marker of a list paragraph (w:numPr) into out: "N. " for a numbered level, "- "
 * otherwise; its level into *level. The number is its abstract list's count at that level
 * (shared by every list made from it): the level's start at its first item and after an item
 * of a higher level, or the list's start override at the list's first item there. */
static void list_marker(struct Docx *d, const xmlNode *num_pr, char *out, size_t cap, int *level)
{
    long num_id = w_long(child_w(num_pr, "numId"), -1), k = w_long(child_w(num_pr, "ilvl"), 0);
    if (k < 0 || k >= DOCX_LIST_LEVELS)
        k = k < 0 ? 0 : DOCX_LIST_LEVELS - 1;
    *level = (int)k;
    snprintf(out, cap, "- ");
    struct NumList key = {.num_id = num_id};
    struct NumList *l = d->n_lists ? bsearch(&key, d->lists, d->n_lists, sizeof *d->lists,
                                             cmp_num_id) : NULL;
    if (!l || l->abs < 0)
        return;
    struct AbsList *a = &d->abs[l->abs];
    if (l->has_start[k] && !l->restarted[k]) {
        a->cur[k] = l->start[k];
        l->restarted[k] = 1;
    } else if (a->started[k]) {
        a->cur[k]++;
    } else {
        a->cur[k] = l->has_start[k] ? l->start[k] : a->start[k];
    }
    a->started[k] = 1;
    for (long j = k + 1; j < DOCX_LIST_LEVELS; j++)
        a->started[j] = 0;
    int numbered = l->numbered[k] >= 0 ? l->numbered[k] : a->numbered[k];
    if (numbered)
        snprintf(out, cap, "%ld. ", a->cur[k]);
}

static int para_level(const struct Docx *d, const xmlNode *p, int *is_title, int *list_item)
{
    const xmlNode *ppr = child_w(p, "pPr");
    xmlChar *style = w_val(child_w(ppr, "pStyle"));
    const xmlNode *num_pr = child_w(ppr, "numPr");
    /* numId 0 takes a paragraph out of the list its style would put it in */
    *list_item = num_pr != NULL && w_long(child_w(num_pr, "numId"), -1) != 0;
    *is_title = 0;
    int level = 0;
    if (style) {
        *is_title = !strcasecmp((const char *)style, "Title");
        level = level_of_name((const char *)style);
        for (size_t i = 0; !level && i < d->n_styles; i++)
            if (!strcmp(d->style_id[i], (const char *)style))
                level = d->style_level[i];
        xmlFree(style);
    }
    return level;
}

/* The text of a paragraph's runs, in order, into m: w:t, w:tab (a space), w:br and w:cr (a line
 * break), no-break hyphens; deleted text (w:delText) and field codes (w:instrText) are not w:t. */
static void runs(struct Docx *d, const xmlNode *n, struct Md *m, int depth)
{
    for (const xmlNode *c = n->children; c; c = c->next) {
        if (c->type != XML_ELEMENT_NODE)
            continue;
        if (is_w(c, "t")) {
            xmlChar *t = xmlNodeGetContent(c);
            if (t) {
                md_text(m, (const char *)t, strlen((const char *)t));
                xmlFree(t);
            }
        } else if (is_w(c, "tab")) {
            m->space = 1;
        } else if (is_w(c, "br") || is_w(c, "cr")) {
            md_newline(m);
        } else if (is_w(c, "noBreakHyphen")) {
            md_text(m, "-", 1);
        } else if (depth < DOCX_MAX_DEPTH && !is_w(c, "pPr") && !is_w(c, "rPr")) {
            runs(d, c, m, depth + 1); /* w:r, w:hyperlink, w:ins, w:smartTag, w:sdt... */
        }
    }
}

static void body(struct Docx *d, const xmlNode *n, int depth);

static void paragraph(struct Docx *d, const xmlNode *p)
{
    int is_title, item;
    int level = para_level(d, p, &is_title, &item);
    struct Md line;
    md_init(&line, d->m->max);
    runs(d, p, &line, 0);
    if (line.oom)
        d->oom = 1;
    if (line.n) {
        if (level) {
            char *s = md_one_line(line.p, line.n);
            if (!s) {
                d->oom = 1;
            } else {
                md_heading(d->m, level);
                md_text(d->m, s, strlen(s));
                md_block(d->m);
                if (is_title && !d->first_title)
                    d->first_title = s;
                else
                    free(s);
            }
        } else if (item) {
            char marker[32];
            int depth = 0;
            list_marker(d, child_w(child_w(p, "pPr"), "numPr"), marker, sizeof marker, &depth);
            md_newline(d->m);
            for (int i = 0; i < depth; i++)
                md_raw(d->m, "   ", 3);
            md_raw(d->m, marker, strlen(marker));
            md_raw(d->m, line.p, line.n);
            md_newline(d->m);
        } else {
            md_block(d->m);
            md_raw(d->m, line.p, line.n);
            md_block(d->m);
        }
    }
    md_free(&line);
}

static void table(struct Docx *d, const xmlNode *tbl, int depth)
{
    size_t cols = 0, row = 0;
    for (const xmlNode *tr = tbl->children; tr; tr = tr->next)
        if (is_w(tr, "tr")) {
            size_t k = 0;
            for (const xmlNode *tc = tr->children; tc; tc = tc->next)
                k += is_w(tc, "tc");
            if (k > cols)
                cols = k;
        }
    md_block(d->m);
    for (const xmlNode *tr = tbl->children; tr && !d->oom; tr = tr->next) {
        if (!is_w(tr, "tr"))
            continue;
        char **cells = calloc(cols + 1, sizeof *cells);
        size_t k = 0;
        if (!cells) {
            d->oom = 1;
            break;
        }
        for (const xmlNode *tc = tr->children; tc; tc = tc->next) {
            if (!is_w(tc, "tc"))
                continue;
            struct Md cell, *saved = d->m;
            md_init(&cell, saved->max);
            d->m = &cell;
            for (const xmlNode *c = tc->children; c; c = c->next) {
                if (is_w(c, "p")) {
                    cell.space = cell.n > 0;
                    runs(d, c, &cell, 0);
                } else if (depth < DOCX_MAX_DEPTH) {
                    body(d, c, depth + 1); /* a table in a cell: its text */
                }
            }
            d->m = saved;
            cells[k] = md_cell(&cell);
            if (!cells[k] || cell.oom)
                d->oom = 1;
            k++;
            md_free(&cell);
        }
        md_table_row(d->m, cells, k, cols, row++ == 0);
        for (size_t i = 0; i < k; i++)
            free(cells[i]);
        free(cells);
    }
    md_block(d->m);
}

static void body(struct Docx *d, const xmlNode *n, int depth)
{
    if (is_w(n, "p")) {
        paragraph(d, n);
    } else if (is_w(n, "tbl")) {
        table(d, n, depth);
    } else if (n->type == XML_ELEMENT_NODE && depth < DOCX_MAX_DEPTH && !is_w(n, "sectPr")) {
        for (const xmlNode *c = n->children; c && !d->oom; c = c->next)
            body(d, c, depth + 1); /* w:sdt, w:sdtContent, w:customXml... */
    }
}

/* dc:title of docProps/core.xml, or NULL. */
static char *core_title(const char *buf, size_t len)
{
    xmlDocPtr doc = parse_xml(buf, len);
    const xmlNode *root = doc ? xmlDocGetRootElement(doc) : NULL;
    char *title = NULL;
    for (const xmlNode *c = root ? root->children : NULL; c; c = c->next)
        if (c->type == XML_ELEMENT_NODE && !strcmp((const char *)c->name, "title")) {
            xmlChar *t = xmlNodeGetContent(c);
            if (t) {
                title = md_one_line((const char *)t, strlen((const char *)t));
                xmlFree(t);
            }
            break;
        }
    if (doc)
        xmlFreeDoc(doc);
    if (title && !title[0]) {
        free(title);
        title = NULL;
    }
    return title;
}

int extract_docx(int fd, const struct ExtractLimits *lim, struct Md *out, char **title,
                 char *err, size_t errlen)
{
    int zerr = 0;
    int dupfd = dup(fd); /* zip_fdopen takes the descriptor */
    zip_t *z = dupfd >= 0 ? zip_fdopen(dupfd, ZIP_RDONLY | ZIP_CHECKCONS, &zerr) : NULL;
    if (!z) {
        zip_error_t ze;
        zip_error_init_with_code(&ze, zerr);
        snprintf(err, errlen, "a damaged zip archive (%s)", dupfd < 0 ? strerror(errno)
                                                                      : zip_error_strerror(&ze));
        zip_error_fini(&ze);
        if (dupfd >= 0)
            close(dupfd);
        return EXTRACT_EBAD;
    }
    struct Docx d = { .m = out };
    char *doc = NULL, *styles = NULL, *core = NULL, *numbering = NULL;
    size_t doc_len, styles_len, core_len, numbering_len;
    int rc = read_entry(z, "word/document.xml", lim, 0, &doc, &doc_len, err, errlen);
    if (!rc)
        rc = read_entry(z, "word/styles.xml", lim, 1, &styles, &styles_len, err, errlen);
    if (!rc)
        rc = read_entry(z, "word/numbering.xml", lim, 1, &numbering, &numbering_len, err, errlen);
    if (!rc)
        rc = read_entry(z, "docProps/core.xml", lim, 1, &core, &core_len, err, errlen);
    zip_discard(z);
    if (rc)
        goto out;
    if (doc_len > (size_t)INT32_MAX) {
        snprintf(err, errlen, "word/document.xml is too large");
        rc = EXTRACT_ELIMIT;
        goto out;
    }
    if (styles)
        load_styles(&d, styles, styles_len);
    if (numbering)
        load_numbering(&d, numbering, numbering_len);
    xmlDocPtr x = parse_xml(doc, doc_len);
    const xmlNode *root = x ? xmlDocGetRootElement(x) : NULL;
    const xmlNode *b = child_w(root, "body");
    if (!b) {
        const xmlError *e = xmlGetLastError();
        snprintf(err, errlen, "word/document.xml is not a Word document's XML%s%s",
                 e && e->message ? ": " : "", e && e->message ? e->message : "");
        size_t l = strlen(err);
        if (l && err[l - 1] == '\n')
            err[l - 1] = 0;
        rc = EXTRACT_EBAD;
    } else {
        for (const xmlNode *c = b->children; c && !d.oom && !out->over; c = c->next)
            body(&d, c, 0);
        md_block(out);
    }
    if (x)
        xmlFreeDoc(x);
    if (!rc && (d.oom || out->oom)) {
        snprintf(err, errlen, "out of memory");
        rc = EXTRACT_ENOMEM;
    }
    if (!rc) {
        *title = core ? core_title(core, core_len) : NULL;
        if (!*title) {
            *title = d.first_title;
            d.first_title = NULL;
        }
    }
out:
    for (size_t i = 0; i < d.n_styles; i++)
        free(d.style_id[i]);
    free(d.style_id);
    free(d.style_level);
    free(d.lists);
    free(d.abs);
    free(numbering);
    free(d.first_title);
    free(doc);
    free(styles);
    free(core);
    return rc;
}
