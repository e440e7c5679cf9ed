/* diffragd's configuration: one table of keys, each with a type, an embedded default, bounds,
 * whether SIGHUP may change it, and a line of help. The same key works in the file
 * (`key = value`, `#` comments) and on the command line (`--key value`; `-` and `_` are the
 * same in keys). Command-line values override the file. */
#ifndef DIFFRAG_CONFIG_H
#define DIFFRAG_CONFIG_H

#include <stddef.h>
#include <stdio.h>

#define CONFIG_DEFAULT_PATH "/etc/diffrag/diffragd.conf"
#define CONFIG_STR_MAX 512

struct Config {
    char model[CONFIG_STR_MAX];
    char data_dir[CONFIG_STR_MAX];
    char listen[CONFIG_STR_MAX];
    char worker_listen[CONFIG_STR_MAX];
    char metrics_listen[CONFIG_STR_MAX];
    char http_listen[CONFIG_STR_MAX];            /* the OpenAI-compatible API; "": off */
    char http_api_key_file[CONFIG_STR_MAX];
    char http_tls_cert_file[CONFIG_STR_MAX];
    char http_tls_key_file[CONFIG_STR_MAX];
    long http_allow_remote;                      /* 1: no key, yet off loopback */
    long http_max_connections;
    long http_reserved_connections;              /* of them, kept from answers in progress */
    double http_timeout;                         /* seconds to send a whole request */
    size_t http_max_body_bytes;                  /* a request body, besides max_message_bytes */
    long http_max_json_values;                   /* values of a body's JSON */
    long http_parse_slots;                       /* bodies parsed at once */
    char default_collection[CONFIG_STR_MAX];     /* the API's collection when none is named */
    char connect[CONFIG_STR_MAX];
    char curve_secret_key_file[CONFIG_STR_MAX];
    char curve_allowed_keys[CONFIG_STR_MAX];
    char curve_worker_keys[CONFIG_STR_MAX];
    char curve_server_key[CONFIG_STR_MAX];
    char device[32];
    char kv_type[8];
    char log_level[16];
    long allow_damaged_store;                    /* 1: serve a damaged store read-only */
    long workers, threads, io_threads;
    long max_queue;
    size_t max_message_bytes;
    long max_docs;
    size_t max_file_bytes;                       /* an ingest document's file bytes */
    char extract_helper[CONFIG_STR_MAX];         /* "": beside diffragd, else on PATH */
    long extract_timeout_ms;                     /* one file's extraction */
    size_t max_question_bytes;
    size_t max_turn_bytes;                       /* a query's system text; each history turn */
    long max_context_tokens, max_tokens, default_max_tokens;
    long default_context_tokens;                 /* 0: auto (config_default_context) */
    double relevance_floor;                      /* chunks under this share of the best
                                                    chunk's score are not placed */
    long top_k, max_top_k;
    long chunk_tokens, chunk_overlap, prefill_chunk;
    size_t kv_budget_bytes;
    long prefix_cache;                           /* 1: reuse cached prompt prefixes */
    long max_running, step_tokens, step_ms;      /* continuous batching */
    size_t kv_pool_bytes;                        /* 0: auto */
    size_t prefix_cache_bytes;                   /* KV pool pages beyond the workers' own */
    long lookup_tokens;                          /* prompt lookup's drafts; 0: off */
    long kv_reuse;                               /* 1: blend documents from chunk KV */
    double kv_reuse_recompute;                   /* share of their tokens recomputed */
    long kv_reuse_full_chunks;                   /* best-ranked chunks computed in full */
    size_t kv_reuse_bytes;                       /* each worker's chunk KV store */
    size_t kv_reuse_store_bytes;                 /* chunk KV records in the document store */
    long max_depth;
    long max_stop;
    double drain_timeout;
    long heartbeat_ms, heartbeat_liveness;
    char grounding_calibration[CONFIG_STR_MAX];  /* a file, "auto" or "none" */
    char grounding_threshold[32];                /* "" : the calibration's own */
    char grounding_heads[8192];                  /* "auto" or L:H,L:H,... */
    long grounding_self_check;                   /* 1: the self-check after each answer */
    long grounding_reliance;                     /* 1: context reliance after each answer */
    char grounding_hidden_layers[256];
    char unsupported[16];                        /* answer, mark or decline: what a query that
                                                    does not say does with an answer the
                                                    documents do not support */
    char decline_text[CONFIG_STR_MAX];           /* the answer of a declined query */
    char answer_mode[16];                        /* free or quote: how a query that does not
                                                    say writes its answer */           /* "" or L,L,...: residual stream reported */
    char rope_scaling[16];                       /* "": the file's; none, linear, yarn */
    double rope_factor;                          /* 0: unset */
    long rope_orig_ctx;                          /* 0: the file's context_length */
    /* Not keys: set at startup once the model is known (0 before), kept across reloads. */
    long model_ctx;                              /* the served model's usable context */
    long ctx_auto;                               /* max_context_tokens when it is 0 (auto) */
    int gpu_workers;                             /* the local workers run on a GPU */
};

