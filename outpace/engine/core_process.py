"""The engine-core process: the `LLMEngine` in a process of its own, apart from the server's
front end (vLLM V1's engine core), so that request parsing, tokenization, chat templates,
detokenization and SSE framing never share a GIL with the loop that launches steps.

    front end (engine/core_client.py)                engine core (this module, spawned)
    ---------------------------------                ---------------------------------
    ("add", rid, prompt ids, SamplingParams) --+
    ("abort", rid)                             +--> pipe --> EngineCore: commands between steps
    ("stop",)                                  |
                                               |            engine.step()
    output handler <-- pipe <-- ("out", acks, outputs, failed, stats): one message a step
                                                            (and one a batch of commands)
                       pipe <-- ("dead", error) before the core exits on a fatal error

Several front ends (`outpace serve --api-server-count N`) each have a pipe of their own: the
first (the server's own process, which spawned the core) gets ("ready", info) when the engine
is built; every other one sends ("hello",) first and gets its ("ready", info) then (a pipe is
not read before its front end's process has started, and the core must not block on it). Each
request's outputs, acknowledgement and failure go to the pipe it came from; the stats go to
every pipe. ("stop",) from the first front end, or its pipe's end, stops the core; from another
front end it only detaches that one (its requests aborted).

The transport is `multiprocessing.connection` (a pipe; messages pickled): plain tuples, the
`SamplingParams` dataclass, `CoreOutput` tuples, exceptions. The requests come tokenized and
run with `detokenize=False` and no stop strings: the front end detokenizes and matches them
(engine/output_processor.py), and aborts a request a stop string ended.

Failure semantics are AsyncEngine's: a failing add fails that request (its ack carries the
error); a failing step fails the requests in flight (their KV released) and the loop goes on;
after `max_consecutive_step_failures` in a row, or any error outside a step, the core sends
("dead", error) and exits. The core exits when the front end's process dies: its commands'
pipe reaches EOF, and, while a step or the model's load runs, a watchdog thread waits on a
lifeline pipe whose only writer is the front end (EOF: the front end is gone).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from multiprocessing.connection import wait as wait_connections
from typing import Optional

from outpace.engine.output_processor import CoreOutput, wall_clock_times
from outpace.errors import EngineStoppedError

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.25  # how often a front end with no outputs in a step gets the stats

def portable(error: BaseException) -> BaseException:
    """`error` if it crosses a pipe intact (pickles and unpickles), else a RuntimeError with its
    type and message: an exception from a library may hold what does not pickle."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 -- any failure to pickle
        return RuntimeError(f"{type(error).__name__}: {error}")


