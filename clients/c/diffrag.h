/* libdiffrag: the C client of diffragd. It speaks only the wire protocol of docs/protocol.md
 * (msgpack maps over a ZeroMQ DEALER socket), so it works against a local or a remote daemon.
 *
 * Conventions
 * - Every call returns an int: DIFFRAG_OK (0) or one of the negative DIFFRAG_E* codes below.
 *   After a failed call on a client, diffrag_last_error() holds a message for people and
 *   diffrag_last_error_code() a code for programs: the daemon's error code ("not_found",
 *   "overloaded", ...) when the status is DIFFRAG_ESERVER, else the client's own code
 *   ("connect", "timeout", "protocol", "invalid", "nomem", "interrupted", "zmq").
 * - Results come back in plain structs allocated by the library; the caller owns them and frees
 *   each with the matching diffrag_*_free(T **), which sets the caller's pointer to NULL. On
 *   failure *out is left NULL. Every result carries `json`: the daemon's whole final reply as
 *   JSON text, for programs that want fields this version does not model.
 * - Strings given to the library are borrowed for the duration of the call only; strings are
 *   UTF-8 and NUL-terminated unless a length accompanies them.
 * - Ids: every request carries an id; the library generates "#1", "#2", ... unless the caller
 *   names one (DiffragQuery.id). Replies are matched by id, so a late reply to a call that
 *   timed out is recognised and dropped, never returned to a later call.
 *
 * Thread safety: a client handle is NOT locked inside. Use one handle per thread (each owns its
 * socket), or serialise every call on a shared handle yourself. The single exception is
 * diffrag_interrupt(), which may be called from any thread or from a signal handler.
 */
#ifndef DIFFRAG_H
#define DIFFRAG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define DIFFRAG_API __attribute__((visibility("default")))
#else
#define DIFFRAG_API
#endif

#define DIFFRAG_VERSION "0.1.0"
#define DIFFRAG_PROTOCOL_VERSION 1
#define DIFFRAG_KEY_Z85_LEN 40 /* a CurveZMQ key in Z85 text: 40 characters (+ NUL) */

/* Status codes. */
enum {
    DIFFRAG_OK           = 0,
    DIFFRAG_EINVAL       = -1, /* a bad argument: NULL where a value is required, a malformed key */
    DIFFRAG_ENOMEM       = -2, /* out of memory */
    DIFFRAG_ECONNECT     = -3, /* no connection within connect_timeout_ms: nothing listens at the
                                * endpoint, or the CurveZMQ handshake was refused */
    DIFFRAG_ETIMEOUT     = -4, /* connected, but no reply (or no next delta) within the timeout */
    DIFFRAG_EPROTOCOL    = -5, /* a reply that breaks docs/protocol.md (not one msgpack map, a
                                * missing or mistyped field, extra frames ...) */
    DIFFRAG_ESERVER      = -6, /* the daemon answered {"ok": false}; see diffrag_last_error_code */
    DIFFRAG_EINTERRUPTED = -7, /* diffrag_interrupt() ended the wait */
    DIFFRAG_EZMQ         = -8, /* a ZeroMQ call failed (its errno text is in the message) */
};

/* A static English description of a status code ("timeout", ...). Never NULL. */
DIFFRAG_API const char *diffrag_strerror(int status);

typedef struct DiffragClient DiffragClient;

/* Timeouts in milliseconds; 0 (as in a zeroed struct) means the default. */
typedef struct DiffragOptions {
    int connect_timeout_ms; /* longest wait for a connection before sending (default 5000) */
    int timeout_ms;         /* longest wait for the reply to ping, ingest, delete, drop, get,
                             * list, stats and cancel (default 30000) */
    int query_timeout_ms;   /* longest silence during a query: before its first delta or its
                             * reply, and between deltas (default 600000: a long prompt's
                             * prefill on a CPU takes minutes) */
    /* CurveZMQ, all Z85 text of DIFFRAG_KEY_Z85_LEN characters. With server_key NULL the
     * connection is plain. With server_key set, the client authenticates with secret_key (its
     * public key is derived from it when public_key is NULL), or with a fresh key pair made for
     * this handle when secret_key is NULL too (for daemons that accept any client key). */
    const char *server_key;
    const char *public_key;
    const char *secret_key;
    void *zmq_context;      /* borrowed ZeroMQ context to create the socket in (it must outlive
                             * the client); NULL: the client makes and owns its own */
} DiffragOptions;

