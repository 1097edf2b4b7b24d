"""The device n-gram lookup (speculative/ngram_device.py) as one Triton kernel, a program a row.

What it computes is `ngram_propose_ref`'s (speculative/ngram_device.py, the torch reference
kept for CPUs and tests): for row b with committed tokens T = history[b, :L] (L = lengths[b]
clamped to 0 .. Lmax), the longest n in [max_n .. min_n] whose suffix T[L-n:L] occurs earlier,
at its most recent earlier occurrence, and the up to k tokens that followed it (fewer where
they run into the end of T, unless `periodic`: then copied on with period L - start).

How: an occurrence is named by its END e (its last token): it is earlier when e <= L - 2 and
lies in the text when its start e - n + 1 >= 0. For an end e let m(e) be its match length, the
number of leading t = 0, 1, .. with history[e - t] == history[L - 1 - t] and e - t >= 0, capped
at top_n = min(max_n, Lmax - 1); the suffix n-gram occurs ending at e iff m(e) >= n. The answer
is then the end with the largest key m(e) * Lmax + e among those with m(e) >= min_n: the
longest n first (m(e) = n* exactly at the ends of the longest matching n*), the most recent
end among them. The row's program walks its own valid ends only, from L - 2 down to 0 in
blocks of BLOCK ends (the loop bound comes from `lengths`, so a short row costs little and
columns past L are never read), each block top_n shifted loads and compares with a running
AND, and a max of the keys; it stops early once a key of m = top_n is found (no later block,
being older, can beat it). The continuation starts at e + 1 whatever n matched.

Cost: one launch; a row reads each of its L tokens top_n times (mostly from cache) and stops
at the most recent top_n-gram match: O(L x max_n) work a row, against the reference's max_n
passes of ~10 elementwise kernels over the whole [B, Lmax] buffer. Memory: nothing beyond the
outputs, which a caller may own (`StepOutputs`).

`StepOutputs` is the fused step's form (runner/fused_ngram.py): each row's count is also
capped at max(context - 1 - lengths[b], 0) (the next step emits count + 1 tokens) and 0 in
rows that are not real, and the drafts go to two [B, k] views (any row stride): 0 past the
count (the next chained step's input) and -1 past it (the packed output the host reads).

Graph-safe: the grid is (B,), every launch argument comes from shapes and Python options,
nothing reads a tensor on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.kernels.options import current

try:  # guarded: CPU machines may not have triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

BLOCK = 512  # ends a loop iteration of a row's program compares


class StepOutputs(NamedTuple):
    """Where the fused step wants a lookup's results (module docstring)."""
    drafts: torch.Tensor  # [B, k] int64, unit column stride: 0 past each row's count
    marked: torch.Tensor  # [B, k] int64, unit column stride: -1 past each row's count
    counts: torch.Tensor  # [B] int64
    real: torch.Tensor  # [B] bool: rows whose count is kept (0 elsewhere)
    context: int  # each count at most max(context - 1 - lengths[b], 0)


def use_ngram_kernel(t: torch.Tensor) -> bool:
    """Whether the lookup over history `t` runs as this kernel: a CUDA tensor, triton
    importable, and KernelOptions.ngram_lookup_kernel on (else the torch reference)."""
    return current().ngram_lookup_kernel and use_triton(t)


