/* Context assembly: encode the fixed frame (with a client's system text), place the earlier
 * turns of a conversation newest first within half of what is left, then place chunks
 * best-first while their label, text and separator fit the budget (skipping ones that do not,
 * trying the rest), optionally reorder by document, and concatenate everything into one token
 * array with exact spans. */
#include "retriever/context.h"

#include <stdlib.h>
#include <string.h>

#include "retriever/prompt.h"
#include "retriever/status.h"

struct Placed {
    size_t rank;
    int32_t *ids; size_t n;          /* the chunk text's tokens */
    size_t text_len;                 /* bytes of the chunk placed (less when truncated) */
    int truncated;
    int32_t *label; size_t n_label;
    int32_t *lead; size_t n_lead;    /* the label with marker PROMPT_COPY_MARKER */
    char label_text[PROMPT_LABEL_BYTES];
    size_t label_len;
};

static int encode_label(const struct TokenCounter *tc, struct Placed *p, int marker,
                        const struct CtxChunk *c)
{
    free(p->label);
    p->label = NULL;
    int len = prompt_label(marker, c->title, c->title_len, c->heading, c->heading_len, p->label_text,
                           sizeof p->label_text);
    if (len < 0)
        return RET_EINPUT;
    p->label_len = (size_t)len;
    return tokcount_encode_alloc(tc, p->label_text, p->label_len, 0, &p->label, &p->n_label);
}

/* The copy label of a placed chunk: its label with the marker every placement shares. */
static int encode_lead(const struct TokenCounter *tc, struct Placed *p, const struct CtxChunk *c)
{
    char text[PROMPT_LABEL_BYTES];
    int len = prompt_label(PROMPT_COPY_MARKER, c->title, c->title_len, c->heading, c->heading_len,
                           text, sizeof text);
    if (len < 0)
        return RET_EINPUT;
    return tokcount_encode_alloc(tc, text, (size_t)len, 0, &p->lead, &p->n_lead);
}

static int is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

