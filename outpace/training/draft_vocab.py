"""EAGLE-3's draft vocabulary: the N target tokens the head can propose, chosen by frequency.

Stored as the public checkpoints store it (models/eagle3.py): `d2t` [N] int64 offsets, draft id
i -> target id i + d2t[i], and `t2d` [V] bool, the target ids the draft vocabulary covers. Draft
ids run over the chosen target ids in ascending order, so d2t is non-decreasing.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch


def count_tokens(sequences: Iterable, vocab_size: int) -> torch.Tensor:
    """[V] int64 counts of the token ids in `sequences` (iterables of ints)."""
    counts = Counter()
    for seq in sequences:
        counts.update(seq)
    out = torch.zeros(vocab_size, dtype=torch.int64)
    if counts:
        ids = torch.tensor(list(counts.keys()), dtype=torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab_size}) in the data")
        out[ids] = torch.tensor(list(counts.values()), dtype=torch.int64)
    return out


def choose_draft_vocab(counts: torch.Tensor, size: int) -> tuple:
    """The `size` most frequent ids (ties and unseen ids: the lower id first) -> (d2t [size]
    int64, t2d [V] bool)."""
    v = counts.numel()
    if not 1 <= size <= v:
        raise ValueError(f"draft vocabulary size must be in 1..{v} (the target's vocabulary), "
                         f"got {size}")
    # stable sort by descending count: equal counts keep ascending id order
    order = torch.sort(-counts, stable=True).indices[:size]
    ids = torch.sort(order).values
    d2t = ids - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def grow_draft_vocab(counts: torch.Tensor, kept: torch.Tensor, size: int) -> tuple:
    """A larger draft vocabulary that keeps every target id in `kept` (a head's:
    `draft_ids_of(d2t)`) and adds the most frequent others (ties and unseen ids: the lower id
    first) up to `size` -> (d2t [size] int64, t2d [V] bool). A head continued with it keeps its
    trained rows; only the added ids are new."""
    counts = counts.cpu()
    v = counts.numel()
    have = int(kept.numel())
    if not have <= size <= v:
        raise ValueError(f"a grown draft vocabulary must hold {have}..{v} ids (the head's and "
                         f"at most the target's vocabulary), got {size}")
    mask = torch.zeros(v, dtype=torch.bool)
    mask[kept.cpu()] = True
    # the kept ids rank first whatever their count; then the others by descending count
    top = int(counts.max()) + 1 if v else 1
    return choose_draft_vocab(torch.where(mask, torch.full_like(counts, top), counts), size)


def draft_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """[N] the target id of every draft id."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """The share of counted tokens the draft vocabulary covers."""
    total = int(counts.sum())
    return float(counts[t2d.to(counts.device)].sum()) / total if total else 0.0
