"""What the sync and asyncio clients share: request maps, the checks every reply passes
(docs/protocol.md: one msgpack map with an "id", then "ok" or "delta"), typed parsing of the
results, socket options (CurveZMQ included) and the reading of connection events."""
from __future__ import annotations

import os
import re
import socket
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import msgpack
import zmq
import zmq.utils.z85

from .errors import ProtocolError, server_error
from .types import (Answer, Citation, CollectionStats, ContextRead, DaemonStats, DeleteResult, DocInfo,
                    Document, DropResult, Grounding, IngestResult, ListResult, Pong, Quote,
                    Timings, Usage)

PROTOCOL_VERSION = 1
DEFAULT_ENDPOINT = "tcp://127.0.0.1:7400"

DocLike = Union[str, Mapping[str, Any]]


# ---- requests ----

def request(op: str, rid: Any, **fields: Any) -> Dict[str, Any]:
    """A request map; fields that are None are left out (the daemon's defaults apply)."""
    m: Dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op, "id": rid}
    m.update({k: v for k, v in fields.items() if v is not None})
    return m


def _doc(d: DocLike, i: int, need_id: bool, with_meta: bool) -> Dict[str, Any]:
    if isinstance(d, str):
        if need_id:
            raise ValueError(f"docs[{i}]: ingest needs {{'id': ..., 'text': ...}}, not a str")
        return {"text": d}
    if not isinstance(d, Mapping):
        raise TypeError(f"docs[{i}]: expected a str or a mapping, not {type(d).__name__}")
    if need_id and d.get("bytes") is not None:
        # a file's content: the daemon finds its format and extracts PDF, DOCX and HTML
        if d.get("text") is not None:
            raise ValueError(f"docs[{i}] has both text and bytes; give one")
        if not isinstance(d["bytes"], (bytes, bytearray, memoryview)):
            raise TypeError(f"docs[{i}].bytes must be bytes, not {type(d['bytes']).__name__}")
        if not isinstance(d.get("name"), str) or not d["name"]:
            raise ValueError(f"docs[{i}] has bytes but no name (the file's name)")
        out = {k: d[k] for k in ("id", "title", "meta", "name") if d.get(k) is not None}
        out["bytes"] = bytes(d["bytes"])
        return out
    if not isinstance(d.get("text"), str):
        raise ValueError(f"docs[{i}] has no text" + (" (or bytes and a name)" if need_id else ""))
    if need_id and not isinstance(d.get("id"), str):
        raise ValueError(f"docs[{i}] has no id")
    keys = ("id", "title", "text", "meta") if with_meta else ("id", "title", "text")
    return {k: d[k] for k in keys if d.get(k) is not None}


def file_docs(paths: Iterable[Any]) -> List[Dict[str, Any]]:
    """Documents of files' bytes, each named by its file name (its id too)."""
    docs = []
    for p in paths:
        path = os.fspath(p)
        with open(path, "rb") as f:
            data = f.read()
        docs.append({"name": os.path.basename(path) or path, "bytes": data})
    return docs


def query_request(rid: Any, question: str, *, collection: Optional[str],
                  docs: Optional[Iterable[DocLike]], ids: Optional[Sequence[str]],
                  top_k: Optional[int], max_context_tokens: Optional[int],
                  max_tokens: Optional[int], temperature: Optional[float],
                  top_p: Optional[float], seed: Optional[int],
                  stop: Union[str, Sequence[str], None], deadline_ms: Optional[int],
                  stream: bool, order: Optional[str] = None,
                  history: Optional[Iterable[Mapping[str, Any]]] = None,
                  system: Optional[str] = None,
                  unsupported: Optional[str] = None,
                  answer_mode: Optional[str] = None,
                  relevance_floor: Optional[float] = None) -> Dict[str, Any]:
    if not isinstance(question, str) or not question:
        raise ValueError("a query needs a question")
    turns = None if history is None else [dict(t) for t in history]
    doc_list = None if docs is None else [_doc(d, i, False, False) for i, d in enumerate(docs)]
    if not doc_list and collection is None:
        raise ValueError("a query needs documents (docs) or a collection, or both")
    return request("query", rid, question=question, docs=doc_list or None,
                   collection=collection, ids=list(ids) if ids is not None else None,
                   top_k=top_k, max_context_tokens=max_context_tokens, max_tokens=max_tokens,
                   temperature=temperature, top_p=top_p, seed=seed,
                   stop=stop if isinstance(stop, (str, type(None))) else list(stop),
                   deadline_ms=deadline_ms, order=order, history=turns or None, system=system,
                   unsupported=unsupported, answer_mode=answer_mode,
                   relevance_floor=relevance_floor, stream=True if stream else None)


