"""The OpenAI-compatible HTTP API against hostile or careless clients (docs/openai.md#security):

- refusals are logged at most once a second, with the count of those held back."""
import http.client
import re
import time

import pytest

from daemon_util import Daemon, fast_model

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fast_model(tmp_path_factory.mktemp("models"))


# ---- the log under a flood of refusals ----

def test_refusals_are_logged_at_most_once_a_second(tmp_path, model):
    keys = tmp_path / "api.keys"
    keys.write_text("the-key\n")
    keys.chmod(0o600)
    d = Daemon(tmp_path, model, workers=1, threads=1, http_api_key_file=keys, log_level="debug")
    with d:
        c = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=10)
        t0, n = time.time(), 0
        while time.time() - t0 < 1.5:
            c.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
            r = c.getresponse()
            r.read()
            assert r.status == 401
            n += 1
        for _ in range(50):   # other refusals too: bad bodies
            c.request("POST", CHAT, b"{not json", {"Authorization": "Bearer the-key"})
            r = c.getresponse()
            r.read()
            assert r.status == 400
            n += 1
        time.sleep(1.1)
        c.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        c.getresponse().read()
        n += 1
        took = time.time() - t0
        c.close()
        time.sleep(0.2)
        lines = [l for l in d.log_text().splitlines() if "http request refused" in l]
        print("%d refusals in %.1f s: %d log lines; the last: %s" % (n, took, len(lines),
                                                                    lines[-1] if lines else None))
        assert n > 100 and 2 <= len(lines) <= took + 2, len(lines)
        held = sum(int(m) for m in re.findall(r"suppressed_since_last=(\d+)", "\n".join(lines)))
        assert held + len(lines) == n, (held, len(lines), n)
        assert d.metric("diffrag_http_requests_total", endpoint="models", status="401") >= n - 50
        assert d.stop() == 0, d.log_text()[-2000:]
