"""The draft-length cost model: every request's k in 0..K for the next step, chosen together so
that the batch emits the most tokens per second of step time.

With E_r(k) the expected tokens request r emits when it drafts k (speculative/acceptance.py) and
the step's time from the engine's table (speculative/step_times.py) corrected by what the
running engine measures (speculative/measured_steps.py), the choice maximises

    (sum_r E_r(k_r) + requests of the batch that are not asked) / (batch_time(batch, max_r k_r)
                                                                  + sum_r per_draft[k_r])

The batch term depends on the longest draft only (a graph step pads every row to one captured
query length), so the search runs over that longest draft m = 0..K: for each m, every request
takes the k <= m that is best for the ratio. Without per-request costs that is k = m for all
(rows padded anyway cost nothing more); with them (eager rows, host drafting) a request drafts
only where its expected gain pays for its own rows, so one batch mixes lengths. The ratio of
separable sums is maximised per m by Dinkelbach's iteration (each request's best k for the
ratio found so far, until the ratio stops rising), a few numpy passes over a [B, K + 1] array.
Ties go to the shorter draft: speculation is chosen only where it is expected to gain. Where
every request drafts one length, the length last used is kept unless another beats it by
KEEP_MARGIN (a change of length launches from the host instead of chaining).

A choice is made (`decide`) apart from being counted (`record`: the probes' counts in the
estimates), so that a caller can make one it may not use: the fused step chooses the next step's
lengths before it launches a graph, and a choice that launches nothing (a chained step given up)
must not spend a request's probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from outpace.speculative.acceptance import AcceptanceEstimates
from outpace.speculative.measured_steps import MeasuredSteps
from outpace.speculative.step_times import StepTimes

_MAX_ROUNDS = 8  # Dinkelbach rounds per longest draft; it converges in two or three
_EPS = 1e-12
# Where every request drafts one length (a graph step), another length than the last one used
# must beat it by this fraction of tokens per second: a change of length cannot chain (the
# next graph's loop differs) and is launched from the host, which costs more than estimates
# moving by a few percent around a tie gain.
KEEP_MARGIN = 0.05


@dataclass(frozen=True)
class DraftChoice:
    """Each request's draft length as a policy chose them, not yet counted
    (DraftLengthPolicy.commit)."""

    lengths: list  # per request asked, in order
    counts: Optional[tuple] = None  # the cost model's (rows, ks, k_max, probe) to record


class CostModel:
    def __init__(self, k: int, estimates: AcceptanceEstimates,
                 table: Optional[StepTimes] = None):
        self.k = k
        self.estimates = estimates
        self.measured: Optional[MeasuredSteps] = None
        self._table: Optional[StepTimes] = None
        self.set_table(table)
        self.last_uniform: Optional[int] = None  # the one length of the last choice used

    @property
    def table(self) -> Optional[StepTimes]:
        return self._table

    def set_table(self, table: Optional[StepTimes], measure: bool = True) -> None:
        """The start-up table; its measured corrections start afresh. measure=False: the
        table alone decides (no step's measured time corrects it: a table given as the truth,
        as tests give one)."""
        self._table = table
        self.measured = MeasuredSteps(table, frozen=not measure) if table is not None else None

    def observe_step(self, batch: int, m: int, seconds: float) -> None:
        """A decode step's measured time (MeasuredSteps.observe): `batch` requests, m the
        longest draft chosen for it."""
        if self.measured is not None:
            self.measured.observe(batch, m, seconds)

    def choose(self, request_ids: Sequence[str], batch_size: int, k_max: int) -> list:
        """Each request's draft length (0..k_max), decided and counted."""
        choice = self.decide(request_ids, batch_size, k_max)
        self.record(choice)
        return choice.lengths

    def decide(self, request_ids: Sequence[str], batch_size: int, k_max: int) -> DraftChoice:
        """Each request's draft length (0..k_max) for a step of batch_size requests (those
        asked and any others, which draft nothing), from the estimates with their probes
        (AcceptanceEstimates.for_choice); nothing counted until `record`."""
        if self.table is None:
            raise RuntimeError("the draft-length cost model has no step-time table; the engine "
                               "measures one at start-up (LLMEngine.measure_step_times)")
        n = len(request_ids)
        if n == 0:
            return DraftChoice([])
        est = self.estimates
        rows = est.rows(request_ids)
        k_max = max(0, min(k_max, self.k, self.table.max_draft))
        alpha, probe = est.for_choice(rows)
        # (a probe reads the prior to try drafting again: no length is kept over it)
        keep = None if probe.any() else self.last_uniform
        ks = self.best_lengths(alpha[:, :k_max], batch_size, keep=keep)
        return DraftChoice(ks.tolist(), (rows, ks, k_max, probe))

    def record(self, choice: DraftChoice) -> None:
        """Count a choice that is used (AcceptanceEstimates.chosen: runs of short steps,
        probes' backoff)."""
        if choice.counts is not None:
            self.estimates.chosen(*choice.counts)
            ks = choice.counts[1]
            self.last_uniform = int(ks[0]) if len(ks) and (ks == ks[0]).all() else None

    def best_lengths(self, alpha: np.ndarray, batch_size: int,
                     keep: Optional[int] = None) -> np.ndarray:
        """[B, K] conditional acceptance -> [B] draft lengths maximising the batch's tokens per
        second under self.table (no estimates touched). keep: where every request drafts one
        length (no per-row costs), that length unless another beats it by KEEP_MARGIN."""
        table, times = self.table, self.measured
        n, k_max = alpha.shape
        batch_size = max(batch_size, n)
        gain = AcceptanceEstimates.expected_emitted(alpha)  # [B, K + 1]
        others = float(batch_size - n)  # they emit one token each
        cost = np.array([table.draft_cost(k) for k in range(k_max + 1)])
        per_row_cost = bool(cost.any())
        best_ks = np.zeros(n, np.int64)
        best = (gain[:, 0].sum() + others) / (times.batch_time(batch_size, 0) + n * cost[0])
        kept = best if keep == 0 and not per_row_cost else None  # keep's ratio
        idx = np.arange(n)
        for m in range(1, k_max + 1):
            t = times.batch_time(batch_size, m)
            if not np.isfinite(t):
                break
            if not per_row_cost:  # every request drafts m: padded rows cost nothing more
                ks = np.full(n, m, np.int64)
                ratio = (gain[:, m].sum() + others) / t
                if m == keep:
                    kept = ratio
            else:
                ks, ratio = self._best_for(gain[:, :m + 1], cost[:m + 1], t, others, idx, best)
            if ratio > best * (1 + 1e-9) + _EPS:
                best, best_ks = ratio, ks
        if kept is not None and best < kept * (1 + KEEP_MARGIN):
            return np.full(n, keep, np.int64)
        return best_ks

    @staticmethod
    def _best_for(gain, cost, t, others, idx, lam):
        """Dinkelbach over per-request k <= m: from ratio lam, each request's k maximises
        gain - lam * cost; the new ratio; repeat while it rises."""
        ks = np.argmax(gain - lam * cost[None, :], axis=1)
        ratio = (gain[idx, ks].sum() + others) / (t + cost[ks].sum())
        for _ in range(_MAX_ROUNDS):
            if ratio <= lam + _EPS:
                break
            lam = ratio
            nxt = np.argmax(gain - lam * cost[None, :], axis=1)
            r = (gain[idx, nxt].sum() + others) / (t + cost[nxt].sum())
            if r <= ratio + _EPS:
                break
            ks, ratio = nxt, r
        return ks, ratio
