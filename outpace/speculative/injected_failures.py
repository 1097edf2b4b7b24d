"""Injected drafter failures (testing only: SpecConfig.inject_draft_failures = n).

Every n-th call of a proposer's `propose` raises `InjectedDraftFailure` at one of the points the
proposer marks with `at(point)`: a head alternates between before its first pass (point 0: the
draft plane keeps last step's entries for this step's rows) and after it (point 1: before the
draft loop, or after MTP depths mode's first depth has written its window; depths mode also at
point 2, after all its depths, before it keeps its stash), so tests exercise what the engine does
after a drafter raises (count, log, draft-plane repair) through an option instead of patching
the proposer.
"""

from __future__ import annotations

from typing import Optional


class InjectedDraftFailure(RuntimeError):
    pass


class InjectedFailures:
    def __init__(self, every: Optional[int]):
        self.every = every or 0
        self.calls = 0  # propose calls seen
        self.raised = 0  # failures raised
        self._point: Optional[int] = None  # where this call fails; None: it doesn't

    def begin(self, points: int = 1) -> None:
        """A propose call starts; it has `points` places it can fail at (0 .. points - 1)."""
        self._point = None
        if not self.every:
            return
        self.calls += 1
        if self.calls % self.every == 0:
            self._point = (self.calls // self.every - 1) % points

    def at(self, point: int) -> None:
        """Raise here when this call was picked to fail at `point`."""
        if self._point == point:
            self._point = None
            self.raised += 1
            raise InjectedDraftFailure(f"injected drafter failure (propose call {self.calls}, "
                                       f"point {point})")
