/* Sentence segmentation (end punctuation followed by a space and not a lowercase word, skipping
 * initials and common abbreviations; blank lines start paragraphs; Markdown block lines stand
 * alone), table rows as units, oversize-sentence splitting, and packing of sections, paragraphs,
 * tables and sentences into chunks. The Markdown structure is found by chunker_md.c. */
#include "retriever/chunker.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/chunker_md.h"
#include "retriever/status.h"
#include "retriever/text.h"

#define is_ws chunk_is_ws

static const char *const ABBREVIATIONS[] = {
    "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "eg", "ie", "no", "fig", "inc",
    "ltd", "co", "mt", "gen", "col", "lt", "sgt", "capt", "rev", "gov", "sen", "rep", "jan",
    "feb", "apr", "aug", "sep", "sept", "oct", "nov", "dec", "approx", "ca", "cf", "al", "vol",
    "pp", "ed", "est", "dept", "univ", "ft", "op",
};

/* Is the word that ends just before text[dot] an initial or a known abbreviation? */
static int before_is_abbrev(const char *text, size_t dot)
{
    size_t b = dot;
    while (b > 0 && (isalpha((unsigned char)text[b - 1]) || text[b - 1] == '.'))
        b--;
    char w[16];
    size_t n = 0;
    for (size_t i = b; i < dot; i++) {
        if (text[i] == '.')
            continue;
        if (n + 1 >= sizeof w)
            return 0;
        w[n++] = (char)tolower((unsigned char)text[i]);
    }
    if (n == 0)
        return 0;
    if (n == 1)
        return 1; /* an initial: "J. Smith", "U.S." */
    w[n] = 0;
    for (size_t i = 0; i < sizeof ABBREVIATIONS / sizeof ABBREVIATIONS[0]; i++)
        if (strcmp(w, ABBREVIATIONS[i]) == 0)
            return 1;
    return 0;
}


static int push_unit(size_t **starts, uint8_t **para, size_t *n, size_t *cap, size_t at, int is_para)
{
    if (*n && (*starts)[*n - 1] == at)
        return RET_OK;
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 16;
        size_t *s = realloc(*starts, c * sizeof *s);
        if (!s)
            return RET_ENOMEM;
        *starts = s;
        uint8_t *p = realloc(*para, c);
        if (!p)
            return RET_ENOMEM;
        *para = p;
        *cap = c;
    }
    (*starts)[*n] = at;
    (*para)[*n] = (uint8_t)is_para;
    (*n)++;
    return RET_OK;
}

int chunk_sentences(const char *text, size_t len, size_t **starts, uint8_t **para, size_t *n_out)
{
    *starts = NULL;
    *para = NULL;
    *n_out = 0;
    size_t n = 0, cap = 0;
    size_t i = 0;
    while (i < len && is_ws((unsigned char)text[i]))
        i++;
    if (i == len)
        return RET_OK;
    if (push_unit(starts, para, &n, &cap, i, 1))
        goto nomem;
    size_t line_start = i;
    while (i < len) {
        unsigned char c = (unsigned char)text[i];
        size_t boundary = 0; /* the offset after which to look for the next unit's start */
        int is_para = 0;
        if (c == '\n') {
            size_t j = i + 1;
            while (j < len && (text[j] == ' ' || text[j] == '\t' || text[j] == '\r'))
                j++;
            if (j < len && text[j] == '\n')
                is_para = 1;
            if (is_para || chunk_line_is_block(text, len, line_start) || chunk_line_is_block(text, len, i + 1))
                boundary = i + 1;
            line_start = i + 1;
        } else if (c == '.' || c == '!' || c == '?') {
            size_t j = i + 1;
            while (j < len && strchr(".!?\"')]", text[j]))
                j++;
            /* closing curly quotes (U+2019, U+201D) */
            while (j + 2 < len && (unsigned char)text[j] == 0xE2 && (unsigned char)text[j + 1] == 0x80 &&
                   ((unsigned char)text[j + 2] == 0x99 || (unsigned char)text[j + 2] == 0x9D))
                j += 3;
            if (j < len && is_ws((unsigned char)text[j])) {
                size_t k = j;
                while (k < len && is_ws((unsigned char)text[k]))
                    k++;
                int next_lower = k < len && islower((unsigned char)text[k]);
                if (!next_lower && !(c == '.' && before_is_abbrev(text, i)))
                    boundary = j;
            }
        } else if (c == 0xE3 && i + 2 < len && (unsigned char)text[i + 1] == 0x80 &&
                   (unsigned char)text[i + 2] == 0x82) {
            boundary = i + 3; /* ideographic full stop */
        }
        if (boundary) {
            size_t k = boundary;
            while (k < len && is_ws((unsigned char)text[k])) {
                if (text[k] == '\n') {
                    size_t j = k + 1;
                    while (j < len && (text[j] == ' ' || text[j] == '\t' || text[j] == '\r'))
                        j++;
                    if (j < len && text[j] == '\n')
                        is_para = 1;
                }
                k++;
            }
            if (k < len && push_unit(starts, para, &n, &cap, k, is_para))
                goto nomem;
            if (k > i + 1 && memchr(text + i, '\n', k - i))
                line_start = k;
            i = k > i ? k : i + 1;
            continue;
        }
        i++;
    }
    *n_out = n;
    return RET_OK;
nomem:
    free(*starts);
    free(*para);
    *starts = NULL;
    *para = NULL;
    return RET_ENOMEM;
}

