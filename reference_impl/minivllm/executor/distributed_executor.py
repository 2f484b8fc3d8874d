"""`DistributedExecutor`: the driver worker here, the other ranks elsewhere
(vLLM's `DistributedGPUExecutor`). How the others are started and called is
the subclass's (`MultiprocessingExecutor`, `RayExecutor`): `_run_workers`.

Each step, the driver worker broadcasts the step to the others (see
`Worker.execute_model`), so the executor calls only the driver; the other
workers sit in `start_worker_execution_loop`, started on the first step and
stopped when the engine has nothing left to run, or before any other call
that needs every worker.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from minivllm.distributed import destroy_distributed_environment, destroy_model_parallel
from minivllm.executor.uniproc_executor import UniProcExecutor
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.sequence import ExecuteModelRequest


class WorkerDiedError(RuntimeError):
    """A worker process or actor is gone; the engine cannot run another step."""


class DistributedExecutor(UniProcExecutor):
    parallel_worker_tasks: list[Future] | None = None

    def _init_workers(self, distributed_init_method: str) -> None:
        """The driver here, then every worker joins the group and loads its shard."""
        self.driver_worker = self._create_worker(0, distributed_init_method)
        self._run_workers("init_device")
        self._run_workers("load_model")

    def _run_workers(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every worker, the driver's call in this thread;
        their results by rank."""
        raise NotImplementedError

    def _start_worker_execution_loop(self) -> list[Future]:
        raise NotImplementedError

    def _worker_failure(self) -> str | None:
        """Which worker is gone and why, once one is."""
        raise NotImplementedError

    def determine_num_available_blocks(self) -> tuple[int, int]:
        blocks = self._run_workers("determine_num_available_blocks")
        return min(b[0] for b in blocks), min(b[1] for b in blocks)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks
        self._run_workers("initialize_cache", num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> SamplerOutput:
        self.check_health()
        if self.parallel_worker_tasks is None:
            self.parallel_worker_tasks = self._start_worker_execution_loop()
        try:
            return super().execute_model(execute_model_req)
        except Exception as error:
            failure = self._worker_failure()
            if failure is None:
                raise
            self.shutdown()
            raise WorkerDiedError(f"{failure}; the engine has shut down its workers") from error

    def stop_remote_worker_execution_loop(self) -> None:
        if self.parallel_worker_tasks is None:
            return
        tasks, self.parallel_worker_tasks = self.parallel_worker_tasks, None
        self.driver_worker.stop_remote_worker_execution_loop()
        for task in tasks:
            task.result()

    def check_health(self) -> None:
        failure = self._worker_failure()
        if failure is not None:
            raise WorkerDiedError(failure)

    def _leave_group(self) -> None:
        destroy_model_parallel()
        destroy_distributed_environment()