def ingest_request(rid: Any, collection: str, docs: Iterable[Mapping[str, Any]]) -> Dict[str, Any]:
    doc_list = [_doc(d, i, True, True) for i, d in enumerate(docs)]
    if not doc_list:
        raise ValueError("ingest needs at least one document")
    return request("ingest", rid, collection=collection, docs=doc_list)


def pack(msg: Mapping[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


# ---- replies ----

def decode(frames: List[bytes]) -> Dict[str, Any]:
    """One message from the daemon, checked: a single frame holding one msgpack map with an
    "id" and either a boolean "ok" or a string "delta"."""
    if len(frames) != 1:
        raise ProtocolError(f"malformed reply: {len(frames)} frames (the protocol sends one)")
    if not frames[0]:
        raise ProtocolError("malformed reply: empty frame")
    try:
        # strict_map_key: every key a str; the default limits bound claims by the frame size
        m = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed reply: {e.__class__.__name__}: {e}") from None
    except RecursionError:
        raise ProtocolError("malformed reply: nested too deep") from None
    if not isinstance(m, dict):
        raise ProtocolError(f"malformed reply: a {type(m).__name__}, not a map")
    if "id" not in m:
        raise ProtocolError('malformed reply: no "id"')
    if "ok" in m:
        if not isinstance(m["ok"], bool):
            raise ProtocolError('malformed reply: "ok" is not a boolean')
    elif not isinstance(m.get("delta"), str):
        raise ProtocolError('malformed reply: neither "ok" nor a string "delta"')
    return m


def is_final(m: Mapping[str, Any]) -> bool:
    return "ok" in m


def same_id(a: Any, b: Any) -> bool:
    """Ids match by type and value (1 and "1" differ; True is not 1)."""
    return type(a) is type(b) and a == b


def check_ok(m: Mapping[str, Any]) -> None:
    """Raises the exception of an error reply."""
    if m["ok"]:
        return
    err = m.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("code"), str) or \
            not isinstance(err.get("message", ""), str):
        raise ProtocolError('malformed reply: an error reply needs "error": '
                            '{"code": str, "message": str}')
    raise server_error(err["code"], err.get("message", ""))


class _Fields:
    """Typed reads of a reply's fields, naming the field that is wrong."""

    def __init__(self, m: Any, where: str = "") -> None:
        if not isinstance(m, dict):
            raise ProtocolError(f"malformed reply: {where or 'reply'} is not a map")
        self.m = m
        self.where = where

    def _bad(self, key: str, want: str) -> ProtocolError:
        name = f"{self.where}.{key}" if self.where else key
        got = self.m.get(key)
        return ProtocolError(f"malformed reply: field {name}: expected {want}, got "
                             f"{type(got).__name__}")

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.m:
            if required:
                name = f"{self.where}.{key}" if self.where else key
                raise ProtocolError(f"malformed reply: field {name} is missing")
            return None
        return self.m[key]

    def str(self, key: str, required: bool = True) -> Optional[str]:
        v = self._get(key, required)
        if v is not None and not isinstance(v, str):
            raise self._bad(key, "a string")
        return v

    def int(self, key: str, required: bool = True) -> Optional[int]:
        v = self._get(key, required)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise self._bad(key, "an integer")
        return v

    def num(self, key: str, required: bool = True) -> Optional[float]:
        v = self._get(key, required)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise self._bad(key, "a number")
        return None if v is None else float(v)

    def bool(self, key: str, required: bool = True) -> Optional[bool]:
        v = self._get(key, required)
        if v is not None and not isinstance(v, bool):
            raise self._bad(key, "a boolean")
        return v

    def list(self, key: str, required: bool = True) -> Optional[list]:
        v = self._get(key, required)
        if v is not None and not isinstance(v, list):
            raise self._bad(key, "an array")
        return v

    def sub(self, key: str, required: bool = True) -> Optional["_Fields"]:
        v = self._get(key, required)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._bad(key, "a map")
        return _Fields(v, f"{self.where}.{key}" if self.where else key)


def parse_answer(m: Dict[str, Any]) -> Answer:
    f = _Fields(m)
    answer, finish = f.str("answer"), f.str("finish_reason")
    cites = []
    for i, c in enumerate(f.list("citations")):
        cf = _Fields(c, f"citations[{i}]")
        off = cf.list("offsets")
        if len(off) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in off):
            raise ProtocolError(f"malformed reply: field citations[{i}].offsets: expected "
                                "[start, end]")
        page = cf.list("page", False)
        if page is not None and (len(page) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in page)
                or page[1] < page[0]):
            raise ProtocolError(f"malformed reply: field citations[{i}].page: expected "
                                "[first, last] or nil")
        cites.append(Citation(doc_id=cf.str("doc_id"), chunk=cf.int("chunk"),
                              score=cf.num("score"), offsets=(off[0], off[1]),
                              marker=cf.int("marker", False) or 0,
                              cited=bool(cf.bool("cited", False)),
                              truncated=bool(cf.bool("truncated", False)),
                              whole=bool(cf.bool("whole", False)),
                              heading=cf.str("heading", False) or "",
                              page=(page[0], page[1]) if page is not None else None))
    u = f.sub("usage")
    usage = Usage(prompt_tokens=u.int("prompt_tokens"),
                  context_tokens=u.int("context_tokens", False) or 0,
                  completion_tokens=u.int("completion_tokens"),
                  cached_tokens=u.int("cached_tokens", False) or 0,
                  reused_tokens=u.int("reused_tokens", False) or 0)
    t = f.sub("timings", False)
    timings = Timings(**{k: (t.num(k, False) or 0.0) for k in Timings.__dataclass_fields__}) \
        if t else Timings()
    g = m.get("grounding")
    grounding = None
    if isinstance(g, dict):
        # informational and still evolving: a field of another type reads as None, never a
        # reason to lose the answer (raw keeps everything)
        def pick(key: str, *types: type) -> Any:
            v = g.get(key)
            return v if isinstance(v, types) and not (isinstance(v, bool) and bool not in types) \
                else None
        grounding = Grounding(score=pick("score", int, float), flagged=pick("flagged", bool),
                              abstained=pick("abstained", bool),
                              lookback_ratio=pick("lookback_ratio", int, float),
                              unsupported_token_ratio=pick("unsupported_token_ratio", int, float),
                              mean_logprob=pick("mean_logprob", int, float),
                              min_logprob=pick("min_logprob", int, float),
                              self_check=pick("self_check", int, float),
                              context_reliance=pick("context_reliance", int, float),
                              hidden_probe=pick("hidden_probe", int, float),
                              quote_removed=pick("quote_removed", int, float),
                              answer_tokens=pick("answer_tokens", int),
                              flagged_tokens=pick("flagged_tokens", int),
                              detector=pick("detector", str), raw=g)
    cx = m.get("context")
    context = None
    if isinstance(cx, dict):
        def count(key: str) -> Optional[int]:
            v = cx.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None
        context = ContextRead(documents=count("documents") or 0, doc_tokens=count("doc_tokens"),
                              placed_tokens=count("placed_tokens") or 0,
                              chunks_matched=count("chunks_matched") or 0,
                              chunks_placed=count("chunks_placed") or 0,
                              chunks_left_out=count("chunks_left_out") or 0,
                              chunks_below_floor=count("chunks_below_floor") or 0,
                              whole=cx.get("whole") is True,
                              window=cx.get("window") is True,
                              history_turns=count("history_turns") or 0,
                              history_left_out=count("history_left_out") or 0)
    quotes = []
    for i, q in enumerate(f.list("quotes", False) or []):
        qf = _Fields(q, f"quotes[{i}]")
        off = qf.list("offsets")
        if len(off) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in off):
            raise ProtocolError(f"malformed reply: field quotes[{i}].offsets: expected "
                                "[start, end]")
        quotes.append(Quote(marker=qf.int("marker"), doc_id=qf.str("doc_id"),
                            chunk=qf.int("chunk"), offsets=(off[0], off[1]),
                            text=qf.str("text")))
    # a daemon before declining existed sends none of these: not declined
    return Answer(id=m["id"], answer=answer, finish_reason=finish, citations=cites, usage=usage,
                  timings=timings, grounding=grounding, context=context,
                  declined=f.bool("declined", False) is True,
                  decline_reason=f.str("decline_reason", False),
                  attempt=f.str("attempt", False),
                  # a daemon before quote mode existed sends neither: a free answer
                  answer_mode=f.str("answer_mode", False) or "free", quotes=quotes, raw=m)


