"""The step plans rank 0 sends the other tensor-parallel ranks, small: a request travels whole
once (when it begins), then each step carries only what changed (its new output tokens, the
blocks its table gained, the scheduler's counters), and the receiving rank keeps a mirror of
every request to rebuild the plan its runner executes. The mirrors are read by the runner only,
as rank 0's requests are."""

from __future__ import annotations

import dataclasses
import pickle

from outpace.types import Request, ScheduledRequest, StepPlan

# What a step may change in a Request and what the runner may read: everything but the fields
# fixed at its start, the token lists (sent as deltas), the output's logprobs and the engine's
# timestamps (neither read by the runner: a row carries nothing a mirror never reads).
_FIXED = {"request_id", "prompt_token_ids", "sampling_params", "eos_token_ids",
          "max_model_len", "arrival_time", "prompt", "output_token_ids", "output_logprobs",
          "scheduled_time", "first_token_time"}
_CHANGING = tuple(f.name for f in dataclasses.fields(Request) if f.name not in _FIXED)


class PlanSender:
    """Rank 0's side: what each other rank already holds of each request."""

    def __init__(self):
        self._sent: dict = {}  # request_id -> output tokens the mirrors hold
        self._tables: dict = {}  # request_id -> the block table the mirrors hold

    def begin(self, req: Request) -> bytes:
        """The request whole (pickled now: later steps change it)."""
        self._sent[req.request_id] = len(req.output_token_ids)
        return pickle.dumps(req)

    def release(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._tables.pop(request_id, None)

    def _table_change(self, rid: str, table: list) -> tuple:
        """(entries kept, entries after them): a table only grows while its request runs, so
        mostly (len(held), the new blocks); anything else (a preempted request's new table)
        travels whole."""
        held = self._tables.get(rid, [])
        n = len(held)
        self._tables[rid] = list(table)
        if len(table) >= n and table[:n] == held:
            return n, list(table[n:])
        return 0, list(table)

    def encode(self, plan: StepPlan) -> tuple:
        rows = []
        for s in plan.scheduled:
            req = s.request
            rid, out = req.request_id, req.output_token_ids
            held = self._sent.get(rid, 0)
            # output tokens only grow; were they ever cut, the whole list goes again
            new = (held, out[held:]) if len(out) >= held else (0, list(out))
            self._sent[rid] = len(out)
            rows.append((rid, new, tuple(getattr(req, f) for f in _CHANGING),
                         s.num_computed_tokens, s.num_new_tokens, list(s.draft_token_ids),
                         s.sample, self._table_change(rid, s.block_ids)))
        return rows, list(plan.preempted_ids), plan.load


class PlanMirror:
    """Another rank's side: the mirrored requests and the plans rebuilt from rank 0's rows."""

    def __init__(self):
        self.requests: dict = {}  # request_id -> Request
        self.tables: dict = {}  # request_id -> its block table

    def begin(self, payload: bytes) -> Request:
        req = pickle.loads(payload)
        self.requests[req.request_id] = req
        return req

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.tables.pop(request_id, None)

    def decode(self, encoded: tuple) -> StepPlan:
        rows, preempted, load = encoded
        scheduled = []
        for rid, (keep, new), changing, computed, num_new, drafts, sample, (kept, more) in rows:
            req = self.requests[rid]
            del req.output_token_ids[keep:]
            req.output_token_ids.extend(new)
            table = self.tables.setdefault(rid, [])
            del table[kept:]
            table.extend(more)
            blocks = list(table)
            for name, value in zip(_CHANGING, changing):
                setattr(req, name, value)
            scheduled.append(ScheduledRequest(request=req, num_computed_tokens=computed,
                                              num_new_tokens=num_new, draft_token_ids=drafts,
                                              sample=sample, block_ids=blocks))
        return StepPlan(scheduled=scheduled, preempted_ids=preempted, load=load)
