"""`DistributedExecutor`: the driver worker here, the other ranks elsewhere
(vLLM's `DistributedGPUExecutor`). How the others are started and called is
the subclass's (`MultiprocessingExecutor`, `RayExecutor`): `_run_workers`.

Each step, the driver worker broadcasts the step to the others (see
`Worker.execute_model`), so the executor calls only the driver; the other
workers sit in `start_worker_execution_loop`, started on the first step and
stopped when the engine has nothing left to run, or before any other call
that needs every worker.

A rank that raises or dies part-way through a call leaves the others
waiting for it in a collective, until gloo gives up after 30 minutes (vLLM
v0.6 waits that long). So the driver's calls run in a thread of their own
(`DriverThread`) while the caller watches every rank's: the first failure
fails the call at once, with that rank's error, and shuts the workers down,
which ends the driver's wait on their closed connections; the group is left
only once the driver's call has ended.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from typing import Any

from minivllm.distributed import destroy_distributed_environment, destroy_model_parallel
from minivllm.executor.uniproc_executor import UniProcExecutor
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.sequence import ExecuteModelRequest

logger = logging.getLogger(__name__)

# How long shutdown waits for a driver call given up on: long enough for a
# model to finish loading; a call still running then is stuck for good.
DRIVER_CALL_GRACE_S = 60.0


class DriverThread:
    """Runs the driver worker's calls, one at a time, in one daemon thread.

    One thread for the executor's life rather than one per call: every
    thread that runs torch ops gets its own OpenMP team (and CUDA keeps the
    current device per thread). Daemon, so that a call stuck in a collective
    never keeps the interpreter from exiting; shutdown waits for it instead."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.last_call: Future | None = None
        threading.Thread(target=self._run, daemon=True, name="minivllm-driver").start()

    def submit(self, fn, *args: Any) -> Future:
        """fn(*args) in the driver's thread, with the caller's context variables."""
        future: Future = Future()
        self._calls.put((future, contextvars.copy_context(), fn, args))
        self.last_call = future
        return future

    def _run(self) -> None:
        for future, context, fn, args in iter(self._calls.get, None):
            try:
                future.set_result(context.run(fn, *args))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)

    def close(self, timeout: float) -> bool:
        """End the thread after its last call; whether that call ended
        within `timeout` seconds."""
        self._calls.put(None)
        if self.last_call is not None:
            wait([self.last_call], timeout)
        return self.last_call is None or self.last_call.done()


class WorkerDiedError(RuntimeError):
    """A worker process or actor is gone; the engine cannot run another step."""


class DistributedExecutor(UniProcExecutor):
    parallel_worker_tasks: list[Future] | None = None
    driver_thread: DriverThread | None = None
    step_failed = False  # a call failed part-way: the workers cannot be stopped politely

    def _init_workers(self, distributed_init_method: str) -> None:
        """The driver here, then every worker joins the group and loads its shard."""
        self.driver_thread = DriverThread()
        self.driver_worker = self._create_worker(0, distributed_init_method)
        self._run_workers("init_device")
        self._run_workers("load_model")

    def _call_workers(self, method: str, *args: Any) -> list[Future]:
        """Start `method(*args)` on every worker but the driver."""
        raise NotImplementedError

    def _run_workers(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every worker; their results by rank. A rank
        that fails fails the call at once (the others may be waiting for it
        in a collective), and the executor with it."""
        self.check_health()
        self.stop_remote_worker_execution_loop()
        futures = self._call_workers(method, *args)
        futures.insert(0, self.driver_thread.submit(getattr(self.driver_worker, method), *args))
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                self.step_failed = True
                self.shutdown()
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
            return self._driver_step(execute_model_req)
        except BaseException as error:
            # The other ranks are somewhere inside this step, where no stop
            # message reaches them: they are stopped by force and the group
            # is left, so that nothing waits on a peer that will never come
            # and a new engine can form a group of its own in this process.
            tasks, self.parallel_worker_tasks = self.parallel_worker_tasks or [], None
            known = any(task.done() for task in tasks)  # a worker's loop failed first
            failure = self._worker_failure(patience=0.0 if known else 1.0)
            self.step_failed = True
            self.shutdown()
            if failure is None:
                raise
            raise WorkerDiedError(f"{failure}; the engine has shut down its workers") from error

    def _driver_step(self, execute_model_req: ExecuteModelRequest) -> SamplerOutput:
        """The driver's part of the step, while this thread watches the
        other ranks' loops: one that ends mid-step (its worker raised, or
        died) fails the step with its error, and the driver's call, waiting
        for that rank in a collective, is given up on."""
        driver = self.driver_thread.submit(super().execute_model, execute_model_req)
        wait([driver, *self.parallel_worker_tasks], return_when=FIRST_COMPLETED)
        if driver.done():
            return driver.result()
        ended = next(task for task in self.parallel_worker_tasks if task.done())
        rank = self.parallel_worker_tasks.index(ended) + 1
        raise ended.exception() or RuntimeError(f"worker rank {rank} left its loop mid-step")

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
        """Once the workers are stopped: wait for the driver's last call
        (stopping them ended any wait for them in a collective), then leave
        the group, if the driver got as far as joining one (an engine
        refused for finding another's group must not break it). A driver
        call that never ends keeps the group: destroying it under a running
        collective could crash the process."""
        if self.driver_thread is not None and not self.driver_thread.close(DRIVER_CALL_GRACE_S):
            logger.error(
                "the driver worker's call is still running %.0f s after the workers were "
                "stopped; it is left running, and the process group with it",
                DRIVER_CALL_GRACE_S,
            )
            return
        if getattr(self, "driver_worker", None) is not None and self.driver_worker.in_group:
            destroy_model_parallel()
            destroy_distributed_environment()
