"""Training batches: conversations -> token sequences with a loss mask, grouped by length.

A sequence is the chat-templated prompt followed by the target's answer; only answer tokens are
predicted (the mask is 1 there). A small target's long greedy answers often end in a verbatim
loop (the same span again and again); past `loop_tokens` tokens of it an answer is cut, so that
copies, which a head learns at once, do not outweigh the text it must learn to predict.
Sequences are sorted by length and cut into batches of at most
`batch_tokens` padded tokens, so little of a batch is padding; each epoch visits the batches in
an order drawn from (seed, epoch) alone, which is what makes a resumed run see exactly the batches
an uninterrupted one would.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Sequence:
    ids: tuple  # prompt then answer token ids
    answer_start: int  # ids[answer_start:] are the answer's


LOOP_SPAN = 32  # an answer loops from the first token at which a span this long repeats


def loop_start(answer: list, span: int = LOOP_SPAN) -> Optional[int]:
    """The index of the first token whose `span`-token run (answer[i:i + span]) already
    appeared earlier in the answer, or None: from there on the answer copies itself."""
    if len(answer) <= span:
        return None
    raw = array("q", answer).tobytes()
    width = 8 * span
    seen = set()
    for i in range(len(answer) - span + 1):
        key = raw[8 * i:8 * i + width]
        if key in seen:
            return i
        seen.add(key)
    return None


def sequences_from_records(records: list, max_len: int,
                           loop_tokens: Optional[int] = None) -> list:
    """Self-distillation records -> [Sequence], each cut to max_len tokens, and an answer that
    loops cut `loop_tokens` tokens after its loop starts (None: never); a record left with
    fewer than 2 answer tokens (nothing a head could learn from) is dropped."""
    out = []
    for r in records:
        prompt, answer = list(r["prompt_ids"]), list(r["answer_ids"])
        if loop_tokens is not None:
            start = loop_start(answer)
            if start is not None:
                answer = answer[:start + loop_tokens]
        ids = (prompt + answer)[:max_len]
        if len(ids) - len(prompt) >= 2:
            out.append(Sequence(ids=tuple(ids), answer_start=len(prompt)))
    return out


def plan_batches(seqs: list, batch_tokens: int) -> list:
    """-> [[sequence index]]: by length, each batch's count x its longest <= batch_tokens (a
    sequence longer than that is a batch of its own)."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i].ids), i))
    batches, cur, longest = [], [], 0
    for i in order:
        n = len(seqs[i].ids)
        if cur and (len(cur) + 1) * max(longest, n) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def epoch_order(num_batches: int, seed: int, epoch: int) -> list:
    """The batches' order in `epoch`: a permutation drawn from (seed, epoch) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_batches, generator=g).tolist()


def collate(seqs: list, idxs: list, device) -> tuple:
    """-> (input_ids [B, T] long, right-padded with 0; answer_mask [B, T] bool: the answer's
    tokens; lengths [B])."""
    t = max(len(seqs[i].ids) for i in idxs)
    ids = torch.zeros(len(idxs), t, dtype=torch.long)
    mask = torch.zeros(len(idxs), t, dtype=torch.bool)
    for row, i in enumerate(idxs):
        s = seqs[i]
        ids[row, :len(s.ids)] = torch.tensor(s.ids, dtype=torch.long)
        mask[row, s.answer_start:len(s.ids)] = True
    lengths = [len(seqs[i].ids) for i in idxs]
    return ids.to(device), mask.to(device), lengths
