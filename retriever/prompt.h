/* The prompt layout for grounded answering, kept in one place so it can be changed: a ChatML
 * frame whose system turn tells the model to answer only from the documents, cite them as [n]
 * and otherwise give the fixed refusal; the user turn lists the documents (each a label
 * "[n] Title › Heading › Subheading", the title and the chunk's heading path, and its text)
 * and then the question.
 *
 *   <|im_start|>system\n INSTRUCTION <|im_end|>\n<|im_start|>user\nDocuments:\n\n   (head)
 *   [1] Title\n  CHUNK TEXT  \n\n                                                  (per chunk)
 *   Question:  QUESTION  <|im_end|>\n<|im_start|>assistant\n                       (tail)
 *
 * and, for the self-check after an answer, a closing of its turn and a second user turn
 * (prompt_check).
 *
 * A client's system text goes after the instruction, and the earlier turns of a conversation
 * after the documents: the first placed user turn is asked in the documents' turn, as its
 * question was, so that a follow-up's prompt begins with the prompt of the question it
 * follows (and takes it from the prefix cache). The head is then laid out in its pieces, cut
 * where a special token starts so that, encoded apart, they give the head's own tokens:
 *
 *   <|im_start|>system\n INSTRUCTION                   (prompt_system_open)
 *   \n\n  SYSTEM TEXT                                   (prompt_system_separator, the client's)
 *   <|im_end|>\n                                        (prompt_turn_close)
 *   <|im_start|>user\nDocuments:\n\n                    (prompt_documents_head)
 *   [1] Title\n  CHUNK TEXT  \n\n                       (per chunk)
 *   Question:  CONTENT  <|im_end|>\n                    (the first earlier user turn)
 *   <|im_start|>assistant\n  CONTENT  <|im_end|>\n      (per later turn: prompt_turn_open,
 *   <|im_start|>user\nQuestion:  CONTENT  <|im_end|>\n   the content, prompt_turn_close)
 *   <|im_start|>user\nQuestion:  QUESTION  <|im_end|>\n<|im_start|>assistant\n
 *
 * Answers whose question was left out (the oldest turns, past the budget) are left out too.
 *
 * Only the frame pieces are encoded with special-token parsing; titles, chunks, the question,
 * the system text and the turns' contents never are, so text in them cannot forge a turn
 * boundary. */
#ifndef DIFFRAG_PROMPT_H
#define DIFFRAG_PROMPT_H

#include <stddef.h>

#define PROMPT_REFUSAL "I cannot find the answer in the provided documents."
#define PROMPT_MAX_TITLE_BYTES 200   /* titles are cut (at a character boundary) in labels */
#define PROMPT_MAX_HEADING_BYTES 200 /* and so are heading paths */
#define PROMPT_LABEL_BYTES (PROMPT_MAX_TITLE_BYTES + PROMPT_MAX_HEADING_BYTES + 40) /* suffices */

const char *prompt_head(void);            /* frame + instruction + "Documents:\n\n" */
const char *prompt_doc_separator(void);   /* after each chunk's text */
const char *prompt_question_prefix(void); /* before the question */
const char *prompt_tail(void);            /* after the question: closes the user turn */

/* The head in pieces (see the layout above): the head is exactly
 * prompt_system_open()[0..prompt_system_open_len()) + prompt_turn_close() +
 * prompt_documents_head(). prompt_system_open is not NUL-terminated at its length (it points
 * into the head). */
const char *prompt_system_open(void);
size_t prompt_system_open_len(void);
const char *prompt_system_separator(void);   /* between the instruction and a system text */
const char *prompt_turn_open(int assistant); /* "<|im_start|>user\n" or "...assistant\n" */
const char *prompt_turn_close(void);         /* "<|im_end|>\n" */
const char *prompt_documents_head(void);     /* the user turn's opening, "Documents:\n\n" */

/* The self-check (docs/groundedness.md): appended after the answer's tokens, it closes the
 * answer's turn and asks whether the documents answer the question and support the answer; the model's
 * next-token probabilities of the verdict words (NULL-terminated lists: yes != 0 the words
 * for "supported", else for "not supported") are the signal. Encoded with special-token
 * parsing. */
const char *prompt_check(void);
const char *const *prompt_check_words(int yes);

/* Write the label for citation `marker` into out (cap bytes, NUL-terminated): "[n] Title\n",
 * "[n] Title › Heading path\n" for a chunk with a heading path (chunker.h), "[n] Heading path\n"
 * without a title, or "[n]\n" with neither; newlines become spaces. Returns the length, or -1
 * when cap is too small (cap >= PROMPT_LABEL_BYTES always suffices). */
int prompt_label(int marker, const char *title, size_t title_len, const char *heading,
                 size_t heading_len, char *out, size_t cap);

/* The marker of the label a chunk's stored KV copy is made after (docs/kv-reuse.md): the same
 * for every placement, so one copy serves the chunk wherever it lands, and that of the first
 * document, so the copy is what a prompt opening with the chunk computes. */
#define PROMPT_COPY_MARKER 1

#endif
