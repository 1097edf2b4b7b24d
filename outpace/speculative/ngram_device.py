"""n-gram prompt lookup over a device token history, for a CUDA graph: one Triton kernel on
CUDA (kernels/ngram_lookup.py), the tensor-op reference here elsewhere.

The same lookup as speculative/ngram.py (`NgramDrafter.propose`), batched: for each row b with
committed tokens T = history[b, :lengths[b]] of length L, the longest n in [max_n .. min_n]
whose suffix n-gram T[L-n:L] occurs earlier, at its most recent earlier occurrence; the drafts
are the tokens that followed it, up to k (fewer where they run into the end of T, unless
`periodic`).

In the reference every shape is fixed by (B, Lmax, k, min_n, max_n), every loop runs over
Python ints, and nothing reads a tensor's value on the host (no `.item()`, no data-dependent
shape), so the function can be captured in a CUDA graph and replayed with new histories and
lengths (the kernel too: a fixed grid of B programs).

How (the reference; the kernel's walk is described in its module): an occurrence is named by
its END e (its last token), not its start. The suffix of length n matches at end e iff
history[e - t] == history[L - 1 - t] for every t < n, so one running AND over t = 0, 1, ..
max_n - 1 of the shifted equality

    acc_t[b, e] = acc_{t-1}[b, e] and history[b, e - t] == history[b, L_b - 1 - t]

gives, after pass t, the ends of every matching (t + 1)-gram at once. An occurrence is earlier
when it ends at e <= L - 2 (the suffix itself ends at L - 1), and it lies in the text when its
start e - n + 1 >= 0. Among valid ends the most recent is the largest index: an `amax` over the
position-weighted mask (-1 where none). Passes run n upward and a found match replaces the one
of a shorter n, so the longest n wins. The continuation starts at e + 1 whatever n matched.

Cost: on CUDA with triton one kernel (kernels/ngram_lookup.py, unless
KernelOptions.ngram_lookup_kernel is off): a program a row walks that row's own earlier ends
only, from the most recent, and stops at a max_n-gram match, O(L x max_n) a row whatever Lmax,
allocating nothing but its outputs. The tensor-op reference below (`ngram_propose_ref`, the CPU
path) runs max_n passes of O(B * Lmax) elementwise work and one row reduction each, then
O(B * k) for the continuation: O(B * Lmax * max_n) work in ~10 kernels a pass and O(B * Lmax)
memory (`lookup_bytes`), reading the whole buffer width Lmax whatever the rows' lengths.
Either way against NgramState's O(max_n^2) per step on the host (it keeps an index instead of
rescanning).

Entries of `history` at or past a row's length are never read as matches (they may hold
anything: a slot's previous request). `lengths` must lie in 0 .. Lmax; a graph can't check
values, so they are clamped to it (the result is then that of the clamped length).
"""

from __future__ import annotations

import torch

from outpace.kernels.ngram_lookup import ngram_lookup_triton, use_ngram_kernel
from outpace.speculative.ngram import _check_range


def ngram_propose(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int = 1,
                  max_n: int = 4, periodic: bool = False) -> tuple:
    """(drafts [B, k] long, counts [B] long): each row's `NgramDrafter(min_n, max_n,
    periodic).propose(history[b, :lengths[b]], k)`, left-aligned in drafts[b, :counts[b]],
    zeros past it (counts 0 where nothing matches).

    history: [B, Lmax] integer token ids; lengths: [B] integer, each in 0 .. Lmax. k, min_n,
    max_n, periodic are fixed for a captured graph (Python values). On CUDA with triton the
    Triton kernel (kernels/ngram_lookup.py) computes it, else the tensor-op reference."""
    _check_args(history, lengths, k, min_n, max_n)
    if use_ngram_kernel(history):
        return ngram_lookup_triton(history, lengths, k, min_n, max_n, periodic)
    return _propose_ref(history, lengths, k, min_n, max_n, periodic)


def ngram_propose_ref(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int = 1,
                      max_n: int = 4, periodic: bool = False) -> tuple:
    """`ngram_propose` in tensor ops on any device (the module docstring's passes): the
    reference the kernel is tested against."""
    _check_args(history, lengths, k, min_n, max_n)
    return _propose_ref(history, lengths, k, min_n, max_n, periodic)


