"""The libFuzzer targets build, replay their committed seed corpora (which hold the inputs of
past crashes) and survive a short fuzzing run each. Long runs: `make fuzz FUZZ_SECONDS=N`."""
import subprocess

import pytest

from conftest import ROOT, run_make

TARGETS = ["fuzz_gguf", "fuzz_tokenizer", "fuzz_analyzer", "fuzz_context", "fuzz_request",
           "fuzz_openai", "fuzz_calibration"]


@pytest.fixture(scope="module")
def fuzz_build():
    r = run_make(["make", "-s", "fuzz-build"], cwd=ROOT, capture_output=True, text=True,
                 timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return ROOT / "build" / "fuzz"


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target(fuzz_build, target, tmp_path, default_model):
    seeds = ROOT / "tests" / "fuzz" / "seeds" / target
    assert any(seeds.iterdir()), f"no seeds for {target}"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    r = subprocess.run([str(fuzz_build / target), "-max_total_time=5", "-max_len=65536",
                        f"-artifact_prefix={tmp_path}/", "-print_final_stats=1", str(corpus),
                        str(seeds)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    stats = [l for l in r.stderr.splitlines() if l.startswith("stat::number_of_executed_units")]
    print(target, stats)
    assert r.returncode == 0, r.stderr[-4000:]
    assert stats and int(stats[0].split(":")[-1]) > 0
