"""Triton kernels for the GPU fast path, each next to the PyTorch reference it is tested against.

    norm.py      rms_norm, fused_add_rms_norm (+ *_ref, *_triton)
    rope.py      apply_rope (+ apply_rope_ref, apply_rope_triton): neox style, in place
    rope.py      also apply_rope_and_store_triton: rope of q and k, k and v written to the pool
    store_kv.py  store_kv_triton (+ store_kv_ref): write K/V into the paged pool through the slot
                 mapping
    skinny_gemm/  few-row (M <= 16) projections with the norm, residual add, silu * mul or
                 rope + KV store fused in, and silu_mul (kernels in skinny_gemm/kernels.py)
    argmax.py    argmax_rows: two-pass row argmax of logits (+ offsets[idx]: EAGLE-3's d2t)
    masked_gumbel.py  masked_race_triton: the sampling race over the top-k / top-p / min-p
                 nucleus without a sort (reference: sample/gumbel.masked_race_tokens' CPU path)
    embed_norm_cat.py  embed_norm_cat: a draft head's [rms_norm(embedding), rms_norm(hidden)] input
    ngram_lookup.py  ngram_lookup_triton: the device n-gram lookup, a program a row (reference:
                 speculative/ngram_device.ngram_propose_ref)
    pdl.py       programmatic dependent launch: launch_options, wait_then_release

Kernels that belong to a higher layer live there: the paged attention kernel in
attention/triton_paged.py, the penalties in sample/penalty_kernels.py, the fused step's
bookkeeping in runner/step_bookkeeping.py.

Every module imports triton behind a guard, so importing it on a machine without triton works and
the dispatchers (`rms_norm`, `fused_add_rms_norm`, `apply_rope`) fall back to the reference.
"""

from __future__ import annotations

import torch


def triton_available() -> bool:
    """True when `import triton` works here (cheap after the first call: sys.modules hit)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton op should run on tensor `t`: a CUDA tensor and triton importable."""
    return t.is_cuda and triton_available()


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1); Triton block shapes must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


__all__ = ["triton_available", "use_triton", "next_pow2"]
