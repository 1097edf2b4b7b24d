"""CPU fast paths of the decoder: faster-to-read weight copies and single-threaded small forwards.

Measured on the 2-core CI machine (docs/decisions.md): batch-1 decode is ~400 tiny ops around
memory-bound GEMVs, so the layout a GEMV reads and the cost of waking OpenMP workers decide its
speed. CUDA never takes these paths.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import nn

from outpace.models.weight_dtype import upcast_linear

# Weight copies (see add_weight_copies_): one row uses the transposed copy where there is one;
# more rows use the oneDNN-packed copy.
_FEW_ROWS = 1
# ... and fewer rows than this are padded with zero rows to it: oneDNN's packed kernel streams
# the weight much more slowly for 2 or 3 rows than for 4, and a batch-1 verify step is k + 1
# rows (docs/decisions.md, "CPU speculative step").
_PAD_ROWS_TO = 4
# Multi-token-query forwards of at most this many tokens run single-threaded on CPU (see
# cpu_threads_for).
_ONE_THREAD_MAX_TOKENS = 16
# oneDNN's packed-weight linear (an internal op, the one torch.compile uses on CPU).
_HAS_PACKED_LINEAR = (torch.backends.mkldnn.is_available()
                      and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                      and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def linear(x: torch.Tensor, module: nn.Module, name: str, bias=None) -> torch.Tensor:
    """F.linear with `module.<name>`, or a faster CPU copy of it (see add_weight_copies_); the
    copies hold the same values. A weight stored narrower than x is upcast (weight_dtype.py)."""
    w = getattr(module, name)
    copies = module.__dict__
    narrow = copies.get(name + "_bf16")
    if narrow is not None:  # a draft head read in bf16 (add_weight_copies_'s `narrow`): the
        # product of bf16 operands, summed in fp32 and rounded to bf16, then widened
        b = None if bias is None else bias.to(torch.bfloat16)
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), narrow, b, "none", [],
                                                  "").to(x.dtype)
    if x.shape[0] <= _FEW_ROWS:
        wt = copies.get(name + "_t")  # [in, out] contiguous: x @ wt is x @ w.T
        if wt is not None:
            return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
    else:
        packed = copies.get(name + "_packed")
        if packed is not None:
            m = x.shape[0]
            if m < _PAD_ROWS_TO:
                xp = x.new_zeros(_PAD_ROWS_TO, x.shape[1])
                xp[:m] = x
                return torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")[:m]
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return upcast_linear(x, w, bias)


@contextlib.contextmanager
def cpu_threads_for(x: torch.Tensor, max_query_len: int = 1):
    """Run a CPU forward on one thread when its ops are many and tiny.

    With OMP_WAIT_POLICY=PASSIVE every parallel op first wakes the sleeping OpenMP workers
    (tens of microseconds). A single-token forward (batch-1 decode) is ~400 tiny ops around
    memory-bound GEMVs that a second thread barely speeds up, and a small step with
    multi-token queries (verify, a short prefill chunk) attends one sequence at a time; both
    run faster on one thread (measured on the 2-core CI machine). Batched decode (its
    attention is a few batched ops, its linears gain from both cores) and long prefills keep
    all threads.
    """
    n = torch.get_num_threads()
    t = x.shape[0]
    small = t == 1 or (max_query_len > 1 and t <= _ONE_THREAD_MAX_TOKENS)
    if x.is_cuda or n == 1 or not small:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def cpu_has_bf16_dot(cpuinfo: Optional[str] = None) -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16) and oneDNN's packed
    linear is there to use it: then a bf16 weight copy streams half the bytes at no extra
    arithmetic cost. `cpuinfo`: /proc/cpuinfo's text (tests); elsewhere than Linux, False."""
    if not cpu_packs_bf16():
        return False
    if cpuinfo is None:
        return _linux_bf16_flags()
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def cpu_packs_bf16() -> bool:
    """Whether oneDNN's packed linear takes bf16 weights on this CPU (at least emulated)."""
    return _HAS_PACKED_LINEAR and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.lru_cache(maxsize=1)  # the machine's facts do not change while it runs
def _linux_bf16_flags() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_has_bf16_dot(f.read())
    except OSError:
        return False


def add_weight_copies_(model: nn.Module, dtype: torch.dtype,
                       narrow: Optional[torch.dtype] = None) -> None:
    """Keep faster-to-read copies of the projection weights next to them (same values, in the
    activation dtype `dtype`: weights stored narrower are upcast once here, not every call;
    `linear` picks one by the number of rows). Measured on the 2-core CI machine
    (decisions-log.md, "CPU decode keeps extra weight copies"):

      one row (decode at batch 1): MKL streams a transposed weight (x @ w_t with w_t a
        contiguous [in, out] copy) faster than x @ w.T from the row-major one, except for
        down_proj (in = 4 * out), where it is slower; so every weight but down_weight gets a
        transposed copy.
      2+ rows (batch decode, verify, prefill): oneDNN with its packed weight layout is
        faster than MKL from a few rows and no slower for many.

    Costs up to two more copies of the weights in RAM (packed: float32 only); over bf16-stored
    weights (weight_dtype) the copies are fp32, so the CPU keeps fp32 speed but not bf16 memory.

    narrow=torch.bfloat16 (a draft head on a CPU with bf16 instructions: cpu_has_bf16_dot):
    one oneDNN-packed bf16 copy of each matrix instead, which `linear` multiplies with its
    input rounded to bf16 (summed in fp32, the result rounded to bf16, then widened to
    `dtype`; exact ties in a draft's argmax go to the lower id). A CPU step streams
    every weight it reads from memory, so half the bytes is most of a draft pass's time; the
    drafts may differ where two logits are within bf16's rounding, the output does not (the
    target verifies every draft)."""
    for m in model.modules():
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight",
                     "lm_head_weight", "fc_weight", "eh_proj_weight"):  # fc: EAGLE-3; eh_proj: MTP
            p = getattr(m, name, None)
            if not isinstance(p, torch.Tensor) or p.dim() != 2 or p.is_cuda:
                continue
            for kind in ("_t", "_packed", "_bf16"):  # one kind of copy: `linear` reads the
                m.__dict__.pop(name + kind, None)  # bf16 one first
            if narrow is not None:
                m.__dict__[name + "_bf16"] = torch.ops.mkldnn._reorder_linear_weight(
                    p.detach().to(narrow), 8)
                continue
            w = p.detach().to(dtype)
            # (down_weight stored narrower gets one too: reading it as is would upcast it on
            # every one-row call)
            if name != "down_weight" or p.dtype != dtype:
                m.__dict__[name + "_t"] = w.t().contiguous()
            if _HAS_PACKED_LINEAR and dtype == torch.float32:
                # The batch-size hint picks the packed layout; 8 rows measured best for 2..256.
                m.__dict__[name + "_packed"] = torch.ops.mkldnn._reorder_linear_weight(w, 8)
