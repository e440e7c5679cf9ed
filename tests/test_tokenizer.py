"""The C tokenizer against Hugging Face `tokenizers` built from the same GGUF vocabulary and merges.

The reference is tokenizers.models.BPE(vocab, merges) with the file's pre-tokenizer and the
ByteLevel decoder: for SmolLM2, Digits(individual_digits=True) then ByteLevel with the GPT-2
regex; for Qwen2.5-Coder, Split with Qwen2's regex (behaviour "isolated") then ByteLevel without
a regex, as Qwen2's tokenizer.json has it (less its NFC normaliser, which the C tokenizer does
not apply: text already in NFC gives the same ids either way). Control tokens are the
reference's special added tokens, user-defined ones its plain added tokens; without
TOK_PARSE_SPECIAL the reference runs with encode_special_tokens. Documents go to
build/tests/test_tokenizer in one batch each way (length-prefixed records in, one line of ids
per record out). Checked per document: identical ids, decode(encode) giving the text back, and
the streaming detokeniser giving the same bytes; separately special tokens, the plain GPT-2
pre-tokenizer (a small GGUF written with tokenizer keys only) and the chat templates rendered
by jinja2.
"""
import json
import pathlib
import random
import subprocess
import unicodedata

import gguf
import jinja2.sandbox
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from conftest import BUILD, ROOT

BINARY = BUILD / "tests" / "test_tokenizer"
SMOLLM_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_MODEL = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
# Qwen2's pre-tokenizer, as its tokenizer.json spells it.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ---- the reference --------------------------------------------------------------------------

def read_vocab(path):
    r = gguf.GGUFReader(str(path))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tt = r.fields["tokenizer.ggml.token_type"]
    return {
        "tokens": strings("tokenizer.ggml.tokens"),
        "types": [int(tt.parts[i][0]) for i in tt.data],
        "merges": strings("tokenizer.ggml.merges"),
        "pre": bytes(r.fields["tokenizer.ggml.pre"].parts[-1]).decode(),
        "template": bytes(r.fields["tokenizer.chat_template"].parts[-1]).decode(),
        "bos": int(r.fields["tokenizer.ggml.bos_token_id"].parts[-1][0]),
        "eos": int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0]),
    }


def hf_tokenizer(v, pre=None, specials=False):
    """The reference for vocabulary v with pre-tokenizer `pre` (the file's by default). Its
    added tokens are the file's control (special) and user-defined (plain) tokens; without
    `specials` the special ones are encoded as text (encode_special_tokens)."""
    pre = pre or v["pre"]
    vocab = {t: i for i, t in enumerate(v["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in v["merges"]]
    tk = Tokenizer(models.BPE(vocab, merges))
    if pre == "qwen2":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        assert pre in ("smollm", "gpt2"), pre
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.pre_tokenizer = (byte_level if pre == "gpt2" else pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]))
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(v["tokens"], v["types"]) if ty == 3])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(v["tokens"], v["types"]) if ty == 4])
    tk.encode_special_tokens = not specials
    return tk


def model_file(path):
    if not path.exists():
        pytest.fail(f"{path} missing: run `make model`")
    return path


@pytest.fixture(scope="module")
def smollm_model():
    return model_file(SMOLLM_MODEL)


@pytest.fixture(scope="module")
def qwen_model():
    return model_file(QWEN_MODEL)


@pytest.fixture(scope="module")
def vocab(smollm_model):
    v = read_vocab(smollm_model)
    assert v["pre"] == "smollm" and len(v["tokens"]) == 49152
    return v


@pytest.fixture(scope="module")
def qwen_vocab(qwen_model):
    v = read_vocab(qwen_model)
    assert v["pre"] == "qwen2" and len(v["tokens"]) == 151936 and len(v["merges"]) == 151387
    return v


@pytest.fixture(scope="module")
def binary():
    if not BINARY.exists():
        pytest.fail(f"{BINARY} missing: run `make`")
    return BINARY


# ---- the C side -----------------------------------------------------------------------------