def parse_pong(m: Dict[str, Any], rtt_ms: float) -> Pong:
    f = _Fields(m)
    if f.bool("pong") is not True:
        raise ProtocolError("malformed reply: field pong: expected true")
    return Pong(version=f.str("version", False) or "", model=f.str("model", False) or "",
                rtt_ms=rtt_ms, raw=m)


def parse_ingest(m: Dict[str, Any], collection: str) -> IngestResult:
    f = _Fields(m)
    return IngestResult(collection=f.str("collection", False) or collection,
                        ingested=f.int("ingested"), bytes=f.int("bytes", False) or 0,
                        docs=f.int("docs"), chunks=f.int("chunks"), raw=m,
                        added=f.int("added", False), changed=f.int("changed", False),
                        unchanged=f.int("unchanged", False))


def parse_delete(m: Dict[str, Any]) -> DeleteResult:
    f = _Fields(m)
    return DeleteResult(deleted=f.int("deleted"), docs=f.int("docs", False) or 0,
                        chunks=f.int("chunks", False) or 0, raw=m)


def parse_drop(m: Dict[str, Any], collection: str) -> DropResult:
    f = _Fields(m)
    return DropResult(collection=f.str("collection", False) or collection,
                      dropped=f.int("dropped"), raw=m)


def parse_document(m: Dict[str, Any]) -> Document:
    d = _Fields(m).sub("doc")
    meta = d.sub("meta", False)
    return Document(id=d.str("id"), title=d.str("title", False) or "", text=d.str("text"),
                    chunks=d.int("chunks", False) or 0, meta=meta.m if meta else None, raw=m)