class EngineCore:
    """The engine loop over a connection: commands in, one output message a step out."""

    def __init__(self, engine, conns, max_consecutive_step_failures: int = 3,
                 ready: Optional[dict] = None):
        """conns: one connection, or a list of them (the first front end's first); ready:
        the ("ready", info) a later front end gets when it says hello."""
        self.engine = engine
        self.conns = list(conns) if isinstance(conns, (list, tuple)) else [conns]
        self.primary = self.conns[0]
        # the ready message, pickled once (the tokenizer is megabytes)
        self._ready = pickle.dumps(("ready", ready)) if ready is not None else None
        # the front ends that have said hello (the first from the start): only they are sent
        # outputs and stats, so the core never blocks on a pipe nobody reads yet
        self._greeted = [self.primary]
        self._stats_sent_at: dict = {}  # connection -> when it was last sent a message
        self._stats_of: dict = {}  # connection -> the stats it was last sent
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self._sent: dict = {}  # request_id -> output tokens sent, for the requests in flight
        self._owner: dict = {}  # request_id -> the connection it came from
        self._last_stats: Optional[dict] = None  # the stats last sent with a step's outputs

    def run(self) -> None:
        """Until ("stop",) or the front end's end of the pipe closes. A fatal error is sent as
        ("dead", error) and raised."""
        failures, stalled = 0, False
        engine = self.engine
        try:
            while True:
                # Block for commands when there is nothing to step; pause briefly when the last
                # step ran nothing (requests waiting on memory), rather than spin.
                idle = not engine.has_unfinished_requests()
                if idle:
                    self._send_stale_stats()
                if not self._apply_commands(wait=0.5 if idle else 0.005 if stalled else 0.0):
                    return
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 -- isolated to the requests in flight
                    failures += 1
                    log.exception("engine step failed (%d in a row)", failures)
                    if (failures >= self.max_consecutive_step_failures
                            or isinstance(e, EngineStoppedError)):  # no step will run again
                        raise
                    self._fail_in_flight(e)
                    continue
                failures = 0
                stats = self._send_outputs(outputs)
                stalled = not outputs and not (stats or {}).get("num_running", 1)
        except BaseException as e:  # noqa: BLE001 -- reported to the front end, then raised
            log.exception("engine core died")
            dead = ("dead", portable(e))
            for conn in self._greeted:
                self._send(conn, dead)
            raise

    # ---- commands -----------------------------------------------------------------------
    def _apply_commands(self, wait: float) -> bool:
        """Run the commands waiting (up to `wait` s for the first); False: stop."""
        try:
            ready = wait_connections(self.conns, timeout=wait)
        except OSError:  # a connection closed under the wait: the reads below find which
            ready = list(self.conns)
        acked: dict = {}  # connection -> acks of its adds (every connection that sent one)
        for conn in ready:
            try:
                while conn.poll(0):
                    cmd = conn.recv()
                    if cmd[0] == "stop":
                        if conn is self.primary:
                            return False
                        raise EOFError  # another front end stopping: detach it
                    if cmd[0] == "hello":
                        conn.send_bytes(self._ready)
                        if conn not in self._greeted:
                            self._greeted.append(conn)
                        continue
                    acks = acked.setdefault(conn, [])
                    if cmd[0] == "add":
                        acks.append((cmd[1], self._add(conn, *cmd[1:])))
                    elif cmd[0] == "abort":
                        self._abort(cmd[1])
            except (EOFError, OSError):  # that front end is gone
                if conn is self.primary:
                    return False
                self._detach(conn)
                acked.pop(conn, None)
        if acked:
            stats = self._stats()
            for conn, acks in acked.items():
                self._send_with_stats(conn, ("out", acks, [], [], stats))
        return True

    def _detach(self, conn) -> None:
        """A front end other than the first is gone: its requests aborted, its pipe closed."""
        if conn in self.conns:
            self.conns.remove(conn)
        if conn in self._greeted:
            self._greeted.remove(conn)
        self._stats_sent_at.pop(conn, None)
        self._stats_of.pop(conn, None)
        for rid in [r for r, c in self._owner.items() if c is conn]:
            self._abort(rid)
        try:
            conn.close()
        except OSError:
            pass

    def _add(self, conn, rid, prompt_ids, params) -> Optional[BaseException]:
        try:
            self.engine.add_request(rid, prompt_ids, params)
        except Exception as e:  # noqa: BLE001 -- goes to that request only
            return portable(e)
        self._sent[rid] = 0
        self._owner[rid] = conn
        return None

    def _abort(self, rid) -> None:
        self._owner.pop(rid, None)
        if self._sent.pop(rid, None) is None:
            return
        try:
            self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001
            log.exception("abort of %s failed", rid)

    # ---- outputs ------------------------------------------------------------------------
    def _send_outputs(self, outputs) -> Optional[dict]:
        sent, owner = self._sent, self._owner
        batches: dict = {conn: [] for conn in self._greeted}  # each front end's outputs
        any_out = False
        for out in outputs:
            rid = out.request_id
            num_sent = sent.get(rid)
            if num_sent is None:
                continue
            comp = out.outputs[0]
            n = len(comp.token_ids)
            lps = comp.logprobs[num_sent:n] if comp.logprobs is not None else None
            batch = batches.get(owner.get(rid))
            if batch is not None:
                batch.append(CoreOutput(
                    rid, comp.token_ids[num_sent:n],
                    comp.finish_reason if out.finished else None, comp.stop_reason, lps,
                    len(out.prompt_token_ids), out.num_cached_tokens or 0,
                    # the engine's stamps go once, with the first tokens
                    wall_clock_times(out.metrics) if num_sent == 0 and n else None))
                any_out = True
            if out.finished:
                del sent[rid]
                owner.pop(rid, None)
            else:
                sent[rid] = n
        # The stats go with every message: /metrics then reads the state of the step whose
        # tokens the streams have (a dict of a few numbers beside the step's outputs). A step
        # that emitted nothing and changed no stat (requests waiting on memory) sends nothing.
        stats = self._stats()
        if any_out or stats != self._last_stats:
            now = time.monotonic()
            for conn, batch in batches.items():
                # a front end with nothing this step gets the stats a few times a second
                # (its /metrics), not every step
                if batch or conn is self.primary or \
                        now - self._stats_sent_at.get(conn, 0.0) >= STATS_EVERY_S:
                    self._send_with_stats(conn, ("out", [], batch, [], stats))
                    self._stats_sent_at[conn] = now
            self._last_stats = stats
        return stats

    def _fail_in_flight(self, error: BaseException) -> None:
        error = portable(error)
        failed: dict = {conn: [] for conn in self._greeted}
        for rid in list(self._sent):
            conn = self._owner.get(rid)
            self._abort(rid)
            if conn in failed:
                failed[conn].append((rid, error))
        stats = self._stats()
        for conn, items in failed.items():
            self._send_with_stats(conn, ("out", [], [], items, stats))

    def _send_with_stats(self, conn, msg) -> None:
        """Send an ("out", ...) message, whose last item is the stats, noting them as that
        front end's."""
        self._send(conn, msg)
        self._stats_of[conn] = msg[-1]

    def _send_stale_stats(self) -> None:
        """With nothing to step: every front end whose last stats differ from the engine's is
        sent them, so each front end's /metrics ends on the engine's final numbers (the steps
        sent them only to the front ends with outputs, and to the others a few times a
        second)."""
        stats = None
        for conn in self._greeted:
            if stats is None:
                stats = self._stats()
                if stats is None:
                    return
            if self._stats_of.get(conn) != stats:
                self._send_with_stats(conn, ("out", [], [], [], stats))

    def _stats(self) -> Optional[dict]:
        try:
            stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 -- stats are best effort
            log.exception("engine.stats() failed")
            return None
        return stats

    @staticmethod
    def _send(conn, msg) -> None:
        try:
            conn.send(msg)
        except (OSError, EOFError, ValueError):  # that front end is gone: nobody listens
            pass


