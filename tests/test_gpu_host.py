"""The GPU path on a machine without a GPU: tests/gpu/gpu_check, the program tests/gpu/run.sh
runs on a GPU, run here against the host emulation of the GPU table (tests/gpu/host_gpu.c,
loaded in place of the CUDA backend through DIFFRAG_CUDA_LIB). That drives everything above
the kernels as a GPU run does: the engine's GPU contexts (model/engine_gpu.c: the paged KV
cache, the activation block, logits left on the device, sampling's pass and its candidates,
the masses and lambdas copied after the last layer) against CPU contexts of the default model,
and the GPU checks' own logic, the code of their speed table included (at sizes divided by 1024),
and the GPU pool's prefix cache (a prompt sharing another's first pages takes them).
The CUDA kernels themselves are checked only on a GPU."""
import os
import re
import subprocess

from conftest import BUILD


def test_gpu_checks_against_the_host_emulation(default_model):
    lib = BUILD / "tests" / "libdiffrag_hostgpu.so"
    check = BUILD / "tests" / "gpu" / "gpu_check"
    assert lib.exists() and check.exists(), "run make first"
    # The CPU contexts the checks compare with use f32 prefill products (the emulated device's
    # are bf16 with f32 accumulation, not the host's int8 ones).
    env = dict(os.environ, DIFFRAG_CUDA_LIB=str(lib.resolve()), OPENBLAS_NUM_THREADS="1",
               DIFFRAG_GEMM="native")
    # --dry-time: the quick checks, then the speed table's code with every size divided by
    # 1024 (its figures mean nothing here; it runs so that a GPU run does not meet its faults)
    r = subprocess.run([str(check), "--dry-time", "--threads", "2", str(default_model)], env=env,
                       capture_output=True, text=True, timeout=3600)
    out = r.stdout + r.stderr
    print(out[-3000:])
    assert "device 0: host emulation of the GPU table" in out, out[-3000:]
    assert r.returncode == 0 and "PASS: 0 failed checks" in out, out[-6000:]
    oks = re.findall(r"^ok   (.*)$", out, re.M)
    # the operations, sampling's pass in 14 settings, 16 attention sequences, and 6 end-to-end
    # checks for each of the two forms (the device's span of the prefill and the captured
    # residual stream among them)
    assert sum(o.startswith("sample (") for o in oks) == 14, oks
    assert sum(o.startswith("attention (") for o in oks) >= 16, oks
    for form in ("GQA form", "DIFF V2 form"):
        e2e = [o for o in oks if o.startswith(form + ", ")]
        assert len(e2e) == 6, (form, e2e)
        assert any("hidden-state probe's rows" in o for o in e2e), e2e
        assert any("greedy sampling on the device" in o for o in e2e), e2e
        assert any("the device's span of it" in o for o in e2e), e2e
    # the GPU pool's prefix cache (check_prefix): a shared prefix taken, bit-exact against cold
    # runs, the pool's pages accounted for, evicted and given back
    pfx = [o for o in oks if o.startswith("prefix cache: ")]
    assert len(pfx) == 8 and any("bit-exact" in o for o in pfx), pfx
    rows = re.findall(r"^\| (.*) \| (.*) \|$", out, re.M)
    assert len(rows) >= 25 and any(r[0].startswith("time to first token, 128K, DIFF V2 form, split")
                                   for r in rows), out[-3000:]


