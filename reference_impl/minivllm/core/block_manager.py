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
from dataclasses import dataclass

from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus


class Device(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"


@dataclass(eq=False)
class PhysicalTokenBlock:
    """One block of the cache; `ref_count` is how many sequences map it."""

    device: Device
    block_number: int
    block_size: int
    ref_count: int = 0

    def __repr__(self) -> str:
        return (
            f"PhysicalTokenBlock({self.device.value}, #{self.block_number}, ref={self.ref_count})"
        )


class BlockAllocator:
    """A free list of the blocks of one device's pool."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Free block numbers, popped from the end so block 0 goes first. A
        # pool can hold millions of blocks: the block objects are made only
        # when handed out.
        self.free_block_numbers = list(reversed(range(num_blocks)))

    def allocate(self) -> PhysicalTokenBlock:
        if not self.free_block_numbers:
            raise ValueError(f"Out of memory: no free {self.device.value} blocks")
        number = self.free_block_numbers.pop()
        return PhysicalTokenBlock(self.device, number, self.block_size, ref_count=1)

    def free(self, block: PhysicalTokenBlock) -> None:
        if block.ref_count == 0:
            raise ValueError(f"Double free of {block}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_numbers.append(block.block_number)

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_numbers)


class AllocStatus(enum.Enum):
    """Can a sequence group get its blocks? OK now, LATER, or NEVER (too big)."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


BlockTable = list[PhysicalTokenBlock]


class BlockSpaceManager:
    """Maps sequences to physical blocks in the device and CPU pools.

    `watermark` (a fraction of the device pool) is kept free when admitting
    new prompts, so that running sequences can still grow by a block without
    an immediate preemption.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_allocator = BlockAllocator(Device.GPU, block_size, num_gpu_blocks)
        self.cpu_allocator = BlockAllocator(Device.CPU, block_size, num_cpu_blocks)
        # seq_id -> its blocks, in logical order.
        self.block_tables: dict[int, BlockTable] = {}

    # -- admitting a prompt ------------------------------------------------

    def _can_fit(self, num_required: int, is_new: bool) -> AllocStatus:
        """The watermark holds back fresh prompts only. A preempted request
        has already generated tokens: refusing it (NEVER) would throw that
        work away, so it may use the watermark blocks."""
        watermark = self.watermark_blocks if is_new else 0
        if self.num_total_gpu_blocks - num_required < watermark:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - num_required >= watermark:
            return AllocStatus.OK
        return AllocStatus.LATER

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
        return self._can_fit(seq.n_blocks, is_new=seq.get_output_len() == 0)

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give the waiting sequences blocks for every token they have.

        All waiting sequences of a group hold the same tokens (the prompt),
        so they share one block table through the ref counts.
        """
        waiting = seq_group.get_seqs(SequenceStatus.WAITING)
        block_table: BlockTable = []
        for _ in range(waiting[0].n_blocks):
            block = self.gpu_allocator.allocate()
            block.ref_count = len(waiting)
            block_table.append(block)
        for seq in waiting:
            self.block_tables[seq.seq_id] = block_table.copy()

    # -- growing a running sequence ----------------------------------------

    def _needs_new_block(self, seq: Sequence) -> bool:
        """Does the slot of this sequence's next token need a fresh block?

        Yes when its last block is full (a new logical block begins) or when
        the last block is shared and must be copied before it is written.
        """
        block_table = self.block_tables[seq.seq_id]
        return len(block_table) < seq.n_blocks or block_table[-1].ref_count > 1

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        running = seq_group.get_seqs(SequenceStatus.RUNNING)
        num_required = sum(self._needs_new_block(seq) for seq in running)
        return num_required <= self.gpu_allocator.get_num_free_blocks()

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
        return self._can_fit(num_required, is_new=False)

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
        block_table = self.block_tables.pop(seq.seq_id, None)
        if block_table is None:
            return  # never allocated, or already freed
        for block in block_table:
            if block.device == Device.GPU:
                self.gpu_allocator.free(block)
            else:
                self.cpu_allocator.free(block)

    # -- queries -----------------------------------------------------------

    def get_block_table(self, seq: Sequence) -> list[int]:
        return [block.block_number for block in self.block_tables[seq.seq_id]]

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()
