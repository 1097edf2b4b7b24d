"""KV cache manager: prefix hits, all-or-nothing allocation, lookahead, caching; sizing."""

import dataclasses
import logging

import pytest
import torch

from outpace.config import CacheConfig
from outpace.errors import ConfigError
from outpace.kvcache.manager import KVCacheManager
from outpace.kvcache.prefix_cache import hash_blocks
from outpace.kvcache.sizing import kv_bytes_per_block, num_kv_blocks
from outpace.model_config import ModelConfig
from outpace.types import Request, SamplingParams

BS = 4


def req(rid, prompt, out=()):
    r = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams())
    r.output_token_ids = list(out)
    return r


def make(num_blocks=9, caching=True, max_model_len=64, **kw):
    return KVCacheManager(CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks,
                          max_model_len, **kw)


def run_prefill(kv, r):
    """Admit r, compute its whole sequence, commit it (what the scheduler + runner do)."""
    r.num_computed_tokens = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
    r.num_computed_tokens = r.num_tokens
    kv.cache_committed(r, r.num_computed_tokens)
    return kv.block_ids(r.request_id)


def assert_all_free(kv):
    assert kv.num_free_blocks == kv.num_blocks and kv.num_used_blocks == 0 and kv.usage == 0.0


def test_prefix_hit_attaches_same_blocks_and_counts_tokens():
    kv = make()
    a = req("a", range(10))  # 2 full blocks + 2 tokens
    blocks_a = run_prefill(kv, a)
    assert len(blocks_a) == 3
    b = req("b", list(range(8)) + [99, 98, 97])  # shares the first 2 blocks
    assert kv.get_computed_blocks(b) == 8
    assert kv.block_ids("b") == blocks_a[:2]
    assert kv.pool.ref_count(blocks_a[0]) == 2
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 3)
    assert kv.block_ids("b")[2] != blocks_a[2]
    assert kv.stats.num_hit_tokens == 8 and kv.stats.num_query_tokens == 21
    assert kv.stats.num_queries == 2 and kv.prefix_cache_hit_tokens == 8
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)
    # After both left, the prefix is still findable (cached free blocks).
    c = req("c", list(range(8)) + [5])
    assert kv.get_computed_blocks(c) == 8 and kv.block_ids("c") == blocks_a[:2]
    kv.free(c)
    assert_all_free(kv)


def test_failed_admission_is_not_counted_and_gives_blocks_back():
    kv = make(num_blocks=6)  # 5 usable
    a = req("a", range(9))
    blocks_a = run_prefill(kv, a)  # 3 blocks, 2 hashed
    kv.free(a)
    before = kv.stats.as_dict()
    big = req("big", list(range(8)) + [60 + i for i in range(20)])  # 7 blocks > 5
    big.num_computed_tokens = kv.get_computed_blocks(big)
    assert big.num_computed_tokens == 8 and kv.num_free_blocks == 3  # 2 cached blocks touched
    assert not kv.allocate_slots(big, big.num_tokens - 8)
    kv.free(big)
    assert kv.stats.as_dict() == before and kv.num_free_blocks == 5
    b = req("b", list(range(8)) + [1, 2])
    assert kv.get_computed_blocks(b) == 8 and kv.block_ids("b") == blocks_a[:2]
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 2)
    assert kv.stats.num_queries == before["num_queries"] + 1
    assert kv.stats.num_hit_tokens == before["num_hit_tokens"] + 8
    kv.free(b)
    assert_all_free(kv)


def test_hit_never_covers_the_last_token_and_rounds_down():
    kv = make()
    a = req("a", range(8))  # exactly 2 blocks
    run_prefill(kv, a)
    same = req("same", range(8))
    # The last token must be computed to sample from it: only 1 block (4 tokens) is served.
    assert kv.get_computed_blocks(same) == 4
    kv.free(same)
    partial = req("p", list(range(6)) + [50, 51, 52])  # diverges inside block 1
    assert kv.get_computed_blocks(partial) == 4
    kv.free(partial)
    miss = req("m", [100] + list(range(1, 12)))
    assert kv.get_computed_blocks(miss) == 0 and kv.block_ids("m") == []
    kv.free(miss)
    kv.free(a)
    assert_all_free(kv)


