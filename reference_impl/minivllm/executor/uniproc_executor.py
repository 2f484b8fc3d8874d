"""`UniProcExecutor`: one worker, in the engine's process (vLLM v0.6 calls
the GPU flavour `GPUExecutor`; later versions name it as we do)."""

from __future__ import annotations

from minivllm.executor.executor_base import ExecutorBase
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.sequence import ExecuteModelRequest
from minivllm.worker.dry_run_worker import DryRunWorker
from minivllm.worker.worker import Worker


class UniProcExecutor(ExecutorBase):
    def _init_executor(self) -> None:
        if self.model_config.dry_run:
            self.driver_worker = DryRunWorker(
                self.model_config, self.cache_config, self.device_config
            )
        else:
            self.driver_worker = self._create_worker(rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def _create_worker(self, rank: int, distributed_init_method: str | None = None) -> Worker:
        return Worker(
            self.model_config, self.cache_config, self.device_config, self.parallel_config,
            rank, distributed_init_method, self.scheduler_config,
        )

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.driver_worker.determine_num_available_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.driver_worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> SamplerOutput:
        req = execute_model_req
        return self.driver_worker.execute_model(
            req.seq_group_metadata_list, req.blocks_to_swap_in, req.blocks_to_swap_out,
            req.blocks_to_copy, with_batch=req.with_batch,
        )