def parse_list(m: Dict[str, Any], collection: Optional[str]) -> ListResult:
    f = _Fields(m)
    if collection is None:
        names = f.list("collections")
        if not all(isinstance(n, str) for n in names):
            raise ProtocolError("malformed reply: field collections: expected strings")
        return ListResult(collections=names, raw=m)
    docs = []
    for i, d in enumerate(f.list("docs")):
        df = _Fields(d, f"docs[{i}]")
        docs.append(DocInfo(id=df.str("id"), title=df.str("title", False),
                            bytes=df.int("bytes", False) or 0, chunks=df.int("chunks", False) or 0))
    nxt = m.get("next")
    if nxt is not None and not isinstance(nxt, str):
        raise ProtocolError("malformed reply: field next: expected a string or nil")
    return ListResult(docs=docs, next=nxt, raw=m)


def parse_stats(m: Dict[str, Any], collection: Optional[str]) -> Union[CollectionStats, DaemonStats]:
    f = _Fields(m)
    if collection is not None:
        return CollectionStats(collection=f.str("collection", False) or collection,
                               docs=f.int("docs"), chunks=f.int("chunks"),
                               terms=f.int("terms", False) or 0,
                               text_bytes=f.int("text_bytes", False) or 0,
                               avg_chunk_terms=f.num("avg_chunk_terms", False) or 0.0,
                               chunk_tokens=f.int("chunk_tokens", False) or 0, raw=m)
    w = f.sub("workers", False)
    return DaemonStats(version=f.str("version"), model=f.str("model", False) or "",
                       uptime_s=f.num("uptime_s", False) or 0.0,
                       workers_idle=(w.int("idle", False) or 0) if w else 0,
                       workers_busy=(w.int("busy", False) or 0) if w else 0,
                       queue_depth=f.int("queue_depth", False) or 0,
                       inflight=f.int("inflight", False) or 0,
                       kv_cache_bytes=f.int("kv_cache_bytes", False) or 0,
                       draining=bool(f.bool("draining", False)), raw=m)


