/* diffrag ask: one question over a collection and/or files sent inline; prints the answer
 * (streamed as it is generated with --stream), its sources and its grounding figures, or the
 * reply as JSON. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clients/cli/cli.h"
#include "clients/ingest/docsrc.h"
#include "clients/ingest/extract_run.h"
#include "text/json.h"

#define ASK_ID "ask"
/* The most text a -d file's extraction may give: what `diffrag ingest` holds a document to. */
#define ASK_MAX_EXTRACTED ((size_t)15 << 20)

struct Stream {
    const struct CliArgs *a;
    int last_newline; /* the answer printed so far ends with a newline */
    size_t bytes;
};

static int on_delta(void *user, const char *text, size_t len)
{
    struct Stream *s = user;
    if (s->a->json) {
        struct JsonBuf b = { 0 };
        json_buf_puts(&b, "{\"id\": \"" ASK_ID "\", \"delta\": ");
        json_buf_string(&b, text, len);
        json_buf_puts(&b, "}\n");
        if (!b.oom)
            fputs(b.p, stdout);
        json_buf_free(&b);
    } else {
        cli_print_safe(text, len, 1);
    }
    if (len) {
        s->last_newline = text[len - 1] == '\n';
        s->bytes += len;
    }
    fflush(stdout);
    return 0;
}

/* One line when the prompt left out part of the documents: how much was read, and how to read
 * more: a larger budget when it left matching chunks out, a lower relevance floor when that
 * dropped chunks the search found. */
static void print_read(const DiffragAnswer *r)
{
    const DiffragContextRead *x = &r->context;
    if (!r->has_context || x->whole)
        return;
    int left = x->chunks_left_out > 0 || x->chunks_below_floor > 0 ||
               (x->doc_tokens >= 0 && x->placed_tokens < x->doc_tokens);
    if (!left)
        return;
    char of[64] = "", floor[96] = "";
    if (x->doc_tokens >= 0)
        snprintf(of, sizeof of, " of %lld", (long long)x->doc_tokens);
    if (x->chunks_below_floor > 0)
        snprintf(floor, sizeof floor, ", %lld under the relevance floor",
                 (long long)x->chunks_below_floor);
    const char *hint = x->chunks_left_out > 0 && x->chunks_below_floor > 0
                           ? "a larger --max-context-tokens and a lower --relevance-floor read more"
                       : x->chunks_left_out > 0 ? "a larger --max-context-tokens reads more"
                       : x->chunks_below_floor > 0 ? "a lower --relevance-floor reads more"
                       : "the rest matched no word of the question or fell past --top-k";
    printf("read: %lld%s document tokens: %s%lld of %lld matching chunks placed, %lld left "
           "out%s; %s\n", (long long)x->placed_tokens, of,
           x->window ? "the best document's opening in order, then the best chunks outside it; "
                     : "",
           (long long)x->chunks_placed,
           (long long)x->chunks_matched, (long long)x->chunks_left_out, floor, hint);
}

/* A declined answer: why, and what the model had written (streamed: shown above already). */
static void print_declined(const DiffragAnswer *r, int streamed)
{
    const char *why = r->decline_reason ? r->decline_reason : "";
    printf("declined: the documents do not say (%s)\n",
           !strcmp(why, "no_match") ? "retrieval found nothing on the question"
           : !strcmp(why, "flagged") ? "the detector flagged the model's answer"
           : !strcmp(why, "model_refused") ? "the model found no answer in them" : why);
    if (r->attempt && streamed) {
        printf("attempt: the streamed text above, replaced by: ");
        cli_print_safe(r->answer, r->answer_len, 1);
        putchar('\n');
    } else if (r->attempt) {
        printf("attempt: ");
        cli_print_safe(r->attempt, r->attempt_len, 1);
        putchar('\n');
    }
}

#define QUOTE_SHOWN 100 /* characters of a quote shown; a longer one is cut with "…" */

/* One line per quoted span of a quote-mode answer (or of its attempt), after the sources:
 *   quote [1] notes/rhine.txt bytes 36-64: "about 1,230 kilometres long"
 * the text on one line (each run of whitespace a space), cut at QUOTE_SHOWN characters. */
