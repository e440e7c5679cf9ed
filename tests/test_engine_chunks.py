"""Chunk-size invariance: one prompt of >= 3,000 tokens prefilled with chunk sizes 1, 7, 64,
512 and unchunked gives the same logits (1e-4 relative) and the same 32-token greedy
continuation — on a tiny DIFF V2 model, and on the default model for the sizes it can afford."""
import json

import numpy as np
import pytest

from conftest import SMALL
from engine_util import gen_tiny, rel_err, run

N_PROMPT = 3072
# DIFFRAG_TEST_SCALE=small (conftest.py): the default model's prompt is 1,000 tokens (a partial
# last chunk for both 64 and 512); the tiny model keeps 3,072.
N_PROMPT_DEFAULT = 1000 if SMALL else N_PROMPT


def squad_text(squad_dir, n_chars):
    out = []
    with open(squad_dir / "passages.jsonl", encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line)["text"])
            if sum(map(len, out)) > n_chars:
                break
    return "\n\n".join(out)


def prefill_and_continue(model, tf, tmp_path, chunk):
    """Last-position logits and the 32-token greedy continuation from one run."""
    out = tmp_path / f"c{chunk}.bin"
    cont = run(model, "--tokens-file", tf, "--chunk", chunk, "--kv", "f32", "-n", 32,
               "--dump-logits", out).stdout
    return np.fromfile(out, dtype="<f4"), cont


def check_invariance(model, tokens, tmp_path, chunks):
    tf = tmp_path / "prompt.tokens"
    tf.write_text(",".join(map(str, tokens)))
    base, base_cont = prefill_and_continue(model, tf, tmp_path, len(tokens))
    for c in chunks:
        got, cont = prefill_and_continue(model, tf, tmp_path, c)
        err = rel_err(got, base)
        print(f"chunk {c}: max rel diff vs unchunked {err:.3e}; continuation "
              f"{'same' if cont == base_cont else 'DIFFERENT'}")
        assert err <= 1e-4, f"chunk {c}: relative error {err:.3e}"
        assert cont == base_cont, f"chunk {c}: greedy continuation differs"


def test_chunk_invariance_tiny_diffv2(tmp_path):
    model = gen_tiny(tmp_path / "tiny.gguf", "--arch", "diffv2", "--heads", "4", "--kv-heads",
                     "2", "--layers", "2", "--dim", "64", "--ctx", "4096", "--seed", "3")
    tokens = np.random.default_rng(11).integers(3, 512, size=N_PROMPT).tolist()
    check_invariance(model, tokens, tmp_path, [1, 7, 64, 512])


def test_chunk_invariance_default_model(default_model, squad_dir, tmp_path):
    # Real text through the real tokenizer. Chunk sizes 1 and 7 over 3,000 tokens of a 135M
    # model re-read every weight hundreds of times (minutes here): the tiny model above covers
    # them.
    r = run(default_model, "--print-tokens", "-n", 0, "-p", squad_text(squad_dir, 16000))
    line = [l for l in r.stderr.decode().splitlines() if l.startswith("tokens:")][0]
    tokens = [int(t) for t in line.split()[1:]][:N_PROMPT_DEFAULT]
    assert len(tokens) >= min(3000, N_PROMPT_DEFAULT)
    if SMALL:
        print("reduced scale (DIFFRAG_TEST_SCALE=small): a prompt of %d tokens" % len(tokens))
    check_invariance(default_model, tokens, tmp_path, [64, 512])