def test_daemon_on_the_host_emulation(tmp_path):
    """diffragd with `device cuda` on the emulated GPU, a tiny random DIFF V2 model of head
    dimension 64 (whose lambdas are not 0), beside the same model on the CPU: the daemon puts
    the model and a KV pool for its workers on the device, answers greedy and sampled queries
    through the device's sampling pass, and returns groundedness signals whose distribution
    figures for the first token agree with the CPU's; the self-check runs on the device too, and
    context reliance on the CPU only; the residual stream a hidden-state probe reads comes back
    from the device's step, close to the CPU's."""
    import math

    from daemon_util import Daemon, gen_model, query

    model = gen_model(tmp_path / "tiny-diffv2-hd64.gguf", "--arch", "diffv2", "--layers", 2,
                      "--dim", 128, "--heads", 2, "--kv-heads", 1, "--head-dim", 64,
                      "--ffn", 256, "--vocab", 512, "--seed", 11, "--untied")
    docs = [{"id": "rhine", "text": "The Rhine flows 1,230 km from the Swiss Alps to the North "
             "Sea. Cologne and Basel lie on its banks."},
            {"id": "paris", "text": "Paris is the capital of France; the Seine crosses it."}]
    lib = (BUILD / "tests" / "libdiffrag_hostgpu.so").resolve()
    env = {"DIFFRAG_CUDA_LIB": str(lib), "OPENBLAS_NUM_THREADS": "1"}
    replies = {}
    for device in ("cuda", "cpu"):
        (tmp_path / device).mkdir()
        with Daemon(tmp_path / device, model, workers=2, device=device, env=env,
                    grounding_self_check=1, grounding_reliance=1,
                    grounding_hidden_layers="0,1,2") as d:
            if device == "cuda":
                log = d.log_text()
                assert "host emulation of the GPU table" in log, log[-2000:]
                assert 'backend="cuda"' in d.metrics()
            c = d.client()
            for name, kw in (("greedy", {"temperature": 0}),
                             ("sampled", {"temperature": 0.8, "seed": 5}),
                             ("quoted", {"temperature": 0.8, "seed": 5,
                                         "answer_mode": "quote"})):
                _, r = c.call(query("How long is the Rhine?", docs, max_tokens=16,
                                    include=["token_signals", "hidden_states"], **kw),
                              timeout=120)
                assert r["ok"], r
                replies[device, name] = r
            assert d.stop() == 0, d.log_text()[-2000:]
    # quote mode on the device: the step's logits come back for the constraint, and every
    # span is the documents'
    texts = {d["id"]: d["text"] for d in docs}
    for device in ("cuda", "cpu"):
        r = replies[device, "quoted"]
        assert r["answer_mode"] == "quote" and r["quotes"], r
        assert "".join(q["text"] for q in r["quotes"]) == r["answer"], r
        for q in r["quotes"]:
            assert texts[q["doc_id"]][q["offsets"][0]:q["offsets"][1]] == q["text"], q
        assert 0 <= r["grounding"]["quote_removed"] <= 1, r["grounding"]
    for name in ("greedy", "sampled", "quoted"):
        g, c = replies["cuda", name], replies["cpu", name]
        ts, tc = g["token_signals"], c["token_signals"]
        n = len(ts["text"])
        assert n >= 1 and "".join(ts["text"]) == g["answer"]
        for k in ("logprob", "entropy", "margin", "doc_mass", "gen_mass", "diff_doc_mass"):
            assert all(math.isfinite(v) for v in ts[k]), (k, ts[k])
        # DIFF V2 with lambdas that are not 0: the differential mass is not the mass
        assert any(abs(a - b) > 1e-4 for a, b in zip(ts["diff_doc_mass"], ts["doc_mass"])), ts
        # the first token's distribution comes from the same prompt on both (bf16 on the device)
        assert abs(ts["entropy"][0] - tc["entropy"][0]) < 0.05, (ts["entropy"][0], tc["entropy"][0])
        for k in ("doc_mass", "diff_doc_mass"):
            assert abs(ts[k][0] - tc[k][0]) < 0.03, (k, ts[k][0], tc[k][0])
        # the self-check runs on the device's context too (a prefill after the answer); the
        # context reliance, which needs every position's logits, only on CPU workers
        assert 0 < g["grounding"]["self_check"] < 1 and 0 < c["grounding"]["self_check"] < 1, \
            (g["grounding"], c["grounding"])
        if g["answer"] == c["answer"]:   # the same answer: the same verdict, within bf16's error
            assert abs(g["grounding"]["self_check"] - c["grounding"]["self_check"]) < 0.01
        assert g["grounding"]["context_reliance"] is None, g["grounding"]
        # the prompt's last position: the same rows within bf16's error, every layer
        hg, hc = g["hidden_states"], c["hidden_states"]
        assert hg["layers"] == hc["layers"] == [0, 1, 2], (hg, hc)
        # and, for the same answer, the last position's
        kinds = ("first", "last") if g["answer"] == c["answer"] else ("first",)
        for kind in kinds:
            for a, b in zip(hg[kind], hc[kind]):
                rel = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)) / sum(y * y for y in b))
                assert len(a) == len(b) == 128 and rel < 0.05, (kind, rel)
        assert math.isfinite(c["grounding"]["context_reliance"]), c["grounding"]
        print(name, "cuda (emulated):", repr(g["answer"]), "cpu:", repr(c["answer"]),
              "self-check %.4f vs %.4f" % (g["grounding"]["self_check"],
                                           c["grounding"]["self_check"]))


