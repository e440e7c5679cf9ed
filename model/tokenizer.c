/* Byte-level BPE tokenizer over a GGUF vocabulary: loading tokenizer.ggml.* (tokens, types,
 * merges, special tokens), decoding, ChatML formatting and the streaming detokeniser. Encoding
 * (the pre-tokenizers and BPE) is in tokenizer_encode.c. */
#include "model/tokenizer.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer_internal.h"
#include "text/hash.h"
#include "text/utf8.h"

static void set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

const char *tok_strerror(int status)
{
    switch (status) {
    case TOK_OK: return "ok";
    case TOK_EFORMAT: return "vocabulary missing or inconsistent";
    case TOK_EUNSUPPORTED: return "tokenizer not supported";
    case TOK_ENOMEM: return "out of memory";
    case TOK_ERANGE: return "token id or buffer size out of range";
    case TOK_EINPUT: return "invalid argument";
    default: return "unknown tokenizer status";
    }
}

/* ---- GPT-2 byte <-> code point mapping ------------------------------------------------- */

/* Printable bytes stand for themselves; the other 68 are shifted to U+0100.. in byte order so
 * that every token string is printable. */
static int byte_is_printable(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

static void byte_map_build(uint32_t byte_to_cp[256], int16_t cp_to_byte[324])
{
    for (int i = 0; i < 324; i++) cp_to_byte[i] = -1;
    uint32_t next = 256;
    for (unsigned b = 0; b < 256; b++) {
        byte_to_cp[b] = byte_is_printable(b) ? b : next++;
        cp_to_byte[byte_to_cp[b]] = (int16_t)b;
    }
}

/* ---- load-time string -> id map -------------------------------------------------------- */

/* Loading resolves 151K tokens and 3 x 151K merge halves through this map; its cost is cache
 * misses, so the loops prefetch the slots they will probe a few dozen steps ahead, and a key's
 * bytes are read only when the slot's full 64-bit hash matches. */
struct StrMap { const struct GgufString *keys; struct HashTable table; }; /* hash -> token id */

static int32_t strmap_get_hashed(const struct StrMap *m, const char *p, size_t n, uint64_t h)
{
    size_t pos;
    for (struct HashSlot *s = hash_find(&m->table, h, &pos); s; s = hash_next(&m->table, h, &pos)) {
        const struct GgufString *k = &m->keys[s->value];
        if (k->len == n && memcmp(k->ptr, p, n) == 0) return (int32_t)s->value;
    }
    return -1;
}

static int32_t strmap_get(const struct StrMap *m, const char *p, size_t n)
{
    return strmap_get_hashed(m, p, n, hash_bytes(p, n));
}

/* A later duplicate replaces an earlier one, as a Python dict built from the list would. The
 * map is sized for every token up front, so this never allocates. */
static void strmap_put(struct StrMap *m, int32_t id, uint64_t h)
{
    const struct GgufString *k = &m->keys[id];
    size_t pos;
    for (struct HashSlot *s = hash_find(&m->table, h, &pos); s; s = hash_next(&m->table, h, &pos)) {
        if (m->keys[s->value].len == k->len && memcmp(m->keys[s->value].ptr, k->ptr, k->len) == 0) {
            s->value = (uint64_t)id;
            return;
        }
    }
    hash_insert(&m->table, h, (uint64_t)id);
}

/* ---- merges ---------------------------------------------------------------------------- */

/* A later duplicate of a pair replaces the earlier one. The table is sized for every merge up
 * front, so this never allocates. */
static void merge_put(struct Tokenizer *t, uint64_t key, uint32_t rank, int32_t id)
{
    uint64_t h = hash_u64(key), value = (uint64_t)rank << 32 | (uint32_t)id;
    size_t pos;
    struct HashSlot *s = hash_find(&t->merges, h, &pos);
    if (s) s->value = value;
    else hash_insert(&t->merges, h, value);
}

/* ---- loading --------------------------------------------------------------------------- */

static int str_eq(struct GgufString s, const char *lit)
{
    return s.len == strlen(lit) && memcmp(s.ptr, lit, s.len) == 0;
}

static int pre_from_name(struct GgufString name, enum PreTokenizer *pre)
{
    static const char *gpt2[] = {"gpt2", "gpt-2", "default"};
    static const char *digits[] = {"smollm", "starcoder", "refact", "command-r", "codeshell"};
    /* llama.cpp's names for Qwen2's regex (LLAMA_VOCAB_PRE_TYPE_QWEN2). */
    static const char *qwen2[] = {"qwen2", "deepseek-r1-qwen"};
    for (size_t i = 0; i < sizeof qwen2 / sizeof qwen2[0]; i++)
        if (str_eq(name, qwen2[i])) { *pre = PRE_QWEN2; return 1; }
    for (size_t i = 0; i < sizeof gpt2 / sizeof gpt2[0]; i++)
        if (str_eq(name, gpt2[i])) { *pre = PRE_GPT2; return 1; }
    for (size_t i = 0; i < sizeof digits / sizeof digits[0]; i++)
        if (str_eq(name, digits[i])) { *pre = PRE_DIGITS_GPT2; return 1; }
    return 0;
}

/* Token text in GPT-2 byte-level form back to bytes; a character outside the 256 mapped ones
 * means the token is not byte-level text, and it is kept verbatim. */
static size_t unmap_bytes(const char *s, size_t n, const int16_t cp_to_byte[324], char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (cp == UTF8_INVALID || cp >= 324 || cp_to_byte[cp] < 0) {
            memcpy(out, s, n);
            return n;
        }
        out[o++] = (char)cp_to_byte[cp];
        i += k;
    }
    return o;
}

