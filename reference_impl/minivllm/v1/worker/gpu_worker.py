"""V1's `Worker` (vLLM's `vllm/v1/worker/gpu_worker.py`).

Device, model loading and the KV-cache budget are the classic worker's;
what changes is the model runner (the persistent batch) and what a step
brings (a `SchedulerOutput`). V1 has no swap space: a preempted request
is recomputed, so no CPU pool is allocated.
"""

from __future__ import annotations

from minivllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.worker.gpu_model_runner import GPUModelRunner
from minivllm.worker.cpu_threads import step_threads
from minivllm.worker.worker import Worker as ClassicWorker


class Worker(ClassicWorker):
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device_config: DeviceConfig,
    ) -> None:
        super().__init__(
            model_config, cache_config, device_config, scheduler_config=scheduler_config
        )
        self.model_runner = GPUModelRunner(
            model_config, cache_config, scheduler_config, device_config
        )

    def determine_num_available_blocks(self) -> tuple[int, int]:
        num_gpu_blocks, _ = super().determine_num_available_blocks()
        return num_gpu_blocks, 0

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        super().initialize_cache(num_gpu_blocks, 0)

    def _warm_up_model(self) -> None:
        """vLLM V1's `compile_or_warm_up_model`: the runner gets the cache,
        then captures its decode graphs where the classic worker would."""
        self.model_runner.initialize_kv_cache(self.gpu_cache)
        if self.captures_cuda_graphs():
            self.model_runner.capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        num_tokens = scheduler_output.total_num_scheduled_tokens
        with step_threads(num_tokens, self.one_thread_max_tokens):
            return self.model_runner.execute_model(scheduler_output)
