"""An fp32 x bf16 matrix product on bf16 tensor cores, exact to fp32 (a Triton helper).

fp32 activations meet bf16 data where weights are stored in bf16 (weight_dtype) or the KV cache
is (kv_cache_dtype). tl.dot wants one operand dtype: upcasting the bf16 side runs an IEEE fp32
dot on the CUDA cores (SmolLM2's LM head at one row: 147 us against 22, run 20), and TF32 would
round the fp32 side. Instead the fp32 operand is cut into three bf16 pieces, hi = bf16(a),
mid = bf16(a - hi), lo = bf16(a - hi - mid), which hold all of its 24 significand bits; a
piece's products with bf16 values are exact in the fp32 accumulator, so three bf16 dots give
the fp32 product up to summation order. Tensor cores align one instruction's products by
truncation, so the error grows with the reduction length (~2e-4 at K = 4096 on O(10) outputs),
against ~1e-2 relative for an operand rounded to bf16. Where few rows make the op bound by the
bf16 side's read, the two extra dots cost nothing measurable. (TRITON_INTERPRET's bf16 tl.dot is
wrong, so interpreter checks keep these paths off; tests/gpu covers them.)
"""

from __future__ import annotations

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
