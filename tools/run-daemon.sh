#!/bin/sh
# `make run`: ingests the project's own docs/ into the collection "docs" of the store in var/,
# then runs diffragd in the foreground on its embedded defaults (the default model
# Qwen2.5-Coder-0.5B-Instruct, tcp://127.0.0.1:7400, metrics on 127.0.0.1:9400, the OpenAI-compatible
# API on 127.0.0.1:7480 reading the collection "docs" by default). Ctrl-C drains
# in-flight requests and stops it.
# DIFFRAG_MODEL names another model: the store counts its chunks in that model's tokens and
# diffragd serves it (the two must agree). DIFFRAG_DATA_DIR names another store directory;
# BUILD another build directory. Arguments are passed to diffragd
# (`sh tools/run-daemon.sh --listen tcp://127.0.0.1:7500 --metrics-listen 127.0.0.1:9500`).
set -eu
cd "$(dirname "$0")/.."
DATA_DIR="${DIFFRAG_DATA_DIR:-var}"
MODEL="${DIFFRAG_MODEL:-models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf}"
BIN="${BUILD:-build}"
"$BIN/diffrag-store" --data-dir "$DATA_DIR" --model "$MODEL" -c docs ingest docs
cat <<'MSG'
diffragd: starting; ask it about diffrag from another terminal, e.g.
  build/diffrag ask "Which port does diffragd listen on?"
  make venv && .venv/bin/python3 -c 'import zmq, msgpack; s = zmq.Context().socket(zmq.DEALER); s.connect("tcp://127.0.0.1:7400"); s.send(msgpack.packb({"v": 1, "op": "query", "collection": "docs", "question": "Under which licence is diffrag released?"})); r = msgpack.unpackb(s.recv()); print(r["answer"]); print([c["doc_id"] for c in r["citations"]])'
  curl -s http://127.0.0.1:7480/v1/chat/completions -d '{"model": "diffrag", "messages": [{"role": "user", "content": "What does /readyz report?"}]}'
MSG
exec "$BIN/diffragd" --config /dev/null --data-dir "$DATA_DIR" --model "$MODEL" \
    --default-collection docs "$@"
