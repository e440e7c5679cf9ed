/* libFuzzer target: the daemon's request decoder and validator (proto_decode over the msgpack
 * reader) and the broker <-> worker body decoders, which read bytes from remote workers.
 * The first byte picks tight or default limits; the rest is one message. Checks: whatever
 * proto_decode accepts obeys every limit, and every slice it returns lies inside the message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/mp.h"
#include "daemon/proto.h"
#include "daemon/wire.h"

static struct Config cfg_default, cfg_tight;
static int configured;

static void configure(void)
{
    char err[256];
    config_defaults(&cfg_default);
    config_defaults(&cfg_tight);
    /* small caps so the "too large" branches are reachable from short inputs */
    static const char *const tight[][2] = {
        { "max_message_bytes", "4096" }, { "max_docs", "3" }, { "max_question_bytes", "40" },
        { "max_top_k", "4" }, { "top_k", "2" }, { "max_tokens", "16" },
        { "default_max_tokens", "8" }, { "max_context_tokens", "128" }, { "max_depth", "3" },
        { "max_stop", "2" },
    };
    for (size_t i = 0; i < sizeof tight / sizeof tight[0]; i++)
        if (config_set(&cfg_tight, tight[i][0], tight[i][1], err, sizeof err))
            abort();   /* a table bug in this harness, not an input */
    /* What diffragd resolves at start-up from the model: its usable context, and the automatic
     * max_context_tokens (that context less max_tokens) of the default configuration. */
    cfg_default.model_ctx = 32768;
    cfg_default.ctx_auto = cfg_default.model_ctx - cfg_default.max_tokens;
    cfg_tight.model_ctx = 32768;
    cfg_tight.ctx_auto = cfg_tight.model_ctx - cfg_tight.max_tokens;
    configured = 1;
}

#define INSIDE(p, n) ((const uint8_t *)(p) >= lo && (const uint8_t *)(p) + (n) <= hi)

static void check_accepted(const struct RequestParams *p, const struct Config *c,
                           const uint8_t *lo, const uint8_t *hi)
{
    if ((size_t)(hi - lo) > c->max_message_bytes)
        abort();
    if (p->id_raw && !INSIDE(p->id_raw, p->id_len))
        abort();
    if (p->n_docs > (size_t)c->max_docs || p->n_ids > (size_t)c->max_docs ||
        p->n_stop > (size_t)c->max_stop)
        abort();
    for (size_t i = 0; i < p->n_docs; i++) {
        const struct StoreDoc *d = &p->docs[i];
        if (d->id_len < 1 || d->id_len > INDEX_MAX_ID_BYTES || d->title_len > INDEX_MAX_TITLE_BYTES)
            abort();
        if (!INSIDE(d->text, d->text_len) || (d->title_len && !INSIDE(d->title, d->title_len)) ||
            (d->meta_len && !INSIDE(d->meta, d->meta_len)))
            abort();
        /* an inline document's id is either in the message or one of auto_ids */
        if (!INSIDE(d->id, d->id_len) && !(p->auto_ids && d->id == p->auto_ids[i]))
            abort();
    }
    for (size_t i = 0; i < p->n_ids; i++)
        if (p->ids[i].len < 1 || p->ids[i].len > INDEX_MAX_ID_BYTES || !INSIDE(p->ids[i].p, p->ids[i].len))
            abort();
    if (p->collection.len > INDEX_MAX_COLLECTION_BYTES ||
        (p->collection.len && !INSIDE(p->collection.p, p->collection.len)))
        abort();
    for (size_t i = 0; i < p->collection.len; i++)
        if ((unsigned char)p->collection.p[i] < 0x20 || p->collection.p[i] == 0x7f)
            abort();
    if (p->op == OP_QUERY) {
        if (p->question.len < 1 || p->question.len > c->max_question_bytes ||
            !INSIDE(p->question.p, p->question.len))
            abort();
        if (p->top_k < 0 || p->top_k > c->max_top_k || p->max_tokens < 1 ||
            p->max_tokens > c->max_tokens || p->max_context_tokens < 64 ||
            p->max_context_tokens > config_max_context(c))
            abort();
        if (!(p->temperature >= 0 && p->temperature <= 10) || !(p->top_p > 0 && p->top_p <= 1))
            abort();
        if (p->n_docs == 0 && p->collection.len == 0)
            abort();
        if (p->system.len > c->max_question_bytes ||
            (p->system.len && !INSIDE(p->system.p, p->system.len)) || p->n_history > PROTO_MAX_HISTORY)
            abort();
        for (size_t i = 0; i < p->n_history; i++) {
            const struct CtxTurn *t = &p->history[i];
            if (t->len < 1 || t->len > c->max_question_bytes || !INSIDE(t->text, t->len) ||
                (t->assistant != 0 && t->assistant != 1))
                abort();
        }
    }
    if (p->op == OP_LIST && (p->limit < 1 || p->limit > PROTO_MAX_LIST_LIMIT))
        abort();
    if (p->op == OP_CANCEL && (!p->target_raw || !INSIDE(p->target_raw, p->target_len)))
        abort();
}

