/* libFuzzer target: context assembly. The input is split at 0x00 bytes into a question and
 * chunk texts (ids/titles from the next fields); the first byte picks the budget, the second
 * the order, truncation, how many fields after the question are also earlier turns (0..7,
 * alternating roles) and whether the last field is a system text.
 * Checks: never over budget, spans inside the prompt and in order, every turn counted. */
#include <stdlib.h>
#include <string.h>

#include "retriever/context.h"
#include "retriever/status.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    struct TokenCounter tc;
    tokcount_simple(&tc);
    struct CtxOptions o = {.budget = 16 + (size_t)data[0] * 8,
                           .order = data[1] & 1 ? CTX_ORDER_DOCUMENT : CTX_ORDER_RANK,
                           .no_truncate = (data[1] >> 1) & 1};
    const char *p = (const char *)data + 2, *end = (const char *)data + size;
    const char *fields[64];
    size_t lens[64], nf = 0;
    while (p <= end && nf < 64) {
        const char *z = memchr(p, 0, (size_t)(end - p));
        size_t len = z ? (size_t)(z - p) : (size_t)(end - p);
        fields[nf] = p;
        lens[nf++] = len;
        if (!z) break;
        p = z + 1;
    }
    struct CtxTurn turns[7];
    size_t n_turns = 0;
    for (size_t i = 1; i < nf && n_turns < (size_t)((data[1] >> 2) & 7); i++, n_turns++)
        turns[n_turns] = (struct CtxTurn){ (int)(n_turns & 1), fields[i], lens[i] };
    o.history = turns;
    o.n_history = n_turns;
    if ((data[1] >> 5) & 1) {
        o.system = fields[nf - 1];
        o.system_len = lens[nf - 1];
    }
    struct CtxChunk chunks[21];
    size_t nc = 0;
    for (size_t i = 1; i + 2 < nf + 2 && nc < 21 && i < nf; i += 3) {
        chunks[nc] = (struct CtxChunk){
            .doc_id = fields[i], .doc_id_len = lens[i],
            .title = i + 1 < nf ? fields[i + 1] : "", .title_len = i + 1 < nf ? lens[i + 1] : 0,
            .text = i + 2 < nf ? fields[i + 2] : "", .text_len = i + 2 < nf ? lens[i + 2] : 0,
            .chunk = (uint32_t)nc, .byte_start = 0, .byte_end = i + 2 < nf ? lens[i + 2] : 0,
            .score = (double)(21 - nc)};
        nc++;
    }
    struct Context *c = NULL;
    char err[256];
    if (ctx_assemble(&tc, fields[0], lens[0], chunks, nc, &o, &c, err, sizeof err) == RET_OK) {
        if (c->n_tokens > o.budget) __builtin_trap();
        for (size_t i = 0; i < c->n_cites; i++) {
            const struct CtxCitation *ct = &c->cites[i];
            if (ct->tokens.start > ct->tokens.end || ct->tokens.end > c->n_tokens) __builtin_trap();
            if (ct->bytes.start > ct->bytes.end || ct->bytes.end > c->text_len) __builtin_trap();
        }
        if (c->question.end > c->n_tokens) __builtin_trap();
        if (c->history.start > c->history.end || c->history.start < c->documents.end ||
            c->history.end > c->question.start ||
            c->n_turns + c->n_turns_skipped != n_turns) __builtin_trap();
        ctx_destroy(&c);
    }
    return 0;
}
