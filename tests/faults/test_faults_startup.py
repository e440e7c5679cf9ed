"""Faults that must stop diffragd before it reports ready: the model file missing, truncated or
garbage; the client, worker or metrics port in use; the data directory unusable (a file where
the directory should be, a read-only filesystem, empty or holding a store). Each start must
exit non-zero within seconds, log one clear error line naming the cause, and never send
READY=1 to the service manager (a NOTIFY_SOCKET the test listens on)."""
import os
import socket
import subprocess
import time

import pytest

from daemon_util import DIFFRAGD, Daemon, fast_model, free_port
from faults_util import can_mount, mount_tmpfs, remount, umount
from test_daemon_systemd import NotifyListener


def start_fails(tmp_path, model, expect, notify_name="n.sock", **keys):
    """Starts diffragd with keys, expects a non-zero exit, an error line containing each of
    `expect` and no READY=1; returns (exit status, seconds, error line)."""
    listener = NotifyListener(tmp_path / notify_name)
    d = Daemon(tmp_path, model, workers=1, threads=1,
               env={"NOTIFY_SOCKET": str(tmp_path / notify_name)}, **keys)
    try:
        t0 = time.time()
        d.start(wait_ready=False)
        try:
            rc = d.proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError("diffragd kept running:\n" + d.log_text()[-2000:])
        took = time.time() - t0
        time.sleep(0.1)   # let the listener read what was sent
        log = d.log_text()
        errors = [l for l in log.splitlines() if "level=error" in l]
        assert rc != 0, log
        assert errors, "no error line:\n" + log
        for e in expect:
            assert any(e in l for l in errors), "no error naming %r:\n%s" % (e, log)
        sent = [m for _, m in listener.msgs]
        assert not any("READY=1" in m for m in sent), sent
        return rc, took, errors[0]
    finally:
        d.__exit__(None, None, None)
        listener.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fast_model(tmp_path_factory.mktemp("models"))


def report(what, res):
    rc, took, line = res
    print("%-34s exit %d after %.2f s: %s" % (what, rc, took, line.split("level=error ", 1)[-1]))


def test_model_missing_or_corrupt(tmp_path, model):
    report("model missing", start_fails(tmp_path, tmp_path / "absent.gguf",
                                        ["cannot load the model", "No such file"], "a.sock"))
    data = model.read_bytes()
    trunc = tmp_path / "truncated.gguf"
    trunc.write_bytes(data[:len(data) // 3])
    report("model truncated", start_fails(tmp_path, trunc, ["cannot load the model", "truncated"],
                                          "b.sock"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    report("model garbage", start_fails(tmp_path, garbage, ["cannot load the model"], "c.sock"))
    # a valid header whose tensor data was cut off
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    report("model tensor data cut", start_fails(tmp_path, cut, ["cannot load the model"], "d.sock"))


def test_port_in_use(tmp_path, model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        report("client port in use", start_fails(
            tmp_path, model, ["cannot start the broker", "Address already in use"], "a.sock",
            listen="tcp://127.0.0.1:%d" % port))
        report("worker port in use", start_fails(
            tmp_path, model, ["cannot listen for workers", "Address already in use"], "b.sock",
            worker_listen="tcp://127.0.0.1:%d" % port))
        report("metrics port in use", start_fails(
            tmp_path, model, ["cannot serve metrics", "127.0.0.1:%d: Address already in use" % port],
            "c.sock",
            metrics_listen="127.0.0.1:%d" % port))
        report("HTTP API port in use", start_fails(
            tmp_path, model, ["cannot serve the HTTP API", "127.0.0.1:%d: Address already in use"
                              % port], "d.sock", http_listen="127.0.0.1:%d" % port))


def test_data_dir_unusable(tmp_path, model):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the data directory should be\n")
    report("data_dir is a file", start_fails(tmp_path, model, ["cannot open the store",
                                                                "Not a directory"], "a.sock",
                                             data_dir=blocker))
    report("data_dir below a file", start_fails(tmp_path, model, ["cannot open the store"],
                                                "b.sock", data_dir=blocker / "store"))
    if not can_mount():
        pytest.skip("not root: cannot mount a read-only filesystem for the remaining cases")
    ro = tmp_path / "ro"
    why = mount_tmpfs(ro, "4m")
    if why:
        pytest.skip(why)
    try:
        # a store created while writable, then the filesystem turned read-only
        d = Daemon(tmp_path, model, workers=1, threads=1, data_dir=ro / "store")
        with d:
            _, r = d.client().call({"v": 1, "op": "ingest", "collection": "c",
                                    "docs": [{"id": "a", "text": "kept"}]})
            assert r["ok"], r
            assert d.stop() == 0
        remount(ro, "ro")
        report("data_dir read-only, holds a store", start_fails(
            tmp_path, model, ["cannot open the store", "Read-only file system"], "c.sock",
            data_dir=ro / "store"))
        report("data_dir read-only, to be created", start_fails(
            tmp_path, model, ["cannot open the store", "Read-only file system"], "d.sock",
            data_dir=ro / "fresh"))
    finally:
        umount(ro)


def test_worker_mode_model_missing(tmp_path):
    """`diffragd --worker` with no model file exits non-zero with the cause, never READY=1."""
    listener = NotifyListener(tmp_path / "w.sock")
    log = open(tmp_path / "w.log", "wb")
    p = subprocess.Popen([str(DIFFRAGD), "--config", "/dev/null", "--worker", "--connect",
                          "tcp://127.0.0.1:%d" % free_port(), "--model", str(tmp_path / "none.gguf")],
                         stdout=log, stderr=subprocess.STDOUT,
                         env=dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "w.sock")))
    try:
        assert p.wait(30) != 0
        time.sleep(0.1)
        assert not any("READY=1" in m for _, m in listener.msgs), listener.msgs
    finally:
        listener.close()
        log.close()
    assert "cannot load the model" in (tmp_path / "w.log").read_text()
