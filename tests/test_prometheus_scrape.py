"""diffragd's metrics read through a real Prometheus server (Debian's `prometheus`) scraping it
on loopback every second: after a known mix of flagged and unflagged answers, the
hallucination-rate query of docs/groundedness.md, evaluated through Prometheus's HTTP API,
equals the share of scored answers that the replies say were flagged, and so does the
documented share of flagged tokens; every query of deploy/grafana-dashboard.json returns data
(finite values) for the same traffic.

The mix is deterministic. The calibration written here scores only the window lookback ratio
(document attention mass / (document + generated mass)) and flags a window whose lookback is
at most 0.05. With `top_k` 1, a question that shares a word with the single inline document
gets its chunk placed, and the answer attends to it (lookback around 0.7 to 1); a question that
shares none gets no chunk placed, so no prompt position is a document position, every window's
lookback is exactly 0, and the answer is flagged whatever the random model writes.

The documented query is a ratio of two `rate(...[5m])`. Prometheus extrapolates each rate from
its samples, but both counters come from the same scrapes (the same timestamps), and the test
makes sure Prometheus scraped both at 0 before the first request: for a counter whose first
sample in the window is 0 the extrapolation does not reach back before that sample, so both
rates are (last value) / 300 s times the same factor, and their ratio is exactly the ratio of
the counts. The test lasts well under five minutes, so the documented expression is evaluated
as written. The dashboard's `$__rate_interval` (which Grafana computes from the panel and the
scrape interval) is replaced by 1m, which covers the whole traffic here and is more than four
scrape intervals."""
import hashlib
import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse

import pytest

from conftest import ROOT
from daemon_util import Daemon, free_port, gen_model, http_get, query

PROMETHEUS = shutil.which("prometheus")   # Debian's package (tools/install-deps.sh)
SCRAPE_INTERVAL_S = 1
DASHBOARD_RATE_INTERVAL = "1m"
DOC = {"id": "rhine", "title": "Rhine",
       "text": "The Rhine flows 1,230 km from the Swiss Alps to the North Sea. Cologne and Basel "
               "lie on its banks."}
# questions that share a word with DOC (its chunk is placed) and questions that share none
GROUNDED = ["How long is the Rhine?", "Which cities lie on the Rhine?", "Where does the Rhine end?",
            "Does the Rhine reach the North Sea?", "What are the Swiss Alps?",
            "Is Basel on the Rhine?", "How far from the Alps is Cologne?"]
