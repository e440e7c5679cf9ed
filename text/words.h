/* Word splitting the way the index's analyzer splits (Unicode word characters, an apostrophe
 * kept only between two of them, each ideograph a word of its own; bytes that are not UTF-8
 * separate words), each word lowercased; and a set of such words. The daemon's groundedness
 * check uses both to ask whether an answer's words occur in the documents. */
#ifndef DIFFRAG_TEXT_WORDS_H
#define DIFFRAG_TEXT_WORDS_H

#include <stddef.h>

#define WORDS_MAX_BYTES 64   /* longer words are cut at a character boundary (= the index's) */

struct Word {
    size_t start, end;             /* bytes of the word in the text */
    char lower[WORDS_MAX_BYTES];   /* lowercased, apostrophes and a final 's dropped */
    size_t lower_len;              /* >= 1 */
    int capital;                   /* the first character is an upper-case letter */
    int digit;                     /* it contains an ASCII digit */
};

/* Called per word in text order; `w` is borrowed until the call returns. Non-zero stops the
 * walk and is returned by words_split. */
typedef int (*words_fn)(void *ctx, const struct Word *w);
/* Splits text[0..len) into words. Returns 0 or the callback's non-zero return. */
int words_split(const char *text, size_t len, words_fn fn, void *ctx);

/* A set of lowercased words, kept as 64-bit hashes (text/hash.h): a lookup of a word that was
 * never added answers yes only on a hash collision, about once in 2^64 / size lookups. */
struct WordSet;
int words_set_new(struct WordSet **out);         /* 0 or -1 (out of memory) */
void words_set_destroy(struct WordSet **ws);      /* NULL or *ws NULL: nothing to do */
/* Adds the words of text (as words_split gives them). 0 or -1 (out of memory). */
int words_set_add_text(struct WordSet *ws, const char *text, size_t len);
/* Is the lowercased word lower[0..len) in the set? */
int words_set_has(const struct WordSet *ws, const char *lower, size_t len);
size_t words_set_size(const struct WordSet *ws);

#endif
