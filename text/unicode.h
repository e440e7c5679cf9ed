/* Unicode code-point properties for every layer, from one generated table (text/unicode_tables.h,
 * tools/gen-unicode-tables.py, Unicode 14.0.0): the classes the BPE pre-tokenizer's regex tests
 * (\p{L}, \p{N}, \s), the analyzer's word classes, and the simple lowercase mapping. */
#ifndef DIFFRAG_TEXT_UNICODE_H
#define DIFFRAG_TEXT_UNICODE_H

#include <stdint.h>

/* Classes of the GPT-2 pre-tokenizer regex; a code point is in exactly one. */
enum UnicodeClass {
    UNICODE_OTHER = 0,  /* [^\s\p{L}\p{N}]: punctuation, symbols, marks, controls, unassigned */
    UNICODE_LETTER = 1, /* \p{L} */
    UNICODE_NUMBER = 2, /* \p{N} */
    UNICODE_SPACE = 3,  /* \s (White_Space) */
};

/* Word classes of the index's analyzer and the grounding word splitter. */
enum UnicodeWordClass {
    UNICODE_SEP = 0,  /* separates words */
    UNICODE_WORD = 1, /* letters, marks and numbers (categories L*, M*, N*) */
    UNICODE_IDEO = 2, /* CJK ideographs, kana: each one a word by itself */
};

/* Any uint32_t is accepted: values past U+10FFFF (UTF8_INVALID among them) are UNICODE_OTHER,
 * UNICODE_SEP and their own lowercase. */
enum UnicodeClass unicode_class(uint32_t cp);
int unicode_is_letter(uint32_t cp);
int unicode_is_number(uint32_t cp);
int unicode_is_space(uint32_t cp);
enum UnicodeWordClass unicode_word_class(uint32_t cp);
/* The simple (one code point) lowercase mapping: the first code point of Python's
 * str.lower(), e.g. U+0130 -> 'i'. */
uint32_t unicode_lower(uint32_t cp);

/* Unicode version of the tables, e.g. "14.0.0". */
const char *unicode_tables_version(void);

#endif
