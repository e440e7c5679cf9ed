"""The engine's attention-mass accumulators (docs/groundedness.md) against the NumPy reference,
which materialises every attention map (tests/ref/ref_forward.py): document and generated mass
of every head of every layer, and for DIFF V2 both maps of each pair, sigmoid(lambda) and the
differential masses, at the last position, for several chunk sizes and prefix lengths."""
import numpy as np
import pytest

from engine_util import gen_tiny, run
from ref.ref_forward import hidden, load, logits

MODELS = {
    "llama-g2": ["--arch", "llama", "--heads", "4", "--kv-heads", "2", "--layers", "3"],
    "diffv2-g2": ["--arch", "diffv2", "--heads", "3", "--kv-heads", "3", "--layers", "3",
                  "--head-dim", "16"],
    "diffv2-g4-neox": ["--arch", "diffv2", "--heads", "4", "--kv-heads", "2", "--layers", "2",
                       "--rope-layout", "neox"],
}
DOCS = [(5, 40), (60, 90)]


def heads_of(ref):
    return ref.n_head if ref.arch == "diffv2" else ref.n_q


def reference(ref, tokens, marked, docs=DOCS):
    """[(layer, head, doc, gen, doc2, gen2, sig, diff_doc, diff_gen)] at the last position."""
    maps = {}
    hidden(ref, tokens, maps=maps)
    n = len(tokens)
    doc_mask = np.zeros(n, dtype=bool)
    for a, b in docs:
        doc_mask[a:min(b, marked)] = True
    gen_mask = np.arange(n) >= marked
    rows = []
    for layer in range(ref.n_layer):
        probs, lam = maps[layer]
        last = probs[:, n - 1, :]
        doc = last[:, doc_mask].sum(axis=1)
        gen = last[:, gen_mask].sum(axis=1)
        for h in range(heads_of(ref)):
            if ref.arch == "diffv2":
                d1, g1, d2, g2 = doc[2 * h], gen[2 * h], doc[2 * h + 1], gen[2 * h + 1]
                s = lam[n - 1, h]
                rows.append((layer, h, d1, g1, d2, g2, s, (d1 - s * d2) / (1 - s),
                             (g1 - s * g2) / (1 - s)))
            else:
                rows.append((layer, h, doc[h], gen[h], 0, 0, 0, doc[h], gen[h]))
    return np.array(rows, dtype=np.float64)


def mass_error(got, want):
    """Largest error: absolute for the masses and sigmoid(lambda) (all in [0, 1]), relative
    (to max(1, |value|)) for the differential masses, which 1 / (1 - sigmoid(lambda)) can make
    large (15 and more on these random models) and so scales their float32 rounding."""
    plain = np.abs(got[:, 2:7] - want[:, 2:7]).max()
    diff = (np.abs(got[:, 7:] - want[:, 7:]) / np.maximum(1.0, np.abs(want[:, 7:]))).max()
    return max(plain, diff)


def engine_masses(model, tokens, tmp_path, marked, *args, docs=DOCS):
    watch = ",".join(f"{l}:{h}" for l in range(load(model).n_layer)
                     for h in range(heads_of(load(model))))
    tf = tmp_path / "tokens.txt"
    tf.write_text(",".join(map(str, tokens)))
    out = tmp_path / "mass.txt"
    spans = [x for a, b in docs for x in ("--doc", f"{a}-{b}")]
    run(model, "--tokens-file", tf, "-n", 0, "--watch", watch, "--mark", marked, *spans,
        "--dump-mass", out, *args)
    lines = out.read_text().splitlines()
    assert lines[0] == "step 0"
    return np.array([[float(v) for v in ln.split()] for ln in lines[1:]], dtype=np.float64)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_masses_match_materialised_maps(name, tmp_path):
    model = gen_tiny(tmp_path / f"{name}.gguf", *MODELS[name], "--seed", "11")
    ref = load(model)
    rng = np.random.default_rng(3)
    worst = 0.0
    for n, marked in ((150, 100), (128, 128), (64, 30), (97, 97)):
        tokens = rng.integers(0, ref.vocab, size=n).tolist()
        want = reference(ref, tokens, marked)
        if ref.arch == "diffv2":
            # the differential mass really differs from the first map's, and can go negative
            assert np.abs(want[:, 7] - want[:, 2]).max() > 1e-3
        for chunk in (n, 16, 1):
            got = engine_masses(model, tokens, tmp_path, marked, "--chunk", chunk, "--kv", "f32",
                                "--threads", 2)
            assert got.shape == want.shape
            assert (got[:, :2] == want[:, :2]).all()
            err = mass_error(got, want)
            worst = max(worst, err)
            assert err <= 1e-5, f"{name} n={n} marked={marked} chunk={chunk}: {err:.3e}"
            # masses are probabilities: doc + gen never exceed the whole map
            assert (got[:, 2] + got[:, 3] <= 1 + 1e-6).all() and (got[:, 2:4] >= 0).all()
        got16 = engine_masses(model, tokens, tmp_path, marked, "--chunk", 32, "--kv", "f16")
        # an f16 cache rounds keys to 11 significant bits; the differential masses divide by
        # 1 - sigmoid(lambda), which scales that error up
        err16 = np.abs(got16[:, 2:7] - want[:, 2:7]).max()
        assert err16 <= 2e-3, f"{name} n={n} with an f16 cache: {err16:.3e}"
        tol = 2e-3 * (1 + want[:, 6:7]) / (1 - want[:, 6:7])
        assert (np.abs(got16[:, 7:] - want[:, 7:]) <= tol).all(), f"{name} n={n}, f16 cache"
        got8 = engine_masses(model, tokens, tmp_path, marked, "--chunk", 32, "--kv", "q8")
        err8 = np.abs(got8[:, 2:7] - want[:, 2:7]).max()
        print(f"{name} n={n}: int8 cache, worst abs diff {err8:.2e}")
        # an int8 cache keeps each key to 1/254 of its largest element
        assert err8 <= 2e-2, f"{name} n={n} with an int8 cache: {err8:.3e}"
        assert (got8[:, 2] + got8[:, 3] <= 1 + 1e-6).all() and (got8[:, 2:4] >= 0).all()
    print(f"{name}: worst abs diff {worst:.2e}")


