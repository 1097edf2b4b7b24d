"""Tensor parallelism's processes. The engine's process is rank 0: it schedules, and its runner
(`TensorParallelRunner`) sends every call that computes to ranks 1..N-1 before making it
itself. Those ranks are processes it spawns (`WorkerSet`); each builds its own share of the model
and its own KV pool (its KV heads) with the same builder, then runs the calls it receives
(`worker_main`). The ranks' tensors meet in a gloo group (parallel/group.py): the all-reduces
inside the forward keep them in step; the calls travel on a `multiprocessing` pipe per rank
(a rank waits on its pipe for as long as the engine idles, which a collective's timeout would
not allow).

Failure: a rank that dies breaks the group, so the next collective on every other rank raises
at once (gloo sees the closed connection); rank 0 then raises `WorkerDiedError` with the rank's
own error where it sent one, and every later call raises it too. A rank whose pipe closes (the
engine's process ended) exits."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import weakref
from typing import Optional

from outpace.engine.plan_mirror import PlanMirror, PlanSender
from outpace.errors import EngineStoppedError

log = logging.getLogger(__name__)

# Seconds a collective may wait for the other ranks (a step's longest compute on any rank,
# a long prompt's prefill chunk on a slow CPU included) and for the ranks to join at start.
COLLECTIVE_TIMEOUT_S = 1800.0
JOIN_TIMEOUT_S = 300.0


class WorkerDiedError(EngineStoppedError, RuntimeError):
    """A tensor-parallel rank ended (or the ranks fell out of step): the engine can't compute
    any more."""


def rank_threads(size: int) -> int:
    """torch's CPU threads on every rank: OMP_NUM_THREADS where set, else each rank's share of
    the cores (the ranks run at once). The same on every rank: the parts every rank computes
    whole (a draft head's fc, norms and LM head) must come out bit for bit the same, and a
    product's rounding can depend on how many threads split it."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return max(1, (os.cpu_count() or 1) // size)


@contextlib.contextmanager
def _sigint_after_the_call():
    """Ctrl-C during a call takes effect when the call has ended on rank 0, so that it never
    leaves rank 0 out of step with the others (which would have run the call whole)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (a signal reaches Python in the main thread only)
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)  # as the process would have taken it


class WorkerSet:
    """Rank 0's handle on ranks 1..size-1: started here, joined in one gloo group (`tp`, rank
    0's place in it), sent calls, stopped."""

    def __init__(self, args, size: int):
        import multiprocessing

        import torch

        from outpace.parallel.group import open_group
        self.size = size
        self.error: Optional[str] = None  # why the group broke, once it has
        ctx = multiprocessing.get_context("spawn")
        # the ranks meet through a file only this user can read (mkdtemp: mode 0700)
        self._folder = tempfile.mkdtemp(prefix="outpace-tp-")
        store = os.path.join(self._folder, "store")
        threads = rank_threads(size)
        level = logging.getLogger("outpace").getEffectiveLevel()
        self._conns, self._procs = [], []
        self._threads_before = torch.get_num_threads()
        try:
            for rank in range(1, size):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=worker_main, name=f"outpace-tp-rank{rank}", daemon=True,
                                args=(args, rank, size, store, threads, theirs, level))
                p.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(p)
            self._wait_hello()
            torch.set_num_threads(threads)
            self.tp = open_group(0, size, store, COLLECTIVE_TIMEOUT_S)
        except BaseException:
            self.stop(timeout=2.0)
            raise
        # the ranks stop with the engine, or when it is collected or the interpreter exits
        self._finalizer = weakref.finalize(self, _stop_procs, self._conns, self._procs, 5.0,
                                           self._folder)

    def _wait_hello(self) -> None:
        """Each rank's "hello" (it imported torch and is about to join), or its error."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            while not conn.poll(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise WorkerDiedError(self._why(rank, " while starting"))
            try:
                msg = conn.recv()
            except EOFError:  # it ended without a word (e.g. it could not start Python)
                raise WorkerDiedError(self._why(rank, " while starting")) from None
            if msg[0] != "hello":
                raise WorkerDiedError(f"tensor-parallel rank {rank} failed while starting: "
                                      f"{msg[1]}")

    @property
    def processes(self) -> tuple:
        """The other ranks' processes, rank 1 first."""
        return tuple(self._procs)

    def send(self, calls: list) -> None:
        """The same calls to every other rank (pickled once)."""
        if self.error is not None:
            raise WorkerDiedError(self.error)
        data = pickle.dumps(calls, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise self.broke(e, "") from e

    def broke(self, cause: BaseException, doing: str) -> WorkerDiedError:
        """The error to raise once a call failed on rank 0, a collective or a send: the rank
        that ended first, with its own error where it sent one, else rank 0's; recorded, so
        every later call raises it at once (the ranks are out of step after a failure)."""
        if self.error is None:
            what = ("was interrupted" if isinstance(cause, KeyboardInterrupt)
                    else f"failed: {type(cause).__name__}: {cause}")
            self.error = self.dead_reason(doing) or (
                f"tensor-parallel rank 0 {what}{doing}; the other ranks can't continue in "
                f"step, so the engine has stopped")
        return WorkerDiedError(self.error)

    def dead_reason(self, doing: str) -> Optional[str]:
        """Why a rank ended (None while all run): one that sent its error first, then one a
        signal ended, then any other (those may have ended of the first one's broken
        collective)."""
        ended = [r for r, p in enumerate(self._procs, start=1)
                 if not p.is_alive() or self._conns[r - 1].poll()]
        if not ended:
            return None
        reasons = [(r, self._why(r, doing)) for r in ended]
        for pick in (lambda r, why: " failed" in why,
                     lambda r, why: (self._procs[r - 1].exitcode or 0) < 0,
                     lambda r, why: True):
            for r, why in reasons:
                if pick(r, why):
                    return why
        return None

    def _why(self, rank: int, doing: str) -> str:
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        proc.join(timeout=1.0)
        sent = None
        try:
            while conn.poll():
                msg = conn.recv()
                if msg and msg[0] == "error":
                    sent = msg[1]
        except (EOFError, OSError):
            pass
        if sent is not None:
            return f"tensor-parallel rank {rank} failed{doing}: {sent}"
        if proc.exitcode is None:
            return f"tensor-parallel rank {rank} did not answer{doing}"
        hint = ""
        if doing == " while starting" and proc.exitcode == 1:
            hint = ("; a script that starts tensor-parallel ranks needs its engine under "
                    "`if __name__ == \"__main__\":` (the ranks are spawned and import it)")
        return f"tensor-parallel rank {rank} ended{doing} (exit code {proc.exitcode}){hint}"

    def stop(self, timeout: float = 5.0) -> None:
        """Ask every rank to end, then end the ones that don't; rank 0's CPU threads back to
        what they were (idempotent)."""
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        else:
            _stop_procs(self._conns, self._procs, timeout, self._folder)
        import torch
        torch.set_num_threads(self._threads_before)


def _stop_procs(conns: list, procs: list, timeout: float, folder: str) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=1.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(folder, ignore_errors=True)


class TensorParallelRunner:
    """Rank 0's runner: ModelRunner's interface for the engine; every call that computes (or
    changes what a later step computes) is sent to the other ranks first, so all ranks run the
    same steps in the same order. Steps run one at a time (no overlap of launch and collect)."""

    def __init__(self, runner, workers: WorkerSet):
        self.runner = runner
        self.workers = workers
        self._sender = PlanSender()
        self._queued: list = []  # begin / release calls, sent with the next step

    @property
    def proposer(self):
        return self.runner.proposer

    @property
    def fused(self):
        return None

    @property
    def step_clock(self):
        """Rank 0's, which never measures here: steps run one at a time on the general path
        (every rank must choose the same draft lengths, from the same table alone)."""
        return self.runner.step_clock

    def begin_request(self, req) -> None:
        self._queued.append(("begin", self._sender.begin(req)))
        self.runner.begin_request(req)

    def release(self, request_id: str) -> None:
        self._queued.append(("release", request_id))
        self._sender.release(request_id)
        self.runner.release(request_id)

    def can_launch(self, plan) -> bool:
        return False

    def execute(self, plan):
        return self._call("execute", plan, self._sender.encode(plan), " in a step")

    def measure_step_times(self, max_draft: int):
        """Rank 0's step times, given to every rank's cost model too: the draft lengths it
        picks decide how many draft steps (and collectives) a step runs, so every rank must
        pick the same, from the same table."""
        times = self._call("measure_step_times", max_draft, max_draft, " timing steps")
        self._queued.append(("set_step_times", times))
        return times

    def _call(self, name: str, arg, sent, doing: str):
        calls, self._queued = self._queued + [(name, sent)], []
        with _sigint_after_the_call():
            self.workers.send(calls)
            try:
                return getattr(self.runner, name)(arg)
            except BaseException as e:  # a collective a rank's end broke, or rank 0's failure
                err = self.workers.broke(e, doing)
                self.workers.stop(timeout=2.0)
                if isinstance(e, KeyboardInterrupt):
                    raise
                raise err from e

    def shutdown(self) -> None:
        self.workers.stop()


def worker_main(args, rank: int, size: int, store: str, threads: int, conn,
                log_level: int) -> None:
    """Rank `rank`: join the group, build this rank's runner as rank 0 builds its own, then run
    the calls rank 0 sends until it sends None or its pipe closes. An error is logged here and
    sent to rank 0 (and ends this rank, which breaks the group)."""
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides what it means (a
    # server drains its requests first, which needs every rank), and ends this rank after
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("outpace").setLevel(max(log_level, logging.WARNING))
    try:
        import torch
        torch.set_num_threads(threads)
        from outpace.engine.builder import assemble
        from outpace.engine.preflight import check_engine_args
        from outpace.parallel.group import open_group
        conn.send(("hello",))
        tp = open_group(rank, size, store, COLLECTIVE_TIMEOUT_S)
        runner = assemble(args, check_engine_args(args), tp).runner
        _serve(conn, runner)
    except EOFError:  # rank 0 ended first
        pass
    except BaseException as e:  # noqa: BLE001 -- rank 0 reports it
        log.exception("outpace: tensor-parallel rank %d failed", rank)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)


def _serve(conn, runner) -> None:
    mirror = PlanMirror()
    while True:
        calls = pickle.loads(conn.recv_bytes())
        if calls is None:
            return
        for name, arg in calls:
            if name == "begin":
                runner.begin_request(mirror.begin(arg))
            elif name == "release":
                mirror.release(arg)
                runner.release(arg)
            elif name == "execute":
                runner.execute(mirror.decode(arg))
            elif name == "measure_step_times":
                runner.measure_step_times(arg)
            elif name == "set_step_times":
                runner.proposer.policy.set_step_times(arg)
            else:
                raise ValueError(f"unknown call {name!r} from rank 0")
