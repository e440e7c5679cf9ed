"""The asyncio client on zmq.asyncio: the same calls as :class:`diffrag.Client` as coroutines,
and any number of them in flight at once on one socket (a reader task hands each reply to
the call waiting for its id)."""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import (Any, AsyncIterator, Dict, Iterable, Mapping, Optional, Sequence, Union,
                    overload)

import zmq
import zmq.asyncio
import zmq.utils.monitor

from . import _protocol as P
from .errors import ConnectionFailed, ProtocolError, Timeout
from .types import (Answer, CollectionStats, DaemonStats, DeleteResult, Delta, Document,
                    DropResult, IngestResult, ListResult, Pong)

Key = Union[str, bytes, None]


class AsyncClient:
    """A connection to diffragd for asyncio programs; the arguments are those of
    :class:`diffrag.Client`. Use it from one event loop; ``async with`` closes it."""

    def __init__(self, endpoint: str = P.DEFAULT_ENDPOINT, timeout: float = 30.0, *,
                 query_timeout: float = 600.0, connect_timeout: float = 5.0,
                 server_key: Key = None, public_key: Key = None, secret_key: Key = None,
                 context: Optional[zmq.asyncio.Context] = None) -> None:
        if min(timeout, query_timeout, connect_timeout) <= 0:
            raise ValueError("timeouts must be positive (seconds)")
        P.check_endpoint(endpoint)
        self.endpoint = endpoint
        self.timeout = timeout
        self.query_timeout = query_timeout
        self.connect_timeout = connect_timeout
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor = None
        try:
            P.configure(self._sock, server_key, public_key, secret_key)
            self._monitor = self._sock.get_monitor_socket(P.MONITOR_EVENTS)
            # connection events are read without waiting, through a blocking-API view
            self._monitor_view = zmq.Socket.shadow(self._monitor.underlying)
            self._sock.connect(endpoint)
        except BaseException:
            self._sock.close(0)
            if self._monitor is not None:
                self._monitor.close(0)
            raise
        self._ids = itertools.count(1)
        self._waiting: Dict[str, asyncio.Queue] = {}
        self._reader: Optional[asyncio.Task] = None
        self._note = ""
        self._refused = False
        self._host_ok = False

    async def close(self) -> None:
        """Stops the reader and closes the socket; calls still waiting get an error."""
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
        if not self._sock.closed:
            self._sock.close(0)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- transport ----

    def _next_id(self) -> str:
        return "#%d" % next(self._ids)

    def _drain_monitor(self) -> None:
        while self._monitor is not None:
            try:
                ev = zmq.utils.monitor.recv_monitor_message(self._monitor_view, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._note = P.event_note(ev["event"], ev["value"], self._note)
            self._refused = self._refused or P.refusal(ev["event"])

    async def _send(self, msg: Mapping[str, Any]) -> None:
        data = P.pack(msg)
        if not self._host_ok:
            # name resolution blocks: off the event loop
            problem = await asyncio.get_running_loop().run_in_executor(
                None, P.resolve_problem, self.endpoint)
            if problem is None:
                self._host_ok = True
            elif problem[0]:
                raise ConnectionFailed("no connection to %s: %s" % (self.endpoint, problem[1]))
            else:
                self._note = problem[1]
        deadline = time.monotonic() + self.connect_timeout
        while True:
            self._drain_monitor()
            left = deadline - time.monotonic()
            if self._refused:
                raise ConnectionFailed("no connection to %s: %s" % (self.endpoint, self._note))
            if left <= 0:
                raise ConnectionFailed("no connection to %s within %g s%s" % (
                    self.endpoint, self.connect_timeout, ": " + self._note if self._note else ""))
            # wake at least every 50 ms to read connection events
            if await self._sock.poll(min(left, 0.05) * 1000 + 1, zmq.POLLOUT):
                try:
                    await self._sock.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    continue

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                m = P.decode(frames)
            except ProtocolError as e:
                # whose reply it was cannot be known: every waiting call learns of it
                for q in self._waiting.values():
                    q.put_nowait(e)
                continue
            mid = m["id"]
            if isinstance(mid, str) and mid in self._waiting:
                self._waiting[mid].put_nowait(m)
            elif mid is None and P.is_final(m) and len(self._waiting) == 1:
                next(iter(self._waiting.values())).put_nowait(m)
            # else: late, for a call that timed out or was abandoned

    def _register(self, rid: str) -> asyncio.Queue:
        if rid in self._waiting:
            raise ValueError(f"id {rid!r} is already in flight on this client")
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read_loop())
        q: asyncio.Queue = asyncio.Queue()
        self._waiting[rid] = q
        return q

    async def _recv(self, q: asyncio.Queue, timeout: float) -> Dict[str, Any]:
        try:
            item = await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            raise Timeout("no reply from %s within %g s" % (self.endpoint, timeout)) from None
        if isinstance(item, Exception):
            raise item
        return item

    async def _call(self, msg: Dict[str, Any], timeout: Optional[float] = None) -> Dict[str, Any]:
        rid = msg["id"]
        q = self._register(rid)
        try:
            await self._send(msg)
            m = await self._recv(q, self.timeout if timeout is None else timeout)
        finally:
            self._waiting.pop(rid, None)
        if not P.is_final(m):
            raise ProtocolError("malformed reply: a delta answered a request that does not stream")
        P.check_ok(m)
        return m

    # ---- operations (see diffrag.Client for each) ----

    async def ping(self) -> Pong:
        t0 = time.monotonic()
        m = await self._call(P.request("ping", self._next_id()))
        return P.parse_pong(m, (time.monotonic() - t0) * 1e3)

    async def query(self, question: str, *, collection: Optional[str] = None,
                    docs: Optional[Iterable[P.DocLike]] = None,
                    ids: Optional[Sequence[str]] = None, top_k: Optional[int] = None,
                    max_context_tokens: Optional[int] = None, max_tokens: Optional[int] = None,
                    temperature: Optional[float] = None, top_p: Optional[float] = None,
                    seed: Optional[int] = None, stop: Union[str, Sequence[str], None] = None,
                    deadline_ms: Optional[int] = None, order: Optional[str] = None,
                    id: Optional[str] = None,
                    timeout: Optional[float] = None,
                    history: Optional[Iterable[Mapping[str, Any]]] = None,
                    system: Optional[str] = None,
                    unsupported: Optional[str] = None,
                    answer_mode: Optional[str] = None,
              relevance_floor: Optional[float] = None) -> Answer:
        msg = P.query_request(id or self._next_id(), question, collection=collection, docs=docs,
                              ids=ids, top_k=top_k, max_context_tokens=max_context_tokens,
                              max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              seed=seed, stop=stop, deadline_ms=deadline_ms, order=order,
                              history=history, system=system, unsupported=unsupported,
                              answer_mode=answer_mode,
                              relevance_floor=relevance_floor, stream=False)
        m = await self._call(msg, self.query_timeout if timeout is None else timeout)
        return P.parse_answer(m)

    async def stream(self, question: str, *, collection: Optional[str] = None,
                     docs: Optional[Iterable[P.DocLike]] = None,
                     ids: Optional[Sequence[str]] = None, top_k: Optional[int] = None,
                     max_context_tokens: Optional[int] = None, max_tokens: Optional[int] = None,
                     temperature: Optional[float] = None, top_p: Optional[float] = None,
                     seed: Optional[int] = None, stop: Union[str, Sequence[str], None] = None,
                     deadline_ms: Optional[int] = None, order: Optional[str] = None,
                    id: Optional[str] = None,
                     timeout: Optional[float] = None,
                     history: Optional[Iterable[Mapping[str, Any]]] = None,
                     system: Optional[str] = None,
                     unsupported: Optional[str] = None,
                     answer_mode: Optional[str] = None,
              relevance_floor: Optional[float] = None) -> AsyncIterator[Union[Delta, Answer]]:
        """Yields a :class:`Delta` per piece of generated text, then the :class:`Answer`;
        leaving early (break, cancellation of the task) cancels the query on the daemon."""
        rid = id or self._next_id()
        msg = P.query_request(rid, question, collection=collection, docs=docs, ids=ids,
                              top_k=top_k, max_context_tokens=max_context_tokens,
                              max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              seed=seed, stop=stop, deadline_ms=deadline_ms, order=order,
                              history=history, system=system, unsupported=unsupported,
                              answer_mode=answer_mode,
                              relevance_floor=relevance_floor, stream=True)
        wait = self.query_timeout if timeout is None else timeout
        q = self._register(rid)
        done = False
        try:
            await self._send(msg)
            while True:
                m = await self._recv(q, wait)
                if P.is_final(m):
                    done = True
                    P.check_ok(m)
                    yield P.parse_answer(m)
                    return
                yield Delta(id=rid, text=m["delta"])
        finally:
            self._waiting.pop(rid, None)
            if not done and not self._sock.closed:
                # a cancel whose acknowledgement nobody waits for (dropped when it comes)
                try:
                    f = self._sock.send(P.pack(P.request("cancel", self._next_id(), target=rid)),
                                        zmq.NOBLOCK)
                    f.add_done_callback(lambda f: f.cancelled() or f.exception())
                except zmq.ZMQError:
                    pass

    async def cancel(self, target: str) -> str:
        m = await self._call(P.request("cancel", self._next_id(), target=target))
        return P.parse_cancel(m)

    async def ingest(self, collection: str, docs: Iterable[Mapping[str, Any]]) -> IngestResult:
        m = await self._call(P.ingest_request(self._next_id(), collection, docs))
        return P.parse_ingest(m, collection)

    async def ingest_files(self, collection: str, paths: Iterable[Any]) -> IngestResult:
        return await self.ingest(collection, P.file_docs(paths))

    async def delete(self, collection: str, ids: Sequence[str]) -> DeleteResult:
        if isinstance(ids, str):
            ids = [ids]
        m = await self._call(P.request("delete", self._next_id(), collection=collection,
                                       ids=list(ids)))
        return P.parse_delete(m)

    async def drop(self, collection: str) -> DropResult:
        """Removes ``collection`` and every document in it, for good; returns after the
        durable commit, with the number of documents it held. :class:`~diffrag.errors.NotFound`
        when there is no such collection."""
        m = await self._call(P.request("drop", self._next_id(), collection=collection))
        return P.parse_drop(m, collection)

    async def get(self, collection: str, doc_id: str) -> Document:
        m = await self._call(P.request("get", self._next_id(), collection=collection,
                                       doc_id=doc_id))
        return P.parse_document(m)

    async def list(self, collection: Optional[str] = None, *, after: Optional[str] = None,
                   limit: Optional[int] = None) -> ListResult:
        m = await self._call(P.request("list", self._next_id(), collection=collection,
                                       after=after, limit=limit))
        return P.parse_list(m, collection)

    @overload
    async def stats(self) -> DaemonStats: ...

    @overload
    async def stats(self, collection: str) -> CollectionStats: ...

    async def stats(self, collection: Optional[str] = None) -> Union[CollectionStats, DaemonStats]:
        m = await self._call(P.request("stats", self._next_id(), collection=collection))
        return P.parse_stats(m, collection)
