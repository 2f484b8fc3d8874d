"""Engine statistics: what each step did, and vLLM's periodic log line.

After every step the engine builds a `Stats` (queues, KV-cache usage,
tokens computed, preemptions, prefix-cache counters) and hands it to the
`StatLogger`, which keeps running totals and, when logging is on, prints one
line every `log_interval` seconds with the throughput over that interval:

    Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 8.0 tokens/s, ...

This is how an operator sees that a server is saturated (Pending grows),
short of KV cache (usage near 100%, preemptions) or benefiting from prefix
caching (hit rate), without a profiler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.sequence import SequenceGroupMetadata

logger = logging.getLogger(__name__)


@dataclass
class Stats:
    """The engine's state after one step, and what that step computed.

    Queue lengths count requests (sequence groups). Cache usage is the
    fraction of a pool's blocks held by sequences: cached blocks that no one
    holds are evictable, so they count as free. Prefill tokens are those the
    model computed for prompts (a prefix-cache hit is not computed); decode
    tokens are one per running sequence of a decoding group. The prefix-cache
    counters are cumulative, in blocks, as the block manager keeps them.
    """

    now: float
    num_running: int
    num_waiting: int
    num_swapped: int
    gpu_cache_usage: float
    cpu_cache_usage: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


def _usage(num_free: int, num_total: int) -> float:
    """Blocks in use over all blocks (an empty pool, swap_space=0, is unused)."""
    return (num_total - num_free) / num_total if num_total else 0.0


def build_stats(
    scheduler: Scheduler,
    scheduler_outputs: SchedulerOutputs | None = None,
    seq_group_metadata_list: Sequence[SequenceGroupMetadata] = (),
) -> Stats:
    """The `Stats` of the step that `scheduler_outputs` scheduled, read once
    its outputs are processed; with no step, the current state alone.

    Tokens are counted from the step's metadata, not from the groups: while
    outputs are processed a sequence that finishes stops being RUNNING, but
    the metadata still lists every sequence that ran.
    """
    num_prefill_tokens = num_decode_tokens = 0
    for metadata in seq_group_metadata_list:
        num_seqs = len(metadata.seq_data)
        if metadata.is_prompt:
            num_prefill_tokens += metadata.token_chunk_size * num_seqs
        else:
            num_decode_tokens += num_seqs
    bm = scheduler.block_manager
    return Stats(
        now=time.time(),
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        gpu_cache_usage=_usage(bm.get_num_free_gpu_blocks(), bm.num_total_gpu_blocks),
        cpu_cache_usage=_usage(bm.get_num_free_cpu_blocks(), bm.num_total_cpu_blocks),
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=num_decode_tokens,
        num_preemptions=len(scheduler_outputs.preempted) if scheduler_outputs else 0,
        prefix_cache_queries=bm.prefix_cache_queries,
        prefix_cache_hits=bm.prefix_cache_hits,
    )


@dataclass
class StatLogger:
    """Records every step's `Stats`; logs throughput every `log_interval` s.

    The totals since the engine started are kept whether or not logging is
    `enabled` (vLLM's `disable_log_stats` turns off only the log line), so a
    lesson or a benchmark can read them after a run. Throughput is the tokens
    of the steps recorded since the last line, divided by the seconds since
    it: an average over the interval, not a per-step rate.
    """

    log_interval: float
    enabled: bool = True
    last_log_time: float = field(default_factory=time.time)
    last_stats: Stats | None = field(default=None, init=False)
    total_prefill_tokens: int = field(default=0, init=False)
    total_decode_tokens: int = field(default=0, init=False)
    total_preemptions: int = field(default=0, init=False)
    interval_prefill_tokens: int = field(default=0, init=False)
    interval_decode_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.log_interval <= 0:
            raise ValueError(f"log_interval must be > 0 seconds, got {self.log_interval}")

    def log(self, stats: Stats) -> None:
        self.last_stats = stats
        self.total_prefill_tokens += stats.num_prefill_tokens
        self.total_decode_tokens += stats.num_decode_tokens
        self.total_preemptions += stats.num_preemptions
        if not self.enabled:
            return
        self.interval_prefill_tokens += stats.num_prefill_tokens
        self.interval_decode_tokens += stats.num_decode_tokens
        elapsed = stats.now - self.last_log_time
        if elapsed < self.log_interval:
            return
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Swapped: %d reqs, Pending: %d reqs, "
            "GPU KV cache usage: %.1f%%, CPU KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self.interval_prefill_tokens / elapsed,
            self.interval_decode_tokens / elapsed,
            stats.num_running,
            stats.num_swapped,
            stats.num_waiting,
            stats.gpu_cache_usage * 100,
            stats.cpu_cache_usage * 100,
            stats.prefix_cache_hit_rate * 100,
        )
        self.interval_prefill_tokens = self.interval_decode_tokens = 0
        self.last_log_time = stats.now