/* Fills *o with the defaults above. */
DIFFRAG_API void diffrag_options_init(DiffragOptions *o);

/* Creates a client for endpoint: tcp://HOST:PORT, ipc://PATH or inproc://NAME
 * ("tcp://127.0.0.1:7400", "ipc:///run/diffrag/diffragd.sock"). opt may be NULL for the
 * defaults. Connecting is lazy: an endpoint where nothing listens, or whose host does not
 * resolve, fails at the first call, with DIFFRAG_ECONNECT.
 * Returns DIFFRAG_OK, DIFFRAG_EINVAL (endpoint NULL or empty or not of the forms above, a
 * malformed key, a negative timeout), DIFFRAG_ENOMEM or DIFFRAG_EZMQ, with a message in err
 * (errlen bytes, may be 0). */
DIFFRAG_API int diffrag_new(DiffragClient **out, const char *endpoint, const DiffragOptions *opt,
                            char *err, size_t errlen);

/* Closes the socket (unsent messages are dropped) and frees the client; *c becomes NULL. */
DIFFRAG_API void diffrag_destroy(DiffragClient **c);

/* The message and the code of the last failed call on c; "" after a call that succeeded.
 * Valid until the next call on c. */
DIFFRAG_API const char *diffrag_last_error(const DiffragClient *c);
DIFFRAG_API const char *diffrag_last_error_code(const DiffragClient *c);

/* Makes the call running on c stop waiting, from any thread or from a signal handler
 * (async-signal-safe). A query is cancelled on the daemon (op "cancel") and its call returns
 * as the daemon answers the cancel: DIFFRAG_OK with finish_reason "cancelled" and the answer so
 * far, or DIFFRAG_ESERVER with code "cancelled" when it had not started. A second interrupt, or
 * one during any other call, returns DIFFRAG_EINTERRUPTED at once. An interrupt that arrives
 * while no call runs is forgotten when the next call starts. */
DIFFRAG_API void diffrag_interrupt(DiffragClient *c);

/* ---- ping ---- */

typedef struct DiffragPong {
    char *version;   /* the daemon's version, "0.1.0" */
    char *model;     /* the name of the model it serves */
    double rtt_ms;   /* round trip measured by the client */
    char *json;
} DiffragPong;

/* Returns DIFFRAG_OK, DIFFRAG_ECONNECT, DIFFRAG_ETIMEOUT, DIFFRAG_EPROTOCOL, DIFFRAG_ESERVER,
 * DIFFRAG_EINTERRUPTED, DIFFRAG_ENOMEM or DIFFRAG_EZMQ (the same set for every call below,
 * plus DIFFRAG_EINVAL where arguments are checked). */
DIFFRAG_API int diffrag_ping(DiffragClient *c, DiffragPong **out);
DIFFRAG_API void diffrag_pong_free(DiffragPong **p);

/* ---- query ---- */

/* A document to send: inline with a query (meta_json is ignored there), or to ingest. */
typedef struct DiffragDoc {
    const char *id;        /* ingest: required, 1..256 bytes; query: optional (named "1",
                            * "2", ... by position when NULL) */
    const char *title;     /* optional */
    const char *text;      /* required, non-empty; text_len bytes, or up to its NUL when
                            * text_len is 0 */
    size_t text_len;
    const char *meta_json; /* ingest only, optional: a JSON object stored with the document and
                            * returned by get (it must parse: DIFFRAG_EINVAL otherwise) */
} DiffragDoc;

