"""Engine configuration, split the way vLLM splits it.

`ModelConfig`, `CacheConfig`, `SchedulerConfig` and `DeviceConfig` are plain
dataclasses; `engine/arg_utils.py` builds them from the keyword arguments a
user passes to `LLM(...)`. Each validates its own ranges so that a bad value is
reported where it was given, with its name.
"""

from __future__ import annotations

import enum
import os
import sys
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from transformers import AutoConfig, PretrainedConfig

from minivllm import envs
from minivllm.attention.selector import check_attention_backend
from minivllm.compilation.levels import CompilationLevel
from minivllm.utils import (
    WrongTypeError,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_seed,
    resolve_class,
    show,
)

_STR_TO_DTYPE = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
# The torch dtypes a model can be built and run in.
_TORCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_path(name: str, value: object) -> str:
    """A checkpoint or tokenizer location: a string or a path object."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise WrongTypeError(
            f"{name} must be a checkpoint directory or a Hugging Face hub id (a string or a "
            f"path), got {show(value)}"
        )
    return value


@dataclass
class DeviceConfig:
    """Where the model and the KV cache live: "cpu" or "cuda"."""

    device: str = "auto"

    def __post_init__(self) -> None:
        check_choice("device", self.device, ("auto", "cpu", "cuda"), "'auto', 'cpu' or 'cuda'")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but torch sees no CUDA GPU")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass
class ParallelConfig:
    """How the model is split over workers: tensor parallelism only (vLLM's
    ParallelConfig also has pipeline parallelism).

    `distributed_executor_backend` starts the workers beyond the first: "mp"
    (processes on this machine), "ray" (Ray actors, on this machine or a Ray
    cluster). None chooses as vLLM does: "ray" when this process has already
    connected to Ray (`ray.init()`), else "mp"; with one worker, none is used.
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, low=1)
        if self.distributed_executor_backend is not None:
            check_choice(
                "distributed_executor_backend", self.distributed_executor_backend, ("mp", "ray"),
                "'mp', 'ray' or None",
            )
        elif self.world_size > 1:
            ray = sys.modules.get("ray")
            self.distributed_executor_backend = (
                "ray" if ray is not None and ray.is_initialized() else "mp"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


# The RoPE variants RotaryEmbedding implements (vLLM's get_rope has more).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: PretrainedConfig) -> tuple[float, dict]:
    """(theta, scaling dict) from a config of either transformers 4 or 5 style."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return float(params.get("rope_theta", 10000.0)), dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    return float(getattr(config, "rope_theta", 10000.0)), scaling


@dataclass
class ModelConfig:
    """The checkpoint to serve and how to run it.

    `model` is a local directory holding a Hugging Face checkpoint
    (config.json, safetensors weights, tokenizer files) or a hub id.
    `dtype="auto"` means float32 on the CPU and the checkpoint's own dtype on
    a GPU: CPUs are slow and inexact in half precision, GPUs are built for it.
    `dry_run` loads no weights: the engine runs its real scheduler on
    pseudo-random tokens (worker/dry_run_worker.py), for scheduling studies.
    `compilation_level` (0-3, `CompilationLevel`) selects `torch.compile` of
    the model forward (compilation/); vLLM keeps it in its CompilationConfig,
    here it rides with the model because the model runner receives only this
    config, the cache's, the device's and the scheduler's.
    `enforce_eager=False` (vLLM's default) captures CUDA graphs of the decode
    steps on a GPU (worker/cuda_graph_runner.py) for contexts up to
    `max_seq_len_to_capture` tokens (8192, or `max_model_len` if shorter); a
    longer context, a prefill or a CPU runs eagerly.
    """

    model: str
    tokenizer: str | None = None
    trust_remote_code: bool = False
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    max_model_len: int | None = None
    device: str = DeviceConfig.device
    dry_run: bool = False
    # The attention implementation asked for: a name, a class, or None
    # ($MINIVLLM_ATTENTION_BACKEND, else "auto"). The model runner resolves it
    # once the block size is known (attention/selector.py::get_attn_backend).
    attention_backend: str | type | None = None
    compilation_level: int = CompilationLevel.NO_COMPILATION
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    # The most top tokens a request may ask for per position (logprobs,
    # prompt_logprobs): each costs a topk column and a name to decode.
    max_logprobs: int = 20
    hf_config: PretrainedConfig = field(init=False, repr=False)
    local_path: str = field(init=False)

    def __post_init__(self) -> None:
        # Imported here: the loader imports this module.
        from minivllm.model_executor.weight_utils import resolve_model_path

        # Types first: a bad value is named before any file is read.
        self.model = _check_path("model", self.model)
        if self.tokenizer is not None:
            self.tokenizer = _check_path("tokenizer", self.tokenizer)
        check_bool("trust_remote_code", self.trust_remote_code)
        check_bool("dry_run", self.dry_run)
        check_attention_backend(self.attention_backend)
        self.compilation_level = check_int(
            "compilation_level", self.compilation_level, low=0, high=3,
            allowed=f"one of {CompilationLevel.allowed()}",
        )
        check_bool("enforce_eager", self.enforce_eager)
        self.max_seq_len_to_capture = check_int(
            "max_seq_len_to_capture", self.max_seq_len_to_capture, low=1
        )
        self.max_logprobs = check_int("max_logprobs", self.max_logprobs, low=0)
        self.device = DeviceConfig(self.device).device  # "auto" resolved as the engine does
        self.seed = check_seed(self.seed)
        if self.max_model_len is not None:
            self.max_model_len = check_int(
                "max_model_len",
                self.max_model_len,
                low=1,
                allowed="None (the model's context length) or an integer >= 1",
            )
        if not isinstance(self.dtype, (str, torch.dtype)):
            raise WrongTypeError(f"dtype must be {self._dtype_allowed()}, got {show(self.dtype)}")

        self.local_path = resolve_model_path(self.model)
        if self.tokenizer is None:
            self.tokenizer = self.local_path
        self.hf_config = AutoConfig.from_pretrained(
            self.local_path, trust_remote_code=self.trust_remote_code
        )
        self.dtype = self._resolve_dtype(self.dtype)
        derived = self.derive_max_model_len()
        if self.max_model_len is None:
            self.max_model_len = derived
        elif not 1 <= self.max_model_len <= derived:
            raise ValueError(
                f"max_model_len must be between 1 and the model's context length "
                f"{derived}, got {self.max_model_len}"
            )
        # vLLM's rule: no graph is captured for contexts the model cannot hold.
        self.max_seq_len_to_capture = min(self.max_seq_len_to_capture, self.max_model_len)

    @staticmethod
    def _dtype_allowed() -> str:
        return (
            f"'auto', one of {sorted(_STR_TO_DTYPE)} or one of the torch dtypes "
            f"{', '.join(map(str, _TORCH_DTYPES))}"
        )

    def _resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        if isinstance(dtype, torch.dtype):
            if dtype not in _TORCH_DTYPES:
                raise ValueError(f"dtype must be {self._dtype_allowed()}, got {dtype}")
            return dtype
        if dtype == "auto":
            if self.device == "cpu":
                return torch.float32
            ckpt = getattr(self.hf_config, "dtype", None) or getattr(
                self.hf_config, "torch_dtype", None
            )
            if isinstance(ckpt, str):
                ckpt = _STR_TO_DTYPE.get(ckpt)
            return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.float16
        if dtype not in _STR_TO_DTYPE:
            raise ValueError(f"dtype must be {self._dtype_allowed()}, got {dtype!r}")
        return _STR_TO_DTYPE[dtype]

    def derive_max_model_len(self) -> int:
        """The longest sequence the checkpoint allows.

        Linear RoPE scaling stretches the positions by `factor`, so the
        context grows by it, as vLLM's `_get_and_verify_max_len` derives it
        (llama3 scaling needs nothing: its max_position_embeddings is
        already the long one). Sliding-window attention (Mistral, some
        Qwen2) is not implemented: within the window it equals full
        attention, so the window caps the length.
        """
        length = 2048
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            value = getattr(self.hf_config, key, None)
            if value is not None:
                length = int(value)
                break
        _, scaling = rope_parameters(self.hf_config)
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} of this model is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "linear":
            length = int(length * scaling["factor"])
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True):
            length = min(length, int(window))
        return length

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    def get_num_layers(self) -> int:
        c = self.hf_config
        return getattr(c, "num_hidden_layers", None) or c.n_layer

    def get_num_attention_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_attention_heads", None) or c.n_head

    def get_total_num_kv_heads(self) -> int:
        """KV heads: fewer than query heads under grouped-query attention."""
        return getattr(self.hf_config, "num_key_value_heads", None) or (
            self.get_num_attention_heads()
        )

    def get_num_kv_heads(self, parallel_config: ParallelConfig | None = None) -> int:
        """KV heads on each worker: the total split over the tensor-parallel
        ranks, and at least one (a KV head is replicated when there are fewer
        KV heads than ranks). Without a parallel config: one worker."""
        tp = parallel_config.tensor_parallel_size if parallel_config else 1
        return max(1, self.get_total_num_kv_heads() // tp)

    def verify_with_parallel_config(self, parallel_config: ParallelConfig) -> None:
        """Refuse, before any worker starts, a split that leaves a rank part
        of a head or of the vocabulary's rows."""
        tp = parallel_config.tensor_parallel_size
        heads = self.get_num_attention_heads()
        if heads % tp:
            raise ValueError(
                f"Total number of attention heads ({heads}) must be divisible by "
                f"tensor_parallel_size ({tp})."
            )
        kv_heads = self.get_total_num_kv_heads()
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(
                f"Total number of KV heads ({kv_heads}) and tensor_parallel_size ({tp}) must "
                "divide one another (each rank holds a share of the KV heads, or one replica)."
            )
        # Imported here: the layers import this module.
        from minivllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size

        vocab_size = self.hf_config.vocab_size
        if pad_vocab_size(vocab_size) % tp:
            raise ValueError(
                f"The vocabulary ({vocab_size} tokens, padded to {pad_vocab_size(vocab_size)} "
                f"rows) must split evenly over tensor_parallel_size ({tp})."
            )
        if tp > 1 and self.dry_run:
            raise ValueError(
                f"tensor_parallel_size={tp} with dry_run=True: a dry run has no model to "
                "split; use tensor_parallel_size=1"
            )

    def get_head_size(self) -> int:
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None)
        if head_dim:
            return head_dim
        hidden = getattr(c, "hidden_size", None) or c.n_embd
        return hidden // self.get_num_attention_heads()


@dataclass
class CacheConfig:
    """The paged KV cache.

    The device pool holds `num_gpu_blocks` blocks of `block_size` tokens
    (the name is vLLM's even when the "GPU" is a CPU). Its size comes from
    `num_gpu_blocks_override` when given, else from the memory budget:
    `kv_cache_memory_bytes` if set, otherwise 1 GiB on the CPU and
    `gpu_memory_utilization` of the GPU. `swap_space` (GiB, as in vLLM)
    sizes the CPU pool that SWAP preemption moves blocks into.
    `enable_prefix_caching` lets requests share the blocks of a common prefix.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4.0
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False
    num_gpu_blocks: int | None = field(default=None, init=False)
    num_cpu_blocks: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        allowed = "a power of two from 1 to 128"
        self.block_size = check_int("block_size", self.block_size, allowed=allowed)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be {allowed}, got {self.block_size}")
        self.gpu_memory_utilization = check_float(
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            low=0,
            high=1,
            low_open=True,
            allowed="in (0, 1]",
        )
        self.swap_space = check_float(
            "swap_space", self.swap_space, low=0, allowed="a finite number of GiB >= 0"
        )
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = check_int(
                "kv_cache_memory_bytes",
                self.kv_cache_memory_bytes,
                low=1,
                allowed="None or a number of bytes > 0 (an integer)",
            )
        if self.num_gpu_blocks_override is not None:
            self.num_gpu_blocks_override = check_int(
                "num_gpu_blocks_override",
                self.num_gpu_blocks_override,
                low=1,
                allowed="None or an integer >= 1",
            )
        check_bool("enable_prefix_caching", self.enable_prefix_caching)


class PreemptionMode(enum.Enum):
    """How a running request gives up its KV cache when blocks run out.

    RECOMPUTE frees the blocks; the request is prefilled again later from
    its prompt plus the tokens it already generated. SWAP copies the blocks
    to the CPU pool and back when memory frees up.
    """

    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass
class SchedulerConfig:
    """Per-step limits of the scheduler.

    `max_num_batched_tokens` bounds the tokens of one forward pass (prefill
    tokens plus one per decode); without chunked prefill it must hold a whole
    prompt of `max_model_len` tokens. With `enable_chunked_prefill`, long
    prompts are split across steps to fit it (default 512, as in vLLM).
    `preemption_mode=None` follows vLLM: RECOMPUTE for single-sequence
    requests, SWAP for several sequences. `scheduling_policy` only orders
    the queues: "fcfs" (arrival) or "priority" (each request's priority,
    then arrival). What a step's batch holds follows `enable_chunked_prefill`
    as in vLLM v0: without it a step is all prefills or all decodes, with it
    decodes and prompt chunks share a step; see core/scheduler.py.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048
    preemption_mode: PreemptionMode | str | None = None
    enable_chunked_prefill: bool = False
    scheduling_policy: str = "fcfs"
    # V1 only: at most this many tokens of one prompt in a step (0: no cap).
    long_prefill_token_threshold: int = 0
    # V1 only: admit a waiting request only if its whole prompt's blocks are
    # free, not only its first chunk's (the classic engine always does).
    scheduler_reserve_full_isl: bool = True
    # Replaceable components, by class or "package.module.Class" (vLLM has
    # scheduler_cls too): the labs plug a learner's own in here.
    scheduler_cls: str | type = "minivllm.core.scheduler.Scheduler"
    block_manager_cls: str | type = "minivllm.core.block_manager.BlockSpaceManager"

    def __post_init__(self) -> None:
        self.scheduler_cls = resolve_class(self.scheduler_cls, "scheduler_cls")
        self.block_manager_cls = resolve_class(self.block_manager_cls, "block_manager_cls")
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, low=1)
        if self.max_num_batched_tokens is not None:
            self.max_num_batched_tokens = check_int(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                low=1,
                allowed="None or an integer >= 1",
            )
        self.max_model_len = check_int("max_model_len", self.max_model_len, low=1)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        self.long_prefill_token_threshold = check_int(
            "long_prefill_token_threshold", self.long_prefill_token_threshold, low=0
        )
        check_bool("scheduler_reserve_full_isl", self.scheduler_reserve_full_isl)
        if self.max_num_batched_tokens is None:
            if self.enable_chunked_prefill:
                self.max_num_batched_tokens = max(512, self.max_num_seqs)
            else:
                self.max_num_batched_tokens = max(self.max_model_len, 2048)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): a prompt of max_model_len tokens "
                "could never be scheduled. Raise max_num_batched_tokens, lower max_model_len "
                "or set enable_chunked_prefill=True."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence decodes one "
                "token per step."
            )
        if not (self.preemption_mode is None or isinstance(self.preemption_mode, PreemptionMode)):
            modes = tuple(m.value for m in PreemptionMode)
            mode = check_choice(
                "preemption_mode", self.preemption_mode, modes, f"None or one of {list(modes)}"
            )
            self.preemption_mode = PreemptionMode(mode)


