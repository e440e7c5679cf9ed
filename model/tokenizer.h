/* Byte-level BPE tokenizer built from a GGUF vocabulary (tokenizer.ggml.*): pre-tokenizer,
 * merges by rank, special tokens, the chat template, and incremental detokenisation that never
 * emits a broken UTF-8 sequence. Thread-safe after load (all calls take a const tokenizer). */
#ifndef DIFFRAG_TOKENIZER_H
#define DIFFRAG_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>
#include "model/gguf.h"

enum TokStatus {
    TOK_OK = 0,
    TOK_EFORMAT = -1,  /* vocabulary in the file is missing or inconsistent */
    TOK_EUNSUPPORTED = -2, /* tokenizer model or pre-tokenizer not handled */
    TOK_ENOMEM = -3,
    TOK_ERANGE = -4,   /* token id out of range */
    TOK_EINPUT = -5,   /* invalid argument (e.g. NULL text with len > 0) */
};
const char *tok_strerror(int status);

enum TokFlags {
    TOK_ADD_BOS = 1u << 0,       /* prepend BOS when the vocabulary asks for it */
    TOK_PARSE_SPECIAL = 1u << 1, /* recognise special-token strings such as <|im_end|> */
};

enum ChatRole { CHAT_SYSTEM, CHAT_USER, CHAT_ASSISTANT };
struct ChatMessage { enum ChatRole role; const char *content; size_t len; };

struct Tokenizer;

/* Build the tokenizer from the tokenizer.ggml.* keys of g. Supported: model "gpt2" (byte-level
 * BPE) with pre-tokenizer "gpt2"/"gpt-2"/"default" (or no tokenizer.ggml.pre), or one of
 * "smollm", "starcoder", "refact", "command-r", "codeshell" (each digit split off first), or
 * "qwen2"/"deepseek-r1-qwen" (Qwen2's regex: single digits, a letter run may take one leading
 * punctuation or space character, case-insensitive contractions, line breaks kept with the
 * punctuation or whitespace before them). Qwen2's own tokenizer NFC-normalises text first; this
 * one does not (llama.cpp neither), so ids match it for NFC text and decoding always gives
 * the text back. Everything needed is copied: g may be closed afterwards.
 * Returns TOK_OK with *out set; TOK_EUNSUPPORTED (another tokenizer model or pre-tokenizer),
 * TOK_EFORMAT (missing or inconsistent vocabulary, merges or ids) or TOK_ENOMEM, with *out =
 * NULL and a message in err. */
int tok_load_gguf(const struct GgufFile *g, struct Tokenizer **out, char *err, size_t errlen);
/* Free *t and set it to NULL; NULL or *t == NULL is a no-op. */
void tok_destroy(struct Tokenizer **t);

int32_t tok_n_vocab(const struct Tokenizer *t);
int32_t tok_bos(const struct Tokenizer *t);   /* -1 if none */
int32_t tok_eos(const struct Tokenizer *t);   /* -1 if none */
/* Does generating this id end a turn? True for EOS, tokenizer.ggml.eot_token_id/eom_token_id,
 * and the tokens whose text is <|im_end|>, <|endoftext|>, <|eot_id|> or <end_of_turn>. */
int tok_is_end(const struct Tokenizer *t, int32_t id);
int tok_is_special(const struct Tokenizer *t, int32_t id); /* control token (type 3) */

/* Encode `len` bytes of UTF-8 `text`. Invalid UTF-8 is never rejected: each ill-formed byte
 * becomes its own byte token. A byte the vocabulary has no token for (SmolLM2 lacks 21, e.g.
 * U+0004 and 0xFF) is dropped, as Hugging Face's BPE without an unknown token does, so
 * decoding gives the text back exactly only when every byte has a token.
 * TOK_ADD_BOS adds BOS only when tokenizer.ggml.add_bos_token is true. The texts of
 * user-defined tokens (type 4, e.g. Qwen2's <tool_call>) are always matched and emitted as
 * their ids, as Hugging Face does for added tokens that are not special; with
 * TOK_PARSE_SPECIAL the texts of control tokens (<|im_end|>...) are matched too (longest text
 * first at each position), otherwise they are ordinary text.
 * Writes at most `cap` ids; *n_out receives the full count, so a first call with cap = 0
 * sizes the buffer. Returns TOK_OK (even when truncated: compare *n_out with cap),
 * TOK_EINPUT (NULL text with len > 0) or TOK_ENOMEM. Allocates scratch per call, so
 * concurrent calls on one tokenizer are safe. */
