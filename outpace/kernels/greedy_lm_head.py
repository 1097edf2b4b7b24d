"""Greedy token ids straight from a few hidden rows: RMSNorm, the LM head's product and the
row argmax in two launches instead of four (norm, cuBLAS GEMV, argmax's two passes).

    greedy_lm_head(x, w, norm_weight=, eps=, scale=, offsets=, also=)  -> [M] int64

Where it serves: a draft head's LM head in the speculative step (EAGLE-3's over its draft
vocabulary, MTP's the target's), one row a request at small batch. That read is the largest of
a small model's draft step (SmolLM2's 49152 x 576 bf16 head: 56.6 MB, ~16 us through cuBLAS,
twice a k = 2 step), and the norm before it and argmax's first pass cost a launch each.

Pass 1 (one program per TILES x BLOCK_N columns): each program loads its weight tiles whole
(every K column at once, so all its bytes are in flight together; the first tile before the
PDL wait, each next tile while the current one is multiplied), normalizes the rows itself
(x is a few KB, an L2 hit), multiplies, rounds each logit to the activation dtype as the
unfused product would be rounded, and keeps the maximum and its first column; pass 2 is
argmax.py's reduction over the programs' partials (with EAGLE-3's d2t offsets and the extra
outputs). Ties go to the lowest column and NaN counts as the maximum, as in argmax.py.

An int8 weight (draft_lm_head_dtype "int8": quantize_int8_rows, a per-column fp32 scale applied
before the rounding) is converted to fp32 through the float's bits (_weight_f32): the
few-row kernel's conversion instruction bounded its int8 read at ~2.4 TB/s.

The logits differ from cuBLAS's only in the order of the fp32 sum, so a draft may differ from
the unfused path's where two logits tie within a rounding; drafts never change the output (the
target verifies them), and a graph and an eager call of the same rows run the same kernel.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.kernels.argmax import _check_also, argmax_ref
from outpace.kernels.norm import rms_norm_ref

try:  # guarded: CPU machines may not have triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

# Rows the kernel takes (a draft step's rows: one a request). Each row multiplies every weight
# tile in registers (no tensor cores), so many rows belong to a GEMM; H200 measurement below.
MAX_ROWS = 4
_MAX_K = 8192  # the whole row of a tile is loaded at once


class GreedyBlocks(NamedTuple):
    block_n: int  # weight rows (output columns) a tile
    tiles: int  # tiles a program, one after another (fewer partials for pass 2)
    num_warps: int
    k_main: int  # the row read as a power-of-two tile...
    k_tail: int  # ...and the rest as a second one (0: none)


# A program's weight tile, bytes a thread (a tile of block_n rows x K columns over num_warps
# warps; rows multiply it one after another). Measured on the H200
# (benchmarks/diag_greedy_lm_head.py, step-shaped graph).
_TILE_BYTES_PER_THREAD = 256
_NUM_WARPS = 4
_TILES = 2


def choose_greedy_blocks(m: int, k: int, elem_bytes: int) -> GreedyBlocks:
    """A pure function of shapes: the widest power-of-two block_n whose tile (block_n x K)
    stays within the per-thread budget (m: the rows, which take the tile in turn)."""
    del m
    k_main = 1 << (k.bit_length() - 1)  # largest power of two <= k
    rest = k - k_main
    k_tail = next_pow2(rest) if rest else 0
    budget = _TILE_BYTES_PER_THREAD * 32 * _NUM_WARPS
    block_n = 1
    while block_n < 256 and 2 * block_n * (k_main + k_tail) * elem_bytes <= budget:
        block_n *= 2
    return GreedyBlocks(block_n, _TILES, _NUM_WARPS, k_main, k_tail)


def greedy_lm_head_ref(x: torch.Tensor, w: torch.Tensor, *,
                       norm_weight: Optional[torch.Tensor] = None, eps: float = 0.0,
                       scale: Optional[torch.Tensor] = None,
                       offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """argmax(rms_norm(x) @ (w * scale).T) (+ offsets[id]): the logits summed in fp32 and
    rounded once to x's dtype, as F.linear / int8_linear_ref give them."""
    return argmax_ref(greedy_logits_ref(x, w, norm_weight=norm_weight, eps=eps, scale=scale),
                      offsets)


def greedy_logits_ref(x, w, *, norm_weight=None, eps=0.0, scale=None) -> torch.Tensor:
    """The logits greedy_lm_head compares: [M, N] in x's dtype."""
    a = rms_norm_ref(x, norm_weight, eps).to(x.dtype) if norm_weight is not None else x
    y = a.float() @ w.float().T
    if scale is not None:
        y = y * scale.float()
    return y.to(x.dtype)


