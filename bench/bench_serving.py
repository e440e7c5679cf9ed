#!/usr/bin/env python3
"""`make bench-serving`: diffragd beside llama.cpp's llama-server, serving the same GGUF file
(the default model, Qwen2.5-Coder-0.5B-Instruct Q4_K_M; --model another, e.g. the tests'
SmolLM2-135M-Instruct for a run a few times shorter) on the same number of threads, as clients
on this machine see them.

1. Prefix reuse: a first question over about 7K tokens of documents, then a second, different
   question over the same documents; the second's time to first token divided by the first's
   (both streamed, measured by the client). diffragd gets the documents inline with a top_k
   that places every chunk and `"order": "document"`, so both prompts share everything up to
   the question; llama-server gets the same text (below) on /completion with cache_prompt.
   Target: at most 0.05.
2. Throughput: 16 concurrent clients, each with its own documents (a prompt of about 600
   tokens, nothing shared but the frame), 64 answer tokens at most, greedy: generated tokens
   of all of them divided by the wall time from the first request to the last reply. diffragd
   with its default workers, and again with `max_running = 1` when it has that key. Target: at
   least 3x diffragd with max_running = 1 and at least llama-server's.
3. Stall-free: one client streams an answer over a short prompt; once its third token came,
   another client sends a prompt of about 7K tokens. The figure is the p99 of the gaps between
   the stream's tokens while the long prompt prefills (from when an engine took it, to its
   first token); the line says how many of the stream's tokens fell in that window (none: the
   engine served the two one after the other). Target: at most 150 ms. Also measured with
   `max_running = 1`, where the long prompt waits for the stream to end.

Documents are SQuAD 2.0 paragraphs (dev, CC BY-SA 4.0) from the repository (tests/data/squad2), each
run of a figure with paragraphs no other run used, so no cache carries over between
repetitions. diffragd places only chunks that share a term with the question, so a set holds
one-chunk paragraphs that match the questions asked over it: both engines see every paragraph.
Figures are medians over --reps repetitions (--quick: one, over shorter prompts). llama-server runs with --parallel 16
--cont-batching, one KV cache shared by its slots (--kv-unified, 16,384 tokens, so a slot can
hold a whole ~8K prompt) and its default prompt cache; it gets the prompt diffragd builds,
written out as text: the ChatML frame and instruction of retriever/prompt.c, each document
labelled "[n] Title", then "Question: ...", tokenized by the server with its special tokens.
llama-server is built by `sh bench/build-llama-bench.sh`."""
import argparse
import http.client
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
sys.path.insert(0, str(ROOT / "tests"))

import msgpack  # noqa: E402
import zmq  # noqa: E402

from daemon_util import DIFFRAGD, Daemon  # noqa: E402

MODEL = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
sys.path.insert(0, str(ROOT / "tools"))
import squad_data  # noqa: E402

# SQuAD 2.0 (dev, CC BY-SA 4.0) paragraphs: the repository's copy (tests/data/squad2/), unpacked
SQUAD = squad_data.squad_dir() / "passages.jsonl"
LLAMA_SERVER = ROOT / "build" / "llama.cpp" / "bin" / "llama-server"
RUN = BUILD / "diffrag-run"

# SmolLM2's context is 8,192 tokens: the prompt budget and the answer cap share it.
MAX_CONTEXT = 7680
MAX_TOKENS = 512
TOP_K = 256          # more than the chunks of any document set here: every chunk is placed
SLOTS = 16
LLAMA_CTX = 16384    # llama-server's KV cache, shared by its slots
TIMEOUT_S = 900.0

# retriever/prompt.c, as text (llama-server parses the special tokens of a /completion prompt)
REFUSAL = "I cannot find the answer in the provided documents."
HEAD = ("<|im_start|>system\nAnswer the question using only the documents. Cite the documents "
        "you use as [n]. If they do not contain the answer, reply: " + REFUSAL +
        "<|im_end|>\n<|im_start|>user\nDocuments:\n\n")
TAIL = "<|im_end|>\n<|im_start|>assistant\n"