/* What the command line asked besides keys. */
struct ConfigCli {
    const char *config_path;   /* NULL: CONFIG_DEFAULT_PATH when it exists */
    int check, print, help, version, worker;
};

/* The unsupported-answer policies (the key `unsupported` and a query's own): report the answer
 * with no flag, flag it, or decline it (docs/groundedness.md#declining). */
enum ConfigUnsupported { UNSUP_ANSWER, UNSUP_MARK, UNSUP_DECLINE };
/* The policy a name of len bytes spells ("answer", "mark", "decline"), or -1. */
int config_unsupported_parse(const char *name, size_t len);

/* The answer modes (the key `answer_mode` and a query's own): free text, or quote decoding
 * (docs/groundedness.md#quote-mode). */
enum ConfigAnswerMode { ANSWER_FREE, ANSWER_QUOTE };
/* The mode a name of len bytes spells ("free", "quote"), or -1. */
int config_answer_mode_parse(const char *name, size_t len);

/* Fills every key with its embedded default. */
void config_defaults(struct Config *c);

/* Sets one key from text. RET-style: 0, or -1 with `err` naming the key and the problem
 * (unknown key, not a number, out of bounds, too long). */
int config_set(struct Config *c, const char *key, const char *value, char *err, size_t errlen);

/* Applies a `key = value` file. 0, or -1 with "PATH:LINE: problem" in err. A missing file is
 * an error only when `must_exist`; *loaded (optional) tells whether it was read. */
int config_load_file(struct Config *c, const char *path, int must_exist, int *loaded, char *err,
                     size_t errlen);

/* The whole command line: flags into *cli, `--key value` pairs into c after the file named by
 * --config (or the default path) has been applied. 0, or -1 with err. */
int config_from_args(struct Config *c, struct ConfigCli *cli, int argc, char **argv, char *err,
                     size_t errlen);

/* The prompt budget cap in force: max_context_tokens, or ctx_auto when it is 0 (auto). */
long config_max_context(const struct Config *c);
/* The prompt budget of a query that does not say: default_context_tokens, or when it is 0
 * (auto) CONFIG_CPU_CONTEXT tokens on CPU workers and the cap on GPU ones; never above the
 * cap. */
enum { CONFIG_CPU_CONTEXT = 2048 };
long config_default_context(const struct Config *c);

/* Checks relations between keys (defaults within caps, endpoints well-formed, ...); once
 * model_ctx is set, also that max_context_tokens + max_tokens fits the model's context. */
int config_validate(const struct Config *c, char *err, size_t errlen);

/* The endpoint checks (config_endpoint.c), 0 or -1 with a message naming the key. */
/* config_check_zmq_endpoint: checks a ZeroMQ endpoint of key `key`. tcp:// is parsed: PORT 1..65535; to bind, HOST is *,
 * an IP address of this machine (IPv6 in brackets) or an interface with an IPv4 address; to
 * connect, any host name. Other transports need only something after the scheme. */
int config_check_zmq_endpoint(const char *key, const char *endpoint, int bind_side, char *err,
                              size_t errlen);
/* metrics_listen, http_listen (named by key): HOST:PORT with HOST an IP address of this
 * machine or localhost (the HTTP servers take no interface names). */
int config_check_http_listen(const char *key, const char *hostport, char *err, size_t errlen);

/* Whether a listen address reaches only this machine: a tcp:// endpoint or a metrics
 * HOST:PORT whose host is 127.0.0.0/8, ::1, localhost or an interface flagged loopback (lo);
 * ipc:// and inproc:// count as local. "*", 0.0.0.0 and [::] do not. */
int config_endpoint_loopback(const char *endpoint);

/* Whether a tcp:// endpoint names an IPv6 address ([...]): its ZeroMQ socket needs ZMQ_IPV6. */
int config_endpoint_ipv6(const char *endpoint);

/* Checks what needs the model file but not its weights, from its GGUF header: that it opens,
 * that grounding_heads (unless auto) names layers and heads the model has, and that an explicit
 * max_context_tokens + max_tokens fits its context (with the RoPE override). 0, or -1 with err
 * ("model: ..." when the file is the problem). */
int config_check_model(const struct Config *c, char *err, size_t errlen);

/* A grounding_heads value ("auto" passes) against a model of `layers` layers and `heads`
 * attention heads (DIFF V2: differential heads). 0, or -1 with err. */
int config_check_heads(const char *list, int layers, int heads, char *err, size_t errlen);

/* `key = value` for every key; with_help puts each key's meaning above it as a comment. */
void config_print(const struct Config *c, FILE *f, int with_help);

/* Re-reads the file and command line into a fresh Config and copies the keys SIGHUP may change
 * into *live; `changed` receives a comma-separated list of reloaded keys that changed and
 * `ignored` the keys that changed but need a restart. When the model or how it is read
 * (model, rope_*, grounding_heads) changed, the new values are checked against the model's
 * header (config_check_model), so a reload never sets up a restart that would fail.
 * 0, or -1 (live untouched) with err. */
int config_reload(struct Config *live, int argc, char **argv, char *changed, size_t changed_len,
                  char *ignored, size_t ignored_len, char *err, size_t errlen);

void config_usage(FILE *f);

#endif
