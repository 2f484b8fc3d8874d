"""`BlockTable`: the block ids of every request in the persistent batch, one
row each, kept from step to step (vLLM's `vllm/v1/worker/block_table.py`).

The classic model runner rebuilt each sequence's block table every step
from the scheduler's lists. Here a row is written once when its request
joins the batch and only *extended* as the request grows: the scheduler
sends just the new block ids.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # [max_num_reqs, max_num_blocks_per_req]; unused entries are 0 (the
        # null block), never read past a request's length.
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks_per_row[row_idx]
        self.block_table_np[row_idx, start : start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row_idx] += len(block_ids)

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        num_blocks = self.num_blocks_per_row[src]
        self.block_table_np[tgt, :num_blocks] = self.block_table_np[src, :num_blocks]
        self.num_blocks_per_row[tgt] = num_blocks

    def swap_row(self, src: int, tgt: int) -> None:
        self.block_table_np[[src, tgt]] = self.block_table_np[[tgt, src]]
        self.num_blocks_per_row[[src, tgt]] = self.num_blocks_per_row[[tgt, src]]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The cache slot of each token: the block that holds its position
        in its request's row, times block_size, plus the offset in it.
        req_indices, positions: [num_tokens]."""
        block_numbers = self.block_table_np[req_indices, positions // self.block_size]
        return block_numbers.astype(np.int64) * self.block_size + positions % self.block_size

    def get_device_tensor(self, num_reqs: int, device: torch.device) -> torch.Tensor:
        """[num_reqs, longest row's blocks] for attention."""
        width = max(int(self.num_blocks_per_row[:num_reqs].max(initial=0)), 1)
        return torch.from_numpy(self.block_table_np[:num_reqs, :width]).to(device, torch.long)