# diffragd places only chunks that share a term with the question (BM25), so each document set
# holds paragraphs that match the questions asked over it (Paragraphs.take)
Q_FIRST = "What happened first, and in which year?"
Q_SECOND = "Which people, places or dates do the documents name?"
Q_SUMMARY = ("Summarize in detail what the documents say about who did what, which year, and "
             "from which place.")
# the Lucene English stop words, which diffragd's analyzer drops
STOP_WORDS = frozenset("a an and are as at be but by for if in into is it no not of on or such "
                       "that the their then there these they this to was will with".split())


class Fail(Exception):
    """A condition the user can act on: printed as one message, no traceback."""


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100.0 * len(xs)))] if xs else float("nan")


# ---------------------------------------------------------------------------------------------
# Documents

def words(text):
    return set(w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOP_WORDS)


def chars_per_token(text, model, run=None):
    """Characters per token of text under model's tokenizer (diffrag-run --print-tokens)."""
    r = subprocess.run([str(run or RUN), "-m", str(model), "-n", "0", "--ctx", "1",
                        "--print-tokens", "-p", "-"], input=text, capture_output=True, text=True)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("tokens:")]
    if not line:
        raise Fail("diffrag-run did not tokenize: %s" % r.stderr[-500:])
    return len(text) / (len(line[0].split()) - 1)


class Paragraphs:
    """SQuAD paragraphs handed out in file order, each once, in sets of about N tokens."""

    def __init__(self):
        if not SQUAD.exists():
            raise Fail("%s not found (the SQuAD data: tools/squad_data.py)" % SQUAD)
        with open(SQUAD, encoding="utf-8") as f:
            self.paras = [json.loads(line) for line in f if line.strip()]
        self.words = [words(p["text"]) for p in self.paras]
        self.used = [False] * len(self.paras)
        self.chars_per_token = self._calibrate()

    def _calibrate(self):
        return chars_per_token("\n\n".join(p["text"] for p in self.paras[:300]), MODEL)

    def take(self, tokens, questions=()):
        """Paragraphs of about `tokens` tokens (label and separator included), as inline docs
        in file order. With questions: only paragraphs of one chunk (under 220 tokens) that
        share a word with each question, so diffragd places all of them."""
        qwords = [words(q) for q in questions]
        docs, total = [], 0.0
        for i, p in enumerate(self.paras):
            if total >= tokens * 0.97:
                break
            n = len(p["text"]) / self.chars_per_token
            if self.used[i] or (qwords and (n > 220 or not all(self.words[i] & q
                                                                 for q in qwords))):
                continue
            self.used[i] = True
            docs.append({"id": "d%04d" % len(docs), "title": p["title"], "text": p["text"]})
            total += n + 8
        else:
            raise Fail("the SQuAD paragraphs ran out; use --quick or fewer --reps")
        return docs


def prompt_text(docs, question):
    """The prompt diffragd assembles for these documents in document order, as text."""
    parts = [HEAD]
    for n, d in enumerate(docs, 1):
        parts.append("[%d] %s\n%s\n\n" % (n, d["title"], d["text"]))
    parts.append("Question: " + question + TAIL)
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# Engines: request() streams one answer and returns what the client saw.

class Reply:
    def __init__(self):
        self.t_send = self.t_first = self.t_end = None
        self.token_times = []     # arrival of each streamed token (perf_counter seconds)
        self.completion_tokens = 0
        self.prompt_tokens = None
        self.cached_tokens = None  # None: the engine did not say
        self.prefill_ms = None
        self.queue_s = 0.0        # before the engine began on it (diffragd: queue + retrieval)
        self.docs_placed = None   # diffragd: documents with a chunk in the prompt

    @property
    def ttft(self):
        return self.t_first - self.t_send


