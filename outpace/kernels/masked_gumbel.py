"""The sampling race over the top-k / top-p / min-p nucleus, without sorting the row.

sample/gumbel.py draws a token as argmax_v(x_v + G_v) (x = logits / temperature, G hashed Gumbel
noise). With masks the race runs over the kept tokens only, and those are always a prefix of the
row ranked by x (ties: lower id first): top-k keeps rank < k; top-p keeps a token when the mass
ranked strictly above it is < p (of the top-k set, renormalised); min-p keeps x >= max + log(p).
The general path finds the prefix with a stable sort of every row, the largest part of the
masks' cost at batch 1. This kernel finds the race's winner directly, by descent:

    w = argmax over all v of (x + G)                  (pass 1, every chunk of the row at once)
    while w is not kept:  w = argmax over the tokens ranked above w of (x + G)

which ends at argmax over the kept prefix of (x + G), exactly the masked race's winner: the kept
set is a prefix, so when w is dropped every kept token ranks above w, and the first kept w is the
best of a superset of the kept set. Each step of the loop is one pass that yields the count
and mass ranked above w (whether w is kept) and the next w at once, and reads only the chunks
whose maximum reaches x_w (a bit mask of the chunk maxima pass 1 left: at most 64 chunks, so
large vocabularies take wider chunks). The unmasked race's winner is kept with probability ~p,
so a row takes ~1-2 passes (top-k alone over a flat row ~log2(V / k): each step lands about
halfway up).

With top-k and top-p together, top-p renormalises over the top-k set, whose mass M_k needs the
k-th largest x. So a token inside the top-k set is first judged by bounds: M_k lies between
the mass above w plus w's, and that plus w's for every top-k token below w (and below the
row's total). Only a token between the two verdicts needs M_k, once a row: one pass keeps each
lane's two largest x, a bisection in registers finds their k-th largest, and a count of the
row at or above it confirms it is the row's (else, when a lane holds three of the top k, a
bisection streaming the row: 32 counting passes, many times the cost of the rest).

Rounding: masses are float32 sums in this kernel's own order, where the sort path sums in rank
order, so a token whose mass ranked above it lies within rounding of p * total may be kept by
one and not the other. Every CUDA path (eager steps and graphs) samples masked rows here, so they
agree with each other; the CPU keeps the sort (sample/gumbel.masked_race_tokens is the dispatcher,
race_tokens(apply_sampling_params(...)) the reference the tests compare with).

Two launches: `_race_chunks_kernel` (a program per CHUNK columns, like the argmax's pass 1: x,
the noisy y stored for the loop, each chunk's best y, max x and sum of exp(x - max)), then
`_descent_kernel` (a program per row: the chunks' totals, the loop). Several times faster
than the sort path for every mix of masks at 1-32 rows; top-k with top-p costs more from about
8 rows, where some row needs M_k (H200; docs/decisions.md, "top-k / top-p / min-p without a
sort").
"""

from __future__ import annotations

import torch

from outpace.kernels import next_pow2, pdl

try:  # guarded: CPU machines may not have triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

# columns per pass-1 program and per step of the descent's passes, and the descent program's
# warps (one program a row): the fastest in a sweep on the H200 (decisions-log.md, "The
# descent")
CHUNK = 4096
DESCENT_WARPS = 32
SPAN = 4  # chunks a step of the top-k bisection reads at once


