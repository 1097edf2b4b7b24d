"""Step times as the engine measures them while it serves: corrections to the start-up table.

The start-up table (speculative/step_times.py) times the graphs alone. What a choice of draft
length costs in a running engine is more: a host drafter's next step cannot be chained, so the
device waits while the host reads the step's tokens, proposes and relaunches; a head's step
that changes length launches from the host too; the engine's own per-step work shows where the
host is the bottleneck. None of that is in a replay's time.

So the engine reports the wall time between the outputs of consecutive decode steps (two
fused decode steps in a row, nothing else run between them) together with the longest draft
that was chosen for the later one (`observe`); per (table bucket, longest draft m) a moving
average keeps how far that lies from the table's time (`correction`). The cost model adds the
correction to the table's time of every length it weighs: where drafting costs a host wait
each step, its measured time says so and the choice of 0 follows. A length not measured yet
at a bucket takes the correction of the nearest drafting length measured there (the host's
wait hardly depends on the length); at a bucket with no drafting length measured, that of the
nearest bucket that has one (nearest in ratio), scaled down in proportion where that bucket
is larger and taken as it is where it is smaller (a host drafter's work a step grows with its
requests, at most in proportion; a head's hardly at all), so that a batch draining through
smaller buckets does not try drafting afresh at each one; else none: the table's time, which
is where a new engine starts. The step without drafts is never inferred.

Noise: a correction starts at the lesser of its first two samples, so one pause of the process
(a collection, another program) cannot switch drafting off; after that a sample above OUTLIER
times the current estimate counts as OUTLIER times it. Staleness: a correction not measured
again within STALE decode steps is dropped (the table's time again), so a length the choice
gave up on is tried once in a while and measured anew (a step in STALE at most): its cost
may have changed (another batch, another load), and without it a choice of 0 made on one bad
measurement would stand for good. The step without drafts never goes stale.

The per-request `per_draft` terms of an eager table are not corrected: eager steps are not
fused decode steps, so they are never measured.
"""

from __future__ import annotations

import math
from typing import Optional

from outpace.speculative.step_times import StepTimes

RATE = 0.2  # weight of a new interval in the moving average
OUTLIER = 3.0  # a sample counts at most this many times the current estimate
STALE = 256  # decode steps after which a correction not measured again is dropped


class MeasuredSteps:
    def __init__(self, table: StepTimes, rate: float = RATE, outlier: float = OUTLIER,
                 stale: int = STALE, frozen: bool = False):
        self.table = table
        self.frozen = frozen  # observe nothing: the table alone
        self.rate, self.outlier, self.stale = rate, outlier, stale
        self._corr: dict = {}  # (bucket, m) -> seconds measured beyond the table's, averaged
        self._first: dict = {}  # (bucket, m) -> its first sample, until the second comes
        self._at: dict = {}  # (bucket, m) -> `samples` when it was last measured
        self.samples = 0  # decode steps measured
        self._count: dict = {}  # (bucket, m) -> intervals measured in all

    def _bucket(self, batch: int) -> int:
        return next((b for b in self.table.buckets if b >= batch), self.table.buckets[-1])

    def observe(self, batch: int, m: int, seconds: float) -> None:
        """One step of `batch` requests whose longest chosen draft was m took `seconds` from
        the previous decode step's output to its own."""
        if self.frozen:
            return
        base = self.table.batch_time(batch, m)
        if not (math.isfinite(base) and math.isfinite(seconds)) or seconds <= 0:
            return
        key = (self._bucket(batch), m)
        self.samples += 1
        if not self._fresh(key):  # gone stale: measured afresh
            self._corr.pop(key, None)
            self._first.pop(key, None)
        self._at[key] = self.samples
        self._count[key] = self._count.get(key, 0) + 1
        old = self._corr.get(key)
        if old is None:
            first = self._first.pop(key, None)
            if first is None:
                self._first[key] = seconds - base
            else:
                self._corr[key] = min(first, seconds - base)
            return
        seconds = min(seconds, self.outlier * max(base + old, 1e-9))
        self._corr[key] = old + self.rate * (seconds - base - old)

    def _fresh(self, key) -> bool:
        """Measured within `stale` steps; a step without drafts never goes stale (it is the
        step every choice is weighed against, and no exploration is needed to measure it)."""
        return key[1] == 0 or self.samples - self._at.get(key, -self.stale - 1) <= self.stale

    def correction(self, batch: int, m: int) -> float:
        """Seconds to add to the table's time of a step of `batch` requests drafting m."""
        bucket = self._bucket(batch)
        if (bucket, m) in self._corr and self._fresh((bucket, m)):
            return self._corr[(bucket, m)]
        if m == 0:
            return 0.0
        drafting = [(b, mm) for (b, mm) in self._corr if mm > 0 and self._fresh((b, mm))]
        if not drafting:
            return 0.0
        # the nearest measured bucket (in ratio; a tie to the smaller), then its nearest length
        near_b = min({b for b, _ in drafting}, key=lambda b: (abs(math.log(b / bucket)), b))
        near_m = min((mm for b, mm in drafting if b == near_b), key=lambda mm: (abs(mm - m), mm))
        c = self._corr[(near_b, near_m)]
        return c * bucket / near_b if near_b > bucket else c

    def batch_time(self, batch: int, m: int) -> float:
        """The table's batch_time with the measured correction (never below 0)."""
        t = self.table.batch_time(batch, m)
        return t if not math.isfinite(t) else max(t + self.correction(batch, m), 1e-12)

    def snapshot(self) -> Optional[dict]:
        """{"bucket/m": correction in ms} of the fresh corrections (for stats and
        benchmarks), None where there is none."""
        got = {f"{b}/{m}": round(c * 1e3, 4) for (b, m), c in sorted(self._corr.items())
               if self._fresh((b, m))}
        return got or None

    def sample_counts(self) -> dict:
        """{"bucket/m": intervals measured} over the engine's life (stats and benchmarks:
        which lengths were ever measured at a bucket)."""
        return {f"{b}/{m}": n for (b, m), n in sorted(self._count.items())}