static void fuzz_wire(const uint8_t *data, size_t size)
{
    char err[256];
    struct WireInfo info;
    wire_info_decode(data, size, &info, err, sizeof err);
    struct WireJob job = { .job = 1 };
    if (wire_job_decode(data, size, &job, err, sizeof err) == 0) {
        if (!job.tokens || job.n_tokens == 0 || job.n_stop > WIRE_MAX_STOP || job.max_tokens < 1)
            abort();
        for (size_t i = 0; i < job.n_stop; i++)
            if (!job.stop[i] || strlen(job.stop[i]) == 0 || strlen(job.stop[i]) > WIRE_MAX_STOP_BYTES)
                abort();
        wire_job_free(&job);
    }
    struct WireResult res = { .job = 1 };
    if (wire_result_decode(data, size, &res, err, sizeof err) == 0) {
        const uint8_t *lo = data, *hi = data + size;
        if ((res.text_len && !INSIDE(res.text, res.text_len)) ||
            (res.code_len && !INSIDE(res.code, res.code_len)) ||
            (res.message_len && !INSIDE(res.message, res.message_len)))
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!configured)
        configure();
    if (size < 1)
        return 0;
    uint8_t mode = data[0];
    const uint8_t *msg = data + 1;
    size_t len = size - 1;
    /* an exactly sized copy, so a read one past the message is an ASan report */
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return 0;
    memcpy(buf, msg, len);
    if (mode & 0x80) {
        fuzz_wire(buf, len);
    } else {
        const struct Config *c = mode & 1 ? &cfg_tight : &cfg_default;
        struct RequestParams p;
        enum ErrCode code;
        char err[512];
        int rc = proto_decode(buf, len, c, &p, &code, err, sizeof err);
        if (rc == 0) {
            if (code != EC_OK)
                abort();
            check_accepted(&p, c, buf, buf + len);
        } else if (code == EC_OK || code >= EC_COUNT || !err[0]) {
            abort();   /* a refusal always names its code and says why */
        } else if (p.id_raw && !(p.id_raw >= buf && p.id_raw + p.id_len <= buf + len)) {
            abort();
        }
        /* the error reply for it must encode */
        struct MpWriter w;
        mpw_init(&w);
        proto_error(&w, p.id_raw, p.id_len, rc ? code : EC_INTERNAL, err);
        if (!w.failed) {
            char merr[128];
            if (mp_check(w.buf.data, w.buf.size, MP_MAX_DEPTH, merr, sizeof merr))
                abort();
        }
        mpw_destroy(&w);
        proto_params_free(&p);
        /* mp_check and mp_skip agree on where one value ends */
        char merr[160];
        if (mp_check(buf, len, MP_MAX_DEPTH, merr, sizeof merr) == MP_OK) {
            struct MpCursor cur;
            mp_cursor_init(&cur, buf, len);
            if (mp_skip(&cur) != MP_OK || cur.p != buf + len)
                abort();
        }
    }
    free(buf);
    return 0;
}
