/* Sentence segmentation (end punctuation followed by a space and not a lowercase word, skipping
 * initials and common abbreviations; blank lines start paragraphs; Markdown block lines stand
 * alone), oversize-sentence splitting, Markdown headings (outside fenced code) as section
 * starts, page markers, and packing of sections, paragraphs and sentences into chunks. */
#include "retriever/chunker.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "retriever/status.h"
#include "retriever/text.h"

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

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

/* The page number of a page marker line text[ls, le) ("<!-- page N -->"), or 0. */
static uint32_t page_marker(const char *text, size_t ls, size_t le)
{
    static const char open[] = "<!-- page ", close[] = " -->";
    size_t ol = sizeof open - 1, cl = sizeof close - 1;
    while (le > ls && is_ws((unsigned char)text[le - 1]))
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

/* Markdown block markers (and page markers) that make a line a unit of its own. */
static int line_is_block(const char *text, size_t len, size_t i)
{
    if (i + 5 < len && memcmp(text + i, "<!-- ", 5) == 0) {
        const char *nl = memchr(text + i, '\n', len - i);
        if (page_marker(text, i, nl ? (size_t)(nl - text) : len))
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
            if (is_para || line_is_block(text, len, line_start) || line_is_block(text, len, i + 1))
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

struct Unit { size_t start, end; uint32_t n_tokens; uint8_t para, head; };

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
        struct Unit v = { cur, next >= e ? e : next, (uint32_t)cnt, first ? para : 0, 0 };
        if (push(u, nu, cap, v))
            return RET_ENOMEM;
        first = 0;
        cur = next;
    }
    return RET_OK;
}

/* ---- headings ---------------------------------------------------------------------------- */

struct Head { size_t at; struct ChunkHeading h; }; /* at: the first '#' */
struct Mark { size_t at, end; uint32_t page; };    /* a page marker line [at, end) */

static int push_mark(struct Mark **ms, size_t *n, size_t *cap, struct Mark m)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 16;
        struct Mark *p = realloc(*ms, nc * sizeof *p);
        if (!p)
            return RET_ENOMEM;
        *ms = p;
        *cap = nc;
    }
    (*ms)[(*n)++] = m;
    return RET_OK;
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

/* The ATX headings and the page markers of text outside fenced code blocks, in order. */
static int find_headings(const char *text, size_t len, struct Head **out, size_t *n_out,
                         struct Mark **marks, size_t *n_marks)
{
    struct Head *hs = NULL;
    size_t n = 0, cap = 0, mcap = 0;
    *marks = NULL;
    *n_marks = 0;
    char fence = 0;
    size_t fence_len = 0;
    for (size_t ls = 0; ls < len;) {
        const char *nl = memchr(text + ls, '\n', len - ls);
        size_t le = nl ? (size_t)(nl - text) : len;
        char ch = 0;
        size_t run = fence_run(text, ls, le, &ch);
        if (fence) {
            if (run >= fence_len && ch == fence) {
                size_t k = ls;
                while (k < le && (text[k] == ' ' || text[k] == '`' || text[k] == '~'))
                    k++;
                while (k < le && is_ws((unsigned char)text[k]))
                    k++;
                if (k == le)
                    fence = 0;
            }
        } else if (run) {
            fence = ch;
            fence_len = run;
        } else if (page_marker(text, ls, le)) {
            if (push_mark(marks, n_marks, &mcap, (struct Mark){ ls, le, page_marker(text, ls, le) })) {
                free(hs);
                free(*marks);
                *marks = NULL;
                return RET_ENOMEM;
            }
        } else {
            size_t i = ls;
            while (i < le && i - ls < 3 && text[i] == ' ')
                i++;
            size_t h = i;
            while (i < le && text[i] == '#')
                i++;
            size_t level = i - h;
            if (level >= 1 && level <= CHUNK_MAX_DEPTH && i < le && (text[i] == ' ' || text[i] == '\t')) {
                size_t ts = i, te = le;
                while (ts < te && is_ws((unsigned char)text[ts]))
                    ts++;
                while (te > ts && is_ws((unsigned char)text[te - 1]))
                    te--;
                size_t c = te; /* a closing run of #s after a space */
                while (c > ts && text[c - 1] == '#')
                    c--;
                if (c < te && (c == ts || text[c - 1] == ' ' || text[c - 1] == '\t')) {
                    te = c;
                    while (te > ts && is_ws((unsigned char)text[te - 1]))
                        te--;
                }
                if (te > ts && te - ts <= UINT32_MAX) {
                    if (n == cap) {
                        size_t nc = cap ? cap * 2 : 16;
                        struct Head *p = realloc(hs, nc * sizeof *p);
                        if (!p) {
                            free(hs);
                            free(*marks);
                            *marks = NULL;
                            return RET_ENOMEM;
                        }
                        hs = p;
                        cap = nc;
                    }
                    hs[n++] = (struct Head){ h, { ts, (uint32_t)(te - ts), (uint32_t)level } };
                }
            }
        }
        ls = le + 1;
    }
    *out = hs;
    *n_out = n;
    return RET_OK;
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
    for (uint32_t i = first; i < span->n_heads && n < limit; i++) {
        const struct ChunkHeading *h = &span->heads[i];
        if (n) {
            if (n + sep > limit)
                break;
            memcpy(out + n, CHUNK_PATH_SEPARATOR, sep);
            n += sep;
        }
        size_t l = h->len;
        if (n + l > limit) {
            l = limit - n;
            while (l > 0 && ((unsigned char)text[h->start + l] & 0xC0) == 0x80)
                l--;
        }
        for (size_t k = 0; k < l; k++) {
            char c = text[h->start + k];
            out[n++] = (c == '\n' || c == '\r' || c == '\t') ? ' ' : c;
        }
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

/* The pages of each chunk from the page markers (chunker.h). */
static void set_pages(struct ChunkSpan *cs, size_t n, const struct Mark *m, size_t nm)
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
    struct Head *heads = NULL;
    struct Mark *marks = NULL;
    size_t n_heads = 0, n_marks = 0;
    struct ChunkSpan c = { 0 };
    c.end = len;
    int rc = find_headings(text, len, &heads, &n_heads, &marks, &n_marks);
    if (rc == RET_OK) {
        while (c.end > 0 && is_ws((unsigned char)text[c.end - 1]))
            c.end--;
        set_pages(&c, 1, marks, n_marks);
    }
    *first = c.page_first;
    *last = c.page_last;
    free(heads);
    free(marks);
    return rc;
}

/* ---- packing ------------------------------------------------------------------------------- */

struct Packer {
    const char *text;
    const struct Unit *u;
    uint32_t target, overlap;
    struct ChunkSpan *ch;
    size_t n, cap;
    const struct Head *heads;  /* the headings, and how many of them the path has taken in */
    size_t n_heads, next_head;
    struct ChunkHeading path[CHUNK_MAX_DEPTH];
    uint32_t depth;
};

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
    return RET_OK;
}