def _propose_ref(history, lengths, k, min_n, max_n, periodic) -> tuple:
    rows, width = history.shape
    dev = history.device
    drafts = torch.zeros(rows, k, dtype=torch.long, device=dev)
    counts = torch.zeros(rows, dtype=torch.long, device=dev)
    top_n = min(max_n, width - 1)  # a longer n has no earlier occurrence in any row
    if k == 0 or top_n < min_n:
        return drafts, counts
    length = lengths.to(torch.long).clamp(0, width).unsqueeze(1)  # [B, 1]
    ends = torch.arange(width, device=dev)  # [Lmax]: e, an occurrence's last position
    earlier = ends <= length - 2  # [B, Lmax]: ends before the suffix's own last token
    best_end = torch.full((rows, 1), -1, dtype=torch.long, device=dev)
    acc = None
    for t in range(top_n):
        n = t + 1
        # the suffix's token t from its end; a row too short for it reads index 0, and its
        # matches of this n are all invalid (e >= n - 1 > L - 2) below
        tail = history.gather(1, (length - 1 - t).clamp(min=0))  # [B, 1]
        # history[b, e - t] at column e; the t columns shifted in lie below n - 1: never valid
        shifted = torch.cat([history.new_zeros(rows, t), history[:, :width - t]], dim=1)
        eq = shifted == tail  # [B, Lmax]
        acc = eq if acc is None else acc & eq
        if n < min_n:
            continue
        valid = acc & earlier & (ends >= n - 1)
        end_n = torch.where(valid, ends, -1).amax(dim=1, keepdim=True)  # [B, 1]: most recent
        best_end = torch.where(end_n >= 0, end_n, best_end)  # a longer n replaces a shorter
    found = best_end >= 0  # [B, 1]
    start = best_end + 1  # the continuation's first position, <= L - 1 where found
    span = (length - start).clamp(min=1)  # tokens from start to the end of the text
    offs = torch.arange(k, device=dev)  # [k]
    if periodic:  # past the end, copy on with period `span` (ngram._continuation)
        pos = start + offs % span
        keep = found.expand(rows, k)
    else:
        pos = start + offs
        keep = found & (offs < span)
    tokens = history.gather(1, pos.clamp(0, width - 1)).to(torch.long)
    drafts = torch.where(keep, tokens, drafts)
    counts = keep.sum(dim=1)
    return drafts, counts


# Bytes of temporaries per history cell at the lookup's peak (an int32 history): in a pass,
# the shifted history (4) while the last pass's is still referenced (4), the equality, the
# running AND and the earlier mask (1 each), the valid mask and its partial (1 each) and the
# position-weighted ends (8); rounded up for the allocator's granularity.
LOOKUP_CELL_BYTES = 24


def lookup_bytes(rows: int, width: int, kernel: bool = False) -> int:
    """A bound of the memory the lookup allocates over a [rows, width] int32 history (what a
    CUDA graph of it holds in its pool), whatever k, min_n and max_n. The reference's
    (`ngram_propose_ref`; kernel False): its passes allocate the same and free the last one's.
    The kernel's (kernel True, where `use_ngram_kernel` holds): none, since the fused step
    passes it the outputs it writes (kernels/ngram_lookup.StepOutputs)."""
    if kernel:
        return 0
    return LOOKUP_CELL_BYTES * rows * width + 16 * width + (1 << 16)


def _check_args(history, lengths, k, min_n, max_n) -> None:
    """Shapes, dtypes and the Python options (nothing here reads a tensor's values)."""
    _check_range(min_n, max_n)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    if history.dim() != 2 or history.dtype.is_floating_point or history.dtype == torch.bool:
        raise ValueError(f"history must be a [B, Lmax] integer tensor, got {history.dtype} "
                         f"of shape {tuple(history.shape)}")
    if lengths.shape != (history.shape[0],) or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be a [B] integer tensor with B = {history.shape[0]}, "
                         f"got {lengths.dtype} of shape {tuple(lengths.shape)}")
    if lengths.device != history.device:
        raise ValueError(f"lengths on {lengths.device} but history on {history.device}")
