/* Sentence segmentation (end punctuation followed by a space and not a lowercase word, skipping
 * initials and common abbreviations; blank lines start paragraphs; Markdown block lines stand
 * alone), oversize-sentence splitting, and greedy packing of sentences into chunks. */
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

/* Markdown block markers that make a line a unit of its own. */
static int line_is_block(const char *text, size_t len, size_t i)
{
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

struct Unit { size_t start, end; uint32_t n_tokens; uint8_t para; };

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
        struct Unit v = { cur, next >= e ? e : next, (uint32_t)cnt, first ? para : 0 };
        if (push(u, nu, cap, v))
            return RET_ENOMEM;
        first = 0;
        cur = next;
    }
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
    struct ChunkSpan *ch = NULL;
    size_t nch = 0, chcap = 0;
    int rc = chunk_sentences(text, len, &starts, &para, &n_st);
    if (rc)
        goto err;
    for (size_t i = 0; i < n_st; i++) {
        size_t s = starts[i], e = i + 1 < n_st ? starts[i + 1] : len;
        size_t te = trim_end(text, s, e), cnt;
        if (tokcount_count(tc, text + s, te - s, &cnt)) {
            rc = RET_ETOKEN;
            goto err;
        }
        if (cnt > o->target_tokens) {
            if ((rc = split_unit(text, s, e, cnt, para[i], o->target_tokens, tc, &u, &nu, &ucap)))
                goto err;
        } else {
            struct Unit v = { s, e, (uint32_t)cnt, para[i] };
            if ((rc = push(&u, &nu, &ucap, v)))
                goto err;
        }
    }
    size_t i = 0, first_new = 0; /* units before first_new repeat the previous chunk's tail */
    while (i < nu) {
        size_t j = i;
        uint64_t sum = 0;
        while (j < nu) {
            if (j > first_new && sum + u[j].n_tokens > o->target_tokens)
                break;
            if (j > first_new && u[j].para && sum >= o->target_tokens / 2)
                break;
            sum += u[j].n_tokens;
            j++;
        }
        if (nch == chcap) {
            size_t c = chcap ? chcap * 2 : 8;
            struct ChunkSpan *p = realloc(ch, c * sizeof *p);
            if (!p) {
                rc = RET_ENOMEM;
                goto err;
            }
            ch = p;
            chcap = c;
        }
        ch[nch].start = u[i].start;
        ch[nch].end = trim_end(text, u[i].start, u[j - 1].end);
        ch[nch].n_tokens = (uint32_t)sum;
        nch++;
        if (j >= nu)
            break;
        size_t k = j;
        uint64_t osum = 0;
        while (o->overlap_tokens && k - 1 > i && osum + u[k - 1].n_tokens <= o->overlap_tokens &&
               osum + u[k - 1].n_tokens + u[j].n_tokens <= o->target_tokens && !u[k].para) {
            k--;
            osum += u[k].n_tokens;
        }
        i = k;
        first_new = j;
    }
    free(starts);
    free(para);
    free(u);
    *out = ch;
    *n_out = nch;
    return RET_OK;
err:
    free(starts);
    free(para);
    free(u);
    free(ch);
    if (rc == RET_ETOKEN)
        return ret_fail(err, errlen, rc, "the token counter failed while chunking");
    return ret_fail(err, errlen, rc, "out of memory while chunking");
}
