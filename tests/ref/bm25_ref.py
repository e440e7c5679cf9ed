"""Reference Okapi BM25 (independent of diffrag's C code) for the retrieval quality test.

Tokens are lowercased runs of Unicode word characters (Python's ``\\w``), with no stemming and
no stop words; a query leaves out its question words (interrogatives, auxiliaries, personal
pronouns, the list docs/retriever.md describes) unless they are all it has. Scoring is the
classic form diffrag documents:

    score(q, d) = sum over query tokens t (repeats count) of
                  idf(t) * tf (k1 + 1) / (tf + k1 (1 - b + b |d| / avgdl))
    idf(t)      = ln(1 + (N - df + 0.5) / (df + 0.5))
"""
import math
import re

import numpy as np

TOKEN = re.compile(r"\w+")
QUESTION_WORDS = {
    "am", "are", "can", "could", "did", "do", "does", "had", "has", "have", "how", "i", "is",
    "me", "my", "should", "was", "we", "were", "what", "when", "where", "which", "who", "whom",
    "whose", "why", "would", "you", "your"}


def tokenize(text):
    return TOKEN.findall(text.lower())


def query_tokens(query):
    """The query's tokens less its question words (unless they are all it has); a word in
    capitals ("WHO") names something and stays."""
    words = TOKEN.findall(query)
    kept = [w.lower() for w in words
            if w.lower() not in QUESTION_WORDS or (len(w) >= 2 and w.isupper())]
    return kept or [w.lower() for w in words]


class BM25Ref:
    def __init__(self, k1=0.9, b=0.4):
        self.k1 = k1
        self.b = b
        self.ids = []
        self.postings = {}  # term -> (doc indices, term-frequency part of the score)

    def index(self, docs):
        """docs: iterable of (id, text)."""
        tfs = {}
        lengths = []
        for i, (doc_id, text) in enumerate(docs):
            self.ids.append(doc_id)
            toks = tokenize(text)
            lengths.append(len(toks))
            for t in toks:
                row = tfs.setdefault(t, {})
                row[i] = row.get(i, 0) + 1
        n = len(lengths)
        lengths = np.asarray(lengths, dtype=np.float64)
        avgdl = lengths.mean() if n else 0.0
        for t, row in tfs.items():
            idx = np.fromiter(row.keys(), dtype=np.int64, count=len(row))
            tf = np.fromiter(row.values(), dtype=np.float64, count=len(row))
            df = len(row)
            idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            norm = self.k1 * (1.0 - self.b + self.b * lengths[idx] / avgdl)
            self.postings[t] = (idx, idf * tf * (self.k1 + 1.0) / (tf + norm))
        self.n = n
        return self

    def search(self, query, k):
        """Top k as a list of (id, score), best first (ties: lower index first)."""
        scores = np.zeros(self.n)
        matched = np.zeros(self.n, dtype=bool)
        for t in query_tokens(query):
            p = self.postings.get(t)
            if p is not None:
                scores[p[0]] += p[1]
                matched[p[0]] = True
        cand = np.nonzero(matched)[0]
        order = cand[np.lexsort((cand, -scores[cand]))][:k]
        return [(self.ids[i], float(scores[i])) for i in order]
