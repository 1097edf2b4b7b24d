"""The server's HTTP/1.1 protocol: uvicorn's, with a deadline for request headers; its httptools
protocol (a C parser: a streamed chunk costs less CPU on it) where httptools is installed, else
h11's.

uvicorn closes a connection left idle after a response (`timeout_keep_alive`), but not one that
was just opened and sends nothing, nor one that sends a request header a byte at a time: its
timer starts only after a response, and any byte received stops it. Each such connection holds
a socket and a file descriptor for as long as the client likes, so a few thousand of them
exhaust the server's descriptors (slowloris). Here the same timer also runs from the moment a
connection opens, and only a complete request header stops it: a connection must deliver one
within `timeout_keep_alive` seconds of opening or of its last response, or it is closed.

The httptools protocol also puts in each request's ASGI scope, under HEADER_PARSED, the
time.monotonic() at which its header was parsed, where the request's task is made: the server
measures from there to its handler's start (ServerMetrics.on_handler_start), the event loop's
delay in starting requests.
"""

from __future__ import annotations

import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_PARSED = "outpace.header_parsed"  # an ASGI scope key: see the module's docstring


class HeaderDeadlineH11Protocol(H11Protocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        # uvicorn stops the timer here, on any byte; handle_events stops it once a whole request
        # header has been parsed, which is the only thing that may stop it
        self.conn.receive_data(data)
        self.handle_events()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self._unset_keepalive_if_required()  # uvicorn keeps the timer of a reset connection

    def timeout_keep_alive_handler(self) -> None:
        try:
            super().timeout_keep_alive_handler()
        except h11.LocalProtocolError:  # a state h11 can't close from: close the socket anyway
            self.transport.close()


try:  # httptools is optional: uvicorn's protocol over it imports it
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is a dependency; h11 serves without it
    HttpToolsProtocol = None


if HttpToolsProtocol is not None:
    class HeaderDeadlineHttpToolsProtocol(HttpToolsProtocol):
        _before_header = False  # inside data_received until a request header is complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            # uvicorn stops the timer as data_received begins, on any byte: that stop is
            # skipped here, and on_headers_complete, a whole request header parsed, stops it
            self._before_header = True
            try:
                super().data_received(data)
            finally:
                self._before_header = False

        def _unset_keepalive_if_required(self) -> None:
            if not self._before_header:
                super()._unset_keepalive_if_required()

        def on_headers_complete(self) -> None:
            self.scope[HEADER_PARSED] = time.monotonic()
            self._before_header = False
            super()._unset_keepalive_if_required()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            super().connection_lost(exc)
            self._before_header = False
            self._unset_keepalive_if_required()  # uvicorn keeps the timer of a reset connection


def header_deadline_protocol(prefer_httptools: bool = True) -> type:
    """The protocol class the server runs: httptools' where it is installed (and preferred),
    else h11's."""
    if prefer_httptools and HttpToolsProtocol is not None:
        return HeaderDeadlineHttpToolsProtocol
    return HeaderDeadlineH11Protocol