class Diffragd:
    name = "diffragd"
    order_note_printed = False

    def __init__(self, tmp, threads, label, **keys):
        self.label = label
        self.order = True
        self.stopping = False
        self.lock = threading.Lock()
        # relevance_floor 0: every chunk the budget holds is placed, so the prompts are the
        # sizes this benchmark means (serving, not retrieval)
        cfg = dict(threads=threads, max_context_tokens=MAX_CONTEXT, max_tokens=MAX_TOKENS,
                   max_top_k=TOP_K, relevance_floor=0, log_level="warn")
        cfg.update(keys)
        workers = cfg.pop("workers")
        self.daemon = Daemon(tmp, MODEL, workers=workers, **cfg)

    def start(self):
        try:
            self.daemon.start(timeout=120)
        except AssertionError as e:
            raise Fail("diffragd (%s) did not start: %s" % (self.label, e))
        return self

    def stop(self):
        # request threads still waiting notice this within half a second and close their
        # sockets, which the context's termination waits for
        self.stopping = True
        self.daemon.__exit__(None, None, None)

    def request(self, question, docs, max_tokens, on_token=None):
        msg = {"v": 1, "op": "query", "id": 1, "question": question, "docs": docs,
               "top_k": TOP_K, "max_context_tokens": MAX_CONTEXT, "max_tokens": max_tokens,
               "temperature": 0, "stream": True}
        if self.order:
            msg["order"] = "document"
        sock = self.daemon.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.daemon.endpoint)
        rep = Reply()
        try:
            rep.t_send = time.perf_counter()
            sock.send(msgpack.packb(msg))
            deadline = rep.t_send + TIMEOUT_S
            while True:
                while not sock.poll(500):
                    if self.stopping:
                        raise Fail("diffragd (%s) stopped" % self.label)
                    if time.perf_counter() > deadline:
                        raise Fail("diffragd (%s): no reply within %.0f s"
                                   % (self.label, TIMEOUT_S))
                m = msgpack.unpackb(sock.recv(), raw=False)
                t = time.perf_counter()
                if "delta" in m and "ok" not in m:
                    if rep.t_first is None:
                        rep.t_first = t
                    rep.token_times.append(t)
                    if on_token:
                        on_token(len(rep.token_times))
                    continue
                rep.t_end = t
                break
        finally:
            sock.close(0)
        if not m.get("ok"):
            e = m.get("error", {})
            if (self.order and e.get("code") == "bad_request"
                    and "order" in e.get("message", "")):
                with self.lock:
                    if self.order:
                        self.order = False
                        print("  note: diffragd refused \"order\" (%s): its figures are measured "
                              "without document order" % e.get("message"), flush=True)
                return self.request(question, docs, max_tokens, on_token)
            raise Fail("diffragd (%s): %s: %s" % (self.label, e.get("code"), e.get("message")))
        u, t = m.get("usage", {}), m.get("timings", {})
        rep.completion_tokens = u.get("completion_tokens", len(rep.token_times))
        rep.prompt_tokens = u.get("prompt_tokens")
        rep.cached_tokens = u.get("cached_tokens")
        rep.prefill_ms = t.get("prefill_ms")
        rep.queue_s = (t.get("queue_ms", 0) + t.get("retrieve_ms", 0)) / 1e3
        rep.docs_placed = len({c.get("doc_id") for c in m.get("citations", [])})
        if rep.t_first is None:
            rep.t_first = rep.t_end
        return rep


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    name = "llama-server"

    def __init__(self, tmp, threads):
        self.label = "llama-server"
        self.port = free_port()
        self.log_path = pathlib.Path(tmp) / "llama-server.log"
        self.argv = [str(LLAMA_SERVER), "-m", str(MODEL), "--host", "127.0.0.1",
                     "--port", str(self.port), "-t", str(threads), "-tb", str(threads),
                     "--parallel", str(SLOTS), "--cont-batching", "-c", str(LLAMA_CTX),
                     "--kv-unified"]
        self.proc = None

    def start(self):
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.time() + 120
        while time.time() < end:
            if self.proc.poll() is not None:
                raise Fail("llama-server exited %d:\n%s" % (self.proc.returncode, self.tail()))
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % self.port,
                                            timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            time.sleep(0.2)
        raise Fail("llama-server not ready after 120 s:\n%s" % self.tail())

    def tail(self):
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-2000:]

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()   # it finishes the requests in flight first: not for long
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.log.close()

    def request(self, question, docs, max_tokens, on_token=None):
        body = json.dumps({"prompt": prompt_text(docs, question), "n_predict": max_tokens,
                           "temperature": 0, "cache_prompt": True, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        rep = Reply()
        final = None
        try:
            rep.t_send = time.perf_counter()
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise Fail("llama-server: HTTP %d: %s" % (r.status, r.read()[:500]))
            while True:
                line = r.readline()
                if not line:
                    break
                t = time.perf_counter()
                if not line.startswith(b"data: "):
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    raise Fail("llama-server: %s" % d["error"])
                if d.get("stop"):
                    final = d
                    rep.t_end = t
                    break
                if rep.t_first is None:
                    rep.t_first = t
                rep.token_times.append(t)
                if on_token:
                    on_token(len(rep.token_times))
        finally:
            conn.close()
        if final is None:
            raise Fail("llama-server: the stream ended without a final message")
        tm = final.get("timings", {})
        rep.completion_tokens = final.get("tokens_predicted", len(rep.token_times))
        rep.prompt_tokens = final.get("tokens_evaluated")
        rep.cached_tokens = tm.get("cache_n", final.get("tokens_cached"))
        rep.prefill_ms = tm.get("prompt_ms")
        if rep.t_first is None:
            rep.t_first = rep.t_end
        return rep


def concurrently(fns):
    """Run the callables at once (one thread each); their results, or the first failure."""
    out = [None] * len(fns)
    errs = []

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: B902 - re-raised in the caller's thread
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        while t.is_alive():
            t.join(0.2)
    if errs:
        raise errs[0]
    return out


# ---------------------------------------------------------------------------------------------
# The three measurements

def prefix_reuse(eng, doc_sets):
    ratios, first, second = [], [], []
    for docs in doc_sets:
        a = eng.request(Q_FIRST, docs, 4)
        b = eng.request(Q_SECOND, docs, 4)
        ratios.append(b.ttft / a.ttft)
        first.append(a)
        second.append(b)
        cached = ("" if b.cached_tokens is None else
                  "  cached_tokens %s/%s" % (a.cached_tokens, b.cached_tokens))
        pre = ("prefill_ms" if eng.name == "diffragd" else "prompt_ms")
        print("  %-26s prompt %s tokens: TTFT %7.1f ms then %7.1f ms (%s %.1f / %.1f)%s"
              % (eng.label, b.prompt_tokens, a.ttft * 1e3, b.ttft * 1e3, pre,
                 a.prefill_ms or 0, b.prefill_ms or 0, cached), flush=True)
        if eng.name == "diffragd" and b.cached_tokens is None:
            print("  %-26s usage.cached_tokens: not in the reply" % "", flush=True)
        for x in (a, b):
            if x.docs_placed is not None and x.docs_placed < len(docs):
                print("  %-26s only %d of the %d documents were placed in the prompt"
                      % ("", x.docs_placed, len(docs)), flush=True)
    return median(ratios), first, second


def throughput(eng, doc_sets, max_tokens):
    """Aggregate generated tokens/s of len(doc_sets) clients at once; (tok/s, wall s, mean
    completion tokens, median TTFT s)."""
    t0 = time.perf_counter()
    reps = concurrently([lambda d=d: eng.request(Q_SUMMARY, d, max_tokens) for d in doc_sets])
    wall = max(r.t_end for r in reps) - t0
    gen = sum(r.completion_tokens for r in reps)
    return gen / wall, wall, gen / len(reps), median([r.ttft for r in reps]), \
        median([r.prompt_tokens or 0 for r in reps])


def stall(eng, short_docs, long_docs, max_tokens):
    """The stream's token gaps while the long prompt prefills: the long one is sent once the
    stream has its third token; the window runs from when the engine began on it (diffragd:
    after its queue and retrieval time) to its first token."""
    third = threading.Event()
    box = {}

    def on_token(n):
        if n == 3:
            third.set()

    def run_stream():
        try:
            box["rep"] = eng.request(Q_SUMMARY, short_docs, max_tokens, on_token)
        except BaseException as e:  # noqa: B902 - re-raised below
            box["err"] = e
        finally:
            third.set()

    ts = threading.Thread(target=run_stream, daemon=True)
    ts.start()
    third.wait(TIMEOUT_S)
    t_long = time.perf_counter()
    long_rep = eng.request(Q_FIRST, long_docs, 4) if "err" not in box else None
    while ts.is_alive():
        ts.join(0.2)
    if "err" in box:
        raise box["err"]
    s = box["rep"]
    win0, win1 = t_long + long_rep.queue_s, long_rep.t_first
    times = s.token_times
    gaps = [b - a for a, b in zip(times, times[1:]) if win0 < b <= win1]
    return dict(p99=pct(gaps, 99) if gaps else None, p50=pct(gaps, 50) if gaps else None,
                n_in=sum(1 for t in times if win0 < t <= win1), n_tokens=len(times),
                prefill_s=win1 - win0, long_prompt=long_rep.prompt_tokens,
                stream_ttft=s.ttft)


# ---------------------------------------------------------------------------------------------

def diffragd_config():
    """(default workers, whether the daemon has a max_running key) from --print-config."""
    r = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--print-config"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise Fail("diffragd --print-config failed: %s" % r.stderr[-500:])
    workers, running = 1, False
    for line in r.stdout.splitlines():
        k, _, v = line.partition("=")
        k = k.strip()
        if k == "workers":
            workers = int(v.split("#")[0].strip())
        elif k == "max_running":
            running = True
    return workers, running


def fmt_ms(x):
    return "-" if x is None else "%.1f ms" % (x * 1e3)


def on_signal(signum, frame):
    raise KeyboardInterrupt


def main():
    global MODEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="compute threads of each engine")
    ap.add_argument("--only", choices=("diffragd", "llama-server", "both"), default="both")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: one repetition, ~2K-token documents, 32 answer tokens")
    ap.add_argument("--reps", type=int, help="repetitions of each figure (default 3, quick 1)")
    ap.add_argument("--step-tokens", type=int, default=0,
                    help="diffragd's step_tokens (0: its default)")
    ap.add_argument("--step-ms", type=int, default=-1,
                    help="diffragd's step_ms (-1: its default; 0: off)")
    ap.add_argument("--figures", default="prefix,throughput,stall",
                    help="which figures, a comma-separated subset of prefix,throughput,stall")
    ap.add_argument("--kv-reuse", type=float, metavar="SHARE",
                    help="diffragd with chunk KV reuse on (kv_reuse = 1) at this recompute "
                         "share: the long prompts' documents are blended (docs/kv-reuse.md)")
    ap.add_argument("--model", type=pathlib.Path,
                    help="GGUF file both engines serve (default %s)" % MODEL.relative_to(ROOT))
    a = ap.parse_args()
    if a.model:
        MODEL = a.model.resolve()
    reps = a.reps or (1 if a.quick else 3)
    figures = set(a.figures.split(","))
    if not figures or figures - {"prefix", "throughput", "stall"}:
        raise Fail("--figures takes a comma-separated subset of prefix,throughput,stall")
    if a.kv_reuse is not None and not 0 <= a.kv_reuse <= 1:
        raise Fail("--kv-reuse takes a recompute share in [0, 1]")
    long_tokens = 2000 if a.quick else 6800
    tp_doc_tokens, tp_answer = (250, 32) if a.quick else (520, 64)
    stream_tokens = 128 if a.quick else 256
    want_dd = a.only in ("diffragd", "both")
    want_ls = a.only in ("llama-server", "both")

    if want_ls and not os.access(LLAMA_SERVER, os.X_OK):
        raise Fail("llama-server is not built (%s): run `sh bench/build-llama-bench.sh` "
                   "(10-20 minutes on two cores), or pass --only diffragd"
                   % LLAMA_SERVER.relative_to(ROOT))
    if not MODEL.exists():
        raise Fail("%s is missing: run `make model`" % MODEL)
    for prog in ([DIFFRAGD] if want_dd else []) + [RUN]:
        if not os.access(prog, os.X_OK):
            raise Fail("%s is not built: run `make`" % prog)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    pool = Paragraphs()
    warm = pool.take(100, [Q_FIRST])
    prefix_sets = [pool.take(long_tokens, [Q_FIRST, Q_SECOND]) for _ in range(reps)]
    tp_sets = [[pool.take(tp_doc_tokens, [Q_SUMMARY]) for _ in range(SLOTS)] for _ in range(reps)]
    stall_sets = [(pool.take(100, [Q_SUMMARY]), pool.take(long_tokens, [Q_FIRST]))
                  for _ in range(reps)]

    print("bench-serving: %s, %d threads per engine, %d cores, %d repetition(s)%s"
          % (MODEL.name, a.threads, os.cpu_count(), reps, " (quick)" if a.quick else ""))
    print("documents: SQuAD 2.0 paragraphs, ~%d tokens for prefix reuse and stalls, ~%d per "
          "throughput client" % (long_tokens, tp_doc_tokens + 80), flush=True)

    engines = []
    if want_dd:
        workers, has_running = diffragd_config()
        steps = {"step_tokens": a.step_tokens} if a.step_tokens else {}
        if a.step_ms >= 0:
            steps["step_ms"] = a.step_ms
        if a.kv_reuse is not None:
            steps.update(kv_reuse=1, kv_reuse_recompute=a.kv_reuse)
        label = "diffragd workers=%d%s%s%s" % (workers, " step_tokens=%d" % a.step_tokens
                                               if a.step_tokens else "",
                                               " step_ms=%d" % a.step_ms if a.step_ms >= 0 else "",
                                               " kv_reuse_recompute=%g" % a.kv_reuse
                                               if a.kv_reuse is not None else "")
        engines.append(("diffragd", lambda tmp: Diffragd(tmp, a.threads, label,
                                                          workers=workers, **steps), True))
        if has_running:
            engines.append(("diffragd max_running=1",
                            lambda tmp: Diffragd(tmp, a.threads, "diffragd max_running=1",
                                                 workers=workers, max_running=1, **steps),
                            False))
    if want_ls:
        engines.append(("llama-server", lambda tmp: LlamaServer(tmp, a.threads), True))

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-serving-"))
    res = {}
    try:
        for key, make, full in engines:
            eng = make(tmp)
            print("\n== %s" % eng.label, flush=True)
            try:
                eng.start()
                eng.request(Q_FIRST, warm, 4)
                r = res[key] = {"label": eng.label}
                if full and "prefix" in figures:
                    print(" prefix reuse (second question's TTFT / first's):", flush=True)
                    r["prefix"], first, second = prefix_reuse(eng, prefix_sets)
                    r["ttft1"] = median([x.ttft for x in first])
                    r["ttft2"] = median([x.ttft for x in second])
                    r["pre1"] = median([x.prefill_ms or 0 for x in first])
                    r["pre2"] = median([x.prefill_ms or 0 for x in second])
                if "throughput" in figures:
                    print(" throughput (%d clients at once):" % SLOTS, flush=True)
                    tps = []
                    for docs in tp_sets:
                        tps.append(throughput(eng, docs, tp_answer))
                        tp, wall, mean_gen, ttft, prompt = tps[-1]
                        print("  %.1f generated tokens/s: wall %.1f s, %.1f answer tokens per "
                              "client, prompt %d tokens, median TTFT %.0f ms"
                              % (tp, wall, mean_gen, prompt, ttft * 1e3), flush=True)
                    r["tp"] = median([x[0] for x in tps])
                    r["tp_wall"] = median([x[1] for x in tps])
                    r["tp_prompt"] = median([x[4] for x in tps])
                if "stall" in figures and (full or key == "diffragd max_running=1"):
                    print(" stall-free (a stream while a ~%d-token prompt prefills):"
                          % long_tokens, flush=True)
                    sts = []
                    for short, long_docs in stall_sets:
                        st = stall(eng, short, long_docs, stream_tokens)
                        sts.append(st)
                        print("  p99 gap %s, p50 %s: %d of the stream's %d tokens came "
                              "during the %.1f s prefill of %s tokens (stream TTFT %.0f ms)"
                              % (fmt_ms(st["p99"]), fmt_ms(st["p50"]), st["n_in"],
                                 st["n_tokens"], st["prefill_s"], st["long_prompt"],
                                 st["stream_ttft"] * 1e3), flush=True)
                    p99s = [s["p99"] for s in sts if s["p99"] is not None]
                    r["stall"] = median(p99s) if p99s else None
                    r["stall_overlap"] = sum(s["n_in"] for s in sts)
            finally:
                eng.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    summary(res, a, reps, long_tokens, tp_answer, want_dd, figures)
    return 0


def summary(res, a, reps, long_tokens, tp_answer, want_dd, figures):
    print("\n== summary (medians of %d)" % reps)
    dd, one, ls = res.get("diffragd"), res.get("diffragd max_running=1"), res.get("llama-server")

    def row(r, what):
        return "  %-26s %s" % (r["label"], what)

    if "prefix" in figures:
        prefix_summary(dd, ls, long_tokens, row)
    if "throughput" in figures:
        throughput_summary(dd, one, ls, a, want_dd, tp_answer, row)
    if "stall" in figures:
        stall_summary(dd, one, ls, long_tokens, row)


def prefix_summary(dd, ls, long_tokens, row):
    print("prefix reuse, TTFT of a second question / first (~%d tokens of documents); "
          "target <= 0.05" % long_tokens)
    for r in (dd, ls):
        if r:
            print(row(r, "%.3f  (%.0f ms -> %.0f ms; prefill %.0f -> %.0f ms)"
                      % (r["prefix"], r["ttft1"] * 1e3, r["ttft2"] * 1e3, r["pre1"],
                         r["pre2"])))
    if dd:
        print("  target met: %s" % ("yes" if dd["prefix"] <= 0.05 else "NO"))


def throughput_summary(dd, one, ls, a, want_dd, tp_answer, row):
    print("throughput, generated tokens/s of %d clients at once (%d answer tokens at most); "
          "target >= 3x max_running=1 and >= llama-server" % (SLOTS, tp_answer))
    for r in (dd, one, ls):
        if r:
            print(row(r, "%.1f tok/s  (wall %.1f s, prompts of %d tokens)"
                      % (r["tp"], r["tp_wall"], r["tp_prompt"])))
    if want_dd and not one:
        print("  diffragd has no max_running key yet: no max_running=1 figure")
    if dd and one:
        x = dd["tp"] / one["tp"]
        print("  diffragd / max_running=1: %.2fx (target >= 3: %s)" % (x, "yes" if x >= 3 else "NO"))
    if dd and ls:
        x = dd["tp"] / ls["tp"]
        print("  diffragd / llama-server: %.2fx (target >= 1: %s)" % (x, "yes" if x >= 1 else "NO"))


def stall_summary(dd, one, ls, long_tokens, row):
    print("stall-free, p99 gap between a stream's tokens during a ~%d-token prefill; target "
          "<= 150 ms" % long_tokens)
    for r in (dd, one, ls):
        if r:
            if r["stall"] is None:
                print(row(r, "-  (no stream token came during the prefill: the two were "
                             "served one after the other)"))
            else:
                print(row(r, "%s  (%d stream tokens during the prefills)"
                          % (fmt_ms(r["stall"]), r["stall_overlap"])))
    if dd:
        ok = dd["stall"] is not None and dd["stall"] <= 0.150
        print("  target met: %s" % ("yes" if ok else "NO"))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Fail as e:
        print("bench-serving: %s" % e, file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("bench-serving: interrupted", file=sys.stderr)
        sys.exit(130)
