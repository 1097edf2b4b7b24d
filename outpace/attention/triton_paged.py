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
counters, by a second kernel.

Softmax runs in base 2 (qk is pre-scaled by scale * log2 e) with fp32 accumulation. fp32 inputs
use IEEE dot products (no TF32) so they match the reference to ~1e-5.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from outpace.attention.base import AttentionBackend, AttentionMetadata
from outpace.errors import ConfigError
from outpace.kernels import next_pow2, pdl
from outpace.kernels.rope import apply_rope_and_store_triton
from outpace.kernels.store_kv import store_kv_triton

try:  # guarded: `import outpace` (and this module) must work without triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

LOG2E = 1.4426950408889634


if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def _attn_tile(acc, l_i, m_i, q, k, v, cols, cmask, qpos, qk_scale, MASKED: tl.constexpr,
                   IS_FP32: tl.constexpr):
        # One KV tile of the online softmax: k [BLOCK_D, BLOCK_N], v [BLOCK_N, BLOCK_D] as
        # loaded (columns outside cmask are 0). MASKED applies the causal mask (and cmask);
        # unmasked tiles are full tiles every row of the tile may see.
        k = k.to(q.dtype)
        if IS_FP32:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        qk = qk * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        if MASKED:
            vis = (cols[None, :] <= qpos[:, None]) & cmask[None, :]
            qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen nothing yet (possible under split-KV) keeps m = -inf; shift by 0
        # instead so exp2 gives 0 rather than NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v.to(q.dtype)  # masked rows are 0 so garbage can't leak
        if IS_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return acc, l_i, m_new

    @triton.jit
    def _kv_offsets(bt_row_ptr, cols, cmask, kvh, stride_cb, stride_co, stride_ch,
                    BLOCK_SIZE: tl.constexpr, CG: tl.constexpr):
        # Pool offsets of KV columns `cols` of one sequence (through its block table); CG:
        # the block-table load bypasses L1.
        if CG:
            blk = tl.load(bt_row_ptr + cols // BLOCK_SIZE, mask=cmask, other=0,
                          cache_modifier=".cg")
        else:
            blk = tl.load(bt_row_ptr + cols // BLOCK_SIZE, mask=cmask, other=0)
        blk = blk.to(tl.int64)
        return blk * stride_cb + (cols % BLOCK_SIZE) * stride_co + kvh * stride_ch

    @triton.jit
    def _attn_tiles(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row_ptr, lo, hi, qpos, offs_d, dmask,
                    kvh, stride_cb, stride_co, stride_ch, qk_scale, BLOCK_SIZE: tl.constexpr,
                    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP32: tl.constexpr,
                    CG: tl.constexpr):
        # Online softmax over KV columns [lo, hi). MASKED applies the causal mask (and hi);
        # unmasked calls only get full tiles every row of the tile may see.
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cmask = cols < hi
            kv_off = _kv_offsets(bt_row_ptr, cols, cmask, kvh, stride_cb, stride_co, stride_ch,
                                 BLOCK_SIZE, CG)
            k = tl.load(kc_ptr + kv_off[None, :] + offs_d[:, None],
                        mask=cmask[None, :] & dmask[:, None], other=0.0)
            v = tl.load(vc_ptr + kv_off[:, None] + offs_d[None, :],
                        mask=cmask[:, None] & dmask[None, :], other=0.0)
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k, v, cols, cmask, qpos, qk_scale,
                                       MASKED, IS_FP32)
        return acc, l_i, m_i

    @triton.jit
    def _paged_attn_kernel(
            q_ptr, kc_ptr, vc_ptr, out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, cnt_ptr,
            qsl_ptr, seq_lens_ptr, bt_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_co, stride_ch,
            stride_bt, num_tokens, num_q_heads, qk_scale, min_chunk, HEAD_DIM,
            BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr,
            NUM_SPLITS: tl.constexpr, IS_FP32: tl.constexpr, FUSED_MERGE: tl.constexpr,
            PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
        # PREFETCH: before the PDL wait (kernels/pdl.py) the kernel reads what only kernels at
        # least two launches back wrote, which have finished once it runs (its predecessor
        # launched it after its own wait): the step's query layout, lengths and block tables,
        # and the KV of every column before this step's tokens. So the first tile's
        # block-table entries and old K / V are in flight while the predecessor (the q / k / v
        # projection) still runs; q and this step's K / V are read after the wait. Those early
        # loads bypass L1 (.cg): L2 is coherent with the writers on other SMs. Without
        # PREFETCH the kernel waits before its first load (see paged_attention for when).
        if not PREFETCH:
            wait_then_release(USE_PDL)
        qb = tl.program_id(0)
        seq = tl.program_id(1)
        kvh = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        q_start = tl.load(qsl_ptr + seq, cache_modifier=".cg")
        q_len = tl.load(qsl_ptr + seq + 1, cache_modifier=".cg") - q_start
        first = qb * BLOCK_Q  # first local query token of this tile
        active = first < q_len  # else a tile past this sequence's queries (or a padded one)
        if not PREFETCH:
            if not active:
                return
        seq_len = tl.load(seq_lens_ptr + seq, cache_modifier=".cg")
        ctx = seq_len - q_len
        last = tl.minimum(q_len, first + BLOCK_Q) - 1

        kv_end = ctx + last + 1
        if NUM_SPLITS == 1:
            lo = kv_end * 0
            hi = kv_end
        else:
            chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
            chunk = tl.maximum(chunk, min_chunk)  # min_chunk is a multiple of BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, kv_end)
        mid = ((ctx + first + 1) // BLOCK_N) * BLOCK_N
        mid = tl.minimum(tl.maximum(mid, lo), hi)

        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
        if PREFETCH:
            cols0 = lo + tl.arange(0, BLOCK_N)  # the first tile, [lo, lo + BLOCK_N)
            cmask0 = cols0 < tl.where(active, hi, lo)  # an inactive tile loads nothing
            kv_off0 = _kv_offsets(bt_row_ptr, cols0, cmask0, kvh, stride_cb, stride_co,
                                  stride_ch, BLOCK_SIZE, True)
            old0 = cmask0 & (cols0 < ctx)
            k0 = tl.load(kc_ptr + kv_off0[None, :] + offs_d[:, None],
                         mask=old0[None, :] & dmask[:, None], other=0.0, cache_modifier=".cg")
            v0 = tl.load(vc_ptr + kv_off0[:, None] + offs_d[None, :],
                         mask=old0[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")

            wait_then_release(USE_PDL)  # everything below may read what the predecessor wrote
            if not active:
                return

            new0 = cmask0 & (cols0 >= ctx)  # this step's tokens in the first tile (0 above)
            k0 += tl.load(kc_ptr + kv_off0[None, :] + offs_d[:, None],
                          mask=new0[None, :] & dmask[:, None], other=0.0)
            v0 += tl.load(vc_ptr + kv_off0[:, None] + offs_d[None, :],
                          mask=new0[:, None] & dmask[None, :], other=0.0)

        rows = tl.arange(0, BLOCK_M)
        tok = first + rows // GROUP_PAD  # local query token of each row
        hig = rows % GROUP_PAD
        row_ok = (tok < q_len) & (hig < GROUP)
        head = kvh * GROUP + hig
        # Pad rows borrow the last real token's position so no row is ever fully masked.
        qpos = ctx + tl.minimum(tok, q_len - 1)
        tok_g = (q_start + tok).to(tl.int64)
        io_mask = row_ok[:, None] & dmask[None, :]
        q = tl.load(q_ptr + tok_g[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        start = lo
        if PREFETCH:
            # the first tile, always masked (exact for a full tile too); the rest as below
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k0, v0, cols0, cmask0, qpos, qk_scale,
                                       True, IS_FP32)
            start = tl.minimum(lo + BLOCK_N, hi)
            mid = tl.maximum(mid, start)
        # full tiles every row of the tile sees unmasked, then the causal edge masked
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row_ptr, start, mid,
                                    qpos, offs_d, dmask, kvh, stride_cb, stride_co, stride_ch,
                                    qk_scale, BLOCK_SIZE, False, BLOCK_N, IS_FP32, PREFETCH)
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row_ptr, mid, hi, qpos,
                                    offs_d, dmask, kvh, stride_cb, stride_co, stride_ch,
                                    qk_scale, BLOCK_SIZE, True, BLOCK_N, IS_FP32, PREFETCH)

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh
                     + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            # workspace: acc [NUM_SPLITS, T, Hq, HEAD_DIM], m and l [NUM_SPLITS, T, Hq]
            idx = (split * num_tokens + tok_g) * num_q_heads + head
            tl.store(ws_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
            tl.store(ws_m_ptr + idx, m_i, mask=row_ok)
            tl.store(ws_l_ptr + idx, l_i, mask=row_ok)
            if FUSED_MERGE:
                # The tile's last split to finish merges all of them (no second kernel). Its
                # acq_rel ticket orders the other splits' partial stores (each issued before
                # their own ticket, behind a barrier) before its loads.
                tl.debug_barrier()
                tile = (seq * tl.num_programs(0) + qb) * (tl.num_programs(2) // NUM_SPLITS) + kvh
                ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if ticket == NUM_SPLITS - 1:
                    tl.store(cnt_ptr + tile, 0)  # zero again for the next launch (graphs)
                    _merge_tile(ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, tok_g, head, row_ok,
                                offs_d, io_mask, stride_ot, stride_oh, num_tokens,
                                num_q_heads, HEAD_DIM, NUM_SPLITS, BLOCK_M, BLOCK_D)

    @triton.jit
    def _merge_tile(ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, tok_g, head, row_ok, offs_d,
                    io_mask, stride_ot, stride_oh, num_tokens, num_q_heads, HEAD_DIM,
                    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        # The merge of _merge_splits_kernel for one tile's rows. Loads bypass L1 (.cg): the
        # partials were written by other programs of this launch.
        s = tl.arange(0, NUM_SPLITS)
        idx = (s[:, None] * num_tokens + tok_g[None, :]) * num_q_heads + head[None, :]
        m = tl.load(ws_m_ptr + idx, mask=row_ok[None, :], other=float("-inf"),
                    cache_modifier=".cg")  # [NUM_SPLITS, BLOCK_M]
        l_s = tl.load(ws_l_ptr + idx, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_max[None, :])  # empty splits have m = -inf -> weight 0
        den = tl.sum(w * l_s, 0)
        num = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(NUM_SPLITS):  # unrolled: the loads are issued together
            row = (j * num_tokens + tok_g) * num_q_heads + head
            a = tl.load(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=io_mask,
                        other=0.0, cache_modifier=".cg")
            w_j = tl.sum(tl.where(s[:, None] == j, w, 0.0), 0)
            num += w_j[:, None] * a
        out = num / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)

    @triton.jit
    def _merge_splits_kernel(ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, qsl_ptr, num_seqs,
                             stride_ot, stride_oh, num_tokens, num_q_heads, HEAD_DIM,
                             NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                             USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        if t >= tl.load(qsl_ptr + num_seqs):  # padding token after the last sequence
            return
        s = tl.arange(0, NUM_SPLITS)
        idx = (s * num_tokens + t) * num_q_heads + h
        m = tl.load(ws_m_ptr + idx)
        l_s = tl.load(ws_l_ptr + idx)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_max)  # empty splits have m = -inf -> weight 0
        d = tl.arange(0, BLOCK_D)
        a = tl.load(ws_acc_ptr + idx[:, None] * HEAD_DIM + d[None, :],
                    mask=(d < HEAD_DIM)[None, :], other=0.0)
        num = tl.sum(w[:, None] * a, 0)
        den = tl.sum(w * l_s, 0)
        out = num / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)


# The last split of a tile merges the partials (no merge kernel; 1.6 us a layer at batch 1).
FUSED_SPLIT_MERGE = True


@dataclass(frozen=True)
class TileConfig:
    """Compile-time tile shape of one launch (chosen from shapes only, so fixed per graph)."""

    block_q: int  # query tokens per tile
    block_m: int  # rows per tile = block_q * group_pad
    block_n: int  # KV columns per inner step
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=1024)  # pure, and asked twice per launch (see num_splits_for)
def choose_tiles(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype) -> TileConfig:
    gp = next_pow2(group)
    small = dtype.itemsize <= 2 and next_pow2(head_dim) <= 128  # fits big tiles in shared mem
    if max_query_len > 16:  # prefill chunks in the batch: big query tiles
        block_m = 128 if small else 64
        block_n = 64 if small else 32
        warps = 8 if small else 4
    else:  # decode / verify: as many tokens of one sequence as the bound allows
        block_m = max(16, min(next_pow2(max_query_len), max(1, 64 // gp)) * gp)
        block_n = 64 if small else 32
        warps = 4
    block_m = max(block_m, gp)
    return TileConfig(block_m // gp, block_m, block_n, warps, 2)


def choose_splits(num_tiles: int, sm_count: int, max_splits: int) -> int:
    """Split-KV factor (power of two) so that roughly every SM gets a program."""
    if num_tiles >= sm_count or max_splits <= 1:
        return 1
    return min(next_pow2(max_splits), next_pow2(-(-sm_count // num_tiles)))


def prefetches(max_query_len: int, num_seqs: int, head_dim: int) -> bool:
    """Whether the attention kernel loads its first KV tile before the PDL wait (PREFETCH):
    for one sequence's decode / verify with heads of at most 64. Measured on the H200 (run 17,
    the prefetch at every shape): SmolLM2's batch-1 graphs 0.537 -> 0.505 ms (no-spec) and
    0.767 -> 0.750 (EAGLE-3 k = 2), but batch 8-128 up to 0.196 ms slower and the 8B-shaped
    batch-1 graph (heads of 128) 0.14 ms slower, so only that case takes it."""
    return max_query_len <= 16 and num_seqs == 1 and next_pow2(max(head_dim, 16)) <= 64


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata,
                    scale: float, num_splits: int = 1, min_split_tokens: int = 64,
                    split_counters: torch.Tensor | None = None,
                    prefetch: bool | None = None) -> torch.Tensor:
    """q [T, Hq, D] (last dim contiguous) -> out [T, Hq, D]; K/V are read from the pool only.

    Uses meta.query_start_loc / seq_lens / block_tables (device) and meta.max_query_len (a bound
    fixed per captured graph); never the *_host mirrors. num_splits: power of two.
    split_counters: int32 zeros, one per tile at least (left zero after the launch); with them
    the last split of each tile merges the partials itself, without the merge kernel.
    prefetch: the kernel variant (None: `prefetches` picks it from the shapes; tests force it).
    """
    t, hq, d = q.shape
    kc, vc = kv_cache[layer, 0], kv_cache[layer, 1]  # [blocks, block_size, Hkv, D]
    hkv = kc.shape[2]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    num_seqs = meta.seq_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = hq // hkv
    cfg = choose_tiles(meta.max_query_len, group, d, q.dtype)
    num_splits = next_pow2(max(1, num_splits))
    block_d = next_pow2(max(d, 16))
    min_chunk = -(-max(1, min_split_tokens) // cfg.block_n) * cfg.block_n
    if num_splits > 1:
        ws_acc = torch.empty((num_splits, t, hq, d), dtype=torch.float32, device=q.device)
        ws_m = torch.empty((num_splits, t, hq), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
    else:
        ws_acc = ws_m = ws_l = out  # unused by the kernel; any pointer will do
    grid = (max(1, -(-meta.max_query_len // cfg.block_q)), num_seqs, hkv * num_splits)
    opts = pdl.launch_options(q)
    fused_merge = (num_splits > 1 and split_counters is not None
                   and split_counters.numel() >= grid[0] * grid[1] * hkv)
    _paged_attn_kernel[grid](
        q, kc, vc, out, ws_acc, ws_m, ws_l, split_counters if fused_merge else out,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), meta.block_tables.stride(0),
        t, hq, float(scale) * LOG2E, min_chunk, d, kc.shape[1],
        GROUP=group, GROUP_PAD=next_pow2(group), BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        IS_FP32=q.dtype == torch.float32, FUSED_MERGE=fused_merge,
        PREFETCH=prefetches(meta.max_query_len, num_seqs, d) if prefetch is None else prefetch,
        num_warps=cfg.num_warps,
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
    """

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, *, max_kv_splits: int = 16, min_split_tokens: int = 64):
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
                               self.split_counters if FUSED_SPLIT_MERGE else None)
