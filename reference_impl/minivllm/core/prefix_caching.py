"""Prefix caching: find and keep KV-cache blocks by their content.

A full block's identity is a hash that chains its parent block's hash with
its own token ids, so equal hashes mean equal tokens at equal positions, and
so equal K/V. Such a block can be shared by every request whose prompt starts
with the same tokens. When its last user frees it, the block is not wiped:
it waits in the evictor, still findable, until its slot is needed for new
content, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict

from minivllm.core.block_allocator import BlockAllocator, PhysicalTokenBlock


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The identity of a full block: its tokens and everything before them."""
    return hash((parent_hash, token_ids))


class CachedBlockAllocator(BlockAllocator):
    """A device pool whose full, computed blocks are indexed by content hash.

    Free blocks are of two kinds: never-used or wiped ones in the free list,
    and cached ones with ref_count 0 in the `evictor` (an LRU queue). Both
    count as free; a new block comes from the free list first and only then
    evicts the least recently used cached block.
    """

    def __init__(self, device, block_size: int, num_blocks: int) -> None:
        super().__init__(device, block_size, num_blocks)
        self.cached_blocks: dict[int, PhysicalTokenBlock] = {}
        # block hash -> cached block with ref_count 0, least recently used first
        self.evictor: OrderedDict[int, PhysicalTokenBlock] = OrderedDict()

    def lookup(self, block_hash: int) -> PhysicalTokenBlock | None:
        return self.cached_blocks.get(block_hash)

    def reuse(self, block: PhysicalTokenBlock) -> PhysicalTokenBlock:
        """Take one more reference to a cached block (reviving it if evictable)."""
        if block.ref_count == 0:
            del self.evictor[block.block_hash]
        block.ref_count += 1
        return block

    def allocate(self) -> PhysicalTokenBlock:
        if self.free_block_numbers or not self.evictor:
            return super().allocate()
        block_hash, victim = self.evictor.popitem(last=False)
        del self.cached_blocks[block_hash]
        return PhysicalTokenBlock(self.device, victim.block_number, self.block_size, ref_count=1)

    def _release(self, block: PhysicalTokenBlock) -> None:
        """A cached block stays findable in the evictor; others are wiped."""
        if self.cached_blocks.get(block.block_hash) is block:
            self.evictor[block.block_hash] = block  # most recently used: last
        else:
            self.free_block_numbers.append(block.block_number)

    def register(self, block: PhysicalTokenBlock) -> None:
        """Index a block that just became full and computed.

        If another block already holds the same content, that one stays the
        cached copy and this block is freed normally later.
        """
        self.cached_blocks.setdefault(block.block_hash, block)

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_numbers) + len(self.evictor)
