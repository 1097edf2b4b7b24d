"""The server's HTTP protocols (outpace/entrypoints/openai/http_protocol.py), httptools' and
h11's: a connection must deliver a complete request header within timeout_keep_alive of opening
or of its last response, whatever bytes it trickles meanwhile; a complete request is answered.
Against uvicorn serving a trivial app on a thread, with a short deadline."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from outpace.entrypoints.openai.http_protocol import (HeaderDeadlineH11Protocol,
                                                      HttpToolsProtocol, header_deadline_protocol)
from tests.http_watch import watch_closes

DEADLINE_S = 1.0
PROTOCOLS = [HeaderDeadlineH11Protocol]
if HttpToolsProtocol is not None:
    PROTOCOLS.append(header_deadline_protocol())


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=PROTOCOLS, ids=lambda c: c.__name__)
def address(request):
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           http=request.param, lifespan="off",
                                           timeout_keep_alive=DEADLINE_S))
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield sock.getsockname()[:2]
    server.should_exit = True
    thread.join(5)
    sock.close()


def _request(sock) -> bytes:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while not data.endswith(b"ok"):
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_no_complete_header_within_the_deadline_closes_the_connection(address):
    trickle = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 200
    socks = {name: socket.create_connection(address, timeout=5)
             for name in ("silent", "partial", "trickle", "answered")}
    socks["partial"].sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    # a response, then nothing: the deadline runs again from the response
    assert _request(socks["answered"]).startswith(b"HTTP/1.1 200")
    try:
        closed_at, sent = watch_closes(socks, "trickle", trickle, DEADLINE_S + 5, 0.05)
        assert set(closed_at) == set(socks), closed_at
        for name, t in closed_at.items():
            assert t <= DEADLINE_S + 1.5, (name, t)
        assert sent > 10  # the trickler was still sending when it was cut off
        with socket.create_connection(address, timeout=5) as s:  # others are served
            assert _request(s).startswith(b"HTTP/1.1 200")
    finally:
        for s in socks.values():
            s.close()


def test_requests_on_one_connection_are_answered(address):
    with socket.create_connection(address, timeout=5) as s:
        for _ in range(3):
            assert _request(s).startswith(b"HTTP/1.1 200")
