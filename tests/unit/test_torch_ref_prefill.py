"""The CPU prefill path of the reference backend (attend_sequence_cpu: the flash kernel, the
prefix and the chunk's own causal square split past a bound) against the oracle's
(attend_sequence_oracle: one SDPA with an explicit causal mask), on fresh random inputs.

Sizes straddle every branch: one query, a masked chunk below the split bound, the split with
and without a prefix, GQA and MHA. Through the backend, pools from kernel_cases.make_batch are
NaN wherever nothing was written, so a read past a sequence's keys fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from outpace.attention.base import AttentionMetadata
from outpace.attention.torch_ref import (_SPLIT_MIN_QUERIES, TorchRefBackend,
                                         attend_sequence_cpu, attend_sequence_oracle, gather_kv)
from tests.unit.kernel_cases import make_batch

SCALE = 0.125
SPLIT = _SPLIT_MIN_QUERIES


def random_sequence(n, kv_len, hkv, group, d, seed, dtype=torch.float32):
    """q [n, Hq, D] as the model passes it (a strided view of a fused qkv tensor), k/v
    [Hkv, L, D] as the backend gathers them (transposed views)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, hkv * (group + 2), d, generator=g).to(dtype)
    q = qkv[:, :hkv * group]
    k = torch.randn(kv_len, hkv, d, generator=g).to(dtype).transpose(0, 1)
    v = torch.randn(kv_len, hkv, d, generator=g).to(dtype).transpose(0, 1)
    return q, k, v


@pytest.mark.parametrize("n,kv_len", [(1, 1), (1, 37), (2, 2), (17, 17), (17, 300),
                                      (SPLIT - 1, SPLIT + 40), (SPLIT, SPLIT),
                                      (SPLIT, 3 * SPLIT + 5), (SPLIT + 77, 2 * SPLIT + 100)])
