/* The tokenizer's state, shared by the files that implement model/tokenizer.h: loading,
 * decoding, chat and streaming (tokenizer.c) and encoding (tokenizer_encode.c). Not for use
 * outside them. */
#ifndef DIFFRAG_TOKENIZER_INTERNAL_H
#define DIFFRAG_TOKENIZER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer.h"
#include "text/hash.h"

enum PreTokenizer { PRE_GPT2, PRE_DIGITS_GPT2, PRE_QWEN2 };

enum TokenType {  /* tokenizer.ggml.token_type values (llama.cpp's numbering) */
    TT_UNDEFINED = 0, TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER_DEFINED = 4,
    TT_UNUSED = 5, TT_BYTE = 6,
};

enum ChatKind { CHAT_NONE_IN_FILE, CHAT_CHATML, CHAT_OTHER };

struct Special { int32_t id; uint32_t len; const char *text; int control; };

struct Tokenizer {
    int32_t n_vocab;
    char *pieces;           /* every token's bytes back to back, each NUL-terminated */
    uint64_t *piece_off;    /* (n_vocab + 1) offsets into pieces; length = next - this - 1 */
    uint8_t *type;          /* (n_vocab) enum TokenType */
    size_t max_piece;
    int32_t byte_id[256];   /* token of each single byte; -1 when the vocabulary has none */

    /* hash_u64(left id << 32 | right id) -> rank << 32 | merged id (merge_find) */
    struct HashTable merges;

    struct Special *specials; /* control and user-defined tokens, longest text first */
    size_t n_specials;
    /* Does some special text start with this byte? SPECIAL_ANY: a control or user-defined
     * one, SPECIAL_USER: a user-defined one (matched even without TOK_PARSE_SPECIAL). */
    uint8_t special_first[256];

    enum PreTokenizer pre;
    int32_t bos, eos;
    int add_bos;
    int32_t end_ids[8];
    size_t n_end;

    enum ChatKind chat;
    char *chat_default_system; /* NULL when the template inserts none */
    size_t chat_default_system_len;
};

enum { SPECIAL_ANY = 1, SPECIAL_USER = 2 };

static inline uint64_t merge_key(int32_t left, int32_t right)
{
    return (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
}

/* The merge of the pair (left, right): 1 with its rank and merged token, or 0 when the pair
 * does not merge. hash_u64 is a bijection, so equal hashes mean equal pairs. */
static inline int merge_find(const struct Tokenizer *t, int32_t left, int32_t right,
                             uint32_t *rank, int32_t *id)
{
    size_t pos;
    const struct HashSlot *s = hash_find(&t->merges, hash_u64(merge_key(left, right)), &pos);
    if (!s) return 0;
    *rank = (uint32_t)(s->value >> 32);
    *id = (int32_t)(uint32_t)s->value;
    return 1;
}

#endif
