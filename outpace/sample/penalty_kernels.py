"""A fused step's penalties (runner/fused_penalties.py) in two Triton kernels, with the PyTorch
references they are tested against.

penalize_rows: the repetition, frequency and presence penalties of a step's logits rows, in one
pass. Row r = b * q + j (request b, verify row j) reads its request's tables (prompt [m, V] bool,
counts [m, V] float32: the output so far) and counts the drafts before it, the input ids of
rows b * q + 1 .. b * q + j, as output too; then logits_processing.penalize's formula. Through
torch ops this is ~15 kernels (two [n, V] gathers, a scatter, eight elementwise passes), each
reading or writing [n, V]; here one read of the logits and tables (decisions-log.md,
"penalties and logprobs in the fused graphs"). The values are torch's bit for bit: the
division is IEEE (div_rn), and the kernel is compiled without fused multiply-adds (torch
rounds freq * counts before subtracting).

count_emitted: after accept, each row's emitted tokens (packed[b, :q], -1 past its accepted
count) added to its output counts (atomics: a token may be emitted twice in a step).
"""

from __future__ import annotations

import torch

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.sample.logits_processing import penalize

try:  # guarded: CPU machines may not have triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

BLOCK = 2048  # columns a program: 24 programs a 49152-id row


def penalize_rows_ref(logits, prompt, counts, ids, rep, freq, pres, bucket: int, q: int):
    """[n, V] float32 logits (n = bucket * q) -> penalized (a new tensor). prompt, counts:
    [>= bucket, V] tables; ids: [n] input ids; rep, freq, pres: [>= bucket] float32."""
    vocab = counts.shape[1]

    def rows_of(table):  # [bucket, V] -> [n, V], each request's row on its q rows
        return table[:bucket, None].expand(bucket, q, vocab).reshape(-1, vocab).clone()
    prompt_n, counts_n = rows_of(prompt), rows_of(counts)
    by_request = ids[:bucket * q].view(bucket, q)
    first = torch.arange(bucket, device=logits.device) * q
    for j in range(1, q):  # row j's earlier drafts: the inputs of rows 1 .. j
        for i in range(1, j + 1):
            flat = (first + j) * vocab + by_request[:, i]
            counts_n.view(-1).index_add_(0, flat, torch.ones(flat.shape, device=flat.device))

    def per_row(t):  # [bucket] -> [n, 1]
        return t[:bucket, None].expand(bucket, q).reshape(-1, 1)
    return penalize(logits, prompt_n | (counts_n > 0), counts_n, per_row(rep), per_row(freq),
                    per_row(pres))


def penalize_rows(logits, prompt, counts, ids, rep, freq, pres, bucket: int, q: int):
    """penalize_rows_ref; on CUDA one kernel, in place (returns logits)."""
    if not use_triton(logits):
        return penalize_rows_ref(logits, prompt, counts, ids, rep, freq, pres, bucket, q)
    return penalize_rows_triton(logits, prompt, counts, ids, rep, freq, pres, bucket, q)


def penalize_rows_triton(logits, prompt, counts, ids, rep, freq, pres, bucket: int, q: int,
                         block: int = BLOCK):
    """penalize_rows on the device; block: columns a program (a power of two)."""
    n, vocab = bucket * q, counts.shape[1]
    assert logits.shape == (n, vocab) and logits.dtype == torch.float32 \
        and logits.is_contiguous() and counts.is_contiguous() and prompt.is_contiguous()
    _penalize_kernel[(n, triton.cdiv(vocab, block))](
        logits, prompt.view(torch.uint8), counts, ids, rep, freq, pres, vocab, Q=q,
        Q_POW2=next_pow2(q), BLOCK=block, num_warps=4, enable_fp_fusion=False,
        **pdl.launch_options(logits))
    return logits


def count_emitted_ref(packed, q: int, counts) -> None:
    """Add each row's emitted tokens (packed[b, :q], -1 past the accepted count) to counts[b]."""
    bucket, vocab = packed.shape[0], counts.shape[1]
    emitted = packed[:, :q]
    rows = torch.arange(bucket, device=packed.device).unsqueeze(1) * vocab
    flat = (rows + emitted.clamp(min=0)).reshape(-1)
    counts.view(-1).index_add_(0, flat, (emitted >= 0).reshape(-1).to(torch.float32))


def count_emitted(packed, q: int, counts) -> None:
    """count_emitted_ref; on CUDA one kernel."""
    if not use_triton(packed):
        return count_emitted_ref(packed, q, counts)
    count_emitted_triton(packed, q, counts)


def count_emitted_triton(packed, q: int, counts) -> None:
    assert counts.is_contiguous()
    _count_kernel[(packed.shape[0],)](packed, counts, packed.stride(0), counts.shape[1], Q=q,
                                      Q_POW2=next_pow2(q), num_warps=1,
                                      **pdl.launch_options(packed))


if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def _penalize_kernel(logits_ptr, prompt_ptr, counts_ptr, ids_ptr, rep_ptr, freq_ptr,
                         pres_ptr, V, Q: tl.constexpr, Q_POW2: tl.constexpr,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        row = tl.program_id(0)
        b = row // Q
        j = row % Q
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        wait_then_release(USE_PDL)  # the logits, ids and tables are this step's or recent
        x = tl.load(logits_ptr + row.to(tl.int64) * V + cols, mask=mask, other=0.0)
        base = b.to(tl.int64) * V
        c = tl.load(counts_ptr + base + cols, mask=mask, other=0.0)
        in_prompt = tl.load(prompt_ptr + base + cols, mask=mask, other=0) != 0
        # the drafts before this row: inputs of rows 1 .. j of the request
        i = tl.arange(0, Q_POW2)
        drafts = tl.load(ids_ptr + b * Q + i, mask=(i >= 1) & (i <= j), other=-1)
        c += tl.sum((cols[:, None] == drafts[None, :]).to(tl.float32), axis=1)
        rep = tl.load(rep_ptr + b)
        freq = tl.load(freq_ptr + b)
        pres = tl.load(pres_ptr + b)
        penalised = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
        x = tl.where(in_prompt | (c > 0), penalised, x)
        x = x - freq * c - pres * (c > 0).to(tl.float32)
        tl.store(logits_ptr + row.to(tl.int64) * V + cols, x, mask=mask)

    @triton.jit
    def _count_kernel(packed_ptr, counts_ptr, stride_p, V, Q: tl.constexpr,
                      Q_POW2: tl.constexpr, USE_PDL: tl.constexpr):
        b = tl.program_id(0)
        i = tl.arange(0, Q_POW2)
        wait_then_release(USE_PDL)
        tok = tl.load(packed_ptr + b * stride_p + i, mask=i < Q, other=-1)
        tl.atomic_add(counts_ptr + b.to(tl.int64) * V + tok, tl.full([Q_POW2], 1.0, tl.float32),
                      mask=tok >= 0)
