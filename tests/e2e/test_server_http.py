"""HTTP habits of the shared `outpace serve`: /version, one access-log line per request, and a
deadline for request headers (a connection that sends nothing, or a header a byte at a time,
is closed after timeout_keep_alive seconds; the default is 5)."""

from __future__ import annotations

import re
import socket
import uuid

import httpx

import outpace
from outpace.entrypoints.cli import main
from tests.e2e.server_helpers import wait_for
from tests.http_watch import watch_closes

HEADER_TIMEOUT_S = 5.0  # ServerConfig.timeout_keep_alive's default, which the server runs with


def test_version_is_open_like_health(server):
    r = httpx.get(server.url + "/version", timeout=30)  # no API key
    assert r.status_code == 200 and r.json() == {"version": outpace.__version__}


def _log_count(srv, pattern: str) -> int:
    return len(re.findall(pattern, srv.log_path.read_text(errors="replace")))


def test_one_access_log_line_per_request(server):
    missing = f"/v1/models/{uuid.uuid4().hex}"
    version = r'"GET /version" 200 \d+\.\d ms'
    stream = r'"POST /v1/completions" 200 \d+\.\d ms'
    with server.client() as c:
        assert c.get(missing).status_code == 404
        assert c.get("/version").status_code == 200
        body = {"prompt": "log me", "max_tokens": 3, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        assert c.post("/v1/completions", content=b"{}", headers={
            "Content-Type": "text/plain"}).status_code == 415
    line = wait_for(lambda: re.search(rf'127\.0\.0\.1:(\d+) "GET {missing}" 404 \d+\.\d ms',
                                      server.log_path.read_text(errors="replace")))
    assert line, server.log_tail()
    # this client's lines (its one kept-alive connection, by port): earlier tests' lines may
    # still be reaching the log, and the last request's line may follow its answer
    port = rf'127\.0\.0\.1:{line.group(1)} '
    assert wait_for(lambda: (_log_count(server, port + version), _log_count(server, port + stream))
                    == (1, 1)), server.log_tail()
    assert wait_for(lambda: _log_count(server, r'"POST /v1/completions" 415 ') >= 1), \
        server.log_tail()


def test_connections_without_a_complete_header_are_dropped(server):
    """Three clients: one sends nothing, one half a header, one a header a byte every 0.3 s
    (a byte received never restarts the deadline). Each is closed by the server after the
    header deadline, while a complete request on another connection is answered."""
    host, port = server.url.rsplit("/", 1)[1].split(":")
    partial = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"
    trickle = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 200
    socks = {name: socket.create_connection((host, int(port)), timeout=5)
             for name in ("silent", "partial", "trickle")}
    socks["partial"].sendall(partial)
    try:
        closed_at, sent = watch_closes(socks, "trickle", trickle, HEADER_TIMEOUT_S + 10, 0.3)
        assert set(closed_at) == {"silent", "partial", "trickle"}, closed_at
        for name, t in closed_at.items():
            assert HEADER_TIMEOUT_S - 1 <= t <= HEADER_TIMEOUT_S + 5, (name, t)
        assert sent > 10  # the trickler was still sending when it was cut off
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        for s in socks.values():
            s.close()


def test_a_bad_header_timeout_is_one_error_line(capsys):
    rc = main(["serve", "/no/such/model", "--timeout-keep-alive", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["outpace: error: --timeout-keep-alive must be a number of "
                               "seconds in (0, 3600], got 0.0"]
