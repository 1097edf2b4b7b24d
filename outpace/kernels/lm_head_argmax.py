"""Greedy tokens straight from a hidden state: (RMSNorm ->) LM head -> argmax in one Triton
launch for few rows, with its PyTorch reference.

Why: at batch 1 a greedy step ended in four kernels: the final RMSNorm, cuBLAS's LM head
writing [M, V] logits, and the two argmax passes reading them back (kernels/argmax.py), each
with its own launch gap; an EAGLE-3 k = 2 step has three such tails (the verify and two
drafts). Here the few-row projection of kernels/small_linear.py (the norm as its prologue)
ends in an argmax epilogue: each program keeps, per row, the maximum of its vocabulary columns
and the first column holding it, and the launch's last program to finish (it takes a ticket
from a counter, as the attention's fused split merge does) reduces those to each row's token.
The logits never leave the registers.

Rounding and ties are the unfused path's: the norm is HF's as in norm_small_linear, each logit
is rounded to the activation dtype (the LM head's output) before the comparison, ties go to
the lowest index and NaN counts as the maximum (torch.argmax). Per row the result does not
depend on the other rows (every row's products take the same instruction order), so a verify
of three rows and a decode of one agree on a shared row. `offsets` (EAGLE-3's d2t) is added to
the winning index, `also` receives it too, as in argmax_rows.

The counter is one int32 per device, allocated by the first eager call (every caller runs
eagerly before capturing a graph: warm-up) and left zero by every launch; launches on one
stream never overlap in their counter use, even with PDL (a program takes its ticket after
the wait, when the previous launch has finished).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.kernels.argmax import _check_also, argmax_ref, argmax_rows
from outpace.kernels.norm import rms_norm_ref
from outpace.kernels.small_linear import SMALL_M_MAX, Blocks, choose_blocks

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton

    from outpace.kernels.small_linear_kernels import _lm_head_argmax_kernel
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None

_REDUCE_VALUES = 8192  # the last program's partial tile (rows x programs) per reduce step
_SMEM_PER_SM = 220 * 1024  # H200 (228 KB, less what the runtime keeps): _blocks' wave rule
_NUM_SMS = 132
_STATS_VALUES = 4096  # the norm statistics' x tile (rows x columns) per unrolled step
_counters: dict = {}  # device -> int32 [1], zero between launches


def lm_head_argmax_ref(x: torch.Tensor, w: torch.Tensor, *,
                       norm_weight: Optional[torch.Tensor] = None, eps: float = 0.0,
                       offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """argmax of (rms_norm(x) rounded to x.dtype, or x) @ w.T in x's dtype -> [M] int64, plus
    offsets[index] when given."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps).to(x.dtype)
    return argmax_ref(torch.nn.functional.linear(x, w.to(x.dtype)), offsets)


