"""Engine statistics: what each step did, and vLLM's periodic log line.

After every step the engine builds a `Stats` (queues, KV-cache usage,
tokens computed and generated, preemptions, prefix-cache counters, the
requests that finished) and hands it to the `StatLogger`, which keeps
running totals and, when logging is on, prints vLLM v0.6's lines every
`log_interval` seconds with the throughput over that interval:

    Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 8.0 tokens/s, ...
    Prefix cache hit rate: GPU: 50.00%, CPU: 0.00%      (only with prefix caching)

This is how an operator sees that a server is saturated (Pending grows),
short of KV cache (usage near 100%, preemptions) or benefiting from prefix
caching (hit rate), without a profiler.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.outputs import RequestOutput
from minivllm.sequence import SequenceGroupMetadata

logger = logging.getLogger(__name__)

# As vLLM v0.6 does on import: no `*_created` sample beside every counter
# and histogram on /metrics (process-wide, as prometheus_client's switch is).
prometheus_client.disable_created_metrics()


@dataclass
class Stats:
    """The engine's state after one step, and what that step computed.

    Queue lengths count requests (sequence groups). Cache usage is the
    fraction of a pool's blocks held by sequences: cached blocks that no one
    holds are evictable, so they count as free. Prefill tokens are those the
    model computed for prompts (a prefix-cache hit is not computed); decode
    tokens are one per running sequence of a decoding group. Generation
    tokens are every token sampled: the decode tokens, plus one per sequence
    of each group whose prompt finished in the step (vLLM v0.6's
    `num_generation_tokens_iter`). The prefix-cache counters are cumulative,
    in blocks, as the block manager keeps them.

    `finished_reasons` and `time_e2e_requests` describe the requests that
    finished in the step after running in it, as v0.6 walks only the
    scheduled groups: one reason per sequence (all `best_of` of them), one
    latency per request. A request the scheduler ignored, or one aborted,
    is in neither.

    `time_to_first_tokens_iter` and `time_per_output_tokens_iter` (v0.6's
    names) time the requests that got tokens in the step, whatever their
    outputs hold (`output_kind`): a request's first token from its arrival,
    and each later step's from the request's previous token, a wait in the
    queue after a preemption included (`RequestMetrics.record_token`, as
    the engines add the tokens; in V1 each engine-core request on its own,
    so each child of an n > 1 request).
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
    enable_prefix_caching: bool = False
    num_generation_tokens: int = 0
    finished_reasons: list[str] = field(default_factory=list)
    time_e2e_requests: list[float] = field(default_factory=list)
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    time_per_output_tokens_iter: list[float] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over lookups since the start; -1 when prefix caching is off
        (v0.6's "not supported or disabled"), 0.0 before any lookup."""
        if not self.enable_prefix_caching:
            return -1.0
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def cpu_prefix_cache_hit_rate(self) -> float:
        """The swap pool's: it is never looked up, so 0.0 (no lookups, as
        v0.6's allocator reports them) with prefix caching, else -1."""
        return 0.0 if self.enable_prefix_caching else -1.0


def _usage(num_free: int, num_total: int) -> float:
    """Blocks in use over all blocks (an empty pool, swap_space=0, is unused)."""
    return (num_total - num_free) / num_total if num_total else 0.0


def build_stats(
    scheduler: Scheduler,
    scheduler_outputs: SchedulerOutputs | None = None,
    seq_group_metadata_list: Sequence[SequenceGroupMetadata] = (),
) -> Stats:
    """The `Stats` of the step that `scheduler_outputs` scheduled, read once
    its outputs are processed; with no step, the current state alone (all
    per-step counts 0: vLLM's forced log).

    Computed tokens are counted from the step's metadata, not from the
    groups: while outputs are processed a sequence that finishes stops being
    RUNNING, but the metadata still lists every sequence that ran.
    """
    num_prefill_tokens = num_decode_tokens = 0
    for metadata in seq_group_metadata_list:
        num_seqs = len(metadata.seq_data)
        if metadata.is_prompt:
            num_prefill_tokens += metadata.token_chunk_size * num_seqs
        else:
            num_decode_tokens += num_seqs
    bm = scheduler.block_manager
    stats = Stats(
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
        enable_prefix_caching=bm.enable_caching,
        num_generation_tokens=num_decode_tokens,
    )
    if scheduler_outputs is not None:
        _add_scheduled_groups(stats, scheduler_outputs)
    return stats


def _add_scheduled_groups(stats: Stats, scheduler_outputs: SchedulerOutputs) -> None:
    """What v0.6's `_get_stats` reads from the scheduled groups: a prefill
    that finished its prompt made one token per sequence (`best_of` once it
    forked; a chunk that left the prompt unfinished made none), and a group
    that finished counts its sequences' reasons and its latency."""
    for idx, scheduled in enumerate(scheduler_outputs.scheduled_seq_groups):
        seq_group = scheduled.seq_group
        if idx < scheduler_outputs.num_prefill_groups and not seq_group.is_prefill():
            stats.num_generation_tokens += seq_group.num_seqs()
        if seq_group.is_finished():
            metrics = seq_group.metrics
            stats.time_e2e_requests.append(metrics.finished_time - metrics.arrival_time)
            stats.finished_reasons += [seq.finish_reason for seq in seq_group.get_seqs()]


@dataclass
class StatLogger:
    """Records every step's `Stats`; logs throughput every `log_interval` s.

    The totals since the engine started are kept whether or not logging is
    `enabled` (vLLM's `disable_log_stats` turns off only the log line), so a
    lesson or a benchmark can read them after a run. Throughput is the tokens
    of the stats recorded since the last line, divided by the seconds since
    it: an average over the interval, not a per-step rate. The server's
    forced logs (`do_log_stats`, from the event loop) may come while a step
    records its stats in the engine's thread: a lock keeps them apart.
    """

    log_interval: float
    enabled: bool = True
    last_log_time: float = field(default_factory=time.time)
    last_stats: Stats | None = field(default=None, init=False)
    total_prefill_tokens: int = field(default=0, init=False)
    total_decode_tokens: int = field(default=0, init=False)
    total_generation_tokens: int = field(default=0, init=False)
    total_preemptions: int = field(default=0, init=False)
    interval_prefill_tokens: int = field(default=0, init=False)
    interval_generation_tokens: int = field(default=0, init=False)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.log_interval <= 0:
            raise ValueError(f"log_interval must be > 0 seconds, got {self.log_interval}")

    def log(self, stats: Stats) -> None:
        with self._lock:
            self._record(stats)
            if self.enabled and stats.now - self.last_log_time >= self.log_interval:
                self._log_line(stats)

    def _record(self, stats: Stats) -> None:
        self.last_stats = stats
        self.total_prefill_tokens += stats.num_prefill_tokens
        self.total_decode_tokens += stats.num_decode_tokens
        self.total_generation_tokens += stats.num_generation_tokens
        self.total_preemptions += stats.num_preemptions
        if self.enabled:
            self.interval_prefill_tokens += stats.num_prefill_tokens
            self.interval_generation_tokens += stats.num_generation_tokens

    def _log_line(self, stats: Stats) -> None:
        """v0.6's two lines: the throughput one, then the prefix-cache one
        only where a pool has a prefix cache (a rate of -1 means none)."""
        elapsed = stats.now - self.last_log_time
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Swapped: %d reqs, Pending: %d reqs, "
            "GPU KV cache usage: %.1f%%, CPU KV cache usage: %.1f%%.",
            self.interval_prefill_tokens / elapsed,
            self.interval_generation_tokens / elapsed,
            stats.num_running,
            stats.num_swapped,
            stats.num_waiting,
            stats.gpu_cache_usage * 100,
            stats.cpu_cache_usage * 100,
        )
        gpu_rate, cpu_rate = stats.prefix_cache_hit_rate, stats.cpu_prefix_cache_hit_rate
        if gpu_rate >= 0 or cpu_rate >= 0:
            logger.info(
                "Prefix cache hit rate: GPU: %.2f%%, CPU: %.2f%%", gpu_rate * 100, cpu_rate * 100
            )
        self.interval_prefill_tokens = self.interval_generation_tokens = 0
        self.last_log_time = stats.now


