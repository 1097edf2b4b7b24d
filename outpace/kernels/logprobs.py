"""Each row's raw logprobs (vLLM's default: the log-softmax of the logits before any
processing) as a request with `logprobs` gets them: its emitted token's and the top `top` with
their ids, in two Triton passes, with the PyTorch reference.

Through torch a row's log_softmax is one block walking the whole row and its topk a dozen
radix-select kernels, plus the gather and the concatenation: a large share of a batch-1 step
(decisions-log.md, "Logprobs in the graphs too" and "logprobs in two Triton passes").
Here pass 1 cuts each row into CHUNK-wide pieces, one program each: the piece's maximum, its sum
of exp(x - max), and its top `top` entries (by keys that order by value, then by lower id:
ties go to the lower id). Pass 2 merges a row's pieces: the log-sum-exp, the top `top` of
the pieces' candidates, and the emitted token's logprob. Values are (x - max) - log(sum), the
formula of torch's log_softmax, with the sum taken in another order (float32 rounding apart,
the same numbers); the general path (SamplingStep) and the fused graphs both call row_logprobs,
so on CUDA they give the same bits.

Output rows: [logprob of the emitted token, the top values, their ids as float32 (exact below
2^24)]: one float32 buffer, so a graph step still ends in copies of fixed buffers.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.kernels.options import current

try:  # guarded: CPU machines may not have triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

CHUNK = 2048  # columns per pass-1 program: 24 programs for a 49152-entry row
WARPS = 4  # per pass-1 program
MERGE_WARPS = 4  # per pass-2 program


def row_logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """logits [n, V], tokens [n] (clamped into [0, V): a -1 past an accepted count reads id 0)
    -> [n, 1 + 2 * top] float32: each row's token's log-softmax, its top `top` values, their
    ids."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.clamp(0, lp.shape[1] - 1).view(-1, 1))
    if top == 0:
        return chosen
    values, ids = lp.topk(top, dim=-1)
    return torch.cat([chosen, values, ids.to(torch.float32)], dim=1)


def row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int,
                 count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """row_logprobs_ref; on CUDA the two Triton passes (graph-capturable: shapes only).
    `count` (a [1] int32 device tensor, read when the kernels run): on CUDA only the first
    min(count, top) of each row's top are computed, the rest of the row left as it was (a
    graph's output is `top` wide; its steps need only their requests' largest n, and each of
    the top costs a reduction over the row)."""
    if top < 0 or top > logits.shape[1]:
        raise ValueError(f"top must be in [0, {logits.shape[1]}], got {top}")
    if not current().triton_logprobs or not use_triton(logits) or logits.shape[1] >= 2 ** 31 - 1:
        return row_logprobs_ref(logits, tokens, top)
    return row_logprobs_triton(logits, tokens, top, count)


