"""The engine core's per-step statistics (vLLM's `vllm/v1/metrics/stats.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the stats were last taken.

    requests: lookups made (one per request scheduled from the waiting queue
        with nothing computed: new, or resumed after preemption).
    queries: tokens looked up (each request's `num_tokens`).
    hits: of those, tokens found in the cache.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """A resumed request mostly finds its own blocks again: counted apart,
        so the hit rate says how much *new* work the cache saves."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SchedulerStats:
    """One step: what it computed, and the scheduler's state after it."""

    num_scheduled_tokens: int = 0  # token positions the model ran
    num_preempted_reqs: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
