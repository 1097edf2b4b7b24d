"""`TensorParallel`: one rank's place in a tensor-parallel group and the collectives the sharded
layers call (all-reduce after a row-parallel projection, all-gather of a vocab-parallel LM head's
logits, the minimum of a number every rank must agree on).

A model gets its `TensorParallel` at construction; size 1 (`SINGLE`) makes every collective the
identity, so unsharded code pays nothing. The process group is a torch.distributed one (gloo on
CPU) created for this engine alone, not torch.distributed's default group: several engines can
live in one process. The ranks meet through a file in a private folder (a FileStore, no port)
and connect over 127.0.0.1 only: nothing listens beyond the host.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (every rank gets the same bits); `t` back."""
        if self.size > 1:
            work = t if t.is_contiguous() else t.contiguous()
            self.group.allreduce([work]).wait()
            if work is not t:
                t.copy_(work)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' `t` side by side along the last dimension, in rank order (every rank's
        `t` has the same shape)."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)

    def all_min(self, n: int) -> int:
        """The smallest of every rank's `n` (a size each rank computed, that all must share)."""
        if self.size == 1:
            return n
        import torch.distributed as dist
        t = torch.tensor([n], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())


SINGLE = TensorParallel()


def open_group(rank: int, size: int, store_path: str, timeout_s: float) -> TensorParallel:
    """Rank `rank`'s TensorParallel over a gloo group of `size` ranks meeting at the file
    `store_path` (in a folder only this user reads), connected over 127.0.0.1."""
    import torch.distributed as dist
    store = dist.FileStore(store_path, size)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(store, rank, size, opts)
    return TensorParallel(rank=rank, size=size, group=group)