def c_encode(binary, model, docs, *flags):
    data = b"".join(b"%d\n" % len(d) + d for d in docs)
    r = subprocess.run([str(binary), "--encode-batch", str(model), *flags], input=data,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    lines = r.stdout.decode().split("\n")
    assert len(lines) == len(docs) + 1 and lines[-1] == ""
    return [[int(x) for x in line.split()] for line in lines[:-1]]


def c_decode(binary, model, id_lists, *flags):
    data = "".join(" ".join(map(str, ids)) + "\n" for ids in id_lists).encode()
    r = subprocess.run([str(binary), "--decode-batch", str(model), *flags], input=data,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    out, pos = [], 0
    buf = r.stdout
    while pos < len(buf):
        nl = buf.index(b"\n", pos)
        n = int(buf[pos:nl])
        out.append(buf[nl + 1:nl + 1 + n])
        pos = nl + 1 + n
    assert len(out) == len(id_lists)
    return out


# ---- the documents --------------------------------------------------------------------------

SCRIPTS = [
    # Greek, Cyrillic, Arabic, Hebrew, Devanagari, Thai, Chinese, Japanese, Korean, Georgian,
    # Armenian, Tamil, Vietnamese with stacked diacritics.
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Καλημέρα, κόσμε! ΑΒΓΔ αβγδ 2024.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Москва — столица России (1147 г.).",
    "مرحبا بالعالم! هذه جملة عربية للاختبار، وفيها أرقام ١٢٣٤٥ و 678. السلام عليكم.",
    "שלום עולם! זהו משפט בעברית לבדיקה, עם ניקוד: שָׁלוֹם. המספר 42 מופיע כאן.",
    "नमस्ते दुनिया! यह हिंदी में एक परीक्षण वाक्य है। संख्याएँ: १२३४ और 5678.",
    "สวัสดีชาวโลก นี่คือประโยคภาษาไทยสำหรับการทดสอบ ตัวเลข ๑๒๓ และ 456",
    "你好，世界！这是一个用于测试的中文句子。北京是中国的首都，人口约2189万。",
    "こんにちは世界。これはテスト用の日本語の文です。カタカナとひらがな、漢字を含みます。",
    "안녕하세요 세계! 이것은 테스트를 위한 한국어 문장입니다. 서울의 인구는 약 950만 명입니다.",
    "გამარჯობა მსოფლიო! Բարեւ աշխարհ! வணக்கம் உலகம்! Xin chào thế giới, tiếng Việt có dấu.",
    "Ελληνικά και русский и English mixed: αβγ-абв-abc, 3.14159 ≈ π, ∑ ∫ √ ∞ ≠ ≤ ≥.",
]

EMOJI = [
    "Family: 👨‍👩‍👧‍👦 couple: 👩‍❤️‍💋‍👨 technologist: 🧑🏽‍💻 rainbow flag: 🏳️‍🌈",
    "Flags: 🇫🇷🇩🇪🇯🇵🇺🇸🇧🇷🇮🇳 🏴󠁧󠁢󠁳󠁣󠁴󠁿 and keycaps 1️⃣ 2️⃣ #️⃣ *️⃣",
    "Skin tones 👍🏻👍🏼👍🏽👍🏾👍🏿 hearts ❤️🧡💛💚💙💜🖤 faces 😀😃😄😁😆😅🤣😂🙂🙃",
    "🦙🧩🪐🫠 text🎉between😀emoji🚀!!! 🤗🤗🤗 ☕️ ✨ 🔥🔥",
]

COMBINING = [
    "Cafe\u0301 vs Café, n\u0303, a\u0308\u0304, e\u0301\u0302\u0303\u0304\u0305",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a"
    "a\u0360\u0357\u0361\u0489l\u0358\u0362g\u0315\u0335o\u0338\u0321 text",
    "\u0915\u094d\u0937 \u0e01\u0e34\u0e4a \u05e9\u05c1\u05b8 \u1100\u1161\u11a8 \u0301\u0301start",
    "Ǆ ǅ ǆ ﬁ ﬂ Å Å Ω Ω ℌ ℍ ⅷ Ⅻ ½ ¾ ² ³ ⁴ ₅ ① ⑳",
]

WHITESPACE = [
    "a  b   c    d\t\te\n\nf\r\ng \t \n h",
    "    indented\n        more\n\t\ttabs\n \n  \n   \nend   ",
    "   leading spaces and trailing   ",
    "\n\n\n\n\nnewlines\n\n\n",
    "nbsp\u00a0here\u00a0\u00a0and\u2003em\u2009thin\u3000ideographic\u2028line\u2029para",
    " " * 300 + "x" + "\t" * 50 + "y" + "\n" * 40 + " z " + " \t\n" * 30,
    "\u000b\u000c\u0085 mixed \u001c\u001d\u001e\u001f separators",
]

DIGITS = [
    "0123456789 00000 1234567890123456789012345678901234567890",
    "Numbers: 3.14159, 2,718, -42, +7, 1e-10, 0x1F, 1_000_000, 12:30, 2024-06-01, v1.2.3",
    " 1 22 333 4444 55555  666666   7777777",
    "Arabic-Indic ٠١٢٣٤٥٦٧٨٩ Devanagari ०१२३४५६७८९ fullwidth ０１２３ Thai ๐๑๒ ⅠⅡⅢ ¼½",
    "abc123def456 x1y2z3 a1b 1a 12ab34 $100 €50 £3.50 ¥1000 100% #1 @2",
]

CONTRACTIONS = [
    "It's we're they've I'm you'll he'd don't can't won't shouldn't y'all o'clock",
    "IT'S WE'RE THEY'VE I'M YOU'LL HE'D DON'T CAN'T THEY'LL She'S We'Re",
    "'s 't 're 've 'm 'll 'd '' 's ''s ' s ' '' ''' 'ss 'tt 'rea 'vee 'mm 'lll 'dd",
    "rock 'n' roll, the '90s, 'quoted', \"double\", ‘curly’ “quotes” it’s don’t",
    "can't's 'twas 'tis fo'c'sle ma'am O'Neill d'Artagnan l'homme",
]

CODE_SNIPPETS = [
    "int main(void){for(int i=0;i<10;i++){printf(\"%d\\n\",i);}return 0;}\n",
    "def f(x):\n    return [y**2 for y in range(x) if y % 2 == 0]  # squares\n",
    "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>\n{\"key\": [1, 2.5, null]}",
    "x+=1; y-=2; z*=3; a/=4; b%=5; c<<=6; d>>=7; e&&=f; g||=h; i??=j; k->l; m::n; o...p",
    "!!!???...,,,;;;:::---___===+++***&&&|||^^^~~~```@@@###$$$%%%(((]]]{{{}}}<<<>>>",
]

EDGE = [
    "",
    " ",
    "a",
    "!",
    "\n",
    "1",
    " 1",
    "  1",
    "x" * 5000,
    "." * 3000 + "a" * 3000 + "1" * 300,
    "Dropped bytes: a\u0004b !\u0006! \u0013\u0014\u0016\u001d end",
]


def random_strings(seed, count):
    """Strings mixing ASCII, whitespace and random assigned code points from every plane."""
    rng = random.Random(seed)
    assigned = [cp for cp in range(0x110000)
                if unicodedata.category(chr(cp)) not in ("Cn", "Cs")]
    ascii_pool = [chr(c) for c in range(0x20, 0x7F)] + ["'s", "'ll", " ", "  ", "\n", "\t"]
    spaces = [" ", "\t", "\n", "\r", "\u00a0", "\u3000", "\u2003", "\u000b"]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(5, 120)):
            r = rng.random()
            if r < 0.35:
                parts.append(rng.choice(ascii_pool))
            elif r < 0.5:
                parts.append(rng.choice(spaces) * rng.randint(1, 4))
            elif r < 0.6:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 8))))
            else:
                parts.append(chr(rng.choice(assigned)))
        out.append("".join(parts))
    return out


