/* Text analysis for the index: Unicode lowercasing and word splitting (text/utf8.h,
 * text/unicode.h), optional stop words and Snowball English stemming. The same analyzer runs
 * over chunks at ingest and over questions at search, so both sides see the same terms. */
#ifndef DIFFRAG_TEXT_H
#define DIFFRAG_TEXT_H

#include <stddef.h>
#include <stdint.h>

/* Longest term kept, in bytes; longer words are cut at a character boundary. */
#define ANALYZE_MAX_TERM 64

enum AnalyzeFlags {
    ANALYZE_STEM = 1u << 0,      /* Snowball English stemmer */
    ANALYZE_STOPWORDS = 1u << 1, /* drop the Lucene English stop words */
};
#define ANALYZE_KNOWN_FLAGS (ANALYZE_STEM | ANALYZE_STOPWORDS)

struct Analyzer;

/* flags: enum AnalyzeFlags. The analyzer holds a stemmer and scratch space, so it is not
 * thread-safe: use one per thread or per call. Returns RET_OK, RET_EINPUT (unknown flag),
 * RET_ENOMEM. */
int analyzer_new(unsigned flags, struct Analyzer **out, char *err, size_t errlen);
void analyzer_destroy(struct Analyzer **a);
unsigned analyzer_flags(const struct Analyzer *a);

/* Called once per term, in text order. `term` is borrowed until the callback returns. A
 * non-zero return stops the run and is passed back by analyzer_run. */
typedef int (*analyzer_emit_fn)(void *ctx, const char *term, size_t len);

/* Split text into terms. Bytes that are not valid UTF-8 act as separators (queries are not
 * validated first). Returns 0, RET_ENOMEM, or the callback's non-zero return. */
int analyzer_run(struct Analyzer *a, const char *text, size_t len, analyzer_emit_fn emit, void *ctx);
/* As analyzer_run, for a question: its interrogatives, auxiliary verbs and personal pronouns
 * ("how", "does", "I", ...) are left out too, whatever the flags; written in capitals ("WHO")
 * such a word names something and stays. */
int analyzer_run_question(struct Analyzer *a, const char *text, size_t len, analyzer_emit_fn emit,
                          void *ctx);

#endif
