"""Few-row projections over an int8 weight with a per-row scale: a draft head's LM head stored
at half a bf16 matrix's bytes (the speculative option draft_lm_head_dtype, speculative/head_proposer.py).

    quantize_int8_rows(w)          w [N, K] -> (q int8 [N, K], scale fp32 [N]), w ~ q * scale
    int8_linear(x, q, scale)       y [M, N] = x @ (q * scale).T in x's dtype

The kernel is small_linear's (kernels/skinny_gemm/kernels.py): it converts each int8 tile to
the activation dtype in registers (exact, |q| <= 127), so its tl.dot and broadcast paths run
unchanged, and multiplies by the column's scale before the output's one rounding (W_SCALE).
Few rows only (M <= SMALL_M_MAX); the reference serves the rest and CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from outpace.kernels import use_triton
from outpace.kernels.skinny_gemm import (SMALL_M_MAX, Blocks, _copy_to, _launch, _out,
                                          _unit_last)


def quantize_int8_rows(w: torch.Tensor) -> tuple:
    """w [N, K] -> (int8 [N, K], fp32 scale [N]): symmetric per-row (per output column)
    weight-only quantization, w ~ q * scale with q = round(w / scale), scale = max|w_row| / 127
    (an all-zero row gets scale 1)."""
    wf = w.float()
    scale = wf.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (w_q [N, K] int8 * scale [N]).T: products of x and the integers summed in
    fp32, times the column's scale, one rounding to x's dtype."""
    return ((x.float() @ w_q.float().T) * scale.float()).to(x.dtype)


def int8_linear_triton(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, *,
                       out: Optional[torch.Tensor] = None,
                       blocks: Optional[Blocks] = None) -> torch.Tensor:
    """int8_linear_ref's product in one few-row launch: the int8 tile is converted to the
    activation dtype in registers (exact) and the scale applied in the epilogue, so the weight
    read is half of a bf16 weight's."""
    x = _unit_last(x)
    out = _out(out, x.shape[0], w_q.shape[0], x.dtype, x.device)
    return _launch(x, w_q, out, n_cols=w_q.shape[0], scale=scale, blocks=blocks)


def int8_linear(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, *,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (w_q [N, K] int8 * scale [N] fp32).T in x's dtype. Triton for CUDA
    inputs of at most SMALL_M_MAX rows, the reference otherwise."""
    if (x.dim() == 2 and 1 <= x.shape[0] <= SMALL_M_MAX and w_q.dim() == 2
            and w_q.is_contiguous() and w_q.dtype == torch.int8 and x.shape[1] == w_q.shape[1]
            and scale.is_contiguous() and use_triton(x)):
        return int8_linear_triton(x, w_q, scale, out=out)
    return _copy_to(out, int8_linear_ref(x, w_q, scale))
