"""Ray for the tensor-parallel workers (vLLM's `vllm/executor/ray_utils.py`).

A Ray cluster (a local one started here, or the one `ray.init(address=...)`
or `RAY_ADDRESS` points at) places one bundle of resources per rank in a
placement group, so the ranks land where there is a device for each. The
workers are Ray actors wrapping an ordinary `Worker`.
"""

from __future__ import annotations

from typing import Any

from minivllm.config import ParallelConfig

try:
    import ray
    from ray.util.placement_group import PlacementGroup
except ImportError:  # the executor says how to install it when asked for
    ray = None
    PlacementGroup = Any


class RayWorkerWrapper:
    """An actor holding one rank's `Worker`, built on its first call (so a
    failure to build it is reported like any other call, with its rank)."""

    def __init__(self, rank: int, worker_args: tuple, registered_models: dict) -> None:
        import torch

        from minivllm import envs
        from minivllm.model_executor.models import ModelRegistry

        # Ray sets the actor's OpenMP threads (so torch's) to its cores;
        # Numba's pool, started later, gets as many.
        envs.set_numba_num_threads(torch.get_num_threads())
        self.rank = rank
        self.worker_args = worker_args
        self.worker = None
        for architecture, model_cls in registered_models.items():
            ModelRegistry.register_model(architecture, model_cls)

    def execute_method(self, method: str, *args: Any) -> Any:
        from minivllm.worker.worker import Worker

        try:
            if self.worker is None:
                self.worker = Worker(*self.worker_args)
            return getattr(self.worker, method)(*args)
        except Exception as error:
            raise RuntimeError(f"worker rank {self.rank}: {type(error).__name__}: {error}") from (
                error
            )


def ray_is_available() -> bool:
    return ray is not None


def initialize_ray_cluster(parallel_config: ParallelConfig, device: str) -> PlacementGroup:
    """Connect to Ray (starting a local instance if this process has not
    connected yet) and reserve one bundle per rank: a GPU each on a GPU, a
    CPU each on a CPU."""
    if ray is None:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'minivllm[ray]' "
            "(or pip install ray)"
        )
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    resource = "GPU" if device == "cuda" else "CPU"
    bundles = [{resource: 1.0}] * parallel_config.world_size
    placement_group = ray.util.placement_group(bundles, strategy="PACK")
    try:
        ray.get(placement_group.ready(), timeout=60)
    except ray.exceptions.GetTimeoutError as error:
        ray.util.remove_placement_group(placement_group)
        raise ValueError(
            f"tensor_parallel_size={parallel_config.world_size} needs "
            f"{parallel_config.world_size} {resource}s in the Ray cluster; it has "
            f"{ray.cluster_resources().get(resource, 0):g}"
        ) from error
    return placement_group
