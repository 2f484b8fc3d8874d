"""`UniProcExecutor`: V1's executor for one worker in this process (vLLM's
`vllm/v1/executor/uniproc_executor.py`). minivllm's V1 runs on one device;
tensor parallelism is the classic engine's (Day 14)."""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.worker.gpu_worker import Worker


class UniProcExecutor:
    def __init__(self, engine_config: EngineConfig) -> None:
        tp = engine_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(
                f"tensor_parallel_size={tp}: minivllm's V1 engine runs on one device; "
                "use the classic engine (use_v1=False) for tensor parallelism"
            )
        self.driver_worker = Worker(
            engine_config.model_config,
            engine_config.cache_config,
            engine_config.scheduler_config,
            engine_config.device_config,
        )
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def determine_num_available_blocks(self) -> int:
        return self.driver_worker.determine_num_available_blocks()[0]

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        self.driver_worker.initialize_cache(num_gpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Nothing runs elsewhere; the worker goes with this object."""
