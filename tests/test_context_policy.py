"""The context-length policy end to end (model/model_ctx.h; tests/test_model_ctx.c has the
arithmetic): diffrag-run and diffragd refuse a context longer than the model serves, naming both
numbers, and serve it when a RoPE override (or the file's own YaRN keys) extends the model;
diffragd chooses max_context_tokens from the model and says so in one start-up line; a query
asking for more than the model's context gets a clear `too_large`. Tiny models written with a
small context_length (gen-tiny-model --ctx) keep it quick."""
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from daemon_util import DIFFRAGD, Daemon, free_port, gen_model, query
from engine_util import gen_tiny, run

TOKENS = [5, 17, 99, 3, 250, 41, 7, 300]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A tiny llama whose context_length is 256."""
    return gen_tiny(tmp_path_factory.mktemp("ctx") / "ctx256.gguf", "--ctx", "256", "--seed", "4")


def test_run_refuses_past_the_models_context(small):
    r = run(small, "--ctx", 300, "-n", 0, tokens=TOKENS, check=False)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert "a 300-token context is longer than the 256 tokens this model serves" in err, err
    assert "context_length 256" in err and "--rope-scaling yarn" in err, err
    # without --ctx, the prompt plus -n is what must fit
    r = run(small, "-n", 250, tokens=TOKENS, check=False)
    err = r.stderr.decode()
    assert r.returncode == 1 and "the prompt (8 tokens) plus -n 250" in err, err
    assert "258-token context" in err and "256 tokens" in err, err
    # at the limit it runs
    run(small, "--ctx", 256, "-n", 2, tokens=TOKENS)


def test_run_override_extends_it(small, tmp_path):
    r = run(small, "--ctx", 1024, "-n", 1, "--rope-scaling", "yarn", "--rope-factor", 4,
            tokens=TOKENS, check=False)
    assert r.returncode == 0, r.stderr.decode()
    # a linear factor over a short original context extends less than the training context
    r = run(small, "--ctx", 300, "-n", 0, "--rope-scaling", "linear", "--rope-factor", 2,
            "--rope-orig-ctx", 100, tokens=TOKENS, check=False)
    err = r.stderr.decode()
    assert r.returncode == 1 and "linear x2 of 100 (context_length 256)" in err, err
    for args, want in [(("--rope-scaling", "yarn", "--rope-factor", "1"), "a factor above 1"),
                       (("--rope-scaling", "ntk", "--rope-factor", "2"), "not none, linear or yarn"),
                       (("--rope-factor", "2"), "need --rope-scaling"),
                       (("--rope-scaling", "yarn", "--rope-factor", "x"), "takes a number"),
                       (("--rope-scaling", "yarn", "--rope-factor", "2", "--rope-orig-ctx", "0"),
                        "takes 1..131072")]:
        r = run(small, "-n", 0, *args, tokens=TOKENS, check=False)
        assert r.returncode == 2 and want in r.stderr.decode(), (args, r.stderr.decode())


def test_override_equals_the_files_own_yarn_keys(tmp_path):
    """The override sets the RoPE configuration as the GGUF keys would: a file without YaRN
    keys, overridden, gives the very logits of the same weights written with them."""
    common = ["--ctx", "256", "--seed", "9", "--rope-layout", "neox"]
    plain = gen_tiny(tmp_path / "plain.gguf", *common)
    keyed = gen_tiny(tmp_path / "yarn.gguf", *common, "--rope-scaling", "yarn",
                     "--rope-factor", "4", "--rope-orig-ctx", "256")
    out = {}
    for name, model, args in [("plain", plain, ()), ("keyed", keyed, ()),
                              ("override", plain, ("--rope-scaling", "yarn", "--rope-factor",
                                                   "4", "--rope-orig-ctx", "256"))]:
        f = tmp_path / (name + ".bin")
        run(model, "--dump-logits", f, "-n", 0, "--threads", 1, *args, tokens=TOKENS)
        out[name] = np.fromfile(f, dtype="<f4")
    diff_plain = float(np.max(np.abs(out["plain"] - out["keyed"])))
    diff_override = float(np.max(np.abs(out["override"] - out["keyed"])))
    print("max |logit difference| to the YaRN file: plain %.3g, overridden %.3g"
          % (diff_plain, diff_override))
    assert diff_plain > 1e-3          # YaRN changes the logits, so the comparison can fail
    assert diff_override == 0.0
    # the file's own keys extend its context: 4 x 256
    run(keyed, "--ctx", 1024, "-n", 0, tokens=TOKENS)
    r = run(keyed, "--ctx", 1025, "-n", 0, tokens=TOKENS, check=False)
    assert r.returncode == 1 and "yarn x4 of 256 (context_length 256)" in r.stderr.decode()


def wait_log(d, text, timeout=10.0):
    deadline = time.time() + timeout
    while text not in d.log_text():
        assert time.time() < deadline, d.log_text()[-2000:]
        time.sleep(0.05)


def context_line(log):
    m = re.search(r'^.*msg="context" .*$', log, re.M)
    assert m, log[-2000:]
    return dict(re.findall(r'(\w+)=("[^"]*"|\S+)', m.group(0)))


@pytest.fixture(scope="module")
def daemon_model(tmp_path_factory):
    return gen_model(tmp_path_factory.mktemp("ctxd") / "tiny-1024.gguf", "--seed", 7,
                     "--ctx", 1024)


def test_daemon_chooses_the_context_and_refuses_past_it(tmp_path, daemon_model):
    conf = tmp_path / "d.conf"
    conf.write_text("max_queue = 16\nmax_tokens = 256\n")   # (the command line would win)
    d = Daemon(tmp_path, daemon_model, workers=1, default_max_tokens=4, max_context_tokens=0)
    d.argv[d.argv.index("/dev/null")] = str(conf)
    with d:
        line = context_line(d.log_text())
        print(line)
        assert line["model_ctx"] == "1024" and line["source"] == '"context_length 1024"'
        assert line["rope_override"] == '""' and line["budget_ctx"] == "none"
        assert line["max_context_tokens"] == "768" and line["n_ctx"] == "1024"
        assert line["chose"] == "\"auto: the model's context minus max_tokens\""
        assert "n_ctx=1024" in d.log_text().split('msg="workers started"')[1].splitlines()[0]
        c = d.client()
        docs = [{"id": "a", "text": "The Rhine is 1,230 km long."}]
        _, r = c.call(query("How long is the Rhine?", docs, max_context_tokens=768))
        assert r["ok"], r
        # past the model's context: the reply says whose limit it is
        _, r = c.call(query("How long is the Rhine?", docs, max_context_tokens=5000))
        assert not r["ok"] and r["error"]["code"] == "too_large", r
        msg = r["error"]["message"]
        assert "max_context_tokens is 5000" in msg and "1024-token context of the model" in msg
        assert "768" in msg, msg
        # within the model's context but over the daemon's cap: the cap
        _, r = c.call(query("How long is the Rhine?", docs, max_context_tokens=900))
        assert not r["ok"] and r["error"]["code"] == "too_large", r
        assert r["error"]["message"] == "max_context_tokens is 900; the limit is 768", r
        # SIGHUP keeps the context chosen at start-up, and refuses a max_tokens it cannot hold
        conf.write_text("max_queue = 8\nmax_tokens = 256\n")
        d.send_signal(signal.SIGHUP)
        wait_log(d, 'msg="configuration reloaded"')
        _, r = c.call(query("How long is the Rhine?", docs, max_context_tokens=900))
        assert r["error"]["message"] == "max_context_tokens is 900; the limit is 768", r
        conf.write_text("max_queue = 8\nmax_tokens = 512\n")
        d.send_signal(signal.SIGHUP)
        wait_log(d, 'msg="reload failed')
        assert ("max_context_tokens 768 (auto) + max_tokens 512 = 1280 exceeds the 1024-token "
                "context of the model" in d.log_text()), d.log_text()[-2000:]
        _, r = c.call(query("How long is the Rhine?", docs, max_context_tokens=768))
        assert r["ok"], r


def test_daemon_override_budget_and_refusals(tmp_path, daemon_model):
    with Daemon(tmp_path, daemon_model, workers=1, max_tokens=256, rope_scaling="yarn",
                rope_factor=4) as d:
        line = context_line(d.log_text())
        assert line["model_ctx"] == "4096" and line["rope_override"] == '"yarn x4 of 1024"'
        assert line["source"] == '"yarn x4 of 1024 (context_length 1024)"'
        assert line["max_context_tokens"] == "3840" and line["n_ctx"] == "4096"
    # a budget that holds less: the context shrinks to the longest the engine's estimate fits
    # (4 KiB of KV cache a position here, 7.4 MiB for the whole context), and the line says why
    wide = gen_model(tmp_path / "wide-1024.gguf", "--layers", 8, "--dim", 256, "--heads", 4,
                     "--ffn", 256, "--ctx", 1024, "--seed", 2)
    with Daemon(tmp_path, wide, workers=1, threads=1, max_tokens=256,
                kv_budget_bytes="6MiB") as d:
        line = context_line(d.log_text())
        budget = int(line["budget_ctx"])
        print(line)
        assert 256 + 64 <= budget < 1024 and line["n_ctx"] == str(budget)
        assert line["max_context_tokens"] == str(budget - 256)
        assert line["chose"] == '"auto: what kv_budget_bytes holds minus max_tokens"'
        ready = d.log_text().split('msg="workers started"')[1].splitlines()[0]
        assert "n_ctx=%d" % budget in ready, ready
    fits = run(wide, "--ctx", budget, "--budget-mb", 6, "--threads", 1, "-n", 0, tokens=TOKENS,
               check=False)
    over = run(wide, "--ctx", budget + 1, "--budget-mb", 6, "--threads", 1, "-n", 0,
               tokens=TOKENS, check=False)
    assert fits.returncode == 0 and over.returncode == 3, (fits.stderr, over.stderr)
    # explicit values past the model's context: no start, both numbers named
    d = Daemon(tmp_path, daemon_model, workers=1, max_tokens=256, max_context_tokens=800)
    d.start(wait_ready=False)
    rc = d.proc.wait(30)
    log = d.log_text()
    d.stop()
    assert rc == 1 and 'msg="the context does not fit the model"' in log, log[-2000:]
    assert ("max_context_tokens 800 + max_tokens 256 = 1056 exceeds the 1024-token context of "
            "the model" in log), log[-2000:]
    p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(daemon_model),
                        "--max-context-tokens", "800", "--max-tokens", "256", "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "1056 exceeds the 1024-token context" in p.stderr, p.stderr
    p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(daemon_model),
                        "--max-context-tokens", "800", "--max-tokens", "256", "--rope-scaling",
                        "yarn", "--rope-factor", "2", "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for args, want in [(("--rope-factor", "2"), "need rope_scaling linear or yarn"),
                       (("--rope-scaling", "yarn"), "needs rope_factor above 1"),
                       (("--rope-scaling", "ntk", "--rope-factor", "2"), "not none, linear or yarn"),
                       (("--max-context-tokens", "10"), "below 64")]:
        p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(daemon_model),
                            *args, "--check-config"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and want in p.stderr, (args, p.stderr)


def test_broker_without_workers_reads_the_context_from_the_file(tmp_path, daemon_model):
    d = Daemon(tmp_path, daemon_model, workers=0, max_tokens=256,
               worker_listen="tcp://127.0.0.1:%d" % free_port())
    d.start(wait_ready=False)
    try:
        deadline = time.time() + 30
        while 'msg="context"' not in d.log_text():
            assert d.proc.poll() is None and time.time() < deadline, d.log_text()[-2000:]
            time.sleep(0.05)
        line = context_line(d.log_text())
        assert line["model_ctx"] == "1024" and line["max_context_tokens"] == "768"
        assert line["budget_ctx"] == "none"
    finally:
        d.stop()
