"""Per-request block tables over the shared block pool, with prefix caching and lookahead.

One block table per request serves the target and every draft-head layer slot (the draft KV
plane: docs/design.md, "Pool layout"), so this manager knows nothing about layers. For one
request:

    positions   0 ......... bs-1 | bs ....... 2bs-1 | 2bs ..... c-1 c ........ c+n-1 | ...+L
    blocks      [ cached, shared ]  [ cached, shared ] [ own, partially full           ]
                 ^ prefix hit (touched)                 ^ allocate_slots: computed c, n new,
                                                          L lookahead (draft KV; docs/design.md,
                                                          "Scheduling and lookahead reservation")

cache_committed() hashes a block once all its tokens are committed and their KV is written
(prompt tokens and accepted outputs, never unverified drafts), so a block the runner may still
overwrite (a rejected draft's slot) is never findable by another request. The scheduler passes
no more tokens than the request's draft-plane mark (Request.num_draft_exact_tokens), so a block
whose draft entries a failed drafter left stale is never published either.

Prefix-cache trim (docs/design.md, "Prefix caching"): with a draft KV plane, the last draft
entry of a matched block depends on the first token of the next block, which its hash does not
fix. With `trim_last_matched_block` the last matched block of a hit is not inherited but
recomputed; the entries of the blocks before it are fixed by the next block's hash, which did
match.
"""

from __future__ import annotations

from outpace.config import CacheConfig
from outpace.kvcache.block_pool import BlockPool
from outpace.kvcache.prefix_cache import PrefixCacheStats, hash_block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_slice(request, start: int, end: int) -> list:
    """request.all_token_ids[start:end] without concatenating the whole sequence."""
    prompt, out = request.prompt_token_ids, request.output_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return out[start - n:end - n]
    return prompt[start:] + out[:end - n]