static void print_quotes(const DiffragAnswer *r)
{
    if (!r->answer_mode || strcmp(r->answer_mode, "quote"))
        return;
    if (r->n_quotes == 0)
        printf("quotes: none (the answer quotes nothing)\n");
    for (size_t i = 0; i < r->n_quotes; i++) {
        const DiffragQuote *q = &r->quotes[i];
        char line[4 * QUOTE_SHOWN + 8];
        size_t n = 0, chars = 0, k = 0;
        while (k < q->text_len && (q->text[k] == ' ' || (q->text[k] >= '\t' && q->text[k] <= '\r')))
            k++;
        for (int space = 0; k < q->text_len; k++) {
            unsigned char ch = (unsigned char)q->text[k];
            if (ch == ' ' || (ch >= '\t' && ch <= '\r')) {
                space = 1;
                continue;
            }
            /* a character starts here (or the buffer is full: text cut inside a character) */
            if ((ch & 0xC0) != 0x80 || n + 8 > sizeof line) {
                if (chars + space >= QUOTE_SHOWN || n + 8 > sizeof line) {
                    memcpy(line + n, "\xe2\x80\xa6", 3);   /* … */
                    n += 3;
                    break;
                }
                chars += 1 + space;
            }
            if (space)
                line[n++] = ' ';
            space = 0;
            line[n++] = (char)ch;
        }
        printf("quote [%lld] ", (long long)q->marker);
        cli_print_safe(q->doc_id, strlen(q->doc_id), 0);
        printf(" bytes %lld-%lld: \"", (long long)q->start, (long long)q->end);
        cli_print_safe(line, n, 0);
        printf("\"\n");
    }
}

/* The detector's name, or "" when the daemon has no calibrated detector for its model. */
static const char *detector_name(const DiffragGrounding *g)
{
    return g->detector && *g->detector && strcmp(g->detector, "none") ? g->detector : "";
}

/* The second line: every figure the daemon measured, named (docs/groundedness.md defines
 * each). noun: "answer", or "attempt" for a declined answer's figures. */
static void print_grounding_details(const DiffragGrounding *g, const char *noun)
{
    const char *sep = "  details: ";
    if (!isnan(g->unsupported_token_ratio)) {
        /* a share of the answer's tokens: those whose bytes overlap a content word the
         * documents lack */
        printf("%s%s tokens on words absent from the documents %.1f%%", sep, noun,
               100.0 * g->unsupported_token_ratio);
        if (g->answer_tokens > 0)
            printf(" (%lld of %lld)",
                   (long long)llround(g->unsupported_token_ratio * (double)g->answer_tokens),
                   (long long)g->answer_tokens);
        sep = ", ";
    }
    if (!isnan(g->quote_removed)) {
        /* quote mode: the share of the model's probability, per answer token on average, on
         * tokens that continue no span of the documents (the constraint removed it) */
        printf("%sprobability quote mode removed %.1f%%", sep, 100.0 * g->quote_removed);
        sep = ", ";
    }
    const struct { const char *name; int digits; double v; } f[] = {
        { "lookback ratio", 3, g->lookback_ratio },
        { "mean logprob", 2, g->mean_logprob },
        { "self-check", 2, g->self_check },
        { "context reliance", 2, g->context_reliance },
        { "hidden-state probe", 2, g->hidden_probe },
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        if (isnan(f[i].v))
            continue;
        printf("%s%s %.*f", sep, f[i].name, f[i].digits, f[i].v);
        sep = ", ";
    }
    if (sep[0] == ',') /* something printed */
        putchar('\n');
}

/* The grounding verdict in words, with the score and detector behind it, then the figures.
 * policy: the query's --unsupported (NULL: the daemon's). */