def test_qwen2_biases_on_the_host_emulation(tmp_path):
    """A tiny qwen2 model (q, k and v biases, neox RoPE, head dimension 64) through the GPU
    table, the biases uploaded and added before RoPE (GpuRopeArgs.bias), against the CPU
    context: last logits within bf16's error (2e-2 relative, the same top token), while the
    same model without its biases is far from them."""
    import numpy as np

    from engine_util import gen_tiny, last_logits, rel_err
    from ref.ref_forward import load, logits

    model = gen_tiny(tmp_path / "tiny-qwen2-hd64.gguf", "--arch", "qwen2", "--layers", "2",
                     "--dim", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
                     "--ffn", "256", "--seed", "3", "--untied")
    tokens = np.random.default_rng(5).integers(0, 512, size=150).tolist()
    lib = (BUILD / "tests" / "libdiffrag_hostgpu.so").resolve()
    os.environ["DIFFRAG_CUDA_LIB"] = str(lib)
    try:
        gpu = last_logits(model, tokens, tmp_path, "--device", "cuda", "--chunk", 16,
                          name="gpu.bin")
    finally:
        del os.environ["DIFFRAG_CUDA_LIB"]
    cpu = last_logits(model, tokens, tmp_path, "--device", "cpu", "--kv", "f32", name="cpu.bin")
    err = rel_err(gpu, cpu)
    ref = load(model)
    for name in [k for k in ref.w if k.endswith(".bias")]:
        del ref.w[name]
    unbiased = logits(ref, tokens)[-1]
    err_unbiased = rel_err(gpu, unbiased)
    print(f"emulated GPU vs CPU: max rel diff {err:.3e}; vs the model without biases "
          f"{err_unbiased:.3e}")
    assert err <= 2e-2 and np.argmax(gpu) == np.argmax(cpu), err
    assert err_unbiased > 10 * err, (err, err_unbiased)


