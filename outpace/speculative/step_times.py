"""What a step costs, as the draft-length cost model (speculative/cost_model.py) reads it.

A step of `batch` requests whose longest draft is m tokens costs

    verify(bucket, q) + draft(bucket, m) + sum over requests of per_draft[k_r]

    verify      the target's step (forward, verify; in a fused graph the head's draft loop too)
                at the batch's bucket and the captured query length q >= m + 1 its rows are
                padded to: every row of a graph step costs the same, so this term depends on
                the longest draft only
    draft       the drafter's own work in a step whose longest draft is m, apart from `verify`
                (a head's eager draft loop runs m steps over the batch); absent: nothing
    per_draft   what a request drafting k tokens adds by itself: rows that are not padded (an
                eager step computes only the tokens it has) and a host drafter's work per
                request; per_draft[0] is 0

The engine fills a table at start-up (runner/step_timing.py): on CUDA from the captured graphs'
replay times, on the CPU from a few eager forwards (`eager`). Tests build tables by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from outpace.errors import ConfigError


@dataclass(frozen=True)
class StepTimes:
    buckets: tuple  # batch-size buckets, ascending
    q_lens: tuple  # query lengths a step's rows pad to, ascending (1: no drafts)
    verify: dict  # (bucket, q) -> seconds
    draft: dict = field(default_factory=dict)  # (bucket, longest draft m) -> seconds
    per_draft: tuple = ()  # [k] -> seconds a request drafting k tokens adds: () or k = 0..max

    def __post_init__(self):
        object.__setattr__(self, "buckets", tuple(sorted(self.buckets)))
        object.__setattr__(self, "q_lens", tuple(sorted(self.q_lens)))
        if not self.buckets or not self.q_lens or self.q_lens[0] != 1:
            raise ConfigError("a step-time table needs at least one bucket and the query "
                              "lengths from 1 (a step without drafts)")
        missing = [(b, q) for b in self.buckets for q in self.q_lens if (b, q) not in self.verify]
        if missing:
            raise ConfigError(f"the step-time table has no verify time for (bucket, q) "
                              f"{missing[:4]}")
        times = list(self.verify.values()) + list(self.draft.values()) + list(self.per_draft)
        if any(not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0) for t in times):
            raise ConfigError("step times must be finite numbers >= 0 (seconds)")
        if self.per_draft and len(self.per_draft) <= self.max_draft:
            raise ConfigError(f"per_draft needs an entry for every draft length 0.."
                              f"{self.max_draft}, got {len(self.per_draft)}")
        if min(self.verify.values()) <= 0:
            raise ConfigError("verify step times must be > 0 seconds")

    @property
    def max_draft(self) -> int:
        """The longest draft a step can verify: the longest query length less the bonus row."""
        return self.q_lens[-1] - 1

    def batch_time(self, batch: int, m: int) -> float:
        """Seconds of a step of `batch` requests whose longest draft is m, less the requests'
        own per_draft terms; inf where no captured query length holds m + 1 rows. Past the
        largest bucket the largest bucket's time grows in proportion to the batch."""
        q = next((q for q in self.q_lens if q >= m + 1), None)
        if q is None:
            return math.inf
        bucket = next((b for b in self.buckets if b >= batch), None)
        scale = 1.0
        if bucket is None:
            bucket = self.buckets[-1]
            scale = batch / bucket
        return scale * (self.verify[(bucket, q)] + self.draft.get((bucket, m), 0.0))

    def draft_cost(self, k: int) -> float:
        """per_draft[k]: what one request drafting k tokens adds to the step."""
        if k <= 0 or not self.per_draft:
            return 0.0
        return self.per_draft[k]

    @staticmethod
    def eager(max_batch: int, max_draft: int, step_s: float, token_s: float,
              head_step_s: float = 0.0, verify_s: float = 0.0) -> "StepTimes":
        """The table of an engine whose steps run eagerly (no rows padded): a step costs step_s
        plus token_s for every row it computes, verify_s more when it verifies drafts, and a
        head's draft loop head_step_s a draft step (the draft of position 0 comes from the
        step's own pass)."""
        buckets = tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch}
                               | {max_batch}))
        q_lens = tuple(range(1, max_draft + 2))
        verify = {(b, q): step_s + token_s * b + (verify_s if q > 1 else 0.0)
                  for b in buckets for q in q_lens}
        draft = {(b, m): head_step_s * max(0, m - 1) for b in buckets for m in range(max_draft + 1)}
        per_draft = tuple(token_s * k for k in range(max_draft + 1))
        return StepTimes(buckets, q_lens, verify, draft, per_draft)
