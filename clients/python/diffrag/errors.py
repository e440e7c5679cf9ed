"""Exceptions of the diffrag client. Every one carries ``code``: the daemon's error code for
errors it answered with (docs/protocol.md), or the client's own: ``connect``, ``timeout``,
``protocol``."""
from __future__ import annotations

from typing import Dict, Type


class DiffragError(Exception):
    """Base of every diffrag error; ``code`` is for programs, ``message`` for people."""

    code: str = "error"

    def __init__(self, message: str, code: str | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{self.code}: {message}")


class ServerError(DiffragError):
    """The daemon answered ``{"ok": false, "error": {"code", "message"}}``."""

    code = "server_error"


class BadRequest(ServerError):
    code = "bad_request"


class TooLarge(ServerError):
    code = "too_large"


class Overloaded(ServerError):
    """The daemon's queue is full: retry later."""

    code = "overloaded"


class NotFound(ServerError):
    code = "not_found"


class DeadlineExceeded(ServerError):
    code = "deadline_exceeded"


class Cancelled(ServerError):
    """The query was cancelled before it started generating."""

    code = "cancelled"


class ShuttingDown(ServerError):
    code = "shutting_down"


class UnsupportedVersion(ServerError):
    code = "unsupported_version"


class InternalError(ServerError):
    code = "internal"


class ConnectionFailed(DiffragError, ConnectionError):
    """No connection within ``connect_timeout`` (nothing listens at the endpoint), or the
    CurveZMQ handshake refused: a refused key or a mismatched security mechanism is raised as
    soon as ZeroMQ reports it, without waiting for the timeout."""

    code = "connect"


class Timeout(DiffragError, TimeoutError):
    """Connected, but no reply (or no next delta) within the timeout."""

    code = "timeout"


class ProtocolError(DiffragError):
    """A reply that breaks the wire protocol (not one msgpack map, a mistyped field...)."""

    code = "protocol"


SERVER_ERRORS: Dict[str, Type[ServerError]] = {
    cls.code: cls
    for cls in (BadRequest, TooLarge, Overloaded, NotFound, DeadlineExceeded, Cancelled,
                ShuttingDown, UnsupportedVersion, InternalError)
}


def server_error(code: str, message: str) -> ServerError:
    """The exception for an error reply: a subclass per known code, else ServerError."""
    cls = SERVER_ERRORS.get(code)
    return cls(message) if cls else ServerError(message, code)