static void print_grounding(const DiffragAnswer *r, const char *policy)
{
    if (!r->has_grounding) {
        printf("grounding: not reported by this daemon\n");
        return;
    }
    const DiffragGrounding *g = &r->grounding;
    const char *why = r->declined && r->decline_reason ? r->decline_reason : "";
    if (r->declined && !strcmp(why, "no_match")) {
        printf("grounding: none: declined before generating (reason: no_match), nothing to "
               "score\n");
        return;
    }
    if (g->answer_tokens == 0 && (r->completion_tokens == 0 || isnan(g->lookback_ratio))) {
        /* no token (or only the one that ended the turn): no figure to show, all nil */
        if (r->completion_tokens == 0 && strcmp(r->finish_reason, "cancelled") == 0)
            printf("grounding: none: the request was cancelled before its first token\n");
        else
            printf("grounding: none: the answer has no token\n");
        return;
    }
    /* "score 0.820, 2 of 8 answer tokens in flagged windows, detector NAME", or why the answer
     * was not scored */
    char score[256];
    const char *det = detector_name(g);
    if (isnan(g->score) && *det)
        snprintf(score, sizeof score, "not scored: detector %s needs hidden-state figures the "
                 "worker did not send", det);
    else if (isnan(g->score))
        snprintf(score, sizeof score, "not scored: no calibrated detector for this model");
    else if (g->flagged)
        snprintf(score, sizeof score, "score %.3f, %lld of %lld %stokens in flagged windows%s%s",
                 g->score, (long long)g->flagged_tokens, (long long)g->answer_tokens,
                 r->declined ? "" : "answer ", *det ? ", detector " : "", det);
    else
        snprintf(score, sizeof score, "score %.3f%s%s", g->score, *det ? ", detector " : "",
                 det);
    if (r->declined && !strcmp(why, "flagged"))
        printf("grounding: declined (reason: flagged): the attempt above is FLAGGED (%s)\n", score);
    else if (r->declined && !strcmp(why, "model_refused"))
        printf("grounding: declined (reason: model_refused): the attempt above says the "
               "documents do not answer (%s)\n", score);
    else {
        if (r->declined) {
            printf("grounding: declined (reason: ");
            cli_print_safe(why, strlen(why), 0);
            printf("), of the attempt above: ");
        } else {
            printf("grounding: ");
        }
        if (g->abstained)
            printf("the model said the documents do not answer (abstained; %s)\n", score);
        else if (g->flagged)
            printf("FLAGGED: the %s may not rest on the documents (%s)\n",
                   r->declined ? "attempt" : "answer", score);
        else if (isnan(g->score))
            printf("%s\n", score);
        else if (policy && !strcmp(policy, "answer"))
            printf("not flagged: --unsupported answer flags nothing (%s)\n", score);
        else
            printf("not flagged: likely supported by the documents (%s)\n", score);
    }
    print_grounding_details(g, r->declined ? "attempt" : "answer");
}

/* Where a source is: its document, then its heading path and its pages when it has them:
 *   docs/protocol.md › Requests › cancel
 *   report.pdf › Results, pp. 3–4
 *   report.pdf, p. 12 */
static void print_where(const DiffragCitation *c)
{
    cli_print_safe(c->doc_id, strlen(c->doc_id), 0);
    if (c->heading && c->heading_len) {
        fputs(" \xe2\x80\xba ", stdout);
        cli_print_safe(c->heading, c->heading_len, 0);
    }
    if (c->page_first > 0 && c->page_last > c->page_first)
        printf(", pp. %lld\xe2\x80\x93%lld", (long long)c->page_first, (long long)c->page_last);
    else if (c->page_first > 0)
        printf(", p. %lld", (long long)c->page_first);
}

