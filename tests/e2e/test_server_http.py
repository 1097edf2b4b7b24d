"""HTTP habits of the shared `outpace serve`: /version, one access-log line per request."""

from __future__ import annotations

import re
import uuid

import httpx

import outpace
from tests.e2e.server_helpers import wait_for


def test_version_is_open_like_health(server):
    r = httpx.get(server.url + "/version", timeout=30)  # no API key
    assert r.status_code == 200 and r.json() == {"version": outpace.__version__}


def _log_count(srv, pattern: str) -> int:
    return len(re.findall(pattern, srv.log_path.read_text(errors="replace")))


def test_one_access_log_line_per_request(server):
    missing = f"/v1/models/{uuid.uuid4().hex}"
    version = r'"GET /version" 200 \d+\.\d ms'
    stream = r'"POST /v1/completions" 200 \d+\.\d ms'
    before = _log_count(server, version), _log_count(server, stream)
    with server.client() as c:
        assert c.get(missing).status_code == 404
        assert c.get("/version").status_code == 200
        body = {"prompt": "log me", "max_tokens": 3, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        assert c.post("/v1/completions", content=b"{}", headers={
            "Content-Type": "text/plain"}).status_code == 415
    line = wait_for(lambda: re.search(rf'127\.0\.0\.1:\d+ "GET {missing}" 404 \d+\.\d ms',
                                      server.log_path.read_text(errors="replace")))
    assert line, server.log_tail()
    assert wait_for(lambda: (_log_count(server, version), _log_count(server, stream))
                    == (before[0] + 1, before[1] + 1)), server.log_tail()
    assert _log_count(server, r'"POST /v1/completions" 415 ') >= 1
