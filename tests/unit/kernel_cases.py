"""Random paged-attention batches shared by the Triton kernel tests (GPU and interpreter).

A batch is a list of (q_len, kv_len) pairs: q_len new tokens whose positions end at kv_len - 1,
the kv_len - q_len earlier ones already in the pool. The pool starts as NaN everywhere, so any
read of a slot that was never written (tail of a block, the null block, a table entry past the
sequence) poisons the output and fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from outpace.attention.base import AttentionMetadata
from outpace.attention.torch_ref import TorchRefBackend, store_kv


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    kv_cache: torch.Tensor  # [layers, 2, blocks, block_size, Hkv, D], context already stored
    initial_cache: torch.Tensor  # copy of kv_cache before the step, for the reference
    meta: AttentionMetadata
    layer: int
    num_real_tokens: int  # rows past this are padding tokens (slot -1, in no sequence)


def make_batch(seqs, num_kv_heads, group, head_dim, dtype, device, *, block_size=16,
               pad_seqs=0, pad_tokens=0, max_query_len=None, num_blocks=None, max_blocks=None,
               seed=0) -> Batch:
    """seqs: [(q_len, kv_len)]. Block tables are random permutations (never contiguous).

    num_blocks / max_blocks fix the pool and table shapes (defaults: just enough, plus spares).
    """
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)
    hq = num_kv_heads * group
    need = [(kv + block_size - 1) // block_size for _, kv in seqs]
    # Block 0 is the null block; the last block is a poison block no sequence owns, and every
    # table entry past a sequence's end (and every padded sequence's row) points at it.
    num_blocks = num_blocks or 2 + sum(need) + 2
    max_blocks = max_blocks or max(need + [1]) + 2
    assert num_blocks >= 2 + sum(need) and max_blocks >= max(need + [1])
    ids = (torch.randperm(num_blocks - 2, generator=g) + 1).tolist()
    tables = torch.full((len(seqs) + pad_seqs, max_blocks), num_blocks - 1, dtype=torch.int32)
    slots_ctx, slots_new, qsl, seq_lens = [], [], [0], []
    for s, (q_len, kv_len) in enumerate(seqs):
        assert 0 < q_len <= kv_len
        own = [ids.pop() for _ in range(need[s])]
        tables[s, :need[s]] = torch.tensor(own, dtype=torch.int32)
        slot = [own[p // block_size] * block_size + p % block_size for p in range(kv_len)]
        slots_ctx += slot[:kv_len - q_len]
        slots_new += slot[kv_len - q_len:]
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(kv_len)
    for _ in range(pad_seqs):  # padded sequences: nothing to attend, nothing to write
        qsl.append(qsl[-1])
        seq_lens.append(0)
    n_real = qsl[-1]
    t = n_real + pad_tokens
    layers, layer = 2, 1

    def rnd(*shape):
        return torch.randn(*shape, generator=gd, device=device).to(dtype)

    q, k, v = rnd(t, hq, head_dim), rnd(t, num_kv_heads, head_dim), rnd(t, num_kv_heads, head_dim)
    kv_cache = torch.full((layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
                          float("nan"), dtype=dtype, device=device)
    n_ctx = len(slots_ctx)
    if n_ctx:
        store_kv(kv_cache, layer, rnd(n_ctx, num_kv_heads, head_dim),
                 rnd(n_ctx, num_kv_heads, head_dim), torch.tensor(slots_ctx, device=device))
    slot_mapping = torch.tensor(slots_new + [-1] * pad_tokens, dtype=torch.int64)
    mql = max_query_len if max_query_len is not None else max([q for q, _ in seqs] + [1])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_start_loc_host=qsl, seq_lens_host=seq_lens,
        max_query_len=mql, max_seq_len=max(seq_lens + [1]))
    return Batch(q, k, v, kv_cache, kv_cache.clone(), meta, layer, n_real)


def reference_out(b: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D] fp32, kv_cache after the store, fp32) from the torch reference backend,
    run in fp32 on fp32 copies so it is the oracle for every input dtype."""
    cache = b.initial_cache.float()
    hq, hkv, d = b.q.shape[1], b.k.shape[1], b.q.shape[2]
    ref = TorchRefBackend(cache, hq, hkv, d, scale)
    # The math SDPA kernel: plain fp32 matmuls on CUDA too (no reduced-precision fast path).
    with sdpa_kernel(SDPBackend.MATH):
        out = ref.forward(b.layer, b.q.float(), b.k.float(), b.v.float(), b.meta)
    return out, cache


def tolerance(dtype: torch.dtype) -> dict:
    """assert_close tolerances for a kernel output of `dtype` against an fp32 reference."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    if dtype == torch.float16:
        return dict(atol=2e-3, rtol=2e-3)
    return dict(atol=1e-2, rtol=1e-2)


def check_attention(b: Batch, out: torch.Tensor, scale: float) -> None:
    """Compare a backend's output and pool with the fp32 reference, real rows only."""
    ref_out, ref_cache = reference_out(b, scale)
    n = b.num_real_tokens
    torch.testing.assert_close(out[:n].float(), ref_out[:n], **tolerance(out.dtype))
    # The pool: everything but the null block (the reference parks padded rows there).
    torch.testing.assert_close(b.kv_cache[:, :, 1:].float(),
                               ref_cache[:, :, 1:].to(b.kv_cache.dtype).float(),
                               atol=0, rtol=0, equal_nan=True)


# Batch compositions: (q_len, kv_len) per sequence.
COMPOSITIONS = {
    "prefill": [(37, 37)],
    "chunk": [(40, 61)],
    "decode": [(1, 1), (1, 17), (1, 50), (1, 33)],
    "verify": [(4, 30), (6, 6), (3, 16)],
    "mixed": [(23, 40), (1, 19), (4, 35), (1, 1), (9, 9)],
}
