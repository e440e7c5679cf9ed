"""Runs the README's "Using diffrag" section in order, as a new user would, on a fresh data
directory, and checks what each command prints. `make run` is what it runs once everything is
built: tools/run-daemon.sh (ingest docs/, then diffragd with the default model), here with a
temporary DIFFRAG_DATA_DIR, the small model SmolLM2-135M (DIFFRAG_MODEL), free ports and short
answers (--default-max-tokens, --top-k) so that the test stays quick. The other ```sh blocks run from the repository root in bash, with
DIFFRAG_ENDPOINT naming the daemon and the documented addresses replaced by the test's, and
with the project's `.venv/bin/python3` replaced by a fresh virtual environment's (so `pip install`
installs there, offline).
Every command of the section must have a check here."""
import json
import os
import re
import signal
import subprocess
import sys
import time

from conftest import ROOT, offline_venv
from daemon_util import free_port, http_get

SECTION = "## Using diffrag"


def section_commands():
    text = (ROOT / "README.md").read_text()
    assert text.startswith("# diffrag\n\n```sh\nmake run    # install what is needed, build, fetch "
                           "the default model, serve on the defaults\nmake test   # every test")
    body = text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", body, re.S):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            cmd = lines[i]
            if cmd.rstrip().endswith("<<'EOF'"):  # a here-document runs as one command
                end = lines.index("EOF", i)
                cmd = "\n".join(lines[i:end + 1])
                i = end
            commands.append(cmd)
            i += 1
    return commands


# a source: its marker, document, heading path and pages (clients/cli/ask.c)
WHERE = r"  \[\d+\] (\S+)(?: \u203a .+?)?(?:, p\. \d+|, pp\. \d+\u2013\d+)?"


def sources(out):
    """The doc ids of the "sources:" lines of `diffrag ask`, in order."""
    assert "\nsources:\n" in out, out
    tail = out.split("\nsources:\n", 1)[1].splitlines()
    ids = [m.group(1) for m in (re.match(WHERE + r"  (?:chunk \d+|whole document), score ", ln)
                                for ln in tail) if m]
    assert ids, out
    assert any(ln.startswith("grounding: ") for ln in tail), out
    assert any(re.match(r"finish: (stop|length); tokens: \d+ prompt", ln) for ln in tail), out
    return ids


def sample_matches(out):
    """The README shows an answer as the default model gives it (its ```text block): what
    follows the answer there, from "sources:" on, follows the real answer too: the same kinds
    of line in the same order, each of the same form up to its figures, doc ids and finish
    reason (the test's small model words its answer otherwise, and places fewer chunks)."""
    body = (ROOT / "README.md").read_text().split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    sample = re.search(r"```text\n(.*?)```", body, re.S).group(1).splitlines()
    assert "sources:" in sample[1:], sample  # an answer, then what follows it
    forms = {"source": WHERE.replace(r"(\S+)", r"docs/[\w-]+\.md") +
                       r"  (?:chunk \d+|whole document), score \d+\.\d+, "
                       r"bytes \d+-\d+(?:, cited)?",
             "read": r"read: \d+ .*document tokens: .*",
             # the verdict and its figures vary by answer and detector
             "grounding": r"grounding: (?:not flagged: likely supported by the documents|FLAGGED: "
                          r"the answer may not rest on the documents) \(score \d\.\d{3}(?:, .*)?\)",
             "details": r"  details: answer tokens on words absent from the documents "
                        r"\d+\.\d%( \(\d+ of \d+\))?(, [a-z -]+ -?\d+\.\d+)*",
             "finish": r"finish: (?:stop|length); tokens: \d+ prompt \(\d+ from documents\), \d+ "
                       r"generated; first token \d+ ms, total \d+ ms"}

    def kinds(lines):
        out = []
        for line in lines:
            kind = next((k for k, f in forms.items() if re.fullmatch(f, line)), None)
            if kind and (not out or out[-1] != kind):
                out.append(kind)
        return out

    shown = sample[sample.index("sources:") + 1:]
    assert kinds(shown) and len(kinds(shown)) == len(set(kinds(shown))), shown
    assert all(re.fullmatch("|".join(forms.values()), l) for l in shown), shown
    real = kinds(out.split("\nsources:\n", 1)[1].splitlines())
    assert [k for k in real if k in kinds(shown)] == kinds(shown), (kinds(shown), real, out)
    return True


def is_doc(name):
    return re.fullmatch(r"docs/[\w-]+\.md", name) is not None


