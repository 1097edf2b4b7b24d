"""The engine loop in a process of its own (`serve --engine-process`, engine/core_process.py and
engine/core_client.py): aborts and stop strings reach the core (its KV freed, its steps
stopped), failing steps stay contained, the core's crash ends every stream with an error event
and /health turns 503, and no core outlives its server, even one killed with SIGKILL.

The rest of the server's behaviour in this mode is the whole e2e server suite run with
`pytest tests/e2e --engine-process`."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from outpace.config import ServerConfig
from outpace.engine.args import EngineArgs
from outpace.engine.async_engine import EngineDeadError
from outpace.engine.core_client import EngineCoreClient
from outpace.engine.core_process import EngineCore
from outpace.engine.engine import LLMEngine
from outpace.entrypoints.openai.server import build_app
from outpace.types import SamplingParams

from tests.e2e.server_helpers import MAX_MODEL_LEN, NUM_KV_BLOCKS, ServerProcess, wait_for

ENGINE_ARGS = dict(device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS,
                   quiet=True)
LONG = 200  # output tokens of a request that must still run when the test acts on it


def _descendants(pid: int) -> set:
    """The live processes under `pid` (read from /proc), zombies left out."""
    children: dict = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture
def client(tiny_model_dir):
    c = EngineCoreClient(EngineArgs.from_kwargs(str(tiny_model_dir), **ENGINE_ARGS))
    try:
        yield c
    finally:
        c.shutdown()
        assert not _alive(c.pid)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _idle(stats: dict) -> bool:
    """The core's stats say it holds no request (the stats of an add's acknowledgement show
    it waiting)."""
    return stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0


async def _drain(stream, timeout: float = 20.0):
    """The stream's last item."""
    async def last():
        item = None
        async for item in stream:
            pass
        return item
    return await asyncio.wait_for(last(), timeout)


async def _until(pred, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_abort_and_stop_strings_reach_the_core(client):
    async def scenario():
        client.start()
        # an aborted stream: the core frees its KV and stops stepping it
        stream = await client.add_request("a", [5, 6, 7], _greedy(LONG))
        first = await stream.__anext__()
        assert first.new_token_ids
        await _until(lambda: client.stats()["kv_blocks_used"] > 0)
        stream.abort()
        await _until(lambda: _idle(client.stats()))
        assert client.stats()["generation_tokens_total"] < LONG // 2

        # a stop string found by the front end ends the text where the engine would end it
        # and stops the request in the core
        whole = await _drain(await client.add_request("b", "hello there", _greedy(40)))
        stop = whole.text[12:15]
        before = client.stats()["generation_tokens_total"]
        cut = await _drain(await client.add_request("c", "hello there",
                                                    _greedy(LONG, stop=[stop])))
        assert (cut.text, cut.finish_reason, cut.stop_reason) == (
            whole.text[:whole.text.index(stop)], "stop", stop)
        await _until(lambda: _idle(client.stats()))
        assert client.stats()["generation_tokens_total"] - before < LONG // 2
        assert client.stats()["kv_blocks_used"] == 0

    asyncio.run(scenario())


def test_core_crash_fails_streams_and_health(client):
    app = build_app(client, ServerConfig())
    body = {"model": client.model_name, "prompt": "hi", "max_tokens": 4}

    async def scenario():
        client.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as c:
            assert (await c.get("/health")).status_code == 200
            stream = await client.add_request("x", [5, 6, 7], _greedy(LONG))
            await stream.__anext__()
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited"):
                await asyncio.wait_for(_drain(stream), 20)
            assert not client.healthy
            assert (await c.get("/health")).status_code == 503
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"

    asyncio.run(scenario())


def test_core_loop_contains_step_failures_then_dies(tiny_model_dir):
    """EngineCore's loop over a pipe, in a thread (the failure injected into the real engine's
    `step`): one failing step fails the requests in flight, which the loop survives; two in a
    row are fatal and reported as ("dead", error)."""
    engine = LLMEngine.from_args(str(tiny_model_dir), **ENGINE_ARGS)
    front, back = multiprocessing.Pipe()
    core = EngineCore(engine, back, max_consecutive_step_failures=2)
    died = []

    def run():
        try:
            core.run()
        except RuntimeError as e:
            died.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    real_step = engine.step

    def boom():
        raise RuntimeError("injected step failure")

    def recv_until(pred):
        while True:
            assert front.poll(20), "no message from the core"
            msg = front.recv()
            if pred(msg):
                return msg

    def finished(rid):
        return lambda m: m[0] == "out" and any(o.request_id == rid and o.finish_reason
                                               for o in m[2])

    front.send(("add", "ok", [5, 6, 7], _greedy(4, detokenize=False)))
    recv_until(finished("ok"))
    front.send(("add", "bad", [5, 6, 7], _greedy(LONG, detokenize=False)))
    recv_until(lambda m: m[0] == "out" and any(o.request_id == "bad" for o in m[2]))
    engine.step = boom  # the request runs, its KV held: the failing step releases it
    msg = recv_until(lambda m: m[0] == "out" and m[3])
    assert [rid for rid, _ in msg[3]] == ["bad"] and "injected" in str(msg[3][0][1])
    stats = msg[4]
    assert stats["kv_blocks_used"] == stats["num_running"] == stats["num_waiting"] == 0
    assert thread.is_alive()
    engine.step = real_step
    front.send(("add", "again", [5, 6, 7], _greedy(4, detokenize=False)))
    recv_until(finished("again"))
    engine.step = boom
    front.send(("add", "x", [5, 6, 7], _greedy(4, detokenize=False)))
    recv_until(lambda m: m[0] == "out" and m[3])
    front.send(("add", "y", [5, 6, 7], _greedy(4, detokenize=False)))
    msg = recv_until(lambda m: m[0] == "dead")
    assert "injected" in str(msg[1])
    thread.join(10)
    assert died and not thread.is_alive()
    engine.step = real_step
    engine.abort_request("y")


def test_detokenize_off_gives_token_ids_only(tiny_model_dir):
    """What the core runs: detokenize=False leaves the text empty, the tokens as they were."""
    from outpace.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)
    engine = LLMEngine.from_args(str(tiny_model_dir), **ENGINE_ARGS)
    outs, prompt = {}, engine.tokenizer.encode("hello there")
    for rid, detok in (("text", True), ("ids", False)):
        engine.add_request(rid, prompt, _greedy(12, detokenize=detok))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[rid] = out.outputs[0]
    assert outs["ids"].token_ids == outs["text"].token_ids and outs["text"].text
    assert outs["ids"].text == ""


