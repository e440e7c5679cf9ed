/* UTF-8 for every layer: strict validation, decoding one code point (ill-formed input reported,
 * never guessed), encoding, cutting at a character boundary. Well-formed means Unicode's
 * Table 3-7: no overlong forms, no surrogates, nothing past U+10FFFF, no truncated sequence. */
#ifndef DIFFRAG_TEXT_UTF8_H
#define DIFFRAG_TEXT_UTF8_H

#include <stddef.h>
#include <stdint.h>

#define UTF8_INVALID 0xFFFFFFFFu  /* what utf8_decode reports for ill-formed bytes */
#define UTF8_REPLACEMENT 0xFFFDu

/* 1 when s[0..len) is well-formed UTF-8; otherwise 0 and *bad_off (if non-NULL) receives the
 * offset of the first byte of the first ill-formed sequence. */
int utf8_valid(const char *s, size_t len, size_t *bad_off);

/* Decode the sequence at s[0..len), len >= 1. Returns the bytes consumed (1..4) and the code
 * point in *cp. Ill-formed input (an overlong form, a surrogate, a value past U+10FFFF, a stray
 * continuation byte, a truncated sequence) gives *cp = UTF8_INVALID and the length of the
 * maximal ill-formed prefix (1..3 bytes: what one U+FFFD replaces, as Python's decoder and
 * Unicode's "best practice" do). A caller that wants one unit per bad byte advances by 1. */
size_t utf8_decode(const unsigned char *s, size_t len, uint32_t *cp);

/* Could s[0..len) (len 1..3) still grow into a well-formed sequence with more bytes? */
int utf8_is_incomplete(const unsigned char *s, size_t len);

/* Write the UTF-8 form of cp into out; returns 1..4, or 0 for a surrogate or a value past
 * U+10FFFF (nothing written). */
size_t utf8_encode(uint32_t cp, char out[4]);

/* The length of s[0..len) cut to at most `max` bytes without splitting a sequence: the cut
 * moves back over continuation bytes (s is expected to be well-formed). */
size_t utf8_cut(const char *s, size_t len, size_t max);

#endif