def corpus(root, squad_dir):
    docs = []
    with open(squad_dir / "passages.jsonl", encoding="utf-8") as f:
        passages = [json.loads(line) for line in f]
    for p in passages[::4][:200]:
        docs.append(("squad", p["title"] + "\n\n" + p["text"]))
    sources = sorted(p for d in ("model", "kernels", "tests", "retriever")
                     for p in (root / d).rglob("*") if p.suffix in (".c", ".h", ".py"))
    for p in sources[:40]:
        docs.append(("project source", p.read_text(encoding="utf-8", errors="replace")[:20000]))
    json_dir = pathlib.Path(json.__file__).parent
    for p in sorted(json_dir.glob("*.py")):
        docs.append(("stdlib json", p.read_text(encoding="utf-8")))
    for kind, items in (("scripts", SCRIPTS), ("emoji", EMOJI), ("combining", COMBINING),
                        ("whitespace", WHITESPACE), ("digits", DIGITS),
                        ("contractions", CONTRACTIONS), ("code", CODE_SNIPPETS), ("edge", EDGE)):
        docs.extend((kind, s) for s in items)
    docs.extend(("random", s) for s in random_strings(1234, 300))
    # Long documents go through the encoder's per-call word cache (texts of 4 KB or more).
    for kind in ("squad", "scripts", "random"):
        docs.append((kind + " joined", "\n".join(t for k, t in docs if k == kind)))
    return docs


