/* What diffragd resolves and checks at start-up, before it serves (startup.c): each call
 * reads the configuration against the model, the store or the key files, and either fills in
 * what the daemon will run with or says why it cannot start. main.c strings them together and
 * starts the threads. */
#ifndef DIFFRAG_STARTUP_H
#define DIFFRAG_STARTUP_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "daemon/grounding.h"
#include "daemon/zap.h"

struct EngineOpts;
struct Model;
struct ModelConfig;

/* The model as clients see it: ping, /v1/models, /metrics, and the name each worker's READY
 * gives the broker. The name is the file's, as the user fetched it (a broker and a remote
 * worker loading the same file agree on it); the header's general.name says less (one name
 * for every quantisation of a model) and is not used. */
struct ServedModel {
    char name[128];          /* the file's base name without ".gguf" */
    char architecture[32];   /* general.architecture: llama, qwen2, diffv2 */
    char quantization[32];   /* general.file_type by name (model/ftype.h), e.g. Q4_K_M */
};

/* Reads the served model of the GGUF file at path (its header; nothing is loaded). 0, or -1
 * with err. */
int startup_served_model(const char *path, struct ServedModel *out, char *err, size_t errlen);

/* The engine options of the configuration for n_workers workers sharing the machine
 * (threads = 0: the cores divided among them). */
void startup_engine_opts(const struct Config *c, int n_workers, struct EngineOpts *o);

/* Resolves max_context_tokens for the model: sets c->model_ctx (the usable context) and
 * c->ctx_auto (usable minus max_tokens, lowered to what kv_budget_bytes allows a worker's
 * context when m is known), checks an explicit value, and logs one line saying what was chosen
 * and why. m is NULL when only the tokenizer is loaded (remote workers only). 0, or -1 after
 * logging why the daemon cannot start. */
int startup_resolve_context(struct Config *c, const struct ModelConfig *mc, const struct Model *m,
                            int n_workers);

/* The groundedness settings the broker hands to every job. */
struct Grounding {
    struct GrCalibration cal;
    int calibrated;           /* cal applies to the loaded model */
    double threshold;
    int32_t watch[2 * GR_MAX_WATCH];
    size_t n_watch;
    int watch_given;          /* 0: the workers' default set */
    int32_t hidden[GR_MAX_HIDDEN];  /* layers whose residual stream answers report */
    size_t n_hidden;
};

/* Resolves grounding_calibration (auto: the first *.grounding file of deploy/grounding, then of
 * the installed share directory, made for the model file's SHA-256), grounding_threshold,
 * grounding_heads and grounding_hidden_layers for the model m (NULL when only the tokenizer is
 * loaded: heads are then checked by the workers). 0, or -1 after logging why the daemon cannot
 * start. */
int startup_grounding(const struct Config *c, const struct Model *m, struct Grounding *g);

/* The store's start-up check (docs/retriever.md#damaged-stores), before this process opens
 * the store: the data file's size against its meta pages, then a sample of its records read in
 * a child process, so that LMDB aborting on a damaged page ends the child only. A damaged store
 * is refused; with allow_damaged_store, one that passes the size check is served read-only and
 * *damaged receives the problem (else ""). 0, or -1 after logging why the daemon cannot
 * start. */
int startup_check_store(const struct Config *c, char *damaged, size_t cap);

/* The CurveZMQ keys of the configuration: the secret key (and its public key), the allowed
 * client keys (*keys stays NULL when any client may connect) and the allowed worker keys
 * (with worker_listen). Nothing to do when curve_secret_key_file is empty. The caller owns
 * *keys and *worker_keys (zap_keys_destroy) and wipes secret. 0, or -1 with err. */
int startup_load_curve(const struct Config *c, char secret[CURVE_KEY_Z85_LEN + 1],
                       char public_key[CURVE_KEY_Z85_LEN + 1], struct ZapKeys **keys,
                       size_t *n_keys, struct ZapKeys **worker_keys, size_t *n_worker_keys,
                       char *err, size_t errlen);

/* --check-config: the key files, the model's header against the configuration, and (with
 * kv_budget_bytes) the loaded model's memory estimate; says why on stderr. The exit status:
 * 0 ok, 1 the configuration does not fit the model or the mode, 2 a file is unreadable. */
int startup_check_config(const struct Config *c, int worker_mode);

#endif