@pytest.mark.parametrize("hkv,group,head_dim", [(3, 3, 64), (2, 1, 32), (1, 4, 16)])
def test_cpu_path_matches_oracle(n, kv_len, hkv, group, head_dim):
    q, k, v = random_sequence(n, kv_len, hkv, group, head_dim, seed=n * 1000 + kv_len + group)
    out = attend_sequence_cpu(q, k, v, SCALE)
    assert out.shape == (n, hkv * group, head_dim) and torch.isfinite(out).all()
    torch.testing.assert_close(out, attend_sequence_oracle(q, k, v, SCALE),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,kv_len", [(40, 100), (SPLIT + 3, SPLIT + 60)])
def test_cpu_path_bfloat16(n, kv_len):
    """bf16 inputs (the split merges in fp32): close to the fp32 oracle."""
    q, k, v = random_sequence(n, kv_len, 3, 3, 64, seed=5, dtype=torch.bfloat16)
    out = attend_sequence_cpu(q, k, v, SCALE)
    assert out.dtype in (torch.bfloat16, torch.float32)
    ref = attend_sequence_oracle(q.float(), k.float(), v.float(), SCALE)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_backend_general_path_matches_oracle():
    """attend_each on the CPU over a batch mixing a decode, a short chunk and split chunks
    (random, never contiguous block tables): outputs equal to the oracle sequence by
    sequence, and the stored K/V are the step's."""
    seqs = [(1, 40), (20, 70), (SPLIT, SPLIT), (SPLIT + 9, SPLIT + 150), (3, 3)]
    hkv, group, d = 3, 3, 64
    b = make_batch(seqs, hkv, group, d, torch.float32, "cpu", seed=3)
    backend = TorchRefBackend(b.kv_cache, hkv * group, hkv, d, SCALE)
    out = backend.attend_each(b.layer, b.q, b.k, b.v, b.meta)
    assert torch.isfinite(out).all()
    qsl = b.meta.query_start_loc_host
    for s, (n, kv_len) in enumerate(seqs):
        ks, vs = gather_kv(backend.kv_cache, b.layer, b.meta.block_tables[s], kv_len)
        torch.testing.assert_close(ks[kv_len - n:], b.k[qsl[s]:qsl[s + 1]], atol=0, rtol=0)
        ref = attend_sequence_oracle(b.q[qsl[s]:qsl[s + 1]], ks.transpose(0, 1),
                                     vs.transpose(0, 1), SCALE)
        torch.testing.assert_close(out[qsl[s]:qsl[s + 1]], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("contiguous", [True, False])
def test_backend_reads_consecutive_blocks_in_place(contiguous):
    """A sequence whose blocks are consecutive is read as a view of the pool (no gather):
    the same outputs. The pool is NaN past every sequence's last slot, so reading one slot
    too many fails."""
    g = torch.Generator().manual_seed(21)
    hkv, group, d, bs, num_blocks = 3, 3, 64, 16, 80
    seqs = [(1, 40), (SPLIT + 5, SPLIT + 70), (30, 30)]
    kv_cache = torch.full((2, 2, num_blocks, bs, hkv, d), float("nan"))
    table = torch.zeros(len(seqs), 40, dtype=torch.int32)
    slots, qsl, first = [], [0], 1
    for s, (n, kv_len) in enumerate(seqs):
        nb = (kv_len + bs - 1) // bs
        blocks = list(range(first, first + nb)) if contiguous else \
            [first + 2 * i for i in range(nb)][::-1]
        first += 2 * nb + 1
        table[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        own = [blocks[p // bs] * bs + p % bs for p in range(kv_len)]
        pool = kv_cache[1].flatten(1, 2)
        pool[:, own[:kv_len - n]] = torch.randn(2, kv_len - n, hkv, d, generator=g)
        slots += own[kv_len - n:]
        qsl.append(qsl[-1] + n)
    t = qsl[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([kv for _, kv in seqs], dtype=torch.int32), block_tables=table,
        query_start_loc_host=qsl, seq_lens_host=[kv for _, kv in seqs],
        max_query_len=max(n for n, _ in seqs), max_seq_len=max(kv for _, kv in seqs))
    q = torch.randn(t, hkv * group, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    backend = TorchRefBackend(kv_cache, hkv * group, hkv, d, SCALE)
    out = backend.attend_each(1, q, k, v, meta)
    assert [r is not None for r in backend._kv_runs(meta, meta.seq_lens_host)] == \
        [contiguous] * len(seqs)
    assert torch.isfinite(out).all()
    for s, (n, kv_len) in enumerate(seqs):
        ks, vs = gather_kv(kv_cache, 1, table[s], kv_len)
        ref = attend_sequence_oracle(q[qsl[s]:qsl[s + 1]], ks.transpose(0, 1),
                                     vs.transpose(0, 1), SCALE)
        torch.testing.assert_close(out[qsl[s]:qsl[s + 1]], ref, atol=1e-5, rtol=1e-5)


def test_a_steps_masks_are_made_once_and_per_shape():
    """The general path makes each (queries, keys) mask once a step and every layer reuses it:
    chunks with the same query count over different lengths get masks of their own, both
    layers of a step agree with the oracle, and a new step's metadata starts afresh."""
    hkv, group, d = 3, 3, 64
    backend = None
    for step, seqs in enumerate([[(20, 40), (20, 90), (20, 40), (17, 60)],
                                 [(20, 41), (5, 90)]]):
        b = make_batch(seqs, hkv, group, d, torch.float32, "cpu", seed=11 + step)
        pool = torch.cat([b.kv_cache, b.kv_cache])  # layers 1 and 3 hold the same K/V
        if backend is None:
            backend = TorchRefBackend(pool, hkv * group, hkv, d, SCALE)
        backend.kv_cache = pool
        qsl = b.meta.query_start_loc_host
        for layer in (b.layer, b.layer + 2):
            out = backend.attend_each(layer, b.q, b.k, b.v, b.meta)
            assert torch.isfinite(out).all()
            for s, (n, kv_len) in enumerate(seqs):
                ks, vs = gather_kv(pool, layer, b.meta.block_tables[s], kv_len)
                ref = attend_sequence_oracle(b.q[qsl[s]:qsl[s + 1]], ks.transpose(0, 1),
                                             vs.transpose(0, 1), SCALE)
                torch.testing.assert_close(out[qsl[s]:qsl[s + 1]], ref, atol=1e-5, rtol=1e-5)
        assert sorted(backend._masks) == sorted({(n, kv) for n, kv in seqs})