def test_gpu_batching_on_the_host_emulation(tmp_path, squad_dir):
    """The batch scheduler drives GPU workers too (on the host emulation of the GPU table): 16
    queries at once on a worker with max_running 16 get the same greedy answers, token signals
    and groundedness (the self-check included) as one at a time, in far fewer engine steps than
    tokens; a cancel in the running batch leaves the others' answers unchanged; with a device
    pool of a few pages the requests take pages as they grow, are preempted and recomputed, all
    answered as alone, and the pool is back to idle afterwards. The emulation computes each
    product's rows alone here (DIFFRAG_HOSTGPU_ROWWISE), so a batched answer must equal the
    one-at-a-time answer exactly, figures included; on a GPU, cuBLAS may round a row differently
    with another number of rows (docs/configuration.md). The small pool is overcommitted on
    purpose (DIFFRAGD_FAULTS=sched_overcommit): admitted by their projected needs, the requests
    would run a few at a time and none would be preempted."""
    from daemon_util import Daemon, gen_model, query
    from test_batching import (assert_same, gather, metric_sum, one_paragraph_queries,
                               send_then_cancel, settle)

    model = gen_model(tmp_path / "tiny-diffv2-hd64.gguf", "--arch", "diffv2", "--layers", 2,
                      "--dim", 128, "--heads", 2, "--kv-heads", 1, "--head-dim", 64,
                      "--ffn", 256, "--vocab", 512, "--seed", 11, "--untied")
    lib = (BUILD / "tests" / "libdiffrag_hostgpu.so").resolve()
    env = {"DIFFRAG_CUDA_LIB": str(lib), "OPENBLAS_NUM_THREADS": "1",
           "DIFFRAG_HOSTGPU_ROWWISE": "1"}
    # step_ms 0: the steps' sizes do not depend on the machine's speed (see test_batching.py)
    common = dict(workers=1, threads=2, device="cuda", env=env, max_context_tokens=1024,
                  max_tokens=64, grounding_self_check=1, step_ms=0)

    def ask(qid, question, docs, **kw):
        kw.setdefault("max_tokens", 24)
        return query(question, docs, id=qid, temperature=0, top_k=8, relevance_floor=0,
                     include=["token_signals"], **kw)

    # short paragraphs: this model's tokenizer has 512 entries (about a token per character)
    qs = one_paragraph_queries(squad_dir, 17, max_chars=500)
    msgs = [ask("g%d" % i, q, docs) for i, (q, docs) in enumerate(qs[:16])]
    stop = ask("stop", qs[16][0], qs[16][1], max_tokens=60, stream=True)

    def pages_used(d):
        return settle(d, "diffrag_kv_pool_pages", 0.0, state="used")

    def alone(d, ms):
        c = d.client()
        out = []
        for m in ms:
            _, r = c.call(m, timeout=300)
            assert r["ok"], (m["id"], r)
            out.append(r)
        return out

    (tmp_path / "serial").mkdir()
    with Daemon(tmp_path / "serial", model, max_running=1, **common) as d:
        refs = alone(d, msgs + [dict(stop, stream=False)])
        assert pages_used(d) == 0.0
        assert d.stop() == 0, d.log_text()[-2000:]
    ref_stop = refs.pop()

    (tmp_path / "batched").mkdir()
    with Daemon(tmp_path / "batched", model, max_running=16, **common) as d:
        assert "host emulation of the GPU table" in d.log_text()
        clients = [d.client() for _ in msgs]
        cs = d.client()
        _, finals = send_then_cancel([(cs, stop)] + list(zip(clients, msgs)), cs)
        text = d.metrics()
        steps = metric_sum(d, "diffrag_step_tokens_count", text)
        assert pages_used(d) == 0.0, "device pages in use after every reply"
        assert d.stop() == 0, d.log_text()[-2000:]
    for m, ref in zip(msgs, refs):
        got = finals[m["id"]]
        print(m["id"], ref["usage"]["prompt_tokens"], repr(got.get("answer", got)))
        assert_same(got, ref, m["id"])
        assert got["grounding"]["self_check"] is not None, got["grounding"]
    generated = sum(r["usage"]["completion_tokens"] for r in refs)
    print("batched on the emulated GPU: %s steps for %d generated tokens" % (steps, generated))
    assert steps is not None and steps < generated / 2, (steps, generated)
    got = finals["stop"]
    assert got["ok"], got
    if finals["cancel-stop"]["ok"]:
        assert got["finish_reason"] == "cancelled", got
        assert ref_stop["answer"].startswith(got["answer"]), (got["answer"], ref_stop["answer"])
    else:
        assert_same(got, ref_stop, "stop")

    # a pool of 12 pages (768 positions) for 16 requests of up to ~250 positions each, each
    # joining on its first chunk's pages
    pages = 12
    pos_bytes = 2 * 2 * 1 * 64 * 2          # keys and values, 2 layers, 1 KV head of 64, bf16
    (tmp_path / "small").mkdir()
    overcommit = dict(common, env=dict(env, DIFFRAGD_FAULTS="sched_overcommit=1"))
    with Daemon(tmp_path / "small", model, max_running=16, kv_pool_bytes=pages * 64 * pos_bytes,
                max_queue=64, **overcommit) as d:
        clients = [d.client() for _ in msgs]
        for c, m in zip(clients, msgs):
            c.send(m)
        _, finals = gather({c: [m["id"]] for c, m in zip(clients, msgs)}, timeout=600)
        preempted = metric_sum(d, "diffrag_preemptions_total")
        # the free and cached counts once the last pages are given back (a worker returns them
        # just after its final reply goes out, so a read before the used count settles can see
        # fewer); the prompts' published pages stay cached
        assert pages_used(d) == 0.0
        free = d.metric("diffrag_kv_pool_pages", state="free")
        cached = d.metric("diffrag_kv_pool_pages", state="cached")
        assert d.stop() == 0, d.log_text()[-2000:]
    print("device pool of %d pages: preemptions %s, free after %s, cached %s"
          % (pages, preempted, free, cached))
    assert preempted and preempted > 0, preempted
    assert free + cached == pages, (free, cached)
    for m, ref in zip(msgs, refs):
        got = finals[m["id"]]
        assert got["ok"], got
        # the self-check takes only free pages: in a full pool it may not run (nil)
        if got["grounding"]["self_check"] is None:
            got = dict(got, grounding=dict(got["grounding"],
                                           self_check=ref["grounding"]["self_check"]))
        assert_same(got, ref, m["id"])