/* Zero-initialise, then set what you need: 0 / NULL means "the daemon's default". */
typedef struct DiffragQuery {
    const char *question;          /* required */
    const char *collection;        /* a stored collection to retrieve from */
    const DiffragDoc *docs;        /* inline documents (n_docs of them) */
    size_t n_docs;
    const char *const *doc_ids;    /* with collection: only these documents (n_doc_ids) */
    size_t n_doc_ids;
    int top_k;                     /* at most this many chunks placed (0: the budget decides,
                                      and documents that fit it go in whole) */
    int max_context_tokens;        /* prompt budget: how much of the documents is read */
    int max_tokens;                /* tokens generated at most */
    double temperature;            /* 0: greedy */
    double top_p;                  /* 0: not sent (the daemon uses 1) */
    uint64_t seed;
    const char *const *stop;       /* stop strings (n_stop) */
    size_t n_stop;
    int deadline_ms;               /* the daemon's time budget from receipt; 0: none */
    int timeout_ms;                /* this call's query_timeout_ms; 0: the client's */
    const char *id;                /* the request id (to cancel it from a callback); NULL:
                                    * generated. Must be unique among this client's requests
                                    * in flight. */
    const char *order;             /* "rank", "nearest" (best last, next to the question) or
                                    * "document" (chunks by document and position: questions
                                    * over the same chunks share the cached prompt prefix);
                                    * NULL: the daemon's ("rank"; "nearest" when it
                                    * blends documents from chunk KV, kv_reuse = 1) */
    const char *unsupported;       /* "answer", "mark" or "decline": what the daemon does with
                                    * an answer the documents do not support; NULL: the
                                    * daemon's (its `unsupported` key, default "mark") */
    const char *answer_mode;       /* "free" (the model's own words) or "quote" (every answer
                                    * token continues a verbatim span of the placed documents;
                                    * the spans come back in DiffragAnswer.quotes); NULL: the
                                    * daemon's (its `answer_mode` key, default "free") */
    double relevance_floor;        /* 0..1, sent when relevance_floor_given: chunks scoring
                                    * under this share of the best one's are not placed (0:
                                    * none dropped); else the daemon's (default 0.5) */
    int relevance_floor_given;
} DiffragQuery;

typedef struct DiffragCitation {
    char *doc_id;
    int64_t chunk;     /* index of the chunk in its document */
    double score;      /* BM25 */
    int64_t start;     /* byte range of the chunk text in the document */
    int64_t end;
    int64_t marker;    /* the n of its [n] label in the prompt */
    int cited;         /* the answer contains [n] */
    int truncated;     /* only a prefix fitted the prompt budget */
    int whole;         /* the whole document (start..end spans it), placed because every
                          document of the query fitted the budget */
    char *heading;     /* the chunk's heading path in a Markdown document, its parts joined by
                          " U+203A " in UTF-8 ("" for none; NULL from a daemon without it) */
    size_t heading_len;
    int64_t page_first; /* the pages the chunk starts and ends on, in a text with page markers */
    int64_t page_last;  /* (a PDF's, by diffrag-extract); 0 and 0 for none */
} DiffragCitation;

/* One verbatim span of a quote-mode answer (answer_mode "quote"): the answer (or, when
 * declined, the attempt) is its quotes' texts one after the other. */
typedef struct DiffragQuote {
    int64_t marker;    /* the n of the [n] citation the span comes from */
    char *doc_id;
    int64_t chunk;     /* index of the chunk in its document */
    int64_t start;     /* byte range of the quoted text in the document (like a citation's) */
    int64_t end;
    char *text;        /* the quoted bytes (text_len of them, NUL-terminated) */
    size_t text_len;
} DiffragQuote;

/* What the prompt held of the documents the query could read (the reply's `context`): the
 * inline documents, those `ids` named, or those of a collection in which the search found a
 * chunk. has_context is 0 from a daemon that does not report it. */
