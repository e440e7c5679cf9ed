"""Configuration values that used to slip through: --check-config refuses what start-up would
refuse (ports past 65535, fractional byte sizes, a budget or watched heads the model cannot
have, host names ZeroMQ cannot bind), the listen forms that bind (localhost, [::1], an interface
name), loopback judged by the address (lo is loopback; metrics on 0.0.0.0 warn), and a SIGHUP
that names a model start-up could not load is refused."""
import signal
import socket
import subprocess
import time

import pytest
import zmq

from daemon_util import DIFFRAGD, Daemon, fast_model, query

DOCS = [{"id": "a", "text": "The Rhine is a European river about 1,230 km long."},
        {"id": "b", "text": "Paris is the capital of France."},
        {"id": "c", "text": "Oxygen has atomic number 8."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fast_model(tmp_path_factory.mktemp("models"))


def check(model, *args):
    p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(model),
                        "--check-config", *map(str, args)], capture_output=True, text=True,
                       timeout=60)
    print(args, p.returncode, p.stdout.strip(), p.stderr.strip())
    return p


def has_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# (arguments, exit status, what stderr says); the tiny model has 2 layers of 4 heads
REFUSED = [
    (("--listen", "tcp://127.0.0.1:99999"), 2, 'listen: port "99999"'),
    (("--listen", "tcp://127.0.0.1:0"), 2, "is not 1..65535"),
    (("--listen", "tcp://127.0.0.1:*"), 2, "is not 1..65535"),
    (("--listen", "tcp://no-such-host.invalid:7400"), 2, "not host names"),
    (("--listen", "tcp://::1:7400"), 2, "in brackets"),
    (("--listen", "tcp://192.0.2.254:7400"), 2, "is not an address of this machine"),
    (("--worker-listen", "tcp://127.0.0.1:65536"), 2, "worker_listen: port"),
    (("--metrics-listen", "127.0.0.1:99999"), 2, "metrics_listen: port"),
    (("--metrics-listen", "127.0.0.1:0"), 2, "metrics_listen: port"),
    (("--metrics-listen", "metrics.example:9400"), 2, "is not an IP address"),
    (("--http-listen", "127.0.0.1:0"), 2, "http_listen: port"),
    (("--http-listen", "api.example:7480"), 2, "is not an IP address"),
    (("--http-listen", "0.0.0.0:7480"), 2, "is not on loopback: set http_api_key_file"),
    (("--http-tls-cert-file", "/dev/null"), 2, "http_tls_cert_file and http_tls_key_file go together"),
    (("--http-timeout", "0"), 2, "http_timeout"),
    (("--worker", "--connect", "tcp://broker.example:70000"), 2, "connect: port"),
    (("--max-question-bytes", "1.5"), 2, 'max_question_bytes: "1.5" is not a whole number'),
    (("--max-message-bytes", "1.1k"), 2, "not a whole number of bytes"),
    (("--kv-budget-bytes", "1.5"), 2, "kv_budget_bytes"),
    (("--kv-budget-bytes", "1"), 1, "kv_budget_bytes 1 holds a context of"),
    (("--kv-budget-bytes", "64KiB", "--max-context-tokens", "2048"), 1, "do not fit"),
    (("--grounding-heads", "99:99"), 1, "grounding_heads: 99:99 is outside the model"),
    (("--grounding-heads", "0:0,1:4"), 1, "1:4 is outside the model (2 layers of 4 heads"),
]


@pytest.mark.parametrize("args,rc,needle", REFUSED, ids=[" ".join(a) for a, _, _ in REFUSED])
def test_check_config_refuses(model, args, rc, needle):
    p = check(model, *args)
    assert p.returncode == rc and needle in p.stderr, (p.returncode, p.stderr)


def test_check_config_accepts(model):
    ok = [("--max-question-bytes", "1.5k"), ("--listen", "tcp://localhost:7400"),
          ("--listen", "tcp://lo:7400"), ("--listen", "tcp://*:7400"),
          ("--listen", "tcp://[::]:7400"), ("--grounding-heads", "1:3"),
          ("--kv-budget-bytes", "64MiB"), ("--metrics-listen", "localhost:9400"),
          ("--http-listen", "0.0.0.0:7480", "--http-allow-remote", "1"), ("--http-listen", ""),
          ("--worker", "--connect", "tcp://broker.example:7401")]
    for args in ok:
        p = check(model, *args)
        assert p.returncode == 0 and "configuration ok" in p.stdout, (args, p.stderr)
    # localhost is bound as 127.0.0.1 (ZeroMQ takes addresses and interface names only)
    p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--print-config", "--listen",
                        "tcp://localhost:7400"], capture_output=True, text=True, timeout=60)
    assert "listen = tcp://127.0.0.1:7400" in p.stdout, p.stdout