struct Unit { size_t start, end; uint32_t n_tokens; uint8_t para, head; uint32_t table; /* its table + 1 */ };

static size_t trim_end(const char *text, size_t start, size_t end)
{
    while (end > start && is_ws((unsigned char)text[end - 1]))
        end--;
    return end;
}

static int push(struct Unit **u, size_t *n, size_t *cap, struct Unit v)
{
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 16;
        struct Unit *p = realloc(*u, c * sizeof *p);
        if (!p)
            return RET_ENOMEM;
        *u = p;
        *cap = c;
    }
    (*u)[(*n)++] = v;
    return RET_OK;
}

/* Cut point at or before `cut` in (cur, end]: after the last whitespace run, else at a UTF-8
 * character boundary; always > cur. */
static size_t snap_cut(const char *text, size_t cur, size_t end, size_t cut)
{
    if (cut >= end)
        return end;
    for (size_t w = cut; w > cur + 1; w--)
        if (is_ws((unsigned char)text[w - 1]) && !is_ws((unsigned char)text[w]))
            return w;
    size_t c = cut;
    while (c > cur + 1 && ((unsigned char)text[c] & 0xC0) == 0x80)
        c--;
    if (c <= cur) {
        c = cur + 1;
        while (c < end && ((unsigned char)text[c] & 0xC0) == 0x80)
            c++;
    }
    return c;
}

/* Split an oversize unit [s, e) with n tokens into pieces of at most target tokens. */
static int split_unit(const char *text, size_t s, size_t e, size_t n, uint8_t para, uint32_t target,
                      const struct TokenCounter *tc, struct Unit **u, size_t *nu, size_t *cap)
{
    size_t cur = s;
    double bytes_per_tok = (double)(e - s) / (double)(n ? n : 1);
    int first = 1;
    while (cur < e) {
        size_t te = trim_end(text, cur, e);
        size_t cnt;
        double want = (double)target * bytes_per_tok * 0.95;
        size_t cut = snap_cut(text, cur, te, cur + (size_t)(want < 1 ? 1 : want));
        for (int tries = 0;; tries++) {
            if (tokcount_count(tc, text + cur, trim_end(text, cur, cut) - cur, &cnt))
                return RET_ETOKEN;
            if (cnt <= target || cut <= cur + 1)
                break;
            size_t span = cut - cur;
            size_t shrink = (size_t)((double)span * (double)target / (double)cnt * 0.9);
            if (tries >= 6)
                shrink = span / 2;
            cut = snap_cut(text, cur, te, cur + (shrink ? shrink : 1));
        }
        if (cnt)
            bytes_per_tok = (double)(cut - cur) / (double)cnt;
        size_t next = cut;
        while (next < e && is_ws((unsigned char)text[next]))
            next++;
        struct Unit v = { cur, next >= e ? e : next, (uint32_t)cnt, first ? para : 0, 0, 0 };
        if (push(u, nu, cap, v))
            return RET_ENOMEM;
        first = 0;
        cur = next;
    }
    return RET_OK;
}

/* ---- packing ------------------------------------------------------------------------------- */

struct TabUnits { size_t ua, ub; uint64_t sum; }; /* a table's units [ua, ub) and their tokens */

struct Packer {
    const char *text;
    const struct Unit *u;
    uint32_t target, overlap;
    struct ChunkSpan *ch;
    size_t n, cap;
    const struct MdHead *heads;  /* the headings, and how many of them the path has taken in */
    size_t n_heads, next_head;
    struct ChunkHeading path[CHUNK_MAX_DEPTH];
    uint32_t depth;
    const struct MdTable *tables;
    const struct TabUnits *tab;
    size_t split_end;            /* the end unit of a table being cut at rows (0: none) */
};

