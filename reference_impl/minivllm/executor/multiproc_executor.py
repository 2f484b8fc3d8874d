"""`MultiprocessingExecutor`: tensor parallelism on one machine (vLLM's
`MultiprocessingGPUExecutor`): rank 0 is the driver, in the engine's
process; ranks 1..tp-1 are worker processes it starts and stops. They form
one `torch.distributed` group over 127.0.0.1 (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import atexit
import multiprocessing
import sys
import weakref
from concurrent.futures import Future
from typing import Any

import torch

from minivllm.executor.distributed_executor import DistributedExecutor
from minivllm.executor.multiproc_worker_utils import (
    ProcessWorkerWrapper,
    ResultHandler,
    WorkerMonitor,
)
from minivllm.utils import get_open_port

# Executors whose workers are running. At exit they are shut down before
# multiprocessing's own exit hook (registered earlier, so run later) kills
# the daemon worker processes: the monitor must know it is not a crash.
_LIVE_EXECUTORS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_live_executors() -> None:
    for executor in list(_LIVE_EXECUTORS):
        executor.shutdown()


class MultiprocessingExecutor(DistributedExecutor):
    def _init_executor(self) -> None:
        world_size = self.parallel_config.world_size
        if self.device_config.device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} GPUs on this machine; "
                f"torch sees {torch.cuda.device_count()}"
            )
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        # On a CPU the ranks share the cores: split them, or every rank's
        # matmuls would fight over all of them.
        self._threads_before = num_threads = torch.get_num_threads()
        if self.device_config.device == "cpu":
            num_threads = max(1, num_threads // world_size)
            torch.set_num_threads(num_threads)  # the driver's share, until shutdown
        context = multiprocessing.get_context("spawn")
        self.result_handler = ResultHandler(context)
        self.result_handler.start()
        self.workers = [
            ProcessWorkerWrapper(
                context, self.result_handler, rank,
                (self.model_config, self.cache_config, self.device_config,
                 self.parallel_config, rank, init_method),
                num_threads,
            )
            for rank in range(1, world_size)
        ]
        self.worker_monitor = WorkerMonitor(self.workers, self.result_handler)
        self.worker_monitor.start()
        self._closed = False
        _LIVE_EXECUTORS.add(self)
        try:
            self._init_workers(init_method)
        except BaseException:
            self.shutdown()
            raise

    def _call_workers(self, method: str, *args: Any) -> list[Future]:
        return [w.execute_method(method, *args) for w in self.workers]

    def _worker_failure(self, patience: float = 0.0) -> str | None:
        if self.worker_monitor.failure is None and patience:
            self.worker_monitor.join(patience)  # it ends once it has handled a death
        return self.worker_monitor.failure

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.worker_monitor.closing = True
        if sys.is_finalizing():  # too late for threads and queues: just stop them
            for worker in self.workers:
                worker.process.kill()
            return
        if self.worker_monitor.failure is None:
            try:
                self.stop_remote_worker_execution_loop()
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        for worker in self.workers:
            worker.terminate(timeout=0 if self.step_failed else 5.0)
        self.result_handler.close()
        self._leave_group()
        torch.set_num_threads(self._threads_before)