/* Longest whitespace-bounded prefix of c's text with at most `avail` tokens; 0 bytes if none. */
static int fit_prefix(const struct TokenCounter *tc, const struct CtxChunk *c, size_t avail,
                      struct Placed *p)
{
    free(p->ids);
    p->ids = NULL;
    p->n = 0;
    size_t *cuts = malloc((c->text_len + 1) * sizeof *cuts), n_cuts = 0;
    if (!cuts)
        return RET_ENOMEM;
    for (size_t i = 1; i < c->text_len; i++)
        if (is_space(c->text[i]) && !is_space(c->text[i - 1]))
            cuts[n_cuts++] = i;
    size_t lo = 0, hi = n_cuts, best = 0; /* best = number of cuts usable (prefix to cuts[best-1]) */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2, cnt;
        if (tokcount_count(tc, c->text, cuts[mid], &cnt)) {
            free(cuts);
            return RET_ETOKEN;
        }
        if (cnt <= avail) {
            best = mid + 1;
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    p->text_len = best ? cuts[best - 1] : 0;
    free(cuts);
    if (p->text_len == 0)
        return RET_OK;
    return tokcount_encode_alloc(tc, c->text, p->text_len, 0, &p->ids, &p->n);
}

static int cmp_doc_order(const void *pa, const void *pb, void *chunks_v)
{
    const struct Placed *a = pa, *b = pb;
    const struct CtxChunk *chunks = chunks_v;
    const struct CtxChunk *x = &chunks[a->rank], *y = &chunks[b->rank];
    size_t n = x->doc_id_len < y->doc_id_len ? x->doc_id_len : y->doc_id_len;
    int c = n ? memcmp(x->doc_id, y->doc_id, n) : 0;
    if (c)
        return c;
    if (x->doc_id_len != y->doc_id_len)
        return x->doc_id_len < y->doc_id_len ? -1 : 1;
    if (x->byte_start != y->byte_start)
        return x->byte_start < y->byte_start ? -1 : 1;
    return (a->rank > b->rank) - (a->rank < b->rank);
}

void ctx_chunks_from_hits(const struct SearchHit *hits, size_t n, struct CtxChunk *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (struct CtxChunk){ hits[i].doc_id, hits[i].doc_id_len, hits[i].title, hits[i].title_len,
                                    hits[i].text, hits[i].text_len, hits[i].chunk, hits[i].byte_start,
                                    hits[i].byte_end, hits[i].score, 0, 0, hits[i].heading,
                                    hits[i].heading_len, hits[i].page_first, hits[i].page_last };
}

void ctx_destroy(struct Context **pc)
{
    struct Context *c = pc ? *pc : NULL;
    if (!c)
        return;
    for (size_t i = 0; i < c->n_cites; i++)
        free(c->cites[i].doc_id);
    free(c->cites);
    free(c->leads);
    free(c->tokens);
    free(c->text);
    free(c);
    *pc = NULL;
}

static void placed_free(struct Placed *p)
{
    free(p->ids);
    free(p->label);
    free(p->lead);
    p->ids = p->label = p->lead = NULL;
    p->n = p->n_label = p->n_lead = 0;   /* a freed entry must never be laid out with stale
                                            counts */
    p->text_len = 0;
}

/* A separately encoded piece of the prompt and its text (borrowed). */
struct Piece {
    int32_t *ids; size_t n;
    const char *text; size_t len;
};

static int piece_encode(const struct TokenCounter *tc, struct Piece *p, const char *text,
                        size_t len, unsigned flags)
{
    p->text = text;
    p->len = len;
    return tokcount_encode_alloc(tc, text, len, flags, &p->ids, &p->n);
}

static void piece_free(struct Piece *p)
{
    free(p->ids);
    p->ids = NULL;
    p->n = 0;
}

/* The frame's pieces before the documents. Without a system text or earlier turns P_HEAD is
 * the whole head (encoded as one, as it always was) and the others stay empty; with them the
 * head is cut into P_HEAD (system turn and instruction), P_CLOSE and P_DOCS_HEAD. */
enum { P_HEAD, P_SYS_SEP, P_SYS, P_CLOSE, P_USER, P_ASSISTANT, P_DOCS_HEAD, P_COUNT };

static int encode_frame(const struct TokenCounter *tc, const struct CtxOptions *o,
                        struct Piece *fr)
{
    int st;
    if (o->system_len == 0 && o->n_history == 0) {
        const char *head = prompt_head();
        return piece_encode(tc, &fr[P_HEAD], head, strlen(head), TC_SPECIAL | TC_ADD_BOS);
    }
    const char *close = prompt_turn_close(), *user = prompt_turn_open(0),
               *assistant = prompt_turn_open(1), *docs = prompt_documents_head(),
               *sep = prompt_system_separator();
    if ((st = piece_encode(tc, &fr[P_HEAD], prompt_system_open(), prompt_system_open_len(),
                           TC_SPECIAL | TC_ADD_BOS)) ||
        (st = piece_encode(tc, &fr[P_CLOSE], close, strlen(close), TC_SPECIAL)) ||
        (st = piece_encode(tc, &fr[P_DOCS_HEAD], docs, strlen(docs), TC_SPECIAL)))
        return st;
    if (o->system_len &&
        ((st = piece_encode(tc, &fr[P_SYS_SEP], sep, strlen(sep), 0)) ||
         (st = piece_encode(tc, &fr[P_SYS], o->system, o->system_len, 0))))
        return st;
    if (o->n_history &&
        ((st = piece_encode(tc, &fr[P_USER], user, strlen(user), TC_SPECIAL)) ||
         (st = piece_encode(tc, &fr[P_ASSISTANT], assistant, strlen(assistant), TC_SPECIAL))))
        return st;
    return RET_OK;
}

int ctx_assemble(const struct TokenCounter *tc, const char *question, size_t question_len,
                 const struct CtxChunk *chunks, size_t n_chunks, const struct CtxOptions *o,
                 struct Context **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!question && question_len)
        return ret_fail(err, errlen, RET_EINPUT, "no question");
    for (size_t i = 0; i < n_chunks; i++)
        if ((!chunks[i].text && chunks[i].text_len) || (!chunks[i].doc_id && chunks[i].doc_id_len))
            return ret_fail(err, errlen, RET_EINPUT, "chunk %zu has no text or id", i);
    if (!o->system && o->system_len)
        return ret_fail(err, errlen, RET_EINPUT, "no system text");
    if (!o->history && o->n_history)
        return ret_fail(err, errlen, RET_EINPUT, "no history");
    for (size_t i = 0; i < o->n_history; i++)
        if ((!o->history[i].text && o->history[i].len) ||
            (o->history[i].assistant != 0 && o->history[i].assistant != 1))
            return ret_fail(err, errlen, RET_EINPUT, "history turn %zu has no text or role", i);
    const char *sep = prompt_doc_separator(), *qp = prompt_question_prefix(), *tail = prompt_tail();
    int32_t *s_ids = NULL, *qp_ids = NULL, *q_ids = NULL, *t_ids = NULL;
    size_t ns = 0, nqp = 0, nq = 0, nt = 0, n_placed = 0;
    struct Piece fr[P_COUNT];
    memset(fr, 0, sizeof fr);
    struct Placed *pl = calloc(n_chunks ? n_chunks : 1, sizeof *pl);
    struct Piece *turns = calloc(o->n_history ? o->n_history : 1, sizeof *turns);
    struct Context *ctx = calloc(1, sizeof *ctx);
    int st = RET_OK;
    if (!pl || !turns || !ctx) {
        st = RET_ENOMEM;
        goto fail;
    }
    if ((st = encode_frame(tc, o, fr)) ||
        (st = tokcount_encode_alloc(tc, sep, strlen(sep), 0, &s_ids, &ns)) ||
        (st = tokcount_encode_alloc(tc, qp, strlen(qp), 0, &qp_ids, &nqp)) ||
        (st = tokcount_encode_alloc(tc, question, question_len, 0, &q_ids, &nq)) ||
        (st = tokcount_encode_alloc(tc, tail, strlen(tail), TC_SPECIAL, &t_ids, &nt)))
        goto fail;
    size_t fixed = nqp + nq + nt;
    for (int k = 0; k < P_COUNT; k++)
        if (k != P_USER && k != P_ASSISTANT)
            fixed += fr[k].n;
    if (fixed > o->budget) {
        st = ret_fail(err, errlen, RET_EBUDGET,
                      "the instruction, %squestion and frame take %zu tokens; the budget is %zu",
                      o->system_len ? "system text, " : "", fixed, o->budget);
        goto out_err;
    }
    /* Earlier turns, newest first, whole, within half of what the fixed part leaves: the
     * documents keep at least the other half. They follow the documents (see the layout in
     * prompt.h): the first placed user turn is asked in the documents' own turn, so that a
     * follow-up's prompt begins with the whole prompt of the question it follows. A user
     * turn's cost counts one turn opening: the first has none of its own, but the question
     * after the turns then needs one. */
    size_t turns_cap = (o->budget - fixed) / 2, turns_used = 0, first_turn = o->n_history;
    size_t turn_cost[2] = { fr[P_USER].n + nqp + fr[P_CLOSE].n, fr[P_ASSISTANT].n + fr[P_CLOSE].n };
    for (size_t i = o->n_history; i-- > 0;) {
        const struct CtxTurn *t = &o->history[i];
        if ((st = piece_encode(tc, &turns[i], t->text, t->len, 0)))
            goto fail;
        size_t cost = turn_cost[t->assistant] + turns[i].n;
        if (turns_used + cost > turns_cap) {
            piece_free(&turns[i]);
            break;
        }
        turns_used += cost;
        first_turn = i;
    }
    /* an answer whose question was left out is left out with it: the documents' turn asks */
    while (first_turn < o->n_history && o->history[first_turn].assistant) {
        turns_used -= turn_cost[1] + turns[first_turn].n;
        piece_free(&turns[first_turn]);
        first_turn++;
    }
    fixed += turns_used;
    size_t remaining = o->budget - fixed;
    for (size_t i = 0; i < n_chunks && remaining > ns; i++) {
        struct Placed *p = &pl[n_placed];
        p->rank = i;
        if ((st = encode_label(tc, p, (int)n_placed + 1, &chunks[i])) ||
            (st = tokcount_encode_alloc(tc, chunks[i].text, chunks[i].text_len, 0, &p->ids, &p->n)))
            goto fail;
        p->text_len = chunks[i].text_len;
        size_t cost = p->n_label + p->n + ns;
        if (cost <= remaining && p->n > 0) {
            remaining -= cost;
            n_placed++;
        } else {
            placed_free(p);
        }
    }
    if (n_placed == 0 && n_chunks > 0 && !o->no_truncate) {
        struct Placed *p = &pl[0];
        p->rank = 0;
        if ((st = encode_label(tc, p, 1, &chunks[0])))
            goto fail;
        if (p->n_label + ns < remaining) {
            if ((st = fit_prefix(tc, &chunks[0], remaining - p->n_label - ns, p)))
                goto fail;
            if (p->n > 0 && p->n_label + p->n + ns <= remaining) {
                p->truncated = p->text_len < chunks[0].text_len;
                n_placed = 1;
            }
        }
        if (!n_placed)
            placed_free(p);
    }
    size_t n_pinned = 0;  /* placed in the order given, so they lead pl[] */
    while (n_pinned < n_placed && pl[n_pinned].rank < o->pinned)
        n_pinned++;
    if (o->order != CTX_ORDER_RANK && n_placed > n_pinned + 1) {
        struct Placed *rest = pl + n_pinned;
        size_t n_rest = n_placed - n_pinned;
        if (o->order == CTX_ORDER_DOCUMENT) {
            qsort_r(rest, n_rest, sizeof *rest, cmp_doc_order, (void *)chunks);
        } else {
            for (size_t i = 0, j = n_rest - 1; i < j; i++, j--) {
                struct Placed t = rest[i];
                rest[i] = rest[j];
                rest[j] = t;
            }
        }
        /* Markers follow the new order; longer numbers may cost a token: drop the worst-ranked
         * chunks until the prompt fits again. */
        for (;;) {
            size_t total = fixed;
            for (size_t i = 0; i < n_placed; i++) {
                if ((st = encode_label(tc, &pl[i], (int)i + 1, &chunks[pl[i].rank])))
                    goto fail;
                total += pl[i].n_label + pl[i].n + ns;
            }
            if (total <= o->budget)
                break;
            size_t worst = 0;
            for (size_t i = 1; i < n_placed; i++)
                if (pl[i].rank > pl[worst].rank)
                    worst = i;
            placed_free(&pl[worst]);
            memmove(&pl[worst], &pl[worst + 1], (n_placed - worst - 1) * sizeof *pl);
            n_placed--;
            memset(&pl[n_placed], 0, sizeof *pl);
        }
    }
    /* Lay out tokens and text. */
    size_t n_tok = fixed, n_text = strlen(qp) + question_len + strlen(tail);
    for (int k = 0; k < P_COUNT; k++)
        if (k != P_USER && k != P_ASSISTANT)
            n_text += fr[k].len;
    for (size_t i = first_turn; i < o->n_history; i++)
        n_text += o->history[i].assistant ? fr[P_ASSISTANT].len + turns[i].len + fr[P_CLOSE].len
                                          : fr[P_USER].len + strlen(qp) + turns[i].len + fr[P_CLOSE].len;
    size_t n_lead = 0;
    for (size_t i = 0; i < n_placed; i++) {
        if ((st = encode_lead(tc, &pl[i], &chunks[pl[i].rank])))
            goto fail;
        n_tok += pl[i].n_label + pl[i].n + ns;
        n_text += pl[i].label_len + pl[i].text_len + strlen(sep);
        n_lead += pl[i].n_lead;
    }
    ctx->tokens = malloc((n_tok ? n_tok : 1) * sizeof *ctx->tokens);
    ctx->text = malloc(n_text + 1);
    ctx->cites = calloc(n_placed ? n_placed : 1, sizeof *ctx->cites);
    ctx->leads = malloc((n_lead ? n_lead : 1) * sizeof *ctx->leads);
    if (!ctx->tokens || !ctx->text || !ctx->cites || !ctx->leads) {
        st = RET_ENOMEM;
        goto fail;
    }
    size_t tk = 0, tx = 0;
/* (an empty piece may come with NULL pointers: memcpy must not see them) */
#define EMIT(ids, n, s, len) do { \
        if (n) \
            memcpy(ctx->tokens + tk, (ids), (n) * sizeof(int32_t)); \
        tk += (n); \
        if (len) \
            memcpy(ctx->text + tx, (s), (len)); \
        tx += (len); } while (0)
