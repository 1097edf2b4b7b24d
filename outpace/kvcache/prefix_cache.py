"""Chained block hashes for prefix caching, and the hit counters.

The hash of block i covers every token before it through its parent:

    h[i] = H(h[i-1], tokens[i*bs:(i+1)*bs], extra_key)      h[-1] = ROOT

so equal hashes mean equal whole prefixes, and a lookup walks h[0], h[1], ... until the first
miss. Only full blocks of committed tokens are ever hashed (prompt tokens and accepted outputs),
never a block with an unverified draft in it. sha256 is used rather than Python's 64-bit tuple
hash because a collision would silently serve another prompt's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Optional

ROOT_HASH = b"outpace-prefix-root"


def hash_block(parent: Optional[bytes], token_ids, extra_key=None) -> bytes:
    """32-byte digest of (parent hash, the block's token ids, extra key)."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(repr(extra_key).encode())
    return h.digest()


def hash_blocks(token_ids, block_size: int, parent: Optional[bytes] = None, extra_key=None,
                start_block: int = 0, end_block: Optional[int] = None) -> list:
    """Chained hashes of full blocks start_block..end_block-1 of token_ids.

    parent is the hash of block start_block-1 (None when start_block == 0)."""
    n_full = len(token_ids) // block_size
    end = n_full if end_block is None else min(end_block, n_full)
    out = []
    for i in range(start_block, end):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key)
        out.append(parent)
    return out


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # admissions that looked the cache up
    num_query_tokens: int = 0  # tokens those admissions asked for
    num_hit_tokens: int = 0  # tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def as_dict(self) -> dict:
        return {"num_queries": self.num_queries, "num_query_tokens": self.num_query_tokens,
                "num_hit_tokens": self.num_hit_tokens, "hit_rate": self.hit_rate}