typedef struct DiffragContextRead {
    int64_t documents;
    int64_t doc_tokens;       /* their tokens; -1: not counted (too much text) */
    int64_t placed_tokens;    /* of those, placed in the prompt */
    int64_t chunks_matched, chunks_placed, chunks_left_out;
    int64_t chunks_below_floor; /* found but under the relevance floor (not matched); 0 from a
                                   daemon that does not say */
    int whole;                /* every document placed whole */
    int window;               /* the best document read as a window: its opening in order,
                                 then the best chunks outside it (0 from a daemon that does
                                 not say) */
} DiffragContextRead;

/* The groundedness figures of an answer, when the daemon reports them (has_grounding); the
 * daemon's docs/groundedness.md defines each. A figure the daemon leaves nil is NAN: score
 * when it has no calibrated detector for its model (detector "none"), the ratios and
 * log-probabilities for an answer of no token. */
typedef struct DiffragGrounding {
    double score;                   /* 0..1, higher: more likely unsupported by the documents;
                                     * NAN: not scored */
    int flagged;                    /* the detector flags the answer */
    int abstained;                  /* the answer declines to answer */
    double lookback_ratio;          /* attention on the documents vs. on the answer so far */
    double unsupported_token_ratio; /* tokens of content words the documents lack */
    double mean_logprob;
    double min_logprob;
    int64_t answer_tokens;
    int64_t flagged_tokens;
    char *detector;                 /* the calibration's name, "none"; may be NULL */
    double self_check;              /* the model's P(yes) when asked after the answer whether
                                     * the documents answer the question and support the
                                     * answer; NAN: the check did not run */
    double context_reliance;        /* mean log-probability of the answer's tokens with the
                                     * documents minus without them; NAN: not measured */
    double hidden_probe;            /* the calibration's hidden-state probe: its probability
                                     * that the answer is not supported; NAN: no probe */
    double quote_removed;           /* quote mode: the mean over the answer's tokens of the
                                     * probability mass the quote constraint removed (what the
                                     * model would have said outside the documents), 0..1;
                                     * NAN: a free answer */
} DiffragGrounding;

typedef struct DiffragAnswer {
    char *id;                       /* the request id */
    char *answer;                   /* answer_len bytes of UTF-8, NUL-terminated */
    size_t answer_len;
    char *finish_reason;            /* "stop", "length", "cancelled" or "deadline" */
    DiffragCitation *citations;     /* in prompt order, best first */
    size_t n_citations;
    int64_t prompt_tokens, context_tokens, completion_tokens;
    int64_t cached_tokens;      /* prompt tokens taken from the prefix cache (0: none, or an
                                   older daemon) */
    double queue_ms, retrieve_ms, prefill_ms, ttft_ms, decode_ms, total_ms;
    int has_grounding;
    DiffragGrounding grounding;
    int has_context;
    DiffragContextRead context;
    size_t n_deltas;                /* delta messages received (streaming) */
    char *json;
    int64_t reused_tokens;      /* document tokens blended from stored chunk KV (kv_reuse;
                                   0: none, or an older daemon) */
    int declined;               /* the daemon declined: answer is its fixed sentence */
    char *decline_reason;       /* "no_match" (retrieval found nothing on the question; nothing
                                   generated), "flagged" (the detector flagged the attempt),
                                   "model_refused"; NULL when not declined */
    char *attempt;              /* what the model generated when declined (attempt_len bytes);
                                   NULL for no_match or when not declined. A streamed query's
                                   deltas were the attempt: show answer instead */
    size_t attempt_len;
    char *answer_mode;          /* "free" or "quote": how the answer was written ("free" from
                                   a daemon without quote mode) */
    DiffragQuote *quotes;       /* quote mode: the spans of the generated text (the answer, or
                                   the attempt when declined), in order; none in free mode */
    size_t n_quotes;
} DiffragAnswer;

/* Called for every delta of a streaming query, in order; text is borrowed until the callback
 * returns (len bytes, NUL-terminated). Return 0 to go on; anything else cancels the query on
 * the daemon, and the call returns its final reply as after diffrag_interrupt(). */
