"""`MergedLinear`: several projections of one input as one matmul.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`
(QKVParallelLinear, MergedColumnParallelLinear): one large matmul is faster
than three small ones. Checkpoints store the parts separately, so loading
copies each part into its rows of the fused weight.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, input_size: int, output_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """Copy one part (`shard_id`, e.g. "q") into its rows of the weight or bias."""
        offset, size = self.shard_offsets[shard_id]
        if loaded.shape[0] != size:
            raise ValueError(
                f"shard {shard_id!r} has {loaded.shape[0]} rows in the checkpoint, expected {size}"
            )
        param.data[offset : offset + size].copy_(loaded)
