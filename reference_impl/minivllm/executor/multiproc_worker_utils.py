"""Workers in processes of their own, called like local objects (vLLM's
`multiproc_worker_utils.py`).

`ProcessWorkerWrapper` starts one worker process (spawned: a fresh
interpreter, so no CUDA or thread state is inherited) and sends it
`(task_id, method, args)` on its task queue; every process answers on one
shared result queue, which a `ResultHandler` thread reads to complete the
caller's `Future`. A worker that raises sends the error back and waits for
the next task; the executor fails the call with it. A `WorkerMonitor`
thread waits on the processes: one that dies unasked fails every pending
call with its rank and exit code, and the others are stopped. Each worker
process also watches its parent and exits when the parent is gone, so no
worker outlives a killed engine.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from minivllm.model_executor.models import ModelRegistry

logger = logging.getLogger(__name__)

_STOP = None  # on a task queue: leave the task loop


class ResultHandler(threading.Thread):
    """Completes each task's Future from the shared result queue.

    Only the workers write to that queue. A queue's writers share one lock,
    and a worker killed while it held it (or that exited before its queue's
    feeder thread had let go) leaves it held for good: a put from this
    process would then wait forever, at shutdown or in the interpreter's
    exit, joining the feeder thread. So the handler is stopped by an event,
    which it checks between short waits for a result."""

    _POLL_S = 0.1

    def __init__(self, context) -> None:
        super().__init__(daemon=True, name="minivllm-result-handler")
        self.result_queue = context.Queue()
        self.tasks: dict[int, Future] = {}
        self.closed = threading.Event()

    def run(self) -> None:
        while not self.closed.is_set():
            try:
                task_id, value, error = self.result_queue.get(timeout=self._POLL_S)
            except queue.Empty:
                continue
            future = self.tasks.pop(task_id, None)
            if future is None:
                continue
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(error))

    def fail_all(self, message: str) -> None:
        for task_id in list(self.tasks):
            future = self.tasks.pop(task_id, None)
            if future is not None and not future.done():
                future.set_exception(RuntimeError(message))

    def close(self) -> None:
        self.closed.set()


class ProcessWorkerWrapper:
    _task_ids = itertools.count()

    def __init__(self, context, result_handler: ResultHandler, rank: int,
                 worker_args: tuple, num_threads: int) -> None:
        self.rank = rank
        self.result_handler = result_handler
        self.tasks = context.Queue()
        self.process = context.Process(
            target=_run_worker_process,
            args=(rank, worker_args, ModelRegistry.registered(), num_threads, self.tasks,
                  result_handler.result_queue),
            name=f"minivllm-worker-rank{rank}",
            daemon=True,
        )
        self.process.start()

    def execute_method(self, method: str, *args: Any) -> Future:
        future: Future = Future()
        task_id = next(self._task_ids)
        self.result_handler.tasks[task_id] = future
        self.tasks.put((task_id, method, args))
        return future

    def terminate(self, timeout: float = 5.0) -> None:
        if self.process.is_alive():
            self.tasks.put(_STOP)
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class WorkerMonitor(threading.Thread):
    """Notices a worker process that exits while the executor still needs it."""

    def __init__(self, workers: list[ProcessWorkerWrapper], result_handler: ResultHandler) -> None:
        super().__init__(daemon=True, name="minivllm-worker-monitor")
        self.workers = workers
        self.result_handler = result_handler
        self.closing = False
        self.failure: str | None = None

    def run(self) -> None:
        sentinels = {w.process.sentinel: w for w in self.workers}
        dead = wait(list(sentinels))
        if self.closing:
            return
        worker = sentinels[dead[0]]
        self.failure = (
            f"worker rank {worker.rank} (pid {worker.process.pid}) died unexpectedly "
            f"with exit code {_exit_code(worker.process)}"
        )
        logger.error("%s; stopping the other workers", self.failure)
        self.result_handler.fail_all(self.failure)
        for other in self.workers:
            if other is not worker:
                other.terminate(timeout=1.0)


def _exit_code(process, patience: float = 1.0) -> int | None:
    """The exit code of a process that has exited. Another thread may be
    reaping it at the same moment (a test that kills and joins it), and
    until that thread has stored the code, `exitcode` still reads None."""
    deadline = time.monotonic() + patience
    process.join()
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode


def _exit_with_parent() -> None:
    """In a worker: exit as soon as the engine's process is gone."""
    wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def _run_worker_process(rank: int, worker_args: tuple, registered_models: dict,
                        num_threads: int, tasks, results) -> None:
    from minivllm import envs

    envs.set_numba_num_threads(num_threads)  # before Numba starts its pool
    import torch

    from minivllm.model_executor.models import ModelRegistry
    from minivllm.worker.worker import Worker

    for architecture, model_cls in registered_models.items():
        ModelRegistry.register_model(architecture, model_cls)

    threading.Thread(target=_exit_with_parent, daemon=True).start()
    # Ctrl-C in a terminal reaches the whole process group: the engine's
    # process handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    worker = None
    for task_id, method, args in iter(tasks.get, _STOP):
        try:
            if worker is None:
                worker = Worker(*worker_args)
            results.put((task_id, getattr(worker, method)(*args), None))
        except BaseException as error:  # noqa: BLE001 - sent to the engine
            message = f"worker rank {rank}: {type(error).__name__}: {error}"
            results.put((task_id, None, message + "\n" + traceback.format_exc()))
