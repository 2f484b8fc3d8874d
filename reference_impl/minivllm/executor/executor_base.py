"""`ExecutorBase`: what the engine asks of wherever its workers run.

The engine never talks to a worker directly: it asks the executor to size
the KV cache (`determine_num_available_blocks`, the minimum over workers,
since every rank holds the same blocks for its heads), to allocate it
(`initialize_cache`) and to run each step (`execute_model`). Whether that is
one worker in this process or several behind collectives is the executor's
business (vLLM's `vllm/executor/executor_base.py`).
"""

from __future__ import annotations

from minivllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.sequence import ExecuteModelRequest


class ExecutorBase:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        parallel_config: ParallelConfig,
        scheduler_config: SchedulerConfig,
        device_config: DeviceConfig,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.parallel_config = parallel_config
        # Its max_num_seqs bounds the batch sizes CUDA graphs are captured
        # for: the driver's worker gets it (the ranks beyond capture none).
        self.scheduler_config = scheduler_config
        self.device_config = device_config
        self._init_executor()

    def _init_executor(self) -> None:
        """Start the workers, join them into a group, load the model."""
        raise NotImplementedError

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) every worker can hold."""
        raise NotImplementedError

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        raise NotImplementedError

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> SamplerOutput:
        raise NotImplementedError

    def stop_remote_worker_execution_loop(self) -> None:
        """Release the workers beyond the driver from waiting for a step (none here)."""

    def check_health(self) -> None:
        """Raise if a worker is gone: the engine cannot run another step."""

    def shutdown(self) -> None:
        """Stop the workers this executor started (idempotent)."""

    def __del__(self) -> None:
        self.shutdown()
