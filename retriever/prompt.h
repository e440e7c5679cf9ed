/* The prompt layout for grounded answering, kept in one place so it can be changed: a ChatML
 * frame whose system turn tells the model to answer only from the documents, cite them as [n]
 * and otherwise give the fixed refusal; the user turn lists the documents (each a label
 * "[n] Title" and its text) and then the question.
 *
 *   <|im_start|>system\n INSTRUCTION <|im_end|>\n<|im_start|>user\nDocuments:\n\n   (head)
 *   [1] Title\n  CHUNK TEXT  \n\n                                                  (per chunk)
 *   Question:  QUESTION  <|im_end|>\n<|im_start|>assistant\n                       (tail)
 *
 * and, for the self-check after an answer, a closing of its turn and a second user turn
 * (prompt_check).
 *
 * Only the head and tail are encoded with special-token parsing; titles, chunks and the
 * question never are, so text in a document cannot forge a turn boundary. */
#ifndef DIFFRAG_PROMPT_H
#define DIFFRAG_PROMPT_H

#include <stddef.h>

#define PROMPT_REFUSAL "I cannot find the answer in the provided documents."
#define PROMPT_MAX_TITLE_BYTES 200   /* titles are cut (at a character boundary) in labels */

const char *prompt_head(void);            /* frame + instruction + "Documents:\n\n" */
const char *prompt_doc_separator(void);   /* after each chunk's text */
const char *prompt_question_prefix(void); /* before the question */
const char *prompt_tail(void);            /* after the question: closes the user turn */

/* The self-check (docs/groundedness.md): appended after the answer's tokens, it closes the
 * answer's turn and asks whether the documents answer the question and support the answer; the model's
 * next-token probabilities of the verdict words (NULL-terminated lists: yes != 0 the words
 * for "supported", else for "not supported") are the signal. Encoded with special-token
 * parsing. */
const char *prompt_check(void);
const char *const *prompt_check_words(int yes);

/* Write the label for citation `marker` into out (cap bytes, NUL-terminated): "[n] Title\n",
 * or "[n]\n" without a title; newlines in the title become spaces. Returns the length, or -1
 * when cap is too small (cap >= PROMPT_MAX_TITLE_BYTES + 32 always suffices). */
int prompt_label(int marker, const char *title, size_t title_len, char *out, size_t cap);

#endif