static int special_cmp(const void *a, const void *b)
{
    const struct Special *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static int load_id(const struct GgufFile *g, const char *key, int32_t n_vocab, int32_t *out,
                   char *err, size_t errlen)
{
    int64_t v;
    int rc = gguf_get_i64(g, key, &v);
    *out = -1;
    if (rc == GGUF_ENOTFOUND) return TOK_OK;
    if (rc != GGUF_OK || v < 0 || v >= n_vocab) {
        set_err(err, errlen, "%s: %s is not a token id below %d", gguf_path(g), key, n_vocab);
        return TOK_EFORMAT;
    }
    *out = (int32_t)v;
    return TOK_OK;
}

/* Pull a literal default system message out of a ChatML template, e.g. SmolLM2's
 * {{ '<|im_start|>system\nYou are ...<|im_end|>\n' }}: the first "<|im_start|>system" that
 * opens a quoted string and whose text runs to "<|im_end|>" inside the same literal. */
static int chat_find_default_system(struct Tokenizer *t, struct GgufString tpl)
{
    static const char open[] = "<|im_start|>system";
    static const char close[] = "<|im_end|>";
    const char *p = tpl.ptr, *end = tpl.ptr + tpl.len;
    while ((p = memmem(p, (size_t)(end - p), open, sizeof open - 1)) != NULL) {
        const char *start = p;
        p += sizeof open - 1;
        if (start == tpl.ptr || (start[-1] != '\'' && start[-1] != '"')) continue;
        char quote = start[-1];
        const char *c = p;
        if (c < end && *c == '\n') c++;
        else if (end - c >= 2 && c[0] == '\\' && c[1] == 'n') c += 2;
        else continue;
        const char *stop = memmem(c, (size_t)(end - c), close, sizeof close - 1);
        if (!stop) return TOK_OK;
        /* Unescape the Jinja string literal; an unescaped quote means the text is built from
         * expressions (e.g. + messages[0]['content']), not a literal default. */
        char *text = malloc((size_t)(stop - c) + 1);
        if (!text) return TOK_ENOMEM;
        size_t n = 0;
        int literal = 1;
        for (const char *q = c; q < stop; q++) {
            if (*q == quote) { literal = 0; break; }
            if (*q == '\\' && q + 1 < stop) {
                q++;
                text[n++] = *q == 'n' ? '\n' : *q == 't' ? '\t' : *q;
            } else {
                text[n++] = *q;
            }
        }
        if (!literal) { free(text); continue; }
        text[n] = 0;
        t->chat_default_system = text;
        t->chat_default_system_len = n;
        return TOK_OK;
    }
    return TOK_OK;
}

static int load_chat(struct Tokenizer *t, const struct GgufFile *g)
{
    struct GgufString tpl;
    if (gguf_get_str(g, "tokenizer.chat_template", &tpl) != GGUF_OK) {
        t->chat = CHAT_NONE_IN_FILE;
        return TOK_OK;
    }
    if (!memmem(tpl.ptr, tpl.len, "<|im_start|>", 12)) {
        t->chat = CHAT_OTHER;
        return TOK_OK;
    }
    t->chat = CHAT_CHATML;
    return chat_find_default_system(t, tpl);
}

static void add_end_id(struct Tokenizer *t, int32_t id)
{
    if (id < 0) return;
    for (size_t i = 0; i < t->n_end; i++)
        if (t->end_ids[i] == id) return;
    if (t->n_end < sizeof t->end_ids / sizeof t->end_ids[0]) t->end_ids[t->n_end++] = id;
}

/* Vocabulary, pieces, token types and specials. `keys` receives every token's text. */
static int load_vocab(struct Tokenizer *t, const struct GgufFile *g, struct GgufString *keys,
                      const int16_t cp_to_byte[324], char *err, size_t errlen)
{
    const char *path = gguf_path(g);
    int32_t n = t->n_vocab;
    uint64_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (gguf_get_arr_str(g, "tokenizer.ggml.tokens", (uint64_t)i, &keys[i]) != GGUF_OK) {
            set_err(err, errlen, "%s: tokenizer.ggml.tokens[%d] is not a string", path, i);
            return TOK_EFORMAT;
        }
        if (keys[i].len > UINT32_MAX) {
            set_err(err, errlen, "%s: token %d is %llu bytes long", path, i,
                    (unsigned long long)keys[i].len);
            return TOK_EFORMAT;
        }
        total += keys[i].len + 1;
    }

    enum GgufValueType et;
    uint64_t count;
    const void *types = NULL;
    int rc = gguf_get_arr_data(g, "tokenizer.ggml.token_type", &et, &count, &types);
    if (rc == GGUF_OK && (et != GGUF_TYPE_INT32 || count != (uint64_t)n)) {
        set_err(err, errlen, "%s: tokenizer.ggml.token_type must be %d int32 values", path, n);
        return TOK_EFORMAT;
    }
    if (rc != GGUF_OK && rc != GGUF_ENOTFOUND) {
        set_err(err, errlen, "%s: tokenizer.ggml.token_type: %s", path, gguf_strerror(rc));
        return TOK_EFORMAT;
    }

    t->pieces = malloc(total ? total : 1);
    t->piece_off = malloc(((size_t)n + 1) * sizeof *t->piece_off);
    t->type = malloc((size_t)n);
    if (!t->pieces || !t->piece_off || !t->type) return TOK_ENOMEM;
    uint64_t off = 0;
    size_t n_specials = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t ty = TT_NORMAL;
        if (types) memcpy(&ty, (const char *)types + (size_t)i * 4, 4);
        t->type[i] = (uint8_t)(ty >= 0 && ty <= TT_BYTE ? ty : TT_UNDEFINED);
        t->piece_off[i] = off;
        char *dst = t->pieces + off;
        size_t len;
        if (ty == TT_NORMAL || ty == TT_UNDEFINED) {
            len = unmap_bytes(keys[i].ptr, keys[i].len, cp_to_byte, dst);
        } else if (ty == TT_UNUSED) {
            /* Padding rows past the real vocabulary (Qwen2: "[PAD151665]".."[PAD151935]"):
             * no text stands for them, as the model's own tokenizer knows no such ids. */
            len = 0;
        } else {
            memcpy(dst, keys[i].ptr, keys[i].len);
            len = keys[i].len;
        }
        dst[len] = 0;
        off += len + 1;
        if (len > t->max_piece) t->max_piece = len;
        if ((ty == TT_CONTROL || ty == TT_USER_DEFINED) && keys[i].len > 0) n_specials++;
    }
    t->piece_off[n] = off;

    t->specials = calloc(n_specials ? n_specials : 1, sizeof *t->specials);
    if (!t->specials) return TOK_ENOMEM;
    for (int32_t i = 0; i < n; i++) {
        if ((t->type[i] == TT_CONTROL || t->type[i] == TT_USER_DEFINED) && keys[i].len > 0) {
            struct Special *s = &t->specials[t->n_specials++];
            s->id = i;
            s->len = (uint32_t)keys[i].len;
            s->text = t->pieces + t->piece_off[i];
            s->control = t->type[i] == TT_CONTROL;
            t->special_first[(unsigned char)s->text[0]] |=
                s->control ? SPECIAL_ANY : SPECIAL_ANY | SPECIAL_USER;
        }
    }
    qsort(t->specials, t->n_specials, sizeof *t->specials, special_cmp);
    return TOK_OK;
}

