"""The messages between V1's front end and its engine core (vLLM's
`vllm/v1/engine/__init__.py`): what goes in (`EngineCoreRequest`) and
what comes out each step (`EngineCoreOutputs`). They are plain data, so the
engine core can run in another process and receive them over a socket.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import PositionLogprobs
from minivllm.v1.metrics.stats import SchedulerStats


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives the OpenAI API's word."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1  # the engine core took the request
    SCHEDULED = 2  # it left the waiting queue (first time, or resumed)
    PREEMPTED = 3  # it went back to the waiting queue


@dataclass
class EngineCoreEvent:
    """A moment of a request's life in the engine core, which only the
    core sees; the front end times requests and counts preemptions from
    them. vLLM stamps them with `time.monotonic()`; ours are wall-clock
    (`time.time()`), the clock of the front end's `RequestMetrics`, so a
    queue time is a difference of two times of one clock, core in another
    process or not."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None):
        return cls(event_type, time.time() if timestamp is None else timestamp)


@dataclass
class EngineCoreRequest:
    """A request after the front end tokenized and checked it.

    `request_id` is the engine's own (internal) id, unique among the
    requests the engine core may still hold; `external_req_id` is the id the
    user gave, which every `RequestOutput` carries (set by
    `InputProcessor.assign_request_id`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    # Salts the prefix cache's hashes: requests share cached blocks only
    # with requests of the same salt (a tenant's own, in a shared server).
    cache_salt: str | None = None
    priority: int = 0
    external_req_id: str | None = None


@dataclass
class EngineCoreOutput:
    """One request's news from one step: the tokens it gained (none for a
    prompt chunk that did not finish the prompt) and, at the end, why.
    With prompt_logprobs, the step that finishes the prompt also carries
    them, all at once (the core sends nothing for the chunks before).
    `events`: the request's events since its last output (so a preemption
    travels with the request's next token)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    new_prompt_logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = field(default_factory=time.monotonic)