def test_trim_last_matched_block_for_draft_plane():
    kv = make(trim_last_matched_block=True)
    a = req("a", range(13))
    blocks_a = run_prefill(kv, a)
    b = req("b", range(13))
    assert kv.get_computed_blocks(b) == 8  # 3 matchable blocks, the last one recomputed
    assert kv.block_ids("b") == blocks_a[:2]
    kv.free(b)
    kv.free(a)
    assert_all_free(kv)


def test_caching_disabled():
    kv = make(caching=False)
    a = req("a", range(10))
    run_prefill(kv, a)
    b = req("b", range(10))
    assert kv.get_computed_blocks(b) == 0
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_cached_blocks == 0
    assert_all_free(kv)


def test_allocate_is_all_or_nothing_and_evicts_cached_first():
    kv = make(num_blocks=5)  # 4 usable
    a = req("a", range(8))
    blocks_a = run_prefill(kv, a)  # 2 blocks, both hashed
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2
    b = req("b", [50 + i for i in range(20)])  # needs 5 blocks > 4
    assert not kv.allocate_slots(b, 20)
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2
    c = req("c", [70 + i for i in range(9)])  # 3 blocks: 2 empty + evicts 1 cached (LRU)
    assert kv.allocate_slots(c, 9)
    assert kv.pool.num_cached_blocks == 1
    # The tail block of a's prefix is evicted first, its head survives.
    hs = hash_blocks(list(range(8)), BS)
    assert kv.pool.lookup(hs[1]) is None and kv.pool.lookup(hs[0]) == blocks_a[0]
    d = req("d", range(8))
    assert kv.get_computed_blocks(d) == 4 and kv.block_ids("d") == blocks_a[:1]
    kv.free(d)
    kv.free(c)
    kv.free(b)
    assert_all_free(kv)


def test_allocate_grows_incrementally_and_lookahead_is_capped():
    kv = make(num_blocks=20, max_model_len=20)
    r = req("r", range(5))
    assert kv.allocate_slots(r, 5, num_lookahead_tokens=3)  # covers 8 -> 2 blocks
    assert len(kv.block_ids("r")) == 2
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 1)  # 6 tokens: still 2 blocks
    assert len(kv.block_ids("r")) == 2
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 4, num_lookahead_tokens=3)  # 10 + 3 = 13 -> 4 blocks
    assert len(kv.block_ids("r")) == 4
    r.num_computed_tokens = 17
    assert kv.allocate_slots(r, 2, num_lookahead_tokens=8)  # 19 + 8, capped at 20 -> 5 blocks
    assert len(kv.block_ids("r")) == 5 == kv.max_blocks_per_request
    kv.free(r)
    assert_all_free(kv)


def test_can_allocate_all_counts_every_request_together():
    """The chain's reservation (Scheduler.reserve_chained) asks for several requests at once:
    each one alone may fit while all of them together don't."""
    kv = make(num_blocks=9)  # block 0 is the null block: 8 usable
    a, b = req("a", range(6)), req("b", range(100, 106))
    for r in (a, b):
        run_prefill(kv, r)  # 2 blocks each: 4 left
    assert kv.num_free_blocks == 4
    # 6 tokens + 6 ahead = 12 -> 3 blocks each, one more than held: 2 together
    assert kv.can_allocate_all([a, b], 0, 6)
    # 6 + 10 = 16 -> 4 blocks each, two more each: 4 together, exactly what is free
    assert kv.can_allocate_all([a, b], 0, 10)
    # 6 + 11 = 17 -> 5 blocks each: 3 more each, 6 together > 4, though one alone fits
    assert kv.can_allocate_all([a], 0, 11) and not kv.can_allocate_all([a, b], 0, 11)
    assert kv.num_free_blocks == 4  # asking takes nothing


