"""Crash safety of the store: an ingesting `diffrag-store ingest --ack` process is killed with
SIGKILL at random moments, 50 times, over a store that starts with a 1 MiB map (so growth
happens under fire too). After each kill the store must open, `verify` must pass, every
document whose ingest was acknowledged (the ingester prints `ack "ID"` only after the commit
returned) must be present with exactly its text, and no document may be visible in a state that
was never written whole."""
import json
import os
import random
import signal
import subprocess
import time

KILLS = 50
N_IDS = 400
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega river mountain harbour castle meadow lantern copper "
         "violet thunder orchard glacier").split()


def make_corpus(rng, n_records):
    """Records (id, version, title, text) in ingest order; ids repeat with new versions."""
    recs = []
    for seq in range(n_records):
        doc = rng.randrange(N_IDS)
        n_sent = rng.choice((2, 5, 10, 40, 120))
        sents = []
        for _ in range(n_sent):
            words = [rng.choice(WORDS) for _ in range(rng.randrange(4, 18))]
            sents.append(" ".join(words).capitalize() + ".")
        text = f"Version {seq} of document {doc}. " + " ".join(sents)
        recs.append({"id": f"doc-{doc:04d}", "version": seq, "title": f"Doc {doc} v{seq}", "text": text})
    return recs


def test_sigkill_during_ingest(build_dir, root, tmp_path):
    store = str(build_dir / "diffrag-store")
    data = str(tmp_path / "store")
    rng = random.Random(20240611)
    corpus = make_corpus(rng, 6000)
    by_version = {r["version"]: r for r in corpus}
    text_to_version = {(r["id"], r["text"]): r["version"] for r in corpus}
    # allowed[id]: the versions the document may show (None = absent).
    allowed = {f"doc-{i:04d}": {None} for i in range(N_IDS)}
    base = [store, "--data-dir", data, "-c", "crash", "--map-size", "1"]
    totals = {"acked": 0, "kills_mid_batch": 0, "verify_s": 0.0, "docs_max": 0}
    t_start = time.time()
    for it in range(KILLS):
        start = rng.randrange(0, len(corpus) - 400)
        batch = rng.choice((1, 2, 3, 5, 8))
        chunk_tokens = rng.choice((32, 64, 256)) if it == 0 else 256
        feed = corpus[start:start + 400]
        path = tmp_path / f"feed{it}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for r in feed:
                f.write(json.dumps({"id": r["id"], "title": r["title"], "text": r["text"]}) + "\n")
        proc = subprocess.Popen(base + ["--approx-tokens", "--chunk-tokens", str(chunk_tokens),
                                        "ingest", "--ack", "--batch-docs", str(batch), str(path)],
                                cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.01, 0.6))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL or proc.returncode == 0, proc.returncode
        # Complete ack lines only (the kill may cut the last one).
        acked = []
        for line in out.decode("utf-8", "replace").split("\n")[:-1]:
            assert line.startswith("ack ")
            acked.append(json.loads(line[4:]))
        totals["acked"] += len(acked)
        # Acks arrive in feed order: match them to feed positions.
        pos = 0
        for doc_id in acked:
            while feed[pos]["id"] != doc_id:
                pos += 1
            allowed[doc_id] = {feed[pos]["version"]}
            pos += 1
        # The batch after the last ack may have committed without its acks being printed.
        window = feed[pos:pos + batch]
        for r in window:
            allowed[r["id"]] = allowed[r["id"]] | {r["version"]}

        t0 = time.time()
        v = subprocess.run(base + ["verify"], cwd=root, capture_output=True, text=True, timeout=120)
        totals["verify_s"] += time.time() - t0
        assert v.returncode == 0, f"kill {it}: verify failed:\n{v.stdout}\n{v.stderr}"
        e = subprocess.run(base + ["export"], cwd=root, capture_output=True, text=True, timeout=120)
        if "unknown collection" in e.stderr:
            visible = {}
        else:
            assert e.returncode == 0, e.stderr
            visible = {}
            for line in e.stdout.splitlines():
                d = json.loads(line)
                ver = text_to_version.get((d["id"], d["text"]))
                assert ver is not None, f"kill {it}: {d['id']} holds text that was never written whole"
                assert d["title"] == by_version[ver]["title"], f"kill {it}: {d['id']} title/text mismatch"
                visible[d["id"]] = ver
        totals["docs_max"] = max(totals["docs_max"], len(visible))
        # Kills that landed after a commit but before its acks were printed.
        if any(visible.get(r["id"]) == r["version"] and r["version"] not in
               {feed[i]["version"] for i in range(pos)} for r in window):
            totals["kills_mid_batch"] += 1
        for doc_id, vers in allowed.items():
            seen = visible.get(doc_id)
            assert seen in vers, (f"kill {it}: {doc_id} shows version {seen}, allowed {sorted(vers, key=str)}"
                                  f" (acked documents must be present and whole)")
            allowed[doc_id] = {seen}
    elapsed = time.time() - t_start
    stats = subprocess.run(base + ["stats", "--json"], cwd=root, capture_output=True, text=True, timeout=60)
    st = json.loads(stats.stdout) if stats.returncode == 0 else {}
    print(f"\n{KILLS} SIGKILLs in {elapsed:.1f} s: {totals['acked']} acknowledged documents checked, "
          f"{totals['kills_mid_batch']} kills between a commit and its acks, verify {totals['verify_s']:.1f} s in all; "
          f"final store {st.get('docs')} docs, {st.get('chunks')} chunks, map {st.get('map_bytes')} bytes")
    assert totals["acked"] > 1000, "too few acknowledged documents: the kills came too early"
    assert st.get("map_bytes", 0) > (1 << 20), "the map never grew"
