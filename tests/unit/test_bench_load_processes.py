"""`outpace bench serve --client-processes N` (outpace/bench/load_processes.py): the load split
over N processes sends exactly the single-process requests (each prompt as often), keeps the
concurrency bound, and its summary counts every request; against a stub SSE server (no model)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import pytest

from outpace.bench.load_processes import share, shard
from outpace.bench.serve import ServeBenchConfig, run_load

CHUNKS = 5  # streamed tokens a request


class StubServer:
    """An OpenAI-style SSE server on a thread: /v1/models, and streamed chat answers of CHUNKS
    one-word chunks with usage; records every prompt and the most requests open at once."""

    def __init__(self):
        self.prompts: list = []
        self.open = self.most_open = 0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    async def _main(self):
        self.stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.ready.set()
        async with server:
            await self.stop.wait()

    async def _handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                if head.startswith(b"GET /v1/models"):
                    data = json.dumps({"data": [{"id": "stub"}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
                    continue
                prompt = json.loads(body)["messages"][0]["content"]
                self.prompts.append(prompt)
                if prompt == "long line":  # one event longer than the client reads as a line
                    data = b"data: " + b"x" * (3 << 20) + b"\n\n"
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
                    await writer.drain()
                    continue
                self.open += 1
                self.most_open = max(self.most_open, self.open)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                events = [{"choices": [{"index": 0, "delta": {"content": " w"},
                                        "finish_reason": "length" if i == CHUNKS - 1 else None}]}
                          for i in range(CHUNKS)]
                events.append({"choices": [], "usage": {"prompt_tokens": 3,
                                                        "completion_tokens": CHUNKS}})
                for ev in events:
                    await asyncio.sleep(0.002)
                    data = f"data: {json.dumps(ev)}\n\n".encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                self.open -= 1
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture(scope="module")
def stub():
    return StubServer()


def test_shares_add_up_and_the_shards_interleave_the_single_process_order():
    assert [share(10, k, 3) for k in range(3)] == [4, 3, 3]
    assert share(None, 1, 3) is None
    cfg = ServeBenchConfig(num_prompts=10, max_concurrency=5, request_rate=6.0, seed=1,
                           client_processes=3)
    prompts = [f"p{i}" for i in range(4)]
    subs = [shard(cfg, prompts, k, 3) for k in range(3)]
    assert sum(s.num_prompts for s, _ in subs) == 10
    assert sum(s.max_concurrency for s, _ in subs) == 5
    assert all(s.request_rate == 2.0 and s.client_processes == 1 for s, _ in subs)
    assert len({s.seed for s, _ in subs}) == 3
    # request j of shard k is request k + 3j of the single process, whose prompt is i % 4
    sent = Counter(p[j % len(p)] for (s, p) in subs for j in range(s.num_prompts))
    assert sent == Counter(prompts[i % 4] for i in range(10))


def test_the_load_from_two_processes_sends_every_request_once(stub):
    prompts = [f"prompt {i}" for i in range(7)]
    cfg = ServeBenchConfig(base_url=stub.url, endpoint="/v1/chat/completions", num_prompts=12,
                           max_concurrency=4, output_len=CHUNKS, client_processes=2)
    before = len(stub.prompts)
    progress = []
    s = run_load(cfg, prompts, on_progress=progress.append)
    assert s["failed"] == 0, s["errors"]
    assert s["completed"] == s["num_prompts"] == 12
    assert s["total_output_tokens"] == 12 * CHUNKS
    assert Counter(stub.prompts[before:]) == Counter(prompts[i % 7] for i in range(12))
    assert stub.most_open <= 4
    assert sum(progress) == 12
    assert s["model"] == "stub" and s["config"]["client_processes"] == 2
    assert 0 < s["duration"] < 60 and s["mean_ttft_ms"] > 0


def test_one_process_runs_in_this_one(stub):
    cfg = ServeBenchConfig(base_url=stub.url, endpoint="/v1/chat/completions", num_prompts=3,
                           max_concurrency=2, output_len=CHUNKS)
    s = run_load(cfg, ["a", "b"])
    assert s["completed"] == 3 and s["total_output_tokens"] == 3 * CHUNKS


def test_a_line_too_long_fails_its_request_only(stub):
    cfg = ServeBenchConfig(base_url=stub.url, endpoint="/v1/chat/completions", num_prompts=3,
                           max_concurrency=3, output_len=CHUNKS)
    s = run_load(cfg, ["long line", "a", "b"])
    assert s["completed"] == 2 and s["failed"] == 1
    assert "LineTooLong" in s["errors"][0] or "too long" in s["errors"][0].lower(), s["errors"]


def test_a_process_needs_a_share_of_the_concurrency():
    cfg = ServeBenchConfig(num_prompts=8, max_concurrency=2, client_processes=3)
    with pytest.raises(ValueError, match="max_concurrency 2 is less than client_processes 3"):
        run_load(cfg, ["a"])
