"""Async front of the synchronous `LLMEngine`, for the server.

    event loop (uvicorn)                         engine thread (one, owns the LLMEngine)
    --------------------                         ----------------------------------------
    add_request() --("add", ..., future)--> cmd queue --> engine.add_request()
         ^                                                   | ok / error -> future
    RequestStream <--call_soon_threadsafe(deliver batch)--- engine.step() -> StreamItem per request
    abort()       --("abort", rid)-------> cmd queue --> engine.abort_request() (frees KV now)

Only the engine thread touches the engine (it is not thread-safe); the event loop talks to it
through a FIFO command queue drained between steps, so an abort that follows an add is always
applied after it. Outputs are snapshotted in the engine thread (the engine keeps mutating its
lists) and delivered in one `call_soon_threadsafe` per step, not one per request.

A failing `add_request` fails only that request. A failing `step()` fails the requests that were in
flight (their streams get the error, their KV is released) and the loop goes on; after
`max_consecutive_step_failures` failures in a row, or any error outside a step, the engine is
declared dead: every stream gets `EngineDeadError` and `healthy` turns False (/health -> 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from outpace.chat_template import ChatPrompt
from outpace.engine.request_stream import (LoopCrossing, RequestStream, RequestTiming,
                                           StreamItem, error_item)
from outpace.errors import EngineStoppedError, OutpaceError
from outpace.types import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(OutpaceError):
    """The engine thread has stopped; the server can't serve requests any more."""


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one live request."""

    stream: "RequestStream"
    timing: RequestTiming
    want_logprobs: bool
    final_only: bool  # the request's one output comes at its end (not streamed)
    num_sent: int = 0


class AsyncEngine(LoopCrossing):
    """The engine loop in a thread of the server process (ServerConfig.engine_process off, or
    unset beside a CPU engine); engine/core_client.py runs it in a process of its own."""

    def __init__(self, engine, on_finished: Optional[Callable[[RequestTiming], None]] = None,
                 max_consecutive_step_failures: int = 3):
        self.engine = engine
        self.on_finished = on_finished
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self._cmds: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._tracked: dict = {}  # request_id -> _Tracked; engine thread only
        self._stats: dict = dict(engine.stats())  # replaced (never mutated) by the engine thread
        self.dead_error: Optional[BaseException] = None
        self._stopping = False
        # Read-only after construction, so the event loop may use them.
        self.tokenizer = engine.tokenizer  # render_chat only (pure jinja, no tokenizing)
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the engine thread; outputs are delivered to `loop` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="outpace-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._cmds.put(("stop",))
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return (self.dead_error is None and self._thread is not None and self._thread.is_alive()
                and not self._stopping)

    def stats(self) -> dict:
        """Last engine stats snapshot (refreshed by the engine thread after every step/command)."""
        return self._stats

    # ---- requests (event loop side) ---------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Union[str, list, ChatPrompt],
                          params: SamplingParams, add_special_tokens: bool = True,
                          arrival: Optional[float] = None) -> RequestStream:
        """Admit a request; raises what `LLMEngine.add_request` raises (InvalidRequestError,
        QueueFullError), or EngineDeadError. arrival: the request's time.monotonic() when its
        handler began (default: now), where its TTFT and latency start.

        A text prompt or a rendered chat (`Tokenizer.render_chat`) is tokenized in the engine
        thread (the tokenizer is not shared across threads); `add_special_tokens=False` for text
        that already holds them. One that is too long by its length alone is refused here,
        before the engine thread spends a step's time or more tokenizing it."""
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running ({self.dead_error!r}); "
                                  "restart the server")
        if isinstance(prompt, (str, ChatPrompt)):
            self.engine.check_text_length(prompt if isinstance(prompt, str) else prompt.text)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        timing = RequestTiming(request_id, arrival=now if arrival is None else arrival,
                               submitted=now)
        stream = RequestStream(request_id, self, timing)
        fut = loop.create_future()
        self._cmds.put(("add", request_id, prompt, params, add_special_tokens, stream, timing,
                        fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still go through: undo it
            raise
        return stream

    async def run_tokenizer(self, fn: Callable):
        """`fn(tokenizer)`, run in the engine thread (the tokenizer is not shared across
        threads), between steps; returns its result or raises its error."""
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running ({self.dead_error!r}); "
                                  "restart the server")
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(("tokenizer", fn, fut))
        return await fut

    def abort(self, request_id: str) -> None:
        """Thread-safe, non-blocking; the engine thread frees the request's KV blocks."""
        self._cmds.put(("abort", request_id))

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        failures, stalled = 0, False
        try:
            while True:
                # Block for commands when there is nothing to step; pause briefly when the last
                # step ran nothing (requests waiting on memory), rather than spin.
                idle = not self.engine.has_unfinished_requests()
                if not self._apply_commands(wait=0.5 if idle else 0.005 if stalled else 0.0):
                    self._fail_in_flight(EngineDeadError("the server is shutting down"))
                    return
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 -- isolated to the requests in flight
                    failures += 1
                    log.exception("engine step failed (%d in a row)", failures)
                    if (failures >= self.max_consecutive_step_failures
                            or isinstance(e, EngineStoppedError)):  # no step will run again
                        raise
                    self._fail_in_flight(e)
                    continue
                failures = 0
                self._dispatch(outputs)
                self._refresh_stats()
                stalled = not outputs and not self._stats.get("num_running", 1)
        except BaseException as e:  # noqa: BLE001 -- the thread must report, never vanish
            self.dead_error = e
            log.exception("engine thread died")
            self._fail_in_flight(EngineDeadError(f"the engine stopped: {e!r}"), release=False)
        finally:
            self._fail_pending_adds()
            self.engine.shutdown()

    def _apply_commands(self, wait: float) -> bool:
        """Run queued adds/aborts (waiting up to `wait` s for the first); False: stop."""
        try:
            cmd = self._cmds.get(timeout=wait) if wait else self._cmds.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._do_add(*cmd[1:])
            elif cmd[0] == "abort":
                self._do_abort(cmd[1])
            elif cmd[0] == "tokenizer":
                self._do_tokenizer(*cmd[1:])
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                self._refresh_stats()
                return True

    def _do_add(self, rid, prompt, params, add_special_tokens, stream, timing, fut) -> None:
        try:
            if isinstance(prompt, ChatPrompt):
                prompt = self.engine.tokenizer.encode_chat(prompt)
            elif isinstance(prompt, str) and not add_special_tokens:
                prompt = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
            self.engine.add_request(rid, prompt, params)
        except Exception as e:  # noqa: BLE001 -- goes to that request only
            self._resolve(fut, e)
            return
        self._tracked[rid] = _Tracked(stream, timing, want_logprobs=params.logprobs is not None,
                                      final_only=params.output_kind == "final_only")
        self._resolve(fut, None)

    def _do_tokenizer(self, fn, fut) -> None:
        try:
            result = fn(self.engine.tokenizer)
        except Exception as e:  # noqa: BLE001 -- goes to that caller only
            self._resolve(fut, e)
            return
        self._resolve(fut, None, result)

    def _do_abort(self, rid) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is None:
            return
        try:
            self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001
            log.exception("abort of %s failed", rid)
        tracked.timing.finished = time.monotonic()
        tracked.timing.finish_reason = "abort"
        self._notify_finished(tracked.timing)
        item = StreamItem(num_tokens=tracked.num_sent, finished=True, finish_reason="abort")
        self._deliver([(tracked.stream, item)])

    def _dispatch(self, outputs) -> None:
        now = time.monotonic()
        batch = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted while the step ran
                continue
            try:
                item = self._snapshot(out, tracked, now)
            except Exception as e:  # noqa: BLE001 -- a bad output fails its request only
                log.exception("output of %s could not be read", out.request_id)
                self._tracked.pop(out.request_id, None)
                self._abort_quietly(out.request_id)
                item = error_item(e)
            batch.append((tracked.stream, item))
            if item.finished:
                self._tracked.pop(out.request_id, None)
                self._notify_finished(tracked.timing)
        self._deliver(batch)

    def _snapshot(self, out, tracked: _Tracked, now: float) -> StreamItem:
        comp = out.outputs[0]
        n = len(comp.token_ids)
        new_ids = list(comp.token_ids[tracked.num_sent:n])
        timing = tracked.timing
        if new_ids:
            if timing.first_token is None:
                timing.take_engine_times(out.metrics)  # the same process: the same clock
                timing.take_first_token(now, final=out.finished and tracked.final_only)
            timing.last_token = now
        timing.num_prompt_tokens = len(out.prompt_token_ids)
        timing.num_output_tokens = n
        lps, pieces = None, {}
        if tracked.want_logprobs:
            lps = [dict(d) for d in (comp.logprobs or [])[tracked.num_sent:n]]
            pieces = {t: self._piece(t) for d in lps for t in d}
        tracked.num_sent = n
        if out.finished:
            timing.finished = now
            timing.finish_reason = comp.finish_reason
        return StreamItem(text=comp.text, num_tokens=n, new_token_ids=new_ids, new_logprobs=lps,
                          token_pieces=pieces, finished=out.finished,
                          finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                          num_prompt_tokens=len(out.prompt_token_ids),
                          num_cached_tokens=out.num_cached_tokens or 0)

    def _piece(self, token_id: int) -> str:
        """A token's own text, special tokens included (logprobs name every token)."""
        try:
            return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
        except TypeError:  # a tokenizer without the keyword
            return self.engine.tokenizer.decode([token_id])

    def _fail_in_flight(self, error: BaseException, release: bool = True) -> None:
        batch = []
        for rid, tracked in list(self._tracked.items()):
            if release:
                self._abort_quietly(rid)
            batch.append((tracked.stream, error_item(error)))
        self._tracked.clear()
        self._deliver(batch)
        if release:
            self._refresh_stats()

    def _fail_pending_adds(self) -> None:
        """Adds still queued when the thread ends get EngineDeadError, so no caller hangs."""
        err = EngineDeadError("the engine stopped before the request was admitted")
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] in ("add", "tokenizer"):
                self._resolve(cmd[-1], err)

    def _abort_quietly(self, rid) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001
            log.exception("abort of %s failed", rid)

    def _refresh_stats(self) -> None:
        try:
            self._stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 -- stats are best effort
            log.exception("engine.stats() failed")

    def _notify_finished(self, timing: RequestTiming) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(timing)
        except Exception:  # noqa: BLE001
            log.exception("on_finished observer failed")

