"""Watching a server close connections that never complete a request header (the header
deadline's tests: tests/unit/test_http_protocol.py, tests/e2e/test_server_http.py)."""

from __future__ import annotations

import selectors
import socket
import time


def closed(sock: socket.socket) -> bool:
    """Whether the peer closed `sock` (read once it is readable)."""
    try:
        return sock.recv(4096) == b""
    except OSError:
        return True


def watch_closes(socks: dict, trickler: str, trickle: bytes, limit_s: float,
                 poll_s: float) -> tuple:
    """Until the server has closed every socket of `socks` ({name: socket}) or limit_s passes,
    send socks[trickler] one byte of `trickle` a poll while it is open -> ({name: seconds from
    the start until the server closed it}, bytes trickled)."""
    t0 = time.monotonic()
    sel = selectors.DefaultSelector()
    for name, s in socks.items():
        sel.register(s, selectors.EVENT_READ, name)
    closed_at, sent = {}, 0
    while len(closed_at) < len(socks) and time.monotonic() - t0 < limit_s:
        for key, _ in sel.select(timeout=poll_s):
            if closed(key.fileobj):
                closed_at[key.data] = time.monotonic() - t0
                sel.unregister(key.fileobj)
        if trickler not in closed_at and sent < len(trickle):
            try:
                socks[trickler].sendall(trickle[sent:sent + 1])
                sent += 1
            except OSError:
                pass
    sel.close()
    return closed_at, sent