def _check_endpoint(name: str, endpoint: object) -> None:
    """A ZMQ address: a string, and for tcp:// a port that is `*` or 1-65535
    (ZMQ would wrap a larger one silently)."""
    allowed = "a ZMQ address such as 'tcp://*:5557' or 'ipc:///tmp/kv-events'"
    if not isinstance(endpoint, str):
        raise WrongTypeError(f"{name} must be {allowed}, got {show(endpoint)}")
    if "://" not in endpoint:
        raise ValueError(f"{name} must be {allowed}, got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        if port != "*" and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{name} must have a port from 1 to 65535 or '*', got {endpoint!r}")


@dataclass
class KVEventsConfig:
    """V1's KV-cache events (vLLM's `vllm/config/kv_events.py`): every block
    the prefix cache gains or loses, published for a router that sends each
    request where its prefix is cached (`distributed/kv_events.py`).

    `publisher` None becomes "zmq" when events are on, else "null". `endpoint`
    is bound when it holds `*`, `::`, `ipc://` or `inproc://`, else
    connected to. `replay_endpoint` (a ROUTER socket) resends the last
    `buffer_steps` batches from a sequence number; `hwm` is the PUB
    socket's high-water mark, `max_queue_size` the batches waiting for the
    publisher's thread; `topic` is the first frame of every message."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        name = "kv_events_config"
        check_bool(f"{name}.enable_kv_cache_events", self.enable_kv_cache_events)
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        check_choice(f"{name}.publisher", self.publisher, ("null", "zmq"), "'null' or 'zmq'")
        _check_endpoint(f"{name}.endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint(f"{name}.replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint:
                raise ValueError(
                    f"{name}.replay_endpoint must differ from endpoint, got "
                    f"{self.replay_endpoint!r} for both"
                )
        if not isinstance(self.topic, str):
            raise WrongTypeError(f"{name}.topic must be printable text, got {show(self.topic)}")
        if not self.topic.isprintable():
            raise ValueError(f"{name}.topic must be printable text, got {show(self.topic)}")
        # 0 as in vLLM: no replay buffer, an unbounded queue, no mark. The
        # highs are what deque, Queue and ZMQ's int option take.
        self.buffer_steps = check_int(f"{name}.buffer_steps", self.buffer_steps,
                                      low=0, high=sys.maxsize)
        self.max_queue_size = check_int(f"{name}.max_queue_size", self.max_queue_size,
                                        low=0, high=sys.maxsize)
        self.hwm = check_int(f"{name}.hwm", self.hwm, low=0, high=2**31 - 1)

    @classmethod
    def from_option(cls, value: object) -> KVEventsConfig | None:
        """The `kv_events_config` engine option: None, a KVEventsConfig, or a
        dict of its fields (what the JSON flag `--kv-events-config` gives)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise WrongTypeError(
                f"kv_events_config must be a KVEventsConfig, a dict of its fields or None, "
                f"got {show(value)}"
            )
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - fields, key=str)
        if unknown:
            raise ValueError(
                f"kv_events_config has no field {show(unknown[0])}; its fields are "
                f"{', '.join(sorted(fields))}"
            )
        return cls(**value)


