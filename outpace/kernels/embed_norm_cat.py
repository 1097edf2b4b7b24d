"""A draft head's input row in one kernel: embedding gather, two RMSNorms, concatenation.

EAGLE-3's layer and an MTP module both read

    cat([rms_norm(embed_table[input_ids].to(dtype), emb_norm_weight),
         rms_norm(hidden, hidden_norm_weight)], -1)                        [T, 2H]

which in torch is five kernels (gather, cast when the table is stored narrower, two norms, cat).
Here one program per row gathers the embedding row, normalizes it and the hidden row, and writes
both halves. The roundings are HF's, as in norm.py: statistics in fp32, the normalized value
rounded to the input dtype, times the weight rounded to the output dtype; the embedding rows are
first cast to the activation dtype (models/weight_dtype.py upcast_embedding: F.embedding, then
`.to(dtype)`). Block size and warps equal norm.py's kernel's, so on the GPU each half equals
rms_norm_triton of the same input bit for bit, except with a table stored narrower than the
activations (weight_dtype): its row's load sets the kernel's register layout, so both halves'
statistics are summed in another order (an fp32 ulp or so, tests/gpu/test_embed_norm_cat.py).

The second half is the normalized hidden: `out[:, H:]` (a view) serves EAGLE-3's
norm_before_residual as the residual.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.kernels.norm import rms_norm_ref

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

_MAX_BLOCK = 65536  # one row per program (as norm.py); wider rows go to the reference


def embed_norm_cat_ref(input_ids: torch.Tensor, embed_table: torch.Tensor,
                       emb_norm_weight: torch.Tensor, hidden: torch.Tensor,
                       hidden_norm_weight: torch.Tensor, eps: float,
                       out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """input_ids [T], embed_table [V, H], hidden [T, H] -> [T, 2H]: the torch composition.
    out_dtype: the activation dtype the embedding rows are cast to (default hidden's)."""
    emb = F.embedding(input_ids, embed_table).to(out_dtype or hidden.dtype)
    return torch.cat([rms_norm_ref(emb, emb_norm_weight, eps),
                      rms_norm_ref(hidden, hidden_norm_weight, eps)], dim=-1)


if triton is not None:
    from outpace.kernels.norm import normalize_row
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def _embed_norm_cat_kernel(ids_ptr, table_ptr, ew_ptr, h_ptr, hw_ptr, out_ptr, H,
                               stride_t, stride_h, stride_o, eps, BLOCK: tl.constexpr,
                               USE_PDL: tl.constexpr):
        # One program per row; both halves sit in registers. The activation dtype is out's.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        act = out_ptr.dtype.element_ty
        # static: the norm weights, before the wait
        ew = tl.load(ew_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        hw = tl.load(hw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wait_then_release(USE_PDL)
        tok = tl.load(ids_ptr + row).to(tl.int64)
        # the table row, cast to the activation dtype first (upcast_embedding's `.to(dtype)`)
        e = tl.load(table_ptr + tok * stride_t + cols, mask=mask, other=0.0).to(act)
        tl.store(out_ptr + row * stride_o + cols,
                 normalize_row(e.to(tl.float32), ew, H, eps, act).to(act), mask=mask)
        x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * stride_o + H + cols,
                 normalize_row(x.to(tl.float32), hw, H, eps, act).to(act), mask=mask)


def _kernel_takes(hidden, embed_table, emb_norm_weight, hidden_norm_weight, out_dtype) -> bool:
    # the activations and both norm weights in one dtype (the table may be stored in another),
    # hidden [T, H], a table of width H, a row that fits one block
    dt = hidden.dtype
    return ((out_dtype or dt) == dt and emb_norm_weight.dtype == dt
            and hidden_norm_weight.dtype == dt and embed_table.dtype.is_floating_point
            and hidden.dim() == 2 and embed_table.shape[-1] == hidden.shape[-1]
            and next_pow2(hidden.shape[-1]) <= _MAX_BLOCK)


def triton_ok(hidden: torch.Tensor, embed_table: torch.Tensor, emb_norm_weight: torch.Tensor,
              hidden_norm_weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether embed_norm_cat runs the kernel: CUDA with triton, the activations and both norm
    weights in one dtype (the table may be stored in another), a row that fits one block."""
    return use_triton(hidden) and _kernel_takes(hidden, embed_table, emb_norm_weight,
                                                hidden_norm_weight, out_dtype)


def embed_norm_cat_triton(input_ids: torch.Tensor, embed_table: torch.Tensor,
                          emb_norm_weight: torch.Tensor, hidden: torch.Tensor,
                          hidden_norm_weight: torch.Tensor, eps: float,
                          out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The kernel (see triton_ok for what it takes) -> [T, 2H] of hidden's dtype.
    Graph-capturable: shapes only. input_ids must index rows of the table (int32 or int64)."""
    if not _kernel_takes(hidden, embed_table, emb_norm_weight, hidden_norm_weight, out_dtype):
        raise ValueError("embed_norm_cat_triton needs hidden [T, H] and both norm weights in one "
                         "dtype, and a table of width H")
    t, h = hidden.shape
    out = torch.empty((t, 2 * h), dtype=hidden.dtype, device=hidden.device)
    if t == 0:
        return out
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if embed_table.stride(-1) != 1:
        embed_table = embed_table.contiguous()
    block = next_pow2(h)
    _embed_norm_cat_kernel[(t,)](
        input_ids.contiguous(), embed_table, emb_norm_weight.contiguous(), hidden,
        hidden_norm_weight.contiguous(), out, h, embed_table.stride(0), hidden.stride(0),
        out.stride(0), float(eps), BLOCK=block, num_warps=min(max(block // 256, 1), 8),
        **pdl.launch_options(hidden))
    return out


def embed_norm_cat(input_ids: torch.Tensor, embed_table: torch.Tensor,
                   emb_norm_weight: torch.Tensor, hidden: torch.Tensor,
                   hidden_norm_weight: torch.Tensor, eps: float,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """cat([rms_norm(embed_table[input_ids].to(out_dtype)), rms_norm(hidden)], -1) -> [T, 2H];
    the kernel on CUDA (triton_ok), the reference otherwise."""
    if triton_ok(hidden, embed_table, emb_norm_weight, hidden_norm_weight, out_dtype):
        return embed_norm_cat_triton(input_ids, embed_table, emb_norm_weight, hidden,
                                     hidden_norm_weight, eps, out_dtype)
    return embed_norm_cat_ref(input_ids, embed_table, emb_norm_weight, hidden,
                              hidden_norm_weight, eps, out_dtype)


def fused_head_input(input_ids: torch.Tensor, embed_table: Optional[torch.Tensor], emb_norm,
                     hidden: torch.Tensor, hidden_norm) -> Optional[torch.Tensor]:
    """A draft head's input [T, 2H] from the kernel, or None where the kernel would not equal
    the head's composition (no table, CPU, mixed dtypes, two different eps): the caller then
    composes it in torch. emb_norm / hidden_norm: RMSNorm modules (.weight, .eps)."""
    if (embed_table is None or emb_norm.eps != hidden_norm.eps
            or not triton_ok(hidden, embed_table, emb_norm.weight, hidden_norm.weight)):
        return None
    return embed_norm_cat_triton(input_ids, embed_table, emb_norm.weight, hidden,
                                 hidden_norm.weight, emb_norm.eps)
