"""A PEP 517 / PEP 660 build backend for the diffrag package using only the Python standard
library: `pip install clients/python` then needs no build tools from a package index (a pure
Python package needs nothing more than zipping its files and writing its metadata)."""
import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "diffrag"
TAG = "py3-none-any"
EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same sources make the same wheel


def _project():
    """[project] of pyproject.toml (tomllib from 3.11; a reader of the few keys used here
    before it)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = f.read()
    try:
        import tomllib
        return tomllib.loads(data.decode())["project"]
    except ImportError:
        text = data.decode().split("[project]", 1)[1]
        p = dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]*)"', text, re.M))
        deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S)
        p["dependencies"] = re.findall(r'"([^"]+)"', deps.group(1)) if deps else []
        return p


def _dist_info(p):
    return "%s-%s.dist-info" % (p["name"], p["version"])


def _metadata(p):
    lines = ["Metadata-Version: 2.1", "Name: " + p["name"], "Version: " + p["version"],
             "Summary: " + p.get("description", "")]
    if p.get("requires-python"):
        lines.append("Requires-Python: " + p["requires-python"])
    lines += ["Requires-Dist: " + d for d in p.get("dependencies", [])]
    lines += ["Classifier: " + c for c in p.get("classifiers", [])]
    body = ""
    if p.get("readme"):
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(ROOT, p["readme"]), encoding="utf-8") as f:
            body = "\n" + f.read()
    return ("\n".join(lines) + "\n" + body).encode("utf-8")


def _dist_files(p):
    """(archive name, bytes) of the dist-info files other than RECORD."""
    di = _dist_info(p)
    wheel = "Wheel-Version: 1.0\nGenerator: diffrag build_backend\nRoot-Is-Purelib: true\nTag: %s\n" % TAG
    return [(di + "/METADATA", _metadata(p)), (di + "/WHEEL", wheel.encode()),
            (di + "/top_level.txt", (PACKAGE + "\n").encode())]


def _package_files():
    out = []
    pkg = os.path.join(ROOT, PACKAGE)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py") or name == "py.typed":
            with open(os.path.join(pkg, name), "rb") as f:
                out.append((PACKAGE + "/" + name, f.read()))
    return out


def _write_wheel(directory, files):
    p = _project()
    name = "%s-%s-%s.whl" % (p["name"], p["version"], TAG)
    files = files + _dist_files(p)
    record = []
    with zipfile.ZipFile(os.path.join(directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files:
            z.writestr(zipfile.ZipInfo(arc, EPOCH), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append("%s,sha256=%s,%d" % (arc, digest.decode(), len(data)))
        rec = _dist_info(p) + "/RECORD"
        record.append(rec + ",,")
        z.writestr(zipfile.ZipInfo(rec, EPOCH), ("\n".join(record) + "\n").encode())
    return name


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    p = _project()
    for arc, data in _dist_files(p):
        path = os.path.join(metadata_directory, arc)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return _dist_info(p)


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, _package_files())


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """A wheel whose .pth file puts this source folder on sys.path."""
    return _write_wheel(wheel_directory, [("%s.pth" % PACKAGE, (ROOT + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    p = _project()
    base = "%s-%s" % (p["name"], p["version"])
    name = base + ".tar.gz"
    files = [("pyproject.toml", None), ("build_backend.py", None), ("README.md", None)]
    files += [(arc, None) for arc, _ in _package_files()]
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        for arc, _ in files:
            t.add(os.path.join(ROOT, arc), arcname=base + "/" + arc)
        info = tarfile.TarInfo(base + "/PKG-INFO")
        meta = _metadata(p)
        info.size = len(meta)
        t.addfile(info, io.BytesIO(meta))
    return name
