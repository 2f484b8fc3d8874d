"""The block manager: which physical KV-cache blocks each sequence owns.

The KV cache is cut into fixed-size blocks of `block_size` token slots. A
sequence's *block table* lists, in logical order, the physical block numbers
that hold its tokens: token i of the sequence lives in slot
`block_table[i // block_size] * block_size + i % block_size`. Blocks are
ref-counted so that sequences of one request can share their prompt's
blocks. There are two pools: the device ("gpu") pool the model reads, and a
CPU pool that SWAP preemption moves blocks into.

Nothing here touches tensors: the manager only decides, and returns the
(src, dst) block pairs that the worker's `CacheEngine` copies.
"""

from __future__ import annotations

import enum

from minivllm.core.block_allocator import BlockAllocator, Device, PhysicalTokenBlock
from minivllm.core.prefix_caching import CachedBlockAllocator, hash_block_tokens
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(enum.Enum):
    """Can a sequence group get its blocks? OK now, LATER, or NEVER (too big)."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


BlockTable = list[PhysicalTokenBlock]


class BlockSpaceManager:
    """Maps sequences to physical blocks in the device and CPU pools.

    `watermark` (a fraction of the device pool) is kept free whenever a
    group joins the device pool, by admission (`can_allocate`, recomputed
    requests included) or by swap-in (`can_swap_in`), as in vLLM v0: running
    sequences can then still grow by a block without an immediate
    preemption.

    With `enable_caching` (prefix caching), a new sequence reuses the cached
    blocks of its longest cached prefix, and full computed blocks are kept
    findable by content after they are freed (see core/prefix_caching.py).
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_caching: bool = False,
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_caching = enable_caching
        gpu_allocator_cls = CachedBlockAllocator if enable_caching else BlockAllocator
        self.gpu_allocator = gpu_allocator_cls(Device.GPU, block_size, num_gpu_blocks)
        # Prefix-cache counters, in blocks: looked up at admission, and found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.cpu_allocator = BlockAllocator(Device.CPU, block_size, num_cpu_blocks)
        # seq_id -> its blocks, in logical order.
        self.block_tables: dict[int, BlockTable] = {}

    # -- admitting a prompt ------------------------------------------------

    def _can_fit(self, num_required: int, num_never: int) -> AllocStatus:
        """OK when `num_required` blocks can be taken now and the watermark
        still left free; NEVER when the pool holds fewer than `num_never`
        blocks at all, so waiting cannot help; LATER otherwise."""
        if self.num_total_gpu_blocks < num_never:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _num_cacheable_blocks(self, seq: Sequence) -> int:
        """Leading full blocks that may come from the cache. Never all of the
        sequence: the block holding its last token is always computed, since
        that token's logits are needed to sample."""
        return (seq.get_len() - 1) // self.block_size

    def _cached_prefix(self, seq: Sequence) -> BlockTable:
        """The cached blocks of the sequence's longest cached prefix."""
        if not self.enable_caching:
            return []
        tokens, bs = seq.get_token_ids(), self.block_size
        hits: BlockTable = []
        parent_hash = None
        for i in range(self._num_cacheable_blocks(seq)):
            parent_hash = hash_block_tokens(parent_hash, tuple(tokens[i * bs : (i + 1) * bs]))
            block = self.gpu_allocator.lookup(parent_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of a waiting sequence whose KV the cache holds."""
        return len(self._cached_prefix(seq)) * self.block_size

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
        # Cached blocks in use by others cost nothing; evictable ones are
        # counted as free, so taking them costs a free block like a new one.
        shared = sum(block.ref_count > 0 for block in self._cached_prefix(seq))
        # A prompt may never use the watermark blocks, even alone in the pool
        # (vLLM's rule; it holds for a recomputed request too).
        num_never = seq.n_blocks + self.watermark_blocks
        return self._can_fit(seq.n_blocks - shared, num_never)

    def allocate(self, seq_group: SequenceGroup) -> int:
        """Give the waiting sequences blocks for every token they have.

        All waiting sequences of a group hold the same tokens (the prompt),
        so they share one block table through the ref counts. Returns how
        many leading tokens are already computed (found in the prefix cache).
        """
        waiting = seq_group.get_seqs(SequenceStatus.WAITING)
        hits = self._cached_prefix(waiting[0])
        if self.enable_caching:
            self.prefix_cache_queries += self._num_cacheable_blocks(waiting[0])
            self.prefix_cache_hits += len(hits)
        block_table: BlockTable = []
        for block in hits:
            self.gpu_allocator.reuse(block)
            block.ref_count += len(waiting) - 1
            block_table.append(block)
        for _ in range(waiting[0].n_blocks - len(hits)):
            block = self.gpu_allocator.allocate()
            block.ref_count = len(waiting)
            block_table.append(block)
        for seq in waiting:
            self.block_tables[seq.seq_id] = block_table.copy()
        return len(hits) * self.block_size

    def mark_blocks_as_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Make the blocks full within the first `num_computed_tokens` tokens
        findable by content.

        The scheduler calls this as it schedules a sequence, with the tokens
        it will have computed by the end of the step. A request admitted later
        in the same step may then reuse these blocks: every layer writes the
        whole batch's K/V before any attention reads (attention/kv_cache.py).
        A full block never changes again, so its hash stays true.
        """
        if not self.enable_caching:
            return
        table, bs = self.block_tables[seq.seq_id], self.block_size
        num_full = num_computed_tokens // bs
        first = num_full
        while first > 0 and table[first - 1].block_hash is None:
            first -= 1
        if first == num_full:
            return  # the usual decode step: no block filled up
        tokens = seq.get_token_ids()  # a copy of them all: only when needed
        for i in range(first, num_full):
            parent_hash = table[i - 1].block_hash if i > 0 else None
            table[i].block_hash = hash_block_tokens(
                parent_hash, tuple(tokens[i * bs : (i + 1) * bs])
            )
            self.gpu_allocator.register(table[i])

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    # -- growing a running sequence ----------------------------------------

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Can every running sequence of the group take its next token?

        vLLM v0's simple, cautious rule: one free block per running sequence,
        whether or not that sequence will need a new block this step (a new
        logical block, or a copy of a shared last block). It may preempt a
        step earlier than strictly needed, but never too late.
        """
        num_seqs = seq_group.num_seqs(SequenceStatus.RUNNING)
        return num_seqs <= self.gpu_allocator.get_num_free_blocks()

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make room for the sequence's newest token.

        Returns the copy-on-write pairs (src, dst) the worker must copy first:
        empty unless the last block was shared.
        """
        block_table = self.block_tables[seq.seq_id]
        if len(block_table) < seq.n_blocks:
            assert len(block_table) == seq.n_blocks - 1, "a sequence grows one block at a time"
            block_table.append(self.gpu_allocator.allocate())
            return []
        last_block = block_table[-1]
        if last_block.ref_count == 1:
            return []
        new_block = self.gpu_allocator.allocate()
        block_table[-1] = new_block
        self.gpu_allocator.free(last_block)
        return [(last_block.block_number, new_block.block_number)]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all the parent's blocks: nothing is allocated or
        copied now; the first write into a shared block copies it."""
        block_table = self.block_tables[parent.seq_id].copy()
        for block in block_table:
            block.ref_count += 1
        self.block_tables[child.seq_id] = block_table

    # -- swapping ----------------------------------------------------------

    def _unique_blocks(self, seq_group: SequenceGroup, status: SequenceStatus) -> BlockTable:
        seen: dict[int, PhysicalTokenBlock] = {}
        for seq in seq_group.get_seqs(status):
            for block in self.block_tables[seq.seq_id]:
                seen.setdefault(id(block), block)
        return list(seen.values())

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        blocks = self._unique_blocks(seq_group, SequenceStatus.SWAPPED)
        # One more block per sequence: its next decode token may open a block.
        num_required = len(blocks) + seq_group.num_seqs(SequenceStatus.SWAPPED)
        # NEVER once it could not come back even to an empty pool without
        # the watermark blocks: vLLM says LATER there, and it waits forever.
        return self._can_fit(num_required, num_never=num_required + self.watermark_blocks)

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks CPU -> device; returns (cpu, gpu) block pairs."""
        return self._swap(seq_group, SequenceStatus.SWAPPED, self.gpu_allocator, self.cpu_allocator)

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._unique_blocks(seq_group, SequenceStatus.RUNNING)
        return len(blocks) <= self.cpu_allocator.get_num_free_blocks()

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks device -> CPU; returns (gpu, cpu) block pairs."""
        return self._swap(seq_group, SequenceStatus.RUNNING, self.cpu_allocator, self.gpu_allocator)

    def _swap(
        self,
        seq_group: SequenceGroup,
        status: SequenceStatus,
        dst_allocator: BlockAllocator,
        src_allocator: BlockAllocator,
    ) -> list[tuple[int, int]]:
        # src block -> its new dst block; a shared block is copied once and
        # stays shared (its ref count moves with it).
        mapping: dict[int, PhysicalTokenBlock] = {}
        src_blocks: dict[int, PhysicalTokenBlock] = {}
        for seq in seq_group.get_seqs(status):
            new_table: BlockTable = []
            for src in self.block_tables[seq.seq_id]:
                if id(src) in mapping:
                    dst = mapping[id(src)]
                    dst.ref_count += 1
                else:
                    dst = dst_allocator.allocate()
                    mapping[id(src)] = dst
                    src_blocks[id(src)] = src
                new_table.append(dst)
                src_allocator.free(src)
            self.block_tables[seq.seq_id] = new_table
        return [(src_blocks[k].block_number, dst.block_number) for k, dst in mapping.items()]

    # -- releasing ---------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (finished, aborted or recomputed)."""
        self._free_table(seq.seq_id)

    def _free_table(self, seq_id: int) -> None:
        block_table = self.block_tables.pop(seq_id, None)
        if block_table is None:
            return  # never allocated, or already freed
        for block in block_table:
            if block.device == Device.GPU:
                self.gpu_allocator.free(block)
            else:
                self.cpu_allocator.free(block)

    def reset(self) -> None:
        """Free every sequence's blocks: an empty cache, as at the start."""
        for seq_id in list(self.block_tables):
            self._free_table(seq_id)

    # -- queries -----------------------------------------------------------

    def get_block_table(self, seq: Sequence) -> list[int]:
        return [block.block_number for block in self.block_tables[seq.seq_id]]

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()
