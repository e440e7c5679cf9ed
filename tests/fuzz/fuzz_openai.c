/* libFuzzer target: the OpenAI-compatible API's request reader (openai_translate: a JSON body to
 * the msgpack `query`), then the daemon's own decoder over what it wrote, as diffragd runs
 * them. The first byte picks whether a default collection is set; the rest is the body.
 * Checks: a refusal says why; an accepted body becomes exactly one well-formed msgpack map
 * that proto_decode reads as a query or refuses with a code and a reason. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/mp.h"
#include "daemon/openai.h"
#include "daemon/proto.h"

static struct Config cfg;
static int configured;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!configured) {
        config_defaults(&cfg);
        cfg.model_ctx = 32768;
        cfg.ctx_auto = cfg.model_ctx - cfg.max_tokens;
        configured = 1;
    }
    if (size < 1)
        return 0;
    const char *dflt = data[0] & 1 ? "kb" : NULL;
    size_t len = size - 1;
    /* an exactly sized copy, so a read one past the body is an ASan report */
    char *body = malloc(len ? len : 1);
    if (!body)
        return 0;
    memcpy(body, data + 1, len);
    struct MpWriter w;
    struct OpenAiAsk ask;
    char msg[512];
    const char *param;
    mpw_init(&w);
    struct OpenAiLimits lim = { dflt, (size_t)cfg.http_max_json_values, cfg.max_turn_bytes };
    const char *why = openai_translate(body, len, &lim, &w, &ask, msg, sizeof msg, &param);
    if (why) {
        if (!why[0] || (ask.status != 400 && ask.status != 413))
            abort();   /* a refusal always says why, with a status */
    } else if (!w.failed) {
        char err[512];
        if (mp_check(w.buf.data, w.buf.size, MP_MAX_DEPTH, err, sizeof err))
            abort();   /* what it writes is one well-formed value */
        struct RequestParams p;
        enum ErrCode code;
        int rc = proto_decode(w.buf.data, w.buf.size, &cfg, &p, &code, err, sizeof err);
        if (rc == 0 && (code != EC_OK || p.op != OP_QUERY || p.stream != ask.stream))
            abort();
        if (rc != 0 && (code == EC_OK || code >= EC_COUNT || !err[0]))
            abort();
        proto_params_free(&p);
    }
    mpw_destroy(&w);
    free(body);
    return 0;
}
