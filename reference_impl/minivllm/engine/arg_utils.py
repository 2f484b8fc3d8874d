"""`EngineArgs`: every engine option by its vLLM name, turned into configs.

`LLM(**kwargs)` and `LLMEngine.from_engine_args` both go through here, so an
option is spelled, defaulted and validated in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minivllm.assets import DEFAULT_MODEL
from minivllm.attention.selector import select_attention_backend
from minivllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from minivllm.utils import check_bool, check_int


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    device: str = "auto"
    # No model: pseudo-random tokens through the real scheduler, for tracing
    # and timing scheduling alone (worker/dry_run_worker.py).
    dry_run: bool = False
    # "torch" | "numba" | "cuda", or an implementation class (like
    # TorchPagedAttention); None: $MINIVLLM_ATTENTION_BACKEND, else "auto"
    # (attention/selector.py).
    attention_backend: str | type | None = None
    # KV cache
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4.0
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False
    # Scheduler
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    preemption_mode: str | None = None
    enable_chunked_prefill: bool = False
    scheduling_policy: str = "fcfs"
    # A learner's (or any) replacement component: a class or "module.Class".
    scheduler_cls: str | type = "minivllm.core.scheduler.Scheduler"
    block_manager_cls: str | type = "minivllm.core.block_manager.BlockSpaceManager"
    # Off by default, as in vLLM's `LLM`: the periodic throughput log line.
    # `LLMEngine.get_stats()` works either way.
    disable_log_stats: bool = True
    # Accepted so vLLM code runs unchanged; only their single-device,
    # eager values are possible here.
    tensor_parallel_size: int = 1
    enforce_eager: bool = True

    @classmethod
    def from_kwargs(cls, caller: str, **kwargs) -> EngineArgs:
        """Like EngineArgs(**kwargs), but an unknown name is a clear error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"{caller} got unexpected keyword argument(s) {unknown}. "
                f"Accepted engine arguments: {', '.join(sorted(names))}"
            )
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        """The configs; each checks its own options (types, ranges) when made,
        and the options that have no config are checked here."""
        check_int(
            "tensor_parallel_size",
            self.tensor_parallel_size,
            low=1,
            high=1,
            allowed="1 (minivllm runs on one device)",
        )
        # Both values run the same (eagerly): vLLM code that sets it runs unchanged.
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("disable_log_stats", self.disable_log_stats)
        device_config = DeviceConfig(self.device)
        model_config = ModelConfig(
            # No model named: the small story model that ships in the package,
            # so `LLM()` works offline and prints readable text.
            model=DEFAULT_MODEL if self.model is None else self.model,
            tokenizer=self.tokenizer,
            trust_remote_code=self.trust_remote_code,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            device=device_config.device,
            dry_run=self.dry_run,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            swap_space=self.swap_space,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        model_config.attention_backend = select_attention_backend(
            self.attention_backend,
            device_config.device,
            model_config.dtype,
            model_config.get_head_size(),
            cache_config.block_size,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            preemption_mode=self.preemption_mode,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
            scheduler_cls=self.scheduler_cls,
            block_manager_cls=self.block_manager_cls,
        )
        return EngineConfig(model_config, cache_config, scheduler_config, device_config)
