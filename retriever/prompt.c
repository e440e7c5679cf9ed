/* Text of the grounded-answer prompt (see prompt.h for the layout). The instruction is kept
 * short so that the smallest budgets (64 tokens) still leave room for a question. */
#include "retriever/prompt.h"

#include <stdio.h>
#include <string.h>

static const char HEAD[] =
    "<|im_start|>system\n"
    "Answer the question using only the documents. Cite the documents you use as [n]. "
    "If they do not contain the answer, reply: " PROMPT_REFUSAL "<|im_end|>\n"
    "<|im_start|>user\n"
    "Documents:\n\n";

const char *prompt_head(void) { return HEAD; }
const char *prompt_doc_separator(void) { return "\n\n"; }
const char *prompt_question_prefix(void) { return "Question: "; }
const char *prompt_tail(void) { return "<|im_end|>\n<|im_start|>assistant\n"; }

/* HEAD stays one literal (tools/eval-longctx.py reads it from this file); its pieces are cut
 * out of it at the end of the system turn. */
static const char TURN_CLOSE[] = "<|im_end|>\n";

const char *prompt_system_open(void) { return HEAD; }
size_t prompt_system_open_len(void) { return (size_t)(strstr(HEAD, TURN_CLOSE) - HEAD); }
const char *prompt_system_separator(void) { return "\n\n"; }
const char *prompt_turn_open(int assistant)
{
    return assistant ? "<|im_start|>assistant\n" : "<|im_start|>user\n";
}
const char *prompt_turn_close(void) { return TURN_CLOSE; }
const char *prompt_documents_head(void)
{
    return HEAD + prompt_system_open_len() + strlen(TURN_CLOSE);
}

/* After the answer: the answer's turn closes, and a new user turn asks for a one-word verdict
 * on both what can go wrong: documents that do not hold the answer, and an answer they do not
 * support. */
static const char CHECK[] =
    "<|im_end|>\n"
    "<|im_start|>user\n"
    "Do the documents answer my question, and is your answer correct according to them? "
    "Reply Yes or No."
    "<|im_end|>\n"
    "<|im_start|>assistant\n";

const char *prompt_check(void) { return CHECK; }
const char *const *prompt_check_words(int yes)
{
    static const char *const yes_words[] = { "Yes", "yes", NULL };
    static const char *const no_words[] = { "No", "no", NULL };
    return yes ? yes_words : no_words;
}

/* Append " " (first) or " › " (after the title) and s, cut to max bytes at a character
 * boundary, to out. */
static int label_part(char *out, size_t *len, size_t cap, int first, const char *s, size_t n,
                      size_t max)
{
    const char *sep = first ? " " : " \xE2\x80\xBA ";
    size_t sl = strlen(sep);
    if (n > max) {
        n = max;
        while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
            n--;
    }
    if (*len + sl + n + 2 > cap)
        return -1;
    memcpy(out + *len, sep, sl);
    *len += sl;
    for (size_t i = 0; i < n; i++)
        out[(*len)++] = (s[i] == '\n' || s[i] == '\r') ? ' ' : s[i];
    return 0;
}

int prompt_label(int marker, const char *title, size_t title_len, const char *heading,
                 size_t heading_len, char *out, size_t cap)
{
    int n = snprintf(out, cap, "[%d]", marker);
    if (n < 0 || (size_t)n >= cap)
        return -1;
    size_t len = (size_t)n;
    if (title_len && label_part(out, &len, cap, 1, title, title_len, PROMPT_MAX_TITLE_BYTES))
        return -1;
    if (heading_len &&
        label_part(out, &len, cap, !title_len, heading, heading_len, PROMPT_MAX_HEADING_BYTES))
        return -1;
    if (len + 2 > cap)
        return -1;
    out[len++] = '\n';
    out[len] = 0;
    return (int)len;
}
