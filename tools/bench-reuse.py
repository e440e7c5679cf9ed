"""Two different questions over one long inline document, with a top_k that places all its
chunks and no relevance floor: each question's time to first token and the prompt tokens the
second takes from the prefix cache (docs/performance.md). Runs diffragd with the given model.

    python3 tools/bench-reuse.py [--diffragd build/diffragd] [--model M] [--chars 26000]
"""
import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

import daemon_util  # noqa: E402
from squad_data import squad_dir  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--diffragd", default=str(ROOT / "build" / "diffragd"))
    ap.add_argument("--model", default=str(ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"))
    ap.add_argument("--chars", type=int, default=26000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/diffrag-bench-reuse")
    a = ap.parse_args()
    ps = [json.loads(l) for l in open(squad_dir() / "passages.jsonl")]
    by_title = {}
    for p in ps:
        by_title.setdefault(p["title"], []).append(p["text"])
    text = next(t for t in ("\n\n".join(v) for v in by_title.values()) if len(t) >= a.chars)
    text = text[:a.chars]
    daemon_util.DIFFRAGD = pathlib.Path(a.diffragd)
    tmp = pathlib.Path(a.dir)
    tmp.mkdir(parents=True, exist_ok=True)
    with daemon_util.Daemon(tmp, a.model, workers=1, threads=a.threads, max_context_tokens=8192,
                            max_tokens=16, relevance_floor=0) as d:
        c = d.client()
        for i, q in enumerate(["Who ruled the region, and in which century?",
                               "Where did the people of the text come from?"]):
            _, r = c.call(daemon_util.query(q, [{"text": text}], id=i, top_k=100, max_tokens=1,
                                            max_context_tokens=8192), timeout=600)
            assert r["ok"], r
            x, u = r["context"], r["usage"]
            print("question %d: first token %.1f s, prompt %d tokens, cached %d, document %s "
                  "tokens, %d of %d chunks placed, whole %s" % (
                      i + 1, r["timings"]["ttft_ms"] / 1000, u["prompt_tokens"],
                      u["cached_tokens"], x["doc_tokens"], x["chunks_placed"],
                      x["chunks_matched"], x["whole"]), flush=True)
        d.stop()


if __name__ == "__main__":
    main()
