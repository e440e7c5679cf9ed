#!/usr/bin/env python3
"""Needle in a haystack: does the model read the whole context? A synthetic fact (the needle) is
put at several depths of a haystack of SQuAD 2.0 paragraphs (dev, CC BY-SA 4.0) that fills a
prompt of 4K, 8K, 16K or 32K tokens, and the question asks for it; recall is the share of
answers that contain the needle's value.

The haystack goes through diffragd as one inline document of the request, with a
max_context_tokens that covers it: the daemon's own prompt (frame, instruction, "[1] Title",
question), chunking and context assembly, as a user's long document meets them. The haystack is
one paragraph (passages joined by single line breaks) and the daemon runs with chunk_tokens
65536 and top_k 1, so it is one chunk, placed whole where the tool put the needle; every reply
is checked for that (one citation, not truncated, covering the whole document), so a
haystack that was cut or reordered stops the run instead of counting as a miss. A haystack
longer than a chunk can be (65,536 tokens: the 128K size) goes to build/diffrag-run with the
same prompt (--chat --system, the instruction taken from retriever/prompt.c).

  tools/eval-longctx.py                      4K..32K, Qwen2.5-Coder-0.5B-Instruct, table on stdout
  tools/eval-longctx.py --yarn               and 64K, 128K with YaRN (factor 4 over 32,768)
  tools/eval-longctx.py --sizes 4096 --per-depth 1 --model models/SmolLM2-135M-Instruct.Q4_1.gguf

Needles, names, values and haystacks are drawn from fixed seeds: a rerun asks the same cases.
"""
import argparse
import json
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import eval_common as ec  # noqa: E402

DEFAULT_SIZES = (4096, 8192, 16384, 32768)
YARN_SIZES = (65536, 131072)
YARN_ARGS = {"rope_scaling": "yarn", "rope_factor": 4, "rope_orig_ctx": 32768}
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
CHUNK_MAX = 65536        # the chunker's largest chunk (retriever/chunker.h CHUNK_MAX_TOKENS)
MAX_TOKENS = 32          # generated tokens per answer: the value comes in the first few
TITLE = "Collected notes"
SEED = 20240617

# A fact unlikely to be in Wikipedia paragraphs, and its question. Names are invented words
# checked absent from the passages; values are five-digit numbers.
TEMPLATES = [
    ("The access code for the {name} archive is {value}.",
     "What is the access code for the {name} archive?"),
    ("The {name} expedition stored its samples in crate number {value}.",
     "In which crate number did the {name} expedition store its samples?"),
    ("The harbour office gave locker number {value} to {name}.",
     "Which locker number did the harbour office give to {name}?"),
    ("The {name} lighthouse keeper wore badge number {value}.",
     "Which badge number did the {name} lighthouse keeper wear?"),
    ("The {name} observatory catalogued the comet under entry {value}.",
     "Under which entry did the {name} observatory catalogue the comet?"),
]
NAMES = ["Mirelle", "Tovarin", "Quessaly", "Ondrakel", "Velmora", "Brastinne", "Kelvaro",
         "Isthane", "Dorrimar", "Pellavin", "Sarvenne", "Lotheric", "Havrosk", "Yvendale",
         "Corvanth", "Zelinde", "Ambrosk", "Feldrane", "Nimmerly", "Ostravel"]


def prompt_parts():
    """(system instruction, user-turn head) of the daemon's prompt, from retriever/prompt.c and
    prompt.h, for the diffrag-run path that must give the model the same text."""
    src = (ec.ROOT / "retriever" / "prompt.c").read_text()
    hdr = (ec.ROOT / "retriever" / "prompt.h").read_text()
    refusal = re.search(r'#define PROMPT_REFUSAL\s+"([^"]*)"', hdr).group(1)
    body = re.search(r"HEAD\[\]\s*=(.*?);", src, re.S).group(1)
    head = ""
    for tok in re.finditer(r'"((?:[^"\\]|\\.)*)"|PROMPT_REFUSAL', body):
        head += refusal if tok.group(1) is None else \
            tok.group(1).encode().decode("unicode_escape")
    m = re.fullmatch(r"<\|im_start\|>system\n(.*)<\|im_end\|>\n<\|im_start\|>user\n(.*)", head,
                     re.S)
    if not m:
        raise ec.EvalError("retriever/prompt.c: HEAD is not a ChatML system turn + user head")
    sep = re.search(r'prompt_doc_separator\(void\)\s*{\s*return\s*"([^"]*)"', src).group(1)
    qp = re.search(r'prompt_question_prefix\(void\)\s*{\s*return\s*"([^"]*)"', src).group(1)
    return (m.group(1), m.group(2), sep.encode().decode("unicode_escape"),
            qp.encode().decode("unicode_escape"))