/* One merge in flight: its text split at the space, the hashes of both halves, then the ids. */
struct MergeLine {
    const char *left, *right;
    size_t la, lb;
    uint64_t ha, hb;
    uint64_t key; /* left id << 32 | right id */
    int32_t joined;
};

#define MERGE_BATCH 64

/* Merges "left right" resolved to ids through the token texts, as a BPE model built from the
 * same vocabulary and merge list would. Done in batches so that the map's slots for a batch
 * are fetched while the one before it is resolved. The merged token is looked for first right
 * after the previous merge's (vocabularies list merged tokens in merge order: Qwen2's merge r
 * makes token 256 + r), and through the map otherwise. */
static int load_merges(struct Tokenizer *t, const struct GgufFile *g, const struct StrMap *map,
                       char *err, size_t errlen)
{
    const char *path = gguf_path(g);
    enum GgufValueType et;
    uint64_t n_merges;
    if (gguf_get_arr_info(g, "tokenizer.ggml.merges", &et, &n_merges) != GGUF_OK ||
        et != GGUF_TYPE_STRING) {
        set_err(err, errlen, "%s: tokenizer.ggml.merges (array of strings) is missing", path);
        return TOK_EFORMAT;
    }
    if (n_merges > UINT32_MAX / 2) {
        set_err(err, errlen, "%s: %llu merges is too many", path, (unsigned long long)n_merges);
        return TOK_EFORMAT;
    }
    if (hash_init(&t->merges, (size_t)n_merges)) return TOK_ENOMEM;

    struct MergeLine line[MERGE_BATCH];
    char *joined = NULL;
    size_t joined_cap = 0;
    int32_t prev = -1;
    int rc = TOK_OK;
    for (uint64_t r0 = 0; r0 < n_merges && rc == TOK_OK; r0 += MERGE_BATCH) {
        size_t n = n_merges - r0 < MERGE_BATCH ? (size_t)(n_merges - r0) : MERGE_BATCH;
        for (size_t j = 0; j < n; j++) {
            struct GgufString m;
            uint64_t r = r0 + j;
            if (gguf_get_arr_str(g, "tokenizer.ggml.merges", r, &m) != GGUF_OK) {
                set_err(err, errlen, "%s: tokenizer.ggml.merges[%llu] unreadable", path,
                        (unsigned long long)r);
                rc = TOK_EFORMAT;
                break;
            }
            const char *sp = m.len > 1 ? memchr(m.ptr + 1, ' ', m.len - 1) : NULL;
            if (!sp || sp + 1 == m.ptr + m.len) {
                set_err(err, errlen, "%s: merge %llu \"%.*s\" is not \"left right\"", path,
                        (unsigned long long)r, (int)(m.len > 64 ? 64 : m.len), m.ptr);
                rc = TOK_EFORMAT;
                break;
            }
            struct MergeLine *l = &line[j];
            l->left = m.ptr;
            l->la = (size_t)(sp - m.ptr);
            l->right = sp + 1;
            l->lb = m.len - l->la - 1;
            l->ha = hash_bytes(l->left, l->la);
            l->hb = hash_bytes(l->right, l->lb);
            hash_prefetch(&map->table, l->ha);
            hash_prefetch(&map->table, l->hb);
        }
        for (size_t j = 0; j < n && rc == TOK_OK; j++) {
            struct MergeLine *l = &line[j];
            int32_t a = strmap_get_hashed(map, l->left, l->la, l->ha);
            int32_t b = strmap_get_hashed(map, l->right, l->lb, l->hb);
            int32_t ab = prev + 1;
            const struct GgufString *k = ab > 0 && ab < t->n_vocab ? &map->keys[ab] : NULL;
            if (!k || k->len != l->la + l->lb || memcmp(k->ptr, l->left, l->la) != 0 ||
                memcmp(k->ptr + l->la, l->right, l->lb) != 0) {
                if (l->la + l->lb > joined_cap) {
                    joined_cap = 2 * (l->la + l->lb);
                    char *nj = realloc(joined, joined_cap);
                    if (!nj) { rc = TOK_ENOMEM; break; }
                    joined = nj;
                }
                memcpy(joined, l->left, l->la);
                memcpy(joined + l->la, l->right, l->lb);
                ab = strmap_get(map, joined, l->la + l->lb);
            }
            if (a < 0 || b < 0 || ab < 0) {
                size_t len = l->la + 1 + l->lb;
                set_err(err, errlen, "%s: merge %llu \"%.*s\" names a token not in the "
                        "vocabulary", path, (unsigned long long)(r0 + j),
                        (int)(len > 64 ? 64 : len), l->left);
                rc = TOK_EFORMAT;
                break;
            }
            prev = ab;
            l->key = merge_key(a, b);
            l->joined = ab;
            hash_prefetch(&t->merges, hash_u64(l->key));
        }
        for (size_t j = 0; j < n && rc == TOK_OK; j++)
            merge_put(t, line[j].key, (uint32_t)(r0 + j), line[j].joined);
    }
    free(joined);
    return rc;
}

