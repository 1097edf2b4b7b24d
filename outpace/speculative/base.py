"""Proposer lifecycle shared by every drafting method.

    begin(request)        the request was admitted (build per-request state)
    propose(batch)  ->    drafts for every request that committed tokens this step
    finish(request_id)    the request finished or was aborted (drop its state)

A proposer runs inside the runner's step, right after the target forward and verification, so
neural heads can read the target's hidden states of that very step (one-model speculation).
Proposers that keep KV (EAGLE-3, MTP) declare `num_kv_layers`: the runner adds that many layer
slots to the target's KV pool (the draft KV plane) and tells the proposer where they start.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from outpace.speculative.draft_length import DEFAULT_PRIOR


class CommittedTokens(Sequence):
    """A request's committed tokens, the concatenation of `parts` (its prompt, its output, a
    step's new tokens), read without copying them: the model-free drafters take the length and
    the new tail each step, and copying a whole sequence a request a step was most of the
    fused step's host-drafter bookkeeping at batch 128."""

    __slots__ = ("_parts", "_len")

    def __init__(self, *parts: list):
        self._parts = parts
        self._len = sum(map(len, parts))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return list(self)[index]
            last = self._parts[-1] if self._parts else ()
            begin = self._len - len(last)
            if stop <= start:
                return []
            if start >= begin:  # within the last part: a drafter reading a step's new tokens
                return list(last[start - begin:stop - begin])
            out: list = []
            for part in self._parts:  # each part's share of [start, stop)
                n = len(part)
                if start < n and stop > 0:
                    out.extend(part[max(start, 0):min(stop, n)])
                start, stop = start - n, stop - n
            return out
        if index < 0:
            index += self._len
        for part in self._parts:
            if 0 <= index < len(part):
                return part[index]
            index -= len(part)
        raise IndexError("CommittedTokens index out of range")


@dataclass
class DraftBatch:
    """What the runner hands a proposer after the target forward of a step.

    Rows are the target's rows of this step (all scheduled requests packed). For request i,
    rows row_start[i]..row_end[i]-1 hold positions pos..; `next_token_ids[r]` is the token at
    position(r)+1 when known (prompt token or a committed token), anything otherwise; the entry
    `last_row[i]` is the row of the last position whose next token is committed (the row whose
    head output predicts the first draft); -1 when the request sampled nothing this step.
    """

    requests: list  # [Request] every scheduled request, in row order
    committed: list  # [Sequence[int]] all committed token ids per request after this step
    # (a list, or a CommittedTokens view)
    row_start: list  # [B]
    row_end: list  # [B]
    last_row: list  # [B]
    positions: Optional[torch.Tensor] = None  # [T]
    next_token_ids: Optional[torch.Tensor] = None  # [T]
    hidden: Optional[torch.Tensor] = None  # [T, H] target output (after the final norm)
    aux_hidden: list = field(default_factory=list)  # [T, H] per captured layer
    meta: object = None  # AttentionMetadata of the target forward
    block_ids: list = field(default_factory=list)  # [B] block tables
    # [B] whether the head runs over request i's rows this step (None: every request's). Off
    # for a request whose draft length is 0: no draft work for it, its plane entries for these
    # rows left unwritten (the runner's decision: ModelRunner._first_pass)
    first_pass: Optional[list] = None


@dataclass
class DraftWork:
    """A head's draft work, counted on the host (tests and benchmarks read it): target rows its
    first pass (or MTP window) ran over and rows it skipped because the request drafts nothing
    this step, and draft-loop rows."""

    first_pass_rows: int = 0
    skipped_rows: int = 0
    loop_rows: int = 0

    def skip(self, rows: int) -> None:
        self.skipped_rows += rows


class Proposer(ABC):
    num_kv_layers: int = 0  # draft KV layer slots this proposer needs in the pool
    capture_layers: tuple = ()  # target layers whose hidden states it reads
    # Conditional acceptance per draft position (a number, or one per position) that the
    # draft-length cost model starts each request from (speculative/acceptance.py)
    acceptance_prior = DEFAULT_PRIOR

    def begin(self, request) -> None:
        pass

    @abstractmethod
    def propose(self, batch: DraftBatch, k: list) -> list:
        """k[i]: drafts wanted for request i (0: none). Returns list[list[int]] (may be shorter)."""

    def finish(self, request_id: str) -> None:
        pass
