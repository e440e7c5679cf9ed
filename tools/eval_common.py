"""What the evaluation tools (tools/eval-longctx.py, tools/eval-answers.py) share: the SQuAD 2.0
files, a diffragd of this build on loopback, one request and its final reply, and SQuAD's
answer normalisation."""
import hashlib
import json
import os
import pathlib
import re
import socket
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
QWEN_MODEL = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
SMOLLM2_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
sys.path.insert(0, str(ROOT / "tools"))
import squad_data  # noqa: E402

# the repository's SQuAD copy, unpacked on first use (tools/squad_data.py)
DEFAULT_SQUAD = squad_data.UNPACKED
# the refusal the daemon's prompt asks for when the documents do not answer (retriever/prompt.h)
REFUSAL = "I cannot find the answer in the provided documents."


class EvalError(Exception):
    pass


def build_dir():
    return ROOT / os.environ.get("BUILD", "build")


def load_squad(squad_dir=DEFAULT_SQUAD):
    """(passages by id, questions in file order) of SQuAD 2.0 (dev, CC BY-SA 4.0)."""
    squad_dir = pathlib.Path(squad_dir)
    if squad_dir == DEFAULT_SQUAD:
        squad_data.squad_dir()
    for f in ("passages.jsonl", "questions.jsonl"):
        if not (squad_dir / f).exists():
            raise EvalError("%s missing (the SQuAD 2.0 evaluation data)" % (squad_dir / f))
    passages = [json.loads(line) for line in open(squad_dir / "passages.jsonl")]
    questions = [json.loads(line) for line in open(squad_dir / "questions.jsonl")]
    return {p["id"]: p for p in passages}, questions


def article_split(title):
    """fit or test for a SQuAD article: a fixed hash, so both halves are stable (the detector
    is fitted on the fit split and evaluated on the test split)."""
    return "fit" if hashlib.sha256(title.encode()).digest()[0] % 2 == 0 else "test"


def normalise(text):
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def contains(answer, candidates):
    """Whether the normalised answer holds one of the normalised candidates as whole words."""
    a = " %s " % normalise(answer)
    return any(" %s " % normalise(c) in a for c in candidates if normalise(c))


def declined(answer):
    """Whether the answer gives the prompt's refusal (anywhere, after normalisation)."""
    return contains(answer, [REFUSAL])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url):
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, socket.timeout):
        return 0


class LocalDaemon:
    """This build's diffragd on loopback with its own store and log; keys are config keys."""

    def __init__(self, workdir, model, **keys):
        self.workdir = pathlib.Path(workdir)
        port, mport = free_port(), free_port()
        self.endpoint = "tcp://127.0.0.1:%d" % port
        self.ready_url = "http://127.0.0.1:%d/readyz" % mport
        self.log_path = self.workdir / ("diffragd-%d.log" % port)
        opts = {"model": model, "data_dir": self.workdir / ("store-%d" % port),
                "listen": self.endpoint, "metrics_listen": "127.0.0.1:%d" % mport,
                # its own HTTP API port, so that two evaluations can run side by side
                "http_listen": "127.0.0.1:%d" % free_port(),
                "workers": 1, "log_level": "warn",
                # a loaded machine can delay heartbeats: wait longer before giving a worker up
                "heartbeat_liveness": 10}
        opts.update(keys)
        self.argv = [str(build_dir() / "diffragd"), "--config", "/dev/null"]
        for k, v in opts.items():
            self.argv += ["--" + k, str(v)]
        self.proc = None

    def __enter__(self):
        if not pathlib.Path(self.argv[0]).exists():
            raise EvalError("%s missing: run `make all`" % self.argv[0])
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.time() + 300
        while time.time() < end:
            if self.proc.poll() is not None:
                self.log.close()
                raise EvalError("diffragd exited %d: %s" % (
                    self.proc.returncode, self.log_path.read_text(errors="replace")[-2000:]))
            if http_status(self.ready_url) == 200:
                return self
            time.sleep(0.1)
        raise EvalError("diffragd not ready after 300 s (log: %s)" % self.log_path)

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Asker:
    """A DEALER socket to one endpoint: ask(msg) sends a request and returns its final reply."""

    def __init__(self, endpoint, proc=None):
        """proc: the daemon's subprocess.Popen, when known; a daemon that exits while a reply
        is awaited fails the request at once instead of at its timeout."""
        import zmq
        self.proc = proc
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, msg, timeout):
        import msgpack
        self.sock.send(msgpack.packb(msg))
        end = time.time() + timeout
        while True:
            left = end - time.time()
            if left <= 0:
                raise EvalError("no reply to %r within %.0f s" % (msg.get("id"), timeout))
            if not self.sock.poll(int(min(left, 1.0) * 1000)):
                if self.proc is not None and self.proc.poll() is not None:
                    raise EvalError("diffragd exited (status %d) before replying to %r"
                                    % (self.proc.returncode, msg.get("id")))
                continue
            r = msgpack.unpackb(self.sock.recv_multipart()[-1], raw=False)
            if r.get("id") == msg.get("id") and "ok" in r:
                return r

    def close(self):
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
