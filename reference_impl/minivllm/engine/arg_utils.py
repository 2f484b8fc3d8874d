"""`EngineArgs`: every engine option by its vLLM name, turned into configs.

`LLM(**kwargs)` and `LLMEngine.from_engine_args` both go through here, so an
option is spelled, defaulted and validated in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from minivllm import envs
from minivllm.assets import DEFAULT_MODEL
from minivllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from minivllm.utils import check_bool, is_int

logger = logging.getLogger(__name__)


def _json_object(text: str) -> dict:
    """A flag's JSON object (`--kv-events-config '{...}'`), as vLLM's config
    flags. argparse shows an ArgumentTypeError's own message."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


# The command-line type of each option's annotation (classes come by name).
_CLI_TYPES = {
    "KVEventsConfig | dict | None": _json_object,
    "str": str,
    "str | None": str,
    "int": int,
    "int | None": int,
    "float": float,
    "str | type": str,
    "str | type | None": str,
}


def v1_default_max_num_batched_tokens(device: str, tensor_parallel_size: object) -> int:
    """V1's token budget per step when none is given, as vLLM's
    `EngineArgs.get_batch_defaults` sets it for its `LLM` class: 4096 per
    worker on a CPU, 8192 on a GPU (vllm_differences row 61 says where vLLM
    has more cases)."""
    if device == "cpu":
        workers = tensor_parallel_size if is_int(tensor_parallel_size) else 1
        return 4096 * max(workers, 1)  # an invalid size is refused by ParallelConfig
    return 8192