if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def _ngram_lookup_kernel(hist_ptr, len_ptr, drafts_ptr, marked_ptr, counts_ptr, real_ptr,
                             W, stride_h, stride_d, stride_m, stride_l, stride_c, stride_r,
                             context,
                             K: tl.constexpr, MIN_N: tl.constexpr, TOP_N: tl.constexpr,
                             PERIODIC: tl.constexpr, STEP: tl.constexpr,
                             BLOCK: tl.constexpr, KBLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        raw = tl.load(len_ptr + row * stride_l).to(tl.int64)
        length = tl.minimum(tl.maximum(raw, 0), W)  # clamped, as the reference does
        h = hist_ptr + row * stride_h
        offs = tl.arange(0, BLOCK)
        # launched with 1 <= MIN_N <= TOP_N <= W - 1 and K >= 1 (else nothing can be proposed)
        best = length * 0 - 1  # the largest key m(e) * W + e so far; -1: no end yet
        full = TOP_N * W  # a key this large has m = top_n: nothing older beats it
        hi = length - 2  # the most recent end an earlier occurrence may have
        while (hi >= 0) & (best < full):
            e = hi - offs  # descending ends; those below 0 lie before the text
            run = e >= 0
            m = tl.zeros([BLOCK], dtype=tl.int32)
            for t in tl.static_range(TOP_N):
                # the suffix's token t from its end: index >= 1 here (hi >= 0 means length
                # >= 2, and an end that still runs has t <= e <= length - 2)
                tail = tl.load(h + tl.maximum(length - 1 - t, 0))
                # masked by position only, not by `run`: the top_n loads of a block don't
                # wait on each other's compares (every e - t >= 0 here lies below length)
                inside = e - t >= 0
                tok = tl.load(h + (e - t), mask=inside, other=0)
                run = run & inside & (tok == tail)
                m += run.to(tl.int32)
            key = tl.where(m >= MIN_N, m.to(tl.int64) * W + e, -1)
            best = tl.maximum(best, tl.max(key, axis=0))
            hi -= BLOCK
        start = best % W + 1  # the continuation's first position, <= L - 1 where found
        span = tl.maximum(length - start, 1)  # tokens from start to the end of the text
        cols = tl.arange(0, KBLOCK)
        if PERIODIC:  # past the end, copy on with period `span` (ngram._continuation)
            pos = start + cols % span
            count = tl.where(best >= 0, K, 0).to(tl.int64)
        else:
            pos = start + cols
            count = tl.where(best >= 0, tl.minimum(span, K), 0).to(tl.int64)
        keep = cols < count  # the drafts are left-aligned: the first `count` columns
        tokens = tl.load(h + pos, mask=keep, other=0).to(tl.int64)
        if STEP:
            count = tl.minimum(count, tl.maximum(context - 1 - raw, 0))
            count = tl.where(tl.load(real_ptr + row * stride_r) != 0, count, 0)
            keep = cols < count
            tl.store(marked_ptr + row * stride_m + cols, tl.where(keep, tokens, -1),
                     mask=cols < K)
        tl.store(drafts_ptr + row * stride_d + cols, tl.where(keep, tokens, 0), mask=cols < K)
        tl.store(counts_ptr + row * stride_c, count)


def ngram_lookup_triton(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int = 1,
                        max_n: int = 4, periodic: bool = False, step: StepOutputs = None,
                        block: int = BLOCK) -> tuple:
    """(drafts [B, k] long, counts [B] long), as `ngram_propose_ref` returns them: drafts
    left-aligned in drafts[b, :counts[b]], zeros past. With `step`, written there instead
    (module docstring) and returned as (step.drafts, step.counts); nothing else is allocated.

    history: [B, Lmax] integer ids; lengths: [B] integers (clamped to 0 .. Lmax), any stride,
    as step.counts and step.real (strided views are read and written in place). The caller
    checks the options (ngram_device._check_args). block: ends a loop iteration compares (a
    power of two)."""
    rows, width = history.shape
    if step is None:
        drafts = torch.empty(rows, k, dtype=torch.long, device=history.device)
        counts = torch.empty(rows, dtype=torch.long, device=history.device)
        marked, real, context = drafts, counts, 0  # unread without a step
    else:
        drafts, marked, counts, real, context = step
        for name, t in (("drafts", drafts), ("marked", marked)):
            if t.shape != (rows, k) or t.dtype != torch.long or (k > 1 and t.stride(1) != 1):
                raise ValueError(f"step.{name} must be a [{rows}, {k}] int64 view with unit "
                                 f"column stride, got {tuple(t.shape)} {t.dtype}")
        if counts.shape != (rows,) or counts.dtype != torch.long or real.shape != (rows,):
            raise ValueError(f"step.counts and step.real must be [{rows}]: got "
                             f"{tuple(counts.shape)} {counts.dtype}, {tuple(real.shape)}")
    top_n = min(max_n, width - 1)  # a longer n has no earlier occurrence in any row
    if rows == 0 or k == 0 or top_n < min_n:  # nothing to propose, whatever the values
        drafts.zero_()
        marked.fill_(-1 if step is not None else 0)
        counts.zero_()
        return drafts, counts
    if history.stride(1) != 1:
        history = history.contiguous()
    _ngram_lookup_kernel[(rows,)](
        history, lengths, drafts, marked, counts, real, width, history.stride(0),
        drafts.stride(0), marked.stride(0), lengths.stride(0), counts.stride(0), real.stride(0),
        context, K=k, MIN_N=min_n, TOP_N=top_n,
        PERIODIC=bool(periodic), STEP=step is not None, BLOCK=block, KBLOCK=next_pow2(k),
        num_warps=4, **pdl.launch_options(history))
    return drafts, counts
