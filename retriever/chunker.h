/* Splits a document into chunks of about a target number of model tokens, at sentence and
 * paragraph boundaries, with an optional overlap of whole trailing sentences. Each chunk is a
 * byte range of the document, trimmed of surrounding whitespace. */
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

struct ChunkSpan {
    uint64_t start, end;  /* byte offsets in the document, [start, end) */
    uint32_t n_tokens;    /* sum of the sentence token counts (BPE merges across sentence
                             joins can make the exact count differ by a token or two) */
};

/* Chunk text[0..len). *out (malloc'ed, caller frees) receives *n_out spans in document order;
 * text with no non-whitespace gives zero chunks. A sentence longer than the target is cut at
 * whitespace (or, failing that, at a character boundary) into pieces within the target.
 * Returns RET_OK, RET_EINPUT (bad options), RET_ETOKEN, RET_ENOMEM. */
int chunk_text(const char *text, size_t len, const struct ChunkOptions *o,
               const struct TokenCounter *tc, struct ChunkSpan **out, size_t *n_out,
               char *err, size_t errlen);

/* Sentence units as the chunker sees them (exposed for tests): starts of units and whether
 * each begins a paragraph. *starts / *para are malloc'ed. */
int chunk_sentences(const char *text, size_t len, size_t **starts, uint8_t **para, size_t *n);

#endif
