"""`RayExecutor`: tensor parallelism on a Ray cluster (vLLM's `RayGPUExecutor`).

Rank 0 is the driver, in the engine's process, as with multiprocessing;
ranks 1..tp-1 are Ray actors placed by a placement group, on this machine
or on any node of the cluster. The ranks meet over TCP at the driver's
address: 127.0.0.1 when the cluster is this machine alone.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

from minivllm.executor.distributed_executor import DistributedExecutor
from minivllm.executor.ray_utils import RayWorkerWrapper, initialize_ray_cluster, ray
from minivllm.model_executor.models import ModelRegistry
from minivllm.utils import get_open_port


def _driver_address() -> str:
    alive = [n for n in ray.nodes() if n["Alive"]]
    return "127.0.0.1" if len(alive) == 1 else ray.util.get_node_ip_address()


class RayExecutor(DistributedExecutor):
    def _init_executor(self) -> None:
        self.placement_group = initialize_ray_cluster(
            self.parallel_config, self.device_config.device
        )
        self._closed = False
        self.workers: list[Any] = []
        self._loop_futures: list[Future] = []
        address = _driver_address()
        # A port free on the address the others will dial ("" binds every interface).
        port = get_open_port(address if address == "127.0.0.1" else "")
        init_method = f"tcp://{address}:{port}"
        resource = {"num_gpus": 1} if self.device_config.device == "cuda" else {"num_cpus": 1}
        actor_cls = ray.remote(**resource)(RayWorkerWrapper)
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        try:
            for rank in range(1, self.parallel_config.world_size):
                self.workers.append(
                    actor_cls.options(
                        scheduling_strategy=strategy(self.placement_group, rank),
                    ).remote(
                        rank,
                        (self.model_config, self.cache_config, self.device_config,
                         self.parallel_config, rank, init_method),
                        ModelRegistry.registered(),
                    )
                )
            self._init_workers(init_method)
        except BaseException:
            self.shutdown()
            raise

    def _call_workers(self, method: str, *args: Any) -> list[Future]:
        return [w.execute_method.remote(method, *args).future() for w in self.workers]

    def _start_worker_execution_loop(self) -> list[Future]:
        self._loop_futures = super()._start_worker_execution_loop()
        return self._loop_futures

    def _worker_failure(self, patience: float = 0.0) -> str | None:
        if patience and self._loop_futures:
            wait(self._loop_futures, timeout=patience, return_when=FIRST_EXCEPTION)
        for rank, future in enumerate(self._loop_futures, start=1):
            if future.done() and future.exception() is not None:
                return f"worker rank {rank} (a Ray actor) failed: {future.exception()}"
        return None

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._worker_failure() is None:
            try:
                self.stop_remote_worker_execution_loop()
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        for worker in self.workers:
            ray.kill(worker)
        ray.util.remove_placement_group(self.placement_group)
        self._leave_group()