UNGROUNDED = ["Why?", "Who wrote this?", "Any news today?", "Where do penguins live?"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny random llama of tests/test_daemon_grounding.py (2 layers of 4 heads, untied
    output, so its answers vary)."""
    return gen_model(tmp_path_factory.mktemp("models") / "tiny-untied.gguf", "--seed", 7,
                     "--untied")


def write_lookback_calibration(path, model_path):
    """Only the window lookback counts: score = sigmoid(5 - 100 * lookback), threshold 0.5, so
    a window is flagged when its lookback is at most 0.05."""
    sha = hashlib.sha256(model_path.read_bytes()).hexdigest()
    path.write_text(
        "diffrag-grounding 1\n"
        "# written by tests/test_prometheus_scrape.py\n"
        "name lookback-only\n"
        "model_sha256 %s\n"
        "window 4\nstride 2\nthreshold 0.5\nwatch 0:0 1:1 1:3\n"
        "features lookback\n"
        "mean 0\nscale 1\nweights -100\nbias 5\n" % sha)
    return path


class Prometheus:
    """Debian's Prometheus server on loopback, scraping one target, with its data in tmp_path."""

    def __init__(self, tmp_path, target):
        self.tmp = tmp_path
        self.config = tmp_path / "prometheus.yml"
        self.config.write_text(
            "global:\n"
            "  scrape_interval: %ds\n"
            "  scrape_timeout: %ds\n"
            "  evaluation_interval: 1m\n"
            "scrape_configs:\n"
            "  - job_name: diffragd\n"
            "    static_configs:\n"
            "      - targets: ['%s']\n" % (SCRAPE_INTERVAL_S, SCRAPE_INTERVAL_S, target))
        self.log_path = tmp_path / "prometheus.log"
        self.proc = None
        self.log = None

    def start(self, timeout=60.0):
        assert PROMETHEUS, "prometheus (Debian package prometheus) is required"
        for attempt in range(3):
            self.port = free_port()
            self.url = "http://127.0.0.1:%d" % self.port
            self.log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(
                [PROMETHEUS, "--config.file=%s" % self.config,
                 "--storage.tsdb.path=%s" % (self.tmp / ("tsdb-%d" % attempt)),
                 "--web.listen-address=127.0.0.1:%d" % self.port, "--log.level=warn"],
                stdout=self.log, stderr=subprocess.STDOUT)
            end = time.time() + timeout
            while time.time() < end and self.proc.poll() is None:
                if http_get(self.url + "/-/ready", 0.5)[0] == 200:
                    return self
                time.sleep(0.1)
            # free_port() lets the port go before Prometheus binds it: on a lost race, again
            if self.proc.poll() is None or "address already in use" not in self.log_text():
                break
            self.log.close()
        raise AssertionError("Prometheus did not start (exit %s):\n%s"
                             % (self.proc.poll(), self.log_text()[-3000:]))

    def log_text(self):
        if self.log and not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.log and not self.log.closed:
            self.log.close()

    def query(self, expr, at):
        """The instant vector of `expr` at unix time `at`: [(labels, value)], through
        /api/v1/query."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": "%.3f" % at})
        status, body = http_get(url, timeout=10)
        assert status == 200, (expr, status, body, self.log_text()[-2000:])
        r = json.loads(body)
        assert r["status"] == "success", (expr, r)
        assert r["data"]["resultType"] == "vector", (expr, r["data"])
        return [(s["metric"], float(s["value"][1])) for s in r["data"]["result"]]

    def scalar(self, expr, at):
        """The one value of `expr` at `at` (None when the result is empty)."""
        res = self.query(expr, at)
        assert len(res) <= 1, (expr, res)
        return res[0][1] if res else None

    def wait_for(self, want, timeout=30.0):
        """Wait until every expression of `want` has its value in Prometheus; returns the time
        at which they all had."""
        end = time.time() + timeout
        while True:
            at = time.time()
            got = {e: self.scalar(e, at) for e in want}
            if got == want:
                return at
            if time.time() > end:
                raise AssertionError("Prometheus has %s, expected %s; its targets: %s\n%s"
                                     % (got, want, http_get(self.url + "/api/v1/targets")[1],
                                        self.log_text()[-2000:]))
            time.sleep(0.2)


def documented_queries():
    """The hallucination-rate query of docs/groundedness.md (section Metrics) and the related
    queries after it, as {comment or name: expression}."""
    text = (ROOT / "docs" / "groundedness.md").read_text()
    m = re.search(r"The \*\*hallucination rate\*\*.*?```\n(.*?)```.*?Related queries:\n\n```\n(.*?)```",
                  text, re.S)
    assert m, "docs/groundedness.md: the hallucination-rate query block and the related queries"
    queries = {"hallucination rate": " ".join(m.group(1).split())}
    name = None
    for line in m.group(2).splitlines():
        if line.startswith("#"):
            name = line.lstrip("# ").strip()
        elif line.strip():
            queries[name] = (queries.get(name, "") + " " + line.strip()).strip()
    return queries


def dashboard_queries():
    """Every target of deploy/grafana-dashboard.json as (panel title, refId, expr), with
    Grafana's $__rate_interval replaced by DASHBOARD_RATE_INTERVAL."""
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$__rate_interval", DASHBOARD_RATE_INTERVAL)
            assert "$" not in expr, ("a Grafana variable the test does not replace",
                                     panel["title"], expr)
            out.append((panel["title"], t["refId"], expr))
    return out


def test_hallucination_rate_and_dashboard_through_prometheus(tmp_path, model):
    started = time.time()
    cal = write_lookback_calibration(tmp_path / "lookback.grounding", model)
    queries = documented_queries()
    rate_expr = queries["hallucination rate"]
    assert rate_expr == ("sum(rate(diffrag_hallucination_flagged_requests_total[5m])) / "
                         "sum(rate(diffrag_grounding_checked_requests_total[5m]))"), rate_expr
    token_expr = queries["share of answer tokens in flagged windows (meaningful while every "
                         "answer is scored)"]
    panels = dashboard_queries()
    assert len(panels) >= 10, panels

    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal) as d:
        prom = Prometheus(tmp_path, d.metrics_url.removeprefix("http://"))
        try:
            prom.start()
            # scraped at 0 before any request: the rates' extrapolation starts from that sample
            zero_at = prom.wait_for({"diffrag_grounding_checked_requests_total": 0.0,
                                     "diffrag_hallucination_flagged_requests_total": 0.0})
            c = d.client()
            kinds = [(q, True) for q in GROUNDED] + [(q, False) for q in UNGROUNDED]
            # interleaved, so that neither kind comes all at once
            kinds = kinds[0::2] + kinds[1::2]
            replies = []
            for i, (q, grounded) in enumerate(kinds):
                _, r = c.call(query(q, [DOC], top_k=1, max_tokens=16, temperature=1.0, seed=i),
                              timeout=60)
                assert r["ok"], (q, r)
                placed = r["context"]["chunks_placed"]
                assert placed == (1 if grounded else 0), ("the question should %s the document"
                                                          % ("match" if grounded else "not match"),
                                                          q, r["context"])
                g = r["grounding"]
                assert g["detector"] == "lookback-only", g
                if not grounded and g["answer_tokens"]:
                    assert g["lookback_ratio"] == 0 and g["flagged"] is True, (q, g)
                replies.append((q, grounded, g))
            traffic_s = time.time() - zero_at
            scored = [g for _, _, g in replies if g["score"] is not None]
            flagged = [g for g in scored if g["flagged"]]
            assert flagged and len(flagged) < len(scored), \
                ("both kinds should occur", [(q, g["score"], g["flagged"]) for q, _, g in replies])
            share = len(flagged) / len(scored)
            answer_tokens = sum(g["answer_tokens"] for _, _, g in replies)
            flagged_tokens = sum(g["flagged_tokens"] for _, _, g in replies)
            print("%d answers, %d scored, %d flagged: share %.6f; tokens %d of %d flagged"
                  % (len(replies), len(scored), len(flagged), share, flagged_tokens, answer_tokens))

            at = prom.wait_for({"diffrag_grounding_checked_requests_total": float(len(scored)),
                                "diffrag_hallucination_flagged_requests_total": float(len(flagged)),
                                "diffrag_answer_tokens_total": float(answer_tokens),
                                "diffrag_hallucination_flagged_tokens_total": float(flagged_tokens)})

            # the documented hallucination rate is the share the replies say
            rate = prom.scalar(rate_expr, at)
            print("Prometheus: %s = %r (share sent %r)" % (rate_expr, rate, share))
            assert rate is not None and math.isclose(rate, share, rel_tol=1e-9, abs_tol=1e-12), \
                (rate_expr, rate, share, len(flagged), len(scored))
            tokens = prom.scalar(token_expr, at)
            assert tokens is not None and math.isclose(
                tokens, flagged_tokens / answer_tokens, rel_tol=1e-9, abs_tol=1e-12), \
                (token_expr, tokens, flagged_tokens, answer_tokens)
            for name, expr in queries.items():
                v = prom.scalar(expr, at)
                print("  docs %-40.40s %r" % (name, v))
                assert v is not None and math.isfinite(v), ("no data", name, expr, v)
            assert prom.scalar(queries["abstention rate among answered queries"], at) == 0

            # every dashboard query returns data for this traffic
            assert traffic_s < 50, ("the traffic took %.1f s: the dashboard's %s window would "
                                    "not cover it" % (traffic_s, DASHBOARD_RATE_INTERVAL))
            for title, ref, expr in panels:
                res = prom.query(expr, at)
                print("  panel %-45.45s %s: %s" % (title, ref, [v for _, v in res]))
                assert res, ("no data", title, ref, expr)
                assert all(math.isfinite(v) for _, v in res), ("not a number", title, ref, expr, res)
                if title == "Hallucination flag rate":
                    assert math.isclose(res[0][1], share, rel_tol=1e-9), (title, expr, res, share)
                if expr == "diffrag_hallucination_detector_info":
                    assert [(m["calibration"], m["threshold"], v) for m, v in res] == \
                        [("lookback-only", "0.5", 1.0)], res
        finally:
            prom.kill()
        assert "level=error" not in prom.log_text(), prom.log_text()[-3000:]
    print("test ran %.1f s" % (time.time() - started))