def test_block_table_is_the_live_table_and_block_ids_a_copy():
    kv = make(num_blocks=20, max_model_len=40)
    r = req("r", range(5))
    assert kv.block_table("r") == [] and kv.block_ids("r") == []
    assert kv.allocate_slots(r, 5)
    live, copy = kv.block_table("r"), kv.block_ids("r")
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 4)  # 9 tokens: a third block, appended to the same list
    assert live is kv.block_table("r") and len(live) == 3 and live[:2] == copy
    assert len(copy) == 2
    kv.free(r)
    assert kv.block_table("r") == []
    assert_all_free(kv)


def test_cache_committed_only_full_committed_blocks():
    kv = make()
    r = req("r", range(6))
    r.num_computed_tokens = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, 6 + 3)  # prompt + 3 drafts written into blocks
    kv.cache_committed(r, 6)  # one full block committed; block 1 holds uncommitted slots
    assert kv.pool.num_cached_blocks == 1
    # Drafts 6,7 accepted + bonus: tokens 0..8, KV for 0..7 committed -> 2 full blocks.
    r.output_token_ids = [6, 7, 8]
    kv.cache_committed(r, 8)
    assert kv.pool.num_cached_blocks == 2
    probe = req("p", list(range(8)) + [1])  # prompt+outputs of r as a new prompt
    assert kv.get_computed_blocks(probe) == 8
    kv.free(probe)
    kv.free(r)
    assert_all_free(kv)


def test_free_unknown_request_is_noop_and_double_admit_raises():
    kv = make()
    kv.free(req("nobody", [1]))
    r = req("r", range(9))
    run_prefill(kv, r)
    with pytest.raises(RuntimeError):
        kv.get_computed_blocks(r)
    kv.free(r)
    kv.free(r)
    assert_all_free(kv)


MODEL = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16)


def test_sizing_cpu_and_override(caplog):
    cache = CacheConfig(block_size=16, cpu_kv_bytes=1 << 20)
    per = kv_bytes_per_block(cache, MODEL, 3, torch.float32)
    assert per == 2 * 3 * 16 * 2 * 16 * 4
    assert num_kv_blocks(cache, MODEL, 3, torch.float32, "cpu") == (1 << 20) // per
    assert num_kv_blocks(cache, MODEL, 3, torch.bfloat16, "cpu") == (1 << 20) // (per // 2)
    assert num_kv_blocks(CacheConfig(num_blocks=7), MODEL, 3, torch.float32, "cpu") == 7
    with pytest.raises(ConfigError):
        num_kv_blocks(CacheConfig(num_blocks=1), MODEL, 3, torch.float32, "cpu")
    with pytest.raises(ConfigError):
        num_kv_blocks(CacheConfig(cpu_kv_bytes=per), MODEL, 3, torch.float32, "cpu")
    with caplog.at_level(logging.WARNING, logger="outpace.kvcache.sizing"):
        num_kv_blocks(CacheConfig(num_blocks=4, block_size=16), MODEL, 3, torch.float32, "cpu",
                      max_model_len=1024)
    assert "fewer than one" in caplog.text


