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

import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

from minivllm.distributed import destroy_distributed_environment, destroy_model_parallel
from minivllm.executor.uniproc_executor import UniProcExecutor
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.sequence import ExecuteModelRequest


def _in_daemon_thread(fn, *args: Any) -> Future:
    """fn(*args) in a daemon thread: one stuck in a collective whose peer
    died never keeps the interpreter from exiting."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="minivllm-driver-call").start()
    return future


class WorkerDiedError(RuntimeError):
    """A worker process or actor is gone; the engine cannot run another step."""


class DistributedExecutor(UniProcExecutor):
    parallel_worker_tasks: list[Future] | None = None
    step_failed = False  # a step failed part-way: the workers cannot be stopped politely

    def _init_workers(self, distributed_init_method: str) -> None:
        """The driver here, then every worker joins the group and loads its shard."""
        self.driver_worker = self._create_worker(0, distributed_init_method)
        self._run_workers("init_device")
        self._run_workers("load_model")

    def _call_workers(self, method: str, *args: Any) -> list[Future]:
        """Start `method(*args)` on every worker but the driver."""
        raise NotImplementedError

    def _run_workers(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every worker; their results by rank. The
        driver's call runs in a thread of its own, so that a worker failing
        (or dying) while the driver waits for it in a collective is reported
        at once instead of when the collective times out."""
        self.check_health()
        self.stop_remote_worker_execution_loop()
        futures = self._call_workers(method, *args)
        futures.insert(0, _in_daemon_thread(getattr(self.driver_worker, method), *args))
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                raise future.exception()
        return [f.result() for f in futures]

    def _start_worker_execution_loop(self) -> list[Future]:
        return self._call_workers("start_worker_execution_loop")

    def _worker_failure(self, patience: float = 0.0) -> str | None:
        """Which worker is gone and why, once one is. With `patience`, wait
        that long for the news: the driver's collective can fail on the
        closed connection before the executor has seen the process end."""
        raise NotImplementedError

    def determine_num_available_blocks(self) -> tuple[int, int]:
        blocks = self._run_workers("determine_num_available_blocks")
        return min(b[0] for b in blocks), min(b[1] for b in blocks)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks
        self._run_workers("initialize_cache", num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req: ExecuteModelRequest) -> SamplerOutput:
        try:
            self.check_health()
            if self.parallel_worker_tasks is None:
                self.parallel_worker_tasks = self._start_worker_execution_loop()
            return super().execute_model(execute_model_req)
        except BaseException as error:
            # The other ranks are somewhere inside this step, where no stop
            # message reaches them: they are stopped by force and the group
            # is left, so that nothing waits on a peer that will never come
            # and a new engine can form a group of its own in this process.
            failure = self._worker_failure(patience=1.0)
            self.step_failed = True
            self.parallel_worker_tasks = None
            self.shutdown()
            if failure is None:
                raise
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
        """Leave the group, if the driver got as far as joining one: an
        engine refused for finding another's group must not break it."""
        if getattr(self, "driver_worker", None) is not None and self.driver_worker.in_group:
            destroy_model_parallel()
            destroy_distributed_environment()
