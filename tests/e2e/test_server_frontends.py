"""Several front-end processes over one engine core (`serve --api-server-count N`,
entrypoints/openai/frontends.py, the core's pipes in engine/core_process.py): a further front
end serves on the shared port on its own (the server's own process stopped meanwhile), streams
from both end whole, SIGTERM ends every stream with [DONE] and every process, a front end that
dies ends the server, no process outlives a killed server, and /metrics on either front end
counts the whole server's requests (prometheus_client's multiprocess mode)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from contextlib import contextmanager, nullcontext

import httpx
import pytest

from outpace.bench.server_metrics import PHASES, TTFT_SUM
from tests.e2e.server_helpers import ServerProcess, scrape, wait_for
from tests.e2e.test_server_engine_process import _alive, _descendants, spawned_under

N = ["--api-server-count", "2"]


@contextmanager
def _server(model_dir, tmp_path, env: dict | None = None):
    """A server with two front ends, healthy, its processes all started -> (server, its
    processes); stopped after, and whatever it left behind killed."""
    srv = ServerProcess(model_dir, N, tmp_path / "server.log", env=env)
    under: set = set()
    try:
        srv.wait_healthy()
        assert wait_for(lambda: len(spawned_under(srv.proc.pid)) == 2, timeout=30), \
            srv.log_tail()
        under |= _descendants(srv.proc.pid)
        yield srv, under
    finally:
        srv.stop()
        for pid in under:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _stream(srv: ServerProcess, max_tokens: int, out: list, timeout: float = 60) -> None:
    """One streamed completion: its data events, appended to `out` when it ends."""
    body = {"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=srv.url, timeout=timeout) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        out.append([line[6:] for line in r.iter_lines() if line.startswith("data: ")])


def test_a_further_front_end_serves_and_sigterm_ends_every_stream(tiny_model_dir, tmp_path):
    with _server(tiny_model_dir, tmp_path) as (srv, under):
        # the server's own process stopped: the other front end takes the connections
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            got: list = []
            _stream(srv, 8, got, timeout=30)
            assert got[0][-1] == "[DONE]" and len(got[0]) >= 2, got
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        # streams over both, whole; then SIGTERM while more run: each ends with [DONE]
        done: list = []
        threads = [threading.Thread(target=_stream, args=(srv, 12, done)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(done) == 8 and all(ev[-1] == "[DONE]" for ev in done), done
        texts = {"".join(json.loads(e)["choices"][0]["text"] for e in ev[:-1]
                         if json.loads(e).get("choices")) for ev in done}
        assert len(texts) == 1  # greedy: the same text from either front end
        running: list = []
        threads = [threading.Thread(target=_stream, args=(srv, 200, running))
                   for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the streams under way (each ends whole, or with an error event)
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert len(running) == 4 and all(ev and ev[-1] == "[DONE]" for ev in running), running
        srv.proc.wait(60)  # (uvicorn re-raises the SIGTERM once it has shut down)
        assert wait_for(lambda: not any(_alive(p) for p in under), timeout=10), \
            f"left behind: {[p for p in under if _alive(p)]}"


@pytest.mark.parametrize("victim", ["frontend", "server"])
def test_a_dead_front_end_or_server_leaves_no_process(tiny_model_dir, tmp_path, victim):
    """SIGKILL of a further front end ends the server (and the core); SIGKILL of the server's
    own process ends the core and the further front ends (their lifelines)."""
    with _server(tiny_model_dir, tmp_path) as (srv, under):
        if victim == "frontend":
            _, fronts, _ = _pids(srv)
            os.kill(fronts[0], signal.SIGKILL)
            srv.proc.wait(60)  # the server stops itself
        else:
            os.kill(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(10)
        assert wait_for(lambda: not any(_alive(p) for p in under), timeout=20), \
            f"left behind: {[p for p in under if _alive(p)]}\n{srv.log_tail()}"


def _pids(srv: ServerProcess) -> tuple:
    """(the server's, the further front ends', the engine core's) pids, from the line the
    server prints when its front ends start."""
    def find():
        for line in srv.log_tail(20000).splitlines():
            if "front-end processes:" in line:
                return line
        return None
    line = wait_for(find, timeout=20)
    assert line, srv.log_tail()
    m = re.search(r"processes: (\d+) \(this one\) and ([\d, ]+), over the engine process "
                  r"(\d+)", line)
    assert m, line
    return int(m[1]), [int(p) for p in m[2].split(", ")], int(m[3])


def test_the_core_routes_each_front_ends_requests_and_waits_for_no_silent_pipe(tiny_model_dir):
    """EngineCore over two pipes, in a thread: a second front end that has not said hello is
    sent nothing (its pipe unread, the first front end's request runs to its end); after its
    hello it gets the ready message, and each front end gets only its own requests' outputs;
    its stop detaches it (its request aborted) and the core runs on for the first."""
    import multiprocessing
    import threading as th

    from outpace.engine.core_process import EngineCore
    from outpace.engine.engine import LLMEngine
    from outpace.types import SamplingParams
    from tests.e2e.test_server_engine_process import ENGINE_ARGS

    engine = LLMEngine.from_args(str(tiny_model_dir), **ENGINE_ARGS)
    first, first_core = multiprocessing.Pipe()
    second, second_core = multiprocessing.Pipe()
    core = EngineCore(engine, [first_core, second_core], ready={"pid": 1})
    thread = th.Thread(target=core.run, daemon=True)
    thread.start()

    def greedy(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def outputs_until_done(conn, rid):
        got = []
        while True:
            assert conn.poll(30), "no message from the core"
            msg = conn.recv()
            assert msg[0] == "out", msg
            for o in msg[2]:
                assert o.request_id == rid, (o.request_id, rid)
                got += o.new_token_ids
                if o.finish_reason:
                    return got

    try:
        first.send(("add", "a", [5, 6, 7], greedy(200)))
        assert len(outputs_until_done(first, "a")) == 200
        assert not second.poll(0.2)  # nothing for a front end that has not said hello
        second.send(("hello",))
        assert second.poll(10) and second.recv() == ("ready", {"pid": 1})
        first.send(("add", "b", [5, 6, 7], greedy(8)))
        second.send(("add", "c", [8, 9], greedy(8)))
        assert len(outputs_until_done(second, "c")) == 8
        assert len(outputs_until_done(first, "b")) == 8
        second.send(("add", "d", [8, 9], greedy(200)))
        second.send(("stop",))  # detached: "d" aborted, the core runs on
        assert wait_for(lambda: engine.stats()["num_running"] == 0, timeout=20)
        first.send(("add", "e", [5, 6], greedy(4)))
        assert len(outputs_until_done(first, "e")) == 4
        assert thread.is_alive()
    finally:
        first.send(("stop",))
        thread.join(10)
        engine.shutdown()


@contextmanager
def _stopped(pid: int):
    """`pid` stopped (SIGSTOP) while the block runs: the other front end takes the
    connections."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_metrics_on_either_front_end_count_the_whole_server(tiny_model_dir, tmp_path):
    """Requests served by each front end (the other one stopped meanwhile), then /metrics
    answered by each: the per-request counters are the server's totals on every scrape, the
    engine's token counters are counted once, and the metrics' temporary directory is gone
    once the server stopped."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with _server(tiny_model_dir, tmp_path, env={"TMPDIR": str(tmp)}) as (srv, _):
        own, fronts, _ = _pids(srv)
        body = {"prompt": "count me", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        usages = []
        for victim in (fronts[0], own, None):  # 3 to each front end alone, then 2 to either
            with _stopped(victim) if victim else nullcontext():
                for _ in range(3 if victim else 2):  # a fresh connection each
                    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
                    assert r.status_code == 200, r.text
                    usages.append(r.json()["usage"])
        n, prompt = len(usages), sum(u["prompt_tokens"] for u in usages)
        files = {p.name for d in tmp.glob("outpace-metrics-*") for p in d.iterdir()}
        assert {f"counter_{own}.db", f"counter_{fronts[0]}.db"} <= files, files

        def whole(m: dict) -> bool:  # the engine's numbers reach a front end with its next
            # message from the core: the per-request ones are in the files at once
            return (m["outpace:prompt_tokens_total"] == prompt
                    and m["outpace:generation_tokens_total"] == 3 * n)

        for victim in (fronts[0], own):  # /metrics answered by one front end, then the other
            with _stopped(victim):
                assert wait_for(lambda: whole(scrape(srv)), timeout=10), scrape(srv)
                for _ in range(3):
                    m = scrape(srv)
                    assert m["outpace:request_success_total{finished_reason=length}"] == n, m
                    assert m["outpace:e2e_request_latency_seconds_count"] == n, m
                    assert m["outpace:time_to_first_token_seconds_count"] == n, m
                    for phase in ("http_wait", *TTFT_SUM):  # (first_chunk: streams only)
                        h = dict(PHASES)[phase]
                        assert m[f"outpace:{h}_count"] == n, (h, m)
                    assert whole(m), m  # not once a front end
        srv.stop()
        assert srv.proc.returncode is not None
        assert not list(tmp.glob("outpace-metrics-*")), list(tmp.iterdir())
