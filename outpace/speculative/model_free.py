"""Proposers without a model: n-gram prompt lookup and the suffix automaton.

Both keep per-request state that is caught up with the committed tokens each step
(`state.update(committed)` only reads the new tail), so a step costs O(new tokens + k).
"""

from __future__ import annotations

from outpace.errors import ConfigError
from outpace.speculative.base import DraftBatch, Proposer
from outpace.speculative.draft_length import DraftLengthPolicy
from outpace.speculative.injected_failures import InjectedFailures
from outpace.speculative.ngram import NgramState, ngram_options
from outpace.speculative.suffix import SuffixDrafter


class _StatefulProposer(Proposer):
    def __init__(self, policy: DraftLengthPolicy, spec):
        self.policy = policy
        self._states: dict = {}  # request_id -> drafter state
        self.injected = InjectedFailures(spec.inject_draft_failures)  # testing only

    def draft_lengths(self, reqs: list, batch_size: int) -> list:
        return self.policy.lengths([req.request_id for req in reqs], batch_size)

    def _state(self, req):
        st = self._states.get(req.request_id)
        if st is None:
            st = self._states[req.request_id] = self._new_state(req.prompt_token_ids)
        return st

    def begin(self, request) -> None:
        self._state(request)

    def propose(self, batch: DraftBatch, k: list) -> list:
        self.injected.begin()
        self.injected.at(0)  # (testing only: inject_draft_failures)
        out = []
        for req, committed, ki in zip(batch.requests, batch.committed, k):
            if ki <= 0:
                out.append([])
                continue
            st = self._state(req)
            st.update(committed)
            out.append(self._propose_one(st, ki))
        return out

    def finish(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.policy.forget(request_id)


class NgramProposer(_StatefulProposer):
    """Prompt lookup: continue the most recent earlier occurrence of the longest suffix n-gram."""

    def __init__(self, policy: DraftLengthPolicy, spec):
        super().__init__(policy, spec)
        self.kw = ngram_options(spec)

    def _new_state(self, prompt):
        st = NgramState(**self.kw)
        st.extend(prompt)
        return st

    def _propose_one(self, st, k: int) -> list:
        return st.propose(k)


class SuffixProposer(_StatefulProposer):
    """Suffix automaton over prompt and output (and optionally recent requests' outputs)."""

    def __init__(self, policy: DraftLengthPolicy, spec):
        super().__init__(policy, spec)
        self.drafter = make_suffix_drafter(spec)

    def _new_state(self, prompt):
        return self.drafter.new_state(prompt)

    def _propose_one(self, st, k: int) -> list:
        return self.drafter.propose(st, k)[0]

    def match(self, req, committed: list, k: int) -> tuple:
        """(tokens, match_len) for the enhancer of a neural head."""
        st = self._state(req)
        st.update(committed)
        return self.drafter.propose(st, k)

    def finish(self, request_id: str) -> None:
        st = self._states.get(request_id)
        if st is not None:
            self.drafter.finish(st)
        super().finish(request_id)


def make_suffix_drafter(spec) -> SuffixDrafter:
    try:
        return SuffixDrafter(
            min_match_len=spec.suffix_min_match_len,
            max_match_len=spec.suffix_max_match_len,
            cache_max_requests=spec.suffix_cache_requests or None,
            periodic=spec.suffix_periodic)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad suffix option: {e}") from None
