"""`EngineCore`: V1's inner loop, schedule → execute → update (vLLM's
`vllm/v1/engine/core.py`).

It knows token ids only. The front end (`LLMEngine`, `AsyncLLM`) tokenizes,
detokenizes and finds stop strings, and talks to it through a client
(core_client.py): in the same process, or in a process of its own so that
the model runs while the front end handles text and HTTP.
"""

from __future__ import annotations

from minivllm.config import EngineConfig, SchedulerConfig
from minivllm.core.scheduler import Scheduler as ClassicScheduler
from minivllm.utils import cdiv
from minivllm.v1.core.kv_cache_utils import get_request_block_hasher
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from minivllm.v1.executor.uniproc_executor import UniProcExecutor
from minivllm.v1.request import Request, RequestStatus


def get_scheduler_cls(scheduler_config: SchedulerConfig) -> type[Scheduler]:
    """The scheduler class: V1's own, unless `scheduler_cls` names a
    subclass of it (a lab plugs a learner's in this way, as vLLM's
    `scheduler_cls` option does). The option's default is the classic
    engine's scheduler, which means V1's here."""
    cls = scheduler_config.scheduler_cls
    if isinstance(cls, type) and issubclass(cls, Scheduler):
        return cls
    if cls is ClassicScheduler:
        return Scheduler
    raise ValueError(
        f"scheduler_cls={getattr(cls, '__qualname__', cls)} is not a V1 scheduler; with "
        "use_v1=True it must subclass minivllm.v1.core.sched.scheduler.Scheduler"
    )


class EngineCore:
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self.model_executor = UniProcExecutor(engine_config)
        self._initialize_kv_caches()
        self.scheduler = get_scheduler_cls(engine_config.scheduler_config)(
            engine_config.scheduler_config, engine_config.cache_config
        )
        cache_config = engine_config.cache_config
        self.block_hasher = (
            get_request_block_hasher(cache_config.block_size)
            if cache_config.enable_prefix_caching
            else None
        )

    def _initialize_kv_caches(self) -> None:
        """Size the KV cache from the worker's memory budget; refuse one that
        cannot hold a single request of max_model_len tokens (it would wait
        forever: V1 cannot swap it out to make room)."""
        config = self.engine_config
        num_gpu_blocks = self.model_executor.determine_num_available_blocks()
        block_size = config.cache_config.block_size
        max_model_len = config.scheduler_config.max_model_len
        needed = cdiv(max_model_len, block_size) + 1  # + the null block
        if num_gpu_blocks < needed:
            raise ValueError(
                f"The KV cache holds {num_gpu_blocks} blocks of {block_size} tokens, one of them "
                f"the null block: too few for one request of max_model_len={max_model_len} "
                f"tokens ({needed} blocks). Raise kv_cache_memory_bytes / "
                "num_gpu_blocks_override, or lower max_model_len."
            )
        self.model_executor.initialize_cache(num_gpu_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request, self.block_hasher))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """One step: (the outputs, whether the model ran)."""
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(), False
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.model_executor.shutdown()
