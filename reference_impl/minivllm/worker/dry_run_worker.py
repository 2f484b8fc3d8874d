"""`DryRunWorker`: the engine without a model, for pure scheduling.

With `dry_run=True` (`LLM(model, dry_run=True)`, `minivllm-trace run
--dry-run`) the engine keeps everything but the forward pass: the real
scheduler, block manager and output processing (detokenization, stop
checks, forks, frees) run as always, but no weights are loaded, no KV-cache
tensor exists and each sampled token is a hash. Thousands of steps of
scheduling then take seconds, so a scenario can be explored, and the
scheduler and block manager timed alone. Only the checkpoint's config.json
and tokenizer are read.

The token a sequence samples is a function of (engine seed, request id,
position, previous token, draw) only, so a request gets the same tokens
whatever shares its batch and whatever the cache size or policy: two
scheduling configurations can be compared token for token. It is never an
EOS or stop token, so a request always runs to `max_tokens` (or
`max_model_len`): lengths, and so block needs, are exactly as configured.
The "model" is uniform over the vocabulary: every logprob is -log(vocab).
Prompt logprobs are not produced.
"""

from __future__ import annotations

import math
import zlib

from minivllm.config import CacheConfig, DeviceConfig, ModelConfig
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.sequence import (
    CompletionSequenceGroupOutput,
    Logprob,
    SequenceGroupMetadata,
    SequenceOutput,
    num_samples_to_draw,
)
from minivllm.utils import gib, host_memory_bytes, show
from minivllm.worker.model_runner import FlatBatch
from minivllm.worker.worker import Worker

_MASK64 = (1 << 64) - 1
# A free block number in the block manager's list: an 8-byte slot and a
# 28-byte int object, rounded up.
_BYTES_PER_FREE_BLOCK = 40


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a fast, well-spread 64-bit integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def dry_run_token(
    seed: int,
    request_id: str,
    position: int,
    prev_token: int,
    draw: int,
    vocab_size: int,
    banned: set[int],
) -> int:
    """The token sampled at `position` after `prev_token`; `draw` tells apart
    the `best_of` samples of a prompt. Never one of `banned`."""
    h = _mix64(seed ^ zlib.crc32(request_id.encode()))
    h = _mix64(h ^ position)
    h = _mix64(h ^ (prev_token << 8 | draw))
    token = h % vocab_size
    while token in banned:
        token = (token + 1) % vocab_size
    return token


class DryRunWorker(Worker):
    """A `Worker` whose model is `dry_run_token`: its model runner is never
    loaded and its cache is block counts only."""

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, device_config: DeviceConfig
    ) -> None:
        # Nothing is allocated anywhere: the pool is sized by the CPU budget
        # (kv_cache_memory_bytes, or 1 GiB) whatever the device.
        super().__init__(model_config, cache_config, DeviceConfig("cpu"))
        self.vocab_size = model_config.hf_config.vocab_size
        self.seed = model_config.seed
        self.logprob = -math.log(self.vocab_size)

    def load_model(self) -> None:
        """No weights: that is the point."""

    def check_pools_fit(
        self, num_gpu_blocks: int, num_cpu_blocks: int, block_bytes: int, source: str
    ) -> None:
        """No cache is allocated, so a dry run may model a GPU larger than
        this machine. Its block manager still lists every free block number
        (about _BYTES_PER_FREE_BLOCK bytes each): that list must fit."""
        host = host_memory_bytes()
        needed = (num_gpu_blocks + num_cpu_blocks) * _BYTES_PER_FREE_BLOCK
        if host is not None and needed > host:
            raise ValueError(
                f"{source} and swap_space={self.cache_config.swap_space} GiB make "
                f"{show(num_gpu_blocks)} + {show(num_cpu_blocks)} blocks, whose free lists alone "
                f"({gib(needed)} GiB) do not fit the {gib(host)} GiB of this machine's memory, "
                "even in a dry run"
            )

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks

    def execute_model(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        blocks_to_swap_in: list[tuple[int, int]],
        blocks_to_swap_out: list[tuple[int, int]],
        blocks_to_copy: list[tuple[int, int]],
        *,
        with_batch: bool = False,
    ) -> SamplerOutput:
        """One output per group, like the real sampler's: when the group
        samples, `num_samples_to_draw` samples per sequence. Block moves have
        no bytes to move. No model runs, so the batch is flattened only
        `with_batch` (for a step observer), exactly as the model runner
        would flatten it."""
        outputs = []
        for meta in seq_group_metadata_list:
            samples = []
            if meta.do_sample:
                params = meta.sampling_params
                for seq_id, data in meta.seq_data.items():
                    for draw in range(num_samples_to_draw(params, data)):
                        token = dry_run_token(
                            self.seed,
                            meta.request_id,
                            data.get_len() - 1,
                            data.get_last_token_id(),
                            draw,
                            self.vocab_size,
                            params.all_stop_token_ids,
                        )
                        logprobs = {token: Logprob(self.logprob, rank=1)}
                        samples.append(SequenceOutput(seq_id, token, logprobs))
            outputs.append(CompletionSequenceGroupOutput(samples))
        batch = None
        if with_batch and seq_group_metadata_list:
            batch = FlatBatch.build(seq_group_metadata_list, self.cache_config.block_size)
        return SamplerOutput(outputs, batch)