def _exit_with_parent(lifeline) -> None:
    """Watchdog thread: the lifeline's only writer is the front end, which never writes; EOF
    means it is gone (killed included), and the core must not outlive it."""
    try:
        lifeline.recv()
    except BaseException:  # noqa: BLE001 -- EOF, or the pipe broken: either way it is gone
        pass
    os._exit(1)


def run_engine_core(conns, lifeline, engine_args, log_level: int,
                    max_consecutive_step_failures: int = 3, build=None) -> None:
    """The process's entry (spawned): build the engine of `engine_args` (an EngineArgs; with
    `build`, a picklable function, build(engine_args) instead of LLMEngine's), send the first
    front end ("ready", info) or ("start_failed", error), then run the loop. conns: the
    front ends' connections (one, or a list: the first front end's first)."""
    conns = list(conns) if isinstance(conns, (list, tuple)) else [conns]
    conn = conns[0]
    # Ctrl-C in a terminal reaches the whole process group: the front end decides when the
    # core stops (after its streams are told), so the core ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("outpace").setLevel(log_level)
    threading.Thread(target=_exit_with_parent, args=(lifeline,), name="outpace-lifeline",
                     daemon=True).start()
    if build is None:
        from outpace.engine.engine import LLMEngine
        build = LLMEngine.from_engine_args
    try:
        engine = build(engine_args)
    except BaseException as e:  # noqa: BLE001 -- the front end reports it
        try:
            conn.send(("start_failed", portable(e)))
        except (OSError, EOFError):
            pass
        return
    info = {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
            "tokenizer": engine.tokenizer, "stats": dict(engine.stats()), "pid": os.getpid()}
    conn.send(("ready", info))
    try:
        EngineCore(engine, conns, max_consecutive_step_failures, ready=info).run()
    except BaseException:  # noqa: BLE001 -- already reported and logged: exit non-zero
        engine.shutdown()
        os._exit(1)
    engine.shutdown()
