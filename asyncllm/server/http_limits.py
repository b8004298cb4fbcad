"""What ``asyncllm serve`` bounds at the HTTP layer, below the app: header size, header time, connections.

uvicorn bounds a header block only when it parses with h11 (httptools, its default when installed,
takes any size), and times a connection out only while it is idle between requests: a client that
sends its headers one byte every few seconds (slowloris) holds its connection, and a task, forever.
:class:`BoundedH11Protocol` is uvicorn's h11 protocol with a deadline for each request's headers;
the body's own deadline is the app's (``server/limits.py``), so hosts that embed ``create_app``
under another server get it too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_HEADER_BYTES = 16 * 1024   # the whole request line and header block
DEFAULT_HEADER_TIMEOUT_S = 10.0        # from the connection (or the previous answer) to the end of the headers
DEFAULT_KEEP_ALIVE_S = 5.0             # an idle connection between requests
DEFAULT_MAX_CONNECTIONS = 2048         # open connections and running requests; 503 past it


@dataclass(frozen=True)
class HTTPLimits:
    """The HTTP-layer bounds of one server (``asyncllm serve`` options of the same names)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def uvicorn_options(self) -> dict:
        """Keyword arguments of ``uvicorn.Config`` that apply these limits."""
        return {"http": bounded_protocol(self.header_timeout_s, self.max_header_bytes),
                "h11_max_incomplete_event_size": self.max_header_bytes,
                "timeout_keep_alive": self.keep_alive_s, "limit_concurrency": self.max_connections}


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than ``header_timeout_s``
    and answering 431 to a request line and headers longer than ``max_header_bytes`` (h11's own bound applies
    only to headers that arrive in pieces)."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._header_seen = b""  # this request's bytes so far while its headers are incomplete
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_seen is not None:
            seen = self._header_seen + data
            end = seen.find(b"\r\n\r\n")
            if (end if end >= 0 else len(seen)) > self.max_header_bytes:
                self._refuse_headers()
                return
            self._header_seen = None if end >= 0 else seen
        super().data_received(data)

    def _refuse_headers(self) -> None:
        self._disarm_header_deadline()
        if not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                                 b"content-length: 0\r\n\r\n")
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole request line and header block arrived
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request on this connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_seen = b""
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()


def bounded_protocol(header_timeout_s: float, max_header_bytes: int) -> type[BoundedH11Protocol]:
    """The protocol class for these bounds (uvicorn instantiates the class it is given)."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"header_timeout_s": float(header_timeout_s),
                                                              "max_header_bytes": int(max_header_bytes)})
