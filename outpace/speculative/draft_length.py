"""How many drafts to propose for a request this step.

    fixed        k every step
    schedule     by batch size: [[max_batch, k], ...]; k = 0 above the last bound (no drafting
                 where the batch is already compute-bound). The batch size asked is the step's
                 requests, or the requests running or waiting when more are (StepPlan.
                 draft_batch_size): while a queue of requests is being admitted, the few a
                 ramp-up step holds are about to decode in the full batch
    adaptive     per request, between 1 and k: up by one after a step that accepted everything,
                 down by one after a step that accepted less than half
"""

from __future__ import annotations

from typing import Optional

from outpace.errors import ConfigError


class DraftLengthPolicy:
    def __init__(self, k: int, schedule: Optional[list] = None, adaptive: bool = False):
        self.k = k
        self.schedule = self._check_schedule(schedule, k)
        self.adaptive = adaptive
        self._per_request: dict = {}  # request_id -> current k (adaptive)

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
        k = self.base_k(batch_size)
        if self.adaptive:
            k = min(k, self._per_request.get(request_id, k))
        return k

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if not self.adaptive or num_draft == 0:
            return
        cur = self._per_request.get(request_id, self.k)
        if num_accepted == num_draft:
            cur = min(self.k, cur + 1)
        elif 2 * num_accepted < num_draft:
            cur = max(1, cur - 1)
        self._per_request[request_id] = cur

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)