static const struct TabUnits *tab_at(const struct Packer *p, size_t j)
{
    return p->u[j].table ? &p->tab[p->u[j].table - 1] : NULL;
}

static int emit(struct Packer *p, size_t a, size_t b, uint64_t sum)
{
    if (p->n == p->cap) {
        size_t c = p->cap ? p->cap * 2 : 8;
        struct ChunkSpan *q = realloc(p->ch, c * sizeof *q);
        if (!q)
            return RET_ENOMEM;
        p->ch = q;
        p->cap = c;
    }
    struct ChunkSpan *c = &p->ch[p->n++];
    memset(c, 0, sizeof *c);
    c->start = p->u[a].start;
    c->end = trim_end(p->text, p->u[a].start, p->u[b - 1].end);
    c->n_tokens = (uint32_t)sum;
    while (p->next_head < p->n_heads && p->heads[p->next_head].at < c->end) {
        const struct ChunkHeading *h = &p->heads[p->next_head++].h;
        while (p->depth && p->path[p->depth - 1].level >= h->level)
            p->depth--;
        p->path[p->depth++] = *h;
    }
    c->n_heads = p->depth;
    memcpy(c->heads, p->path, p->depth * sizeof *p->path);
    if (p->u[a].table) { /* a later part of a table: its path takes the caption and header row */
        const struct MdTable *t = &p->tables[p->u[a].table - 1];
        if (c->start > t->head) {
            c->table_cap = t->cap;
            c->table_cap_len = (uint32_t)(t->cap_end - t->cap);
            c->table_head = t->head;
            c->table_head_len = (uint32_t)(t->head_end - t->head);
        }
    }
    return RET_OK;
}

/* Where a chunk that would hold units [first_new, j) ends when the table starting at j goes to
 * the next one: before the paragraph that introduces the table (its last paragraph) when that
 * paragraph and the table fit together and something new stays; else at j. */
static size_t before_intro(const struct Packer *p, size_t first_new, size_t j, uint64_t tsum,
                           uint64_t *sum)
{
    const struct Unit *u = p->u;
    size_t k = j;
    uint64_t ks = 0;
    while (k > first_new + 1 && !u[k - 1].para && !u[k - 1].table && !u[k - 1].head)
        ks += u[--k].n_tokens;
    if (k > first_new + 1 && u[k - 1].para && !u[k - 1].table && !u[k - 1].head &&
        ks + u[k - 1].n_tokens + tsum <= p->target) {
        k--;
        *sum -= ks + u[k].n_tokens;
        return k;
    }
    return j;
}

/* Greedy packing of the sentence units [a, b): a chunk ends before a unit that would pass the
 * target, or before a paragraph once it holds half the target; the next one repeats whole
 * trailing sentences of the same paragraph up to the overlap. A table that fits is taken whole
 * or starts the next chunk (with its introducing paragraph when both fit); a longer one starts a
 * chunk of its own (after any headings) and is cut between rows, and its last part ends the
 * chunk. Nothing overlaps into or out of a table. */
static int pack_units(struct Packer *p, size_t a, size_t b)
{
    const struct Unit *u = p->u;
    size_t i = a, first_new = a; /* units before first_new repeat the previous chunk's tail */
    while (i < b) {
        size_t j = i;
        uint64_t sum = 0;
        int only_heads = 1;      /* the new units so far are headings */
        while (j < b) {
            const struct TabUnits *t = tab_at(p, j);
            if (j > first_new && j == p->split_end)
                break;           /* a table cut at rows ends its last part */
            if (t && t->ua == j && !(p->split_end > j)) {
                if (t->sum <= p->target && !(only_heads && j > first_new && sum + t->sum > p->target)) {
                    if (j > first_new && (sum + t->sum > p->target || (u[j].para && sum >= p->target / 2))) {
                        j = before_intro(p, first_new, j, t->sum, &sum);
                        break;
                    }
                    sum += t->sum;
                    j = t->ub;
                    only_heads = 0;
                    continue;
                }
                if (j > first_new && !only_heads)
                    break;       /* a long table starts a chunk */
                p->split_end = t->ub;
            }
            if (j > first_new && sum + u[j].n_tokens > p->target)
                break;
            if (j > first_new && u[j].para && sum >= p->target / 2)
                break;
            sum += u[j].n_tokens;
            only_heads &= u[j].head;
            j++;
        }
        if (emit(p, i, j, sum))
            return RET_ENOMEM;
        if (j >= p->split_end)
            p->split_end = 0;
        if (j >= b)
            break;
        size_t k = j;
        uint64_t osum = 0;
        while (p->overlap && !u[j].table && !u[j - 1].table && k - 1 > i &&
               osum + u[k - 1].n_tokens <= p->overlap &&
               osum + u[k - 1].n_tokens + u[j].n_tokens <= p->target && !u[k].para) {
            k--;
            osum += u[k].n_tokens;
        }
        i = k;
        first_new = j;
    }
    return RET_OK;
}

