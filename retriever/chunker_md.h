/* The Markdown structure the chunker works with (chunker.h): page markers, fenced code, ATX
 * headings and tables, found in one pass over the document's lines, and what chunks take from
 * them (heading paths, pages). Internal to the chunker. */
#ifndef DIFFRAG_CHUNKER_MD_H
#define DIFFRAG_CHUNKER_MD_H

#include <stddef.h>
#include <stdint.h>

#include "retriever/chunker.h"

static inline int chunk_is_ws(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* The page number of a page marker line text[ls, le) ("<!-- page N -->"), or 0. */
uint32_t chunk_page_marker(const char *text, size_t ls, size_t le);

/* Does the line at text[i] start with a Markdown block marker (or is it a page marker), so that
 * it is a sentence unit of its own? */
int chunk_line_is_block(const char *text, size_t len, size_t i);

struct MdHead { size_t at; struct ChunkHeading h; }; /* at: the first '#' (a setext heading's
                                                        first byte of text) */
struct MdMark { size_t at, end; uint32_t page; };    /* a page marker line [at, end) */

/* A table: its caption line (when it has one), header row, separator row and body rows, each a
 * line; offsets are those of the lines' first non-blank bytes, ends exclude the newline and
 * trailing whitespace. */
struct MdTable {
    size_t start;              /* the caption, or the header row when none */
    size_t cap, cap_end;       /* the caption line [cap, cap_end); cap == cap_end: none */
    size_t head, head_end;     /* the header row */
    size_t body;               /* the line after the separator row (== end: no body rows) */
    size_t end;                /* the end of the last row */
};

struct ChunkMd {
    struct MdHead *heads;
    size_t n_heads;
    struct MdMark *marks;
    size_t n_marks;
    struct MdTable *tables;
    size_t n_tables;
};

/* The headings, page markers and tables of text outside fenced code, each in document order.
 * Returns RET_OK or RET_ENOMEM (md then holds nothing). */
int chunk_md_scan(const char *text, size_t len, struct ChunkMd *md);
void chunk_md_free(struct ChunkMd *md);

/* Is text[s] the first non-blank byte of a line? */
int chunk_at_line_start(const char *text, size_t s);

/* The pages of each chunk from the page markers (chunker.h). */
void chunk_set_pages(struct ChunkSpan *cs, size_t n, const struct MdMark *m, size_t nm);

#endif
