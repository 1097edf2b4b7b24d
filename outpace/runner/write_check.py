"""The fused step's write check (testing only: SpecConfig.check_fused_writes): the slots a fused
or chained step's graph wrote, read back from its device-side metadata, against the blocks the
scheduler reserved for each request.

A chained step builds its positions and slots on the device from the previous step's carry, so
the host mirrors of the input buffers say nothing about where it wrote; the check reads the
device tensors themselves (the target's slot mapping and positions, and the draft loop's
positions and slots) after the step ran. Every real row's slot must be the one its position maps
to through the request's block ids as the host knows them (the plan's for a step launched from
the host, the chain's for a chained one: reserved by Scheduler.reserve_chained before the
launch); a position past those blocks maps through the device block table's zero entries to the
null block, which no request holds, so an under-reservation is caught. A row whose request
finished while the chain went on (its block ids empty: ChainedTables zeroes its table row) may
write only the null block, which nothing reads.
"""

from __future__ import annotations

import torch

from outpace.attention.base import NULL_BLOCK


class FusedWriteError(AssertionError):
    """A fused step wrote a KV slot outside the blocks reserved for its request."""


class WriteCheck:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.steps = 0  # steps checked (tests read them)
        self.chained_steps = 0
        self.slots = 0  # slots checked

    def check(self, rows: list, block_ids: list, q: int, slot_mapping: torch.Tensor,
              positions: torch.Tensor, loop: tuple = (), chained: bool = False) -> None:
        """rows: request ids in device row order; block_ids: per row the request's block ids
        ([] for a finished request's row, which writes only the null block); slot_mapping, positions: the
        target's [bucket * q]; loop: (positions, slots) of the draft loop, [kd - 1, bucket]."""
        if slot_mapping.device.type == "cuda":
            torch.cuda.synchronize()
        n = len(rows) * q
        target = list(zip(positions[:n].tolist(), slot_mapping[:n].tolist()))  # sync-ok: test
        pairs = [(rows[r // q], block_ids[r // q], p, s, "target")
                 for r, (p, s) in enumerate(target)]
        if loop:
            pos_all, slots_all = loop
            for j, (ps, ss) in enumerate(zip(pos_all.tolist(), slots_all.tolist())):  # sync-ok
                pairs += [(rows[b], block_ids[b], ps[b], ss[b], f"draft loop step {j + 1}")
                          for b in range(len(rows))]
        bs = self.block_size
        for rid, blocks, pos, slot, where in pairs:
            if slot < 0:
                continue  # padding: writes nothing
            self.slots += 1
            if not blocks:  # finished: its zeroed table row maps every position to the null block
                if slot != NULL_BLOCK * bs + pos % bs:
                    raise FusedWriteError(
                        f"{'chained' if chained else 'launched'} fused step: {rid}'s {where} "
                        f"row (its request finished) at position {pos} wrote slot {slot} "
                        f"(block {slot // bs}), not the null block's")
                continue
            block = pos // bs
            if block >= len(blocks) or slot != blocks[block] * bs + pos % bs:
                raise FusedWriteError(
                    f"{'chained' if chained else 'launched'} fused step: {rid}'s {where} row "
                    f"at position {pos} wrote slot {slot} (block {slot // bs}), outside its "
                    f"{len(blocks)} reserved blocks {list(blocks)[:8]}")
        self.steps += 1
        self.chained_steps += chained
