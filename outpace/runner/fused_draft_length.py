"""The fused step's draft lengths: how many draft steps a graph's loop runs (kd) when a step is
launched from the host or chained, and under the draft-length cost model the choice it makes
for the next step (the drafts a graph makes are verified by the NEXT step, so the choice is
made at launch, once, and counted when the graph launches: DraftLengthPolicy.choose / commit).
The policy is the drafter's in the graphs (FusedStep.policy); a step that drafts nothing on
the device has kd 0. runner/fused_step.py's docstring says how the steps use it.
"""

from __future__ import annotations

from typing import Optional


class StepDraftLengths:
    def __init__(self, step):
        self.step = step  # the FusedStep (a weak proxy: it owns this part)
        # the cost model's choice for the step about to launch, made once and kept until then:
        # (the plan or the Launched step it follows, request ids, DraftChoice)
        self._choice = None
        # a host drafter's choice of 0 drafts for a chain (prev, request ids, DraftChoice)
        self._host_choice = None

    @property
    def follows_choice(self) -> bool:
        """Whether the graphs' draft loop follows the cost model's choice."""
        return self.step.drafter is not None and self.step.drafter.policy.cost_model is not None

    def draft_steps(self, batch_size: int) -> int:
        """Draft-loop length in the graph: the policy's k for this batch size (a plan's
        draft_batch_size; an upper bound of every request's own k, which the host trims to).
        Under the cost model the bound of its choice (launch_kd)."""
        if not self.step.device_drafts:
            return 0
        return self.step.policy.base_k(batch_size)

    def steady_kd(self, bucket: int, q: int) -> int:
        """The draft-loop length of the graph a steady decode step of q rows a request runs:
        the policy's k, or under the cost model q - 1 (the next step drafts as many as this
        one verifies), within the bound. Captured at start-up and timed for the step-time
        table (runner/step_timing.py: the table's (bucket, q) is the cost of choosing q - 1)."""
        kd = self.draft_steps(bucket)
        return min(q - 1, kd) if self.follows_choice else kd

    def launch_kd(self, plan) -> int:
        """The draft-loop length of plan's graph launched from the host: draft_steps, or under
        the cost model the longest draft it chooses for the next step (chosen once for plan,
        counted when the graph launches)."""
        if not self.follows_choice:
            return self.draft_steps(plan.draft_batch_size)
        rids = [sr.request.request_id for sr in plan.scheduled]
        return max(self._next_choice(plan, rids, plan.draft_batch_size).lengths, default=0)

    def chained_kd(self, prev, plan) -> Optional[int]:
        """The draft-loop length of the step chained after `prev` (plan: prev's plan, its
        requests still running), or None when it can't be chained: prev's drafts are not kd for
        every request (a per-request policy, another k at this batch size, a cost-model choice
        of several lengths or one other than kd: the device's next step verifies kd drafts of
        every row), the next choice is not one length, it would draft after a kd = 0 step (the
        skipped plane entries: the general path repairs them), or its graph was not captured
        ahead (capturing now would clobber the step in flight)."""
        if not self.step.chainable:
            return self._host_chain(prev, plan) if self.step.host_drafter is not None else None
        bucket, _, kd, _ = prev.key
        batch_size = plan.draft_batch_size
        if self.follows_choice:
            rids = [sr.request.request_id for sr in plan.scheduled]
            if prev.next_k is None or any(prev.next_k[r] != kd for r in rids):
                return None
            lengths = set(self._next_choice(prev, rids, batch_size).lengths)
            if len(lengths) != 1:
                return None
            kd_next = lengths.pop()
            if kd_next > 0 and kd == 0 and not prev.prefill:
                return None
        else:
            policy = self.step.policy
            if policy is not None and (policy.adaptive or policy.base_k(batch_size) != kd):
                return None
            kd_next = kd
        if (bucket, self.step.next_q(kd), kd_next, True) not in self.step.table.by_mode[prev.mode]:
            return None
        return kd_next

    def _host_chain(self, prev, plan) -> Optional[int]:
        """A host drafter's step chains only when the next step drafts nothing (0), else None:
        its drafts would come from prev's tokens, which the host has not read yet. Nothing to
        draft means the k schedule's 0 at this batch size, or under the cost model a choice of
        0 for every request where prev drafted nothing (so its acceptance moves no estimate),
        made now for the step after prev (kept until `take_host`, which
        counts it once the chain launches, and given to prev's collect as its next_k, so the
        host proposes nothing for the step already running). A request the drafter would not
        help then costs a plain chained step, not a wait for the host."""
        policy = self.step.runner.proposer.policy
        batch_size = plan.draft_batch_size
        self._host_choice = None
        if policy.cost_model is not None:
            if any(sr.draft_token_ids for sr in plan.scheduled):
                # prev's acceptance, not yet observed, would move the estimates the choice
                # reads: the collect after prev chooses (the same choice a sync step makes)
                return None
            rids = [sr.request.request_id for sr in plan.scheduled]
            choice = policy.choose(rids, batch_size)
            if any(choice.lengths):
                return None  # not counted: the host launch after prev's collect asks again
            self._host_choice = (prev, rids, choice)
        elif policy.adaptive or policy.base_k(batch_size) > 0:
            return None
        if (prev.key[0], 1, 0, True) not in self.step.table.by_mode[prev.mode]:
            return None
        return 0

    def take_host(self, prev) -> Optional[dict]:
        """The host drafter's choice of 0 drafts that let the step after prev chain (cost
        model), counted now that the chain launches -> prev's next_k; None otherwise."""
        kept, self._host_choice = self._host_choice, None
        if kept is None or kept[0] is not prev:
            return None
        _, rids, choice = kept
        return dict(zip(rids, self.step.runner.proposer.policy.commit(choice)))

    def _next_choice(self, after, rids: list, batch_size: int):
        """The cost model's choice of the next step's draft lengths for the step that follows
        `after` (its plan, or the Launched step it chains from), made once (DraftChoice)."""
        kept = self._choice
        if kept is None or kept[0] is not after:
            kept = self._choice = (after, rids, self.step.drafter.policy.choose(rids, batch_size))
        return kept[2]

    def choose_next(self, plan) -> Optional[dict]:
        """Under the cost model, the next step's draft lengths for plan's requests (the choice
        launch_kd made, or made now), counted: a Launched step's next_k. None otherwise."""
        if not self.follows_choice:
            return None
        self.launch_kd(plan)
        return self.take(plan)

    def take(self, after) -> Optional[dict]:
        """The choice made for `after`, counted now that its graph launches -> next_k."""
        if not self.follows_choice:
            return None
        kept, self._choice = self._choice, None
        if kept is None or kept[0] is not after:  # pragma: no cover - launch_kd, chained_kd
            raise RuntimeError("a fused step launched without its draft-length choice")
        _, rids, choice = kept
        return dict(zip(rids, self.step.drafter.policy.commit(choice)))