def spawned_under(pid: int) -> list:
    """The multiprocessing children under `pid` (engine core, further front ends), not
    multiprocessing's resource tracker."""
    out = []
    for child in _descendants(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(child)
    return out


def _core_pid(srv: ServerProcess) -> int:
    def find():
        found = spawned_under(srv.proc.pid)
        return found[0] if found else None
    pid = wait_for(find, timeout=10)
    assert pid, f"no engine process under the server:\n{srv.log_tail()}"
    return pid


def test_core_crash_ends_served_streams_with_an_error_event(tiny_model_dir, tmp_path):
    srv = ServerProcess(tiny_model_dir, ["--engine-process"], tmp_path / "server.log")
    try:
        srv.wait_healthy()
        core = _core_pid(srv)
        body = {"prompt": "hi", "max_tokens": LONG, "ignore_eos": True, "stream": True}
        events = []
        with srv.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    os.kill(core, signal.SIGSTOP)  # no more steps: it is still running
                    os.kill(core, signal.SIGKILL)
                    break
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine" in error["message"], error
        assert wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503)
        assert srv.proc.poll() is None  # the front end answers on
    finally:
        srv.stop()


@pytest.mark.parametrize("when", ["serving", "loading"])
def test_no_engine_process_outlives_its_server(tiny_model_dir, tmp_path, when):
    """SIGKILL of the server: its engine process ends within seconds, whether it idles between
    requests or is still building its engine (not reading its pipe: the lifeline's watchdog)."""
    srv = ServerProcess(tiny_model_dir, ["--engine-process"], tmp_path / "server.log")
    under: set = set()
    try:
        if when == "serving":
            srv.wait_healthy()
        core = _core_pid(srv)
        under = _descendants(srv.proc.pid)  # the core and multiprocessing's resource tracker
        assert core in under
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        assert wait_for(lambda: not any(_alive(p) for p in under), timeout=5), \
            f"left behind: {[p for p in under if _alive(p)]}"
    finally:
        srv.stop()
        for pid in under:  # a failed test's leftovers
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_cpu_servers_engine_runs_in_a_thread_unless_asked(server, server_mode_args):
    """Unset, the engine loop of a server on the CPU stays in a thread of the server's process
    (ServerConfig.runs_engine_process; on a GPU it gets a process of its own)."""
    wait_for(lambda: "serving" in server.log_tail(100_000))
    in_process = "the engine runs in process" in server.log_tail(100_000)
    assert in_process == ("--engine-process" in server_mode_args)
