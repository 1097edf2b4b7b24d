"""Weights stored narrower than the activations (RunnerConfig.weight_dtype).

With dtype float32 and weight_dtype bfloat16 the large matrices (the projections of every
decoder layer, the embedding, the LM head, a draft head's fc / eh_proj) are stored in bf16, so
they cost the memory and bandwidth of a bf16 model, while the activations, the residual stream,
the KV cache and all arithmetic stay fp32. Norm weights and biases are small and stay in the
activation dtype. Why: bf16 greedy output parts from fp32 because of the bf16 activations, not
the weights (docs/decisions.md: fp32 compute over bf16-rounded weights matched fp32 on 20/20
prompts, all-bf16 on 7-8/20).

Where such a weight meets an activation the weight is upcast (exactly) to the activation dtype
and the product is computed there: `upcast_linear` and `upcast_embedding` here, the few-row
Triton kernels (kernels/skinny_gemm/) on CUDA, and fp32 CPU weight copies
(cpu_fast_paths.add_weight_copies_). Many rows of fp32 over a bf16 weight on CUDA skip the
upcast: kernels/bf16x3.split_mm multiplies three bf16 pieces of x on the tensor cores.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from outpace.kernels.skinny_gemm import SMALL_M_MAX, small_linear
from outpace.kernels.bf16x3 import split_mm, split_mm_ok

# Attribute names of the parameters stored in the weight dtype, on any module of a target model
# or draft head (llama.py, eagle3.py, mtp.py).
STORED_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight", "embed_weight",
                  "lm_head_weight", "fc_weight", "eh_proj_weight")


def store_weights_in_(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the STORED_WEIGHTS parameters of `model` to `dtype` in place (the Parameter objects
    stay, so a tied LM head stays tied). Rounds to nearest even, as `.to()` does.

    CPU weight copies made before (cpu_fast_paths) would hold the old values: they are dropped;
    add them again after (the loader casts before it makes them)."""
    seen = set()
    for m in model.modules():
        for name in STORED_WEIGHTS:
            p = m._parameters.get(name)
            if p is None:
                continue
            for suffix in ("_t", "_packed", "_bf16"):
                m.__dict__.pop(name + suffix, None)
            if id(p) not in seen and p.dtype != dtype:
                p.data = p.data.to(dtype)
            seen.add(id(p))
    if any(p.is_cuda for p in model.parameters()):
        # The wider copies' memory goes back to the device, so that the KV pool sizing (free
        # memory after loading) sees what the weights really take.
        torch.cuda.empty_cache()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters (a tied one counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def upcast_linear(x: torch.Tensor, w: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear in x's dtype: x [M, K], w [N, K] -> [M, N] of x.dtype.

    A weight stored narrower than x is upcast first (exact), so the result is the one of a model
    whose weights were rounded to that dtype and then held in x's dtype. Without a bias this is
    small_linear, which for few rows on CUDA reads the narrow weight directly (no upcast copy)
    and elsewhere falls back to exactly that upcast F.linear."""
    if w.dtype == x.dtype:
        return F.linear(x, w, bias)
    if x.dim() == 2 and x.shape[0] > SMALL_M_MAX and split_mm_ok(x, w):
        # many rows of fp32 over bf16 on CUDA: bf16 tensor cores on x's pieces, no upcast
        y = split_mm(x, w)
        return y if bias is None else y.add_(bias)
    if bias is None and x.dim() == 2:
        return small_linear(x, w)
    return F.linear(x, w.to(x.dtype), bias)


def upcast_embedding(input_ids: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of w for input_ids, in `dtype`: the gather reads the narrow table (no full copy)."""
    return F.embedding(input_ids, w).to(dtype)