static void print_details(const DiffragAnswer *r, const char *policy)
{
    if (r->n_citations == 0)
        printf("sources: none (nothing retrieved)\n");
    else
        printf("sources:\n");
    for (size_t i = 0; i < r->n_citations; i++) {
        const DiffragCitation *c = &r->citations[i];
        printf("  [%lld] ", (long long)c->marker);
        print_where(c);
        if (c->whole)
            printf("  whole document, score %.2f, bytes %lld-%lld%s\n", c->score,
                   (long long)c->start, (long long)c->end, c->cited ? ", cited" : "");
        else
            printf("  chunk %lld, score %.2f, bytes %lld-%lld%s%s\n", (long long)c->chunk,
                   c->score, (long long)c->start, (long long)c->end, c->cited ? ", cited" : "",
                   c->truncated ? ", truncated" : "");
    }
    print_quotes(r);
    print_read(r);
    print_grounding(r, policy);
    char cached[112] = "";
    if (r->cached_tokens > 0)
        snprintf(cached, sizeof cached, ", %lld from the prefix cache", (long long)r->cached_tokens);
    if (r->reused_tokens > 0)
        snprintf(cached + strlen(cached), sizeof cached - strlen(cached),
                 ", %lld blended from stored chunk KV", (long long)r->reused_tokens);
    printf("finish: %s; tokens: %lld prompt (%lld from documents%s), %lld generated; "
           "first token %.0f ms, total %.0f ms\n", r->finish_reason,
           (long long)r->prompt_tokens, (long long)r->context_tokens, cached,
           (long long)r->completion_tokens, r->ttft_ms, r->total_ms);
}

/* Reads a -d file: a PDF, DOCX or HTML file (by its first bytes, as `diffrag ingest` decides)
 * becomes the Markdown diffrag-extract makes of it, with its title; anything else is sent as
 * it is and must be UTF-8 text. 0 with *text (and *title for an extracted file) malloc'd, or
 * -1 after a message naming the file. */