class PrometheusStatLogger:
    """vLLM's Prometheus metrics, by vLLM's names, for a server's /metrics.

    Shown every step's `Stats` and outputs (by `AsyncLLMEngine`, or V1's
    `StatLoggerManager`): the gauges take the queues, cache usage and the
    prefix-cache hit rate (-1 when caching is off, as v0.6), the counters
    add the step's prompt tokens (computed, as `Stats` counts them),
    generated tokens (all `best_of` sequences', as v0.6 counts the batch),
    preemptions and finished sequences by finish_reason, and the E2E
    histogram each finished request's latency. An aborted request, or one
    the scheduler ignored, counts nowhere, as in vLLM.

    The per-token histograms take the step's token latencies from `Stats`
    (TTFT and TPOT, recorded by the engines as they add tokens), so they do
    not depend on what the outputs hold (`output_kind`).

    Each logger has its own registry (vLLM uses prometheus_client's global
    one), so several engines can live in one process, as in the tests.
    """

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.registry = CollectorRegistry()
        names = list(labels)

        def make(cls, name: str, doc: str, extra: tuple[str, ...] = (), **kwargs):
            return cls(name, doc, [*names, *extra], registry=self.registry, **kwargs)

        self.gauge_scheduler_running = make(
            Gauge, "vllm:num_requests_running", "Number of requests running on the device."
        )
        self.gauge_scheduler_waiting = make(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.gauge_scheduler_swapped = make(
            Gauge, "vllm:num_requests_swapped", "Number of requests swapped to the CPU."
        )
        self.gauge_gpu_cache_usage = make(
            Gauge, "vllm:gpu_cache_usage_perc", "Device KV-cache usage (1 means 100 percent)."
        )
        self.gauge_cpu_cache_usage = make(
            Gauge, "vllm:cpu_cache_usage_perc", "CPU swap-pool usage (1 means 100 percent)."
        )
        self.gauge_gpu_prefix_cache_hit_rate = make(
            Gauge,
            "vllm:gpu_prefix_cache_hit_rate",
            "Device prefix-cache block hit rate since the start (1 means 100 percent).",
        )
        self.counter_num_preemption = make(
            Counter, "vllm:num_preemptions", "Cumulative number of preemptions."
        )
        self.counter_prompt_tokens = make(
            Counter, "vllm:prompt_tokens", "Number of prefill tokens computed."
        )
        self.counter_generation_tokens = make(
            Counter, "vllm:generation_tokens", "Number of generation tokens produced."
        )
        self.histogram_time_to_first_token = make(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=[
                0.001,
                0.005,
                0.01,
                0.02,
                0.04,
                0.06,
                0.08,
                0.1,
                0.25,
                0.5,
                0.75,
                1.0,
                2.5,
                5.0,
                7.5,
                10.0,
            ],
        )
        self.histogram_time_per_output_token = make(
            Histogram,
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            buckets=[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5],
        )
        self.histogram_e2e_time_request = make(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            buckets=[1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0],
        )
        self.counter_request_success = make(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            extra=("finished_reason",),
        )
        # Each metric shows (at 0) from the start, not from its first event.
        for metric in (
            self.counter_num_preemption,
            self.counter_prompt_tokens,
            self.counter_generation_tokens,
            self.histogram_time_to_first_token,
            self.histogram_time_per_output_token,
            self.histogram_e2e_time_request,
        ):
            metric.labels(**labels)

    def log(self, stats: Stats, request_outputs: list[RequestOutput]) -> None:
        """The step's `Stats`: everything is in them (the outputs are not read)."""
        self._log_gauges(stats)
        self._log_counters(stats)
        labels = self.labels
        for e2e in stats.time_e2e_requests:
            self.histogram_e2e_time_request.labels(**labels).observe(e2e)
        for ttft in stats.time_to_first_tokens_iter:
            self.histogram_time_to_first_token.labels(**labels).observe(ttft)
        for tpot in stats.time_per_output_tokens_iter:
            self.histogram_time_per_output_token.labels(**labels).observe(tpot)

    def _log_gauges(self, stats: Stats) -> None:
        labels = self.labels
        self.gauge_scheduler_running.labels(**labels).set(stats.num_running)
        self.gauge_scheduler_waiting.labels(**labels).set(stats.num_waiting)
        self.gauge_scheduler_swapped.labels(**labels).set(stats.num_swapped)
        self.gauge_gpu_cache_usage.labels(**labels).set(stats.gpu_cache_usage)
        self.gauge_cpu_cache_usage.labels(**labels).set(stats.cpu_cache_usage)
        self.gauge_gpu_prefix_cache_hit_rate.labels(**labels).set(stats.prefix_cache_hit_rate)

    def _log_counters(self, stats: Stats) -> None:
        labels = self.labels
        self.counter_num_preemption.labels(**labels).inc(stats.num_preemptions)
        self.counter_prompt_tokens.labels(**labels).inc(stats.num_prefill_tokens)
        self.counter_generation_tokens.labels(**labels).inc(stats.num_generation_tokens)
        for reason, count in collections.Counter(stats.finished_reasons).items():
            self.counter_request_success.labels(**labels, finished_reason=reason).inc(count)