def _option(default, help: str, **cli) -> Any:
    """One engine option: its default (taken from the config class that owns
    it, so it is written once) and its help, which `add_cli_args` shows.
    `cli` holds extra argparse settings (choices, metavar)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """Every engine option, by vLLM's name: `LLM(**kwargs)`, `LLMEngine` and
    (through `add_cli_args`) any command line take exactly these."""

    model: str | None = _option(
        None, "checkpoint directory or hub id (default: the shipped story model)"
    )
    tokenizer: str | None = _option(ModelConfig.tokenizer, "tokenizer location (default: model)")
    trust_remote_code: bool = _option(
        ModelConfig.trust_remote_code, "run the checkpoint's own modelling code"
    )
    dtype: str = _option(
        ModelConfig.dtype,
        "weights and activations ('auto': float32 on a CPU, the checkpoint's on a GPU)",
        choices=["auto", "float32", "float", "float16", "half", "bfloat16"],
    )
    seed: int = _option(ModelConfig.seed, "seed of the sampler's shared generator")
    max_model_len: int | None = _option(
        ModelConfig.max_model_len, "longest sequence (default: the model's context length)"
    )
    device: str = _option(DeviceConfig.device, "where to run", choices=["auto", "cpu", "cuda"])
    dry_run: bool = _option(
        ModelConfig.dry_run,
        "no weights: pseudo-random tokens through the real scheduler (worker/dry_run_worker.py)",
    )
    attention_backend: str | type | None = _option(
        ModelConfig.attention_backend,
        "torch, numba, cuda or auto, or an implementation class (default: "
        "$MINIVLLM_ATTENTION_BACKEND, else auto; attention/selector.py)",
    )
    # KV cache
    block_size: int = _option(CacheConfig.block_size, "tokens per KV-cache block")
    gpu_memory_utilization: float = _option(
        CacheConfig.gpu_memory_utilization, "fraction of GPU memory for weights and KV cache"
    )
    kv_cache_memory_bytes: int | None = _option(
        CacheConfig.kv_cache_memory_bytes,
        "KV-cache size in bytes (default: $MINIVLLM_CPU_KVCACHE_SPACE GiB on a CPU, "
        "gpu_memory_utilization on a GPU)",
    )
    swap_space: float = _option(CacheConfig.swap_space, "CPU swap pool for SWAP preemption, GiB")
    num_gpu_blocks_override: int | None = _option(
        CacheConfig.num_gpu_blocks_override, "device blocks, whatever the memory budget"
    )
    enable_prefix_caching: bool | None = _option(
        None,
        "share the KV blocks of common prompt prefixes (default: on with V1, off with the "
        "classic engine)",
    )
    # Scheduler
    max_num_seqs: int | None = _option(
        None,
        f"most sequences in one step (default: {SchedulerConfig.max_num_seqs}; with V1 at most "
        "max_num_batched_tokens)",
    )
    max_num_batched_tokens: int | None = _option(
        SchedulerConfig.max_num_batched_tokens,
        "most tokens in one step (default: with V1 4096 per worker on a CPU, 8192 on a GPU, "
        "and at least max_model_len without chunked prefill; classic: 512 with chunked "
        "prefill, else max(max_model_len, 2048))",
    )
    long_prefill_token_threshold: int = _option(
        SchedulerConfig.long_prefill_token_threshold,
        "V1: at most this many tokens of one prompt in a step, so short requests are not kept "
        "waiting behind a long one (0: no cap)",
    )
    scheduler_reserve_full_isl: bool = _option(
        SchedulerConfig.scheduler_reserve_full_isl,
        "V1: admit a waiting request only when its whole prompt's KV blocks are free, not "
        "only its first chunk's (the classic engine always does)",
    )
    kv_events_config: KVEventsConfig | dict | None = _option(
        None,
        "V1: publish the prefix cache's block events over ZMQ, a KVEventsConfig or its "
        'fields as JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://127.0.0.1:5557"}\' (default: off)',
    )
    preemption_mode: str | None = _option(
        SchedulerConfig.preemption_mode,
        "how to preempt (default: recompute one sequence, swap several)",
        choices=["recompute", "swap"],
    )
    enable_chunked_prefill: bool | None = _option(
        None,
        "split long prompts across steps (default: on with V1, off with the classic engine)",
    )
    scheduling_policy: str = _option(
        SchedulerConfig.scheduling_policy,
        "queue order: arrival, or priority then arrival (core/scheduler.py)",
        choices=["fcfs", "priority"],
    )
    # A learner's (or any) replacement component: a class or "module.Class".
    scheduler_cls: str | type = _option(
        SchedulerConfig.scheduler_cls, "the scheduler class, as 'package.module.Class'"
    )
    block_manager_cls: str | type = _option(
        SchedulerConfig.block_manager_cls, "the block manager class, as 'package.module.Class'"
    )
    # Off by default, as in vLLM's `LLM`: `LLMEngine.get_stats()` works either way.
    disable_log_stats: bool = _option(True, "no periodic throughput log line")
    tensor_parallel_size: int = _option(
        ParallelConfig.tensor_parallel_size, "workers (devices) to shard the model over"
    )
    distributed_executor_backend: str | None = _option(
        ParallelConfig.distributed_executor_backend,
        "how workers beyond the first start: mp (processes here) or ray (default: mp, or "
        "ray if ray.init() was called)",
        choices=["mp", "ray"],
    )
    use_v1: bool | None = _option(
        None,
        "run vLLM's V1 engine (minivllm/v1/) instead of the classic one (default: "
        "$MINIVLLM_USE_V1, else off)",
    )
    # Compilation (compilation/): vLLM's CompilationLevel numbers.
    compilation_level: int = _option(
        ModelConfig.compilation_level,
        "torch.compile of the model forward: 0 no compilation, 1 TorchDynamo as is, 2 "
        "TorchDynamo once (dynamic token count), 3 Inductor, attention left eager "
        "(vLLM's PIECEWISE); one worker only",
        choices=[0, 1, 2, 3],
    )
    enforce_eager: bool = _option(
        ModelConfig.enforce_eager,
        "no CUDA graphs: on a GPU, decode steps are otherwise replayed from graphs captured "
        "per batch size (one worker, a backend that allows it; compilation is "
        "compilation_level's)",
    )
    max_seq_len_to_capture: int = _option(
        ModelConfig.max_seq_len_to_capture,
        "longest context a CUDA graph covers (at most max_model_len); decodes of longer "
        "contexts run eagerly",
    )
    max_logprobs: int = _option(
        ModelConfig.max_logprobs,
        "the most top tokens a request may ask for per position (logprobs, prompt_logprobs)",
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """A flag for every option (`--block-size 8`, `--enable-prefix-caching`,
        `--no-disable-log-stats`), with its default and help, as vLLM's
        `EngineArgs.add_cli_args`; `from_cli_args` turns them back."""
        group = parser.add_argument_group("engine options")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = {k: v for k, v in f.metadata.items() if k != "help"}
            default = f.default if isinstance(f.default, (str, int, float, type(None))) else None
            help_text = f.metadata["help"]
            if "default" not in help_text:
                help_text += f" (default: {default})"
            if f.type in ("bool", "bool | None"):
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
                )
            else:
                group.add_argument(
                    flag, type=_CLI_TYPES[f.type], default=default, help=help_text, **meta
                )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

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

    def resolve_use_v1(self) -> bool:
        """Which engine: `use_v1` if given, else $MINIVLLM_USE_V1 ("1" or "0"),
        else the classic one (vLLM's own switch was VLLM_USE_V1)."""
        if self.use_v1 is not None:
            return check_bool("use_v1", self.use_v1, "None, True or False")
        raw = envs.MINIVLLM_USE_V1
        if raw in (None, "0"):
            return False
        if raw == "1":
            return True
        raise ValueError(f"The environment variable MINIVLLM_USE_V1 must be 0 or 1, got {raw!r}")

    def create_engine_config(self) -> EngineConfig:
        """The configs; each checks its own options (types, ranges) when made,
        and the options that have no config are checked here."""
        check_bool("disable_log_stats", self.disable_log_stats)
        use_v1 = self.resolve_use_v1()
        # V1's defaults (as vLLM's): prefix caching and chunked prefill on,
        # and a token budget per step that depends on the device.
        enable_prefix_caching = self.enable_prefix_caching
        if enable_prefix_caching is None:
            enable_prefix_caching = use_v1
        enable_chunked_prefill = self.enable_chunked_prefill
        if enable_chunked_prefill is None:
            enable_chunked_prefill = use_v1
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
            attention_backend=self.attention_backend,
            compilation_level=self.compilation_level,
            enforce_eager=self.enforce_eager,
            max_seq_len_to_capture=self.max_seq_len_to_capture,
            max_logprobs=self.max_logprobs,
        )
        max_num_seqs, max_num_batched_tokens = self._batch_limits(
            use_v1, enable_chunked_prefill, device_config.device, model_config.max_model_len
        )
        if not use_v1 and self.long_prefill_token_threshold != 0:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} is an option "
                "of the V1 scheduler (vLLM v0.6's had none): use use_v1=True, or leave it 0"
            )
        kv_events_config = self._check_kv_events(use_v1, enable_prefix_caching)
        if not use_v1 and self.scheduler_reserve_full_isl is False:
            raise ValueError(
                "scheduler_reserve_full_isl=False is an option of the V1 scheduler: the classic "
                "engine (vLLM v0.6) always takes a prompt's blocks when it admits it"
            )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            swap_space=self.swap_space,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=enable_prefix_caching,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            preemption_mode=self.preemption_mode,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
            scheduler_cls=self.scheduler_cls,
            block_manager_cls=self.block_manager_cls,
        )
        parallel_config = ParallelConfig(
            self.tensor_parallel_size, self.distributed_executor_backend
        )
        model_config.verify_with_parallel_config(parallel_config)
        self._check_compilation(model_config, parallel_config)
        return EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            device_config,
            parallel_config,
            use_v1,
            kv_events_config,
        )

    def _batch_limits(
        self, use_v1: bool, enable_chunked_prefill: bool, device: str, max_model_len: int
    ) -> tuple[object, object]:
        """(max_num_seqs, max_num_batched_tokens) with the defaults filled in.
        The classic engine's are SchedulerConfig's (vLLM v0.6's). V1's are
        vLLM's `_set_default_max_num_seqs_and_batched_tokens_args`: the
        device's token budget, at least max_model_len without chunked
        prefill (a prompt must fit one step), at least max_num_seqs; and a
        default max_num_seqs no larger than the budget. Values given are
        passed on as they are, for SchedulerConfig to check."""
        max_num_seqs, budget = self.max_num_seqs, self.max_num_batched_tokens
        if not use_v1:
            return SchedulerConfig.max_num_seqs if max_num_seqs is None else max_num_seqs, budget
        if budget is None:
            budget = v1_default_max_num_batched_tokens(device, self.tensor_parallel_size)
            if not enable_chunked_prefill:
                budget = max(budget, max_model_len)
            if is_int(max_num_seqs):
                budget = max(budget, max_num_seqs)
        if max_num_seqs is None:
            max_num_seqs = SchedulerConfig.max_num_seqs
            if is_int(budget):
                max_num_seqs = min(max_num_seqs, budget)
        return max_num_seqs, budget

    def _check_kv_events(self, use_v1: bool, enable_prefix_caching: bool) -> KVEventsConfig | None:
        """The events' config; events that are on need V1, and are empty
        without prefix caching (vLLM warns so too)."""
        config = KVEventsConfig.from_option(self.kv_events_config)
        if config is None or not config.enable_kv_cache_events:
            return config
        if not use_v1:
            raise ValueError(
                "kv_events_config with enable_kv_cache_events=True: KV-cache events are "
                "published by the V1 engine (use_v1=True); vLLM v0.6 had none"
            )
        if not enable_prefix_caching:
            logger.warning(
                "KV-cache events are on but prefix caching is off: no block is ever "
                "cached, so no event is published (enable_prefix_caching=True)"
            )
        return config

    @staticmethod
    def _check_compilation(model_config: ModelConfig, parallel_config: ParallelConfig) -> None:
        """Refuse, before any model loads, a compilation the engine would not do."""
        level = model_config.compilation_level
        if level == 0:
            return
        if parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                f"compilation_level={level} with tensor_parallel_size="
                f"{parallel_config.tensor_parallel_size}: the compiled path runs on one "
                "worker only (use compilation_level=0, or tensor_parallel_size=1)"
            )


@dataclass
class AsyncEngineArgs(EngineArgs):
    """The engine options of `AsyncLLMEngine` (the server's), as vLLM's
    `AsyncEngineArgs`: every `EngineArgs` option and the ones that only a
    server has. A server logs its throughput line by default, as vLLM's does."""

    disable_log_stats: bool = _option(False, "no periodic throughput log line")
    disable_log_requests: bool = _option(False, "no log line per added and finished request")