if triton is not None:
    from outpace.kernels.argmax import _argmax_reduce_kernel
    from outpace.kernels.pdl import wait_then_release
    from outpace.kernels.small_linear_kernels import _operand

    @triton.jit
    def _weight_f32(w):
        # A weight tile in fp32. int8 through the float's bits: 0x4B400000 is 1.5 * 2^23, so
        # adding v (|v| <= 2^22) to its bit pattern gives the float 1.5 * 2^23 + v exactly,
        # and subtracting 1.5 * 2^23 leaves v. An integer add and a float add per value,
        # instead of the int-to-float conversion, whose throughput bounded the int8 read.
        if w.dtype == tl.int8:
            return (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        return w.to(tl.float32)

    @triton.jit
    def _load_tile(w_ptr, col0, N, K, BLOCK_N: tl.constexpr, K_MAIN: tl.constexpr,
                   K_TAIL: tl.constexpr):
        # Weight rows [col0, col0 + BLOCK_N): the first K_MAIN columns and the rest.
        offs_n = col0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = w_ptr + offs_n[:, None].to(tl.int64) * K
        km = tl.arange(0, K_MAIN)
        w = tl.load(rows + km[None, :], mask=n_mask[:, None], other=0)
        wt = w
        if K_TAIL > 0:
            kt = K_MAIN + tl.arange(0, K_TAIL)
            wt = tl.load(rows + kt[None, :], mask=n_mask[:, None] & (kt < K)[None, :], other=0)
        return w, wt

    @triton.jit
    def _row_product(x_row, nw_ptr, offs_k, wf, rstd, offs_m, r, A_DTYPE: tl.constexpr,
                     HAS_NORM: tl.constexpr, NORM_ROUND: tl.constexpr, K=-1):
        # [BLOCK_N] fp32: row r's operand at columns offs_k (normed with its rstd) times the
        # weight tile wf [BLOCK_N, len(offs_k)]. K >= 0: mask the columns past K (the tail).
        if K >= 0:
            k_mask = offs_k < K
            x = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
            nw = x
            if HAS_NORM:
                nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0)
        else:
            x = tl.load(x_row + offs_k)
            nw = x
            if HAS_NORM:
                nw = tl.load(nw_ptr + offs_k)
        rstd_r = tl.sum(tl.where(offs_m == r, rstd, 0.0), axis=0)
        a = _operand(x, rstd_r, nw, A_DTYPE, HAS_NORM, NORM_ROUND)
        return tl.sum(a[None, :] * wf, axis=1)

    @triton.jit
    def _greedy_lm_head_kernel(x_ptr, nw_ptr, w_ptr, scale_ptr, vals_ptr, idx_ptr, logits_ptr,
                               M, N, K, stride_xm, stride_lm, num_chunks, eps,
                               HAS_NORM: tl.constexpr, NORM_ROUND: tl.constexpr,
                               W_SCALE: tl.constexpr, STORE_LOGITS: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               TILES: tl.constexpr, K_MAIN: tl.constexpr,
                               K_TAIL: tl.constexpr, USE_PDL: tl.constexpr):
        pid = tl.program_id(0)
        col0 = pid * (TILES * BLOCK_N)
        # The weight does not depend on earlier kernels: its first tile is read before the
        # PDL wait, overlapping the kernel before.
        w, wt = _load_tile(w_ptr, col0, N, K, BLOCK_N, K_MAIN, K_TAIL)
        wait_then_release(USE_PDL)

        A_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        km = tl.arange(0, K_MAIN)
        kt = km
        if K_TAIL > 0:
            kt = K_MAIN + tl.arange(0, K_TAIL)
        # Each row's norm statistics once; its operand is made again for every tile (an L1
        # hit), in the weight tile's own layout: multiplying a [rows, 1, K] operand by a
        # [1, BLOCK_N, K] tile made the compiler move the whole weight tile between layouts.
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_NORM:
            x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
            xf = tl.load(x_rows + km[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
            ss = tl.sum(xf * xf, axis=1)
            if K_TAIL > 0:
                xtf = tl.load(x_rows + kt[None, :], mask=m_mask[:, None] & (kt < K)[None, :],
                              other=0.0).to(tl.float32)
                ss += tl.sum(xtf * xtf, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)

        best_v = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        best_i = tl.zeros([BLOCK_M], dtype=tl.int32) + col0
        for t in tl.static_range(TILES):
            if t + 1 < TILES:  # the next tile's read overlaps this tile's products
                w_next, wt_next = _load_tile(w_ptr, col0 + (t + 1) * BLOCK_N, N, K, BLOCK_N,
                                             K_MAIN, K_TAIL)
            offs_n = col0 + t * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            wf = _weight_f32(w)
            wtf = _weight_f32(wt)
            if W_SCALE:  # an int8 weight's per-column scale, before the one rounding
                sc = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
            for r in tl.static_range(BLOCK_M):
                if r < M:
                    acc = _row_product(x_ptr + r * stride_xm, nw_ptr, km, wf, rstd, offs_m, r,
                                       A_DTYPE, HAS_NORM, NORM_ROUND)
                    if K_TAIL > 0:
                        acc += _row_product(x_ptr + r * stride_xm, nw_ptr, kt, wtf, rstd,
                                            offs_m, r, A_DTYPE, HAS_NORM, NORM_ROUND, K)
                    if W_SCALE:
                        acc *= sc
                    logits = acc.to(A_DTYPE)
                    if STORE_LOGITS:  # tests: the values the argmax compared
                        tl.store(logits_ptr + r * stride_lm + offs_n, logits, mask=n_mask)
                    v = logits.to(tl.float32)  # exact; the order is the rounded logits'
                    v = tl.where(v == v, v, float("inf"))  # NaN is the maximum, as in torch
                    v = tl.where(n_mask, v, float("-inf"))
                    tile_max = tl.max(v, axis=0)
                    tile_first = tl.min(tl.where(v == tile_max, offs_n, N), axis=0)
                    # strict: on a tie the earlier tile's column stays
                    better = (offs_m == r) & (tile_max > best_v)
                    best_i = tl.where(better, tile_first, best_i)
                    best_v = tl.where(better, tile_max, best_v)
            if t + 1 < TILES:
                w = w_next
                wt = wt_next
        tl.store(vals_ptr + offs_m * num_chunks + pid, best_v, mask=m_mask)
        tl.store(idx_ptr + offs_m * num_chunks + pid, best_i, mask=m_mask)


def greedy_lm_head_triton(x: torch.Tensor, w: torch.Tensor, *,
                          norm_weight: Optional[torch.Tensor] = None, eps: float = 0.0,
                          scale: Optional[torch.Tensor] = None,
                          offsets: Optional[torch.Tensor] = None, also: tuple = (),
                          logits: Optional[torch.Tensor] = None,
                          blocks: Optional[GreedyBlocks] = None) -> torch.Tensor:
    """greedy_lm_head_ref's ids in two launches. x [M, K] (unit last stride, M <= MAX_ROWS),
    w [N, K] contiguous (int8 with scale [N] fp32), norm_weight [K]; `also`: up to two [M]
    int64 views that receive the ids too; `logits` ([M, N] of x's dtype): also store the
    logits compared (tests); `blocks` overrides choose_greedy_blocks (sweeps)."""
    m, k = x.shape
    n = w.shape[0]
    _check_also(also, m)
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = blocks or choose_greedy_blocks(m, k, w.element_size())
    per_program = cfg.tiles * cfg.block_n
    chunks = -(-n // per_program)
    vals = torch.empty((m, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((m, chunks), dtype=torch.int32, device=x.device)
    opts = pdl.launch_options(x)
    nw = norm_weight.contiguous() if norm_weight is not None else x
    _greedy_lm_head_kernel[(chunks,)](
        x, nw, w, scale if scale is not None else vals, vals, idx,
        logits if logits is not None else vals, m, n, k, x.stride(0),
        logits.stride(0) if logits is not None else 0, chunks, float(eps),
        HAS_NORM=norm_weight is not None,
        NORM_ROUND=norm_weight is not None and norm_weight.dtype == x.dtype,
        W_SCALE=scale is not None, STORE_LOGITS=logits is not None,
        BLOCK_M=max(1, next_pow2(m)), BLOCK_N=cfg.block_n, TILES=cfg.tiles,
        K_MAIN=cfg.k_main, K_TAIL=cfg.k_tail, num_warps=cfg.num_warps, **opts)
    if offsets is not None:
        offsets = offsets.contiguous()
    a1, a2 = (tuple(also) + (out, out))[:2]
    block = max(16, next_pow2(chunks))
    _argmax_reduce_kernel[(m,)](vals, idx, offsets if offsets is not None else idx, out, a1, a2,
                                a1.stride(0), a2.stride(0), chunks, n,
                                HAS_OFFSETS=offsets is not None, NUM_ALSO=len(also),
                                BLOCK=block, num_warps=4 if block >= 1024 else 1, **opts)
    return out


def greedy_lm_head_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether greedy_lm_head runs the kernel for these operands (else the reference)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and w.dim() == 2
            and x.shape[1] == w.shape[1] and 16 <= w.shape[1] <= _MAX_K
            and w.shape[1] % 16 == 0 and w.is_contiguous()
            and w.dtype in (torch.int8, torch.bfloat16, torch.float16, torch.float32)
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and w.shape[0] < 2 ** 31 - 1 and use_triton(x))


def greedy_lm_head(x: torch.Tensor, w: torch.Tensor, *,
                   norm_weight: Optional[torch.Tensor] = None, eps: float = 0.0,
                   scale: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None,
                   also: tuple = ()) -> torch.Tensor:
    """[M, K] hidden rows -> [M] int64 greedy ids over w [N, K] (int8 with `scale`), after
    RMSNorm(norm_weight, eps) when given, plus offsets[id] when given; also written into
    `also`. The kernel where greedy_lm_head_ok, the reference otherwise."""
    if greedy_lm_head_ok(x, w):
        return greedy_lm_head_triton(x, w, norm_weight=norm_weight, eps=eps, scale=scale,
                                     offsets=offsets, also=also)
    _check_also(also, x.shape[0])
    out = greedy_lm_head_ref(x, w, norm_weight=norm_weight, eps=eps, scale=scale,
                             offsets=offsets)
    for t in also:
        t.copy_(out)
    return out
