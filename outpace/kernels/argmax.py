"""Row-wise argmax over logits, in two Triton passes, with the PyTorch reference.

torch.argmax of one [1, 49152] row is a single-block reduction on the GPU, one block walking
the whole row: slow enough to show in a batch-1 decode step (decisions-log.md, "Fewer kernels
per decoder layer on CUDA"). Here pass 1 cuts each row into CHUNK-wide pieces, one program each
(max and its first index), and pass 2 reduces a row's pieces. Ties go to the lowest index, as
torch.argmax documents; rows are compared in their own dtype, so argmax of bf16 logits equals
argmax of the same values in fp32 (no conversion kernel is needed). NaN counts as the maximum,
as in torch (whose index then may differ from ours in a row holding both NaN and +inf); the
result is always in range.

`offsets` (optional, [V] integers) is added to the winning index in pass 2: EAGLE-3's d2t maps a
draft-vocabulary id to the target's (`id + d2t[id]`) without two more kernels (index, add).
`also` (up to two [R] int64 views, any stride) receive the result too: the fused step's draft
loop writes each draft straight into its output and carry columns, without a stack and two
copies after the loop.

`race` (optional, a Race of [R] tensors) makes it the sampling race of sample/gumbel.py: a row
whose seed word is >= 0 takes the argmax of x / temperature + Gumbel noise hashed from (its
key, column), the key hashed from (seed word, position) (race_key); all of it in pass 1 as the
row is read, where the reference makes ~30 elementwise tensors (a chain of small kernels for
the keys alone). A row whose word is < 0 (greedy) takes the plain argmax. The
division is IEEE (div_rn), as torch's, so x / t is the value process_logits computes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from outpace.kernels import next_pow2, pdl, use_triton

try:  # guarded: CPU machines may not have triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

CHUNK = 2048  # columns per pass-1 program: 24 programs for a 49152-entry row


class Race(NamedTuple):
    """A row argmax as the sampling race: per row the seed word (< 0: greedy, no noise), the
    position of the token sampled (plus pos_offset), and optionally a temperature to divide by
    (1.0 in greedy rows)."""
    words: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] integers
    temperature: Optional[torch.Tensor] = None  # [R] float32
    pos_offset: int = 0

M32 = 0xFFFFFFFF
# Odd multipliers below 2^31, so a 32-bit word times one fits in int64 (the reference's
# tensors); the kernel multiplies uint32 words, wrapping, with the same result.
_C1, _C2 = 0x7FEB352D, 0x5BD1E995
GOLDEN = 0x61C88647  # 2^32 / phi, odd, below 2^31: spreads consecutive ids


def hash32(x):
    """A 32-bit mix (xor-shift-multiply rounds) of values in [0, 2^32): Python ints or int64
    tensors, with the same result (the kernel's _hash32 on uint32 words too)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & M32
    x = x ^ (x >> 15)
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def race_key(words, positions):
    """Seed words and positions -> race keys in [0, 2^32): Python ints or int64 tensors."""
    return hash32(words ^ hash32(positions & M32))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R] keys in [0, 2^32) -> [R, vocab] float32 Gumbel noise -log(-log u), u from the hash
    of (key, id) with 23 random bits, (x + 0.5) / 2^23: never 0 or 1."""
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    bits = hash32(keys.to(torch.int64).unsqueeze(1) ^ ((ids * GOLDEN) & M32))
    u = ((bits >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)
    return -torch.log(-torch.log(u))


def argmax_ref(x: torch.Tensor, offsets: Optional[torch.Tensor] = None,
               race: Optional[Race] = None) -> torch.Tensor:
    """x [R, V] -> [R] int64, first index of each row's maximum (plus offsets[index], [V]);
    with `race`, of x / temperature + race noise in the rows whose seed word is >= 0."""
    if race is not None:
        x = x.float()
        if race.temperature is not None:
            x = x / race.temperature.float().unsqueeze(1)
        words = race.words.to(torch.int64)
        keys = race_key(words.clamp(min=0), race.positions.to(torch.int64) + race.pos_offset)
        noise = gumbel_noise(keys, x.shape[-1])
        x = x + noise.masked_fill_((words < 0).unsqueeze(1), 0.0)
    idx = x.argmax(dim=-1)
    return idx if offsets is None else idx + offsets[idx]


if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def _hash32(x):
        # hash32 on uint32 words: the products wrap modulo 2^32, as the reference's masks
        # make them
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x5BD1E995
        return x ^ (x >> 16)

    @triton.jit
    def _race_noise(key, cols):
        # gumbel_noise for one row: -log(-log u), u from the hash of (key, column)
        bits = _hash32(key ^ (cols.to(tl.uint32) * 0x61C88647))
        u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
        return -tl.log(-tl.log(u))

    @triton.jit
    def _argmax_chunks_kernel(x_ptr, vals_ptr, idx_ptr, words_ptr, pos_ptr, temp_ptr, V,
                              stride_x, num_chunks, pos_offset, CHUNK: tl.constexpr,
                              RACE: tl.constexpr, TEMP: tl.constexpr, USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf"))
        x = x.to(tl.float32)  # exact for bf16/fp16; order is unchanged
        if RACE:
            if TEMP:
                x = tl.math.div_rn(x, tl.load(temp_ptr + row).to(tl.float32))
            word = tl.load(words_ptr + row)
            if word >= 0:
                pos = (tl.load(pos_ptr + row).to(tl.int64) + pos_offset).to(tl.uint32)
                key = _hash32(word.to(tl.uint32) ^ _hash32(pos))
                x = x + _race_noise(key, cols)
        # NaN counts as the largest value, as in torch.argmax: a row of garbage (a dropped row
        # of a chained step can read never-written memory) still yields an index in range
        x = tl.where(x == x, x, float("inf"))
        m = tl.max(x, axis=0)
        # first column holding the maximum: the smallest index among the equal ones
        first = tl.min(tl.where(x == m, cols, V), axis=0)
        tl.store(vals_ptr + row * num_chunks + c, m)
        tl.store(idx_ptr + row * num_chunks + c, first)

    @triton.jit
    def _argmax_reduce_kernel(vals_ptr, idx_ptr, off_ptr, out_ptr, also1_ptr, also2_ptr,
                              stride_a1, stride_a2, num_chunks, V,
                              HAS_OFFSETS: tl.constexpr, NUM_ALSO: tl.constexpr,
                              BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < num_chunks
        v = tl.load(vals_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
        i = tl.load(idx_ptr + row * num_chunks + offs, mask=mask, other=V)
        m = tl.max(v, axis=0)
        # chunks are in column order, so the smallest index among the maximal chunks is the
        # row's first maximum
        first = tl.min(tl.where(v == m, i, V), axis=0)
        first = tl.minimum(first, V - 1).to(tl.int64)  # always in range
        if HAS_OFFSETS:
            first += tl.load(off_ptr + first).to(tl.int64)
        tl.store(out_ptr + row, first)
        if NUM_ALSO >= 1:
            tl.store(also1_ptr + row * stride_a1, first)
        if NUM_ALSO >= 2:
            tl.store(also2_ptr + row * stride_a2, first)


def argmax_triton(x: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                  also: tuple = (), race: Optional[Race] = None) -> torch.Tensor:
    """x [R, V] (unit last stride) -> [R] int64, plus offsets[index] when given ([V] integers,
    unit stride), also written into each of `also` (at most two [R] int64 views); `race`: the
    sampling race (module docstring). Graph-capturable: shapes only."""
    r, v = x.shape
    _check_also(also, r)
    out = torch.empty(r, dtype=torch.int64, device=x.device)
    if r == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = -(-v // CHUNK)
    vals = torch.empty((r, n), dtype=torch.float32, device=x.device)
    idx = torch.empty((r, n), dtype=torch.int32, device=x.device)
    opts = pdl.launch_options(x)
    words = pos = temp = idx  # unread without a race
    if race is not None:
        words, pos = race.words.contiguous(), race.positions.contiguous()
        if race.temperature is not None:
            temp = race.temperature.contiguous()
    _argmax_chunks_kernel[(r, n)](x, vals, idx, words, pos, temp, v, x.stride(0), n,
                                  race.pos_offset if race is not None else 0, CHUNK=CHUNK,
                                  RACE=race is not None,
                                  TEMP=race is not None and race.temperature is not None,
                                  num_warps=4, **opts)
    if offsets is not None:
        offsets = offsets.contiguous()
    a1, a2 = (tuple(also) + (out, out))[:2]
    _argmax_reduce_kernel[(r,)](vals, idx, offsets if offsets is not None else idx, out, a1, a2,
                                a1.stride(0), a2.stride(0), n, v,
                                HAS_OFFSETS=offsets is not None, NUM_ALSO=len(also),
                                BLOCK=max(16, next_pow2(n)), num_warps=1, **opts)
    return out


def _check_also(also: tuple, rows: int) -> None:
    if len(also) > 2:
        raise ValueError(f"argmax writes at most two extra outputs, got {len(also)}")
    for t in also:
        if t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] != rows:
            raise ValueError(f"an extra argmax output must be a [{rows}] int64 view, got "
                             f"{tuple(t.shape)} {t.dtype}")


def argmax_rows(x: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                also: tuple = (), race: Optional[Race] = None) -> torch.Tensor:
    """x [..., V] -> [...] int64 first index of the maximum, plus offsets[index] when offsets
    ([V] integers) is given; Triton on CUDA, torch otherwise. With `also` (x [R, V] only):
    the result is written into those [R] int64 views too. With `race` (x [R, V] only): the
    sampling race (module docstring)."""
    if (also or race is not None) and x.dim() != 2:
        raise ValueError("argmax_rows(also=..., race=...) takes [R, V] rows")
    if not use_triton(x) or x.shape[-1] >= 2 ** 31 - 1:
        out = argmax_ref(x, offsets, race)
        if also:
            _check_also(also, x.shape[0])
            for t in also:
                t.copy_(out)
        return out
    lead = x.shape[:-1]
    return argmax_triton(x.reshape(-1, x.shape[-1]), offsets, also, race).view(lead)
