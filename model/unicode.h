/* UTF-8 decoding and encoding, and the code-point classes the BPE pre-tokenizer's regex tests
 * (\p{L}, \p{N}, \s). Tables come from model/unicode_tables.h (tools/gen-unicode-tables.py). */
#ifndef DIFFRAG_UNICODE_H
#define DIFFRAG_UNICODE_H

#include <stddef.h>
#include <stdint.h>

#define UNICODE_INVALID 0xFFFFFFFFu  /* what unicode_decode_utf8 reports for a bad byte */
#define UNICODE_REPLACEMENT 0xFFFDu

/* Classes of the GPT-2 pre-tokenizer regex; a code point is in exactly one. */
enum UnicodeClass {
    UNICODE_OTHER = 0,  /* [^\s\p{L}\p{N}]: punctuation, symbols, marks, controls, unassigned */
    UNICODE_LETTER = 1, /* \p{L} */
    UNICODE_NUMBER = 2, /* \p{N} */
    UNICODE_SPACE = 3,  /* \s (White_Space) */
};

/* Decode the UTF-8 sequence at s[0..len), len >= 1. Returns the bytes consumed (1..4) and the
 * code point in *cp. Strict like Python's decoder: an overlong form, a surrogate, a value past
 * U+10FFFF, a stray continuation byte or a truncated sequence yields *cp = UNICODE_INVALID and
 * the length of the maximal ill-formed prefix (1..3, the unit replaced by one U+FFFD). */
size_t unicode_decode_utf8(const unsigned char *s, size_t len, uint32_t *cp);

/* Could s[0..len) (len 1..3) still grow into a valid sequence with more bytes? */
int unicode_is_incomplete_utf8(const unsigned char *s, size_t len);

/* Write the UTF-8 form of cp (<= U+10FFFF, not a surrogate) into out; returns 1..4, or 0 for
 * a value that has none. */
size_t unicode_encode_utf8(uint32_t cp, char out[4]);

enum UnicodeClass unicode_class(uint32_t cp);
int unicode_is_letter(uint32_t cp);
int unicode_is_number(uint32_t cp);
int unicode_is_space(uint32_t cp);

/* Unicode version of the tables, e.g. "14.0.0". */
const char *unicode_tables_version(void);

#endif