class KVCacheManager:
    def __init__(self, cache: CacheConfig, num_blocks: int, max_model_len: int,
                 trim_last_matched_block: bool = False):
        """num_blocks: blocks in the pool tensor, the null block included (see sizing.py)."""
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.enable_caching = cache.enable_prefix_caching
        self.trim_last_matched_block = trim_last_matched_block
        self.pool = BlockPool(num_blocks, enable_caching=cache.enable_prefix_caching)
        self.stats = PrefixCacheStats()
        self._blocks: dict = {}  # request_id -> [block_id]: the block table
        self._hashes: dict = {}  # request_id -> [bytes]: chained hashes of its full blocks
        self._num_cached: dict = {}  # request_id -> leading blocks already hashed in the pool
        # cached block -> the physical block before it when it was cached. The draft plane's
        # last entry of a block depends on the next block's first token, so with draft heads a
        # match must follow physical chains, not just equal hashes (see get_computed_blocks).
        self._parent: dict = {}
        self._pending_stats: dict = {}  # request_id -> (query tokens, hit tokens) of a lookup

    # ---- counters -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds for one request."""
        return self.num_blocks * self.block_size

    @property
    def max_blocks_per_request(self) -> int:
        """A block table never gets longer than this (lookahead is capped at max_model_len)."""
        return _cdiv(self.max_model_len, self.block_size)

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.stats.num_hit_tokens

    @property
    def prefix_cache_query_tokens(self) -> int:
        return self.stats.num_query_tokens

    def block_ids(self, request_id: str) -> list:
        """The request's block table (a copy): block i holds positions i*bs .. i*bs+bs-1."""
        return list(self._blocks.get(request_id, ()))

    def block_table(self, request_id: str) -> list:
        """The request's block table itself, not a copy (empty for an unknown request): for
        readers that finish with it before the table changes. A running request's table only
        grows, so what was read stays its prefix."""
        return self._blocks.get(request_id) or []

    def has_blocks(self, request_id: str) -> bool:
        return bool(self._blocks.get(request_id))

    def num_blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    # ---- request lifecycle ----------------------------------------------------------------
    def get_computed_blocks(self, request) -> int:
        """Prefix-cache lookup on admission: attach the matched blocks, return cached tokens.

        The result is block-aligned and < request.num_tokens: the last token is always computed
        so that its logits can be sampled. The caller sets request.num_computed_tokens.
        """
        rid = request.request_id
        if self._blocks.get(rid):
            raise RuntimeError(f"request {rid} already holds blocks; free it before re-admitting")
        self._blocks[rid], self._hashes[rid], self._num_cached[rid] = [], [], 0
        if not self.enable_caching:
            return 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._hashes[rid]
        matched = []
        parent = None
        for i in range(max_blocks):  # hash lazily: a miss at block 0 costs one hash
            parent = hash_block(parent, _token_slice(request, i * bs, (i + 1) * bs))
            hashes.append(parent)
            b = self.pool.lookup(parent)
            if b is None:
                break
            if self.trim_last_matched_block and matched and self._parent.get(b) != matched[-1]:
                break  # b was computed after another copy of the previous block
            matched.append(b)
        if self.trim_last_matched_block and matched:
            matched.pop()
        self.pool.touch(matched)
        self._blocks[rid] = matched
        self._num_cached[rid] = len(matched)
        # Counted once the admission goes through (allocate_slots), not per failed attempt.
        self._pending_stats[rid] = (request.num_tokens, len(matched) * bs)
        return len(matched) * bs

    def allocate_slots(self, request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Make the table cover num_computed_tokens + num_new_tokens (+ lookahead, capped at
        max_model_len: draft KV past the context is never read). All or nothing: on False no
        block was taken."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks is None:
            blocks = self._blocks[rid] = []
            self._hashes[rid], self._num_cached[rid] = [], 0
        need = self._blocks_short(request, blocks, num_new_tokens, num_lookahead_tokens)
        if need > 0:
            if need > self.pool.num_free_blocks:
                return False
            blocks.extend(self.pool.allocate(need))
        # (a decode step's call, every step for every request, skips the pop when none waits)
        pending = self._pending_stats.pop(rid, None) if self._pending_stats else None
        if pending is not None:
            self.stats.num_queries += 1
            self.stats.num_query_tokens += pending[0]
            self.stats.num_hit_tokens += pending[1]
        return True

    def _blocks_short(self, request, blocks, num_new_tokens: int,
                      num_lookahead_tokens: int) -> int:
        """Blocks allocate_slots would have to add to `blocks` (the request's table)."""
        tokens = request.num_computed_tokens + num_new_tokens
        if num_lookahead_tokens > 0 and tokens < self.max_model_len:
            tokens += min(num_lookahead_tokens, self.max_model_len - tokens)
        return -(-tokens // self.block_size) - len(blocks)

    def can_allocate_all(self, requests, num_new_tokens: int, num_lookahead_tokens: int) -> bool:
        """Whether allocate_slots(r, num_new_tokens, num_lookahead_tokens) would succeed for
        every one of `requests` in turn: their missing blocks together fit in the free pool."""
        need = 0
        for r in requests:
            need += max(0, self._blocks_short(r, self._blocks.get(r.request_id, ()),
                                              num_new_tokens, num_lookahead_tokens))
        return need <= self.pool.num_free_blocks

    def cache_committed(self, request, num_committed_tokens: int) -> None:
        """Register the hashes of blocks that became full of committed tokens (KV written)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if not blocks:
            return
        bs = self.block_size
        full = min(num_committed_tokens // bs, len(blocks), request.num_tokens // bs)
        start = self._num_cached[rid]
        if full <= start:
            return
        hashes = self._hashes[rid]
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), full):
            parent = hash_block(parent, _token_slice(request, i * bs, (i + 1) * bs))
            hashes.append(parent)
        for i in range(start, full):
            if self.pool.cache_block(blocks[i], hashes[i]):
                self._parent[blocks[i]] = blocks[i - 1] if i else None
        self._num_cached[rid] = full

    def free(self, request) -> None:
        """Release the request's blocks. Hashed ones stay findable until evicted (LRU)."""
        rid = request.request_id if not isinstance(request, str) else request
        blocks = self._blocks.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._pending_stats.pop(rid, None)
        if blocks:
            # Tail first: the tail of a prefix is the least likely part to be shared, so it
            # should be evicted before the head.
            self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()
