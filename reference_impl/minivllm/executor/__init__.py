"""Where the workers run (vLLM's `vllm/executor/`): one worker in the
engine's process, or one per tensor-parallel rank in processes or Ray actors."""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.executor.executor_base import ExecutorBase


def get_executor_class(engine_config: EngineConfig) -> type[ExecutorBase]:
    """The executor for these options, as `LLMEngine._get_executor_cls` chooses it."""
    backend = engine_config.parallel_config.distributed_executor_backend
    if engine_config.parallel_config.world_size == 1:
        from minivllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    if backend == "ray":
        from minivllm.executor.ray_executor import RayExecutor

        return RayExecutor
    from minivllm.executor.multiproc_executor import MultiprocessingExecutor

    return MultiprocessingExecutor
