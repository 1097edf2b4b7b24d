"""RMSNorm and fused residual-add + RMSNorm: Triton kernels and their PyTorch references.

Semantics are HF transformers' (LlamaRMSNorm and the decoder layer's residual add):

    new_residual = x + residual                 # rounded to the activation dtype, as torch adds
    normed       = (new_residual_f32 * rsqrt(mean(new_residual_f32^2) + eps)).to(input dtype)
    out          = weight * normed              # dtype promote(weight, input), as torch multiplies

The kernels compute the statistics in fp32 and round at the same two points as HF, so on bf16 they
differ from the reference only by reduction order (at most an ulp here and there).
"""

from __future__ import annotations

import torch

from outpace.kernels import next_pow2, pdl, use_triton

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

_MAX_BLOCK = 65536  # one row per program; wider rows go to the reference


# ----------------------------------------------------------------------------- references

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] (dtype promote(x, weight))."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


def gather_rms_norm_ref(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H], rows [R] -> (rms_norm(x[rows]), x[rows])."""
    gathered = x.index_select(0, rows)
    return rms_norm_ref(gathered, weight, eps), gathered


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] -> (rms_norm(x + residual), x + residual)."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


# ----------------------------------------------------------------------------- triton

if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def normalize_row(xf, w, H, eps, ACT: tl.constexpr):
        # One row: xf its fp32 values (0 where masked), w the fp32 weight -> weight * normed in
        # fp32 with HF's roundings: fp32 statistics, normed rounded to ACT (the input dtype)
        # before the weight. Shared with kernels/embed_norm_cat.py, whose halves equal this.
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        return (xf * rstd).to(ACT).to(tl.float32) * w

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, rows_ptr, H, stride_x,
                         stride_r, stride_o, stride_ro, eps, HAS_RESIDUAL: tl.constexpr,
                         GATHER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        # One program per row; the whole row sits in registers, so x is read once. GATHER:
        # the row is x[rows[row]], also copied to res_out (a head's hidden at each request's
        # drafting row, and its norm for the LM head, in one kernel).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # static: before the wait
        wait_then_release(USE_PDL)
        if GATHER:
            src = tl.load(rows_ptr + row).to(tl.int64)
            x = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
            # Round the sum to the residual's dtype before the statistics, as HF does.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        y = normalize_row(x.to(tl.float32), w, H, eps, x.dtype)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [N, H] with a unit last stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2, r2, weight, eps, out, res_out, rows=None):
    n, h = out.shape  # rows of the output (= of x2 unless gathering)
    if n == 0:
        return
    block = next_pow2(h)
    _rms_norm_kernel[(n,)](
        x2, r2 if r2 is not None else x2, weight, out, res_out if res_out is not None else out,
        rows if rows is not None else out, h, x2.stride(0),
        r2.stride(0) if r2 is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0, float(eps),
        HAS_RESIDUAL=r2 is not None, GATHER=rows is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 8), **pdl.launch_options(x2))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm. x [..., H], weight [H] -> [..., H] (dtype promote(x, weight))."""
    h = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    _launch(x2, None, weight.contiguous(), eps, out, None)
    return out.view(*x.shape[:-1], h)


def gather_rms_norm_triton(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton gather + RMSNorm in one pass. x [N, H] (unit last stride), rows [R] integers ->
    (rms_norm(x[rows]), x[rows])."""
    r, h = rows.shape[0], x.shape[1]
    gathered = torch.empty((r, h), dtype=x.dtype, device=x.device)
    out = torch.empty((r, h), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(_rows(x), None, weight.contiguous(), eps, out, gathered, rows=rows.contiguous())
    return out, gathered


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm in one pass. x, residual [..., H] -> (normed, new_residual)."""
    h = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    new_res = torch.empty(x2.shape, dtype=res_dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(res_dtype, weight.dtype),
                      device=x.device)
    _launch(x2, r2, weight.contiguous(), eps, out, new_res)
    shape = (*x.shape[:-1], h)
    return out.view(shape), new_res.view(shape)


# ----------------------------------------------------------------------------- dispatch

def _triton_ok(x: torch.Tensor) -> bool:
    return use_triton(x) and next_pow2(x.shape[-1]) <= _MAX_BLOCK


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton on CUDA when triton is importable, the reference otherwise."""
    return rms_norm_triton(x, weight, eps) if _triton_ok(x) else rms_norm_ref(x, weight, eps)


def gather_rms_norm(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x[rows]), x[rows]); one Triton kernel on CUDA, the reference otherwise."""
    if _triton_ok(x) and x.dim() == 2:
        return gather_rms_norm_triton(x, rows, weight, eps)
    return gather_rms_norm_ref(x, rows, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); Triton on CUDA, the reference otherwise."""
    if _triton_ok(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)
