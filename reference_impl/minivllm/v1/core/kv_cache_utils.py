"""The pieces of V1's KV cache (vLLM's `vllm/v1/core/kv_cache_utils.py`).

Three ideas replace the classic engine's block allocator, evictor and
per-sequence block tables:

- A full block is named by a **chained hash**: the hash of its parent block's
  hash, its own token ids and any extra keys (in vLLM a LoRA or multimodal
  id; here the request's cache salt, in its first block).
  Equal hashes mean equal tokens at equal positions, so equal K/V.
- A `KVCacheBlock` knows its reference count and, once full and cached, its
  hash. A block with no references stays cached (findable by hash) until it
  is handed out again.
- One doubly linked `FreeKVCacheBlockQueue` holds every block with no
  references, cached or not, **in eviction order**: new blocks come from the
  head; freed blocks that are cached go to the tail, freed blocks that are
  not (a partial last block) to the head, since no hit can ever want them.
  There is no separate evictor: the LRU order of the cached blocks *is* the
  free order. A cached block that gets a new user ("touched") is unlinked
  from the middle in O(1), which is why the list is linked by hand instead
  of being a `collections.deque`.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

BlockHash = bytes  # sha256 digest of (parent hash, token ids, extra keys)

# The parent of a request's first block. vLLM draws it at random per process
# unless PYTHONHASHSEED is set; a fixed value keeps our traces reproducible.
NONE_HASH: BlockHash = hashlib.sha256(b"minivllm v1 prefix cache").digest()


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The hash of one full block, chained to everything before it."""
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    payload = (parent_block_hash, tuple(curr_block_token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()


def hash_request_tokens(
    block_size: int, token_ids: Sequence[int], parent_block_hash: BlockHash | None = None
) -> list[BlockHash]:
    """The chained hashes of every *full* block of `token_ids` (a partial
    last block has none: its K/V is not final until the block fills),
    the first chained to `parent_block_hash` (None: the request's start),
    no extra keys: the hashes of a request without a cache salt."""
    hashes: list[BlockHash] = []
    parent = parent_block_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def generate_block_hash_extra_keys(request, start_token_idx: int) -> tuple[Any, ...] | None:
    """What a block's hash needs besides its tokens. vLLM's keys are a LoRA
    adapter's name, multimodal inputs' hashes, the cache salt and prompt
    embeddings; minivllm has only the salt. It goes into the request's
    first block alone: every later hash chains to that one, so a salt
    changes them all, and requests with different salts (or one with a salt
    and one without) never share a cached block."""
    if start_token_idx == 0 and request.cache_salt:
        return (request.cache_salt,)
    return None


def get_request_block_hasher(block_size: int):
    """A function that hashes the full blocks a request has gained since it
    was last hashed (`Request.update_block_hashes` calls it)."""

    def request_block_hasher(request) -> list[BlockHash]:
        hashes: list[BlockHash] = []
        parent = request.block_hashes[-1] if request.block_hashes else None
        start = len(request.block_hashes) * block_size
        for begin in range(start, request.num_tokens - block_size + 1, block_size):
            tokens = request.all_token_ids[begin : begin + block_size]
            extra_keys = generate_block_hash_extra_keys(request, begin)
            parent = hash_block_tokens(parent, tokens, extra_keys)
            hashes.append(parent)
        return hashes

    return request_block_hasher


@dataclass(eq=False)
class KVCacheBlock:
    """One block of the KV cache, as the scheduler sees it (no tensors here)."""

    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and cached; cleared when it is evicted.
    _block_hash: BlockHash | None = None
    # Links of the free queue; None while the block is in use.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    # The null block (block 0) stands in for skipped positions; never freed.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        if self._block_hash is not None:
            raise ValueError(f"block {self.block_id} already has a hash")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the content: the block is about to be written again."""
        self._block_hash = None


class FreeKVCacheBlockQueue:
    """The free blocks, head first out: a doubly linked list through the
    blocks' own `prev_free_block` / `next_free_block`, between two sentinels,
    so that append, popleft and removal from the middle are all O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for prev, nxt in pairwise(chain):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """The block to hand out next: the least recently freed."""
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is in the queue (a cache hit on a
        free block takes it back into use)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block that lost its last user at the tail: evicted last."""
        last = self.fake_free_list_tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the head, in the order given (the first given is
        handed out first): blocks no hit can want are reused before any
        cached one is evicted."""
        for block in reversed(blocks):
            first = self.fake_free_list_head.next_free_block
            first.prev_free_block = block
            block.next_free_block = first
            block.prev_free_block = self.fake_free_list_head
            self.fake_free_list_head.next_free_block = block
            self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (next out) first."""
        out = []
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block
        return out