if triton is not None:
    from outpace.kernels.argmax import _hash32, _race_noise
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def _race_chunks_kernel(x_ptr, y_ptr, ybest_ptr, yidx_ptr, xmax_ptr, zsum_ptr, words_ptr,
                            pos_ptr, temp_ptr, V, stride_x, num_chunks, pos_offset,
                            CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        inb = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=inb, other=float("-inf"))
        x = tl.math.div_rn(x.to(tl.float32), tl.load(temp_ptr + row).to(tl.float32))
        y = x
        word = tl.load(words_ptr + row)
        if word >= 0:  # a greedy row (word -1) races without noise: its argmax
            pos = (tl.load(pos_ptr + row).to(tl.int64) + pos_offset).to(tl.uint32)
            y = x + _race_noise(_hash32(word.to(tl.uint32) ^ _hash32(pos)), cols)
        tl.store(y_ptr + row * V + cols, y, mask=inb)
        y = tl.where(y == y, y, float("inf"))  # NaN as the maximum, as argmax_rows
        best = tl.max(y, axis=0)
        xm = tl.max(x, axis=0)
        z = tl.sum(tl.where(x > float("-inf"), tl.exp(x - xm), 0.0), axis=0)
        part = row * num_chunks + c
        tl.store(ybest_ptr + part, best)
        tl.store(yidx_ptr + part, tl.min(tl.where(y == best, cols, V), axis=0))
        tl.store(xmax_ptr + part, xm)
        tl.store(zsum_ptr + part, z)

    @triton.jit
    def _x_block(x_ptr, row, stride_x, cols, V, t):
        # x = logits / temperature over one block of a row (-inf past its end)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf"))
        return tl.math.div_rn(x.to(tl.float32), t)

    @triton.jit
    def _ordered_key(x):
        # float32 -> uint32 in the same order (+0.0 for -0.0 first: they compare equal)
        bits = (x + 0.0).to(tl.uint32, bitcast=True)
        return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)

    @triton.jit
    def _chunk_bits(flags, offs):
        # [CBLOCK] flags -> an int64 whose bit c is flags[c] (at most 64 chunks)
        return tl.sum(tl.where(flags, tl.full(flags.shape, 1, tl.int64) << offs.to(tl.int64), 0),
                      axis=0)

    @triton.jit
    def _key_value(key):
        # _ordered_key's inverse
        bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, ~key)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _kth_key_of(keys_a, keys_b, k):
        # the largest key with >= k of keys_a and keys_b at or above it: the k-th largest of
        # them, by bisection in registers
        key = tl.full((), 0, tl.uint32)
        bit = tl.full((), 0x80000000, tl.uint32)
        for _ in range(32):
            trial = key | bit
            bit = bit >> 1
            count = tl.sum((keys_a >= trial).to(tl.int32) + (keys_b >= trial).to(tl.int32),
                           axis=0)
            key = tl.where(count >= k, trial, key)
        return key

    @triton.jit
    def _kth_key_streamed(x_ptr, row, stride_x, V, num_chunks, key_max, offs, t, k,
                          CHUNK: tl.constexpr, SPAN: tl.constexpr):
        # the row's k-th largest key by bisection over the row itself: a step reads SPAN chunks
        # at a time, only spans with a chunk whose maximum reaches the trial, and stops at k
        key = tl.full((), 0, tl.uint32)
        bit = tl.full((), 0x80000000, tl.uint32)
        for _ in range(32):
            trial = key | bit
            bit = bit >> 1
            visit = _chunk_bits((offs < num_chunks) & (key_max >= trial), offs)
            count = tl.zeros((), tl.int32)
            c = 0
            while (c < num_chunks) & (count < k):
                if ((visit >> c) & ((1 << SPAN) - 1)) != 0:
                    cols = c * CHUNK + tl.arange(0, SPAN * CHUNK)
                    kx = _ordered_key(_x_block(x_ptr, row, stride_x, cols, V, t))
                    count += tl.sum(((cols < V) & (kx >= trial)).to(tl.int32), axis=0)
                c += SPAN
            key = tl.where(count >= k, trial, key)
        return key

    @triton.jit
    def _top_k_mass(x_ptr, row, stride_x, V, num_chunks, xm, offs, t, m, k,
                    CHUNK: tl.constexpr, SPAN: tl.constexpr):
        # sum of exp(x - m) over the top-k set (ties at the k-th value: the lower ids), from
        # the k-th largest x. One pass keeps each lane's two largest x (a lane: a column of
        # the chunks); their k-th largest is the row's unless a lane holds three of the top
        # k, which a count of the row at or above it tells (then: _kth_key_streamed, 32 passes
        # over the row, far slower).
        first = tl.full((CHUNK,), float("-inf"), tl.float32)
        second = tl.full((CHUNK,), float("-inf"), tl.float32)
        for c in range(num_chunks):
            x = _x_block(x_ptr, row, stride_x, c * CHUNK + tl.arange(0, CHUNK), V, t)
            second = tl.where(x > first, first, tl.maximum(second, x))
            first = tl.maximum(first, x)
        key_a, key_b = _ordered_key(first), _ordered_key(second)
        key = _kth_key_of(key_a, key_b, k)
        kept = tl.sum((key_a >= key).to(tl.int32) + (key_b >= key).to(tl.int32), axis=0)
        xk = _key_value(key)
        visit = _chunk_bits((offs < num_chunks) & (xm >= xk), offs)
        at_or_above = tl.zeros((CHUNK,), tl.int32)
        for c in range(num_chunks):
            if ((visit >> c) & 1) != 0:
                cols = c * CHUNK + tl.arange(0, CHUNK)
                x = _x_block(x_ptr, row, stride_x, cols, V, t)
                at_or_above += ((cols < V) & (x >= xk)).to(tl.int32)
        if tl.sum(at_or_above, axis=0) != kept:
            key = _kth_key_streamed(x_ptr, row, stride_x, V, num_chunks, _ordered_key(xm), offs,
                                    t, k, CHUNK, SPAN)
        xk = _key_value(key)
        visit = _chunk_bits((offs < num_chunks) & (xm > xk), offs)
        above = tl.zeros((CHUNK,), tl.int32)
        mass = tl.zeros((CHUNK,), tl.float32)
        for c in range(num_chunks):
            if ((visit >> c) & 1) != 0:
                cols = c * CHUNK + tl.arange(0, CHUNK)
                x = _x_block(x_ptr, row, stride_x, cols, V, t)
                gt = (cols < V) & (x > xk)
                above += gt.to(tl.int32)
                mass += tl.where(gt, tl.exp(x - m), 0.0)
        return (tl.sum(mass, axis=0)
                + (k - tl.sum(above, axis=0)).to(tl.float32) * tl.exp(xk - m))

    @triton.jit
    def _descent_kernel(x_ptr, y_ptr, ybest_ptr, yidx_ptr, xmax_ptr, zsum_ptr, words_ptr,
                        temp_ptr, topk_ptr, topp_ptr, minp_ptr, out_ptr, V, stride_x,
                        num_chunks, CBLOCK: tl.constexpr, CHUNK: tl.constexpr,
                        SPAN: tl.constexpr, USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, CBLOCK)
        cm = offs < num_chunks
        parts = row * num_chunks + offs
        yb = tl.load(ybest_ptr + parts, mask=cm, other=float("-inf"))
        best = tl.max(yb, axis=0)
        # the unmasked race's winner: the first column holding the best y (chunks in order)
        w = tl.min(tl.where(yb == best, tl.load(yidx_ptr + parts, mask=cm, other=V), V), axis=0)
        w = tl.minimum(w, V - 1)
        k = tl.minimum(tl.load(topk_ptr + row), V).to(tl.int32)  # <= 0: off
        p = tl.load(topp_ptr + row).to(tl.float32)  # >= 1: off
        min_p = tl.load(minp_ptr + row).to(tl.float32)  # <= 0: off
        masked = (k > 0) | (p < 1.0) | (min_p > 0.0)
        if (tl.load(words_ptr + row) >= 0) & masked:
            t = tl.load(temp_ptr + row).to(tl.float32)
            xm = tl.load(xmax_ptr + parts, mask=cm, other=float("-inf"))
            zc = tl.load(zsum_ptr + parts, mask=cm, other=0.0)
            m = tl.max(xm, axis=0)
            total = tl.sum(tl.where(zc > 0.0, zc * tl.exp(xm - m), 0.0), axis=0)
            # With top-k, top-p renormalises over the top-k set, whose mass costs a bisection
            # (slow: many passes over the row); until a token's fate needs it, bounds decide
            lazy = ((k > 0) & (k < V) & (p < 1.0)).to(tl.int32)
            floor = tl.where(min_p > 0.0, m + tl.log(min_p), float("-inf"))
            xw = tl.math.div_rn(tl.load(x_ptr + row * stride_x + w).to(tl.float32), t)
            # min-p alone needs no pass while w is kept
            done = ((k <= 0) & (p >= 1.0) & (xw >= floor)).to(tl.int32)
            while done == 0:
                # one pass: what ranks above w (x larger, or equal at a lower id), its count
                # and mass, and the best y among it (the next w if w is dropped). Only chunks
                # whose maximum reaches x_w hold any of it; per-lane sums, reduced once.
                visit = _chunk_bits(cm & (xm >= xw), offs)
                count = tl.zeros((CHUNK,), tl.int32)
                mass = tl.zeros((CHUNK,), tl.float32)
                next_y = tl.full((CHUNK,), float("-inf"), tl.float32)
                next_i = tl.full((CHUNK,), V, tl.int32)
                for c in range(num_chunks):
                    if ((visit >> c) & 1) != 0:
                        cols = c * CHUNK + tl.arange(0, CHUNK)
                        inb = cols < V
                        x = _x_block(x_ptr, row, stride_x, cols, V, t)
                        y = tl.load(y_ptr + row * V + cols, mask=inb, other=float("-inf"))
                        above = inb & ((x > xw) | ((x == xw) & (cols < w)))
                        count += above.to(tl.int32)
                        mass += tl.where(above, tl.exp(x - m), 0.0)
                        y = tl.where(y == y, y, float("inf"))
                        take = above & (y > next_y)  # strictly: a lane keeps its first column
                        next_i = tl.where(take, cols, next_i)
                        next_y = tl.where(take, y, next_y)
                n_above = tl.sum(count, axis=0)
                by = tl.max(next_y, axis=0)
                next_w = tl.min(tl.where(next_y == by, next_i, V), axis=0)
                m_above = tl.sum(mass, axis=0)
                p_mass = p * total
                if (lazy != 0) & (n_above < k):
                    # w is in the top-k set, and so are the tokens above it: its mass lies
                    # between theirs + w's and that + w's for each top-k token below w
                    e_w = tl.exp(xw - m)
                    p_mass = p * (m_above + e_w)
                    upper = tl.minimum(total, m_above + (k - n_above).to(tl.float32) * e_w)
                    if (m_above >= p_mass) & (m_above < p * upper):
                        total = _top_k_mass(x_ptr, row, stride_x, V, num_chunks, xm, offs, t,
                                            m, k, CHUNK, SPAN)
                        lazy = 0
                        p_mass = p * total
                kept = ((xw >= floor) & ((k <= 0) | (n_above < k))
                        & ((p >= 1.0) | (m_above < p_mass)))
                # nothing ranks above w: it is the top-1, always kept (this also ends the loop
                # on a row of NaN, where nothing compares)
                if kept | (n_above == 0) | (next_w >= V):
                    done = 1
                else:
                    w = next_w
                    xw = tl.math.div_rn(tl.load(x_ptr + row * stride_x + w).to(tl.float32), t)
        tl.store(out_ptr + row, w.to(tl.int64))


