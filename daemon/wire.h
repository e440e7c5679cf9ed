/* The broker <-> worker protocol, the same for worker threads (inproc://) and worker processes
 * on other machines (tcp://). A worker's DEALER sends and receives two-frame messages; the
 * broker's ROUTER sees the worker's routing id in front of them.
 *
 *   frame 0: one command byte          frame 1: body
 *   WIRE_READY      0x01  w -> b       msgpack {v, model, vocab, n_ctx, kv_bytes, threads,
 *                                      max_running}
 *   WIRE_HEARTBEAT  0x02  both         (no body frame)
 *   WIRE_JOB        0x03  b -> w       u64 job id (LE) | msgpack {tokens: bin of int32 LE,
 *                                      max_tokens, temperature, top_p, seed, stop: [str],
 *                                      stream: bool, doc_spans: bin of uint32 LE pairs
 *                                      [start, end) (the documents' prompt tokens),
 *                                      [watch: bin of int32 LE pairs (layer, head); absent:
 *                                      the worker's default set], [docs: bin of 2 uint32 LE,
 *                                      the documents' tokens [start, end)], [chunk_refs: bin of
 *                                      uint32 LE pairs (collection id, chunk id), one a doc
 *                                      span, (0, 0): not a stored chunk], [lead_tokens: bin
 *                                      of int32 LE, doc_leads: bin of uint32 LE pairs [start,
 *                                      end) into lead_tokens, one a doc span: what each
 *                                      chunk's KV copy is made after besides the frame],
 *                                      [doc_ranks: bin of uint32 LE, one a doc span: its
 *                                      retrieval rank among the prompt's chunks, 0 the best],
 *                                      [quote: true: quote decoding over the doc spans]}
 *   WIRE_DELTA      0x04  w -> b       u64 job id | UTF-8 text released by one token
 *   WIRE_RESULT     0x05  w -> b       u64 job id | msgpack {finish, text, prompt_tokens,
 *                                      completion_tokens, cached_tokens, [reused_tokens],
 *                                      prefill_ms, ttft_ms,
 *                                      decode_ms,
 *                                      signals: {n, logprob, entropy, margin, doc_mass,
 *                                      gen_mass, diff_doc_mass, lookback: bin of n float32 LE,
 *                                      text_end: bin of n uint32 LE, [quote_removed: bin
 *                                      of n float32 LE]}, [quotes: bin of uint32 LE
 *                                      triples (doc span, byte start, byte end)],
 *                                      [code, message] when finish is "error"}
 *
 * The signals are those of the answer tokens (the generated tokens without the control token
 * that ends the turn; docs/groundedness.md): text_end[i] is the length of the answer text
 * released up to and including token i, so token i owns text[text_end[i-1] .. text_end[i]).
 *   WIRE_CANCEL     0x06  b -> w       u64 job id | one reason byte (enum WireReason)
 *   WIRE_DISCONNECT 0x07  both         (no body frame) the peer forgets the sender
 *
 * A worker runs up to max_running jobs at once (continuous batching; 1 when READY does not
 * say): after READY it runs none, and each RESULT ends one; the broker sends a JOB only to a
 * worker running fewer. Any message proves the sender alive; each side sends HEARTBEAT every heartbeat_ms
 * and presumes the other dead after heartbeat_liveness intervals of silence. Job ids are never
 * reused, so a late DELTA or RESULT of a job the broker gave up on is recognised and dropped. */
#ifndef DIFFRAG_WIRE_H
#define DIFFRAG_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/mp.h"

enum WireCmd {
    WIRE_READY = 0x01,
    WIRE_HEARTBEAT = 0x02,
    WIRE_JOB = 0x03,
    WIRE_DELTA = 0x04,
    WIRE_RESULT = 0x05,
    WIRE_CANCEL = 0x06,
    WIRE_DISCONNECT = 0x07,
};

enum WireReason { WIRE_REASON_CANCEL = 1, WIRE_REASON_DEADLINE = 2, WIRE_REASON_SHUTDOWN = 3 };