def parse_cancel(m: Dict[str, Any]) -> str:
    return _Fields(m).str("state")


# ---- sockets ----

ENDPOINT_FORMS = "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"
_ENDPOINT = re.compile(r"(tcp://.+:[0-9]+|ipc://.+|inproc://.+)", re.S)


def check_endpoint(endpoint: str) -> None:
    """Raises ValueError for an endpoint not of a form a client connects to (ZeroMQ itself
    says only "Invalid argument" to "127.0.0.1:7400")."""
    if not isinstance(endpoint, str) or not _ENDPOINT.fullmatch(endpoint):
        raise ValueError(f"endpoint '{endpoint}': {ENDPOINT_FORMS}")


def _endpoint_host(endpoint: str) -> Optional[str]:
    """The host of a tcp://[SOURCE;]HOST:PORT endpoint, None for other transports."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[6:].split(";")[-1].rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host if host and host != "*" else None


_UNRESOLVABLE = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_FAIL", "EAI_NODATA",
                                               "EAI_ADDRFAMILY") if hasattr(socket, n)}


def resolve_problem(endpoint: str) -> Optional[Tuple[bool, str]]:
    """None when the endpoint's host resolves (or it has none); else (definitive, note): a
    host that does not exist fails a call at once (ZeroMQ would retry it until
    connect_timeout and say nothing), a temporary failure only explains a later timeout."""
    host = _endpoint_host(endpoint)
    if host is None:
        return None
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _UNRESOLVABLE:
            return True, f'the host "{host}" does not resolve ({e.strerror})'
        return False, f'the host "{host}" does not resolve now ({e.strerror})'
    except (UnicodeError, OSError) as e:
        return True, f'the host "{host}" does not resolve ({e})'
    return None

MONITOR_EVENTS = (zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED |
                  zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                  zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)


def _key(k: Union[str, bytes]) -> bytes:
    b = k.encode("ascii") if isinstance(k, str) else bytes(k)
    b = b.strip()
    if len(b) != 40:
        raise ValueError("a CurveZMQ key is 40 characters of Z85 text")
    try:
        zmq.utils.z85.decode(b)
    except (ValueError, KeyError, IndexError):
        raise ValueError("a CurveZMQ key is 40 characters of Z85 text") from None
    return b


def configure(sock: zmq.Socket, server_key: Union[str, bytes, None],
              public_key: Union[str, bytes, None], secret_key: Union[str, bytes, None]) -> None:
    """Socket options before connecting: no linger, IMMEDIATE (nothing is queued before a
    connection is up, so a send that waits for one tells "nothing listens" from "slow"),
    and CurveZMQ when server_key is given (a fresh client key pair when secret_key is not)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    if server_key is None:
        if public_key is not None or secret_key is not None:
            raise ValueError("a client key pair needs the server's public key (server_key)")
        return
    server = _key(server_key)
    if secret_key is not None:
        secret = _key(secret_key)
        public = _key(public_key) if public_key is not None else zmq.curve_public(secret)
    elif public_key is not None:
        raise ValueError("public_key without secret_key")
    else:
        public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def refusal(event: int) -> bool:
    """Whether a connection event is a definite refusal (the key or the security mechanism),
    which retrying cannot mend: the client reports it at once instead of at its timeout."""
    return event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


def event_note(event: int, value: int, note: str) -> str:
    """What a monitor event says about the connection, for ConnectionFailed messages."""
    if event == zmq.EVENT_CONNECT_RETRIED:
        return note or "connection refused: is diffragd running and listening there?"
    if event == zmq.EVENT_CONNECTED:
        return "the TCP connection was made but the ZeroMQ handshake did not complete"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the daemon refused this client's CurveZMQ key (ZAP status {value}): is its "
                "public key allowed there?")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000002):
            return ("security mechanism mismatch: the daemon and this client disagree on "
                    "CurveZMQ (give or drop the server key)")
        return f"the handshake failed (ZMTP protocol error {value:#x}): a wrong server key?"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        if note.startswith("security mechanism"):
            return note
        return (f"the handshake failed: {zmq.strerror(value)} (does the daemon require "
                "CurveZMQ, or this client's server key not match it?)")
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return ""
    return note
