"""V1's stat loggers in the front end (vLLM's `vllm/v1/metrics/loggers.py`).

`AsyncLLM` hands every step's news to a `StatLoggerManager`: the engine
core's `SchedulerStats` (queues, KV-cache usage, prefix-cache lookups) and
the front end's `IterationStats` (prompt and generated tokens, and the
preemptions the outputs' events bring), with the step's `RequestOutput`s. From those it
builds the classic engine's `Stats`, so the very loggers the classic engine
feeds run unchanged on V1: the server's `PrometheusStatLogger` (vLLM's
`vllm:` metric names; token latencies from `IterationStats`, end-to-end
times from each finished output's `RequestMetrics`) and the periodic
throughput line (`StatLogger`).

What V1 feeds, metric by metric (engine/metrics.py has the names):

    vllm:num_requests_running / _waiting    SchedulerStats.num_running_reqs / num_waiting_reqs
    vllm:gpu_cache_usage_perc               SchedulerStats.kv_cache_usage
    vllm:gpu_prefix_cache_hit_rate          PrefixCacheStats, summed since the start or
                                            the last reset_prefix_cache (in tokens; the
                                            classic engine counts blocks; resumed
                                            requests' lookups left out); -1 with
                                            prefix caching off, as v0.6
    vllm:num_preemptions_total              IterationStats: the PREEMPTED events the
                                            outputs brought (vLLM V1's rule: counted
                                            when the request next makes a token)
    vllm:prompt_tokens_total                each request's prompt length when its first
                                            token comes (vLLM V1's rule; the classic
                                            engine counts prompt tokens computed, so a
                                            prefix-cache hit counts here, not there; with
                                            n > 1 every child request counts its prompt)
    vllm:generation_tokens_total            IterationStats: the new tokens of the outputs
    vllm:request_success_total,             each finished request's output: one per
    vllm:e2e_request_latency_seconds        completion by finish_reason, one latency
    vllm:time_to_first_token_seconds,       IterationStats: the OutputProcessor's, as
    vllm:time_per_output_token_seconds      it adds tokens, each engine-core request on
                                            its own (with n > 1, each child: vLLM V1's
                                            rule), whatever the outputs hold
    vllm:num_requests_swapped, vllm:cpu_cache_usage_perc
                                            always 0: V1 never swaps (it preempts by
                                            recompute) and has no CPU block pool

The engine core sends stats only when it steps. After an abort (a client
that hung up, a stop string found in the front end) it may have nothing
left to step: when the front end has no request left, every request the
core had is finished or aborted, so the manager records an idle scheduler
(`record_idle`) instead of keeping the last step's queues on show.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from minivllm.engine.metrics import StatLogger, Stats
from minivllm.engine.protocol import StepStatLogger
from minivllm.outputs import RequestOutput
from minivllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

# Seconds between throughput log lines (the classic LLMEngine's interval).
LOG_INTERVAL_S = 5.0


class StatLoggerManager:
    """Every stat logger of one V1 engine (`AsyncLLM`, or `LLMEngine` with
    `log_stats`), and what it needs to build the classic `Stats`: the
    prefix-cache totals and the last step's state. `log_stats`: also print
    vLLM's throughput line every few seconds. `enable_prefix_caching`: the
    engine's, so the hit rate reads -1 without a cache (v0.6's rule)."""

    def __init__(self, log_stats: bool = False, enable_prefix_caching: bool = False) -> None:
        self.stat_loggers: dict[str, StepStatLogger] = {}
        self.log_line = StatLogger(log_interval=LOG_INTERVAL_S, enabled=log_stats)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.last_stats = self._idle_stats()

    def add_logger(self, name: str, stat_logger: StepStatLogger) -> None:
        if name in self.stat_loggers:
            raise KeyError(f"a stat logger named {name!r} is already added")
        self.stat_loggers[name] = stat_logger

    def remove_logger(self, name: str) -> None:
        del self.stat_loggers[name]

    # -- building the classic Stats --------------------------------------------------

    def make_stats(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
        request_outputs: Sequence[RequestOutput] = (),
    ) -> Stats:
        """One step's `Stats`: the scheduler's state after it, the tokens of
        its outputs, the requests its outputs finished. Without
        SchedulerStats, the last step's state."""
        if scheduler_stats is not None and scheduler_stats.prefix_cache_stats is not None:
            self._add_prefix_cache_stats(scheduler_stats.prefix_cache_stats)
        last = self.last_stats
        stats = Stats(
            now=time.time(),
            num_running=last.num_running if scheduler_stats is None
            else scheduler_stats.num_running_reqs,
            num_waiting=last.num_waiting if scheduler_stats is None
            else scheduler_stats.num_waiting_reqs,
            num_swapped=0,  # V1 preempts by recompute only
            gpu_cache_usage=last.gpu_cache_usage if scheduler_stats is None
            else scheduler_stats.kv_cache_usage,
            cpu_cache_usage=0.0,  # no CPU block pool
            num_prefill_tokens=iteration_stats.num_prompt_tokens,
            num_decode_tokens=iteration_stats.num_generation_tokens,
            num_preemptions=iteration_stats.num_preempted_reqs,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            enable_prefix_caching=self.enable_prefix_caching,
            num_generation_tokens=iteration_stats.num_generation_tokens,
            time_to_first_tokens_iter=iteration_stats.time_to_first_tokens_iter,
            time_per_output_tokens_iter=iteration_stats.time_per_output_tokens_iter,
        )
        for output in request_outputs:
            add_finished_request(stats, output)
        return stats

    def _add_prefix_cache_stats(self, prefix: PrefixCacheStats) -> None:
        """Add a step's lookups to the totals. After `reset_prefix_cache`
        the totals start again from this step's: the hits counted before
        were on blocks the cache no longer has (vLLM resets its hit-rate
        window the same way)."""
        if prefix.reset:
            self.prefix_cache_queries = 0
            self.prefix_cache_hits = 0
        self.prefix_cache_queries += prefix.queries
        self.prefix_cache_hits += prefix.hits

    def _idle_stats(self) -> Stats:
        return Stats(
            now=time.time(),
            num_running=0,
            num_waiting=0,
            num_swapped=0,
            gpu_cache_usage=0.0,
            cpu_cache_usage=0.0,
            num_prefill_tokens=0,
            num_decode_tokens=0,
            num_preemptions=0,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    # -- recording ---------------------------------------------------------------------

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
        request_outputs: Iterable[RequestOutput],
    ) -> None:
        """One step's news, to every logger: every output the step made (a
        request with n > 1 makes one per child that moved, each holding all
        the parent's children; only the last child's is finished)."""
        request_outputs = list(request_outputs)
        stats = self.make_stats(scheduler_stats, iteration_stats, request_outputs)
        self._log(stats, request_outputs)

    def record_idle(self) -> None:
        """No request is left anywhere: show an empty scheduler (see the
        module's docstring). Freed blocks count as free, cached or not."""
        self._log(self._idle_stats(), [])

    def log_current(self) -> None:
        """The last step's state again, with nothing of a step (do_log_stats):
        the scheduler's gauges copied onto idle stats, so every per-step
        count and list stays empty, those added later too."""
        last = self.last_stats
        current = replace(
            self._idle_stats(),
            num_running=last.num_running,
            num_waiting=last.num_waiting,
            gpu_cache_usage=last.gpu_cache_usage,
        )
        self._log(current, [])

    def _log(self, stats: Stats, request_outputs: list[RequestOutput]) -> None:
        self.last_stats = stats
        self.log_line.log(stats)
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats, request_outputs)


def add_finished_request(stats: Stats, output: RequestOutput) -> None:
    """A request this step finished (not aborted) counts in `stats`: one
    finish reason per completion, and its latency from arrival."""
    if not output.finished or output.metrics is None:
        return
    reasons = [completion.finish_reason for completion in output.outputs]
    if "abort" in reasons:
        return
    stats.finished_reasons += reasons
    stats.time_e2e_requests.append(output.metrics.finished_time - output.metrics.arrival_time)