enum WireFinish { WF_STOP, WF_LENGTH, WF_CANCELLED, WF_DEADLINE, WF_ERROR };
const char *wire_finish_name(enum WireFinish f);
int wire_finish_parse(const char *s, size_t len);   /* -1 when unknown */

/* The largest broker <-> worker message either side accepts: a JOB holds at most 131072
 * tokens (512 KiB) and a RESULT the text of as many (a few MiB); a peer announcing more is
 * dropped before anything is allocated for it. */
#define WIRE_MAX_MESSAGE (32ll << 20)

#define WIRE_MAX_STOP 64
#define WIRE_MAX_STOP_BYTES 256

struct WireInfo {
    char model[128];
    int64_t vocab, n_ctx, threads;
    uint64_t kv_bytes;
    int64_t max_running;        /* sequences it runs at once (1..WIRE_MAX_RUNNING; absent: 1) */
};

#define WIRE_MAX_RUNNING 256

/* The grounding part of a job: the prompt's document token spans and the watched heads. */
struct WireGround {
    const uint32_t *doc_spans;  /* (n_spans, 2): [start, end) token ranges */
    size_t n_spans;
    const int32_t *watch;       /* (n_watch, 2): layer, head; NULL: the worker's default set */
    size_t n_watch;
    int self_check;             /* run the self-check after the answer (docs/groundedness.md) */
    const int32_t *bare;        /* the prompt without its documents, for context reliance;
                                   NULL: not measured */
    size_t n_bare;
    uint32_t docs[2];           /* the documents' tokens [start, end): from the first label to
                                   the last separator (chunk KV reuse); start == end: none */
    const uint32_t *chunk_refs; /* (n_spans, 2): each span's stored chunk (collection id,
                                   chunk id), (0, 0) for none; NULL: none is stored */
    const int32_t *hidden;      /* layers whose residual stream the answer reports
                                   (WireResult.hidden); NULL: none */
    size_t n_hidden;
    const int32_t *lead_tokens; /* each span's lead (ChunkKvLeads): its tokens are lead_tokens[
                                   doc_leads[2i]..doc_leads[2i+1]); NULL: none */
    size_t n_lead_tokens;
    const uint32_t *doc_leads;  /* (n_spans, 2) */
    const uint32_t *doc_ranks;  /* (n_spans) each span's rank among them by retrieval score, 0
                                   the best; NULL: none */
    int quote;                  /* quote decoding over the doc spans (model/quote.h) */
};

#define WIRE_MAX_WATCH 1024
#define WIRE_MAX_HIDDEN 8             /* layers of WireGround.hidden (= ENGINE_MAX_CAPTURE) */
#define WIRE_HIDDEN_ROWS 3            /* rows of WireResult.hidden per layer: first, mean, last */
#define WIRE_MAX_HIDDEN_FLOATS (1u << 20)

/* A job as the worker runs it. tokens, stop strings, spans and watch are owned
 * (wire_job_free). */
struct WireJob {
    uint64_t job;
    int32_t *tokens;
    size_t n_tokens;
    int max_tokens;
    float temperature, top_p;
    uint64_t seed;
    char **stop;              /* NUL-terminated copies */
    size_t n_stop;
    int stream;
    uint32_t *doc_spans;      /* (n_spans, 2), each within [0, n_tokens] with start <= end */
    size_t n_spans;
    int32_t *watch;           /* (n_watch, 2) when watch_given */
    size_t n_watch;
    int watch_given;          /* 0: the worker's default set */
    int self_check;           /* the self-check after the answer */
    int32_t *bare;            /* the prompt without its documents (context reliance); NULL: none */
    size_t n_bare;
    uint32_t docs[2];         /* the documents' tokens [start, end), every doc span inside;
                                 start == end: not given */
    uint32_t *chunk_refs;     /* (n_spans, 2) stored chunks (WireGround); NULL: none */
    int32_t *hidden;          /* (n_hidden) layers to report (WireGround); NULL: none */
    size_t n_hidden;
    int32_t *lead_tokens;     /* the spans' leads (WireGround), at most n_tokens of them, each
                                 >= 0; NULL: none */
    size_t n_lead_tokens;
    uint32_t *doc_leads;      /* (n_spans, 2) inside lead_tokens, given with them */
    uint32_t *doc_ranks;      /* (n_spans) (WireGround); NULL: none */
    int quote;                /* quote decoding (WireGround) */
};