/* Greedy packing of the sentence units [a, b): a chunk ends before a unit that would pass the
 * target, or before a paragraph once it holds half the target; the next one repeats whole
 * trailing sentences of the same paragraph up to the overlap. */
static int pack_units(struct Packer *p, size_t a, size_t b)
{
    const struct Unit *u = p->u;
    size_t i = a, first_new = a; /* units before first_new repeat the previous chunk's tail */
    while (i < b) {
        size_t j = i;
        uint64_t sum = 0;
        while (j < b) {
            if (j > first_new && sum + u[j].n_tokens > p->target)
                break;
            if (j > first_new && u[j].para && sum >= p->target / 2)
                break;
            sum += u[j].n_tokens;
            j++;
        }
        if (emit(p, i, j, sum))
            return RET_ENOMEM;
        if (j >= b)
            break;
        size_t k = j;
        uint64_t osum = 0;
        while (p->overlap && k - 1 > i && osum + u[k - 1].n_tokens <= p->overlap &&
               osum + u[k - 1].n_tokens + u[j].n_tokens <= p->target && !u[k].para) {
            k--;
            osum += u[k].n_tokens;
        }
        i = k;
        first_new = j;
    }
    return RET_OK;
}

/* One section, units [a, b): whole when it fits; else paragraphs packed whole while they fit
 * (the headings it starts with stay with its first paragraph), and a paragraph over the target
 * cut at sentences. */
static int pack_section(struct Packer *p, size_t a, size_t b)
{
    const struct Unit *u = p->u;
    uint64_t total = 0;
    for (size_t i = a; i < b; i++)
        total += u[i].n_tokens;
    if (total <= p->target)
        return emit(p, a, b, total);
    size_t cur = a;      /* the pending chunk: units [cur, q) */
    uint64_t cur_sum = 0;
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
            if (emit(p, cur, q, cur_sum))
                return RET_ENOMEM;
            cur = q;
            cur_sum = psum;
        } else {
            cur_sum += psum;
        }
        q = r;
    }
    if (cur < b)
        return emit(p, cur, b, cur_sum);
    return RET_OK;
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
    struct Head *heads = NULL;
    size_t n_heads = 0, n_marks = 0;
    struct Mark *marks = NULL;
    struct Packer pk = { .text = text, .target = o->target_tokens, .overlap = o->overlap_tokens };
    int rc = chunk_sentences(text, len, &starts, &para, &n_st);
    if (rc || (rc = find_headings(text, len, &heads, &n_heads, &marks, &n_marks)))
        goto err;
    size_t h = 0, n_head_units = 0, mk = 0;
    int after_mark = 0;
    for (size_t i = 0; i < n_st; i++) {
        size_t s = starts[i], e = i + 1 < n_st ? starts[i + 1] : len;
        size_t te = trim_end(text, s, e), cnt;
        while (h < n_heads && heads[h].at < s)
            h++;
        uint8_t head = h < n_heads && heads[h].at == s;
        while (mk < n_marks && marks[mk].at < s)
            mk++;
        /* a page marker starts the paragraph that follows it: never a chunk of its own */
        uint8_t is_para = para[i] && !after_mark;
        after_mark = mk < n_marks && marks[mk].at == s;
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
            struct Unit v = { s, e, (uint32_t)cnt, is_para, 0 };
            if ((rc = push(&u, &nu, &ucap, v)))
                goto err;
        }
        if (first < nu)
            u[first].head = head;
    }
    pk.u = u;
    pk.heads = heads;
    pk.n_heads = n_heads;
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
    set_pages(pk.ch, pk.n, marks, n_marks);
    free(starts);
    free(para);
    free(u);
    free(heads);
    free(marks);
    *out = pk.ch;
    *n_out = pk.n;
    return RET_OK;
err:
    free(starts);
    free(para);
    free(u);
    free(heads);
    free(marks);
    free(pk.ch);
    if (rc == RET_ETOKEN)
        return ret_fail(err, errlen, rc, "the token counter failed while chunking");
    return ret_fail(err, errlen, rc, "out of memory while chunking");
}