def row_logprobs_triton(logits: torch.Tensor, tokens: torch.Tensor, top: int,
                        count: Optional[torch.Tensor] = None, chunk: int = CHUNK) -> torch.Tensor:
    """row_logprobs on the device; chunk: the widest piece (columns a pass-1 program; a power
    of two)."""
    n, vocab = logits.shape
    out = torch.empty(n, 1 + 2 * top, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunk = min(chunk, max(16, next_pow2(vocab)))
    chunks = triton.cdiv(vocab, chunk)
    maxes = torch.empty(n, chunks, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    cands = torch.empty(n, chunks * top, dtype=torch.int64, device=logits.device)
    if count is None:
        count = torch.full((1,), top, dtype=torch.int32, device=logits.device)
    opts = pdl.launch_options(logits)
    _chunks_kernel[(n, chunks)](logits, count, maxes, sums, cands, vocab, logits.stride(0),
                                chunks, TOP=top, CHUNK=chunk, num_warps=WARPS, **opts)
    _merge_kernel[(n,)](logits, tokens, count, maxes, sums, cands, out, vocab,
                        logits.stride(0), tokens.stride(0), chunks, out.stride(0), TOP=top,
                        CHUNKS_POW2=max(2, next_pow2(chunks)),
                        CANDS_POW2=max(2, next_pow2(chunks * top)), num_warps=MERGE_WARPS,
                        **opts)
    return out


def logprob_lists(rows: np.ndarray, n: int) -> list:
    """[..., 1 + 2 * top] float32 rows of row_logprobs, on the host -> the same nesting as lists
    of [token's logprob, n values, n ids], in one conversion: a batch's rows are made into
    Python numbers at once (per-request slicing and tolist cost host time for every request,
    and a request wants only its n of the top 20)."""
    top = (rows.shape[-1] - 1) // 2
    n = min(n, top)  # (a vocabulary smaller than the n asked for has fewer)
    return np.concatenate([rows[..., :1 + n], rows[..., 1 + top:1 + top + n]],
                          axis=-1).tolist()


def token_logprobs(rows: list, n: int) -> list:
    """Rows of logprob_lists (n <= their width) -> what a request's output holds: per token
    (its logprob, {id: logprob} of the top n)."""
    width = (len(rows[0]) - 1) // 2 if rows else 0
    return [(r[0], {int(r[1 + width + j]): r[1 + j] for j in range(min(n, width))})
            for r in rows]


if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    # A key orders entries by value, then by lower column: the float's bits made to order as
    # signed integers (negative floats: every bit but the sign flipped), shifted up 32 bits,
    # over 2^31 - 1 - column (columns < 2^31): the larger key is the larger value, or the
    # lower column of an equal one. Below every key: _LOWEST (masked columns).
    _LOWEST = tl.constexpr(-(2 ** 63))

    @triton.jit
    def _key(x, cols):
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)

    @triton.jit
    def _unkey(key):
        # -> (value, column) of _key
        ordered = (key >> 32).to(tl.int32)
        bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True), 0x7FFFFFFF - (key & 0x7FFFFFFF)

    @triton.jit
    def _chunks_kernel(x_ptr, count_ptr, max_ptr, sum_ptr, cand_ptr, V, stride_x, num_chunks,
                       TOP: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        mask = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        m = tl.max(x, axis=0)
        # a piece of -inf only (or a garbage row) must not make NaN out of exp(-inf + inf)
        shift = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp(x - shift), axis=0)
        piece = row * num_chunks + c
        tl.store(max_ptr + piece, m)
        tl.store(sum_ptr + piece, s)
        if TOP > 0:
            # the piece's best `count`, best first: the largest key, count times, each then
            # removed (a piece of fewer real columns runs out into the masked ones' lowest
            # key, which the merge never takes). A reduction of one key each beats a sort of
            # the piece: a bitonic sort of 2048 keys compiles to ~350 barriers.
            count = tl.minimum(tl.maximum(tl.load(count_ptr), 0), TOP)
            keys = tl.where(mask, _key(x, cols), _LOWEST)
            for i in range(count):
                best = tl.max(keys, axis=0)
                tl.store(cand_ptr + piece * TOP + i, best)
                keys = tl.where(keys == best, _LOWEST, keys)

    @triton.jit
    def _merge_kernel(x_ptr, tok_ptr, count_ptr, max_ptr, sum_ptr, cand_ptr, out_ptr, V,
                      stride_x, stride_t, num_chunks, stride_o, TOP: tl.constexpr,
                      CHUNKS_POW2: tl.constexpr, CANDS_POW2: tl.constexpr,
                      USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs_c = tl.arange(0, CHUNKS_POW2)
        c_mask = offs_c < num_chunks
        m = tl.load(max_ptr + row * num_chunks + offs_c, mask=c_mask, other=float("-inf"))
        s = tl.load(sum_ptr + row * num_chunks + offs_c, mask=c_mask, other=0.0)
        big = tl.max(m, axis=0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))
        log_sum = tl.log(tl.sum(s * scale, axis=0))
        tok = tl.load(tok_ptr + row * stride_t)
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)
        x_tok = tl.load(x_ptr + row * stride_x + tok).to(tl.float32)
        tl.store(out_ptr + row * stride_o, (x_tok - big) - log_sum)
        if TOP > 0:
            # every piece's `count` candidates, then the best of them as pass 1 took its own
            count = tl.minimum(tl.maximum(tl.load(count_ptr), 0), TOP)
            offs = tl.arange(0, CANDS_POW2)
            keys = tl.load(cand_ptr + row * num_chunks * TOP + offs,
                           mask=(offs < num_chunks * TOP) & (offs % TOP < count),
                           other=_LOWEST)
            for i in range(count):
                best = tl.max(keys, axis=0)
                keys = tl.where(keys == best, _LOWEST, keys)
                value, col = _unkey(best)
                col = tl.minimum(tl.maximum(col, 0), V - 1)  # always an id in range
                tl.store(out_ptr + row * stride_o + 1 + i, (value - big) - log_sum)
                tl.store(out_ptr + row * stride_o + 1 + TOP + i, col.to(tl.float32))