def masked_race_triton(logits: torch.Tensor, seed_words: torch.Tensor, positions: torch.Tensor,
                       temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, pos_offset: int = 0, chunk: int = CHUNK) -> torch.Tensor:
    """logits [R, V] (unit last stride; any float dtype) and per-row [R] seed words (< 0: a
    greedy row, its argmax), positions (+ pos_offset: the position sampled), temperature, top_k
    (<= 0: off), top_p (>= 1: off) and min_p (<= 0: off) -> [R] int64 tokens: the race over
    each row's kept tokens (module docstring). Graph-capturable: shapes only, no host reads.
    chunk: the narrowest chunk (columns a pass-1 program; a power of two)."""
    r, v = logits.shape
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunk = max(chunk, next_pow2(-(-v // 64)))  # at most 64 chunks: the descent's bit masks
    n = -(-v // chunk)
    dev = logits.device
    y = torch.empty((r, v), dtype=torch.float32, device=dev)
    ybest, xmax, zsum = (torch.empty((r, n), dtype=torch.float32, device=dev) for _ in range(3))
    yidx = torch.empty((r, n), dtype=torch.int32, device=dev)
    words, pos, temp = seed_words.contiguous(), positions.contiguous(), temperature.contiguous()
    opts = pdl.launch_options(logits)
    _race_chunks_kernel[(r, n)](logits, y, ybest, yidx, xmax, zsum, words, pos, temp, v,
                                logits.stride(0), n, pos_offset, CHUNK=chunk, num_warps=4, **opts)
    _descent_kernel[(r,)](logits, y, ybest, yidx, xmax, zsum, words, temp, top_k.contiguous(),
                          top_p.contiguous(), min_p.contiguous(), out, v, logits.stride(0), n,
                          CBLOCK=max(16, next_pow2(n)), CHUNK=chunk, SPAN=SPAN,
                          num_warps=DESCENT_WARPS, **opts)
    return out