static int read_doc_file(const char *path, char **text, size_t *len, char **title)
{
    char *bytes = NULL;
    size_t n = 0;
    *text = *title = NULL;
    if (cli_read_file(path, &bytes, &n)) {
        fprintf(stderr, "diffrag ask: %s: %s\n", path, strerror(errno));
        return -1;
    }
    enum DocFormat fmt = docformat_sniff((const unsigned char *)bytes,
                                         n < DOCFORMAT_SNIFF_BYTES ? n : DOCFORMAT_SNIFF_BYTES);
    if (fmt == DOCFMT_TEXT) {
        if (n == 0 || !cli_utf8_ok(bytes, n)) {
            fprintf(stderr, "diffrag ask: %s: %s\n", path,
                    n ? "not UTF-8 text (nor a PDF, DOCX or HTML file)" : "empty");
            free(bytes);
            return -1;
        }
        *text = bytes;
        *len = n;
        return 0;
    }
    /* the helper reads the bytes already read (a file, or stdin), from a file in memory */
    char err[1280];
    struct DocsrcOptions o = {.max_file_bytes = ASK_MAX_EXTRACTED};
    struct DocsrcDoc d = {0};
    int fd = memfd_create("diffrag-ask", MFD_CLOEXEC), st = DOCSRC_EIO;
    size_t done = 0;
    while (fd >= 0 && done < n) {
        ssize_t w = write(fd, bytes + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        done += (size_t)w;
    }
    if (fd < 0 || done < n || lseek(fd, 0, SEEK_SET) != 0)
        snprintf(err, sizeof err, "%s: cannot hold it for " EXTRACT_PROGRAM ": %s", path,
                 strerror(errno));
    else
        st = docsrc_extract(&o, path, fd, n, fmt, &d, err, sizeof err);
    if (fd >= 0)
        close(fd);
    free(bytes);
    if (st == DOCSRC_OK && d.text_len == 0) {
        snprintf(err, sizeof err, "%s: %s %s: no text in it", path,
                 fmt == DOCFMT_HTML ? "an" : "a", docformat_name(fmt));
        docsrc_doc_free(&d);
        st = DOCSRC_EFILE;
    }
    if (st != DOCSRC_OK) {
        fprintf(stderr, "diffrag ask: %s\n", err);
        return -1;
    }
    *text = d.text;
    *len = d.text_len;
    *title = d.title;
    return 0;
}

int cmd_ask(const struct CliArgs *a)
{
    DiffragClient *c = NULL;
    DiffragAnswer *ans = NULL;
    DiffragDoc *docs = NULL;
    char **texts = NULL, **titles = NULL;
    char *question = NULL;
    size_t qlen = 0;
    int rc = CLI_EXIT_LOCAL;

    if (a->n_doc_ids && !a->collection_given && a->n_doc_files)
        return cli_usage_error("ask", "--doc-id restricts a collection: give -c too");
    if (strcmp(a->pos[0], "-") == 0) {
        if (cli_read_file("-", &question, &qlen)) {
            fprintf(stderr, "diffrag ask: reading the question from stdin: %s\n", strerror(errno));
            return CLI_EXIT_LOCAL;
        }
    } else {
        question = strdup(a->pos[0]);
        if (!question)
            return CLI_EXIT_LOCAL;
        qlen = strlen(question);
    }
    while (qlen && (question[qlen - 1] == '\n' || question[qlen - 1] == '\r' ||
                    question[qlen - 1] == ' ' || question[qlen - 1] == '\t'))
        question[--qlen] = 0;
    if (qlen == 0) {
        rc = cli_usage_error("ask", "the question is empty");
        goto out;
    }
    if (!cli_utf8_ok(question, qlen)) {
        rc = cli_usage_error("ask", "the question is not UTF-8 text");
        goto out;
    }
    if (a->n_doc_files) {
        docs = calloc(a->n_doc_files, sizeof *docs);
        texts = calloc(a->n_doc_files, sizeof *texts);
        titles = calloc(a->n_doc_files, sizeof *titles);
        if (!docs || !texts || !titles)
            goto out;
    }
    for (size_t i = 0; i < a->n_doc_files; i++) {
        size_t len;
        if (read_doc_file(a->doc_files[i], &texts[i], &len, &titles[i]))
            goto out;
        /* the path names it in citations; a text file has no title, so that its prompt is
         * the one the same text gets through the Python client or the OpenAI API (a bare text
         * has none) and the prefix cache serves it to both; an extracted file has its own */
        docs[i].id = a->doc_files[i];
        docs[i].title = titles[i];
        docs[i].text = texts[i];
        docs[i].text_len = len;
    }

    DiffragQuery q;
    memset(&q, 0, sizeof q);
    q.question = question;
    q.collection = a->collection_given || !a->n_doc_files ? a->collection : NULL;
    q.docs = docs;
    q.n_docs = a->n_doc_files;
    q.doc_ids = a->doc_ids;
    q.n_doc_ids = a->n_doc_ids;
    q.top_k = a->top_k;
    q.max_context_tokens = a->max_context_tokens;
    q.relevance_floor = a->relevance_floor;
    q.relevance_floor_given = a->relevance_floor_given;
    q.max_tokens = a->max_tokens;
    q.temperature = a->temperature;
    q.top_p = a->top_p;
    q.seed = a->seed;
    q.stop = a->stops;
    q.n_stop = a->n_stops;
    q.deadline_ms = a->deadline_ms;
    q.order = a->order;
    q.unsupported = a->unsupported;
    q.answer_mode = a->answer_mode;
    q.id = ASK_ID;

    rc = cli_connect(a, &c);
    if (rc)
        goto out;
    struct Stream s = { .a = a, .last_newline = 1 };
    int st = diffrag_query(c, &q, a->stream ? on_delta : NULL, &s, &ans);
    if (st) {
        if (a->stream && !a->json && !s.last_newline)
            putchar('\n');
        rc = cli_fail(a, c, st);
        goto out;
    }
    if (a->json) {
        printf("%s\n", ans->json);
    } else {
        if (!a->stream)
            cli_print_safe(ans->answer, ans->answer_len, 1);
        int nl = a->stream ? s.last_newline : ans->answer_len && ans->answer[ans->answer_len - 1] == '\n';
        if (!nl)
            putchar('\n');
        putchar('\n');
        if (ans->declined)
            print_declined(ans, a->stream);
        print_details(ans, a->unsupported);
    }
    rc = strcmp(ans->finish_reason, "cancelled") == 0 && cli_interrupted ? CLI_EXIT_INTERRUPTED
                                                                         : CLI_EXIT_OK;
out:
    fflush(stdout);
    diffrag_answer_free(&ans);
    cli_disconnect(&c);
    for (size_t i = 0; i < a->n_doc_files; i++) {
        free(texts ? texts[i] : NULL);
        free(titles ? titles[i] : NULL);
    }
    free(texts);
    free(titles);
    free(docs);
    free(question);
    return rc;
}
