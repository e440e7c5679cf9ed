/* Splits a document into chunks of about a target number of model tokens, at sentence and
 * paragraph boundaries, with an optional overlap of whole trailing sentences. Each chunk is a
 * byte range of the document, trimmed of surrounding whitespace.
 *
 * A Markdown ATX heading (`#`..`######` and a space at the start of a line, outside fenced
 * ``` / ~~~ code blocks) starts a chunk: a section (the heading and its body up to the next
 * heading) that fits the target is one chunk; a longer one is cut at paragraphs, and a
 * paragraph longer than the target at sentences. Headings with no body of their own go with the
 * chunk that follows them. Overlap never crosses a heading. Each chunk records its heading
 * path: the headings that enclose it, outermost first. Text without headings is chunked as
 * one run of sentences, as before headings counted.
 *
 * Tables: a header row, a separator row (`|---|...`) and body rows, lines starting with `|`,
 * outside fenced code, with the one-line paragraph right before them (at most
 * CHUNK_MAX_CAPTION_BYTES) as caption. Rows are units (no cut inside one but in a row longer
 * than the target); a table that fits is never split and stays with its caption (and the
 * paragraph before it when both fit); a longer one starts a chunk and is cut between rows, its
 * first part holding caption and header row, and each later part records both (table_cap,
 * table_head), which its heading path shows: "caption (cont.) › header row". No overlap in or
 * out of a table.
 *
 * Page markers: a line that is exactly `<!-- page N -->` (N from 1, no leading zero; trailing
 * whitespace allowed), outside fenced code, as diffrag-extract writes at the start of each
 * page of a PDF, says that page starts there. It is a sentence unit of its own and stays in
 * the chunk's text. Each chunk records the page it starts on (the last marker at or before its
 * start; for a chunk that starts before any marker, the first marker with text after it in the
 * chunk: what precedes page 1 is the title line the extractor adds) and the page it ends on
 * (the last marker in it with text after it). Text without markers gives chunks no pages. */
#ifndef DIFFRAG_CHUNKER_H
#define DIFFRAG_CHUNKER_H

#include <stddef.h>
#include <stdint.h>

#include "text/tokcount.h"

#define CHUNK_DEFAULT_TOKENS 256
#define CHUNK_DEFAULT_OVERLAP 32
#define CHUNK_MIN_TOKENS 16
#define CHUNK_MAX_TOKENS 65536

struct ChunkOptions {
    uint32_t target_tokens;   /* CHUNK_MIN_TOKENS..CHUNK_MAX_TOKENS */
    uint32_t overlap_tokens;  /* < target_tokens; 0 = no overlap */
};

#define CHUNK_MAX_DEPTH 6          /* heading levels */
#define CHUNK_MAX_PATH_BYTES 512    /* a formatted heading path is cut to this */
#define CHUNK_PATH_SEPARATOR " \xE2\x80\xBA " /* " › " */

/* A heading's title in the document: its bytes without the #s, the spaces around them or a
 * closing run of #s. */
struct ChunkHeading {
    uint64_t start;
    uint32_t len;
    uint32_t level;       /* 1..6 */
};

struct ChunkSpan {
    uint64_t start, end;  /* byte offsets in the document, [start, end) */
    uint32_t n_tokens;    /* sum of the sentence token counts (BPE merges across sentence
                             joins can make the exact count differ by a token or two) */
    uint32_t n_heads;     /* the heading path: headings open at the chunk's end (after those
                             it starts with), outermost first */
    struct ChunkHeading heads[CHUNK_MAX_DEPTH];
    uint32_t page_first, page_last; /* the pages it starts and ends on (0, 0: none) */
    uint64_t table_cap, table_head; /* a later part of a split table: the table's caption and */
    uint32_t table_cap_len, table_head_len; /* header row (len 0: none; table_head_len 0: not one) */
};

#define CHUNK_MAX_CAPTION_BYTES 200      /* a longer line before a table is not its caption */
#define CHUNK_TABLE_CONT " (cont.)"       /* follows a split table's caption in later parts' paths */

#define CHUNK_MAX_PAGE 999999999u  /* the largest page number a marker may give */

/* Chunk text[0..len). *out (malloc'ed, caller frees) receives *n_out spans in document order;
 * text with no non-whitespace gives zero chunks. A sentence longer than the target is cut at
 * whitespace (or, failing that, at a character boundary) into pieces within the target.
 * Returns RET_OK, RET_EINPUT (bad options), RET_ETOKEN, RET_ENOMEM. */
int chunk_text(const char *text, size_t len, const struct ChunkOptions *o,
               const struct TokenCounter *tc, struct ChunkSpan **out, size_t *n_out,
               char *err, size_t errlen);

/* Format span's heading path into out (cap bytes, NUL-terminated): the titles joined by
 * CHUNK_PATH_SEPARATOR, the outermost left out when it is the document's title (title, may be
 * empty), newlines as spaces, cut at a character boundary to fit cap - 1 and
 * CHUNK_MAX_PATH_BYTES. Returns the length (0: no path). */
size_t chunk_heading_path(const char *text, const struct ChunkSpan *span, const char *title,
                          size_t title_len, char *out, size_t cap);

/* The pages of the whole of text[0..len) as one chunk (*first, *last; 0, 0: no markers).
 * Returns RET_OK or RET_ENOMEM. */
int chunk_text_pages(const char *text, size_t len, uint32_t *first, uint32_t *last);

/* Sentence units as the chunker sees them (exposed for tests): starts of units and whether
 * each begins a paragraph. *starts / *para are malloc'ed. */
int chunk_sentences(const char *text, size_t len, size_t **starts, uint8_t **para, size_t *n);

#endif