def test_prefix_cache_on_the_host_emulation(tmp_path):
    """The GPU pool's prefix cache through diffragd with `device cuda` on the emulated GPU: the
    same question over the same inline document twice. The second request takes the prompt's
    full pages that the first published (all but at most its last page: usage.cached_tokens
    >= prompt_tokens - 64, as on a CPU worker) and prefills only the rest; its answer and token
    figures equal the first's exactly (the emulation computes each product's rows alone here,
    DIFFRAG_HOSTGPU_ROWWISE, so a row does not depend on how many were computed beside it);
    /metrics counts the reused tokens, and once both are answered no page is in use and the
    prompt's pages stay cached."""
    from daemon_util import Daemon, gen_model, query
    from test_batching import settle

    model = gen_model(tmp_path / "tiny-diffv2-hd64.gguf", "--arch", "diffv2", "--layers", 2,
                      "--dim", 128, "--heads", 2, "--kv-heads", 1, "--head-dim", 64,
                      "--ffn", 256, "--vocab", 512, "--seed", 11, "--untied")
    docs = [{"id": "rhine", "text": "The Rhine flows 1,230 km from the Swiss Alps to the North "
             "Sea. It rises in the canton of Graubunden, forms part of the Swiss-Austrian and "
             "Swiss-German borders, and then the Franco-German border, before it crosses Germany "
             "and the Netherlands. Cologne, Basel, Strasbourg, Mainz, Dusseldorf and Rotterdam "
             "lie on its banks. It carries more freight than any other river of Europe, and its "
             "middle valley, with its castles and vineyards, is a World Heritage Site."}]
    lib = (BUILD / "tests" / "libdiffrag_hostgpu.so").resolve()
    env = {"DIFFRAG_CUDA_LIB": str(lib), "OPENBLAS_NUM_THREADS": "1",
           "DIFFRAG_HOSTGPU_ROWWISE": "1"}
    msg = query("How long is the Rhine?", docs, temperature=0, max_tokens=16,
                include=["token_signals"])
    with Daemon(tmp_path, model, workers=1, threads=2, device="cuda", env=env,
                max_context_tokens=1024, max_tokens=16) as d:
        assert "host emulation of the GPU table" in d.log_text()
        c = d.client()
        _, first = c.call(dict(msg, id="first"), timeout=300)
        _, second = c.call(dict(msg, id="second"), timeout=300)
        assert first["ok"] and second["ok"], (first, second)
        hit = d.metric("diffrag_prefix_cache_hit_tokens_total")
        used = settle(d, "diffrag_kv_pool_pages", 0.0, state="used")
        cached = d.metric("diffrag_kv_pool_pages", state="cached")
        assert d.stop() == 0, d.log_text()[-2000:]
    u1, u2 = first["usage"], second["usage"]
    print("prompt", u1["prompt_tokens"], "tokens; cached on the second ask:", u2["cached_tokens"],
          "answer", repr(second["answer"]))
    assert u1["prompt_tokens"] == u2["prompt_tokens"] > 4 * 64, (u1, u2)
    assert u1["cached_tokens"] == 0, u1
    assert u2["prompt_tokens"] - 64 <= u2["cached_tokens"] < u2["prompt_tokens"], u2
    assert u2["cached_tokens"] % 64 == 0, u2
    assert second["answer"] == first["answer"], (first["answer"], second["answer"])
    for k in ("logprob", "entropy", "margin", "doc_mass"):
        assert second["token_signals"][k] == first["token_signals"][k], k
    assert hit == u2["cached_tokens"], (hit, u2)
    assert used == 0 and cached >= u2["cached_tokens"] // 64, (used, cached)
