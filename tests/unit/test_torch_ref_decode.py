"""The CPU planned path of the reference backend (TorchRefBackend.decode, one SDPA for all
sequences of a decode, verify or draft step) against its general per-sequence path
(attend_each), on fresh random inputs.

Both run on copies of the same pool; outputs must agree to fp32 rounding and the pools must end
up identical. Pools from kernel_cases.make_batch start as NaN everywhere nothing was written
(block tails, table entries past a sequence, the null block), so a read of an unowned slot that
leaks into the output fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from outpace.attention.base import AttentionMetadata
from outpace.attention.torch_ref import TorchRefBackend, make_decode_plan
from tests.unit.kernel_cases import make_batch

SCALE = 0.125


def run_both(q, k, v, kv_cache, meta, layer, hkv):
    """(decode out, decode pool, general out, general pool); asserts the decode path ran."""
    hq, d = q.shape[1], q.shape[2]
    fast = TorchRefBackend(kv_cache.clone(), hq, hkv, d, SCALE)
    general = TorchRefBackend(kv_cache.clone(), hq, hkv, d, SCALE)
    assert make_decode_plan(meta, fast.block_size) is not None
    out_fast = fast.forward(layer, q, k, v, meta)
    out_general = general.attend_each(layer, q, k, v, meta)
    return out_fast, fast.kv_cache, out_general, general.kv_cache


def check(out_fast, pool_fast, out_general, pool_general):
    assert torch.isfinite(out_fast).all()
    torch.testing.assert_close(out_fast, out_general, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_fast, pool_general, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("kv_lens", [[1], [37], [16, 16, 16], [1, 17, 16, 40, 5], [33, 64]])
@pytest.mark.parametrize("hkv,group,head_dim", [(3, 3, 64), (2, 1, 32), (1, 4, 16)])
def test_decode_matches_general_path_gathered(kv_lens, hkv, group, head_dim):
    """Random (never contiguous) block tables, GQA and MHA, equal and unequal lengths."""
    b = make_batch([(1, n) for n in kv_lens], hkv, group, head_dim, torch.float32, "cpu",
                   seed=sum(kv_lens) + group)
    check(*run_both(b.q, b.k, b.v, b.kv_cache, b.meta, b.layer, hkv))


def test_decode_padded_slot_writes_null_block():
    """A row with slot -1 (padding) writes the null block only, like the general path."""
    b = make_batch([(1, 20), (1, 9), (1, 31)], 3, 3, 64, torch.float32, "cpu", seed=7)
    b.meta.slot_mapping[1] = -1
    out_fast, pool_fast, out_general, pool_general = run_both(
        b.q, b.k, b.v, b.kv_cache, b.meta, b.layer, 3)
    torch.testing.assert_close(pool_fast, pool_general, atol=0, rtol=0, equal_nan=True)
    rows = [0, 2]  # row 1 attends over a KV entry it didn't write; compare the others
    torch.testing.assert_close(out_fast[rows], out_general[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_len", [1, 16, 17, 100])
@pytest.mark.parametrize("contiguous", [True, False])
def test_decode_single_sequence_view_or_gather(kv_len, contiguous):
    """One sequence: consecutive blocks are read as a view of the pool, others gathered."""
    g = torch.Generator().manual_seed(kv_len)
    hkv, group, d, bs, num_blocks = 3, 3, 64, 16, 24
    nb = (kv_len + bs - 1) // bs
    blocks = list(range(5, 5 + nb)) if contiguous else [5 + 2 * i for i in range(nb)]
    kv_cache = torch.randn(2, 2, num_blocks, bs, hkv, d, generator=g)
    table = torch.zeros(1, 10, dtype=torch.int32)
    table[0, :nb] = torch.tensor(blocks, dtype=torch.int32)
    p = kv_len - 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([blocks[p // bs] * bs + p % bs]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([kv_len], dtype=torch.int32), block_tables=table,
        query_start_loc_host=[0, 1], seq_lens_host=[kv_len], max_query_len=1,
        max_seq_len=kv_len)
    plan = make_decode_plan(meta, bs)
    assert (plan.kv_start is not None) == (contiguous or nb == 1)
    # q, k rows as the model passes them: strided views of one fused tensor.
    qkv = torch.randn(1, hkv * (group + 2), d, generator=g)
    q, k, v = qkv[:, :hkv * group], qkv[:, hkv * group:-hkv], qkv[:, -hkv:]
    check(*run_both(q, k, v, kv_cache, meta, 1, hkv))


def test_no_plan_for_prefill_rows_or_padded_sequences():
    b = make_batch([(1, 10), (17, 30)], 3, 3, 64, torch.float32, "cpu")
    assert make_decode_plan(b.meta, 16) is None
    b = make_batch([(1, 10)], 3, 3, 64, torch.float32, "cpu", pad_seqs=1)
    assert make_decode_plan(b.meta, 16) is None


@pytest.mark.parametrize("seqs", [
    [(3, 12), (3, 40), (3, 17)],  # a verify step at batch 3 (k = 2)
    [(4, 20), (4, 20)],  # equal lengths: no padding
    [(1, 10), (3, 12), (5, 30), (2, 2), (16, 33)],  # unequal query counts and lengths
    [(2, 5), (1, 1)],
], ids=["verify", "equal", "unequal", "short"])
@pytest.mark.parametrize("hkv,group,head_dim", [(3, 3, 64), (1, 4, 16)])
def test_batched_few_query_steps_match_general_path(seqs, hkv, group, head_dim):
    """Several sequences of 1..16 query tokens each (a verify step at batch > 1, a draft
    head's pass, decodes beside verifies) take the planned path: each sequence causal over its
    own keys, padded keys and queries leaving no trace in the outputs or the pool."""
    b = make_batch(seqs, hkv, group, head_dim, torch.float32, "cpu",
                   seed=sum(q * 7 + n for q, n in seqs) + group)
    plan = make_decode_plan(b.meta, 16, torch.float32, group)
    assert plan is not None and plan.q_len == max(q for q, _ in seqs)
    assert (plan.q_rows is None) == (len({q for q, _ in seqs}) == 1)
    assert (plan.pad_rows is None) == (len({n for _, n in seqs}) == 1)
    check(*run_both(b.q, b.k, b.v, b.kv_cache, b.meta, b.layer, hkv))


def test_batched_few_query_bfloat16():
    b = make_batch([(3, 9), (1, 21), (2, 16)], 2, 2, 32, torch.bfloat16, "cpu", seed=5)
    out_fast, pool_fast, out_general, pool_general = run_both(
        b.q, b.k, b.v, b.kv_cache, b.meta, b.layer, 2)
    assert torch.isfinite(out_fast.float()).all()
    torch.testing.assert_close(out_fast.float(), out_general.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool_fast, pool_general, atol=0, rtol=0, equal_nan=True)


def test_decode_bfloat16_unequal_lengths():
    """The padding mask takes the queries' dtype."""
    b = make_batch([(1, 5), (1, 21)], 2, 2, 32, torch.bfloat16, "cpu", seed=3)
    assert make_decode_plan(b.meta, 16, torch.bfloat16, 2).mask.dtype == torch.bfloat16
    out_fast, pool_fast, out_general, pool_general = run_both(
        b.q, b.k, b.v, b.kv_cache, b.meta, b.layer, 2)
    assert torch.isfinite(out_fast.float()).all()
    torch.testing.assert_close(out_fast.float(), out_general.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool_fast, pool_general, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("q_len,kv_len", [(2, 2), (2, 40), (3, 17), (5, 64), (16, 100)])
@pytest.mark.parametrize("hkv,group,head_dim", [(3, 3, 64), (1, 4, 16)])
def test_few_query_single_sequence_matches_general_path(q_len, kv_len, hkv, group, head_dim):
    """A batch-1 verify block (2..16 query tokens of one sequence) takes the planned path:
    causal within the block, the same outputs and KV writes as the general path."""
    b = make_batch([(q_len, kv_len)], hkv, group, head_dim, torch.float32, "cpu",
                   seed=q_len * 100 + kv_len + group)
    plan = make_decode_plan(b.meta, 16, torch.float32, group)
    assert plan is not None and plan.q_len == q_len
    check(*run_both(b.q, b.k, b.v, b.kv_cache, b.meta, b.layer, hkv))


@pytest.mark.parametrize("contiguous", [True, False])
def test_few_query_reads_consecutive_blocks_in_place(contiguous):
    g = torch.Generator().manual_seed(11)
    hkv, group, d, bs, num_blocks, kv_len, n = 3, 3, 64, 16, 24, 40, 4
    nb = (kv_len + bs - 1) // bs
    blocks = list(range(5, 5 + nb)) if contiguous else [5 + 2 * i for i in range(nb)]
    kv_cache = torch.randn(2, 2, num_blocks, bs, hkv, d, generator=g)
    table = torch.zeros(1, 10, dtype=torch.int32)
    table[0, :nb] = torch.tensor(blocks, dtype=torch.int32)
    slots = [blocks[p // bs] * bs + p % bs for p in range(kv_len - n, kv_len)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([kv_len], dtype=torch.int32), block_tables=table,
        query_start_loc_host=[0, n], seq_lens_host=[kv_len], max_query_len=n,
        max_seq_len=kv_len)
    plan = make_decode_plan(meta, bs, torch.float32, group)
    assert plan.q_len == n and (plan.kv_start is not None) == contiguous
    qkv = torch.randn(n, hkv * (group + 2), d, generator=g)
    q, k, v = qkv[:, :hkv * group], qkv[:, hkv * group:-hkv], qkv[:, -hkv:]
    check(*run_both(q, k, v, kv_cache, meta, 1, hkv))


def test_no_plan_past_the_few_query_bound():
    b = make_batch([(17, 30)], 3, 3, 64, torch.float32, "cpu")
    assert make_decode_plan(b.meta, 16) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_no_plan_for_lengths_too_unequal_to_pad(threads):
    """A long context beside short ones: padding every sequence to it would cost more than
    attending each over its own keys (the general path, whose outputs are checked in
    test_torch_ref_prefill.py); on several threads the bound is higher."""
    from outpace.attention.torch_ref import padding_per_seq_max
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        most = padding_per_seq_max()
        assert most == (128 if threads == 1 else 512)
        assert make_decode_plan(make_batch([(1, 40), (1, 2500)], 3, 3, 64, torch.float32,
                                           "cpu").meta, 16) is None
        near = [(1, 1100), (1, 1100 - 2 * most)]  # on average `most` padded keys a sequence
        assert make_decode_plan(make_batch(near, 3, 3, 64, torch.float32, "cpu").meta, 16)
        far = [(1, 1100), (1, 1100 - 2 * most - 1)]
        assert make_decode_plan(make_batch(far, 3, 3, 64, torch.float32, "cpu").meta,
                                16) is None
    finally:
        torch.set_num_threads(before)


def test_no_plan_where_one_sequences_queries_would_pad_every_other():
    """Up to 16 queries beside one-query decodes over long keys: every sequence would attend
    16 query rows, so the padded query rows count against the bound too."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lopsided = [(16, 3000)] + [(1, 3000)] * 7
        assert make_decode_plan(make_batch(lopsided, 3, 3, 64, torch.float32, "cpu").meta,
                                16) is None
        chunk = [(16, 16)] + [(1, 1000)] * 7
        assert make_decode_plan(make_batch(chunk, 3, 3, 64, torch.float32, "cpu").meta,
                                16) is None
        mild = [(4, 300)] + [(1, 300)] * 7
        assert make_decode_plan(make_batch(mild, 3, 3, 64, torch.float32, "cpu").meta, 16)
    finally:
        torch.set_num_threads(before)


def test_every_layer_of_a_planned_step_reads_its_own_keys():
    """The gather's buffer is made at a step's first layer and reused: each layer's output
    is still its own keys' (two layers of different K/V, then the first again)."""
    b = make_batch([(3, 40), (1, 33), (2, 18)], 3, 3, 64, torch.float32, "cpu", seed=9)
    pool = torch.cat([b.kv_cache, torch.randn_like(b.kv_cache)])  # layers 1 and 3 differ
    pool[2:] = torch.where(b.kv_cache.isnan(), b.kv_cache, pool[2:])  # the same NaN slots
    fast = TorchRefBackend(pool.clone(), 9, 3, 64, SCALE)
    general = TorchRefBackend(pool.clone(), 9, 3, 64, SCALE)
    for layer in (b.layer, b.layer + 2, b.layer):
        out_fast = fast.forward(layer, b.q, b.k, b.v, b.meta)
        out_general = general.attend_each(layer, b.q, b.k, b.v, b.meta)
        check(out_fast, fast.kv_cache, out_general, general.kv_cache)
    assert fast._plan is not None and fast._plan.kv_buf is not None


def test_padding_tokens_fall_back_to_the_general_path():
    """A step with padding rows past its sequences' tokens (more query rows than the plan's
    tokens) attends on the general path: the real rows and the pool as there."""
    b = make_batch([(2, 20), (1, 9)], 3, 3, 64, torch.float32, "cpu", seed=4, pad_tokens=2)
    fast = TorchRefBackend(b.kv_cache.clone(), 9, 3, 64, SCALE)
    general = TorchRefBackend(b.kv_cache.clone(), 9, 3, 64, SCALE)
    out_fast = fast.forward(b.layer, b.q, b.k, b.v, b.meta)
    out_general = general.attend_each(b.layer, b.q, b.k, b.v, b.meta)
    real = b.num_real_tokens
    torch.testing.assert_close(out_fast[:real], out_general[:real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.kv_cache, general.kv_cache, atol=0, rtol=0,
                               equal_nan=True)
