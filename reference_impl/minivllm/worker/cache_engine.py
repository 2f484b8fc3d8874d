"""`CacheEngine`: the KV-cache tensors themselves, and block copies.

Allocated once at start-up: per layer, one device tensor in the layout of
`attention/kv_cache.py` (the device pool) and one CPU tensor of the same
layout (the swap pool). The block manager decides; this class moves bytes,
with the chosen attention backend's `swap_blocks` and `copy_blocks`.
"""

from __future__ import annotations

import torch

from minivllm.attention.backends.abstract import AttentionBackend
from minivllm.config import CacheConfig, ModelConfig, ParallelConfig


class CacheEngine:
    def __init__(
        self,
        cache_config: CacheConfig,
        model_config: ModelConfig,
        parallel_config: ParallelConfig,
        device: torch.device,
        attn_backend: type[AttentionBackend],
    ) -> None:
        self.block_size = cache_config.block_size
        self.num_layers = model_config.get_num_layers()
        self.num_kv_heads = model_config.get_num_kv_heads(parallel_config)  # this rank's
        self.head_size = model_config.get_head_size()
        self.dtype = model_config.dtype
        self.attn_backend = attn_backend  # the model runner's, resolved once
        self.gpu_cache = self._allocate(cache_config.num_gpu_blocks, device)
        # Pinned host memory makes device<->host copies asynchronous on a GPU.
        pin = device.type == "cuda"
        self.cpu_cache = self._allocate(cache_config.num_cpu_blocks, torch.device("cpu"), pin)

    def _allocate(
        self, num_blocks: int, device: torch.device, pin_memory: bool = False
    ) -> list[torch.Tensor]:
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, self.head_size
        )
        # torch.empty: pages are only touched when a block is first written.
        return [
            torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin_memory)
            for _ in range(self.num_layers)
        ]

    def _swap(
        self,
        src_cache: list[torch.Tensor],
        dst_cache: list[torch.Tensor],
        pairs: list[tuple[int, int]],
    ) -> None:
        if not pairs:
            return
        for src_layer, dst_layer in zip(src_cache, dst_cache, strict=True):
            self.attn_backend.swap_blocks(src_layer, dst_layer, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs: CPU pool -> device pool."""
        self._swap(self.cpu_cache, self.gpu_cache, pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs: device pool -> CPU pool."""
        self._swap(self.gpu_cache, self.cpu_cache, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device blocks: copy-on-write of shared blocks."""
        if pairs:
            self.attn_backend.copy_blocks(self.gpu_cache, pairs)

    @staticmethod
    def get_cache_block_size(
        block_size: int, model_config: ModelConfig, parallel_config: ParallelConfig | None = None
    ) -> int:
        """Bytes of one block across all layers on one worker: K and V of
        block_size tokens, for this worker's share of the KV heads."""
        elem = torch.tensor([], dtype=model_config.dtype).element_size()
        num_kv_heads = model_config.get_num_kv_heads(parallel_config)
        per_token = 2 * num_kv_heads * model_config.get_head_size() * elem
        return model_config.get_num_layers() * block_size * per_token
