"""Per-request acceptance estimates at each draft position, for the draft-length cost model.

For request r and draft position i (0-based), alpha[r, i] estimates the probability that draft i
is accepted given that drafts 0..i-1 were: strict prefix verification accepts a chain, so the
chain acceptance at i is prod(alpha[r, :i + 1]) and drafting k tokens emits, in expectation,

    E_r(k) = 1 + sum_{i < k} prod_{j <= i} alpha[r, j]     (the 1: the recovered / bonus token)

Each verify step observes positions 0..min(accepted, drafts - 1): drafts 0..accepted-1 were
accepted, draft `accepted` (if there was one) was rejected, later ones say nothing. An observed
position moves toward 1 or 0 by RATE (a moving average over the last few steps, so a request
that turns from free text to copying, or back, is followed within a few steps). A request starts
at the drafter's prior.

Probes: a request that drafts less than it could is not observed where it does not draft, so an
estimate that fell would never rise again (a request that starts copying later would stay
undrafted). After `backoff` such steps in a row the choice reads the prior wherever the estimate
is below it (`for_choice`), once; the step's drafts are then observed as any others. A probe the
choice still declines, or that drafts without the request then drafting on its own estimate,
doubles the backoff (from PROBE_AFTER up to PROBE_MAX), so a request whose drafts keep failing
costs a probe every PROBE_MAX steps at most; drafting on its own estimate resets it.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

RATE = 0.3  # weight of a step's observation in the moving average
PROBE_AFTER = 16  # steps drafting less than allowed before the first probe
PROBE_MAX = 256  # the longest backoff between probes


class AcceptanceEstimates:
    def __init__(self, k: int, prior: Union[float, Sequence[float]], rate: float = RATE,
                 probe_after: int = PROBE_AFTER, probe_max: int = PROBE_MAX):
        self.k = k
        p = np.broadcast_to(np.asarray(prior, dtype=np.float64), (k,)).copy() if k else \
            np.zeros(0)
        if ((p < 0) | (p > 1)).any():
            raise ValueError(f"acceptance prior must lie in [0, 1], got {prior!r}")
        self.prior = p
        self.rate = rate
        self.probe_after, self.probe_max = probe_after, probe_max
        self._alpha = np.empty((16, k))  # a row per request slot
        self._short = np.zeros(16, np.int64)  # steps in a row drafting less than allowed
        self._backoff = np.zeros(16, np.int64)  # ...before its next probe
        self._slot: dict = {}  # request_id -> row of _alpha
        self._free: list = []

    def _row(self, request_id: str) -> int:
        s = self._slot.get(request_id)
        if s is None:
            if self._free:
                s = self._free.pop()
            else:
                s = len(self._slot)
                if s == len(self._alpha):
                    self._alpha = np.concatenate([self._alpha, np.empty_like(self._alpha)])
                    self._short = np.concatenate([self._short, np.zeros_like(self._short)])
                    self._backoff = np.concatenate([self._backoff,
                                                    np.zeros_like(self._backoff)])
            self._alpha[s] = self.prior
            self._short[s] = 0
            self._backoff[s] = self.probe_after
            self._slot[request_id] = s
        return s

    def rows(self, request_ids: Sequence[str]) -> np.ndarray:
        """[B] rows of the requests (new ones start at the prior)."""
        return np.fromiter((self._row(r) for r in request_ids), np.int64, len(request_ids))

    def at(self, rows: np.ndarray) -> np.ndarray:
        """[B, k] conditional acceptance per position of those rows (a copy)."""
        return self._alpha[rows]

    def alpha(self, request_ids: Sequence[str]) -> np.ndarray:
        """[B, k] conditional acceptance per position of the requests (a copy)."""
        return self.at(self.rows(request_ids))

    def __len__(self) -> int:
        return len(self._slot)  # the requests with a row

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """A step's drafts and accepted count for a request with a row (`rows`: asked for its
        draft length); others are ignored."""
        row = self._slot.get(request_id)
        if num_draft <= 0 or row is None:
            return  # (a request ended, or never asked for drafts, keeps no slot)
        a = self._alpha[row]
        seen = min(num_accepted + 1, num_draft, self.k)
        hit = np.arange(seen) < num_accepted  # accepted positions 1, the first rejected 0
        a[:seen] += self.rate * (hit - a[:seen])

    def observe_many(self, request_ids: Sequence[str], num_draft: Sequence[int],
                     num_accepted: Sequence[int]) -> None:
        """`observe` for a step's requests at once (each at most once): one numpy pass over
        their rows instead of a few small array operations a request, which at batch 128 are
        on the host's critical path every step."""
        slot = self._slot
        picked = [(row, d, a) for row, d, a in
                  zip(map(slot.get, request_ids), num_draft, num_accepted)
                  if d > 0 and row is not None]
        if not picked:
            return
        rows, nd, na = (np.array(c, np.int64) for c in zip(*picked))
        seen = np.minimum(np.minimum(na + 1, nd), self.k)
        j = np.arange(self.k)
        hit = (j[None, :] < na[:, None]).astype(np.float64)
        a = self._alpha[rows]
        self._alpha[rows] = np.where(j[None, :] < seen[:, None], a + self.rate * (hit - a), a)

    def for_choice(self, rows: np.ndarray) -> tuple:
        """([B, k] the estimates a step's choice reads, [B] bool: which rows probe): rows
        whose backoff has run out read at least the prior at every position."""
        a = self._alpha[rows]
        probe = self._short[rows] >= self._backoff[rows]
        if probe.any():
            a[probe] = np.maximum(a[probe], self.prior[None, :])
        return a, probe

    def chosen(self, rows: np.ndarray, ks: np.ndarray, k_max: int, probe: np.ndarray) -> None:
        """Count the step's choice: drafting less than k_max continues a request's run of
        short steps; a probe doubles its backoff; drafting on its own estimate resets it."""
        if not len(rows) or k_max <= 0:
            return
        short = ks < k_max
        self._short[rows] = np.where(short, self._short[rows] + 1, 0)
        self._short[rows[probe]] = 0
        own = (ks > 0) & ~probe
        self._backoff[rows] = np.where(
            probe, np.minimum(2 * self._backoff[rows], self.probe_max),
            np.where(own, self.probe_after, self._backoff[rows]))

    def forget(self, request_id: str) -> None:
        s = self._slot.pop(request_id, None)
        if s is not None:
            self._free.append(s)

    @staticmethod
    def expected_emitted(alpha: np.ndarray) -> np.ndarray:
        """[B, k] conditional acceptance -> [B, k + 1]: E_r(k') for k' = 0..k."""
        out = np.ones((alpha.shape[0], alpha.shape[1] + 1))
        out[:, 1:] += np.cumsum(np.cumprod(alpha, axis=1), axis=1)
        return out
