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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.outputs import RequestOutput
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


class PrometheusStatLogger:
    """vLLM's Prometheus metrics, by vLLM's names, for a server's /metrics.

    Shown every step's `Stats` and outputs (by `AsyncLLMEngine`): the
    gauges take the queues and cache usage, the counters add the step's
    prompt tokens (computed, as `Stats` counts them), generated tokens and
    preemptions, and the histograms time each request from its outputs'
    `RequestMetrics`: the first token (TTFT, from arrival), each later step
    that gave it a token (TPOT: the gap since its previous token) and its
    end (E2E). Finished requests count in `request_success_total` by
    finish_reason; an aborted one counts nowhere, as in vLLM.

    Generated tokens are counted from the outputs, so with best_of > n only
    the n returned sequences' tokens count. Each logger has its own
    registry (vLLM uses prometheus_client's global one), so several engines
    can live in one process, as in the tests.
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
        # request id -> (its last token's time, its output tokens so far)
        self._seen: dict[str, tuple[float, int]] = {}

    def log(self, stats: Stats, request_outputs: list[RequestOutput]) -> None:
        labels = self.labels
        self.gauge_scheduler_running.labels(**labels).set(stats.num_running)
        self.gauge_scheduler_waiting.labels(**labels).set(stats.num_waiting)
        self.gauge_scheduler_swapped.labels(**labels).set(stats.num_swapped)
        self.gauge_gpu_cache_usage.labels(**labels).set(stats.gpu_cache_usage)
        self.gauge_cpu_cache_usage.labels(**labels).set(stats.cpu_cache_usage)
        self.gauge_gpu_prefix_cache_hit_rate.labels(**labels).set(stats.prefix_cache_hit_rate)
        self.counter_num_preemption.labels(**labels).inc(stats.num_preemptions)
        self.counter_prompt_tokens.labels(**labels).inc(stats.num_prefill_tokens)
        for output in request_outputs:
            self._log_request(output)

    def _log_request(self, output: RequestOutput) -> None:
        labels, metrics, rid = self.labels, output.metrics, output.request_id
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        aborted = any(c.finish_reason == "abort" for c in output.outputs)
        if metrics is not None and metrics.first_token_time is not None and not aborted:
            last_time, last_tokens = self._seen.get(rid, (None, 0))
            if last_time is None:
                ttft = metrics.first_token_time - metrics.arrival_time
                self.histogram_time_to_first_token.labels(**labels).observe(ttft)
            elif num_tokens > last_tokens:
                tpot = metrics.last_token_time - last_time
                self.histogram_time_per_output_token.labels(**labels).observe(tpot)
            self.counter_generation_tokens.labels(**labels).inc(max(num_tokens - last_tokens, 0))
            self._seen[rid] = (metrics.last_token_time, num_tokens)
        if not output.finished:
            return
        self._seen.pop(rid, None)
        if aborted or metrics is None:
            return
        e2e = metrics.finished_time - metrics.arrival_time
        self.histogram_e2e_time_request.labels(**labels).observe(e2e)
        for completion in output.outputs:
            self.counter_request_success.labels(
                **labels, finished_reason=completion.finish_reason
            ).inc()