typedef int (*DiffragDeltaFn)(void *user, const char *text, size_t len);

/* Asks q->question over q->collection and/or q->docs (at least one of them). With on_delta
 * the query streams (deltas as the model generates them); otherwise only the final reply
 * comes. The concatenated deltas equal (*out)->answer.
 * Returns DIFFRAG_OK with *out set, DIFFRAG_EINVAL (no question, neither docs nor collection,
 * a NULL text), or the errors of diffrag_ping; DIFFRAG_ESERVER codes include "bad_request",
 * "too_large", "overloaded", "not_found", "deadline_exceeded", "cancelled", "shutting_down". */
DIFFRAG_API int diffrag_query(DiffragClient *c, const DiffragQuery *q, DiffragDeltaFn on_delta,
                              void *user, DiffragAnswer **out);
DIFFRAG_API void diffrag_answer_free(DiffragAnswer **a);

/* Asks the daemon to cancel the query with id target, sent earlier on this client (the daemon
 * matches cancels per connection) and still in flight: call it from a DiffragDeltaFn, or from
 * the same thread between sending and collecting. On DIFFRAG_OK, state (state_len bytes, may
 * be NULL) receives "running", "queued" or "retrieving". DIFFRAG_ESERVER with "not_found":
 * nothing in flight with that id. */
DIFFRAG_API int diffrag_cancel(DiffragClient *c, const char *target, char *state,
                               size_t state_len);

/* ---- documents ---- */

typedef struct DiffragIngestResult {
    char *collection;
    int64_t ingested;   /* documents added or replaced by this call */
    int64_t bytes;      /* their text bytes */
    int64_t docs;       /* documents in the collection after the commit */
    int64_t chunks;     /* chunks in the collection after the commit */
    char *json;
    /* Of the ingested: stored new, replacing a different one, and left as they were (the
     * same text, title and metadata were stored under the id already). All 0 from a daemon
     * that does not report them (their sum is then not `ingested`). */
    int64_t added, changed, unchanged;
} DiffragIngestResult;

/* Stores docs (1..max_docs of the daemon, each with a unique id) in collection, created on
 * first use; a document with an existing id is replaced, unless it is stored exactly so already
 * (then it is left as it is and counted unchanged). The reply comes after the durable
 * commit. One bad document rejects the whole batch (DIFFRAG_ESERVER "bad_request"); a batch
 * over max_message_bytes or max_docs gets "too_large". */
DIFFRAG_API int diffrag_ingest(DiffragClient *c, const char *collection, const DiffragDoc *docs,
                               size_t n_docs, DiffragIngestResult **out);
DIFFRAG_API void diffrag_ingest_result_free(DiffragIngestResult **r);

/* A file to ingest as it is on disk: the daemon finds its format by content (PDF, DOCX, HTML,
 * else UTF-8 text) and reads it with its extraction helper (docs/protocol.md, "ingest"). */
typedef struct DiffragFile {
    const char *name;      /* required: its file name, 1..256 bytes (the id when id is NULL;
                            * its extension helps find the format) */
    const void *bytes;     /* required: its content, len bytes (1..the daemon's
                            * max_file_bytes) */
    size_t len;
    const char *id;        /* optional */
    const char *title;     /* optional: else the document's own (<title>, a PDF's Title...) */
    const char *meta_json; /* optional: a JSON object, as DiffragDoc's */
} DiffragFile;

/* diffrag_ingest for files: the same reply and rules; a file the daemon cannot read (a scanned
 * PDF, a damaged archive...) rejects the batch with DIFFRAG_ESERVER "bad_request" naming it. */
DIFFRAG_API int diffrag_ingest_files(DiffragClient *c, const char *collection,
                                     const DiffragFile *files, size_t n_files,
                                     DiffragIngestResult **out);

typedef struct DiffragDeleteResult {
    int64_t deleted;    /* ids found and removed (ids not present are skipped) */
    int64_t docs, chunks; /* left in the collection */
    char *json;
} DiffragDeleteResult;

