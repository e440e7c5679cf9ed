/* The configuration's keys, one row each (the table daemon/config_keys.h describes): what every
 * key means, its default and bounds. The readers, validation and reload are config.c's. */
#include "daemon/config_keys.h"

#include <stddef.h>

#define F(field) offsetof(struct Config, field), sizeof(((struct Config *)0)->field)

const struct Key config_keys[] = {
    { "model", K_STR, F(model), "models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", 0, 0, 0,
      "GGUF model file (llama, qwen2 or DIFF V2); one read-only copy serves every worker" },
    { "rope_scaling", K_STR, F(rope_scaling), "", 0, 0, 0,
      "override the model file's RoPE scaling: none, linear or yarn (with rope_factor), to serve "
      "past its training context on purpose; empty: as the file says" },
    { "rope_factor", K_DOUBLE, F(rope_factor), "0", 0, 64, 0,
      "the RoPE scaling factor of rope_scaling linear or yarn (above 1; e.g. 4: yarn x4 of "
      "32768 = 131072 tokens); 0: unset" },
    { "rope_orig_ctx", K_LONG, F(rope_orig_ctx), "0", 0, 131072, 0,
      "the original context rope_factor multiplies; 0: the file's context_length" },
    { "data_dir", K_STR, F(data_dir), "var", 0, 0, 0,
      "directory of the LMDB document store (created if missing)" },
    { "allow_damaged_store", K_LONG, F(allow_damaged_store), "0", 0, 1, 0,
      "1: start on a store that fails the start-up check, serving it read-only (writes are "
      "refused); 0: refuse to start and name the problem. A data file shorter than its meta "
      "pages claim is refused either way (docs/retriever.md#damaged-stores)" },
    { "listen", K_STR, F(listen), "tcp://127.0.0.1:7400", 0, 0, 0,
      "ZeroMQ endpoint for clients (tcp://, ipc:// ...)" },
    { "worker_listen", K_STR, F(worker_listen), "", 0, 0, 0,
      "ZeroMQ endpoint where remote workers (diffragd --worker) connect; empty: none" },
    { "metrics_listen", K_STR, F(metrics_listen), "127.0.0.1:9400", 0, 0, 0,
      "HOST:PORT for /metrics, /healthz and /readyz over HTTP; empty: off" },
    { "http_listen", K_STR, F(http_listen), "127.0.0.1:7480", 0, 0, 0,
      "HOST:PORT of the OpenAI-compatible HTTP API (POST /v1/chat/completions, GET /v1/models; "
      "docs/openai.md); empty: off. Off loopback it needs http_api_key_file or "
      "http_allow_remote = 1" },
    { "http_api_key_file", K_STR, F(http_api_key_file), "", 0, 0, 0,
      "file of API keys, one a line (# comments): HTTP requests must send one as "
      "`Authorization: Bearer KEY` or get 401; empty: no key asked" },
    { "http_allow_remote", K_LONG, F(http_allow_remote), "0", 0, 1, 0,
      "1: serve the HTTP API off loopback without http_api_key_file (behind a proxy that "
      "authenticates); 0: refuse to start so" },
    { "http_max_connections", K_LONG, F(http_max_connections), "64", 1, 4096, 0,
      "HTTP API connections open at once (each answered on its own thread); at the limit a new "
      "one replaces the connection that has waited longest without a complete request" },
    { "http_reserved_connections", K_LONG, F(http_reserved_connections), "8", 0, 4095, 0,
      "of http_max_connections, the connections kept for new requests (/v1/models among them) "
      "while the others are answering: a chat request past the rest gets 503 with Retry-After. "
      "Below http_max_connections" },
    { "http_timeout", K_DOUBLE, F(http_timeout), "10", 0.5, 3600, 0,
      "seconds an HTTP API client has to send a whole request (headers and body) from "
      "connecting or its last answer, and to read some of an answer it is sent; a slower one "
      "is disconnected (its query cancelled)" },
    { "http_max_body_bytes", K_SIZE, F(http_max_body_bytes), "16MiB", 1024, 1073741824.0, 0,
      "largest HTTP API request body (bigger: 413, unread); max_message_bytes caps it too" },
    { "http_max_json_values", K_LONG, F(http_max_json_values), "65536", 64, 16777216, 0,
      "values (objects, arrays, strings, numbers, literals) an HTTP API request body may hold; "
      "more: 413 before it is parsed (a parsed value costs some 100-250 bytes)" },
    { "http_parse_slots", K_LONG, F(http_parse_slots), "2", 1, 256, 0,
      "HTTP API request bodies parsed at once (each costs a few times its size in memory); "
      "another waits up to 5 s for a slot, then gets 503" },
    { "http_tls_cert_file", K_STR, F(http_tls_cert_file), "", 0, 0, 0,
      "PEM certificate (chain) of the HTTP API: set with http_tls_key_file, it speaks HTTPS; "
      "empty: plain HTTP" },
    { "http_tls_key_file", K_STR, F(http_tls_key_file), "", 0, 0, 0,
      "PEM private key of http_tls_cert_file" },
    { "default_collection", K_STR, F(default_collection), "", 0, 0, 0,
      "the collection an HTTP API request reads when it names no documents; empty: such a "
      "request is refused" },
    { "connect", K_STR, F(connect), "", 0, 0, 0,
      "worker mode only: the broker's worker endpoint to join, e.g. tcp://HOST:7401" },
    { "curve_secret_key_file", K_STR, F(curve_secret_key_file), "", 0, 0, 0,
      "the daemon's CurveZMQ secret key (a Z85 key file); set: clients must use CurveZMQ with "
      "its public key (docs/security.md); empty: plain ZeroMQ" },
    { "curve_allowed_keys", K_STR, F(curve_allowed_keys), "", 0, 0, 1,
      "client public keys allowed to connect with CurveZMQ: a file of Z85 keys, one a line, or "
      "a directory of *.pub files; empty: any client that has the daemon's public key" },
    { "curve_worker_keys", K_STR, F(curve_worker_keys), "", 0, 0, 1,
      "with curve_secret_key_file and a worker_listen: the public keys of the remote workers "
      "allowed to join (file or directory, as curve_allowed_keys); required then" },
    { "curve_server_key", K_STR, F(curve_server_key), "", 0, 0, 0,
      "worker mode: the broker's CurveZMQ public key (a key file); the worker's own key is "
      "curve_secret_key_file" },
    { "workers", K_LONG, F(workers), "1", 0, 256, 0,
      "in-process worker threads, each with its own engine context (0: remote workers only)" },
    { "threads", K_LONG, F(threads), "0", 0, 256, 0,
      "compute threads per worker (0: online cores divided by workers, at least 1)" },
    { "device", K_STR, F(device), "auto", 0, 0, 0,
      "compute device: auto (a CUDA GPU when one is visible and the CUDA backend loads, else the "
      "CPU), cpu, or cuda (fail at start without a usable GPU)" },
    { "io_threads", K_LONG, F(io_threads), "2", 1, 64, 0,
      "threads for retrieval, context assembly and store operations (off the socket loop)" },
    { "max_queue", K_LONG, F(max_queue), "64", 1, 1000000, 1,
      "requests admitted but not yet running; beyond it requests get `overloaded` at once" },
    { "max_message_bytes", K_SIZE, F(max_message_bytes), "16MiB", 1024, 1073741824.0, 1,
      "largest request accepted (bigger: too_large; over 4x: the connection is dropped)" },
    { "max_docs", K_LONG, F(max_docs), "256", 1, 1000000, 1,
      "documents (or ids) per request, inline or ingested" },
    { "max_file_bytes", K_SIZE, F(max_file_bytes), "64MiB", 1, 1073741824.0, 1,
      "largest file an ingest document may carry as bytes (its request must fit "
      "max_message_bytes too)" },
    { "extract_helper", K_STR, F(extract_helper), "", 0, 0, 0,
      "diffrag-extract, which turns the PDF, DOCX and HTML files of an ingest into text; "
      "empty: the one beside diffragd, else diffrag-extract on PATH" },
    { "extract_timeout_ms", K_LONG, F(extract_timeout_ms), "60000", 100, 3600000, 1,
      "wall-clock limit of the extraction of an ingest request's files, together, in "
      "milliseconds (the helper is killed after)" },
    { "max_question_bytes", K_SIZE, F(max_question_bytes), "4096", 1, 1048576, 1,
      "longest question in bytes" },
    { "max_turn_bytes", K_SIZE, F(max_turn_bytes), "1MiB", 1, 1073741824.0, 0,
      "longest system text and earlier (history) turn of a query in bytes; whether it fits is "
      "the prompt budget's to say (a turn that does not is left out with the older ones)" },
    { "max_context_tokens", K_LONG, F(max_context_tokens), "0", 0, 131072, 1,
      "cap of a query's prompt budget in tokens: frame, documents, question; 0 "
      "(auto): the model's usable context minus max_tokens, lowered to what kv_budget_bytes "
      "allows. Startup fails when max_context_tokens + max_tokens exceeds the model's context" },
    { "default_context_tokens", K_LONG, F(default_context_tokens), "0", 0, 131072, 1,
      "prompt budget in tokens of a query that does not say (at most max_context_tokens); 0 "
      "(auto): 2048 with CPU workers, max_context_tokens with GPU ones" },
    { "relevance_floor", K_DOUBLE, F(relevance_floor), "0.5", 0, 1, 1,
      "a query's chunks scoring under this share of its best chunk's BM25 score are not "
      "placed, however much budget is left (0: every chunk found may fill it)" },
    { "max_tokens", K_LONG, F(max_tokens), "1024", 1, 131072, 1,
      "cap of a query's max_tokens (tokens generated)" },
    { "default_max_tokens", K_LONG, F(default_max_tokens), "256", 1, 131072, 1,
      "max_tokens of a query that does not say (at most max_tokens)" },
    { "top_k", K_LONG, F(top_k), "0", 0, 100000, 1,
      "cap on the chunks a query that does not say places (at most max_top_k); 0: none, the "
      "token budget decides, and documents that fit it go in whole" },
    { "max_top_k", K_LONG, F(max_top_k), "100", 1, 100000, 1,
      "cap of a query's top_k" },
    { "chunk_tokens", K_LONG, F(chunk_tokens), "256", 16, 65536, 1,
      "document chunk size in tokens for new collections and inline documents" },
    { "chunk_overlap", K_LONG, F(chunk_overlap), "32", 0, 65535, 1,
      "overlap between consecutive chunks in tokens" },
    { "prefill_chunk", K_LONG, F(prefill_chunk), "0", 0, 65536, 0,
      "tokens per prefill step (cancellation and deadlines are checked between steps); 0: 512 "
      "on the CPU, 8192 on a GPU" },
    { "kv_type", K_STR, F(kv_type), "f16", 0, 0, 0,
      "KV cache element type: f16, f32 or q8 (int8 with one scale per position and head: half "
      "the memory and read traffic of f16; CPU only)" },
    { "kv_budget_bytes", K_SIZE, F(kv_budget_bytes), "0", 0, 1e15, 0,
      "memory a worker context (KV cache + scratch) may take; 0: unlimited. Startup fails "
      "when max_context_tokens + max_tokens would not fit" },
    { "max_running", K_LONG, F(max_running), "8", 1, 256, 0,
      "requests a worker (CPU or GPU) runs at once, their decode tokens batched in one product "
      "per step (continuous batching); 1: one at a time" },
    { "step_tokens", K_LONG, F(step_tokens), "64", 1, 65536, 0,
      "tokens per engine step while a request is decoding: its next token and every other's, "
      "then prefill chunks of the others (stall-free streaming); a step with no request "
      "decoding takes a whole prefill_chunk. At most prefill_chunk" },
    { "step_ms", K_LONG, F(step_ms), "100", 0, 60000, 0,
      "while a request is decoding, a step also takes no more prefill tokens than the worker's "
      "measured speed fits in this many milliseconds (at least 8): a stream's tokens keep "
      "coming on a slow machine or model; 0: step_tokens alone" },
    { "kv_pool_bytes", K_SIZE, F(kv_pool_bytes), "0", 0, 1e15, 0,
      "the in-process workers' KV page pool (64 positions a page; on a GPU, in device memory); "
      "0 (auto): a full context for every running request, on the CPU at most half the memory "
      "(at least one context per worker). When pages run out the latest request is preempted "
      "and recomputed later" },
    { "prefix_cache", K_LONG, F(prefix_cache), "1", 0, 1, 0,
      "1: a prompt that starts like an earlier one takes that prefix's keys and values from the "
      "KV pool instead of computing them again (exact: the answer is the same; on a GPU, within "
      "the products' rounding); 0: off" },
    { "prefix_cache_bytes", K_SIZE, F(prefix_cache_bytes), "0", 0, 1e15, 0,
      "memory for cached prompt prefixes beyond the workers' own KV pages (whose pages stay "
      "cached until a worker needs them); reserved, committed as it fills" },
    { "lookup_tokens", K_LONG, F(lookup_tokens), "3", 0, 16, 0,
      "prompt-lookup decoding on CPU workers: each decode step also verifies up to this many "
      "tokens drafted from the request's own prompt and answer, kept while the model itself "
      "chooses them (the answer and its signals are the same); 0: off" },
    { "kv_reuse", K_LONG, F(kv_reuse), "0", 0, 1, 0,
      "1: CPU workers keep each document chunk's KV, computed at its first use, and blend a "
      "prompt's documents from it, recomputing kv_reuse_recompute of their tokens "
      "(docs/kv-reuse.md; answers change, see there); 0: every prompt is prefilled exactly" },
    { "kv_reuse_recompute", K_DOUBLE, F(kv_reuse_recompute), "0.15", 0, 1, 0,
      "share of the documents' tokens a blend recomputes (those whose values moved most); 1: "
      "the exact prefill's result" },
    { "kv_reuse_full_chunks", K_LONG, F(kv_reuse_full_chunks), "2", 0, 1000, 0,
      "the chunks of a prompt that retrieval ranks best which a blend computes in full, as a "
      "prefill would, instead of from their stored KV (the answer is most often in them)" },
    { "kv_reuse_bytes", K_SIZE, F(kv_reuse_bytes), "1GiB", 1048576, 1e15, 0,
      "memory each worker's chunk KV store may take (least recently used chunks go first)" },
    { "kv_reuse_store_bytes", K_SIZE, F(kv_reuse_store_bytes), "4GiB", 0, 1e15, 0,
      "with kv_reuse, the chunk KV records the document store keeps beside stored chunks for the "
      "daemon's own workers, across restarts (least recently used go first); 0: none, each "
      "worker keeps its copies in memory only" },
    { "max_depth", K_LONG, F(max_depth), "16", 2, 64, 1,
      "deepest msgpack nesting accepted in a request" },
    { "max_stop", K_LONG, F(max_stop), "8", 0, 64, 1,
      "stop strings per query" },
    { "log_level", K_STR, F(log_level), "info", 0, 0, 1,
      "error, warn, info (one line per request) or debug" },
    { "drain_timeout", K_DOUBLE, F(drain_timeout), "30", 0, 86400, 1,
      "seconds in-flight requests may take to finish after SIGTERM" },
    { "heartbeat_ms", K_LONG, F(heartbeat_ms), "1000", 20, 60000, 0,
      "heartbeat interval between broker and workers in milliseconds" },
    { "heartbeat_liveness", K_LONG, F(heartbeat_liveness), "3", 1, 100, 0,
      "missed heartbeats after which a peer is presumed dead" },
    { "grounding_calibration", K_STR, F(grounding_calibration), "auto", 0, 0, 0,
      "groundedness calibration file; auto: the *.grounding file for the loaded model in "
      "deploy/grounding/ or the installed share directory; none: signals only, no score" },
    { "grounding_threshold", K_STR, F(grounding_threshold), "", 0, 0, 0,
      "score at or above which an answer is flagged (0..1); empty: the calibration's own" },
    { "grounding_self_check", K_LONG, F(grounding_self_check), "0", 0, 1, 1,
      "1: after each answer, ask the model whether the documents answer the question and "
      "support the answer (a few dozen tokens over the cached prompt; docs/groundedness.md); "
      "0: off" },
    { "grounding_reliance", K_LONG, F(grounding_reliance), "0", 0, 1, 1,
      "1: after each answer, score its tokens given the prompt without the documents (CPU "
      "workers; a prefill of the frame, question and answer; docs/groundedness.md); 0: off" },
    { "grounding_hidden_layers", K_STR, F(grounding_hidden_layers), "", 0, 0, 0,
      "layers whose residual stream each answer reports to requests that include "
      "hidden_states (L,L,...; at most 8; 0..layers), to fit a hidden-state "
      "probe; empty: only the calibration's probe layer" },
    { "unsupported", K_STR, F(unsupported), "mark", 0, 0, 1,
      "what a query that does not say does with an answer the documents do not support: answer "
      "(report it, never flagged), mark (report it with grounding.flagged) or decline (answer "
      "decline_text instead: when retrieval matched nothing, without generating; when the "
      "detector flags the answer or the model refuses, keeping its attempt; "
      "docs/groundedness.md#declining)" },
    { "decline_text", K_STR, F(decline_text), "The documents do not say.", 0, 0, 1,
      "the answer of a declined query (unsupported = decline)" },
    { "answer_mode", K_STR, F(answer_mode), "free", 0, 0, 1,
      "how a query that does not say writes its answer: free (the model's own words) or quote "
      "(every answer token continues a verbatim span of the placed documents, each span "
      "returned with its document and byte range; docs/groundedness.md#quote-mode)" },
    { "grounding_heads", K_STR, F(grounding_heads), "auto", 0, 0, 0,
      "attention heads watched without a calibration: auto (every head of the layers at 1/2 "
      "and 3/4 depth) or LAYER:HEAD,LAYER:HEAD,..." },
};
const size_t config_n_keys = sizeof config_keys / sizeof config_keys[0];