def test_gpu_budget_follows_vllms_gpu_memory_utilization():
    """gpu_memory_utilization is a share of the total: the pool gets it less what is in use
    (weights, other processes); memory_fraction (the default) a share of what is free."""
    from outpace.kvcache.sizing import gpu_kv_budget
    gib = 2 ** 30
    free, total = 50 * gib, 80 * gib  # 30 GiB in use
    assert gpu_kv_budget(CacheConfig(), free, total)[0] == int(0.85 * free)
    budget, source = gpu_kv_budget(CacheConfig(gpu_memory_utilization=0.9), free, total)
    assert budget == int(0.9 * total) - 30 * gib
    assert source == "gpu_memory_utilization=0.9 of 80.00 GiB, less 30.00 GiB in use"
    # more in use than the share allows: no budget (num_kv_blocks then names the option)
    assert gpu_kv_budget(CacheConfig(gpu_memory_utilization=0.3), free, total)[0] < 0
    for bad in (0, 0.0, 1.5, -0.1, float("nan"), True, "0.9"):
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_gpu_memory_utilization_near_1_leaves_the_activations_their_memory():
    """At gpu_memory_utilization 1.0 (or 0.99) the pool takes what is left less a step's
    activations, never all of the GPU; memory_fraction never takes the headroom either; a share
    that cannot cover the weights and the activations gives no budget (num_kv_blocks then
    refuses it, naming the option)."""
    from outpace.kvcache.sizing import GPU_RESERVE_BYTES, activation_bytes, gpu_kv_budget
    gib = 2 ** 30
    free, total = 50 * gib, 80 * gib
    headroom = activation_bytes(MODEL, 8192 + 64 * 4, 64 * 4, 2)
    assert headroom > GPU_RESERVE_BYTES
    # more tokens a step, more headroom; a bigger vocabulary, more logits
    assert activation_bytes(MODEL, 2 * 8448, 256, 2) > activation_bytes(MODEL, 8448, 256, 2)
    wide = dataclasses.replace(MODEL, vocab_size=128_000)
    assert activation_bytes(wide, 8448, 256, 2) > activation_bytes(MODEL, 8448, 256, 2) + (
        256 * 127_000 * 4)
    budget, source = gpu_kv_budget(CacheConfig(gpu_memory_utilization=1.0), free, total,
                                   headroom)
    assert budget == free - headroom and "GiB for activations" in source
    assert gpu_kv_budget(CacheConfig(gpu_memory_utilization=0.99), free, total, headroom)[0] \
        == int(0.99 * total) - 30 * gib - headroom
    assert gpu_kv_budget(CacheConfig(memory_fraction=1.0), free, total, headroom)[0] == \
        free - headroom
    assert gpu_kv_budget(CacheConfig(gpu_memory_utilization=0.375), free, total,
                         headroom)[0] < 0  # 30 GiB share, 30 GiB in use


def test_device_ngram_buffers_are_kept_out_of_the_pool():
    """With ngram_device and graphs the headroom adds StepNgram's device bytes (its history
    and counters as allocated, a fill's row moves, the lookup's temporaries at the largest
    bucket: none with the lookup as the kernel), growing with max_num_seqs and the context;
    without either, a step's activations alone."""
    from outpace.engine.builder import kv_headroom
    from outpace.kvcache.sizing import activation_bytes
    from outpace.runner.fused_ngram import StepNgram
    from outpace.speculative.ngram_device import lookup_bytes
    from outpace.speculative_config import SpecConfig
    on = SpecConfig(method="ngram", num_speculative_tokens=3, ngram_device=True)
    off = SpecConfig(method="ngram", num_speculative_tokens=3)
    seqs, ctx = 64, 8192
    base = activation_bytes(MODEL, 1000, seqs * 4, 2)
    assert kv_headroom(MODEL, off, 1000, seqs, ctx, 2, graphs=True) == base
    assert kv_headroom(MODEL, on, 1000, seqs, ctx, 2, graphs=False) == base
    assert kv_headroom(MODEL, SpecConfig(), 1000, seqs, ctx, 2, graphs=True) == \
        activation_bytes(MODEL, 1000, seqs, 2)
    extra = StepNgram.device_bytes(seqs, ctx)
    assert kv_headroom(MODEL, on, 1000, seqs, ctx, 2, graphs=True) == base + extra
    ng = StepNgram(seqs + 1, ctx, on, torch.device("cpu"))  # the runner's rows: one more
    held = sum(t.nbytes for t in (ng.history, ng.lengths, ng.counts))
    moves = 4 * seqs * (ctx + 1)  # every row of the largest bucket moved at once
    assert extra >= held + moves + lookup_bytes(seqs, ctx)
    assert extra < 2 * (held + moves + lookup_bytes(seqs, ctx))
    assert StepNgram.device_bytes(seqs, 2 * ctx) > 1.9 * extra
    assert StepNgram.device_bytes(2 * seqs, ctx) > 1.9 * extra
    # the lookup as the Triton kernel writes into the step's outputs: no temporaries
    assert lookup_bytes(seqs, ctx, kernel=True) == 0
    lean = StepNgram.device_bytes(seqs, ctx, lookup_kernel=True)
    assert lean == extra - lookup_bytes(seqs, ctx) and lean >= held + moves
    assert kv_headroom(MODEL, on, 1000, seqs, ctx, 2, graphs=True, lookup_kernel=True) == \
        base + lean
