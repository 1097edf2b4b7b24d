"""An fp32 x bf16 matrix product on bf16 tensor cores, exact to fp32 (a Triton helper).

fp32 activations meet bf16 data where weights are stored in bf16 (weight_dtype) or the KV cache
is (kv_cache_dtype). tl.dot wants one operand dtype: upcasting the bf16 side runs an IEEE fp32
dot on the CUDA cores, several times slower (decisions-log.md, "fp32 x over a bf16 weight on
the tensor cores, exactly"), and TF32 would round the fp32 side. Instead the fp32 operand is
cut into three bf16 pieces, hi = bf16(a), mid = bf16(a - hi), lo = bf16(a - hi - mid), which
hold all of its 24 significand bits; a piece's products with bf16 values are exact in the fp32
accumulator, so three bf16 dots give the fp32 product up to summation order. Tensor cores align
one instruction's products by truncation, so the error grows with the reduction length (~2e-4
at K = 4096 on O(10) outputs), against ~1e-2 relative for an operand rounded to bf16. Where few
rows make the op bound by the bf16 side's read, the two extra dots cost nothing measurable.
(TRITON_INTERPRET's bf16 tl.dot is wrong, so interpreter checks keep these paths off; tests/gpu
covers them.)

`split_mm` is the same product for many rows through cuBLAS (prefill chunks, large batches):
one kernel cuts x into its pieces, one bf16 GEMM with fp32 output (`torch.mm(out_dtype=)`,
CUDA only) multiplies the three stacked row blocks by the weight as stored, and a sum adds
them. Before it, such products upcast the whole weight to fp32 on every call (a copy twice its
size) and ran an fp32 GEMM on the CUDA cores.
"""

from __future__ import annotations

import torch

from outpace.kernels import next_pow2, use_triton

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

if triton is not None:
    @triton.jit
    def dot_fp32_bf16(a, b, acc):
        """acc + a @ b: a fp32 [M, K], b bf16 [K, N], acc fp32 [M, N]."""
        hi = a.to(tl.bfloat16)
        rest = a - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(hi, b, acc)
        acc = tl.dot(mid, b, acc)
        return tl.dot(lo, b, acc)

    @triton.jit
    def _split_pieces_kernel(x_ptr, out_ptr, M, K, stride_xm, BLOCK: tl.constexpr):
        # x [M, K] fp32 -> out [3, M, K] bf16: hi, mid, lo (dot_fp32_bf16's pieces)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < K
        a = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0)
        hi = a.to(tl.bfloat16)
        rest = a - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        at = out_ptr + row * K + cols
        plane = M * K
        tl.store(at, hi, mask=mask)
        tl.store(at + plane, mid, mask=mask)
        tl.store(at + 2 * plane, lo, mask=mask)


_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()  # torch.mm(..., out_dtype=)


def split_pieces_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [3, M, K] bf16 pieces hi, mid, lo with hi + mid + lo == x exactly."""
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack((hi, mid, (rest - mid.float()).to(torch.bfloat16)))


def split_pieces_triton(x: torch.Tensor) -> torch.Tensor:
    """split_pieces_ref in one Triton kernel (x with a unit last stride)."""
    m, k = x.shape
    out = torch.empty((3, m, k), dtype=torch.bfloat16, device=x.device)
    if m and k:
        block = min(1024, next_pow2(k))
        _split_pieces_kernel[(m, -(-k // block))](x, out, m, k, x.stride(0), BLOCK=block)
    return out


def split_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether split_mm serves x @ w.T: fp32 x [M, K] over a bf16 w [N, K], on CUDA, with a
    torch whose mm takes out_dtype (2.8 and later)."""
    return (x.dtype == torch.float32 and w.dtype == torch.bfloat16 and x.dim() == 2
            and w.dim() == 2 and x.stride(-1) == 1 and use_triton(x) and _MM_OUT_DTYPE)


def split_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ w [N, K].T bf16 -> [M, N] fp32 (split_mm_ok): three bf16 pieces of x in
    one cuBLAS GEMM with fp32 output, summed; the fp32 product up to summation order."""
    m = x.shape[0]
    pieces = split_pieces_triton(x).view(3 * m, x.shape[1])
    return torch.mm(pieces, w.t(), out_dtype=torch.float32).view(3, m, w.shape[0]).sum(0)
