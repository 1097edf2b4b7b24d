"""Attention backend interface and the per-step metadata every backend reads.

KV pool layout (one tensor for the target and every draft head):

    kv_cache[layer_slot, 0|1 (K|V), block_id, offset_in_block, kv_head, head_dim]

Layer slots 0..L-1 are the target's layers; slots L.. are draft-head layers (the draft KV plane,
docs/design.md, "Pool layout"), addressed through the same block tables. Block 0 is the null
block: the block pool never hands it out, so padded rows (slot -1) may be written there and
nothing reads it.

A token's slot is `block_table[seq, pos // block_size] * block_size + pos % block_size`.
Query token i of sequence s sits at position seq_lens[s] - q_len(s) + i and attends to every
KV position <= its own (causal within a prefill chunk and within a verify block of drafts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

NULL_BLOCK = 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = padded row (writes nowhere that is read)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, KV length after this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    # Host mirrors: the runner builds them on the host anyway, so reading them is free. GPU
    # kernels must not use them (a graph replay would bake them in).
    query_start_loc_host: list = field(default_factory=list)  # [B+1]
    seq_lens_host: list = field(default_factory=list)  # [B]
    max_query_len: int = 1
    max_seq_len: int = 1
    # [n, 2] int32 (sequence, query block) pairs for the Triton attention's programs (a graph
    # of many prefill sequences, triton_paged.tile_map_for); None: every sequence x every block
    # of the longest query
    tile_map: Optional[torch.Tensor] = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1] if self.query_start_loc_host else 0


class AttentionBackend(ABC):
    """Stores new K/V into the paged pool and attends over it.

    Graph hooks: `prepare_capture` runs once before a CUDA graph is captured for a batch-size
    bucket (allocate any workspace at fixed addresses); `prepare_replay` runs on the host before
    each replay (fill that workspace from the metadata). Eager backends need neither.
    """

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float):
        self.kv_cache = kv_cache  # [slots, 2, num_blocks, block_size, Hkv, D]
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = kv_cache.shape[3]

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]. Writes k/v at meta.slot_mapping."""

    @abstractmethod
    def attend_stored(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """forward() for a step whose k/v the caller already wrote into the pool at
        meta.slot_mapping (e.g. a projection kernel that stores them itself): q [T, Hq, D]
        -> out [T, Hq, D]."""

    def forward_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """forward() of q and k before rope: rotates them (tables [max_pos, D/2 or D], see
        kernels/rope.py; q may be rotated in place) at `positions` first. Backends may fuse
        the rotation into their KV store (TritonPagedBackend does)."""
        from outpace.kernels.rope import apply_rope
        k = k.clone()  # k may be a view into the caller's qkv buffer
        apply_rope(q, k, cos, sin, positions)
        return self.forward(layer, q, k, v, meta)

    def prepare_capture(self, max_num_seqs: int, max_query_len: int) -> None:
        pass

    def prepare_replay(self, meta: AttentionMetadata) -> None:
        pass


@dataclass
class ForwardContext:
    """What a model's forward needs besides tokens and positions."""

    backend: AttentionBackend
    meta: AttentionMetadata