# ---- tests ----------------------------------------------------------------------------------

def representable_bytes(v):
    """Bytes whose single-byte token exists (the others are dropped by both tokenizers)."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cps, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cps.append(256 + n)
            n += 1
    tokens = set(v["tokens"])
    return {b for b, cp in zip(bs, cps) if chr(cp) in tokens}


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare(docs, ours, theirs, tk):
    mismatches = []
    for (kind, text), a, b in zip(docs, ours, theirs):
        if a != b:
            i = first_difference(a, b)
            mismatches.append(f"{kind}: {text[:60]!r}... at token {i}: C {a[i:i + 6]} "
                              f"({[tk.decode([x]) for x in a[i:i + 6]]}) vs HF {b[i:i + 6]} "
                              f"({[tk.decode([x]) for x in b[i:i + 6]]})")
    return mismatches


def check_ids_and_round_trip(binary, model, v, docs):
    """Identical ids to the reference on every document, and decode/stream giving it back."""
    texts = [t.encode("utf-8") for _, t in docs]
    total = sum(map(len, texts))
    tk = hf_tokenizer(v)
    theirs = [e.ids for e in tk.encode_batch([t for _, t in docs], add_special_tokens=False)]
    ours = c_encode(binary, model, texts)
    mismatches = compare(docs, ours, theirs, tk)
    kinds = sorted({k for k, _ in docs})
    n_tokens = sum(map(len, ours))
    print(f"{model.name}: {len(docs)} documents, {total} bytes, {n_tokens} tokens, "
          f"kinds {kinds}, mismatches {len(mismatches)}")
    assert total >= 200_000
    assert not mismatches, "\n".join(mismatches[:10])

    keep = representable_bytes(v)
    decoded = c_decode(binary, model, ours)
    streamed = c_decode(binary, model, ours, "--stream")
    bad, n_dropped = [], 0
    for (kind, text), raw, dec, st in zip(docs, texts, decoded, streamed):
        want = bytes(b for b in raw if b in keep)
        n_dropped += want != raw
        if dec != want:
            bad.append(f"decode {kind}: {text[:60]!r}")
        # The stream must give the same bytes; it only differs where dropping bytes broke UTF-8.
        try:
            want.decode("utf-8")
            if st != want:
                bad.append(f"stream {kind}: {text[:60]!r}")
        except UnicodeDecodeError:
            if st != want.decode("utf-8", errors="replace").encode():
                bad.append(f"stream (replacement) {kind}: {text[:60]!r}")
    print(f"round trip: {len(docs) - len(bad)}/{len(docs)} documents exact "
          f"({n_dropped} contain bytes the vocabulary has no token for, dropped as HF does)")
    assert not bad, "\n".join(bad[:10])
    return texts, ours


def test_ids_match_hf_and_round_trip(binary, smollm_model, vocab, root, squad_dir):
    check_ids_and_round_trip(binary, smollm_model, vocab, corpus(root, squad_dir))


# What Qwen2's regex treats unlike GPT-2's: line breaks after punctuation and inside whitespace
# runs, CRLF, a letter run taking one leading non-space character, single digits, contractions
# in any case (U+017F LONG S folds to 's').
QWEN_EXTRA = [
    "Line one\r\nLine two\r\n\r\n\tTabbed\r\n  \r\n   spaced\r\rold mac\n\r\n\rmixed\n",
    "x\n \n \n y", "a.\r\n\r\nb", "end!!\n\n\n", "  \t\r\n\t  word", ",\n", " ,\n\nx", "'\n",
    "}\n\n\n}\r\n", "  \n\n  x", "\n\n\n", "\r", " \r\n", "\t\n\t\n\tx", "a \u3000\nb \u00a0\r\nc",
    ";\n    return x;\n}\n\nint f(void)\n{\n\tif (a)\n\t\treturn 1;\n\r\n}\n",
    "(foo) [bar] {baz} <qux> \"quoted\" 'single' `tick` #hash @at $dollar %pct ^caret &amp",
    "_snake_case __dunder__ -dash +plus =eq ~tilde |pipe \\back /slash .dot ,comma ;semi :colon",
    "\u00bfQu\u00e9? \u00a1Hola! \u00abguillemets\u00bb \u201cquotes\u201d \u2014dash \u2026dots",
    "I'M YOU'RE WE'VE SHE'LL HE'D IT'S DON'T 'S 'T 'RE 'VE 'M 'LL 'D 'Ll 'lL 'rE 'Ve 'vE",
    "it'\u017f '\u017f '\u017fx '\u017f\u017f L'\u017fA '\u212a 'K 'k 'sT 'Tt 'mM 'dD 'LLl",
    "1234567890 3.14159 1,000,000 0x7FFF_FFFF 1e-9 v2.5.0-rc1 10:30:00 2024-06-01T00:00Z",
    "\u0661\u0662\u0663 \u0967\u0968\u0969 \uff11\uff12 \u2460\u2461 \u00bd\u00bc \u2167 x\u00b2 H\u2082O",
    "Qwen2.5-Coder-0.5B-Instruct: 24 layers, d=896, 14 heads (2 kv), rope 1e6, vocab 151,936.",
    "\u0645\u0631\u062d\u0628\u0627\u060c \u0647\u0630\u0627 \u0627\u062e\u062a\u0628\u0627\u0631\u061f "
    "\u05e9\u05dc\u05d5\u05dd, \u05e2\u05d5\u05dc\u05dd! \u0928\u092e\u0938\u094d\u0924\u0947 "
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35 \u4e2d\u6587\uff0c\u6d4b\u8bd5\u3002 \ud55c\uad6d\uc5b4 "
    "\u65e5\u672c\u8a9e\u306e\u6587 \u0440\u0443\u0441\u0441\u043a\u0438\u0439 "
    "\u03b5\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8",
    "\U0001f469\U0001f3fd\u200d\U0001f4bb\U0001f468\u200d\U0001f469\u200d\U0001f467 "
    "\U0001f44b\U0001f3ff!\U0001f3f3\ufe0f\u200d\u26a7\ufe0f\u2764\ufe0f\u200d\U0001f525 a\U0001f600b",
]


def test_qwen_ids_match_hf_and_round_trip(binary, qwen_model, qwen_vocab, root, squad_dir):
    docs = corpus(root, squad_dir) + [("qwen2 regex", s) for s in QWEN_EXTRA]
    docs.append(("qwen2 regex joined", "\n".join(QWEN_EXTRA) * 3))
    # Runs of each whitespace character and of mixtures, at every length up to 12.
    ws = [" ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\u2028", "\x0b"]
    rng = random.Random(5)
    docs += [("whitespace runs", "".join(rng.choice(ws) for _ in range(n)).join(pair))
             for n in range(1, 13) for pair in (("a", "b"), (".", ","), ("1", "2"), ("", ""))]
    check_ids_and_round_trip(binary, qwen_model, qwen_vocab, docs)


def test_qwen_long_document(binary, qwen_model, qwen_vocab, squad_dir, root):
    """A document of over 32K tokens (prose and this project's C sources, as the daemon's
    prompts hold): the ids of the reference, and the C side's load and encoding times."""
    with open(squad_dir / "passages.jsonl", encoding="utf-8") as f:
        passages = [json.loads(line) for line in f]
    sources = sorted((root / "model").glob("*.c"))
    parts = [p["title"] + "\n\n" + p["text"] for p in passages[1::3][:400]]
    parts += [p.read_text(encoding="utf-8", errors="replace")[:8000] for p in sources]
    text = "\n\n".join(parts)
    tk = hf_tokenizer(qwen_vocab)
    theirs = tk.encode(text, add_special_tokens=False).ids
    assert len(theirs) >= 32768, len(theirs)
    ours = c_encode(binary, qwen_model, [text.encode()])[0]
    assert ours == theirs, f"first difference at token {first_difference(ours, theirs)}"
    r = subprocess.run([str(binary), "--encode-time", str(qwen_model)], input=text.encode(),
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    f = r.stdout.split()
    assert f[0] == b"load_s" and f[2] == b"tokens" and int(f[3]) == len(theirs)
    load_s, encode_s = float(f[1]), float(f[5])
    print(f"qwen2 document: {len(text.encode())} bytes, {len(theirs)} tokens; tokenizer load "
          f"{load_s * 1e3:.1f} ms, encoding {encode_s * 1e3:.1f} ms "
          f"({len(theirs) / encode_s / 1e6:.2f} M tokens/s)")


def split_before_inner_spaces(data):
    """Cut bytes before every space whose previous byte is ASCII other than whitespace and whose
    next byte is not ASCII whitespace: where the retriever's token-count cache
    (model/tokcount_model.c) encodes words apart."""
    ws = b" \t\n\r\f\v"
    cuts = [i for i in range(1, len(data) - 1)
            if data[i] == 0x20 and data[i - 1] < 0x80 and data[i - 1] not in ws
            and data[i + 1] not in ws]
    return [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]


@pytest.mark.parametrize("which", ["smollm", "qwen"])
def test_words_encode_apart(binary, which, root, squad_dir):
    """Encoding the pieces between those cuts one by one gives the same ids as the whole text,
    for both pre-tokenizers (the retriever's counts are exact only if so)."""
    model = model_file(SMOLLM_MODEL if which == "smollm" else QWEN_MODEL)
    docs = [t for k, t in corpus(root, squad_dir)
            if k in ("squad", "project source", "scripts", "emoji", "whitespace", "digits",
                     "contractions", "code", "random")]
    docs += QWEN_EXTRA
    whole = c_encode(binary, model, [d.encode() for d in docs])
    pieces = [split_before_inner_spaces(d.encode()) for d in docs]
    flat = c_encode(binary, model, [w for ws in pieces for w in ws])
    bad, i, n_words = [], 0, 0
    for d, ws, ids in zip(docs, pieces, whole):
        joined = [x for w in flat[i:i + len(ws)] for x in w]
        i += len(ws)
        n_words += len(ws)
        if joined != ids:
            bad.append(repr(d[:60]))
    print(f"{model.name}: {len(docs)} documents, {n_words} words encoded apart, "
          f"{len(bad)} differ")
    assert n_words > 10_000
    assert not bad, "\n".join(bad[:10])


def special_documents(v, squad_dir, seed):
    """Chat transcripts, every special string, near misses and random mixtures."""
    specials = [t for t, ty in zip(v["tokens"], v["types"]) if ty in (3, 4)]
    with open(squad_dir / "passages.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(40), f)]
    rng = random.Random(seed)
    docs = []
    for i in range(0, 40, 2):
        docs.append("<|im_start|>system\nAnswer from the passage.<|im_end|>\n<|im_start|>user\n"
                    f"{texts[i][:400]}\n\nQuestion?<|im_end|>\n<|im_start|>assistant\n"
                    f"{texts[i + 1][:200]}<|im_end|>\n")
    docs += ["".join(specials), " ".join(specials), "\n".join(specials),
             "<|im_end|><|im_end|>x<|im_start|>", "<|im_start", "<|im_end|", "<<|im_end|>>",
             "<|im_start|><|im_start|>user", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
             "<tool_call</tool_call>>", "<|fim_prefix|>def f():\n<|fim_suffix|>\n<|fim_middle|>",
             "<|repo_name|>diffrag\n<|file_sep|>model/tokenizer.c\nint x;<|endoftext|>",
             "text<repo_name>name<file_sep>code 123<filename>a.py<gh_stars>100<|endoftext|>"]
    for _ in range(30):
        docs.append("".join(rng.choice(specials + ["a", " ", "1", "<", "|", "\n", "é", "'s"])
                            for _ in range(rng.randint(1, 40))))
    return docs


def check_special_tokens(binary, model, v, docs):
    control = {i for i, ty in enumerate(v["types"]) if ty == 3}
    user = {i for i, ty in enumerate(v["types"]) if ty == 4}
    encoded = [d.encode() for d in docs]
    ours = c_encode(binary, model, encoded, "--special")
    tk = hf_tokenizer(v, specials=True)
    theirs = [e.ids for e in tk.encode_batch(docs, add_special_tokens=False)]
    mismatches = compare([("special", d) for d in docs], ours, theirs, tk)
    n_control = sum(x in control for ids in ours for x in ids)
    print(f"{model.name} special tokens: {len(docs)} documents, {n_control} control ids, "
          f"mismatches {len(mismatches)}")
    assert n_control > 100
    assert not mismatches, "\n".join(mismatches[:10])
    assert c_decode(binary, model, ours) == encoded

    # Without TOK_PARSE_SPECIAL control texts are text; user-defined tokens still match.
    plain = c_encode(binary, model, encoded)
    tk = hf_tokenizer(v, specials=False)
    theirs = [e.ids for e in tk.encode_batch(docs, add_special_tokens=False)]
    mismatches = compare([("plain", d) for d in docs], plain, theirs, tk)
    assert not any(x in control for ids in plain for x in ids), "control ids without --special"
    n_user = sum(x in user for ids in plain for x in ids)
    print(f"  as text: mismatches {len(mismatches)}, user-defined ids {n_user}")
    assert not mismatches, "\n".join(mismatches[:10])
    assert (n_user > 0) == bool(user)
    assert c_decode(binary, model, plain) == encoded


def test_special_tokens_match_hf(binary, smollm_model, vocab, squad_dir):
    assert sum(ty == 3 for ty in vocab["types"]) == 17
    check_special_tokens(binary, smollm_model, vocab, special_documents(vocab, squad_dir, 7))


def test_qwen_special_tokens_match_hf(binary, qwen_model, qwen_vocab, squad_dir):
    types = qwen_vocab["types"]
    tokens = qwen_vocab["tokens"]
    named = {tokens[i]: ty for i, ty in enumerate(types) if ty != 1}
    assert sum(ty == 3 for ty in types) == 20 and sum(ty == 4 for ty in types) == 2
    assert named["<|im_start|>"] == 3 and named["<|fim_middle|>"] == 3
    assert named["<tool_call>"] == 4 and named["</tool_call>"] == 4
    # The rows past the real vocabulary are unused padding; they decode to nothing.
    pads = [i for i, ty in enumerate(types) if ty == 5]
    assert len(pads) == 271 and pads[0] == 151665 and pads[-1] == 151935
    assert c_decode(binary, qwen_model, [pads[:3], [pads[-1], 9707]]) == [b"", b"Hello"]
    check_special_tokens(binary, qwen_model, qwen_vocab, special_documents(qwen_vocab, squad_dir, 11))


def test_gpt2_pre_tokenizer_matches_hf(binary, vocab, root, squad_dir, tmp_path):
    """The plain GPT-2 regex (no digit split) through a GGUF holding only tokenizer keys."""
    path = tmp_path / "gpt2-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    docs = [d for d in corpus(root, squad_dir) if d[0] not in ("squad", "project source")]
    docs += [("digits", s) for s in (" 1 22 333", "a 12345 b", "  99  bottles", "x\t42")]
    texts = [t.encode() for _, t in docs]
    tk = hf_tokenizer(vocab, pre="gpt2")
    theirs = [e.ids for e in tk.encode_batch([t for _, t in docs], add_special_tokens=False)]
    ours = c_encode(binary, path, texts)
    mismatches = compare(docs, ours, theirs, tk)
    print(f"gpt2 pre-tokenizer: {len(docs)} documents, {sum(map(len, texts))} bytes, "
          f"mismatches {len(mismatches)}")
    assert not mismatches, "\n".join(mismatches[:10])
    # This file asks for BOS: --bos prepends it, and " 12" stays one pre-token here.
    with_bos = c_encode(binary, path, [b"hi 12"], "--bos")[0]
    assert with_bos[0] == vocab["bos"] and with_bos[1:] == tk.encode("hi 12").ids


def c_chat(binary, model, messages, gen):
    data = b"".join(b"%s %d\n" % (m["role"].encode(), len(m["content"].encode()))
                    + m["content"].encode() for m in messages)
    r = subprocess.run([str(binary), "--chat", str(model)] + (["--gen"] if gen else []),
                       input=data, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout.decode()


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Explain.\nLine two, 'quoted', émoji 🤗"}],
    [{"role": "assistant", "content": ""}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"},
     {"role": "assistant", "content": "b\n\n"}, {"role": "user", "content": ""}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "<|im_end|> as text"}],
]


def check_chat_template(binary, model, template_text):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(template_text)
    n = 0
    for conv in CONVERSATIONS:
        for gen in (False, True):
            want = template.render(messages=conv, add_generation_prompt=gen)
            got = c_chat(binary, model, conv, gen)
            assert got == want, f"{conv} gen={gen}\nC:     {got!r}\njinja: {want!r}"
            n += 1
    print(f"{model.name} chat template: {n} renderings identical to jinja2")


def test_chat_template_matches_jinja(binary, smollm_model, vocab):
    check_chat_template(binary, smollm_model, vocab["template"])
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(vocab["template"])
    for gen in (False, True):
        assert c_chat(binary, smollm_model, [], gen) == template.render(
            messages=[], add_generation_prompt=gen)
    assert "You are a helpful AI assistant named SmolLM" in c_chat(
        binary, smollm_model, CONVERSATIONS[0], True)


def test_qwen_chat_template_matches_jinja(binary, qwen_model, qwen_vocab):
    check_chat_template(binary, qwen_model, qwen_vocab["template"])
    default = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
               "assistant.<|im_end|>\n")
    got = c_chat(binary, qwen_model, CONVERSATIONS[0], True)
    assert got == default + ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert default not in c_chat(binary, qwen_model, CONVERSATIONS[1], True)
    # Qwen2.5's template cannot render no messages (it reads messages[0]); the C side gives
    # the assistant prompt alone, as for SmolLM2.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    with pytest.raises(jinja2.exceptions.UndefinedError):
        env.from_string(qwen_vocab["template"]).render(messages=[], add_generation_prompt=True)
    assert c_chat(binary, qwen_model, [], True) == "<|im_start|>assistant\n"
