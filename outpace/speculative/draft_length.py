"""How many drafts to propose for a request this step.

    fixed        k every step
    schedule     by batch size: [[max_batch, k], ...]; k = 0 above the last bound (no drafting
                 where the batch is already compute-bound). The batch size asked is the step's
                 requests, or the requests running or waiting when more are (StepPlan.
                 draft_batch_size): while a queue of requests is being admitted, the few a
                 ramp-up step holds are about to decode in the full batch
    adaptive     per request, between 1 and k: up by one after a step that accepted everything,
                 down by one after a step that accepted less than half
    cost         (adaptive="cost") every request's k in 0..k chosen together, each step, for
                 the most tokens per second of step time, from each request's acceptance per
                 position and the engine's step-time table (speculative/cost_model.py)

A schedule bounds the adaptive and cost choices: they pick at most its k at the batch size.
`lengths` asks for a whole step's requests at once (the cost model's choice is the batch's);
`choose` and `commit` split it where a choice may go unused (the fused step's, made before its
graph launches: the cost model counts only the choices used); `observe` feeds each verify step's
drafts and accepted count back.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from outpace.errors import ConfigError
from outpace.speculative.acceptance import AcceptanceEstimates
from outpace.speculative.cost_model import CostModel, DraftChoice
from outpace.speculative.step_times import StepTimes

# A drafter's conditional acceptance per position before a request has been verified: even
# odds, so that a new request drafts where steps are cheap and learns its own rate.
DEFAULT_PRIOR = 0.5


class DraftLengthPolicy:
    def __init__(self, k: int, schedule: Optional[list] = None,
                 adaptive: Union[bool, str] = False,
                 prior: Union[float, Sequence[float]] = DEFAULT_PRIOR):
        self.k = k
        self.schedule = self._check_schedule(schedule, k)
        # truthy for both per-request modes: each request's k may differ from base_k
        self.adaptive = adaptive
        self._per_request: dict = {}  # request_id -> current k (adaptive=True)
        self.cost_model = (CostModel(k, AcceptanceEstimates(k, prior)) if adaptive == "cost"
                           else None)

    def seed_prior(self, prior: Union[float, Sequence[float]]) -> None:
        """The drafter's prior acceptance per position, where new requests' estimates start."""
        if self.cost_model is not None:
            self.cost_model.estimates = AcceptanceEstimates(self.k, prior)

    def set_step_times(self, table: StepTimes, measure: bool = True) -> None:
        """The step-time table the cost model reads (the engine's, measured at start-up),
        corrected by the steps' measured times unless measure is False."""
        if self.cost_model is not None:
            self.cost_model.set_table(table, measure)

    @staticmethod
    def _check_schedule(schedule, k):
        if schedule is None:
            return None
        try:
            pairs = sorted((int(b), int(v)) for b, v in schedule)
        except (TypeError, ValueError):
            raise ConfigError("k_schedule must be a list of [max_batch_size, k] pairs, "
                              "e.g. [[8, 4], [32, 2], [64, 1]]") from None
        if any(b < 1 or not 0 <= v <= k for b, v in pairs):
            raise ConfigError(f"k_schedule entries need max_batch_size >= 1 and 0 <= k <= {k}")
        return pairs

    def base_k(self, batch_size: int) -> int:
        if self.schedule is None:
            return self.k
        for bound, k in self.schedule:
            if batch_size <= bound:
                return k
        return 0

    def __call__(self, request_id: str, batch_size: int) -> int:
        return self.lengths([request_id], batch_size)[0]

    def lengths(self, request_ids: Sequence[str], batch_size: int) -> list:
        """The draft length of each request of a step (batch_size: StepPlan.draft_batch_size)."""
        return self.commit(self.choose(request_ids, batch_size))

    def choose(self, request_ids: Sequence[str], batch_size: int) -> DraftChoice:
        """`lengths`' answer, not counted until `commit` (the cost model's probes): a choice
        never committed leaves the policy as it was."""
        k = self.base_k(batch_size)
        if self.cost_model is not None:
            return self.cost_model.decide(request_ids, batch_size, k)
        if self.adaptive:
            get = self._per_request.get
            return DraftChoice([min(k, get(rid, k)) for rid in request_ids])
        return DraftChoice([k] * len(request_ids))

    def commit(self, choice: DraftChoice) -> list:
        """Count a choice that is used -> its lengths."""
        if self.cost_model is not None:
            self.cost_model.record(choice)
        return choice.lengths

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if not self.adaptive or num_draft == 0:
            return
        if self.cost_model is not None:
            self.cost_model.estimates.observe(request_id, num_draft, num_accepted)
            return
        cur = self._per_request.get(request_id, self.k)
        if num_accepted == num_draft:
            cur = min(self.k, cur + 1)
        elif 2 * num_accepted < num_draft:
            cur = max(1, cur - 1)
        self._per_request[request_id] = cur

    def observe_many(self, request_ids: Sequence[str], num_draft: Sequence[int],
                     num_accepted: Sequence[int]) -> None:
        """`observe` for a step's requests (each at most once), at once."""
        if not self.adaptive:
            return
        if self.cost_model is not None:
            self.cost_model.estimates.observe_many(request_ids, num_draft, num_accepted)
            return
        for rid, d, a in zip(request_ids, num_draft, num_accepted):
            self.observe(rid, d, a)

    def observe_step(self, batch: int, longest: int, seconds: float) -> None:
        """A decode step's measured time (the cost model's corrections to its table)."""
        if self.cost_model is not None:
            self.cost_model.observe_step(batch, longest, seconds)

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)
        if self.cost_model is not None:
            self.cost_model.estimates.forget(request_id)