def _blocks(m: int, v: int, k: int, elem_bytes: int, x_bytes: int, norm: bool) -> Blocks:
    """small_linear.choose_blocks, with the tl.dot path's tiles chosen for one wave: 128
    vocabulary columns a program, and the deepest K pipeline (block_k x (stages - 1) columns in
    flight) whose shared memory still lets every program be resident at once. A second wave
    costs a program's whole latency again: in graphs of L2-cold calls (bench_small_linear's
    greedy_sweep, H200) SmolLM2's LM head (384 programs, three an SM) took 16.0 us with
    64-column K steps in 4 stages against 20.1 with 128 in 3 (two waves) and 18.4 with 64 in
    3; a 32000-id head (250 programs, two an SM) 11.5 us with 128-column steps in 3 stages
    against 12.1-14.1 for the others. Heads too large for one wave (Llama-8B's 128256 ids)
    keep choose_blocks' tiles."""
    cfg = choose_blocks(m, v, k, elem_bytes=elem_bytes, x_bytes=x_bytes, norm=norm)
    if not cfg.use_dot:
        return cfg
    per_sm = -(-(-(-v // 128)) // _NUM_SMS)  # programs an SM must hold at once
    for block_k, stages in ((128, 3), (64, 4), (64, 3)):
        smem = stages * block_k * (128 * elem_bytes + cfg.block_m * x_bytes)
        if block_k <= max(next_pow2(k), 16) and per_sm * smem <= _SMEM_PER_SM:
            return cfg._replace(block_n=128, block_k=block_k, num_stages=stages, num_warps=4)
    return cfg


def lm_head_argmax_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether lm_head_argmax runs the fused kernel for these operands: CUDA, at most
    SMALL_M_MAX rows, a weight as wide as x or (under fp32 activations) narrower."""
    return (use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= SMALL_M_MAX
            and w.dim() == 2 and w.shape[1] == x.shape[1]
            and w.is_contiguous() and w.shape[0] < 2 ** 31 - 1
            and (w.dtype == x.dtype or x.dtype == torch.float32))


def _counter(device: torch.device) -> torch.Tensor:
    cnt = _counters.get(device)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("lm_head_argmax: its first call on a device must be eager "
                               "(warm up before capturing a graph)")
        cnt = _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return cnt


def lm_head_argmax(x: torch.Tensor, w: torch.Tensor, *,
                   norm_weight: Optional[torch.Tensor] = None, eps: float = 0.0,
                   offsets: Optional[torch.Tensor] = None, also: tuple = (),
                   blocks: Optional[Blocks] = None) -> torch.Tensor:
    """x [M, K] (M <= SMALL_M_MAX, CUDA: lm_head_argmax_ok), w [V, K] -> [M] int64: the
    greedy token of each row of (rms_norm(x) if norm_weight is given, else x) @ w.T, plus
    offsets[token] ([V] integers) when given, also written into each of `also` (at most two
    [M] int64 views). Graph-capturable after one eager call on the device: shapes only.
    `blocks` overrides the tiles (_blocks: tests, sweeps)."""
    m, k = x.shape
    v = w.shape[0]
    _check_also(also, m)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = blocks or _blocks(m, v, k, w.element_size(), x.element_size(), norm_weight is not None)
    grid = (-(-v // cfg.block_n), -(-m // cfg.block_m))
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    vals = torch.empty((m, grid[0]), dtype=torch.float32, device=x.device)
    idx = torch.empty((m, grid[0]), dtype=torch.int32, device=x.device)
    p_block = max(16, next_pow2(grid[0]))
    a1, a2 = (tuple(also) + (out, out))[:2]
    if offsets is not None:
        offsets = offsets.contiguous()
    _lm_head_argmax_kernel[grid](
        x, norm_weight if norm_weight is not None else w, w,
        offsets if offsets is not None else idx, vals, idx, _counter(x.device), out, a1, a2,
        m, v, k, x.stride(0), a1.stride(0), a2.stride(0), float(eps),
        HAS_NORM=norm_weight is not None,
        NORM_ROUND=norm_weight is not None and norm_weight.dtype == x.dtype,
        HAS_OFFSETS=offsets is not None, NUM_ALSO=len(also), USE_DOT=cfg.use_dot,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TAIL_K=cfg.tail_k,
        STATS_K=k if norm_weight is not None else 0,
        STATS_BLOCK=max(16, min(next_pow2(k), _STATS_VALUES // cfg.block_m)), P_BLOCK=p_block,
        R_BLOCK=max(1, min(SMALL_M_MAX, _REDUCE_VALUES // p_block)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x))
    return out


def greedy_ids(x: torch.Tensor, w: torch.Tensor, project: Callable, *, norm=None,
               offsets: Optional[torch.Tensor] = None, also: tuple = ()) -> torch.Tensor:
    """The dispatcher: [M, K] -> [M] int64 greedy tokens of `norm(x)` (an RMSNorm module:
    weight, eps, callable; or x as is) through the LM head `w`, plus offsets[token], also
    written into `also`. lm_head_argmax where it runs (lm_head_argmax_ok), else the unfused
    path: the norm, `project` (the caller's logits in x's dtype, e.g. with CPU weight copies)
    and argmax_rows."""
    if lm_head_argmax_ok(x, w):
        return lm_head_argmax(x, w, norm_weight=None if norm is None else norm.weight,
                              eps=0.0 if norm is None else norm.eps, offsets=offsets, also=also)
    if norm is not None:
        x = norm(x)
    return argmax_rows(project(x), offsets, also)
