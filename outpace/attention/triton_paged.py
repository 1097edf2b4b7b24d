"""Paged attention in Triton: one varlen kernel for prefill chunks, decode and verify blocks.

Each program owns one tile: BLOCK_Q query tokens of one sequence x the GROUP query heads that
share one KV head (GQA heads are folded into the rows, so K/V tiles are loaded once per group):

    row r of tile (qb, seq, kvh), r = 0 .. BLOCK_M-1 (GROUP_PAD = next pow2 of GROUP):
      token = qb * BLOCK_Q + r // GROUP_PAD      head = kvh * GROUP + r % GROUP_PAD
      (rows with r % GROUP_PAD >= GROUP, or token >= q_len, are padding and masked out)

    grid = (cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads * NUM_SPLITS)

Query token i of a sequence sits at position ctx + i, ctx = seq_len - q_len, and sees KV columns
<= its position. Per tile the KV range [0, kv_end) is walked in BLOCK_N columns, gathering K/V
through the block table (column c lives in block_table[c // block_size], offset c % block_size):

    0 ........ mid ............ kv_end
    | unmasked | causal-masked   |        mid = full_end rounded down to BLOCK_N, where
                                          full_end = ctx + first token of the tile + 1

Graph capture: the kernel reads only device tensors (query_start_loc, seq_lens, block_tables); the
grid depends on shapes and on `max_query_len`, which the runner fixes per captured bucket as an
upper bound. Tiles past a sequence's q_len exit at once; padded sequences have q_len 0.

Split-KV (flash-decoding): when few tiles exist (decode/verify at small batch) each tile's KV range
is cut into NUM_SPLITS chunks (>= min_split_tokens each, computed on device from seq_lens); each
program writes an unnormalised partial (acc, running max m, running sum l) to a workspace, and
they are merged:  out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, by the tile's last
split to finish (it takes a ticket from a per-tile counter; split_counters) or, without
counters, by a second kernel. With counters only the splits whose chunk holds some of the range
(cdiv(range, chunk) of them: a short context leaves the rest empty) store a partial and take a
ticket, and the merge reads only theirs; so NUM_SPLITS is an upper bound that costs a short
context little.

Softmax runs in base 2 (qk is pre-scaled by scale * log2 e) with fp32 accumulation. fp32 q over
an fp32 pool uses three-pass TF32 dot products (tf32x3: each operand split into a TF32 high and
low part, the low x low product dropped), so it matches the reference to ~1e-6 on the tensor
cores (IEEE dot products ran on the CUDA cores); over a bf16 pool (kv_cache_dtype) q and the
softmax weights go in three bf16 pieces (kernels/bf16x3.py).

PDL (kernels/pdl.py): the kernel waits on its predecessor (the q / k / v projection that wrote
q and this step's K/V) before its first load, except for one sequence's decode / verify with
heads of at most 64 (`prefetches`), where the first tile's block-table entries and the K/V of
the columns before the step's tokens are loaded before the wait (the kernels are in
triton_paged_kernels.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from outpace.attention.base import AttentionBackend, AttentionMetadata
from outpace.errors import ConfigError
from outpace.kernels import next_pow2, pdl
from outpace.kernels.options import current
from outpace.kernels.rope import apply_rope_and_store_triton
from outpace.kernels.store_kv import store_kv_triton

try:  # guarded: `import outpace` (and this module) must work without triton
    import triton

    from outpace.attention.triton_paged_kernels import _merge_splits_kernel, _paged_attn_kernel
except Exception:  # pragma: no cover
    triton = None

LOG2E = 1.4426950408889634



@dataclass(frozen=True)
class TileConfig:
    """Compile-time tile shape of one launch (chosen from shapes only, so fixed per graph)."""

    block_q: int  # query tokens per tile
    block_m: int  # rows per tile = block_q * group_pad
    block_n: int  # KV columns per inner step
    num_warps: int
    num_stages: int


# A launch without a tile map whose longest query has at most this many tokens (a short
# prompt's prefill graph, the draft head's pass over it) takes tiles of 64 rows and 4 warps,
# 32 KV columns a step up to 96 tokens and 64 above: the 128-row, 8-warp tiles of longer
# prefills leave too few programs for the GPU at these lengths, and split-KV is slower.
# Measured on the H200 with SmolLM2's heads; see docs/decisions.md, "Short prefills take
# smaller attention tiles".
_SHORT_PREFILL_Q = 256


@functools.lru_cache(maxsize=1024)  # pure, and asked twice per launch (see num_splits_for)
def choose_tiles(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype,
                 tile_map: bool = False) -> TileConfig:
    """tile_map: a launch whose programs come from a tile map (varlen graphs), whose unit
    (block_q) is fixed for every bound above 16 (varlen_block_q)."""
    gp = next_pow2(group)
    row_bytes = next_pow2(head_dim) * dtype.itemsize  # of one K / V column
    if (max_query_len > 16 and not tile_map and max_query_len <= _SHORT_PREFILL_Q
            and dtype.itemsize <= 2 and row_bytes <= 128):  # the shapes measured
        block_m = max(64, gp)
        return TileConfig(block_m // gp, block_m, 32 if max_query_len <= 96 else 64, 4, 2)
    if max_query_len > 16:  # prefill chunks in the batch: big query tiles
        small = dtype.itemsize <= 2 and row_bytes <= 256  # fits big tiles in shared mem
        block_m = 128 if small else 64
        block_n = 64 if small else 32
        warps = 8 if small else 4
    else:  # decode / verify: as many tokens of one sequence as the bound allows; 64 columns
        # a tile up to 256-byte columns (bf16 heads of 128, fp32 of 64): 32-column tiles made
        # fp32 decode far slower than bf16 (decisions-log.md, "fp32 attention in three-pass
        # TF32 with 64-column decode tiles")
        block_m = max(16, min(next_pow2(max_query_len), max(1, 64 // gp)) * gp)
        block_n = 64 if row_bytes <= 256 else 32
        warps = 4
    block_m = max(block_m, gp)
    return TileConfig(block_m // gp, block_m, block_n, warps, 2)


def tile_map_for(query_lens: np.ndarray, max_tiles: int, block_q: int) -> np.ndarray:
    """[max_tiles, 2] int32 (sequence, query block) pairs, one per block_q query tokens of each
    sequence, then spare entries (0, a block past any sequence) that do nothing. Raises when
    the sequences need more than max_tiles."""
    blocks = -(-query_lens.astype(np.int64) // block_q)
    n = int(blocks.sum())
    if n > max_tiles:
        raise ValueError(f"{n} query tiles do not fit a map of {max_tiles}")
    out = np.empty((max_tiles, 2), np.int32)
    seqs = np.repeat(np.arange(len(query_lens), dtype=np.int32), blocks)
    out[:n, 0] = seqs
    starts = np.cumsum(blocks) - blocks  # each sequence's first entry
    out[:n, 1] = np.arange(n, dtype=np.int64) - np.repeat(starts, blocks)
    out[n:, 0] = 0
    out[n:, 1] = 1 << 30  # past any sequence's queries: inactive
    return out


def choose_splits(num_tiles: int, sm_count: int, max_splits: int) -> int:
    """Split-KV factor (power of two) so that roughly every SM gets a program."""
    if num_tiles >= sm_count or max_splits <= 1:
        return 1
    return min(next_pow2(max_splits), next_pow2(-(-sm_count // num_tiles)))


def prefetches(max_query_len: int, num_seqs: int, head_dim: int) -> bool:
    """Whether the attention kernel loads its first KV tile before the PDL wait (PREFETCH):
    for one sequence's decode / verify with heads of at most 64. That case gains: the load
    overlaps the projection before it. With more sequences, or heads of 128, the prefetch
    makes the step slower (many more programs resident early, holding the tile's registers
    next to the projection), so every other shape waits first. Measured on the H200; see
    decisions-log.md, "The attention kernel loads its first KV tile before the PDL wait"."""
    return max_query_len <= 16 and num_seqs == 1 and next_pow2(max(head_dim, 16)) <= 64


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata,
                    scale: float, num_splits: int = 1, min_split_tokens: int = 64,
                    split_counters: torch.Tensor | None = None,
                    prefetch: bool | None = None, fill: float | None = None) -> torch.Tensor:
    """q [T, Hq, D] (last dim contiguous) -> out [T, Hq, D]; K/V are read from the pool only.

    Uses meta.query_start_loc / seq_lens / block_tables (device) and meta.max_query_len (a bound
    fixed per captured graph); never the *_host mirrors. num_splits: power of two.
    split_counters: int32 zeros, one per tile at least (left zero after the launch); with them
    the last split of each tile merges the partials itself, without the merge kernel.
    prefetch: the kernel variant (None: `prefetches` picks it from the shapes; tests force it).
    fill: a value the output and the split workspace are filled with before the launch (None:
    left uninitialised; tests pass NaN, so a row read before any program wrote it shows).
    """
    t, hq, d = q.shape
    kc, vc = kv_cache[layer, 0], kv_cache[layer, 1]  # [blocks, block_size, Hkv, D]
    hkv = kc.shape[2]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if fill is not None:
        out.fill_(fill)
    num_seqs = meta.seq_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = hq // hkv
    tiles = meta.tile_map
    cfg = choose_tiles(meta.max_query_len, group, d, q.dtype, tiles is not None)
    num_splits = next_pow2(max(1, num_splits))
    block_d = next_pow2(max(d, 16))
    min_chunk = -(-max(1, min_split_tokens) // cfg.block_n) * cfg.block_n
    if num_splits > 1:
        ws_acc = torch.empty((num_splits, t, hq, d), dtype=torch.float32, device=q.device)
        ws_m = torch.empty((num_splits, t, hq), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        if fill is not None:
            for ws in (ws_acc, ws_m, ws_l):
                ws.fill_(fill)
    else:
        ws_acc = ws_m = ws_l = out  # unused by the kernel; any pointer will do
    if tiles is not None:  # (sequence, query block) pairs: see tile_map_for
        if num_splits > 1 or tiles.shape[1] != 2:
            raise ValueError("a tile map needs one split and [n, 2] (sequence, block) pairs")
        grid = (tiles.shape[0], 1, hkv)
    else:
        grid = (max(1, -(-meta.max_query_len // cfg.block_q)), num_seqs, hkv * num_splits)
    opts = pdl.launch_options(q)
    fused_merge = (num_splits > 1 and split_counters is not None
                   and split_counters.numel() >= grid[0] * grid[1] * hkv)
    _paged_attn_kernel[grid](
        q, kc, vc, out, ws_acc, ws_m, ws_l, split_counters if fused_merge else out,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        tiles if tiles is not None else meta.seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), meta.block_tables.stride(0),
        t, hq, float(scale) * LOG2E, min_chunk, d, kc.shape[1],
        GROUP=group, GROUP_PAD=next_pow2(group), BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        IS_FP32=q.dtype == torch.float32, FUSED_MERGE=fused_merge,
        PREFETCH=prefetches(meta.max_query_len, num_seqs, d) if prefetch is None else prefetch,
        TILE_MAP=tiles is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **opts)
    if num_splits > 1 and not fused_merge:
        _merge_splits_kernel[(t, hq)](
            ws_acc, ws_m, ws_l, out, meta.query_start_loc, num_seqs, out.stride(0),
            out.stride(1), t, hq, d, NUM_SPLITS=num_splits, BLOCK_D=block_d, num_warps=4,
            **opts)
    return out


class TritonPagedBackend(AttentionBackend):
    """GPU backend: Triton KV store + paged attention, graph-capturable (no host reads).

    max_kv_splits: upper bound of the split-KV factor used when a launch has fewer tiles than
    the GPU has SMs (1 disables split-KV); min_split_tokens: smallest KV chunk per split.
    At most 8 splits: short contexts use only a few either way, and launching splits that
    have nothing to do costs step time; 4 splits are slower on longer contexts, 2 slower
    still, and 128-token chunks slower than 64. Measured on the H200; see decisions-log.md,
    "At most 8 attention splits".
    """

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, *, max_kv_splits: int = 8, min_split_tokens: int = 64):
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        if triton is None:  # ImportError: callers fall back to the reference backend on it
            raise ImportError("the Triton attention backend needs triton; install it "
                              "(pip install triton) or use the reference backend")
        if kv_cache.dim() != 6 or tuple(kv_cache.shape[4:]) != (num_kv_heads, head_dim):
            raise ConfigError(f"kv_cache shape {tuple(kv_cache.shape)} does not match "
                              f"num_kv_heads={num_kv_heads}, head_dim={head_dim}")
        if num_heads % num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")
        if kv_cache.stride(-1) != 1:
            raise ConfigError("kv_cache must be contiguous in its last dimension")
        self.max_kv_splits = max_kv_splits
        self.min_split_tokens = min_split_tokens
        # Read once here, not per step: a device query is a host call we keep out of the step.
        self.sm_count = (torch.cuda.get_device_properties(kv_cache.device).multi_processor_count
                         if kv_cache.is_cuda else 1)
        # Split-KV runs only below sm_count tiles, so that many counters cover every launch;
        # a fixed buffer, so captured graphs keep its address.
        self.split_counters = torch.zeros(self.sm_count, dtype=torch.int32,
                                          device=kv_cache.device)

    def num_splits_for(self, meta: AttentionMetadata, num_q_heads: int) -> int:
        """Split-KV factor for this launch; a function of shapes and max_query_len only."""
        if meta.max_query_len > 16:
            return 1  # prefill tiles already fill the GPU
        cfg = choose_tiles(meta.max_query_len, num_q_heads // self.num_kv_heads, self.head_dim,
                           self.kv_cache.dtype)
        tiles = math.ceil(meta.max_query_len / cfg.block_q) * meta.seq_lens.shape[0] \
            * self.num_kv_heads
        return choose_splits(tiles, self.sm_count, self.max_kv_splits)

    def varlen_block_q(self, dtype: torch.dtype) -> int:
        """Query tokens per tile of a launch with more than 16 query rows and q of `dtype`: the
        unit of a tile map (AttentionMetadata.tile_map) for such launches."""
        return choose_tiles(17, self.num_heads // self.num_kv_heads, self.head_dim,
                            dtype, tile_map=True).block_q

    def forward(self, layer, q, k, v, meta: AttentionMetadata):
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]; writes k/v at meta.slot_mapping."""
        store_kv_triton(self.kv_cache, layer, k, v, meta.slot_mapping)
        return self._attend(layer, q, meta)

    def forward_rope(self, layer, q, k, v, meta: AttentionMetadata, cos, sin, positions):
        """q, k before rope: one kernel rotates q in place and writes rotated k and v into the
        pool (kernels/rope.py), then attention."""
        apply_rope_and_store_triton(q, k, v, cos, sin, positions, self.kv_cache, layer,
                                    meta.slot_mapping)
        return self._attend(layer, q, meta)

    def attend_stored(self, layer, q, meta: AttentionMetadata):
        return self._attend(layer, q, meta)

    def _attend(self, layer, q, meta: AttentionMetadata):
        return paged_attention(q, self.kv_cache, layer, meta, self.scale,
                               self.num_splits_for(meta, q.shape[1]), self.min_split_tokens,
                               self.split_counters if current().fused_split_merge else None)
