"""The paged KV pool's block allocator: reference counts, an LRU free queue, cached blocks.

    block ids:   0 | 1 2 3 ... num_blocks-1
                 ^ null block: never handed out; padded rows (slot -1) write there.

    free queue (front = next to hand out / evict)            back = most recently freed
    [ uncached free blocks ... | cached free blocks, least recently used ... most recent ]

A block is either in use (ref_count > 0, not in the queue) or free (ref_count == 0, in the
queue). A free block may still hold a cached prefix (a hash): a later prefix hit "touches" it,
which takes it out of the queue and bumps its count; handing it out for new tokens evicts it
(its hash is dropped). Blocks freed without a hash go to the front, since nothing they hold is
worth keeping, so cached prefixes are evicted only when no empty block is left.
Every operation is O(1) per block (an OrderedDict is a hash map over a doubly linked list).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

NULL_BLOCK = 0  # same id as outpace.attention.base.NULL_BLOCK (not imported: that pulls torch)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs >= 2 blocks (one is the null block), got "
                             f"{num_blocks}")
        self.num_blocks = num_blocks  # including the null block
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list = [None] * num_blocks
        self._hash_to_block: dict = {}
        self._free: OrderedDict = OrderedDict((b, None) for b in range(1, num_blocks))
        self._ref[NULL_BLOCK] = 1  # pinned forever; never in the free queue

    # ---- counters -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty ones and evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a findable prefix hash (in use or free)."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> Optional[Hashable]:
        return self._hash[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # ---- allocation -----------------------------------------------------------------------
    def allocate(self, n: int) -> list:
        """Hand out n blocks with ref_count 1, evicting cached free blocks (LRU) if needed."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks but only {len(self._free)} are free; "
                               f"check num_free_blocks first")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:  # eviction: the prefix this block held can't be found any more
                del self._hash_to_block[h]
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def touch(self, block_ids) -> None:
        """Take a reference on blocks found by a prefix hit (free ones leave the queue)."""
        for b in block_ids:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def free(self, block_ids) -> None:
        """Drop one reference per block, in the given order (first freed = first evicted)."""
        for b in block_ids:
            if b == NULL_BLOCK:
                raise RuntimeError("the null block is never allocated, so it can't be freed")
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)

    # ---- prefix cache ---------------------------------------------------------------------
    def lookup(self, block_hash: Hashable) -> Optional[int]:
        """The block holding this prefix hash, or None."""
        return self._hash_to_block.get(block_hash)

    def cache_block(self, block_id: int, block_hash: Hashable) -> bool:
        """Register a full, committed block under its hash. False (and nothing changes) when
        caching is off, the block already has a hash, or another block holds the same prefix
        (two requests computed it at once; the duplicate just isn't findable)."""
        if not self.enable_caching or self._hash[block_id] is not None:
            return False
        if block_hash in self._hash_to_block:
            return False
        if self._ref[block_id] <= 0:
            raise RuntimeError(f"block {block_id} is free; only blocks in use can be cached")
        self._hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use keep their contents). Returns how many."""
        n = len(self._hash_to_block)
        for b in self._hash_to_block.values():
            self._hash[b] = None
        self._hash_to_block.clear()
        # Now-uncached free blocks keep their queue position; order among free blocks with no
        # hash doesn't matter.
        return n