/* One section, units [a, b): whole when it fits; else paragraphs (a table with its caption is
 * one) packed whole while they fit (the headings it starts with stay with its first paragraph;
 * a table that fits takes the paragraph before it along when both fit), and a paragraph or
 * table over the target packed by pack_units. */
static int pack_section(struct Packer *p, size_t a, size_t b)
{
    const struct Unit *u = p->u;
    uint64_t total = 0;
    for (size_t i = a; i < b; i++)
        total += u[i].n_tokens;
    if (total <= p->target)
        return emit(p, a, b, total);
    size_t cur = a, last = a; /* the pending chunk: units [cur, q); its last paragraph at last */
    uint64_t cur_sum = 0, last_sum = 0;
    for (size_t q = a; q < b;) {
        size_t r = q + 1;
        uint64_t psum = u[q].n_tokens;
        while (r < b && !((u[r].para || u[r].head) && !u[r - 1].head))
            psum += u[r++].n_tokens;
        if (psum > p->target) {
            if (cur < q && emit(p, cur, q, cur_sum))
                return RET_ENOMEM;
            if (pack_units(p, q, r))
                return RET_ENOMEM;
            cur = r;
            cur_sum = 0;
        } else if (cur < q && cur_sum + psum > p->target) {
            if (u[q].table && last > cur && !u[last].table && last_sum + psum <= p->target) {
                if (emit(p, cur, last, cur_sum - last_sum)) /* the table's introduction goes along */
                    return RET_ENOMEM;
                cur = last;
                cur_sum = last_sum + psum;
            } else {
                if (emit(p, cur, q, cur_sum))
                    return RET_ENOMEM;
                cur = q;
                cur_sum = psum;
            }
        } else {
            cur_sum += psum;
        }
        last = q;
        last_sum = psum;
        q = r;
    }
    if (cur < b)
        return emit(p, cur, b, cur_sum);
    return RET_OK;
}

/* The sentence units with a table's units in place of those inside it: its caption line, its
 * header and separator rows together, then each body row (sentence ends inside a row cut
 * nothing). starts/para are rebuilt; their arrays are malloc'ed. */
static int table_units(const char *text, const struct ChunkMd *md, size_t **starts, uint8_t **para,
                       size_t *n)
{
    if (!md->n_tables)
        return RET_OK;
    size_t *ns = NULL, nn = 0, cap = 0;
    uint8_t *np = NULL;
    size_t k = 0;
    int after = 0; /* the unit after a table starts a paragraph */
    for (size_t t = 0; t <= md->n_tables; t++) {
        size_t lim = t < md->n_tables ? md->tables[t].start : SIZE_MAX;
        for (; k < *n && (*starts)[k] < lim; k++, after = 0)
            if (push_unit(&ns, &np, &nn, &cap, (*starts)[k], (*para)[k] || after))
                goto nomem;
        if (t == md->n_tables)
            break;
        const struct MdTable *tb = &md->tables[t];
        if (push_unit(&ns, &np, &nn, &cap, tb->start, 1) ||
            push_unit(&ns, &np, &nn, &cap, tb->head, tb->head == tb->start))
            goto nomem;
        for (size_t s = tb->body; s < tb->end;) {
            if (push_unit(&ns, &np, &nn, &cap, s, 0))
                goto nomem;
            const char *nl = memchr(text + s, '\n', tb->end - s);
            if (!nl)
                break;
            s = (size_t)(nl - text) + 1;
            while (s < tb->end && (text[s] == ' ' || text[s] == '\t'))
                s++;
        }
        while (k < *n && (*starts)[k] <= tb->end)
            k++;
        after = 1;
    }
    free(*starts);
    free(*para);
    *starts = ns;
    *para = np;
    *n = nn;
    return RET_OK;
nomem:
    free(ns);
    free(np);
    return RET_ENOMEM;
}