# (command pattern, queries it sends, check(stdout, context)) for every command of the section
CHECKS = [
    (r"build/diffrag ping$", 0,
     lambda out, c: out.startswith("pong from %s: diffragd 0.1.0, model " % c["ep"])),
    (r'build/diffrag ask "Under which licence is diffrag released\?"$', 1,
     lambda out, c: sources(out)[0] == "docs/licenses.md" and sample_matches(out)),
    (r'build/diffrag ask --stream "Which port does diffragd listen on\?"$', 1,
     lambda out, c: all(map(is_doc, sources(out)))),
    (r'echo "What does /readyz report\?" \| build/diffrag ask -$', 1,
     lambda out, c: "docs/configuration.md" in sources(out)),
    (r"build/diffrag ingest -c mine examples/$", 0,
     lambda out, c: out.startswith("ingested 1 document ") and "skipped 2 files" in out),
    (r'build/diffrag ask -c mine "How long is the Rhine\?"$', 1,
     lambda out, c: sources(out)[0] == "examples/sample-paragraph.txt"),
    (r'build/diffrag ask -d examples/sample-paragraph.txt "How long is the Rhine\?"$', 1,
     lambda out, c: set(sources(out)) == {"examples/sample-paragraph.txt"}),
    (r"build/diffrag ask --json .* \| python3 -c ", 1,
     lambda out, c: re.fullmatch(r"(stop|length) \['docs/[\w-]+\.md'.*\]\n", out)),
    (r"build/diffrag ls$", 0, lambda out, c: set(out.split()) >= {"docs", "mine"}),
    (r"build/diffrag ls -c mine$", 0,
     lambda out, c: out.startswith("examples/sample-paragraph.txt ") and out.count("\n") == 1),
    (r"build/diffrag stats$", 0,
     lambda out, c: "diffragd:        0.1.0" in out and "workers:         1 idle" in out),
    (r"make venv$", 0,
     lambda out, c: (ROOT / ".venv" / ".requirements").read_text() ==
     (ROOT / "tests" / "requirements.txt").read_text()),
    (r"\.venv/bin/python3 -m pip install clients/python$", 0,
     lambda out, c: any(c["venv"].glob("lib/python*/site-packages/diffrag/client.py"))),
    (r"\.venv/bin/python3 - <<'EOF'\nimport diffrag\n", 1,
     lambda out, c: re.search(r"\nsources: \[\(1, 'docs/[\w-]+\.md'\)", out)),
    (r"\.venv/bin/python3 examples/ask_folder.py tcp://127.0.0.1:7400 examples ", 1,
     lambda out, c: out.startswith("stored 1 documents") and
     "[1] sample-paragraph.txt" in out.split("sources:")[1]),
    (r"curl -s http://127.0.0.1:7480/v1/chat/completions ", 1,
     lambda out, c: json.loads(out)["choices"][0]["message"]["content"] and
     all(is_doc(x["doc_id"]) for x in json.loads(out)["diffrag"]["citations"]) and
     json.loads(out)["diffrag"]["citations"]),
    (r"\.venv/bin/python3 - <<'EOF'\nfrom openai import OpenAI\n", 1,
     lambda out, c: out.strip().splitlines()[-1] == "sources: ['examples/sample-paragraph.txt']"),
    (r"curl -s http://127.0.0.1:9400/metrics \| grep ", 0,
     lambda out, c: re.search(r'^diffrag_requests_total\{op="query",code="ok"\} %d$'
                              % c["asks"], out, re.M) and
     re.search(r"^diffrag_time_to_first_token_seconds_count %d$" % c["asks"], out, re.M)),
]


def check_for(cmd):
    for pattern, asks, chk in CHECKS:
        if re.match(pattern, cmd):
            return asks, chk
    raise AssertionError("the README runs %r: add a check for it to this test" % cmd)


def test_readme_quickstart(tmp_path, default_model):
    commands = section_commands()
    assert commands[0] == "make run", commands
    checks = [check_for(c) for c in commands[1:]]  # every command is known before starting
    port, mport, hport = free_port(), free_port(), free_port()
    ep = "tcp://127.0.0.1:%d" % port
    venv = tmp_path / "venv"
    offline_venv(venv)
    # `make run` serves the default model (Qwen2.5-Coder-0.5B); SmolLM2-135M keeps this quick
    # (tools/run-daemon.sh ingests with the tokenizer of the model it serves: DIFFRAG_MODEL)
    env = dict(os.environ, DIFFRAG_ENDPOINT=ep, DIFFRAG_DATA_DIR=str(tmp_path / "var"),
               DIFFRAG_MODEL=str(default_model),
               PATH="%s:%s" % (venv / "bin", os.environ["PATH"]), PIP_NO_INDEX="1",
               PYTHONPATH="", PIP_DISABLE_PIP_VERSION_CHECK="1")
    log = open(tmp_path / "run.log", "wb")
    # `make run` = make deps all model (done by the test environment) + tools/run-daemon.sh
    daemon = subprocess.Popen(["sh", "tools/run-daemon.sh", "--listen", ep,
                               "--metrics-listen", "127.0.0.1:%d" % mport,
                               "--http-listen", "127.0.0.1:%d" % hport, "--workers", "1",
                               "--default-max-tokens", "24", "--top-k", "2",
                               "--log-level", "warn"],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while http_get("http://127.0.0.1:%d/readyz" % mport, 0.5)[0] != 200:
            assert daemon.poll() is None, (tmp_path / "run.log").read_text()
            assert time.time() < deadline, "diffragd not ready"
            time.sleep(0.1)
        started = (tmp_path / "run.log").read_text()
        assert 'into "docs"' in started and 'build/diffrag ask "Which port does diffragd listen on?"' in started
        ctx = {"ep": ep, "venv": venv, "asks": 0}
        for cmd, (asks, chk) in zip(commands[1:], checks):
            run = cmd.replace("tcp://127.0.0.1:7400", ep).replace(
                "127.0.0.1:9400", "127.0.0.1:%d" % mport).replace("127.0.0.1:7480",
                                                                  "127.0.0.1:%d" % hport)
            # the project's .venv (which `make venv` keeps) stands for this test's own
            # environment, so that the client package installs there, offline
            run = run.replace(".venv/bin/python3", str(venv / "bin" / "python3"))
            t0 = time.time()
            r = subprocess.run(["bash", "-c", "set -o pipefail\n" + run], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
            ctx["asks"] += asks
            print("$ %s  (exit %d, %.1f s)\n%s%s" % (cmd, r.returncode, time.time() - t0,
                                                     r.stdout[-1500:], r.stderr[-1500:]))
            assert r.returncode == 0, cmd
            assert chk(r.stdout, ctx), "unexpected output of %r:\n%s" % (cmd, r.stdout)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            rc = daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            rc = daemon.wait()
        log.close()
    assert rc == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert (tmp_path / "var" / "data.mdb").exists()  # the fresh store, not var/