int tok_encode(const struct Tokenizer *t, const char *text, size_t len, unsigned flags,
               int32_t *ids, size_t cap, size_t *n_out);

/* The raw bytes a token stands for (byte-level mapping undone). Special tokens give their
 * text; unused ones (type 5, padding rows such as Qwen2's "[PAD151665]") give "" (len 0).
 * Borrowed: valid while the tokenizer lives. NULL for an id out of range. */
const char *tok_piece(const struct Tokenizer *t, int32_t id, size_t *len);

/* Decode ids to bytes (concatenated pieces, no NUL added). Same sizing convention as
 * tok_encode. Returns TOK_OK, TOK_EINPUT, or TOK_ERANGE for an id out of range. */
int tok_decode(const struct Tokenizer *t, const int32_t *ids, size_t n, char *out, size_t cap,
               size_t *n_out);

/* Format a conversation with the model's chat template, optionally ending with the prompt
 * that opens the assistant's turn. Only ChatML is implemented:
 *   <|im_start|>ROLE\nCONTENT<|im_end|>\n ... [<|im_start|>assistant\n]
 * When the file's template carries a literal default system message (SmolLM2: "You are a
 * helpful AI assistant named SmolLM, trained by Hugging Face"; Qwen2.5: "You are Qwen, created
 * by Alibaba Cloud. You are a helpful assistant."), it is inserted first if the first message
 * is not a system message, as the template does; no messages give "" (plus the assistant
 * prompt if asked), where Qwen2.5's template itself fails.
 * Writes a NUL-terminated string into out (cap bytes); *n_out receives the full length
 * excluding the NUL, so a first call with cap = 0 sizes the buffer (cap >= *n_out + 1 fits).
 * Returns TOK_OK when the file names a ChatML template or none at all; TOK_EUNSUPPORTED when
 * its template is something else: the ChatML text is still written, and the caller decides
 * whether that fallback is acceptable; TOK_EINPUT for an unknown role or NULL content with
 * len > 0 (nothing written). */
int tok_chat_format(const struct Tokenizer *t, const struct ChatMessage *msgs, size_t n_msgs,
                    int add_assistant_prompt, char *out, size_t cap, size_t *n_out);

/* Longest piece in bytes (tok_piece) of any token: sizes TokStream output buffers. */
size_t tok_max_piece_len(const struct Tokenizer *t);

/* Incremental detokeniser for streaming: feed ids one at a time and receive only complete,
 * valid UTF-8. A sequence split across tokens is held back until its last byte arrives; bytes
 * that can never complete a sequence come out as U+FFFD (one per maximal ill-formed subpart),
 * so the output is always valid UTF-8. At most 3 bytes are ever held back. The struct is
 * plain data owned by the caller; it borrows the tokenizer, which must outlive it. */
struct TokStream { const struct Tokenizer *tok; char pending[8]; size_t n_pending; };
void tok_stream_init(struct TokStream *s, const struct Tokenizer *t);
/* Append the text that id completes to out (cap bytes). Returns the number of bytes written
 * (0 when everything is held back), TOK_ERANGE for an id out of range, or TOK_ERANGE as well
 * when the text does not fit in cap; in both error cases the stream is unchanged, so the call
 * can be repeated with a larger buffer. cap >= 3 * (tok_max_piece_len(t) + 3) always fits. */
int tok_stream_feed(struct TokStream *s, int32_t id, char *out, size_t cap);
/* End of stream: writes U+FFFD for a held-back incomplete sequence (3 bytes) or nothing, and
 * resets the stream. Returns bytes written, or TOK_ERANGE (stream unchanged) if cap < 3. */
int tok_stream_flush(struct TokStream *s, char *out, size_t cap);

#endif