/* The answer tokens' signals, struct of arrays of n each. */
enum WireSig { WS_LOGPROB, WS_ENTROPY, WS_MARGIN, WS_DOC_MASS, WS_GEN_MASS, WS_DIFF_DOC_MASS,
               WS_LOOKBACK, WS_N_FLOAT };
const char *wire_sig_name(int s);   /* the key of each float array ("logprob", ...) */
struct WireSignals {
    size_t n;
    float *f[WS_N_FLOAT];
    uint32_t *text_end;       /* non-decreasing; the last equals the text's length */
    float *quote_removed;     /* quote decoding: the mass the constraint removed at each token,
                                 in [0, 1] (key "quote_removed"); NULL: the job did not quote */
};

struct WireResult {
    uint64_t job;
    enum WireFinish finish;
    const char *text; size_t text_len;      /* borrowed (from the message when decoded) */
    int64_t prompt_tokens, completion_tokens;
    int64_t cached_tokens;                  /* prompt tokens from the prefix cache */
    int64_t reused_tokens;                  /* document tokens whose stored chunk KV stayed in
                                               a blend (docs/kv-reuse.md) */
    double prefill_ms, ttft_ms, decode_ms;
    const char *code, *message;             /* finish == WF_ERROR; borrowed */
    size_t code_len, message_len;
    int has_signals;                        /* sig holds the answer tokens' signals */
    int has_check;                          /* the self-check ran: check holds its verdict */
    float check;                            /* log P(yes words) - log P(no words), finite */
    int has_reliance;                       /* reliance holds the context reliance */
    float reliance;                         /* mean log-probability of the answer tokens with
                                               the documents minus without them, finite */
    struct WireSignals sig;                 /* encode: borrowed; decode: owned */
    /* The residual stream of the job's hidden layers, in its order, each as WIRE_HIDDEN_ROWS
     * rows of the model's dim: at the prompt's last position (the one that gave the first
     * answer token); its mean over the positions that gave the answer tokens; and at the last
     * position computed (the last answer token's, when the model ended its turn: the one that
     * gave the end-of-turn token). n_hidden floats (0: none). encode: borrowed; decode: owned,
     * every value finite. */
    float *hidden;
    size_t n_hidden;
    /* Quote decoding: the answer's spans in order, (n_quotes, 3): doc span index, and the
     * bytes [start, end) of that span's text the answer quotes. encode: borrowed; decode:
     * owned, each span index below the job's doc spans' count is the broker's to check; start < end (the broker checks
     * them against its prompt). */
    uint32_t *quotes;
    size_t n_quotes;
};

#define WIRE_MAX_QUOTES 64

static inline void wire_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t wire_get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Encoders append one msgpack value (no job id prefix) to w. */
void wire_info_encode(struct MpWriter *w, const struct WireInfo *info);
void wire_job_encode(struct MpWriter *w, const int32_t *tokens, size_t n_tokens, int max_tokens,
                     double temperature, double top_p, uint64_t seed, const char *const *stop,
                     const size_t *stop_lens, size_t n_stop, int stream,
                     const struct WireGround *ground);   /* ground NULL: no spans, default watch */
void wire_result_encode(struct MpWriter *w, const struct WireResult *r);

/* Decoders take the body after the job id. 0, or -1 with err (the peer sent garbage). */
int wire_info_decode(const void *buf, size_t len, struct WireInfo *out, char *err, size_t errlen);
int wire_job_decode(const void *buf, size_t len, struct WireJob *out, char *err, size_t errlen);
void wire_job_free(struct WireJob *j);
/* The result's strings borrow buf; its signals are checked (lengths, finite values, text_end
 * non-decreasing, on character boundaries, ending at the text's end, no more than
 * completion_tokens) and copied: free them with wire_result_free. */
int wire_result_decode(const void *buf, size_t len, struct WireResult *out, char *err, size_t errlen);
void wire_result_free(struct WireResult *r);

#endif