def tokenizer(model):
    """A Hugging Face BPE tokenizer built from the GGUF's vocabulary and merges with the
    pre-tokenizer its tokenizer.ggml.pre names; used only to size haystacks and place needles
    (the daemon's reply gives the exact counts)."""
    import gguf
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    r = gguf.GGUFReader(str(model))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    pre = strings("tokenizer.ggml.pre")[0] if "tokenizer.ggml.pre" in r.fields else ""
    vocab = {t: i for i, t in enumerate(strings("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tk = Tokenizer(models.BPE(vocab, merges))
    if pre == "qwen2":
        pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                   r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    return lambda text: len(tk.encode(text).ids)


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


class Haystacks:
    """Passages split into sentences with their token counts (counted once)."""

    def __init__(self, passages, tok_count):
        self.passages = list(passages.values())
        self.tok_count = tok_count
        self.cache = {}
        text = " ".join(p["text"] for p in self.passages).lower()
        self.names = [n for n in NAMES if n.lower() not in text]

    def sentences(self, i):
        if i not in self.cache:
            ss = SENTENCE_END.split(self.passages[i]["text"].strip())
            self.cache[i] = [(s, self.tok_count(" " + s)) for s in ss]
        return self.cache[i]

    def build(self, rng, n_tokens):
        """[[(sentence, tokens)]] per passage, drawn without repeats until n_tokens; the last
        passage is cut at a sentence end."""
        order = list(range(len(self.passages)))
        rng.shuffle(order)
        paras, total = [], 0
        for i in order:
            left = n_tokens - total
            if left < 8:
                break
            part = []
            for s, n in self.sentences(i):
                if n + 1 > left:
                    break
                part.append((s, n))
                left -= n
                total += n
            if part:
                paras.append(part)
                total += 1  # the line break
        if total < n_tokens - 64:
            raise ec.EvalError("the passages are too few for a %d-token haystack" % n_tokens)
        return paras


def place(paras, depth, needle):
    """The haystack text with the needle as a sentence at the sentence boundary nearest to
    depth (0..1) of its tokens; returns (text, the needle's actual depth)."""
    flat = [(pi, si, n) for pi, p in enumerate(paras) for si, (_, n) in enumerate(p)]
    total = sum(n for _, _, n in flat)
    best, cum, at = None, 0, (0, 0, 0.0)
    for k in range(len(flat) + 1):
        d = abs(cum - depth * total)
        if best is None or d < best:
            best = d
            at = (flat[k][0], flat[k][1], cum / total) if k < len(flat) else \
                (len(paras) - 1, len(paras[-1]), 1.0)
        if k < len(flat):
            cum += flat[k][2]
    pi, si, actual = at
    out = []
    for j, p in enumerate(paras):
        ss = [s for s, _ in p]
        if j == pi:
            ss.insert(si, needle)
        out.append(" ".join(ss))
    return "\n".join(out), actual


def budget(size):
    """The prompt budget (max_context_tokens) of a size: the answer's tokens come out of the
    same window (32K means prompt and answer within the model's 32,768 positions)."""
    return size - MAX_TOKENS


def reserve(size):
    """Window tokens that are not haystack: the answer, the frame, instruction, label and
    question (about 100), and a margin for the sizing tokenizer's small differences from the
    engine's."""
    return MAX_TOKENS + 128 + size // 128


def cases(passages, tok_count, sizes, depths, per_depth, seed=SEED):
    """Every (size, depth, repeat) case: {id, size, depth, actual_depth, question, value,
    text}. Each has its own haystack, name, template and value."""
    hs = Haystacks(passages, tok_count)
    out = []
    for size in sizes:
        rng = random.Random(seed * 1000003 + size)
        serial = 0
        for r in range(per_depth):
            for depth in depths:
                name = hs.names[rng.randrange(len(hs.names))]
                needle_t, question_t = TEMPLATES[serial % len(TEMPLATES)]
                serial += 1
                value = str(rng.randrange(10000, 100000))
                paras = hs.build(rng, size - reserve(size))
                text, actual = place(paras, depth, needle_t.format(name=name, value=value))
                out.append({"id": "n%d-d%03d-r%d" % (size, round(depth * 100), r), "size": size,
                            "depth": depth, "actual_depth": round(actual, 4),
                            "question": question_t.format(name=name), "value": value,
                            "text": text})
    return out


def found(answer, value):
    """Whether the answer states the value (digit groups written 48,213 or 48 213 count)."""
    return value in re.sub(r"(?<=\d)[,\s\u202f](?=\d{3}\b)", "", answer)


def query_message(case):
    return {"v": 1, "op": "query", "id": case["id"], "question": case["question"],
            "docs": [{"id": "haystack", "title": TITLE, "text": case["text"]}], "top_k": 1,
            "max_context_tokens": budget(case["size"]), "max_tokens": MAX_TOKENS, "temperature": 0}


def check_placed(case, reply):
    """Raise unless the reply's prompt held the whole haystack as its one document."""
    if not reply.get("ok"):
        raise ec.EvalError("%s: %s" % (case["id"], reply.get("error")))
    cites = reply["citations"]
    whole = [0, len(case["text"].encode())]
    if len(cites) != 1 or cites[0]["truncated"] or cites[0]["offsets"] != whole:
        raise ec.EvalError("%s: the haystack was not placed whole (%s); its %d tokens by the "
                           "sizing tokenizer and the prompt's %d do not fit max_context_tokens "
                           "%d" % (case["id"], [(c["offsets"], c["truncated"]) for c in cites],
                                   case["size"] - reserve(case["size"]),
                                   reply["usage"]["prompt_tokens"], budget(case["size"])))


def peak_rss_mb(pid):
    """The process's peak resident memory so far (VmHWM), in MiB; None where /proc lacks it."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def ask_daemon(asker, case, timeout, pid):
    t = time.time()
    r = asker.ask(query_message(case), timeout)
    wall = time.time() - t
    check_placed(case, r)
    return {"id": case["id"], "size": case["size"], "depth": case["depth"],
            "actual_depth": case["actual_depth"], "value": case["value"],
            "answer": r["answer"], "hit": found(r["answer"], case["value"]),
            "prompt_tokens": r["usage"]["prompt_tokens"],
            "context_tokens": r["usage"]["context_tokens"],
            "prefill_ms": r["timings"]["prefill_ms"], "wall_s": round(wall, 2),
            "peak_rss_mb": peak_rss_mb(pid), "via": "daemon"}


def ask_run(model, case, threads, rope, timeout):
    """The same prompt through build/diffrag-run (for haystacks longer than one chunk)."""
    system, user_head, sep, qprefix = prompt_parts()
    user = "%s[1] %s\n%s%s%s%s" % (user_head, TITLE, case["text"], sep, qprefix, case["question"])
    argv = [str(ec.build_dir() / "diffrag-run"), "-m", str(model), "--chat", "--system", system,
            "-p", "-", "-n", str(MAX_TOKENS), "--ctx", str(case["size"]), "--threads",
            str(threads), "--temp", "0"]
    for k, v in rope.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    t = time.time()
    p = subprocess.run(argv, input=user.encode(), capture_output=True, timeout=timeout)
    wall = time.time() - t
    err = p.stderr.decode(errors="replace")
    if p.returncode:
        raise ec.EvalError("%s: diffrag-run exited %d: %s" % (case["id"], p.returncode, err[-800:]))
    m = re.search(r"prompt_tokens=(\d+) prefill_tok_s=([0-9.]+)", err)
    rss = re.search(r"peak_rss_mb=([0-9.]+)", err)
    answer = p.stdout.decode(errors="replace")
    n = int(m.group(1)) if m else 0
    rate = float(m.group(2)) if m else 0.0
    return {"id": case["id"], "size": case["size"], "depth": case["depth"],
            "actual_depth": case["actual_depth"], "value": case["value"], "answer": answer,
            "hit": found(answer, case["value"]), "prompt_tokens": n, "context_tokens": None,
            "prefill_ms": round(1000 * n / rate, 1) if rate else None,
            "wall_s": round(wall, 2), "peak_rss_mb": float(rss.group(1)) if rss else None,
            "via": "diffrag-run"}


def table(results, depths):
    """Markdown: one row per size (window), its largest prompt, recall per depth and overall,
    mean prefill time."""
    sizes = sorted({r["size"] for r in results})
    head = ("| window | prompt tokens | " + " | ".join("depth %d%%" % round(d * 100)
                                                          for d in depths)
            + " | recall | prefill s/needle | peak RSS MiB | via |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in sizes:
        rs = [r for r in results if r["size"] == s]
        cells = []
        for d in depths:
            dr = [r for r in rs if r["depth"] == d]
            cells.append("%d/%d" % (sum(r["hit"] for r in dr), len(dr)) if dr else "-")
        pre = [r["prefill_ms"] for r in rs if r["prefill_ms"]]
        rss = [r["peak_rss_mb"] for r in rs if r.get("peak_rss_mb")]
        lines.append("| %s | %d | %s | %.2f | %s | %s | %s |" % (
            "%dK" % (s // 1024), max(r["prompt_tokens"] for r in rs), " | ".join(cells),
            sum(r["hit"] for r in rs) / len(rs),
            "%.1f" % (sum(pre) / len(pre) / 1000) if pre else "-",
            "%.0f" % max(rss) if rss else "-",
            "/".join(sorted({r["via"] for r in rs}))))
    return "\n".join(lines)


def recall_by_size(results):
    out = {}
    for r in results:
        h, n = out.get(r["size"], (0, 0))
        out[r["size"]] = (h + r["hit"], n + 1)
    return {s: h / n for s, (h, n) in out.items()}


def run(model, sizes, depths, per_depth, threads, rope, squad_dir, workdir, timeout, log):
    passages, _ = ec.load_squad(squad_dir)
    tok_count = tokenizer(model)
    todo = cases(passages, tok_count, sizes, depths, per_depth)
    results = []
    by_daemon = [c for c in todo if c["size"] - reserve(c["size"]) <= CHUNK_MAX - 256]
    by_run = [c for c in todo if c not in by_daemon]
    if by_daemon:
        most = max(budget(c["size"]) for c in by_daemon)
        keys = {"threads": threads, "max_context_tokens": most, "max_tokens": MAX_TOKENS,
                "chunk_tokens": CHUNK_MAX, "chunk_overlap": 0, "max_top_k": 1,
                "grounding_calibration": "none"}
        keys.update(rope)
        with ec.LocalDaemon(workdir, model, **keys) as d, ec.Asker(d.endpoint, d.proc) as a:
            for c in by_daemon:
                r = ask_daemon(a, c, timeout, d.proc.pid)
                results.append(r)
                log(json.dumps(r))
    for c in by_run:
        r = ask_run(model, c, threads, rope, timeout)
        results.append(r)
        log(json.dumps(r))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ec.QWEN_MODEL))
    ap.add_argument("--sizes", default=None,
                    help="windows (prompt + answer) in tokens, comma-separated (default: %s; "
                    "with --yarn also %s)" % (",".join(map(str, DEFAULT_SIZES)),
                                  ",".join(map(str, YARN_SIZES))))
    ap.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)),
                    help="needle depths 0..1 (default: %(default)s)")
    ap.add_argument("--per-depth", type=int, default=2,
                    help="needles per size and depth, each in its own haystack (default 2)")
    ap.add_argument("--yarn", action="store_true",
                    help="rope_scaling yarn, rope_factor 4, rope_orig_ctx 32768 (for every "
                    "size asked), and the 64K and 128K sizes when --sizes is not given")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--squad", default=str(ec.DEFAULT_SQUAD))
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per needle")
    ap.add_argument("--json", help="write every result here (JSON lines)")
    ap.add_argument("--bar", type=float, default=0.9,
                    help="exit status 1 when a size's recall is below this (default 0.9)")
    args = ap.parse_args()
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = list(DEFAULT_SIZES) + (list(YARN_SIZES) if args.yarn else [])
    depths = [float(d) for d in args.depths.split(",")]
    rope = YARN_ARGS if args.yarn else {}
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="eval-longctx-") as work:
            results = run(args.model, sizes, depths, args.per_depth, args.threads, rope,
                          args.squad, work, args.timeout,
                          lambda s: print(s, file=sys.stderr, flush=True))
    except ec.EvalError as e:
        print("eval-longctx: %s" % e, file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    print("model %s%s; %d needles per size; %.0f s in all" % (
        pathlib.Path(args.model).name, " (YaRN x4 over 32768)" if args.yarn else "",
        len(depths) * args.per_depth, time.time() - t0))
    print(table(results, depths))
    low = {s: v for s, v in recall_by_size(results).items() if v < args.bar}
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
