"""The wall time between consecutive decode steps' outputs, for the draft-length cost model's
measured corrections (speculative/measured_steps.py).

A fused decode step's output reaching the host (`collected`) closes an interval that began at
the previous one's, when nothing else ran between them; anything else (a prefill, a mixed or
eager step, a graph captured on first launch, a request added or aborted, which may leave the
engine idle with a step in flight: `interrupt`) breaks the run. Each interval is reported with
the longest draft that was chosen for the step it ends (`chose`, called where the draft
lengths of the next step are decided), so a choice's whole cost is measured: for a host
drafter the wait while the host reads the tokens, proposes and relaunches, for a head the host
launch a change of length takes, and wherever the host is the bottleneck its own per-step
work.
"""

from __future__ import annotations

from typing import Callable, Optional


class StepClock:
    def __init__(self, report: Callable[[int, int, float], None]):
        self.report = report  # (requests, longest draft chosen, seconds)
        self._last: Optional[float] = None  # when the previous decode step's output came
        self._pending = 0  # the longest draft chosen for the next step

    def chose(self, longest: int) -> None:
        """The next step's longest draft, as just decided."""
        self._pending = longest

    def interrupt(self) -> None:
        """A step that is not a fused decode step ran: the next interval is not a step's."""
        self._last = None

    def collected(self, requests: int, now: float) -> None:
        """A fused decode step of `requests` requests (its graph's batch bucket): its output
        reached the host at `now`."""
        if self._last is not None:
            self.report(requests, self._pending, now - self._last)
        self._last = now
