"""Fairness through the real server (issue 36): one stream decodes while a request that could
stall it arrives, (a) a 2,500-token prompt, (b) a 3.9 MB text prompt, (c) huge stop /
stop_token_ids lists; the stream's worst gap between tokens after the arrival, against its
median gap before it, stays under a bound.

The goal is 3x; the bound here is 6x, headroom for a shared CI machine whose other work lands
in some gaps, and a test passes if one of three tries is under it. Each try prints its ratio.
The server runs the default model with the CPU defaults (no flag but the device and port): a
request's stall matters against the default model's step, tens of milliseconds. The long
prompt's prefill takes tens of seconds beside a stream (chunks of max_prefill_with_decodes
tokens), so (a) times the stream over its first chunks only (a prefill without the bound
stalls it for seconds in its first step); benchmarks/fairness.py measures the whole of it
(docs/performance.md).
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_helpers import ServerProcess, scrape, wait_for

BOUND = 6.0  # worst gap / normal gap; the goal is 3 (see the module docstring)
BEFORE = 12  # stream tokens before the arrival: their median gap is the normal one
AFTER = 16  # stream tokens timed after the arriving request is answered
ATTEMPTS = 3  # tries to get under BOUND (see check_stall)
RUNNING = "outpace:num_requests_running"


@pytest.fixture(scope="module")
def fair_server(tmp_path_factory, default_model_path, server_mode_args):
    log = tmp_path_factory.mktemp("fair_logs") / "server.log"
    srv = ServerProcess(Path(default_model_path), server_mode_args, log, max_model_len=None)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


class Stream:
    """A streaming completion read in a thread; the arrival time of every token's event (with
    logprobs each step's token comes in an event of its own, text or not)."""

    def __init__(self, srv: ServerProcess, max_tokens: int = 1500):
        self.times: list = []
        self.error = None
        self._stop = threading.Event()
        self._body = {"model": srv.model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                      "temperature": 0.0, "ignore_eos": True, "stream": True, "logprobs": 0}
        self._url = srv.url
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self._url, timeout=60) as client:
                with client.stream("POST", "/v1/completions", json=self._body) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            assert "error" not in event, event
                            self.times.append(time.monotonic())
                        if self._stop.is_set():
                            return
        except Exception as e:  # noqa: BLE001 -- reported by the test
            self.error = e

    def wait_for(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < n:
            assert self.error is None, self.error
            assert self._thread.is_alive(), "the stream ended early"
            assert time.monotonic() < deadline, f"{len(self.times)} of {n} tokens"
            time.sleep(0.002)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def stall_ratio(srv: ServerProcess, arrive, during=None) -> tuple:
    """Start a stream, run arrive() after BEFORE tokens, time AFTER tokens more -> (ratio,
    normal gap s, worst s, arrive()'s result). arrive() returns once the server has answered
    the arriving request, or at once for one that runs beside the stream: then during(result)
    runs after the AFTER tokens, before the stream ends, and the server is let go idle."""
    stream = Stream(srv)
    try:
        stream.wait_for(BEFORE)
        n0 = len(stream.times)
        result = arrive()
        stream.wait_for(len(stream.times) + AFTER)
        times = list(stream.times)
        if during is not None:
            during(result)
    finally:
        stream.close()
    if during is not None:
        assert wait_for(lambda: scrape(srv)[RUNNING] == 0, 30), "requests left running"
    gaps = [b - a for a, b in zip(times, times[1:])]
    normal = statistics.median(gaps[1:n0 - 1])  # (the first: from the prefill's token)
    worst = max(gaps[n0 - 1:])
    return worst / normal, normal, worst, result


def check_stall(name: str, srv: ServerProcess, arrive, check, during=None) -> None:
    """stall_ratio under BOUND in one of ATTEMPTS tries (a stall the server causes recurs every
    time, a CI machine's hiccup seldom twice), then check(arrive()'s result) of that try."""
    ratios = []
    for _ in range(ATTEMPTS):
        ratio, normal, worst, result = stall_ratio(srv, arrive, during)
        ratios.append(ratio)
        print(f"\n{name}: worst gap {worst * 1e3:.1f} ms / normal gap {normal * 1e3:.1f} ms = "
              f"{ratio:.2f}x (bound {BOUND}x, goal 3x)")
        if ratio < BOUND:
            check(result)
            return
    pytest.fail(f"{name}: the stream's worst gap was {min(ratios):.1f}x its normal gap or more "
                f"in {ATTEMPTS} tries ({', '.join(f'{r:.1f}' for r in ratios)}); the bound is "
                f"{BOUND}x")


def post(srv: ServerProcess, body: str) -> tuple:
    """(response, seconds it took). The body comes encoded: encoding it in the window would
    hold this process's GIL, and so the stream's reader, for tens of milliseconds."""
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", content=body, timeout=120,
                   headers={"Content-Type": "application/json"})
    return r, time.monotonic() - t0


def test_long_prompt_beside_a_stream(fair_server):
    """(a) A 2,500-token prompt arrives: it is prefilled beside the stream in bounded chunks
    (the CPU default of max_prefill_with_decodes); the stream is timed over the first of
    them, then the prompt's client goes away (its request is aborted)."""
    requests = []
    for attempt in range(ATTEMPTS):  # a prompt each (a prefix-cache hit would prefill nothing)
        prompt = [(i * 7919 + attempt) % 40000 + 100 for i in range(2500)]
        body = json.dumps({"model": fair_server.model, "prompt": prompt, "max_tokens": 1})
        requests.append((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                         f"\r\n{body}").encode())

    def arrive():
        sock = socket.create_connection(("127.0.0.1", fair_server.port))
        sock.sendall(requests.pop())
        return sock

    running = []

    def during(sock):  # then the prompt's client goes away: its request is aborted
        running.append(scrape(fair_server)[RUNNING])
        sock.close()

    def check(sock):
        assert running[-1] == 2, "the long prompt was not running beside the stream"

    check_stall("2,500-token prompt", fair_server, arrive, check, during)


def test_huge_text_prompt_beside_a_stream(fair_server):
    """(b) A 3.9 MB text prompt gets its 400 at once, without tokenizing it (which takes
    seconds, on the thread that runs the engine's steps)."""
    text = ("All work and no play makes Jack a dull boy. " * 90000)[:3_900_000]
    body = json.dumps({"model": fair_server.model, "prompt": text, "max_tokens": 4})

    def check(result):
        r, took = result
        assert r.status_code == 400, r.text
        err = r.json()["error"]["message"]
        assert "3900000 characters" in err and "context is 8192 tokens" in err, err
        assert took < 2.0, f"the 400 took {took:.2f} s"

    check_stall("3.9 MB prompt", fair_server, lambda: post(fair_server, body), check)


@pytest.mark.parametrize("field,value", [
    ("stop_token_ids", [i % 1000 for i in range(600_000)]),
    ("stop", [f"s{i}" for i in range(200_000)]),
], ids=["stop_token_ids", "stop"])
def test_huge_lists_beside_a_stream(fair_server, field, value):
    """(c) A request with a huge stop / stop_token_ids list is refused (the lists are
    bounded), fast, and the stream doesn't notice."""
    body = json.dumps({"model": fair_server.model, "prompt": "hi", "max_tokens": 4,
                       field: value})

    def check(result):
        r, took = result
        assert r.status_code == 400, r.text
        assert field in r.json()["error"]["message"]
        assert took < 2.0, f"the 400 took {took:.2f} s"

    check_stall(f"{len(body) / 1e6:.1f} MB {field} list", fair_server,
                lambda: post(fair_server, body), check)
