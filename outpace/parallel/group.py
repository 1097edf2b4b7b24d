"""`TensorParallel`: one rank's place in a tensor-parallel group and the collectives the sharded
layers call (all-reduce after a row-parallel projection, all-gather of a vocab-parallel LM head's
logits, the minimum of a number every rank must agree on).

A model gets its `TensorParallel` at construction; size 1 (`SINGLE`) makes every collective the
identity, so unsharded code pays nothing. The process group is a torch.distributed one (gloo on
CPU) created for this engine alone, not torch.distributed's default group: several engines can
live in one process.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional

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


def open_group(rank: int, size: int, port: int, timeout_s: float,
               store=None) -> TensorParallel:
    """Rank `rank`'s TensorParallel over a gloo group of `size` ranks meeting at
    127.0.0.1:`port` (rank 0 passes the TCPStore it created there as `store`)."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
    group = dist.ProcessGroupGloo(store, rank, size, timeout)
    return TensorParallel(rank=rank, size=size, group=group)


def host_store(size: int, timeout_s: float):
    """Rank 0's TCPStore on a free port of 127.0.0.1 (its `.port` tells the others)."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, size, True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def describe(tp: Optional[TensorParallel]) -> str:
    return "" if tp is None or tp.size == 1 else f" (tensor-parallel rank {tp.rank} of {tp.size})"
