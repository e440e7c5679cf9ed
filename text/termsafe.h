/* Text for a terminal: what a program prints from a document, a reply or a store (ids, titles,
 * document text) must not drive the terminal, so the characters a terminal acts on are written
 * as visible escapes instead. */
#ifndef DIFFRAG_TEXT_TERMSAFE_H
#define DIFFRAG_TEXT_TERMSAFE_H

#include <stddef.h>
#include <stdio.h>

/* Tab and newline (and a carriage return just before a newline) are the text's own layout and
 * pass through; without this flag they are escaped like every other control character. */
#define TERM_KEEP_LAYOUT 1u

/* Writes s[0..len) to f with C0 controls and DEL escaped as `\x1b`, `\x7f`, C1 controls
 * (U+0080..U+009F) as `\u009b`, and bytes that are not well-formed UTF-8 as `\xNN` (an 8-bit
 * terminal reads 0x9B alone as CSI). Everything else, backslashes included, is written as it
 * is. Returns the bytes written (what a %-Ns field would count). */
size_t term_write_escaped(FILE *f, const char *s, size_t len, unsigned flags);

#endif
