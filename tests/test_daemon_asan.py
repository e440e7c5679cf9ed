"""diffragd and the daemon unit tests built with AddressSanitizer + UndefinedBehaviorSanitizer
(build/asan), leak detection on: the unit tests (msgpack reader on every truncation and random
bytes; the groundedness figures and the signals on the wire), then a sanitized daemon fed every malformed case of test_daemon_malformed.py, a
streamed query, a cancel, store operations and a SIGTERM drain; no sanitizer report, exit 0."""
import os
import subprocess

import pytest

import daemon_util
import test_daemon_malformed as malformed
from daemon_util import Daemon, fast_model, query

from conftest import run_make

ASAN_BUILD = "build/asan"
ENV = {"ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error")


@pytest.fixture(scope="module")
def asan_build(root):
    targets = [f"{ASAN_BUILD}/diffragd", f"{ASAN_BUILD}/tests/test_daemon_units",
               f"{ASAN_BUILD}/tests/test_grounding_units"]
    r = run_make(["make", "-s", "-j2", f"BUILD={ASAN_BUILD}",
                  *targets], cwd=root, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, f"ASan build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return root / ASAN_BUILD


@pytest.mark.parametrize("unit", ["test_daemon_units", "test_grounding_units"])
def test_units_under_asan(asan_build, root, unit):
    r = subprocess.run([str(asan_build / "tests" / unit)], cwd=root,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, **ENV))
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and not any(m in r.stderr for m in MARKERS), r.stderr[-3000:]


def test_daemon_under_asan(asan_build, tmp_path, monkeypatch):
    monkeypatch.setattr(daemon_util, "DIFFRAGD", asan_build / "diffragd")
    d = Daemon(tmp_path, fast_model(tmp_path), workers=2, env=ENV,
               max_message_bytes=malformed.MAX_MSG, max_docs=malformed.MAX_DOCS,
               max_question_bytes=malformed.MAX_Q, max_tokens=512, max_context_tokens=2048,
               max_top_k=50)
    with d:
        c = d.client()
        _, r = c.call({"v": 1, "op": "ingest", "collection": "main", "id": 0,
                       "docs": [{"id": "p", "text": "Paris is the capital of France."},
                                {"id": "r", "text": "The Rhine flows into the North Sea."}]})
        assert r["ok"], r
        wrong = []
        for name, msg, want in malformed.CASES:
            if isinstance(msg, list):
                c.send_frames(msg)
            else:
                c.send(msg)
            r = c.recv(10)
            got = r.get("error", {}).get("code") if r.get("ok") is False else "ok"
            if got != want:
                wrong.append((name, want, r))
        assert not wrong, wrong
        deltas, r = c.call(query("Where does the Rhine flow?", collection="main", id="s",
                                 stream=True, max_tokens=20))
        assert r["ok"] and "".join(x["delta"] for x in deltas) == r["answer"]
        c.send(query("capital?", [{"text": "Paris is the capital."}], id="long", stream=True,
                     max_tokens=400))
        c.recv(10)
        c.send({"v": 1, "op": "cancel", "id": "c", "target": "long"})
        finals = {}
        while len(finals) < 2:
            m = c.recv(10)
            if "ok" in m:
                finals[m["id"]] = m
        assert finals["long"]["ok"] and finals["c"]["ok"], finals
        _, r = c.call({"v": 1, "op": "get", "collection": "main", "doc_id": "p"})
        assert r["ok"] and r["doc"]["id"] == "p", r
        for m in ({"v": 1, "op": "get", "collection": "main", "doc_id": "p"},
                  {"v": 1, "op": "list", "collection": "main"},
                  {"v": 1, "op": "delete", "collection": "main", "ids": ["r"]},
                  {"v": 1, "op": "stats", "collection": "main"}, {"v": 1, "op": "stats"}):
            _, r = c.call(m)
            assert r["ok"], (m, r)
        rc = d.stop()
        log = d.log_text()
        found = [l for l in log.splitlines() if any(m in l for m in MARKERS)]
        print("sanitized daemon: %d malformed cases, exit %d, %d sanitizer lines"
              % (len(malformed.CASES), rc, len(found)))
        assert rc == 0 and not found, log[-4000:]