int tok_load_gguf(const struct GgufFile *g, struct Tokenizer **out, char *err, size_t errlen)
{
    *out = NULL;
    const char *path = gguf_path(g);
    struct GgufString model, pre_name;
    if (gguf_get_str(g, "tokenizer.ggml.model", &model) != GGUF_OK) {
        set_err(err, errlen, "%s: no tokenizer.ggml.model", path);
        return TOK_EFORMAT;
    }
    if (!str_eq(model, "gpt2")) {
        set_err(err, errlen, "%s: tokenizer model \"%.*s\" is not supported (only \"gpt2\", "
                "byte-level BPE)", path, (int)(model.len > 64 ? 64 : model.len), model.ptr);
        return TOK_EUNSUPPORTED;
    }
    enum PreTokenizer pre = PRE_GPT2;
    if (gguf_get_str(g, "tokenizer.ggml.pre", &pre_name) == GGUF_OK &&
        !pre_from_name(pre_name, &pre)) {
        set_err(err, errlen, "%s: pre-tokenizer \"%.*s\" is not supported (supported: gpt2, "
                "gpt-2, default, smollm, starcoder, refact, command-r, codeshell, qwen2, "
                "deepseek-r1-qwen)", path,
                (int)(pre_name.len > 64 ? 64 : pre_name.len), pre_name.ptr);
        return TOK_EUNSUPPORTED;
    }
    enum GgufValueType et;
    uint64_t n_tokens;
    if (gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &n_tokens) != GGUF_OK ||
        et != GGUF_TYPE_STRING || n_tokens == 0 || n_tokens > INT32_MAX / 2) {
        set_err(err, errlen, "%s: tokenizer.ggml.tokens (array of strings) missing or empty", path);
        return TOK_EFORMAT;
    }

    int rc = TOK_ENOMEM;
    struct GgufString *keys = NULL;
    struct StrMap map = {0};
    uint64_t *hashes = NULL; /* of every token's text, while the map is filled */
    struct Tokenizer *t = calloc(1, sizeof *t);
    if (!t) goto err;
    t->n_vocab = (int32_t)n_tokens;
    t->pre = pre;
    keys = calloc(n_tokens, sizeof *keys);
    map.keys = keys;
    if (!keys || hash_init(&map.table, (size_t)n_tokens)) goto err;

    uint32_t byte_to_cp[256];
    int16_t cp_to_byte[324];
    byte_map_build(byte_to_cp, cp_to_byte);
    if ((rc = load_vocab(t, g, keys, cp_to_byte, err, errlen)) != TOK_OK) goto err;
    hashes = malloc((size_t)t->n_vocab * sizeof *hashes);
    if (!hashes) { rc = TOK_ENOMEM; goto err; }
    for (int32_t i = 0; i < t->n_vocab; i++) {
        hashes[i] = hash_bytes(keys[i].ptr, keys[i].len);
        if (i >= 32) hash_prefetch(&map.table, hashes[i]);
        if (i >= 32) strmap_put(&map, i - 32, hashes[i - 32]);
    }
    for (int32_t i = t->n_vocab > 32 ? t->n_vocab - 32 : 0; i < t->n_vocab; i++)
        strmap_put(&map, i, hashes[i]);
    /* Real vocabularies lack the tokens of bytes never seen in training (SmolLM2: some C0
     * controls, 0xC0, 0xC1, 0xF1, 0xF2, 0xF5..0xFF); printable ASCII, space and newline are
     * what makes it a byte-level vocabulary at all. */
    for (unsigned b = 0; b < 256; b++) {
        char u[4];
        size_t k = utf8_encode(byte_to_cp[b], u);
        t->byte_id[b] = strmap_get(&map, u, k);
        if (t->byte_id[b] < 0 && ((b >= 0x20 && b <= 0x7E) || b == '\n')) {
            set_err(err, errlen, "%s: vocabulary has no token for byte 0x%02X: not byte-level",
                    path, b);
            rc = TOK_EFORMAT;
            goto err;
        }
    }
    if ((rc = load_merges(t, g, &map, err, errlen)) != TOK_OK) goto err;

    if ((rc = load_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos, err, errlen)) ||
        (rc = load_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos, err, errlen)))
        goto err;
    if (gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos) != GGUF_OK) t->add_bos = 0;
    add_end_id(t, t->eos);
    static const char *end_keys[] = {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"};
    for (size_t i = 0; i < 2; i++) {
        int32_t id;
        if ((rc = load_id(g, end_keys[i], t->n_vocab, &id, err, errlen))) goto err;
        add_end_id(t, id);
    }
    static const char *end_texts[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"};
    for (size_t i = 0; i < sizeof end_texts / sizeof end_texts[0]; i++)
        add_end_id(t, strmap_get(&map, end_texts[i], strlen(end_texts[i])));

    if ((rc = load_chat(t, g)) != TOK_OK) goto err;
    hash_free(&map.table);
    free(hashes);
    free(keys);
    *out = t;
    return TOK_OK;
err:
    if (rc == TOK_ENOMEM) set_err(err, errlen, "%s: out of memory loading the tokenizer", path);
    hash_free(&map.table);
    free(hashes);
    free(keys);
    tok_destroy(&t);
    return rc;
}

void tok_destroy(struct Tokenizer **pt)
{
    if (!pt || !*pt) return;
    struct Tokenizer *t = *pt;
    free(t->pieces);
    free(t->piece_off);
    free(t->type);
    hash_free(&t->merges);
    free(t->specials);
    free(t->chat_default_system);
    free(t);
    *pt = NULL;
}

int32_t tok_n_vocab(const struct Tokenizer *t) { return t->n_vocab; }
int32_t tok_bos(const struct Tokenizer *t) { return t->bos; }
int32_t tok_eos(const struct Tokenizer *t) { return t->eos; }
size_t tok_max_piece_len(const struct Tokenizer *t) { return t->max_piece; }

int tok_is_end(const struct Tokenizer *t, int32_t id)
{
    for (size_t i = 0; i < t->n_end; i++)
        if (t->end_ids[i] == id) return 1;
    return 0;
}

int tok_is_special(const struct Tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && t->type[id] == TT_CONTROL;
}

const char *tok_piece(const struct Tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_vocab) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = (size_t)(t->piece_off[id + 1] - t->piece_off[id] - 1);
    return t->pieces + t->piece_off[id];
}

