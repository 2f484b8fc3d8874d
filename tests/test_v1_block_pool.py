"""V1's KV-cache core (`minivllm/v1/core/`): the chained block hash, the free
queue whose order is the eviction order, and the block pool, on scenarios
worked by hand from vLLM's `vllm/v1/core/block_pool.py` and
`kv_cache_utils.py`, and a property test over random operations."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from minivllm.v1.core.block_pool import BlockPool
from minivllm.v1.core.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    hash_request_tokens,
)


@dataclass
class FakeRequest:
    block_hashes: list[bytes] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# -- the hash chain -------------------------------------------------------

def test_a_block_hash_depends_on_its_tokens_its_parent_and_its_extra_keys():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(NONE_HASH, (1, 2, 3, 4))  # None means the chain's start
    assert first == hash_block_tokens(None, [1, 2, 3, 4])  # deterministic
    assert hash_block_tokens(None, [1, 2, 3, 5]) != first
    assert hash_block_tokens(first, [1, 2, 3, 4]) != first  # same tokens, other position
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora-1",)) != first


def test_only_full_blocks_have_hashes_and_each_chains_to_the_one_before():
    tokens = list(range(10))
    hashes = hash_request_tokens(4, tokens)
    assert len(hashes) == 2  # tokens 8, 9 fill half a block: no hash yet
    assert hashes[0] == hash_block_tokens(None, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    # A shared first block, a different second: the first hash is shared.
    other = hash_request_tokens(4, tokens[:4] + [99, 5, 6, 7])
    assert other[0] == hashes[0] and other[1] != hashes[1]


# -- the free queue -------------------------------------------------------

def test_the_free_queue_pops_from_the_head_appends_at_the_tail_and_unlinks_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert _ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])  # a cache hit on a free block
    assert _ids(queue.get_all_free_blocks()) == [1, 3, 4]
    queue.append(blocks[0])
    assert _ids(queue.get_all_free_blocks()) == [1, 3, 4, 0]
    assert _ids(queue.popleft_n(2)) == [1, 3]
    assert queue.num_free_blocks == 2
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 are free"):
        queue.popleft_n(3)
    with pytest.raises(RuntimeError, match="block 1 is not in the free queue"):
        queue.remove(blocks[1])
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks left"):
        queue.popleft()


def test_prepend_n_puts_blocks_at_the_head_in_the_order_given():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks[:3])
    queue.prepend_n([blocks[4], blocks[3]])
    assert _ids(queue.get_all_free_blocks()) == [4, 3, 0, 1, 2]
    queue.prepend_n([])
    queue.append(blocks[5])
    assert _ids(queue.get_all_free_blocks()) == [4, 3, 0, 1, 2, 5]
    assert queue.num_free_blocks == 6
    queue.remove(blocks[4])  # the links hold both ways
    assert _ids(queue.popleft_n(2)) == [3, 0]
    emptied = FreeKVCacheBlockQueue([])
    emptied.prepend_n([blocks[4]])
    assert _ids(emptied.get_all_free_blocks()) == [4] and emptied.popleft() is blocks[4]


# -- the block pool -------------------------------------------------------

def test_block_0_is_the_null_block_and_never_free():
    pool = BlockPool(5)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    with pytest.raises(ValueError, match="num_gpu_blocks must be at least 2"):
        BlockPool(1)


def test_new_blocks_come_from_the_head_and_uncached_freed_ones_go_back_to_it():
    """Blocks that hold no cached block (here none is cached, as with
    caching off) are freed to the head, in the order given: the next request
    reuses them first, the last block first."""
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert _ids(a) == [1, 2, 3] and all(b.ref_cnt == 1 for b in a)
    assert pool.get_usage() == pytest.approx(3 / 5)
    pool.free_blocks(reversed(a))
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 4, 5]
    assert _ids(pool.get_new_blocks(3)) == [3, 2, 1]
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 are free"):
        pool.get_new_blocks(3)


def test_cached_freed_blocks_go_to_the_tail_and_a_partial_block_to_the_head():
    """vLLM's prefill scenario (tests/v1/core/test_prefix_caching.py), blocks
    of 4: A holds 3 full cached blocks and a partial one; B shares A's 3 and
    has its own partial block. Freed (last block first), the partial blocks
    go to the head, the cached ones to the tail once nobody holds them."""
    pool = BlockPool(11)
    a_tokens = list(range(14))
    a = FakeRequest(hash_request_tokens(4, a_tokens))
    a_blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, a_blocks, num_cached_blocks=0, num_full_blocks=3, block_size=4)
    b = FakeRequest(hash_request_tokens(4, a_tokens[:12] + [90, 91]))
    hits = [pool.get_cached_block(h) for h in b.block_hashes]
    assert hits == a_blocks[:3]
    pool.touch(hits)
    b_blocks = hits + pool.get_new_blocks(1)
    assert _ids(b_blocks) == [1, 2, 3, 5]
    pool.free_blocks(reversed(a_blocks))  # 4 to the head; 3, 2, 1 still held by B
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [4, 6, 7, 8, 9, 10]
    pool.free_blocks(reversed(b_blocks))  # 5 to the head; 3, 2, 1 to the tail
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    # A new request takes the partial blocks first: every cached block survives.
    assert _ids(pool.get_new_blocks(2)) == [5, 4]
    assert all(pool.get_cached_block(h) is not None for h in a.block_hashes)


def test_a_prefix_hit_touches_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(6)
    tokens = list(range(8))
    a = FakeRequest(hash_request_tokens(4, tokens))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, blocks, num_cached_blocks=0, num_full_blocks=2, block_size=4)
    assert pool.get_cached_block(a.block_hashes[1]) is blocks[1]
    pool.free_blocks(reversed(blocks))  # a finishes; its blocks stay cached
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1]

    # b shares a's first block: a hit, which leaves the free queue.
    b = FakeRequest(hash_request_tokens(4, tokens[:4] + [50, 51, 52, 53]))
    hit = pool.get_cached_block(b.block_hashes[0])
    assert hit is blocks[0]
    assert pool.get_cached_block(b.block_hashes[1]) is None
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2]

    # c hits the same block while b holds it: shared, two references.
    pool.touch([pool.get_cached_block(a.block_hashes[0])])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and hit.prev_free_block is None  # still in use by one
    pool.free_blocks([hit])
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1]


def test_a_cached_block_handed_out_again_is_evicted_first():
    pool = BlockPool(3)
    a = FakeRequest(hash_request_tokens(2, [7, 8, 9, 10]))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, blocks, 0, 2, 2)
    pool.free_blocks(reversed(blocks))  # queue: 2, 1
    (reused,) = pool.get_new_blocks(1)
    assert reused.block_id == 2 and reused.block_hash is None
    assert pool.get_cached_block(a.block_hashes[1]) is None  # evicted
    assert pool.get_cached_block(a.block_hashes[0]) is blocks[0]  # still cached, still free


def test_two_copies_of_one_block_both_serve_hits_until_each_is_evicted():
    """Two requests that computed the same prompt at the same time each
    cache their own block under one hash (vLLM does not merge them)."""
    pool = BlockPool(4)
    req = FakeRequest(hash_request_tokens(2, [1, 2]))
    x, y = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(req, x, 0, 1, 2)
    pool.cache_full_blocks(req, y, 0, 1, 2)
    assert set(pool.cached_block_hash_to_block[req.block_hashes[0]]) == {1, 2}
    pool.free_blocks(x + y)
    pool.get_new_blocks(2)  # block 3, then block 1 (evicted)
    assert pool.get_cached_block(req.block_hashes[0]) is y[0]


def test_blocks_are_cached_once_and_only_while_caching_is_on():
    pool = BlockPool(4)
    req = FakeRequest(hash_request_tokens(2, [1, 2, 3, 4]))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 1, 2)
    pool.cache_full_blocks(req, blocks, 1, 2, 2)  # the second filled later
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    with pytest.raises(ValueError, match="already has a hash"):
        pool.cache_full_blocks(req, blocks, 0, 1, 2)
    with pytest.raises(ValueError, match="3 full blocks, but the request has hashes for 2"):
        pool.cache_full_blocks(req, blocks, 0, 3, 2)
    off = BlockPool(4, enable_caching=False)
    blocks = off.get_new_blocks(2)
    off.cache_full_blocks(req, blocks, 0, 2, 2)
    assert off.get_cached_block(req.block_hashes[0]) is None


def test_freeing_more_than_was_taken_is_refused_and_changes_nothing():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="block 1 freed more often than taken"):
        pool.free_blocks([block, block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2


def test_the_prefix_cache_resets_only_when_no_block_is_in_use():
    pool = BlockPool(4)
    req = FakeRequest(hash_request_tokens(2, [1, 2]))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, 1, 2)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(req.block_hashes[0]) is None
    assert blocks[0].block_hash is None


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_the_pool_consistent(seed):
    """Random requests take new blocks, hit cached ones and free them tail
    first: no block leaks, reference counts match the holders, a block is in
    the free queue exactly when nobody holds it, every cached hash finds a
    block carrying it, and the queue holds its uncached blocks first."""
    rng = random.Random(seed)
    pool = BlockPool(12)
    held: list[list] = []  # each live request's blocks
    for _ in range(400):
        if held and (rng.random() < 0.4 or pool.get_num_free_blocks() < 3):
            blocks = held.pop(rng.randrange(len(held)))
            pool.free_blocks(reversed(blocks))
        else:
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            req = FakeRequest(hash_request_tokens(2, tokens))  # full blocks only
            hits = []
            for h in req.block_hashes:
                block = pool.get_cached_block(h)
                if block is None:
                    break
                hits.append(block)
            pool.touch(hits)
            new = pool.get_new_blocks(-(-len(tokens) // 2) - len(hits))
            blocks = hits + new
            pool.cache_full_blocks(req, blocks, len(hits), len(req.block_hashes), 2)
            held.append(blocks)
        holders = {}
        for blocks in held:
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
        for b in pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0) >= 0
            assert (b.block_id in free) == (b.ref_cnt == 0)
        assert len(free) == pool.get_num_free_blocks() == 11 - len(holders)
        for h, blocks in pool.cached_block_hash_to_block.items():
            assert blocks and all(b.block_hash == h for b in blocks.values())
        # Uncached blocks join at the head, cached ones at the tail, and
        # blocks leave from the head: no uncached block ever follows a cached one.
        cached = [b.block_hash is not None for b in pool.free_block_queue.get_all_free_blocks()]
        assert cached == sorted(cached)
