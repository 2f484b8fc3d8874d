"""`Worker`: owns the model runner and the KV cache on one device.

Each step it first applies the scheduler's block moves (swap in, swap out,
copy-on-write), then runs the model on the scheduled batch.
"""

from __future__ import annotations

import torch

from minivllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    default_cpu_kv_cache_bytes,
)
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.sequence import SequenceGroupMetadata
from minivllm.worker.cache_engine import CacheEngine
from minivllm.worker.model_runner import ModelRunner


class Worker:
    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, device_config: DeviceConfig
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = device_config.torch_device
        self.model_runner = ModelRunner(model_config, cache_config, device_config)
        self.cache_engine: CacheEngine | None = None

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) that fit the memory budgets."""
        cfg = self.cache_config
        block_bytes = CacheEngine.get_cache_block_size(cfg.block_size, self.model_config)
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            # What is left of the allowed fraction after the weights; the
            # activations of one step are small next to the cache here.
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free)
        else:
            budget = default_cpu_kv_cache_bytes()
        num_gpu_blocks = budget // block_bytes
        if cfg.num_gpu_blocks_override is not None:
            num_gpu_blocks = cfg.num_gpu_blocks_override
        if num_gpu_blocks < 1:
            raise ValueError(
                f"The KV-cache budget of {budget} bytes holds no block of {block_bytes} bytes; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization or lower block_size."
            )
        num_cpu_blocks = int(cfg.swap_space * (1 << 30)) // block_bytes
        return num_gpu_blocks, num_cpu_blocks

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks
        self.cache_engine = CacheEngine(self.cache_config, self.model_config, self.device)

    @property
    def gpu_cache(self) -> list[torch.Tensor]:
        return self.cache_engine.gpu_cache

    def execute_model(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        blocks_to_swap_in: list[tuple[int, int]],
        blocks_to_swap_out: list[tuple[int, int]],
        blocks_to_copy: list[tuple[int, int]],
    ) -> SamplerOutput:
        self.cache_engine.swap_in(blocks_to_swap_in)
        self.cache_engine.swap_out(blocks_to_swap_out)
        self.cache_engine.copy(blocks_to_copy)
        if not seq_group_metadata_list:
            return SamplerOutput([])
        return self.model_runner.execute_model(seq_group_metadata_list, self.gpu_cache)