/* ---- decoding -------------------------------------------------------------------------- */

int tok_decode(const struct Tokenizer *t, const int32_t *ids, size_t n, char *out, size_t cap,
               size_t *n_out)
{
    *n_out = 0;
    if ((!ids && n > 0) || (!out && cap > 0)) return TOK_EINPUT;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *p = tok_piece(t, ids[i], &len);
        if (!p) return TOK_ERANGE;
        if (total < cap) memcpy(out + total, p, len < cap - total ? len : cap - total);
        total += len;
    }
    *n_out = total;
    return TOK_OK;
}

/* ---- chat ------------------------------------------------------------------------------ */

struct OutBuf { char *p; size_t cap, n; };

static void out_put(struct OutBuf *o, const char *s, size_t n)
{
    if (o->n < o->cap) memcpy(o->p + o->n, s, n < o->cap - o->n ? n : o->cap - o->n);
    o->n += n;
}

static void chat_turn(struct OutBuf *o, const char *role, const char *content, size_t len)
{
    out_put(o, "<|im_start|>", 12);
    out_put(o, role, strlen(role));
    out_put(o, "\n", 1);
    out_put(o, content, len);
    out_put(o, "<|im_end|>\n", 11);
}

int tok_chat_format(const struct Tokenizer *t, const struct ChatMessage *msgs, size_t n_msgs,
                    int add_assistant_prompt, char *out, size_t cap, size_t *n_out)
{
    static const char *roles[] = {"system", "user", "assistant"};
    *n_out = 0;
    if ((!msgs && n_msgs > 0) || (!out && cap > 0)) return TOK_EINPUT;
    for (size_t i = 0; i < n_msgs; i++)
        if ((unsigned)msgs[i].role > CHAT_ASSISTANT || (!msgs[i].content && msgs[i].len > 0))
            return TOK_EINPUT;
    /* Leave room for the NUL: the text is laid out in cap - 1 bytes. */
    struct OutBuf o = {out, cap > 0 ? cap - 1 : 0, 0};
    if (n_msgs > 0 && msgs[0].role != CHAT_SYSTEM && t->chat_default_system)
        chat_turn(&o, "system", t->chat_default_system, t->chat_default_system_len);
    for (size_t i = 0; i < n_msgs; i++)
        chat_turn(&o, roles[msgs[i].role], msgs[i].content ? msgs[i].content : "", msgs[i].len);
    if (add_assistant_prompt) out_put(&o, "<|im_start|>assistant\n", 22);
    if (cap > 0) out[o.n < o.cap ? o.n : o.cap] = 0;
    *n_out = o.n;
    return t->chat == CHAT_OTHER ? TOK_EUNSUPPORTED : TOK_OK;
}

