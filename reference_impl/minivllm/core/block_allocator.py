"""Physical blocks and the free list of one pool (device or CPU)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
    # Prefix caching: the hash of the block's content and of every block
    # before it, set once the block is full and computed (else None).
    block_hash: int | None = None

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
            self._release(block)

    def _release(self, block: PhysicalTokenBlock) -> None:
        """The last reference is gone: the block is free again."""
        self.free_block_numbers.append(block.block_number)

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_numbers)