int chunk_text(const char *text, size_t len, const struct ChunkOptions *o,
               const struct TokenCounter *tc, struct ChunkSpan **out, size_t *n_out,
               char *err, size_t errlen)
{
    *out = NULL;
    *n_out = 0;
    if (o->target_tokens < CHUNK_MIN_TOKENS || o->target_tokens > CHUNK_MAX_TOKENS ||
        o->overlap_tokens >= o->target_tokens)
        return ret_fail(err, errlen, RET_EINPUT,
                        "chunk size %u must be in %d..%d and overlap %u below it",
                        o->target_tokens, CHUNK_MIN_TOKENS, CHUNK_MAX_TOKENS, o->overlap_tokens);
    size_t *starts = NULL, n_st = 0;
    uint8_t *para = NULL;
    struct Unit *u = NULL;
    size_t nu = 0, ucap = 0;
    struct ChunkMd md = { 0 };
    struct TabUnits *tab = NULL;
    struct Packer pk = { .text = text, .target = o->target_tokens, .overlap = o->overlap_tokens };
    int rc = chunk_sentences(text, len, &starts, &para, &n_st);
    if (rc || (rc = chunk_md_scan(text, len, &md)) || (rc = table_units(text, &md, &starts, &para, &n_st)))
        goto err;
    if (md.n_tables && !(tab = calloc(md.n_tables, sizeof *tab))) {
        rc = RET_ENOMEM;
        goto err;
    }
    size_t h = 0, n_head_units = 0, mk = 0, tb = 0;
    int after_mark = 0;
    for (size_t i = 0; i < n_st; i++) {
        size_t s = starts[i], e = i + 1 < n_st ? starts[i + 1] : len;
        size_t te = trim_end(text, s, e), cnt;
        while (h < md.n_heads && md.heads[h].at < s)
            h++;
        uint8_t head = h < md.n_heads && md.heads[h].at == s;
        while (mk < md.n_marks && md.marks[mk].at < s)
            mk++;
        while (tb < md.n_tables && md.tables[tb].end <= s)
            tb++;
        uint32_t table = tb < md.n_tables && md.tables[tb].start <= s ? (uint32_t)tb + 1 : 0;
        /* a page marker starts the paragraph that follows it: never a chunk of its own */
        uint8_t is_para = para[i] && !after_mark;
        after_mark = mk < md.n_marks && md.marks[mk].at == s;
        n_head_units += head;
        if (tokcount_count(tc, text + s, te - s, &cnt)) {
            rc = RET_ETOKEN;
            goto err;
        }
        size_t first = nu;
        if (cnt > o->target_tokens) {
            if ((rc = split_unit(text, s, e, cnt, is_para, o->target_tokens, tc, &u, &nu, &ucap)))
                goto err;
        } else {
            struct Unit v = { s, e, (uint32_t)cnt, is_para, 0, 0 };
            if ((rc = push(&u, &nu, &ucap, v)))
                goto err;
        }
        if (first < nu)
            u[first].head = head;
        for (size_t k = first; table && k < nu; k++) {
            struct TabUnits *t = &tab[table - 1];
            if (!t->ub)
                t->ua = k;
            t->ub = k + 1;
            t->sum += u[k].n_tokens;
            u[k].table = table;
        }
    }
    pk.u = u;
    pk.heads = md.heads;
    pk.n_heads = md.n_heads;
    pk.tables = md.tables;
    pk.tab = tab;
    if (n_head_units == 0) {
        rc = pack_units(&pk, 0, nu); /* no headings: one run of sentences */
    } else {
        /* a section starts at the first of a run of heading units */
        for (size_t a = 0; a < nu && !rc;) {
            size_t b = a + 1;
            while (b < nu && !(u[b].head && !u[b - 1].head))
                b++;
            rc = pack_section(&pk, a, b);
            a = b;
        }
    }
    if (rc)
        goto err;
    chunk_set_pages(pk.ch, pk.n, md.marks, md.n_marks);
    free(starts);
    free(para);
    free(u);
    free(tab);
    chunk_md_free(&md);
    *out = pk.ch;
    *n_out = pk.n;
    return RET_OK;
err:
    free(starts);
    free(para);
    free(u);
    free(tab);
    chunk_md_free(&md);
    free(pk.ch);
    if (rc == RET_ETOKEN)
        return ret_fail(err, errlen, rc, "the token counter failed while chunking");
    return ret_fail(err, errlen, rc, "out of memory while chunking");
}
