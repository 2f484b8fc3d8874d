"""V1's per-step statistics (vLLM's `vllm/v1/metrics/stats.py`): the engine
core's `SchedulerStats`, and the front end's `IterationStats` of the outputs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.v1.engine import EngineCoreEvent, EngineCoreOutput


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the stats were last taken.

    requests: lookups made (one per request scheduled from the waiting queue
        with nothing computed, counted when it is admitted: a request looked
        up in several steps before there was room for it counts once).
    queries: tokens looked up (each request's `num_tokens`).
    hits: of those, tokens found in the cache.
    preempted_*: the same, for requests resumed after preemption.
    reset: the prefix cache was emptied (`reset_prefix_cache`) before these
        lookups: whoever sums the stats starts its hit rate again from them.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

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
    # Requests this step preempted (or a reset before it): not vLLM's, which
    # counts preemptions from events (IterationStats); our totals of a run
    # (LLMEngine.total_preemptions) read it, stats logged or not.
    num_preempted_reqs: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)


@dataclass
class IterationStats:
    """What the front end counts of one step's outputs (vLLM's
    `IterationStats`): token counts, preemptions, and the token latencies
    the `OutputProcessor` records as it adds the tokens (TTFT, and TPOT
    where vLLM's V1 has inter-token latencies: the same gaps)."""

    num_prompt_tokens: int = 0  # prompts of the requests that got their first token
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0  # PREEMPTED events these outputs brought
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    time_per_output_tokens_iter: list[float] = field(default_factory=list)

    def update_from_output(self, num_new_tokens: int, is_prefilling: bool, prompt_len: int) -> None:
        """One request's output: its new tokens; its prompt, counted once,
        when its first token comes (a prompt chunk that made no token is not
        counted yet: vLLM V1's rule)."""
        self.num_generation_tokens += num_new_tokens
        if is_prefilling and num_new_tokens:
            self.num_prompt_tokens += prompt_len

    def update_from_events(self, events: Iterable[EngineCoreEvent]) -> None:
        """A preemption counts when the request's next output brings its
        event (vLLM's rule): never, for a request aborted before it runs
        again."""
        from minivllm.v1.engine import EngineCoreEventType  # (v1.engine imports this module)

        self.num_preempted_reqs += sum(e.type == EngineCoreEventType.PREEMPTED for e in events)


def iteration_stats_of(
    outputs: Iterable[EngineCoreOutput], request_states: Mapping
) -> IterationStats:
    """The front end's token counts of one step's engine-core outputs, read
    before the OutputProcessor takes them (vLLM counts them inside it): a
    request whose state has no first token yet is prefilling; one with no
    state was aborted meanwhile and is not counted."""
    stats = IterationStats()
    for output in outputs:
        state = request_states.get(output.request_id)
        if state is not None:
            stats.update_from_output(
                len(output.new_token_ids),
                state.metrics.first_token_time is None,
                len(state.prompt_token_ids),
            )
            stats.update_from_events(output.events or ())
    return stats
