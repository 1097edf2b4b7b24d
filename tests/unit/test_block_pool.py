"""Block pool: null block, reference counts, LRU free queue, cached-block reuse and eviction."""

import pytest

from outpace.kvcache.block_pool import NULL_BLOCK, BlockPool
from outpace.kvcache.prefix_cache import hash_block, hash_blocks


def test_null_block_never_handed_out_and_counts():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4 and pool.usage == 0.0
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and NULL_BLOCK not in got
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4 and pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.free([NULL_BLOCK])
    pool.free(got)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.free([got[0]])  # double free
    with pytest.raises(ValueError):
        BlockPool(1)


def test_refcount_shared_block_freed_only_by_last_owner():
    pool = BlockPool(4)
    a = pool.allocate(1)
    pool.touch(a)  # a second owner (a prefix hit)
    assert pool.ref_count(a[0]) == 2
    pool.free(a)
    assert pool.ref_count(a[0]) == 1 and not pool.is_free(a[0])
    assert pool.num_free_blocks == 2
    pool.free(a)
    assert pool.ref_count(a[0]) == 0 and pool.is_free(a[0]) and pool.num_free_blocks == 3


def test_cached_free_block_is_reused_by_touch():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    h = hash_block(None, [1, 2, 3, 4])
    assert pool.cache_block(b, h)
    pool.free([b])
    assert pool.is_free(b) and pool.lookup(h) == b  # free but still findable
    pool.touch([b])
    assert not pool.is_free(b) and pool.ref_count(b) == 1 and pool.num_free_blocks == 2
    pool.free([b])
    assert pool.num_free_blocks == 3


def test_uncached_blocks_are_handed_out_before_cached_ones():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    hashes = hash_blocks(list(range(8)), 4)
    pool.cache_block(blocks[0], hashes[0])
    pool.cache_block(blocks[1], hashes[1])
    pool.free(blocks)  # two cached, two plain
    got = pool.allocate(2)
    assert set(got) == {blocks[2], blocks[3]}
    assert pool.lookup(hashes[0]) == blocks[0] and pool.lookup(hashes[1]) == blocks[1]
    pool.free(got)


def test_eviction_is_lru_and_drops_hash():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    hs = [hash_block(None, [i]) for i in range(3)]
    for b, h in zip(blocks, hs):
        pool.cache_block(b, h)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])  # LRU order: 1, 0, 2
    # touching 1 and freeing it again makes it the most recently used
    pool.touch([blocks[1]])
    pool.free([blocks[1]])  # LRU order: 0, 2, 1
    (e,) = pool.allocate(1)
    assert e == blocks[0] and pool.lookup(hs[0]) is None and pool.block_hash(e) is None
    (e2,) = pool.allocate(1)
    assert e2 == blocks[2] and pool.lookup(hs[2]) is None
    assert pool.lookup(hs[1]) == blocks[1] and pool.num_cached_blocks == 1
    pool.free([e, e2])
    assert pool.num_free_blocks == 3


def test_duplicate_hash_not_registered_and_caching_off():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    h = hash_block(None, [7, 7])
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)  # same prefix computed twice: second copy not findable
    assert pool.block_hash(b) is None and pool.lookup(h) == a
    assert not pool.cache_block(a, hash_block(None, [8]))  # a block keeps its first hash
    pool.free([a, b])
    assert pool.reset_prefix_cache() == 1 and pool.lookup(h) is None
    off = BlockPool(3, enable_caching=False)
    (c,) = off.allocate(1)
    assert not off.cache_block(c, h) and off.lookup(h) is None
    off.free([c])
    assert off.num_free_blocks == 2 and pool.num_free_blocks == 3


def test_hash_chain_depends_on_whole_prefix():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different parent
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # partial block not hashed
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2], extra_key="lora")
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, parent=a[0], start_block=1) == a[1:]


def test_every_copy_of_the_null_block_id_agrees():
    # kvcache and kernels keep their own copy (they do not import the attention layer)
    from outpace.attention.base import NULL_BLOCK as attention_null
    from outpace.kernels.store_kv import NULL_SLOT
    assert NULL_BLOCK == attention_null == 0 and NULL_SLOT == attention_null * 16
