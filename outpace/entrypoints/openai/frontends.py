"""The server's further front-end processes (`outpace serve --api-server-count N`, as vLLM's):
N - 1 processes beside the server's own, each running the same app (HTTP, validation, chat
templates, tokenization, detokenization, SSE) on the one listening socket, the kernel handing
each new connection to one of them, and each with its own pipe to the one engine core
(EngineCoreClient.attach), so the front end's per-request and per-token work spreads over N
processes while one engine steps for all.

The server's process starts them once its own engine client is ready, and stops them when it
stops (SIGTERM: each drains its streams as the server does, then is killed after a bound). One
that ends on its own ends the server (vLLM's rule: a server with a front end missing would
refuse a share of the connections). Each watches a lifeline from the server's process and
exits when it is gone.

/metrics is the whole server's on any front end: the per-request metrics go through
prometheus_client's multiprocess mode, in a private temporary directory (`metrics_dir`) that
the server's process makes before prometheus_client's first import there, names in its own
PROMETHEUS_MULTIPROC_DIR (inherited by the processes it spawns) and removes when it stops; a
front end that exits is marked dead there. The engine's numbers come from each front end's
copy of the engine core's stats, sent to every front end (metrics.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_for
from typing import Iterator, Optional

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # a front end's drain after SIGTERM, before it is killed


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@contextmanager
def metrics_dir(n_front: int) -> Iterator[Optional[str]]:
    """The directory of the front ends' metric files while the block runs, or None with one
    front end (its metrics stay in memory, and the environment untouched). It is set in this
    process's environment (the server's, where prometheus_client must not have been imported
    before: it picks in-memory or file-backed values at its import) and restored after; the
    directory is removed whichever way the block ends."""
    if n_front <= 1:
        yield None
        return
    if "prometheus_client" in sys.modules:
        raise RuntimeError(
            "api_server_count above 1 needs prometheus_client's multiprocess mode, which it "
            "picks at its first import: this process imported it before the server started "
            "(run the server in a process of its own, e.g. `outpace serve`)")
    path = tempfile.mkdtemp(prefix="outpace-metrics-")
    before = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = before
        remove_metrics_dir(path)


def remove_metrics_dir(path: str) -> None:
    """Idempotent."""
    shutil.rmtree(path, ignore_errors=True)


def _mark_dead(path: Optional[str], pid: int) -> None:
    """A front end that exited: its live gauges' files go (prometheus_client's rule); its
    counters' and histograms' stay, so what it served stays in the totals."""
    if path is None:
        return
    from prometheus_client import multiprocess
    try:
        multiprocess.mark_process_dead(pid, path)
    except OSError:
        log.exception("outpace: marking front end %d's metrics dead failed", pid)


def _exit_with_parent(lifeline) -> None:
    """Watchdog thread: the lifeline's only writer is the server's process, which never
    writes; EOF means it is gone (killed included)."""
    try:
        lifeline.recv()
    except BaseException:  # noqa: BLE001 -- EOF, or the pipe broken: either way it is gone
        pass
    os._exit(1)


def frontend_main(conn, sock, server_cfg, log_level: str, lifeline, index: int,
                  metrics_path: Optional[str] = None) -> None:
    """A further front end's process (spawned): attach to the engine core over `conn`, then
    serve the app on `sock` until SIGTERM / SIGINT; its metrics go to `metrics_path`'s files."""
    if metrics_path is not None:  # before prometheus_client's import (build_app's)
        os.environ[MULTIPROC_ENV] = metrics_path
    import uvicorn

    from outpace.engine.core_client import EngineCoreClient
    from outpace.entrypoints.openai.http_protocol import header_deadline_protocol
    from outpace.entrypoints.openai.server import build_app

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("outpace").setLevel(getattr(logging, log_level.upper(), logging.INFO))
    threading.Thread(target=_exit_with_parent, args=(lifeline,), name="outpace-lifeline",
                     daemon=True).start()
    engine = EngineCoreClient.attach(conn)
    try:
        app = build_app(engine, server_cfg, metrics_dir=metrics_path)
        server = uvicorn.Server(uvicorn.Config(
            app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False,
            http=header_deadline_protocol(), timeout_keep_alive=server_cfg.timeout_keep_alive))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass
    finally:
        engine.shutdown()
    log.debug("outpace: front end %d stopped", index)


class Frontends:
    """The further front-end processes of one server: started over the first front end's
    `peer_conns`, watched, stopped."""

    def __init__(self, peer_conns: list, sock, server_cfg, log_level: str,
                 metrics_path: Optional[str] = None):
        ctx = multiprocessing.get_context("spawn")
        self._stopping = False
        self._metrics_path = metrics_path
        lifeline_r, self._lifeline = ctx.Pipe(duplex=False)
        self.procs = []
        for i, conn in enumerate(peer_conns, start=1):
            proc = ctx.Process(target=frontend_main, name=f"outpace-frontend-{i}",
                               args=(conn, sock, server_cfg, log_level, lifeline_r, i,
                                     metrics_path))
            proc.start()
            self.procs.append(proc)
        # the children hold their own copies now: the core sees a pipe's end only once the
        # front end holding it is gone, so this process keeps none
        for conn in peer_conns:
            conn.close()
        lifeline_r.close()
        self._watch = threading.Thread(target=self._watch_children, name="outpace-frontends",
                                       daemon=True)
        self._watch.start()

    def _watch_children(self) -> None:
        """A front end that fails while the server runs ends the server. One that exits
        cleanly or on SIGTERM / SIGINT was told to (Ctrl-C reaches the whole process group,
        a service manager's stop the whole group: each front end drains and exits on its own
        while the server drains too)."""
        told = (0, -signal.SIGTERM, -signal.SIGINT)
        left = {p.sentinel: p for p in self.procs}
        while left and not self._stopping:
            for sentinel in wait_for(list(left)):
                proc = left.pop(sentinel)
                proc.join(1)
                _mark_dead(self._metrics_path, proc.pid)
                if self._stopping or proc.exitcode in told:
                    continue
                log.error("outpace: front-end process %s exited (code %s): stopping the "
                          "server", proc.name, proc.exitcode)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM each (it drains its streams), then kill what is left after `timeout`.
        Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                log.warning("outpace: %s did not stop within %g s: killing it", p.name, timeout)
                p.kill()
                p.join(5)
            if p.exitcode is not None:
                _mark_dead(self._metrics_path, p.pid)
        try:
            self._lifeline.close()
        except OSError:
            pass
