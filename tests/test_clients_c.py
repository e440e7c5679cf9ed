"""libdiffrag (clients/c) end to end: build/tests/test_client_c against a live diffragd on
loopback (every call, streaming, cancel, server errors), the same binary and its fake-server
mode (malformed replies, timeouts, connection failure) under valgrind memcheck with no leak
and no error, the timeout against a real diffragd that never answers (no worker), the C
example, and `make install-clients` into a staging directory: the files, the exported
symbols, and the example built against the installed library through pkg-config, shared and
static."""
import os
import re
import subprocess
import time

import pytest

from conftest import BUILD, ROOT, run_make
from daemon_util import Daemon, free_port
from test_clients_python import diffrag, tiny_model

VALGRIND_BUILD = "build/valgrind"
VALGRIND = ["valgrind", "-q", "--leak-check=full", "--show-leak-kinds=definite,indirect,possible",
            "--errors-for-leak-kinds=definite,indirect,possible", "--error-exitcode=99"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("cclient"), tiny_model(tmp_path_factory), workers=2)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def run(argv, timeout=300, **kw):
    r = subprocess.run([str(a) for a in argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, **kw)
    print(r.stdout[-6000:])
    print(r.stderr[-6000:])
    return r


def test_c_client_against_the_daemon(daemon):
    r = run([BUILD / "tests" / "test_client_c", "--endpoint", daemon.endpoint])
    assert r.returncode == 0
    m = re.search(r"(\d+) checks, 0 failed", r.stdout)
    assert m and int(m.group(1)) >= 20, r.stdout


@pytest.fixture(scope="module")
def valgrind_build():
    # valgrind does not know every instruction -march=native may emit (AVX-512): the flags of
    # test_valgrind_units.py, which builds in the same tree
    r = run_make(["make", "-s", "-j2", f"BUILD={VALGRIND_BUILD}", "ARCH=-march=x86-64-v3", "OPT=-O1",
                  f"{VALGRIND_BUILD}/tests/test_client_c"], cwd=ROOT, capture_output=True,
                 text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return ROOT / VALGRIND_BUILD


def test_c_client_under_valgrind_fake_server(valgrind_build):
    r = run(VALGRIND + [valgrind_build / "tests" / "test_client_c"])
    assert r.returncode == 0, "valgrind or the test failed"
    assert "0 failed" in r.stdout and "==" not in r.stderr, r.stderr[-3000:]


def test_c_client_under_valgrind_live(valgrind_build, daemon):
    r = run(VALGRIND + [valgrind_build / "tests" / "test_client_c", "--endpoint", daemon.endpoint])
    assert r.returncode == 0, "valgrind or the test failed"
    assert "0 failed" in r.stdout and "==" not in r.stderr, r.stderr[-3000:]


def test_timeout_against_a_daemon_that_does_not_answer(tmp_path_factory):
    """A real diffragd that accepts queries and never answers them (no worker joins): the
    client gives up after its timeout with DIFFRAG_ETIMEOUT (the CLI's exit 4; Python's
    Timeout), while ping, answered by the socket loop, still works."""
    d = Daemon(tmp_path_factory.mktemp("noworker"), tiny_model(tmp_path_factory), workers=0,
               worker_listen="tcp://127.0.0.1:%d" % free_port(), drain_timeout=1)
    d.start(wait_ready=False)  # /readyz stays 503 without a worker
    try:
        cli = [BUILD / "diffrag", "-e", d.endpoint]
        deadline = time.time() + 30
        while run(cli + ["ping"]).returncode != 0:
            assert time.time() < deadline, d.log_text()[-2000:]
        t0 = time.time()
        r = run(cli + ["--timeout", "0.5", "ask", "-d", "examples/sample-paragraph.txt", "q"])
        waited = time.time() - t0
        assert r.returncode == 4 and "no reply from %s within 500 ms" % d.endpoint in r.stderr
        assert 0.5 <= waited < 3, waited
        with diffrag.Client(d.endpoint, query_timeout=0.5) as c:
            t0 = time.time()
            with pytest.raises(diffrag.Timeout):
                c.query("q", docs=["some text"])
            assert 0.5 <= time.time() - t0 < 3
            assert c.ping().version
        print("gave up after %.2f s (timeout 0.5 s)" % waited)
        assert d.stop() == 0
    finally:
        d.__exit__(None, None, None)


def test_c_example(daemon):
    r = run([BUILD / "examples" / "ask_folder", daemon.endpoint, "examples",
             "How long is the Rhine?"], timeout=120)
    assert r.returncode == 0
    assert 'stored 1 documents in the collection "examples" (created if it was not there)' in r.stdout
    assert "sample-paragraph.txt" in r.stdout.split("sources:")[1]


def test_install_and_pkg_config(tmp_path, daemon):
    stage = tmp_path / "stage"
    r = run(["make", "-s", "install-clients", f"DESTDIR={stage}", "PREFIX=/opt/diffrag"])
    assert r.returncode == 0
    pre = stage / "opt" / "diffrag"
    for f in ("include/diffrag.h", "lib/libdiffrag.a", "lib/libdiffrag.so.0.1.0",
              "lib/pkgconfig/diffrag.pc", "bin/diffrag"):
        assert (pre / f).is_file(), f
    assert os.readlink(pre / "lib" / "libdiffrag.so") == "libdiffrag.so.0"
    assert os.readlink(pre / "lib" / "libdiffrag.so.0") == "libdiffrag.so.0.1.0"
    pc = (pre / "lib" / "pkgconfig" / "diffrag.pc").read_text()
    assert "prefix=/opt/diffrag" in pc and "Version: 0.1.0" in pc and "@" not in pc
    # only the API leaves the shared library, and only the API is global in the archive
    dyn = run(["nm", "-D", "--defined-only", pre / "lib" / "libdiffrag.so.0.1.0"]).stdout.split()
    exported = [s for s in dyn if re.fullmatch(r"[A-Za-z_]\w*", s) and len(s) > 1]
    assert exported and all(s.startswith("diffrag_") for s in exported), exported
    glob = [ln.split()[-1] for ln in run(["nm", "-g", "--defined-only",
                                          pre / "lib" / "libdiffrag.a"]).stdout.splitlines()
            if re.search(r" [TDBR] ", ln)]
    assert glob and all(s.startswith("diffrag_") for s in glob), glob
    header_api = set(re.findall(r"DIFFRAG_API [^;]*?\b(diffrag_\w+)\(",
                                (ROOT / "clients/c/diffrag.h").read_text()))
    assert header_api == set(exported), header_api ^ set(exported)
    print("exported:", len(exported), "functions")
    env = dict(os.environ, PKG_CONFIG_PATH=str(pre / "lib" / "pkgconfig"),
               PKG_CONFIG_SYSROOT_DIR=str(stage))
    flags = run(["pkg-config", "--cflags", "--libs", "diffrag"], env=env).stdout.split()
    assert f"-I{pre}/include" in flags and f"-L{pre}/lib" in flags and "-ldiffrag" in flags, flags
    shared = tmp_path / "ask_shared"
    r = run(["cc", "-std=c11", "-Wall", "-Werror", "examples/ask_folder.c", "-o", shared] + flags,
            env=env)
    assert r.returncode == 0
    static_flags = run(["pkg-config", "--static", "--libs", "diffrag"], env=env).stdout.split()
    static = tmp_path / "ask_static"
    r = run(["cc", "-std=c11", "-Wall", "-Werror", "examples/ask_folder.c", "-o", static,
             f"-I{pre}/include", str(pre / "lib" / "libdiffrag.a")] +
            [f for f in static_flags if f not in ("-ldiffrag",) and not f.startswith("-L")])
    assert r.returncode == 0
    for exe, env2 in ((shared, dict(os.environ, LD_LIBRARY_PATH=str(pre / "lib"))),
                      (static, dict(os.environ))):
        r = run([exe, daemon.endpoint, "examples", "Where does the Rhine flow?"], env=env2)
        assert r.returncode == 0 and "sources:" in r.stdout
    deps = run(["ldd", shared], env=dict(os.environ, LD_LIBRARY_PATH=str(pre / "lib"))).stdout
    assert str(pre / "lib" / "libdiffrag.so.0") in deps
    r = run([pre / "bin" / "diffrag", "-e", daemon.endpoint, "ping"])
    assert r.returncode == 0 and r.stdout.startswith("pong from")
