"""diffrag: the Python client of diffragd, speaking the wire protocol of docs/protocol.md
(msgpack maps over a ZeroMQ DEALER socket).

    import diffrag
    with diffrag.Client("tcp://127.0.0.1:7400") as c:
        a = c.query("How do I cancel a query?", collection="docs")
        print(a.answer, [x.doc_id for x in a.citations])
        for item in c.stream("What does /readyz report?", collection="docs"):
            if isinstance(item, diffrag.Delta):
                print(item.text, end="", flush=True)

:class:`AsyncClient` offers the same calls as coroutines; errors are the exceptions of
:mod:`diffrag.errors`, each carrying the protocol's error ``code``.
"""
from ._protocol import DEFAULT_ENDPOINT, PROTOCOL_VERSION
from .aio import AsyncClient
from .client import Client
from .errors import (BadRequest, Cancelled, ConnectionFailed, DeadlineExceeded, DiffragError,
                     InternalError, NotFound, Overloaded, ProtocolError, ServerError,
                     ShuttingDown, Timeout, TooLarge, UnsupportedVersion)
from .types import (Answer, Citation, CollectionStats, ContextRead, DaemonStats, DeleteResult, Delta, DocInfo,
                    Document, DropResult, Grounding, IngestResult, ListResult, Pong, Quote,
                    Timings, Usage)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "Client", "DEFAULT_ENDPOINT", "PROTOCOL_VERSION",
    "DiffragError", "ServerError", "BadRequest", "TooLarge", "Overloaded", "NotFound",
    "DeadlineExceeded", "Cancelled", "ShuttingDown", "UnsupportedVersion", "InternalError",
    "ConnectionFailed", "Timeout", "ProtocolError",
    "Answer", "Citation", "CollectionStats", "ContextRead", "DaemonStats", "DeleteResult", "Delta", "DocInfo",
    "Document", "DropResult", "Grounding", "IngestResult", "ListResult", "Pong", "Quote", "Timings",
    "Usage",
]