/* ---- streaming ------------------------------------------------------------------------- */

void tok_stream_init(struct TokStream *s, const struct Tokenizer *t)
{
    memset(s, 0, sizeof *s);
    s->tok = t;
}

static const char replacement[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

int tok_stream_feed(struct TokStream *s, int32_t id, char *out, size_t cap)
{
    size_t plen;
    const unsigned char *p = (const unsigned char *)tok_piece(s->tok, id, &plen);
    if (!p) return TOK_ERANGE;
    struct OutBuf o = {out, cap, 0};
    size_t i = 0;
    unsigned char held[8];
    size_t n_held = 0;
    if (s->n_pending > 0) {
        /* Finish the sequence started in earlier pieces (pending is a valid prefix). */
        unsigned char tmp[8];
        size_t n = s->n_pending;
        memcpy(tmp, s->pending, n);
        size_t take = plen < 4 - n ? plen : 4 - n;
        memcpy(tmp + n, p, take);
        uint32_t cp;
        size_t k = utf8_decode(tmp, n + take, &cp);
        if (cp != UTF8_INVALID) {
            out_put(&o, (const char *)tmp, k);
            i = k - n;
        } else if (k == n + take && utf8_is_incomplete(tmp, k)) {
            memcpy(held, tmp, k);  /* the whole piece extends it and it is still short */
            n_held = k;
            i = plen;
        } else {
            out_put(&o, replacement, 3);  /* the piece broke the sequence after k bytes */
            i = k - n;
        }
    }
    while (i < plen) {
        uint32_t cp;
        size_t k = utf8_decode(p + i, plen - i, &cp);
        if (cp != UTF8_INVALID) {
            out_put(&o, (const char *)p + i, k);
        } else if (i + k == plen && utf8_is_incomplete(p + i, k)) {
            memcpy(held, p + i, k);
            n_held = k;
        } else {
            out_put(&o, replacement, 3);
        }
        i += k;
    }
    if (o.n > cap || o.n > INT32_MAX) return TOK_ERANGE;
    memcpy(s->pending, held, n_held);
    s->n_pending = n_held;
    return (int)o.n;
}

int tok_stream_flush(struct TokStream *s, char *out, size_t cap)
{
    if (s->n_pending == 0) return 0;
    if (cap < 3) return TOK_ERANGE;
    memcpy(out, replacement, 3);
    s->n_pending = 0;
    return 3;
}