@dataclass
class EngineConfig:
    """All the configs of one engine, passed around together."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    use_v1: bool = False  # which engine runs them (EngineArgs.resolve_use_v1)
    kv_events_config: KVEventsConfig | None = None  # V1 only

    def __str__(self) -> str:
        """The options that shape a run, for the engine's first log line
        (vLLM's "Initializing an LLM engine ... with config: ...")."""
        model, cache, sched = self.model_config, self.cache_config, self.scheduler_config
        return (
            f"model={model.model!r}, dtype={model.dtype}, max_seq_len={sched.max_model_len}, "
            f"device={self.device_config.device}, attention_backend={model.attention_backend}, "
            f"tensor_parallel_size={self.parallel_config.tensor_parallel_size}, "
            f"block_size={cache.block_size}, enable_prefix_caching={cache.enable_prefix_caching}, "
            f"chunked_prefill_enabled={sched.enable_chunked_prefill}, "
            f"max_num_batched_tokens={sched.max_num_batched_tokens}, "
            f"max_num_seqs={sched.max_num_seqs}, seed={model.seed}"
        )


def default_cpu_kv_cache_bytes() -> int:
    """1 GiB unless MINIVLLM_CPU_KVCACHE_SPACE (GiB) says otherwise, like vLLM's CPU backend."""
    gib = envs.positive_number("MINIVLLM_CPU_KVCACHE_SPACE", "1", "GiB (the CPU KV-cache size)")
    return int(Fraction(gib) * (1 << 30))  # exact: 1e300 GiB overflows a float
