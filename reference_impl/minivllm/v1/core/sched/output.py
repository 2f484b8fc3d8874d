"""What the scheduler sends the worker each step (vLLM's
`vllm/v1/core/sched/output.py`).

The worker keeps every running request's state from step to step (its
persistent batch), so a step carries only what changed: the whole of a
request the worker has never seen (`NewRequestData`), and for the others
(`CachedRequestData`) their new blocks and computed-token counts. This is
also what crosses the process boundary when the engine core runs apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sampling_params import SamplingParams
from minivllm.v1.request import Request


@dataclass
class NewRequestData:
    """A request scheduled for the first time: everything the worker needs."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: tokens already in the blocks

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )


@dataclass
class CachedRequestData:
    """The requests the worker has seen before, as parallel lists.

    resumed_req_ids: those back from preemption; their `new_block_ids`
        replace their blocks instead of extending them.
    all_token_ids: for requests not scheduled in the previous step (the
        worker's copy of their tokens may be stale), all their tokens.
    new_block_ids: per request, blocks added this step.
    num_computed_tokens: per request, tokens with K/V before this step.
    num_output_tokens: per request, tokens generated so far.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # request id -> tokens to compute for it this step
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # first blocks all running requests share (cascade attention's prefix;
    # vLLM keeps one count per KV-cache group, we have one group)
    num_common_prefix_blocks: int
    # requests preempted in this step (back in the waiting queue)
    preempted_req_ids: set[str]
    # requests finished since the last step: the worker drops their state
    finished_req_ids: set[str]
