"""The results of diffrag calls, as typed dataclasses. Each keeps ``raw``: the daemon's whole
reply as a dict, for fields this version of the client does not model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class Citation:
    """A chunk placed in the prompt: ``marker`` is the n of its ``[n]`` label, ``cited`` says
    whether the answer contains ``[n]``, ``offsets`` the byte range in the document."""

    doc_id: str
    chunk: int
    score: float
    offsets: Tuple[int, int]
    marker: int = 0
    cited: bool = False
    truncated: bool = False
    whole: bool = False  # the whole document: every document of the query fitted the budget
    heading: str = ""  # the chunk's heading path in a Markdown document ("" for none)
    # (first, last) pages the chunk starts and ends on, in a text with page markers (a PDF's);
    # None for none
    page: Optional[Tuple[int, int]] = None


@dataclass
class Quote:
    """A verbatim span of a quote-mode answer (``answer_mode="quote"``): ``text`` is the
    document's bytes at ``offsets`` (a byte range in the document, like a citation's), from
    the chunk labelled ``[marker]``. The answer (or, when declined, the attempt) is its quotes'
    texts one after the other."""

    marker: int
    doc_id: str
    chunk: int
    offsets: Tuple[int, int]
    text: str


@dataclass
class Usage:
    prompt_tokens: int
    context_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reused_tokens: int = 0  # document tokens blended from stored chunk KV (kv_reuse)


@dataclass
class ContextRead:
    """What the prompt held of the documents the query could read: the inline ones, those
    ``ids`` named, or those of a collection in which the search found a chunk. ``doc_tokens``
    is None when the daemon did not count them (too much text). ``history_turns`` earlier turns
    of the conversation were placed, ``history_left_out`` (the oldest) were not.
    ``chunks_below_floor``: chunks the search found that the relevance floor dropped (0 from a
    daemon that does not say). ``window``: the best document was read as a window, its opening
    in order and then the best chunks outside it (False from a daemon that does not say)."""

    documents: int = 0
    doc_tokens: Optional[int] = None
    placed_tokens: int = 0
    chunks_matched: int = 0
    chunks_placed: int = 0
    chunks_left_out: int = 0
    chunks_below_floor: int = 0
    whole: bool = False
    window: bool = False
    history_turns: int = 0
    history_left_out: int = 0


@dataclass
class Timings:
    """Milliseconds, as the daemon measured them."""

    queue_ms: float = 0.0
    retrieve_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0


@dataclass
class Grounding:
    """How far the answer rests on the documents, when the daemon reports it (the daemon's
    docs/groundedness.md defines each figure). ``score`` and ``flagged`` are None when the
    daemon has no calibrated detector for its model (``detector`` is then "none"); the ratios
    and log-probabilities are None for an answer of no token. ``self_check`` is the model's own
    probability, asked after the answer, that the documents answer the question and support the
    answer (None when the check did not run); ``context_reliance`` how much more likely the
    answer's tokens are with the documents than without them (mean log-probability difference;
    None when not measured); ``hidden_probe`` the calibration's hidden-state probe, its
    probability that the answer is not supported (None without a probe); ``quote_removed``,
    in quote mode, the mean over the answer's tokens of the probability mass the quote
    constraint removed: what the model would have said outside the documents (None for a free
    answer)."""

    score: Optional[float] = None
    flagged: Optional[bool] = None
    abstained: Optional[bool] = None
    lookback_ratio: Optional[float] = None
    unsupported_token_ratio: Optional[float] = None
    mean_logprob: Optional[float] = None
    min_logprob: Optional[float] = None
    self_check: Optional[float] = None
    context_reliance: Optional[float] = None
    hidden_probe: Optional[float] = None
    quote_removed: Optional[float] = None
    answer_tokens: Optional[int] = None
    flagged_tokens: Optional[int] = None
    detector: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class Delta:
    """A piece of a streamed answer: the text released by one generated token."""

    id: Any
    text: str


@dataclass
class Answer:
    """The final reply to a query. ``finish_reason``: stop, length, cancelled or deadline.
    ``declined``: the daemon declined to answer (a query with ``unsupported="decline"``):
    ``answer`` is then its fixed sentence, ``decline_reason`` says why ("no_match": retrieval
    found nothing on the question and nothing was generated; "flagged": the detector flagged
    the model's answer; "model_refused": the model refused), and ``attempt`` holds what the
    model generated (None for "no_match"). A streamed query's deltas showed the attempt: show
    ``answer`` instead. ``answer_mode``: "free" (the model's own words) or "quote" (every
    answer token continued a verbatim span of the documents); ``quotes`` are then those spans,
    in order (empty for a free answer)."""

    id: Any
    answer: str
    finish_reason: str
    citations: List[Citation]
    usage: Usage
    timings: Timings
    grounding: Optional[Grounding] = None
    context: Optional[ContextRead] = None
    declined: bool = False
    decline_reason: Optional[str] = None
    attempt: Optional[str] = None
    answer_mode: str = "free"
    quotes: List[Quote] = field(default_factory=list)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class Pong:
    version: str
    model: str
    rtt_ms: float
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class IngestResult:
    """``ingested`` documents (``bytes`` of text) stored; the collection now holds ``docs``
    documents in ``chunks`` chunks. Of the ingested, ``added`` were new, ``changed`` replaced
    a different document and ``unchanged`` were stored exactly so already (left as they were);
    all three are ``None`` from a daemon that does not report them."""

    collection: str
    ingested: int
    bytes: int
    docs: int
    chunks: int
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)
    added: Optional[int] = None
    changed: Optional[int] = None
    unchanged: Optional[int] = None


@dataclass
class DeleteResult:
    deleted: int
    docs: int
    chunks: int
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class DropResult:
    """The collection removed, and the ``dropped`` documents it held."""

    collection: str
    dropped: int
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class Document:
    id: str
    title: str
    text: str
    chunks: int
    meta: Optional[Dict[str, Any]] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class DocInfo:
    id: str
    title: Optional[str]
    bytes: int
    chunks: int


@dataclass
class ListResult:
    """Without a collection: ``collections``. With one: a page of ``docs`` and ``next`` (pass
    it as ``after`` for the next page; None at the end)."""

    collections: List[str] = field(default_factory=list)
    docs: List[DocInfo] = field(default_factory=list)
    next: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class CollectionStats:
    collection: str
    docs: int
    chunks: int
    terms: int
    text_bytes: int
    avg_chunk_terms: float
    chunk_tokens: int
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class DaemonStats:
    version: str
    model: str
    uptime_s: float
    workers_idle: int
    workers_busy: int
    queue_depth: int
    inflight: int
    kv_cache_bytes: int
    draining: bool
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)
