"""Process checks of the tests that start processes (tensor-parallel ranks, servers): read from
/proc, Linux only."""

from __future__ import annotations

import os
import time


def _state(pid: int):
    """A live process's state letter (Z: a zombie, ended), None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def descendants(pid: int) -> set:
    """Every live process under `pid` (from /proc's parent links)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(entry)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo.extend(kids)
    return out


def wait_all_ended(pids, timeout: float = 15.0) -> list:
    """Wait until none of `pids` is alive, at most `timeout` s -> the ones still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]
