/* The decode loop and stop-string handling: output is released only once it can no longer
 * become part of a stop string, so streamed text never has to be taken back. */
#include "model/generate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *finish_reason_name(enum FinishReason r)
{
    switch (r) {
    case FINISH_STOP: return "stop";
    case FINISH_LENGTH: return "length";
    case FINISH_CANCELLED: return "cancelled";
    case FINISH_ERROR: return "error";
    }
    return "error";
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct OutBuf { char *p; size_t len, cap; };

static int out_append(struct OutBuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) return -1;
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

/* Length of the longest suffix of text[0..len) that is a proper prefix of a stop string. */
static size_t held_back(const char *text, size_t len, const char *const *stop, size_t n_stop)
{
    size_t hold = 0;
    for (size_t i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        for (size_t k = sl > 1 ? sl - 1 : 0; k > hold; k--)
            if (k <= len && memcmp(text + len - k, stop[i], k) == 0) { hold = k; break; }
    }
    return hold;
}

int generate(struct Engine *e, const int32_t *prompt, size_t n_prompt, const struct GenParams *p,
             gen_token_fn cb, void *user, struct GenResult *r, char *err, size_t errlen)
{
    memset(r, 0, sizeof *r);
    r->n_prompt = (int)n_prompt;
    r->finish = FINISH_ERROR;
    const struct Model *m = engine_model(e);
    struct Sampler *smp = NULL;
    struct OutBuf out = {0};
    size_t emitted = 0;
    int rc;
    if (n_prompt == 0) {
        snprintf(err, errlen, "empty prompt");
        return ENGINE_EINPUT;
    }
    if (sampler_new(&p->sampler, m->cfg.vocab, &smp) != 0) {
        snprintf(err, errlen, "out of memory");
        return ENGINE_ENOMEM;
    }
    double t0 = now_ms();
    if (p->prefilled && engine_n_past(e) == (int)n_prompt) {
        rc = ENGINE_OK;
    } else {
        engine_reset(e);
        rc = engine_prefill(e, prompt, n_prompt, err, errlen);
    }
    r->prefill_ms = now_ms() - t0;
    if (rc == ENGINE_ECANCELLED) { r->finish = FINISH_CANCELLED; rc = ENGINE_OK; goto done; }
    if (rc) goto done;

    struct TokStream ts;
    tok_stream_init(&ts, m->tok);
    double t1 = now_ms();
    r->finish = FINISH_LENGTH;
    for (int i = 0; i < p->max_tokens; i++) {
        struct GenToken gt = {.index = i};
        rc = engine_sample(e, smp, &gt.id, &gt.sig, err, errlen);
        if (rc) break;
        gt.mass = engine_attn_mass(e, &gt.n_mass);
        r->n_generated++;
        /* A control token (e.g. <|im_start|>) never belongs in an answer: it ends the turn
         * like EOS instead of leaking template text into the output. */
        int end = tok_is_end(m->tok, gt.id) || tok_is_special(m->tok, gt.id);
        char piece[512];
        int nb = end ? tok_stream_flush(&ts, piece, sizeof piece)
                     : tok_stream_feed(&ts, gt.id, piece, sizeof piece);
        if (nb < 0) nb = 0;
        if (out_append(&out, piece, (size_t)nb)) { rc = ENGINE_ENOMEM; goto done; }
        /* A stop string anywhere in the unreleased tail ends the output before it. */
        int stopped = end;
        for (size_t s = 0; s < p->n_stop && !stopped; s++) {
            size_t sl = strlen(p->stop[s]);
            size_t from = emitted > sl ? emitted - sl : 0;
            char *hit = sl ? memmem(out.p + from, out.len - from, p->stop[s], sl) : NULL;
            if (hit) { out.len = (size_t)(hit - out.p); out.p[out.len] = 0; stopped = 1; }
        }
        size_t release = stopped ? out.len : out.len - held_back(out.p, out.len, p->stop, p->n_stop);
        if (release < emitted) release = emitted;
        gt.text = out.p ? out.p + emitted : "";
        gt.text_len = release - emitted;
        emitted = release;
        if (cb && cb(user, &gt)) { r->finish = FINISH_CANCELLED; break; }
        if (stopped) { r->finish = FINISH_STOP; break; }
        if (i + 1 == p->max_tokens) break;
        if (engine_n_past(e) >= engine_opts(e)->n_ctx) break; /* context full: length */
        rc = engine_decode(e, gt.id, err, errlen);
        if (rc == ENGINE_ECANCELLED) { r->finish = FINISH_CANCELLED; rc = ENGINE_OK; break; }
        if (rc) break;
    }
    r->decode_ms = now_ms() - t1;
    if (rc == ENGINE_OK && r->finish != FINISH_STOP) {
        char tail[16];
        int nb = tok_stream_flush(&ts, tail, sizeof tail);
        if (nb > 0 && out_append(&out, tail, (size_t)nb)) rc = ENGINE_ENOMEM;
        /* Release what was held back for a stop string that never came. */
        if (rc == ENGINE_OK && cb && emitted < out.len) {
            struct GenToken gt = {.id = -1, .index = -1, .text = out.p + emitted,
                                  .text_len = out.len - emitted};
            cb(user, &gt);
        }
    }
done:
    sampler_destroy(&smp);
    if (rc) { free(out.p); r->finish = FINISH_ERROR; return rc; }
    if (!out.p && out_append(&out, "", 0)) return ENGINE_ENOMEM;
    r->text = out.p;
    r->text_len = out.len;
    return ENGINE_OK;
}