def ping(ctx, endpoint, ipv6=False):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if ipv6:
        s.setsockopt(zmq.IPV6, 1)
    s.connect(endpoint)
    s.send(b"\x82\xa1v\x01\xa2op\xa4ping")   # msgpack {"v": 1, "op": "ping"}
    ok = s.poll(10000)
    s.close()
    return bool(ok)


def serve(tmp_path, model, listen, metrics_host="127.0.0.1"):
    """A daemon whose listen endpoint is `listen` % port; metrics on metrics_host."""
    d = Daemon(tmp_path, model, workers=1)
    d.argv[d.argv.index("--listen") + 1] = listen % d.port
    d.argv[d.argv.index("--metrics_listen") + 1] = "%s:%d" % (metrics_host, d.metrics_port)
    return d


@pytest.mark.parametrize("form", ["tcp://localhost:%d", "tcp://lo:%d", "tcp://[::1]:%d"])
def test_listen_forms_bind_and_count_as_loopback(tmp_path, model, form):
    if "::1" in form and not has_ipv6_loopback():
        pytest.skip("no IPv6 on the loopback interface")
    d = serve(tmp_path, model, form)
    with d:
        ctx = zmq.Context()
        try:
            target = "tcp://[::1]:%d" if "::1" in form else "tcp://127.0.0.1:%d"
            assert ping(ctx, target % d.port, ipv6="::1" in form), d.log_text()[-1500:]
        finally:
            ctx.term()
        log = d.log_text()
        assert "neither authenticated nor encrypted" not in log, log[-1500:]
        assert "metrics on" not in log
        assert d.stop() == 0


def test_any_address_warns_for_clients_and_metrics(tmp_path, model):
    d = serve(tmp_path, model, "tcp://[::]:%d", metrics_host="0.0.0.0")
    if not has_ipv6_loopback():
        d.argv[d.argv.index("--listen") + 1] = "tcp://*:%d" % d.port
    with d:
        ctx = zmq.Context()
        try:
            assert ping(ctx, "tcp://127.0.0.1:%d" % d.port), d.log_text()[-1500:]
        finally:
            ctx.term()
        log = d.log_text()
        assert "are neither authenticated nor encrypted" in log, log[-1500:]
        assert "metrics on 0.0.0.0:%d are served to anyone" % d.metrics_port in log, log[-1500:]
        assert d.stop() == 0


def test_reload_refuses_a_model_that_would_not_start(tmp_path, model):
    conf = tmp_path / "d.conf"
    conf.write_text("model = %s\nmax_docs = 8\n" % model)
    d = Daemon(tmp_path, model, workers=1)
    i = d.argv.index("--model")
    del d.argv[i:i + 2]                      # the model comes from the file
    d.argv[d.argv.index("/dev/null")] = str(conf)
    with d:
        c = d.client()
        _, r = c.call(query("capital?", DOCS, id="before", max_tokens=2), timeout=60)
        assert r["ok"], r
        conf.write_text("model = /nonexistent/model.gguf\nmax_docs = 2\n")
        d.send_signal(signal.SIGHUP)
        end = time.time() + 10
        while time.time() < end and "reload failed" not in d.log_text():
            time.sleep(0.05)
        log = d.log_text()
        assert "reload failed" in log and "/nonexistent/model.gguf" in log, log[-1500:]
        assert "configuration reloaded" not in log, log[-1500:]
        # nothing of the refused file applies: max_docs is still 8, the old model still serves
        _, r = c.call(query("capital?", DOCS, id="after", max_tokens=2), timeout=60)
        assert r["ok"], r
        # grounding_heads naming heads the model lacks is refused the same way
        conf.write_text("model = %s\nmax_docs = 2\ngrounding_heads = 5:0\n" % model)
        n = d.log_text().count("reload failed")
        d.send_signal(signal.SIGHUP)
        end = time.time() + 10
        while time.time() < end and d.log_text().count("reload failed") == n:
            time.sleep(0.05)
        assert "grounding_heads: 5:0 is outside the model" in d.log_text(), d.log_text()[-1500:]
        # a good file reloads
        conf.write_text("model = %s\nmax_docs = 2\n" % model)
        d.send_signal(signal.SIGHUP)
        end = time.time() + 10
        while time.time() < end and "configuration reloaded" not in d.log_text():
            time.sleep(0.05)
        assert 'changed="max_docs"' in d.log_text(), d.log_text()[-1500:]
        assert d.stop() == 0
