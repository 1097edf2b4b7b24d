"""The server's front end of an engine-core process (engine/core_process.py): the interface the
server uses of `AsyncEngine` (add_request / abort / run_tokenizer / streams / healthy / stats),
with the engine loop in a process of its own.

    event loop                  tokenizer thread (one)                     engine-core process
    ----------                  ----------------------                     -------------------
    add_request() --job-->  tokenize, OutputProcessor.add --sender--> ("add", ...)
    abort()       --job-->  OutputProcessor.pop           --sender--> ("abort", rid)
    RequestStream <--call_soon_threadsafe(batch)-- detokenize <--reader-- ("out", ...) a step

The tokenizer thread owns the tokenizer (it is not shared across threads) and every request's
output state, so tokenizing, detokenizing, stop strings and logprobs' token pieces never run on
the event loop nor beside the steps. Its jobs run in order (a single-worker executor): an add is
sent before any later abort of it, and acknowledgements before the outputs that follow them.
The sender thread writes to the pipe, so neither the loop nor the tokenizer thread waits on a
core busy with a step; the reader thread blocks on the pipe and queues each message as a job.

Failure semantics are AsyncEngine's: a refused add raises from add_request; a failing step
fails the requests in flight; the core's death (("dead", error), or its process gone: the pipe
at EOF) fails every stream with EngineDeadError and `healthy` turns False (/health -> 503).
`shutdown` stops the core (asked, then terminated, then killed) and fails what is left.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import queue
import threading
import time
from multiprocessing.connection import wait as wait_connections
from typing import Callable, Optional, Union

from outpace.chat_template import ChatPrompt
from outpace.engine.async_engine import EngineDeadError
from outpace.engine.engine import check_text_length
from outpace.engine.output_processor import OutputProcessor, coalesce_messages, core_params
from outpace.engine.request_stream import (LoopCrossing, RequestStream, RequestTiming,
                                           error_item)
from outpace.engine.args import EngineArgs
from outpace.errors import ConfigError, InvalidRequestError
from outpace.types import SamplingParams

log = logging.getLogger(__name__)


def _import_tokenizer_modules() -> None:
    """What unpickling the core's tokenizer imports (transformers' tokenizer classes, seconds
    of imports), imported meanwhile rather than after the engine is ready."""
    import transformers

    from outpace.tokenizer import Tokenizer  # noqa: F401
    transformers.PreTrainedTokenizerFast  # noqa: B018 -- a lazy module: the access imports it


class EngineCoreClient(LoopCrossing):
    def __init__(self, engine_args: EngineArgs,
                 on_finished: Optional[Callable[[RequestTiming], None]] = None,
                 max_consecutive_step_failures: int = 3, build_engine=None,
                 frontends: int = 1):
        """Spawn the engine-core process and wait until its engine is built from
        `engine_args` (the model loads there); raises what building it raised (ConfigError,
        ModelLoadError, ...). build_engine: a picklable function engine_args -> engine that
        the core calls instead of LLMEngine.from_engine_args (a stand-in engine).
        frontends: how many front ends the core serves; this is the first, and the others'
        connections are `peer_conns`, each for a front end in another process (`attach`)."""
        from outpace.engine.core_process import run_engine_core
        if engine_args.loaded is not None:
            raise ConfigError("an engine process loads its own model: a model lent with "
                              "`loaded` stays in this process; set engine_process off (and "
                              "api_server_count to 1) to serve it", option="loaded")
        self._init_state(on_finished)
        ctx = multiprocessing.get_context("spawn")
        pairs = [ctx.Pipe() for _ in range(max(1, frontends))]
        self._conn = pairs[0][0]
        self.peer_conns = [mine for mine, _ in pairs[1:]]
        lifeline_r, self._lifeline = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_engine_core, name="outpace-engine-core",
            args=([theirs for _, theirs in pairs], lifeline_r, engine_args,
                  logging.getLogger("outpace").getEffectiveLevel(),
                  max_consecutive_step_failures, build_engine))
        self._proc.start()
        for _, theirs in pairs:
            theirs.close()
        lifeline_r.close()
        try:
            _import_tokenizer_modules()  # while the core builds its engine
            info = self._wait_ready()
        except BaseException:
            self._stop_process(timeout=2.0)
            raise
        self._take_ready(info)

    @classmethod
    def attach(cls, conn, on_finished: Optional[Callable[[RequestTiming], None]] = None):
        """A further front end of a running engine core, over `conn` (one of the first
        front end's `peer_conns`, handed to this process): it says hello and waits for the
        core's ready. It does not own the core: its shutdown detaches it (its requests
        aborted), and the core's end fails its streams."""
        self = cls.__new__(cls)
        self._init_state(on_finished)
        self._conn, self._proc, self._lifeline, self.peer_conns = conn, None, None, []
        _import_tokenizer_modules()
        conn.send(("hello",))
        self._take_ready(self._wait_ready())
        return self

    def _init_state(self, on_finished) -> None:
        self.on_finished = on_finished
        self.dead_error: Optional[BaseException] = None
        self._stopping = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._jobs: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._outbox: queue.Queue = queue.Queue()
        self._threads: list = []
        self._pending: dict = {}  # request_id -> add_request's future; tokenizer thread only
        # the core's messages not yet processed: the reader appends, one queued drain job
        # (at most) takes them all (coalesce_messages)
        self._inbox: list = []
        self._inbox_lock = threading.Lock()
        self._drain_queued = False

    def _take_ready(self, info: dict) -> None:
        self.tokenizer = info["tokenizer"]  # the core's own: same ids, eos, chat template
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.pid: int = info["pid"]
        self._stats: dict = info["stats"]  # replaced (never mutated) by the tokenizer thread
        self._outputs = OutputProcessor(self.tokenizer)  # tokenizer thread only

    def _wait_ready(self) -> dict:
        conn, proc = self._conn, self._proc
        while True:
            ready = wait_connections([conn] + ([proc.sentinel] if proc is not None else []))
            if conn in ready or conn.poll(0):  # a last message may come with the exit
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg[0] == "ready":
                    return msg[1]
                if msg is not None and msg[0] == "start_failed":
                    proc.join(5)
                    raise msg[1]
                if msg is not None:
                    continue
            if proc is None:
                raise EngineDeadError("the engine process closed this front end's connection "
                                      "before it was ready")
            proc.join(5)
            raise EngineDeadError(f"the engine process exited with code {proc.exitcode} "
                                  f"while the engine was being built (its log is above)")

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the front end's threads; outputs are delivered to `loop` (default: the
        running one)."""
        if self._jobs is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._jobs = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="outpace-tokenizer")
        for target, name in ((self._send_loop, "outpace-core-sender"),
                             (self._read_loop, "outpace-core-reader")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (asked, then terminated, then killed) and end what is in flight with
        EngineDeadError. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._outbox.put(("stop",))
        self._stop_process(timeout)
        self._outbox.put(None)  # ends the sender
        if self._proc is None:  # attached: its stop sent and the core's end read first, so
            for t in self._threads:  # no thread is left on the connection about to close
                t.join(2.0)
        if self._jobs is not None:
            self._submit(self._fail_all, EngineDeadError("the server is shutting down"))
            self._jobs.shutdown(wait=True)
        try:
            self._conn.close()
            if self._lifeline is not None:
                self._lifeline.close()
            for conn in self.peer_conns:
                conn.close()
        except OSError:
            pass

    def _stop_process(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:  # a further front end: its ("stop",) detaches it; nothing to join
            if not self._jobs:
                try:
                    self._conn.send(("stop",))
                except (OSError, ValueError):
                    pass
            return
        if not self._jobs:  # no sender yet: ask directly
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
        proc.join(timeout)
        if proc.exitcode is None:
            log.warning("outpace: the engine process did not stop within %g s: terminating it",
                        timeout)
            proc.terminate()
            proc.join(5)
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)

    @property
    def healthy(self) -> bool:
        return (self.dead_error is None and self._jobs is not None and not self._stopping
                and (self._proc is None or self._proc.exitcode is None))

    def stats(self) -> dict:
        """The core's last stats (sent with every step's outputs and every batch of commands
        it applied)."""
        return self._stats

    # ---- requests (event loop side) ---------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Union[str, list, ChatPrompt],
                          params: SamplingParams, add_special_tokens: bool = True,
                          arrival: Optional[float] = None) -> RequestStream:
        """Admit a request; raises what `LLMEngine.add_request` raises (InvalidRequestError,
        QueueFullError), or EngineDeadError. A text prompt too long by its length alone is
        refused here, before it is tokenized (in the tokenizer thread). arrival: as
        AsyncEngine.add_request's."""
        self._check_alive()
        if isinstance(prompt, (str, ChatPrompt)):
            check_text_length(self.tokenizer, self.max_model_len,
                              prompt if isinstance(prompt, str) else prompt.text)
        loop = asyncio.get_running_loop()
        timing = RequestTiming(request_id,
                               arrival=time.monotonic() if arrival is None else arrival)
        stream = RequestStream(request_id, self, timing)
        fut = loop.create_future()
        self._submit(self._do_add, request_id, prompt, params, add_special_tokens, stream,
                     timing, fut)
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still go through: undo it
            raise
        return stream

    async def run_tokenizer(self, fn: Callable):
        """`fn(tokenizer)`, run in the tokenizer thread; returns its result or raises its
        error."""
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._submit(self._do_tokenizer, fn, fut)
        return await fut

    def abort(self, request_id: str) -> None:
        """Thread-safe, non-blocking; the core frees the request's KV blocks."""
        self._submit(self._do_abort, request_id)

    def _check_alive(self) -> None:
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running ({self.dead_error!r}); "
                                  "restart the server")

    def _submit(self, fn, *args) -> None:
        try:
            self._jobs.submit(self._guarded, fn, *args)
        except (RuntimeError, AttributeError):  # shut down (or never started): nobody listens
            pass

    @staticmethod
    def _guarded(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 -- a job must not take the thread's later jobs along
            log.exception("front-end job %s failed", getattr(fn, "__name__", fn))

    # ---- tokenizer thread -------------------------------------------------------------------
    def _do_add(self, rid, prompt, params, add_special_tokens, stream, timing, fut) -> None:
        if self.dead_error is not None or self._stopping:
            self._resolve(fut, EngineDeadError("the engine stopped before the request was "
                                               "admitted"))
            return
        try:
            if rid in self._outputs or rid in self._pending:
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            tok = self.tokenizer
            if isinstance(prompt, ChatPrompt):
                ids = tok.encode_chat(prompt)
            elif isinstance(prompt, str):
                ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
            else:
                ids = list(prompt)
            self._outputs.add(rid, ids, params, stream, timing)
        except Exception as e:  # noqa: BLE001 -- goes to that request only
            self._resolve(fut, e)
            return
        self._pending[rid] = fut
        timing.submitted = time.monotonic()
        self._outbox.put(("add", rid, ids, core_params(params)))

    def _do_tokenizer(self, fn, fut) -> None:
        try:
            result = fn(self.tokenizer)
        except Exception as e:  # noqa: BLE001 -- goes to that caller only
            self._resolve(fut, e)
            return
        self._resolve(fut, None, result)

    def _do_abort(self, rid) -> None:
        state = self._outputs.pop(rid)
        if state is None:
            return
        self._outbox.put(("abort", rid))
        fut = self._pending.pop(rid, None)
        if fut is not None:  # its caller was cancelled: nobody awaits it
            self._resolve(fut, EngineDeadError("aborted before it was admitted"))
        item = self._outputs.abort_item(state)
        self._notify_finished(state.timing)
        self._deliver([(state.stream, item)])

    def _on_message(self, msg) -> None:
        kind = msg[0]
        if kind == "out":
            _, acks, outputs, failed, stats = msg
            for rid, error in acks:
                fut = self._pending.pop(rid, None)
                if error is not None:
                    self._outputs.pop(rid)
                if fut is not None:
                    self._resolve(fut, error)
            batch, finished, stopped = self._outputs.process(outputs, time.monotonic())
            for rid in stopped:  # ended by a stop string here: the core still runs it
                self._outbox.put(("abort", rid))
            for rid, error in failed:
                state = self._outputs.pop(rid)
                if state is not None:
                    batch.append((state.stream, error_item(error)))
            if stats is not None:
                self._stats = stats
            self._deliver(batch)
            for timing in finished:
                self._notify_finished(timing)
        elif kind == "dead":
            self.dead_error = msg[1]
            log.error("outpace: the engine process stopped: %r", msg[1])
            self._fail_all(EngineDeadError(f"the engine stopped: {msg[1]!r}"))

    def _on_exit(self) -> None:
        """The core's pipe closed: its process ended (or is ending)."""
        if self._stopping:
            return
        if self._proc is not None:
            self._proc.join(2)
        if self.dead_error is None:
            self.dead_error = EngineDeadError(
                f"the engine process exited with code {self._proc.exitcode}"
                if self._proc is not None else
                "the engine process closed this front end's connection")
            log.error("outpace: %s", self.dead_error)
        self._fail_all(EngineDeadError(f"the engine stopped: {self.dead_error!r}"))

    def _fail_all(self, error: BaseException) -> None:
        """Every stream in flight and every add not yet acknowledged gets `error`."""
        for rid, fut in list(self._pending.items()):
            self._resolve(fut, error)
            self._outputs.pop(rid)
        self._pending.clear()
        self._deliver([(state.stream, error_item(error)) for state in self._outputs.pop_all()])

    def _notify_finished(self, timing: RequestTiming) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(timing)
        except Exception:  # noqa: BLE001
            log.exception("on_finished observer failed")

    # ---- pipe threads -----------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the core is gone: the reader reports it
                pass

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._inbox_lock:
                self._inbox.append(msg)
                if self._drain_queued:
                    continue
                self._drain_queued = True
            self._submit(self._drain_inbox)
        self._submit(self._on_exit)

    def _drain_inbox(self) -> None:
        """(tokenizer thread) Every message the reader has queued, runs of step messages
        taken as one: behind the core, the front end does a request's work once for all the
        steps it missed rather than once a step."""
        with self._inbox_lock:
            msgs, self._inbox = self._inbox, []
            self._drain_queued = False
        for msg in coalesce_messages(msgs):
            try:
                self._on_message(msg)
            except Exception:  # noqa: BLE001 -- the later messages must still be processed
                log.exception("front-end job _on_message failed")

