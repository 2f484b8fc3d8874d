"""`BlockPool`: every KV-cache block, the free queue and the prefix-cache
index (vLLM's `vllm/v1/core/block_pool.py`).

The pool hands out, shares and takes back blocks; it does not know which
request holds which (that is `KVCacheManager`'s). Its rules:

- `get_new_blocks` takes blocks from the head of the free queue. A block
  taken there may still be cached: it is evicted now (its hash forgotten),
  because its slots are about to be overwritten.
- `touch` takes cached blocks into use for a prefix hit: a block nobody held
  is unlinked from the free queue, and every touched block gains a reference.
- `free_blocks` drops one reference from each block. Those left with none
  and cached go to the tail of the free queue **in the order given**: the
  caller passes a request's blocks tail first, so that the end of a prompt,
  the part least likely to be shared, is evicted before its beginning. Those
  left with none and not cached (a partial last block, or every block when
  caching is off) go to the head, in the same order: no hit can want them,
  so they are reused before any cached block is evicted.
- `cache_full_blocks` indexes blocks by the hashes of their tokens once they
  are full.

With `enable_kv_cache_events`, caching a run of blocks queues one
`BlockStored`, evicting a block one `BlockRemoved`, and emptying the cache
an `AllBlocksCleared`; the scheduler takes them (`take_events`) and
publishes them (`distributed/kv_events.py`). A block cached by two requests
at once is stored twice, and each copy's eviction is its own event.

Block 0 is the null block: taken out of the queue at start, never handed out
or freed (vLLM uses it for positions a sliding window skips).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from minivllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_block_hash,
)
from minivllm.v1.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class HasBlockHashes(Protocol):
    """A request, as far as caching its blocks goes: its full blocks' hashes,
    and its tokens (for the `BlockStored` event)."""

    block_hashes: list[BlockHash]
    all_token_ids: list[int]


def _stored_event(
    request: HasBlockHashes, num_cached_blocks: int, num_full_blocks: int, block_size: int
) -> BlockStored:
    """The event for the request's blocks `num_cached_blocks:num_full_blocks`,
    chained to the block before them (None: they start the request)."""
    hashes = request.block_hashes
    parent = hashes[num_cached_blocks - 1] if num_cached_blocks else None
    first_token, end_token = num_cached_blocks * block_size, num_full_blocks * block_size
    return BlockStored(
        block_hashes=[external_block_hash(h) for h in hashes[num_cached_blocks:num_full_blocks]],
        parent_block_hash=None if parent is None else external_block_hash(parent),
        token_ids=request.all_token_ids[first_token:end_token],
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
    )


class BlockPool:
    def __init__(
        self, num_gpu_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(
                f"num_gpu_blocks must be at least 2 (one is the null block), got {num_gpu_blocks}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # block hash -> {block_id: block}: two requests that computed the
        # same block at the same time each hold a copy; either serves a hit.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding exactly these tokens after exactly this prefix."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(
        self,
        request: HasBlockHashes,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Index `blocks[num_cached_blocks:num_full_blocks]`, the request's
        blocks that have filled since it last cached, by their hashes."""
        if num_full_blocks > len(request.block_hashes):
            raise ValueError(
                f"{num_full_blocks} full blocks, but the request has hashes for "
                f"{len(request.block_hashes)}"
            )
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            block.block_hash = request.block_hashes[i]  # refuses a block hashed twice
            self.cached_block_hash_to_block.setdefault(block.block_hash, {})[block.block_id] = block
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                _stored_event(request, num_cached_blocks, num_full_blocks, block_size)
            )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """`num_blocks` blocks for new content, each with one reference."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Forget a block's content before it is overwritten. True if it was cached."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        cached = self.cached_block_hash_to_block[block_hash]
        del cached[block.block_id]
        if not cached:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(block_hashes=[external_block_hash(block_hash)], medium=MEDIUM_GPU)
            )
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take cached blocks into use for another request (a prefix hit)."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; those left unused join the free
        queue in this order (first here, reused first): uncached ones at the
        head, cached ones at the tail."""
        ordered_blocks = list(ordered_blocks)
        for block_id, times in Counter(b.block_id for b in ordered_blocks).items():
            if self.blocks[block_id].ref_cnt < times:  # all checked before any change
                raise RuntimeError(f"block {block_id} freed more often than taken")
        uncached, cached = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                (cached if block.block_hash is not None else uncached).append(block)
        self.free_block_queue.prepend_n(uncached)
        self.free_block_queue.append_n(cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use,
        since a running request's blocks must keep their hashes."""
        if self.get_num_free_blocks() != self.num_gpu_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """The share of the blocks in use (the null block excluded)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)