/* Removes ids (n_ids >= 1) from collection. DIFFRAG_ESERVER "not_found": no such collection. */
DIFFRAG_API int diffrag_delete(DiffragClient *c, const char *collection, const char *const *ids,
                               size_t n_ids, DiffragDeleteResult **out);
DIFFRAG_API void diffrag_delete_result_free(DiffragDeleteResult **r);

typedef struct DiffragDropResult {
    char *collection;
    int64_t dropped;    /* documents the collection held */
    char *json;
} DiffragDropResult;

/* Removes collection with every document in it; the reply comes after the durable commit.
 * There is no undo. DIFFRAG_ESERVER "not_found": no such collection. */
DIFFRAG_API int diffrag_drop(DiffragClient *c, const char *collection, DiffragDropResult **out);
DIFFRAG_API void diffrag_drop_result_free(DiffragDropResult **r);

typedef struct DiffragDocument {
    char *id;
    char *title;        /* "" when the document has none */
    char *text;         /* text_len bytes, NUL-terminated */
    size_t text_len;
    int64_t chunks;
    char *meta_json;    /* the stored meta as a JSON object, or NULL */
    char *json;
} DiffragDocument;

/* Reads one document. DIFFRAG_ESERVER "not_found": no such collection or document. */
DIFFRAG_API int diffrag_get(DiffragClient *c, const char *collection, const char *doc_id,
                            DiffragDocument **out);
DIFFRAG_API void diffrag_document_free(DiffragDocument **d);

typedef struct DiffragDocInfo {
    char *id;
    char *title;
    int64_t bytes;
    int64_t chunks;
} DiffragDocInfo;

typedef struct DiffragList {
    char **collections; /* without a collection: every collection name, in byte order */
    size_t n_collections;
    DiffragDocInfo *docs; /* with a collection: one page of documents, in id byte order */
    size_t n_docs;
    char *next;         /* pass as `after` for the next page; NULL at the end */
    char *json;
} DiffragList;

/* Lists collections (collection NULL), or one page of collection's documents after the id
 * `after` (NULL: from the start), at most limit (1..1000; 0: the daemon's 100). */
DIFFRAG_API int diffrag_list(DiffragClient *c, const char *collection, const char *after,
                             int limit, DiffragList **out);
DIFFRAG_API void diffrag_list_free(DiffragList **l);

typedef struct DiffragStats {
    /* with a collection */
    char *collection;
    int64_t docs, chunks, terms, text_bytes, chunk_tokens;
    double avg_chunk_terms;
    /* without: the daemon */
    char *version, *model;
    double uptime_s;
    int64_t workers_idle, workers_busy, queue_depth, inflight, kv_cache_bytes;
    int draining;
    char *json;
} DiffragStats;

/* Statistics of collection, or of the daemon when collection is NULL (then collection is NULL
 * in the result and the collection fields are 0, and the other way round). */
DIFFRAG_API int diffrag_stats(DiffragClient *c, const char *collection, DiffragStats **out);
DIFFRAG_API void diffrag_stats_free(DiffragStats **s);

/* ---- CurveZMQ keys ---- */

/* A new key pair in Z85 text (41 bytes each, NUL-terminated). DIFFRAG_EZMQ when libzmq was
 * built without CurveZMQ. */
DIFFRAG_API int diffrag_keygen(char public_key[41], char secret_key[41]);

/* The public key of secret_key (Z85). DIFFRAG_EINVAL when secret_key is not a Z85 key. */
DIFFRAG_API int diffrag_key_public(const char *secret_key, char public_key[41]);

/* Reads a key from a file of Z85 text (as `diffrag keygen` writes them): the first line that
 * is neither blank nor a comment ('#'), without surrounding blanks. Returns DIFFRAG_OK, or
 * DIFFRAG_EINVAL when the file cannot be read or that line is not a key (why, in err). */
DIFFRAG_API int diffrag_key_read(const char *path, char key[41], char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
