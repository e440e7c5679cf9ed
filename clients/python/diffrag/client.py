"""The blocking client: one DEALER socket, one call at a time, replies matched by id (a late
reply to a call that timed out is recognised and dropped)."""
from __future__ import annotations

import collections
import itertools
import time
from typing import (Any, Deque, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Set,
                    Union, overload)

import zmq
import zmq.utils.monitor

from . import _protocol as P
from .errors import ConnectionFailed, ProtocolError, Timeout
from .types import (Answer, CollectionStats, DaemonStats, DeleteResult, Delta, Document,
                    DropResult, IngestResult, ListResult, Pong)

Key = Union[str, bytes, None]


class Client:
    """A connection to diffragd.

    ``endpoint`` is ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME`` (ValueError for
    anything else); a host that does not resolve raises :class:`ConnectionFailed` at the first
    call. ``timeout`` bounds the wait for the reply of ping, ingest, delete, drop, get, list,
    stats and cancel;
    ``query_timeout`` the silence during a query (before its first delta or reply, and between
    deltas); ``connect_timeout`` the wait for a connection. Seconds, all of them.

    CurveZMQ: give the daemon's public key as ``server_key`` (Z85 text), and this client's
    ``secret_key`` (its public key is derived) when the daemon allows clients by key; without
    it a fresh key pair is made.

    Not thread-safe (a ZeroMQ socket is not): use one Client per thread. Errors are
    exceptions from :mod:`diffrag.errors`, each with the protocol's ``code``.
    """

    def __init__(self, endpoint: str = P.DEFAULT_ENDPOINT, timeout: float = 30.0, *,
                 query_timeout: float = 600.0, connect_timeout: float = 5.0,
                 server_key: Key = None, public_key: Key = None, secret_key: Key = None,
                 context: Optional[zmq.Context] = None) -> None:
        if min(timeout, query_timeout, connect_timeout) <= 0:
            raise ValueError("timeouts must be positive (seconds)")
        P.check_endpoint(endpoint)
        self.endpoint = endpoint
        self.timeout = timeout
        self.query_timeout = query_timeout
        self.connect_timeout = connect_timeout
        self._host_ok = False
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor = None
        try:
            P.configure(self._sock, server_key, public_key, secret_key)
            self._monitor = self._sock.get_monitor_socket(P.MONITOR_EVENTS)
            self._sock.connect(endpoint)
        except BaseException:
            self.close()
            raise
        self._ids = itertools.count(1)
        self._inflight: Set[str] = set()
        self._mail: Dict[str, Deque[Dict[str, Any]]] = {}
        self._note = ""
        self._refused = False

    # ---- life ----

    def close(self) -> None:
        """Closes the socket; unsent requests are dropped."""
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
        if not self._sock.closed:
            self._sock.close(0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- transport ----

    def _next_id(self) -> str:
        return "#%d" % next(self._ids)

    def _drain_monitor(self) -> None:
        while self._monitor is not None:
            try:
                ev = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._note = P.event_note(ev["event"], ev["value"], self._note)
            self._refused = self._refused or P.refusal(ev["event"])

    def _check_host(self) -> None:
        problem = P.resolve_problem(self.endpoint)
        if problem is None:
            self._host_ok = True
        elif problem[0]:
            raise ConnectionFailed("no connection to %s: %s" % (self.endpoint, problem[1]))
        else:
            self._note = problem[1]

    def _send(self, msg: Mapping[str, Any]) -> None:
        data = P.pack(msg)
        if not self._host_ok:
            self._check_host()
        deadline = time.monotonic() + self.connect_timeout
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLOUT)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            self._drain_monitor()
            left = deadline - time.monotonic()
            if self._refused:
                raise ConnectionFailed("no connection to %s: %s" % (self.endpoint, self._note))
            if left <= 0:
                raise ConnectionFailed("no connection to %s within %g s%s" % (
                    self.endpoint, self.connect_timeout, ": " + self._note if self._note else ""))
            events = dict(poller.poll(left * 1000 + 1))
            if events.get(self._sock, 0) & zmq.POLLOUT:
                try:
                    self._sock.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    continue

    def _recv(self, rid: str, timeout: float) -> Dict[str, Any]:
        box = self._mail.get(rid)
        if box:
            return box.popleft()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout("no reply from %s within %g s" % (self.endpoint, timeout))
            if not self._sock.poll(left * 1000 + 1, zmq.POLLIN):
                continue
            m = P.decode(self._sock.recv_multipart(zmq.NOBLOCK))
            mid = m["id"]
            # a nil id answers a request the daemon could not read far enough to find its id:
            # only this client's calls send on its socket, so it is the current one's
            if P.same_id(mid, rid) or (mid is None and P.is_final(m)):
                return m
            if isinstance(mid, str) and mid in self._inflight:
                self._mail.setdefault(mid, collections.deque()).append(m)
            # else: late, for a call that timed out or was abandoned

    def _register(self, rid: str) -> None:
        self._inflight.add(rid)

    def _unregister(self, rid: str) -> None:
        self._inflight.discard(rid)
        self._mail.pop(rid, None)

    def _call(self, msg: Dict[str, Any], timeout: Optional[float] = None) -> Dict[str, Any]:
        rid = msg["id"]
        self._register(rid)
        try:
            self._send(msg)
            m = self._recv(rid, self.timeout if timeout is None else timeout)
        finally:
            self._unregister(rid)
        if not P.is_final(m):
            raise ProtocolError("malformed reply: a delta answered a request that does not stream")
        P.check_ok(m)
        return m

    # ---- operations ----

    def ping(self) -> Pong:
        """Checks that the daemon answers; its version, model and the round trip."""
        t0 = time.monotonic()
        m = self._call(P.request("ping", self._next_id()))
        return P.parse_pong(m, (time.monotonic() - t0) * 1e3)

    def query(self, question: str, *, collection: Optional[str] = None,
              docs: Optional[Iterable[P.DocLike]] = None, ids: Optional[Sequence[str]] = None,
              top_k: Optional[int] = None, max_context_tokens: Optional[int] = None,
              max_tokens: Optional[int] = None, temperature: Optional[float] = None,
              top_p: Optional[float] = None, seed: Optional[int] = None,
              stop: Union[str, Sequence[str], None] = None, deadline_ms: Optional[int] = None,
              order: Optional[str] = None, id: Optional[str] = None,
              timeout: Optional[float] = None,
              history: Optional[Iterable[Mapping[str, Any]]] = None,
              system: Optional[str] = None,
              unsupported: Optional[str] = None,
              answer_mode: Optional[str] = None,
              relevance_floor: Optional[float] = None) -> Answer:
        """Answers ``question`` from ``collection`` and/or inline ``docs`` (each a str or a
        mapping with "text" and optional "id", "title"); blocks until the whole answer.
        ``max_context_tokens`` decides how much of the documents is read (documents that fit go
        in whole; ``Answer.context`` says what was left out); ``top_k`` only caps the chunks.
        ``order="document"`` lays the chosen chunks out by document and position rather than
        best first, so questions over the same documents share the prompt's cached prefix;
        ``order="nearest"`` lays them out best last, next to the question; without ``order``
        the daemon's default holds (best first, or best last on a daemon with kv_reuse = 1).
        ``history``: the earlier turns of a conversation, oldest first, each ``{"role": "user"
        | "assistant", "content": str}`` (the newest that fit go in; ``Answer.context`` counts
        them); ``system``: an instruction of your own, added after the daemon's.
        ``unsupported``: "answer", "mark" or "decline", what the daemon does with an answer
        the documents do not support (default: its configuration's); declined answers come
        back with ``Answer.declined`` and ``Answer.decline_reason``.
        ``answer_mode``: "free" (the model's own words) or "quote" (every answer token
        continues a verbatim span of the placed documents; ``Answer.quotes`` holds the spans
        with their documents and byte ranges); default: the daemon's configuration's.
        ``relevance_floor`` (0..1): chunks scoring under this share of the best one's are not
        placed, whatever the budget (0: none dropped); default: the daemon's (0.5);
        ``Answer.context.chunks_below_floor`` counts those it dropped."""
        msg = P.query_request(id or self._next_id(), question, collection=collection, docs=docs,
                              ids=ids, top_k=top_k, max_context_tokens=max_context_tokens,
                              max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              seed=seed, stop=stop, deadline_ms=deadline_ms, order=order,
                              history=history, system=system, unsupported=unsupported,
                              answer_mode=answer_mode,
                              relevance_floor=relevance_floor, stream=False)
        m = self._call(msg, self.query_timeout if timeout is None else timeout)
        return P.parse_answer(m)

    def stream(self, question: str, *, collection: Optional[str] = None,
               docs: Optional[Iterable[P.DocLike]] = None, ids: Optional[Sequence[str]] = None,
               top_k: Optional[int] = None, max_context_tokens: Optional[int] = None,
               max_tokens: Optional[int] = None, temperature: Optional[float] = None,
               top_p: Optional[float] = None, seed: Optional[int] = None,
               stop: Union[str, Sequence[str], None] = None, deadline_ms: Optional[int] = None,
               order: Optional[str] = None, id: Optional[str] = None,
               timeout: Optional[float] = None,
               history: Optional[Iterable[Mapping[str, Any]]] = None,
               system: Optional[str] = None,
               unsupported: Optional[str] = None,
               answer_mode: Optional[str] = None,
              relevance_floor: Optional[float] = None) -> Iterator[Union[Delta, Answer]]:
        """Like :meth:`query`, streaming: yields a :class:`Delta` per generated piece of text,
        then the final :class:`Answer` (whose ``answer`` is the deltas joined). Leaving the
        loop early (break, an exception, Ctrl-C) cancels the query on the daemon."""
        rid = id or self._next_id()
        msg = P.query_request(rid, question, collection=collection, docs=docs, ids=ids,
                              top_k=top_k, max_context_tokens=max_context_tokens,
                              max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              seed=seed, stop=stop, deadline_ms=deadline_ms, order=order,
                              history=history, system=system, unsupported=unsupported,
                              answer_mode=answer_mode,
                              relevance_floor=relevance_floor, stream=True)
        wait = self.query_timeout if timeout is None else timeout
        self._register(rid)
        done = False
        try:
            self._send(msg)
            while True:
                m = self._recv(rid, wait)
                if P.is_final(m):
                    done = True
                    P.check_ok(m)
                    yield P.parse_answer(m)
                    return
                yield Delta(id=rid, text=m["delta"])
        finally:
            self._unregister(rid)
            if not done:
                self._cancel_quietly(rid)

    def _cancel_quietly(self, target: str) -> None:
        """A cancel whose acknowledgement nobody waits for (it is dropped when it comes)."""
        try:
            self._sock.send(P.pack(P.request("cancel", self._next_id(), target=target)),
                            zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def cancel(self, target: str) -> str:
        """Cancels the query with id ``target`` sent on this client and still in flight (call
        it while iterating :meth:`stream`). Returns its state: "running", "queued" or
        "retrieving". :class:`~diffrag.errors.NotFound` when nothing has that id."""
        return P.parse_cancel(self._call(P.request("cancel", self._next_id(), target=target)))

    def ingest(self, collection: str, docs: Iterable[Mapping[str, Any]]) -> IngestResult:
        """Stores documents ({"id", "text", "title"?, "meta"?}, or a file's content as
        {"name", "bytes", "id"?, "title"?, "meta"?}: the daemon extracts PDF, DOCX and HTML) in
        ``collection``, created on first use; an existing id is replaced. Returns after the
        durable commit."""
        m = self._call(P.ingest_request(self._next_id(), collection, docs))
        return P.parse_ingest(m, collection)

    def ingest_files(self, collection: str, paths: Iterable[Any]) -> IngestResult:
        """Sends the files' bytes to be stored, each with its file name as name and id (the
        daemon extracts PDF, DOCX and HTML; docs/protocol.md#ingest)."""
        return self.ingest(collection, P.file_docs(paths))

    def delete(self, collection: str, ids: Sequence[str]) -> DeleteResult:
        """Removes documents by id (ids not present are skipped)."""
        if isinstance(ids, str):
            ids = [ids]
        m = self._call(P.request("delete", self._next_id(), collection=collection, ids=list(ids)))
        return P.parse_delete(m)

    def drop(self, collection: str) -> DropResult:
        """Removes ``collection`` and every document in it, for good; returns after the
        durable commit, with the number of documents it held. :class:`~diffrag.errors.NotFound`
        when there is no such collection."""
        m = self._call(P.request("drop", self._next_id(), collection=collection))
        return P.parse_drop(m, collection)

    def get(self, collection: str, doc_id: str) -> Document:
        """One stored document, with its meta."""
        m = self._call(P.request("get", self._next_id(), collection=collection, doc_id=doc_id))
        return P.parse_document(m)

    def list(self, collection: Optional[str] = None, *, after: Optional[str] = None,
             limit: Optional[int] = None) -> ListResult:
        """The collections, or one page of a collection's documents after the id ``after``."""
        m = self._call(P.request("list", self._next_id(), collection=collection, after=after,
                                 limit=limit))
        return P.parse_list(m, collection)

    @overload
    def stats(self) -> DaemonStats: ...

    @overload
    def stats(self, collection: str) -> CollectionStats: ...

    def stats(self, collection: Optional[str] = None) -> Union[CollectionStats, DaemonStats]:
        """The daemon's state, or a collection's statistics."""
        m = self._call(P.request("stats", self._next_id(), collection=collection))
        return P.parse_stats(m, collection)
