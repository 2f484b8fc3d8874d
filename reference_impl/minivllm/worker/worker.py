"""`Worker`: owns the model runner and the KV cache on one device.

Each step it first applies the scheduler's block moves (swap in, swap out,
copy-on-write), then runs the model on the scheduled batch.

Under tensor parallelism there is one worker per rank, each with its shard of
the model and the KV cache of its heads. The driver worker (rank 0, in the
engine's process) gets the step from the engine, prepares the model input and
broadcasts it with the block moves; the other workers wait in
`start_worker_execution_loop` for each broadcast, apply the same moves to
their cache, and run their shard. Only the driver samples.
"""

from __future__ import annotations

import gc
import logging
from fractions import Fraction
from typing import Any

import torch

from minivllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    default_cpu_kv_cache_bytes,
)
from minivllm.distributed import (
    broadcast_tensor_dict,
    ensure_model_parallel_initialized,
    init_distributed_environment,
    model_parallel_is_initialized,
)
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.sequence import SequenceGroupMetadata
from minivllm.utils import gib, host_memory_bytes, show
from minivllm.worker.cache_engine import CacheEngine
from minivllm.worker.cpu_threads import one_thread_max_tokens, step_threads
from minivllm.worker.model_runner import ModelInput, ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        parallel_config: ParallelConfig | None = None,
        rank: int = 0,
        distributed_init_method: str | None = None,
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.parallel_config = parallel_config or ParallelConfig()
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = rank == 0
        self.device = device_config.torch_device
        self.model_runner = ModelRunner(
            model_config, cache_config, device_config, scheduler_config or SchedulerConfig()
        )
        self.cache_engine: CacheEngine | None = None
        # Steps of at most this many tokens run on one CPU thread
        # (worker/cpu_threads.py); 0: never. Set when the model is loaded.
        self.one_thread_max_tokens = 0
        self.in_group = False  # whether this worker formed (or joins) the process's group

    def init_device(self) -> None:
        """Join the tensor-parallel group (gloo on CPU, NCCL on GPU). One
        worker alone creates no process group."""
        world_size = self.parallel_config.world_size
        if model_parallel_is_initialized():
            # One process, one group: joining the old one would leave the new
            # ranks waiting for a driver that never comes.
            raise RuntimeError(
                "another engine in this process runs with tensor parallelism; shut it down "
                "(llm.llm_engine.model_executor.shutdown()) before starting a new one"
            )
        if world_size == 1:
            return
        self.in_group = True
        if self.device.type == "cuda":
            # One GPU per rank: "cuda" means this rank's from here on. (A Ray
            # actor sees only the GPU Ray gave it; a worker process sees all.)
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        init_distributed_environment(
            world_size, self.rank, self.distributed_init_method, self.rank,
            backend="nccl" if self.device.type == "cuda" else "gloo",
        )
        ensure_model_parallel_initialized(self.parallel_config.tensor_parallel_size)

    def load_model(self) -> None:
        runner = self.model_runner
        runner.load_model()
        # Tensor-parallel ranks keep their threads for every step: each would
        # time a threshold of its own, and a rank on one thread while the
        # others use more holds them up at every all-reduce.
        if self.parallel_config.world_size == 1:
            self.one_thread_max_tokens = one_thread_max_tokens(runner.packed_layers, self.device)
        if self.one_thread_max_tokens:
            logger.info(
                "steps of at most %d tokens run on one CPU thread, larger ones on %d "
                "(worker/cpu_threads.py)",
                self.one_thread_max_tokens,
                torch.get_num_threads(),
            )

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) that fit the memory budgets."""
        cfg = self.cache_config
        block_bytes = CacheEngine.get_cache_block_size(
            cfg.block_size, self.model_config, self.parallel_config
        )
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
            source = f"kv_cache_memory_bytes={show(budget)}"
        elif self.device.type == "cuda":
            # What is left of the allowed fraction after everything already
            # on the card (vLLM v0.6 subtracts only its own worker's use:
            # vllm_differences row 90); the activations of one step are small
            # next to the cache here. The CUDA graphs' memory pool comes
            # later, outside this budget (as in vLLM v0.6). An engine deleted
            # before this one may still hold memory through reference cycles
            # and torch's caching allocator: release it first.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free)
            source = (
                f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {gib(total)} GiB, "
                f"{gib(total - free)} GiB already in use: the weights, other engines, "
                "other processes"
            )
        else:
            budget = default_cpu_kv_cache_bytes()
            source = "the CPU budget ($MINIVLLM_CPU_KVCACHE_SPACE, default 1 GiB)"
        num_gpu_blocks = budget // block_bytes
        if cfg.num_gpu_blocks_override is not None:
            num_gpu_blocks = cfg.num_gpu_blocks_override
            source = f"num_gpu_blocks_override={num_gpu_blocks}"
        if num_gpu_blocks < 1:
            raise ValueError(
                f"The KV-cache budget of {budget} bytes ({source}) holds no block of "
                f"{block_bytes} bytes; raise kv_cache_memory_bytes / gpu_memory_utilization "
                "or lower block_size."
            )
        # Exact: swap_space * 2**30 overflows a float from about 1.7e299 GiB.
        num_cpu_blocks = int(Fraction(cfg.swap_space) * (1 << 30)) // block_bytes
        self.check_pools_fit(num_gpu_blocks, num_cpu_blocks, block_bytes, source)
        return num_gpu_blocks, num_cpu_blocks

    def check_pools_fit(
        self, num_gpu_blocks: int, num_cpu_blocks: int, block_bytes: int, source: str
    ) -> None:
        """Refuse, naming the option, a pool larger than the memory it would
        live in: torch would fail to allocate it, or the cache could never
        be filled. (How much is actually free is not checked: a pool is
        allocated untouched, and fills as requests arrive.)"""
        host = host_memory_bytes()
        if self.device.type == "cuda":
            device_total, where = torch.cuda.mem_get_info(self.device)[1], "GPU"
        else:
            device_total, where = host, "this machine's"
        pool = num_gpu_blocks * block_bytes
        if device_total is not None and pool > device_total:
            raise ValueError(
                f"{source} asks for a KV cache of {show(num_gpu_blocks)} blocks of {block_bytes} "
                f"bytes ({gib(pool)} GiB), more than the {gib(device_total)} GiB of "
                f"{where} memory"
            )
        swap = num_cpu_blocks * block_bytes
        if host is not None and swap > host:
            raise ValueError(
                f"swap_space={self.cache_config.swap_space} GiB is more than the "
                f"{gib(host)} GiB of this machine's memory (0 disables swapping)"
            )

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks
        self.cache_engine = CacheEngine(
            self.cache_config, self.model_config, self.parallel_config, self.device,
            self.model_runner.attn_backend,
        )
        self._warm_up_model()

    def _warm_up_model(self) -> None:
        """vLLM's step after allocating the cache: capture the decode steps'
        CUDA graphs, which need the cache (its addresses are in them). On a
        GPU, and only one worker alone: a graph of several ranks would hold
        their collectives, which must then be captured in step on every rank.
        (vLLM then reseeds torch's global generators, which warm-up may have
        drawn from; our sampler keeps a generator of its own.)"""
        if self.captures_cuda_graphs():
            self.model_runner.capture_model(self.gpu_cache)

    def captures_cuda_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.model_config.enforce_eager
            and self.parallel_config.world_size == 1
        )

    @property
    def gpu_cache(self) -> list[torch.Tensor]:
        return self.cache_engine.gpu_cache

    def execute_model(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata] | None = None,
        blocks_to_swap_in: list[tuple[int, int]] = (),
        blocks_to_swap_out: list[tuple[int, int]] = (),
        blocks_to_copy: list[tuple[int, int]] = (),
        *,
        with_batch: bool = False,
    ) -> SamplerOutput | None:
        """Move the blocks, then run the model. The output carries the
        `FlatBatch` the model ran on whatever `with_batch` says: building it
        is part of running the model. (A dry run has no model input, and
        builds one only `with_batch`.)

        On the driver of several workers, the step is broadcast first; on
        the others, called with no arguments, it is received: an empty
        broadcast means stop, and returns None."""
        if self.is_driver_worker:
            worker_input = {
                "blocks_to_swap_in": list(blocks_to_swap_in),
                "blocks_to_swap_out": list(blocks_to_swap_out),
                "blocks_to_copy": list(blocks_to_copy),
            }
            model_input = None
            if seq_group_metadata_list:
                model_input = self.model_runner.prepare_model_input(seq_group_metadata_list)
            if self.parallel_config.world_size > 1:
                tensors = model_input.as_broadcastable_tensor_dict() if model_input else {}
                broadcast_tensor_dict({**worker_input, **tensors}, src=0)
        else:
            received = broadcast_tensor_dict(src=0)
            if not received:
                return None
            worker_input, model_input = self._unpack(received)
        self.cache_engine.swap_in(worker_input["blocks_to_swap_in"])
        self.cache_engine.swap_out(worker_input["blocks_to_swap_out"])
        self.cache_engine.copy(worker_input["blocks_to_copy"])
        if model_input is None:
            return SamplerOutput([])
        with step_threads(model_input.input_ids.shape[0], self.one_thread_max_tokens):
            output = self.model_runner.execute_model(model_input, self.gpu_cache)
        return output if output is not None else SamplerOutput([])

    def _unpack(self, received: dict[str, Any]) -> tuple[dict[str, Any], ModelInput | None]:
        moves = ("blocks_to_swap_in", "blocks_to_swap_out", "blocks_to_copy")
        worker_input = {name: received.pop(name) for name in moves}
        if not received:  # the step ran no model (only block moves)
            return worker_input, None
        return worker_input, ModelInput.from_broadcasted_tensor_dict(
            received, self.model_runner.attn_backend
        )

    def start_worker_execution_loop(self) -> None:
        """A worker other than the driver: run every step the driver
        broadcasts, until it broadcasts the empty step that means stop."""
        while self.execute_model() is not None:
            pass

    def stop_remote_worker_execution_loop(self) -> None:
        """The driver: release the other workers from their loop."""
        broadcast_tensor_dict({}, src=0)
