"""`outpace bench serve --client-processes N`: the load sent from N processes, so that the
client's own parsing (a Python process parses streamed chunks at a bounded rate) is not what a
fast server's numbers measure.

Process k of N takes requests k, k + N, k + 2N, ... of the single-process order (their prompts
too), concurrency C // N (plus one for the first C % N processes), rate R / N (N Poisson streams
of rate R / N are one of rate R) and its own seed. All of them open their sessions, then wait at
one barrier and start together; the summary is the single-process one over every request, with
the duration from the earliest start to the latest end (time.perf_counter is the system's
monotonic clock, the same in every process of the machine). The first process to fail ends
the load: the others are stopped and its error is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
from typing import Callable, Optional

from outpace.errors import OutpaceError

_START_TIMEOUT_S = 120.0  # every process started (imports, its session), or the load is given up


def share(total: Optional[int], k: int, n: int) -> Optional[int]:
    """Process k's share of `total` split over n processes (None: unbounded)."""
    if total is None:
        return None
    return total // n + (1 if k < total % n else 0)


def shard(cfg, prompts: list, k: int, n: int) -> tuple:
    """Process k's config and prompt list (requests k, k + n, ... in the single-process
    order, cycled as that order cycles them)."""
    sub = dataclasses.replace(
        cfg, num_prompts=share(cfg.num_prompts, k, n),
        max_concurrency=share(cfg.max_concurrency, k, n),
        request_rate=cfg.request_rate / n, seed=cfg.seed * n + k, client_processes=1)
    return sub, [prompts[(k + j * n) % len(prompts)] for j in range(len(prompts))]


def _worker(cfg, prompts: list, model: str, barrier, counter, conn) -> None:
    """A load process: its share of the load -> ("ok", results, start, end, its CPU seconds
    over the load) or ("error", text) on `conn`."""
    import threading

    from outpace.bench.serve import drive, open_session

    def done(_res) -> None:
        with counter.get_lock():
            counter.value += 1

    async def main():
        async with open_session(cfg) as session:
            return await drive(session, cfg, model, prompts, done,
                               ready=lambda: barrier.wait(_START_TIMEOUT_S))

    try:
        conn.send(("ok", *asyncio.run(main())))
    except threading.BrokenBarrierError:
        conn.send(("error", f"not every load process started within {_START_TIMEOUT_S:.0f} s"))
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which raises it
        barrier.abort()  # nobody waits for a process that will never come
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run_in_processes(cfg, prompts: list, on_progress: Optional[Callable] = None) -> dict:
    """The load of `cfg` from cfg.client_processes processes -> serve.summarize's summary."""
    from outpace.bench.serve import open_session, served_model, summarize

    async def resolve():
        async with open_session(cfg) as session:
            return await served_model(session, cfg)

    model = asyncio.run(resolve())
    n = cfg.client_processes
    ctx = multiprocessing.get_context("spawn")  # no copy of the caller's threads or loop
    barrier = ctx.Barrier(n)
    counter = ctx.Value("q", 0)
    procs, pipes = [], []
    replies, failure, seen = [None] * n, None, 0
    try:
        for k in range(n):
            sub, sub_prompts = shard(cfg, prompts, k, n)
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"outpace-load-{k}", daemon=True,
                            args=(sub, sub_prompts, model, barrier, counter, send))
            p.start()
            send.close()
            procs.append(p)
            pipes.append(recv)
        while failure is None and any(r is None for r in replies):
            for k, conn in enumerate(pipes):
                if replies[k] is not None or not conn.poll(0.05):
                    continue
                try:
                    replies[k] = conn.recv()
                except EOFError:
                    procs[k].join(1)
                    replies[k] = ("error", f"load process {k} exited with {procs[k].exitcode} "
                                           f"before it reported")
                if replies[k][0] != "ok":
                    failure = replies[k][1]  # the first to fail: the others are stopped
                    barrier.abort()
                    break
            value = counter.value
            if on_progress is not None and value > seen:
                on_progress(value - seen)
                seen = value
    finally:
        for p in procs:
            if failure is not None:
                p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if failure is not None:
        raise OutpaceError(f"a load process failed: {failure}")
    results = [res for r in replies for res in r[1]]
    start = min(r[2] for r in replies)
    end = max(r[3] for r in replies)
    return summarize(cfg, model, results, end - start, [r[4] for r in replies])