@pytest.mark.parametrize("arch", ["llama", "diffv2"])
def test_masses_long_sequence_in_segments(arch, tmp_path):
    """Past 1,024 keys the keys are split into segments whose partial sums are merged: a
    2,300-token sequence (3 segments) with the marked range ending inside the second."""
    model = gen_tiny(tmp_path / f"{arch}.gguf", "--arch", arch, "--heads", "2", "--kv-heads",
                     "1", "--layers", "1", "--ctx", "4096", "--seed", "4")
    ref = load(model)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, ref.vocab, size=2300).tolist()
    docs = [(5, 40), (900, 1200), (1400, 1600)]
    want = reference(ref, tokens, 1500, docs)
    got = engine_masses(model, tokens, tmp_path, 1500, "--chunk", 512, "--kv", "f32",
                        "--threads", 2, docs=docs)
    assert mass_error(got, want) <= 1e-5, mass_error(got, want)


def test_masses_each_generated_step(tmp_path):
    """During generation every token gets the masses of the position that produced it: the
    first from the prompt's last position (no generated mass yet), the later ones from each
    decode step, with the generated tokens as the generated span; checked against the
    reference over the prompt plus the greedy tokens (the reference's own argmax)."""
    model = gen_tiny(tmp_path / "d.gguf", *MODELS["diffv2-g2"], "--seed", "5")
    ref = load(model)
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, ref.vocab, size=90).tolist()
    tf = tmp_path / "tokens.txt"
    tf.write_text(",".join(map(str, prompt)))
    out = tmp_path / "mass.txt"
    watch = ",".join(f"{l}:{h}" for l in range(ref.n_layer) for h in range(ref.n_head))
    run(model, "--tokens-file", tf, "-n", 5, "--watch", watch, "--doc", "5-40", "--doc",
        "60-90", "--dump-mass", out, "--kv", "f32", "--chunk", 32)
    blocks = out.read_text().split("step ")[1:]
    assert [b.splitlines()[0] for b in blocks] == [str(i) for i in range(len(blocks))]
    assert len(blocks) >= 2
    seq = list(prompt)
    for i, block in enumerate(blocks):
        got = np.array([[float(v) for v in ln.split()] for ln in block.splitlines()[1:]])
        want = reference(ref, seq, 90)
        err = mass_error(got, want)
        assert err <= 1e-5, f"step {i}: {err:.3e}"
        if i == 0:
            assert (got[:, 3] == 0).all() and (got[:, 5] == 0).all()
        else:
            assert (got[:, 3] > 0).all()
        lg = logits(ref, seq)[-1]
        top2 = np.sort(lg)[-2:]
        assert top2[1] - top2[0] > 1e-3, "a near tie would make greedy decoding ambiguous"
        seq.append(int(np.argmax(lg)))


def test_watch_errors(tmp_path):
    model = gen_tiny(tmp_path / "l.gguf", *MODELS["llama-g2"], "--seed", "2")
    for spec, msg in (("3:0", "outside the model"), ("0:4", "outside the model"),
                      ("0:1,0:1", "watched twice"), ("0-1", "--watch takes")):
        r = run(model, "--tokens", "1,2,3", "-n", 0, "--watch", spec, check=False)
        assert r.returncode != 0 and msg in r.stderr.decode(), (spec, r.stderr)
    r = run(model, "--tokens", "1,2,3", "-n", 0, "--watch", "auto", "--mark", "99999",
            check=False)
    assert r.returncode != 0 and "do not fit" in r.stderr.decode()
