"""Helpers for the fault suites: the store CLI on a daemon's data directory, tmpfs mounts, and a
supervised daemon restarted after each kill."""
import json
import os
import subprocess
import time

from conftest import BUILD, ROOT

STORE = BUILD / "diffrag-store"


def store_cli(data_dir, coll, *args, timeout=120):
    return subprocess.run([str(STORE), "--data-dir", str(data_dir), "-c", coll, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def store_verify(data_dir, coll):
    """Runs `diffrag-store verify`; returns its output, failing on a non-zero exit."""
    r = store_cli(data_dir, coll, "verify")
    assert r.returncode == 0, "store verify failed:\n%s\n%s" % (r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout


def store_export(data_dir, coll):
    """{id: (title, text)} of a collection as the store CLI reads it ({} when it does not
    exist yet)."""
    r = store_cli(data_dir, coll, "export")
    if r.returncode != 0 and "unknown collection" in r.stderr:
        return {}
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        d = json.loads(line)
        out[d["id"]] = (d["title"], d["text"])
    return out


def can_mount():
    """Whether this process may mount a tmpfs (root without a restricting sandbox)."""
    return os.geteuid() == 0


def mount_tmpfs(path, size, readonly=False):
    """Mounts a tmpfs of `size` (mount(8) syntax) on path; returns None, or why it could not."""
    path.mkdir(parents=True, exist_ok=True)
    opts = "size=%s%s" % (size, ",ro" if readonly else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return "mount -t tmpfs -o %s failed: %s" % (opts, (r.stderr or r.stdout).strip())
    return None


def remount(path, opts):
    r = subprocess.run(["mount", "-o", "remount," + opts, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def umount(path):
    for _ in range(50):
        r = subprocess.run(["umount", str(path)], capture_output=True, text=True)
        if r.returncode == 0:
            return
        time.sleep(0.1)   # a process that just died may still hold a file open
    raise AssertionError("cannot unmount %s: %s" % (path, r.stderr))


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
