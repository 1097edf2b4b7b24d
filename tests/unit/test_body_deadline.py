"""The request body must arrive within the server's body_timeout: a body trickled in slowly is a
408, not a connection and a task held forever."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from outpace.entrypoints.openai.errors import APIError
from outpace.entrypoints.openai.server import read_json


def _request(parts: list, delay: float) -> Request:
    body = iter(parts)

    async def receive():
        await asyncio.sleep(delay)
        chunk = next(body, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.request", "body": chunk, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    return Request(scope, receive)


def test_a_slow_body_is_a_408():
    parts = [b'{"prompt": ', b'"hi"', b"}"] + [b" "] * 50
    with pytest.raises(APIError) as e:
        asyncio.run(read_json(_request(parts, 0.02), 1 << 20, deadline_s=0.2))
    assert e.value.status == 408 and "body_timeout" in e.value.message


def test_a_body_in_time_is_read():
    parts = [b'{"prompt": ', b'"hi"', b"}"]
    got = asyncio.run(read_json(_request(parts, 0.01), 1 << 20, deadline_s=5))
    assert got == json.loads('{"prompt": "hi"}')
