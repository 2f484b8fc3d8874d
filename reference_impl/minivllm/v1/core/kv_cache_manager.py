"""`KVCacheManager`: which blocks each request holds (vLLM's
`vllm/v1/core/kv_cache_manager.py`, for a model whose layers all use full
attention; vLLM's manager coordinates several kinds of layer, each with its
own manager, and ours is what its full-attention manager does).

The scheduler asks it three things:

- `get_computed_blocks(request)`: the longest run of the request's full
  blocks already in the prefix cache. At most `num_tokens - 1` tokens are
  taken from it: the last token must be computed, because its logits give
  the next token. (The lookup counts nothing: the scheduler calls
  `record_prefix_cache_stats` once the request is admitted, so a request
  looked up again every step while it waits for room is counted once.)
- `allocate_slots(request, num_new_tokens, ...)`: room for the K/V of the
  tokens scheduled this step, taking the cached blocks found above into
  use; None if the free blocks are too few (the scheduler then preempts).
  The request's blocks that the step fills are cached at once.
- `free(request)`: give every block back, last block first.

After scheduling it asks `get_num_common_prefix_blocks`: how many first
blocks all running requests share.

`reset_prefix_cache` empties the cache once no request holds a block (the
scheduler preempts the running ones first if asked to), and flags the
next `PrefixCacheStats` so the front end's hit rate starts again.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from minivllm.distributed.kv_events import KVCacheEvent
from minivllm.utils import cdiv
from minivllm.v1.core.block_pool import BlockPool
from minivllm.v1.core.kv_cache_utils import KVCacheBlock
from minivllm.v1.metrics.stats import PrefixCacheStats
from minivllm.v1.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler, as vLLM wraps them (one group here)."""

    blocks: list[KVCacheBlock]

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, enable_kv_cache_events)
        # request id -> its blocks, in position order
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # request id -> how many of its blocks are cached (have their hash)
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call, and a fresh count from now."""
        stats, self.prefix_cache_stats = (
            self.prefix_cache_stats,
            (PrefixCacheStats() if self.prefix_cache_stats is not None else None),
        )
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether the request is looked up in the prefix cache at all."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one lookup, of the request's `num_tokens`, `num_hits` of them
        found. The scheduler calls it when it admits a request from the waiting
        queue (vLLM records at admission, so unscheduled lookups are not
        counted); a request that skipped the lookup is not counted."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            request.num_tokens, num_hits, preempted=request.num_preemptions > 0
        )

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """(cached blocks of the request's prefix, tokens they hold). Counts
        nothing in the stats: see `record_prefix_cache_stats`."""
        if not self.prefix_cache_lookup_enabled(request):
            return KVCacheBlocks([]), 0
        # The last token's logits are needed: never take it from the cache.
        max_cache_hit_length = request.num_tokens - 1
        computed: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[: max_cache_hit_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # hashes are chained: nothing after a miss can hit
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size
        return KVCacheBlocks(computed), num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        """Blocks for `num_new_tokens` more tokens after the request's
        computed ones (`num_new_computed_tokens` of them just found in the
        cache, in `new_computed_blocks`). Returns the newly allocated blocks,
        or None, changing nothing, if too few blocks are free; with
        `full_sequence_must_fit` (the scheduler's admission of a waiting
        request), also if the free blocks could not hold all its tokens,
        whatever part of them this step computes.

        Blocks (layout):
        | < computed > | < new computed > |    < new >    |
                                          ^ num_new_tokens of them
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        new_computed = new_computed_blocks.blocks if new_computed_blocks else []
        # Looked up without creating the entry: a refused request holds nothing.
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens, self.max_model_len)
        num_held = len(req_blocks) + len(new_computed)
        num_new_blocks = cdiv(num_tokens_need_slot, self.block_size) - num_held
        # The blocks that must be free: this step's, or all the request's.
        num_tokens_to_fit = num_tokens_need_slot
        if full_sequence_must_fit:
            num_tokens_to_fit = max(num_tokens_to_fit, min(request.num_tokens, self.max_model_len))
        num_blocks_to_fit = cdiv(num_tokens_to_fit, self.block_size) - num_held
        # A cached block that nobody holds sits in the free queue: taking it
        # into use removes it from there, so it counts against the free blocks.
        num_evictable_computed = sum(b.ref_cnt == 0 and not b.is_null for b in new_computed)
        if num_blocks_to_fit + num_evictable_computed > self.block_pool.get_num_free_blocks():
            return None

        if self.enable_caching:
            self.block_pool.touch(new_computed)
        req_blocks = self.req_to_blocks[request.request_id]
        if request.request_id not in self.num_cached_block:
            # The request's first blocks: its cache hits, all cached. Counted
            # only here, as vLLM's save_new_computed_blocks does: recounting
            # len(req_blocks) on every call took a running request's partly
            # filled last block for cached, so cache_blocks skipped it once it
            # filled and it never entered the prefix cache.
            req_blocks.extend(new_computed)
            self.num_cached_block[request.request_id] = len(req_blocks)
        else:
            assert not new_computed, "a running request takes no cache hits"
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # The blocks this step fills hold known tokens: cache them now
            # (the step that computes them runs before anyone can hit them).
            self.cache_blocks(
                request, min(num_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's blocks that are full once `num_computed_tokens`
        tokens are computed."""
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_cached >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            num_cached,
            num_full_blocks,
            self.block_size,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Give back all of a request's blocks, last first: the free queue
        then evicts a prompt's tail before its more shareable head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(list(self.req_to_blocks.get(request_id, [])))

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """How many first blocks every request holding blocks shares: the
        run of the request's blocks whose `ref_cnt` (their holders) equals
        the number of such requests. Any running request gives the same
        count, so the scheduler asks with the first. Cascade attention
        would attend to this shared prefix once for the whole batch; we
        have no cascade attention, so the count is only reported
        (`SchedulerOutput.num_common_prefix_blocks`)."""
        num_common_blocks = 0
        # .get, not [] as vLLM: a lookup must not add an empty entry, which
        # would count as a request holding blocks from then on.
        for block in self.req_to_blocks.get(running_request_id, []):
            if block.ref_cnt != len(self.req_to_blocks):
                break
            num_common_blocks += 1
        return num_common_blocks

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (refused, False, while a request holds
        blocks). The next stats say so, so the hit rate starts again."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The block pool's KV-cache events since the last call."""
        return self.block_pool.take_events()