#define EMIT_PIECE(pc) EMIT((pc)->ids, (pc)->n, (pc)->text, (pc)->len)
    for (int k = P_HEAD; k <= P_CLOSE; k++)
        EMIT_PIECE(&fr[k]);
    EMIT_PIECE(&fr[P_DOCS_HEAD]);
    ctx->documents.start = tk;
    for (size_t i = 0; i < n_placed; i++) {
        const struct CtxChunk *c = &chunks[pl[i].rank];
        struct CtxCitation *ci = &ctx->cites[ctx->n_cites];
        ci->doc_id = malloc(c->doc_id_len + 1 + c->heading_len + 1);
        if (!ci->doc_id) {
            st = RET_ENOMEM;
            goto fail;
        }
        ctx->n_cites++;
        memcpy(ci->doc_id, c->doc_id, c->doc_id_len);
        ci->doc_id[c->doc_id_len] = 0;
        ci->doc_id_len = c->doc_id_len;
        char *heading = ci->doc_id + c->doc_id_len + 1;
        if (c->heading_len)
            memcpy(heading, c->heading, c->heading_len);
        heading[c->heading_len] = 0;
        ci->heading = heading;
        ci->heading_len = c->heading_len;
        ci->page_first = c->page_first;
        ci->page_last = c->page_last;
        ci->marker = (int)i + 1;
        ci->rank = pl[i].rank;
        ci->chunk = c->chunk;
        ci->ref = c->ref;
        ci->byte_start = c->byte_start;
        ci->byte_end = c->byte_start + pl[i].text_len;
        ci->score = c->score;
        ci->truncated = pl[i].truncated;
        ci->whole = c->whole && !pl[i].truncated;
        ci->lead.start = ctx->n_leads;
        if (pl[i].n_lead)
            memcpy(ctx->leads + ctx->n_leads, pl[i].lead, pl[i].n_lead * sizeof *ctx->leads);
        ctx->n_leads += pl[i].n_lead;
        ci->lead.end = ctx->n_leads;
        EMIT(pl[i].label, pl[i].n_label, pl[i].label_text, pl[i].label_len);
        ci->tokens.start = tk;
        ci->bytes.start = tx;
        EMIT(pl[i].ids, pl[i].n, c->text, pl[i].text_len);
        ci->tokens.end = tk;
        ci->bytes.end = tx;
        EMIT(s_ids, ns, sep, strlen(sep));
    }
    ctx->documents.end = tk;
    /* the earlier turns, the first in the documents' turn; then the question opens its own */
    ctx->history.start = tk;
    for (size_t i = first_turn; i < o->n_history; i++) {
        if (o->history[i].assistant) {
            EMIT_PIECE(&fr[P_ASSISTANT]);
        } else {
            if (i > first_turn)
                EMIT_PIECE(&fr[P_USER]);
            EMIT(qp_ids, nqp, qp, strlen(qp));
        }
        EMIT_PIECE(&turns[i]);
        EMIT_PIECE(&fr[P_CLOSE]);
    }
    if (first_turn < o->n_history)
        EMIT_PIECE(&fr[P_USER]);
    ctx->history.end = tk;
    EMIT(qp_ids, nqp, qp, strlen(qp));
    ctx->question.start = tk;
    EMIT(q_ids, nq, question, question_len);
    ctx->question.end = tk;
    EMIT(t_ids, nt, tail, strlen(tail));
#undef EMIT_PIECE
#undef EMIT
    ctx->text[tx] = 0;
    ctx->n_tokens = tk;
    ctx->text_len = tx;
    ctx->n_offered = n_chunks;
    ctx->n_skipped = n_chunks - n_placed; /* includes chunks never tried once the budget ran out */
    ctx->n_turns = o->n_history - first_turn;
    ctx->n_turns_skipped = first_turn;
    *out = ctx;
    ctx = NULL;
    goto done;
fail:
    if (st == RET_ENOMEM)
        ret_fail(err, errlen, st, "out of memory assembling the context");
    else
        ret_fail(err, errlen, st, "the token counter failed assembling the context");
out_err:
    ctx_destroy(&ctx);
done:
    for (size_t i = 0; pl && i < n_chunks; i++)
        placed_free(&pl[i]);
    free(pl);
    for (size_t i = 0; turns && i < o->n_history; i++)
        piece_free(&turns[i]);
    free(turns);
    for (int k = 0; k < P_COUNT; k++)
        piece_free(&fr[k]);
    free(s_ids); free(qp_ids); free(q_ids); free(t_ids);
    return st;
}
