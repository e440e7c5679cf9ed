/* Prompt-lookup drafting: the tokens a generation is likely to produce next, guessed without a
 * draft model from where its last few tokens occurred before (in the prompt, or earlier in the
 * answer). A RAG answer copies much of its text from the documents, so such guesses are often
 * right; the engine checks them all in one verify step (engine_verify in model/engine.h). */
#ifndef DIFFRAG_LOOKUP_H
#define DIFFRAG_LOOKUP_H

#include <stdint.h>

#define LOOKUP_NGRAM_MAX 3   /* the longest suffix looked up */
#define LOOKUP_NGRAM_MIN 2   /* the shortest: a single token matches too often to draft from */
#define LOOKUP_MAX_DRAFT 16  /* the most tokens a draft may hold */

/* Finds the latest earlier occurrence of the longest suffix of hist[0..n) of
 * LOOKUP_NGRAM_MAX..LOOKUP_NGRAM_MIN tokens, and copies the tokens that followed it (at most
 * k_max, and never past hist[n - 1]) into draft. Returns their count; 0 when no suffix
 * occurs earlier (or k_max < 1). */
int lookup_draft(const int32_t *hist, int n, int32_t *draft, int k_max);

#endif
