"""`Request`: one request as V1's engine core sees it (vLLM's `vllm/v1/request.py`).

The classic engine keeps a `SequenceGroup` of `Sequence`s, each with a stage
(PREFILL or DECODE). V1 has one sequence per request (`n > 1` is fanned out
into child requests by the front end) and no stage: only two counters.

    num_tokens           prompt + output tokens known so far
    num_computed_tokens  how many of them have K/V in the cache

Each step the scheduler gives a request some of the difference. A fresh
prompt, a prompt chunk, a decode and a recompute after preemption are all
the same operation: let `num_computed_tokens` catch up with `num_tokens`.

`block_hashes` holds the chained hash of every full block of the request's
tokens (prompt and output), extended as tokens are appended, so the prefix
cache can look a request up, and cache its blocks, without hashing again.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.kv_cache_utils import BlockHash
from minivllm.v1.engine import EngineCoreEvent, EngineCoreEventType, FinishReason

if TYPE_CHECKING:
    from minivllm.v1.engine import EngineCoreRequest


class RequestStatus(enum.IntEnum):
    """Where a request is. Everything after PREEMPTED is a way to finish."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return {
            RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
            RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
            RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
            # A prompt that can never run (too long) ends as "length", as in vLLM.
            RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
        }.get(status)


# request -> the hashes of its full blocks not yet in request.block_hashes
BlockHasher = Callable[["Request"], list[BlockHash]]


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        block_hasher: BlockHasher | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens

        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache the first time it was
        # scheduled (-1 until then): reported back to the client.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # What happened to it in the core since its last output (see
        # EngineCoreEvent): the next output takes them to the front end.
        self.events: list[EngineCoreEvent] = []

        # Hashed into the first block: see kv_cache_utils.generate_block_hash_extra_keys.
        self.cache_salt = cache_salt
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, block_hasher: BlockHasher | None
    ) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            block_hasher=block_hasher,
            cache_salt=request.cache_salt,
        )

    def record_event(
        self, event_type: EngineCoreEventType, timestamp: float | None = None
    ) -> None:
        self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events since the last call (None if none)."""
        events, self.events = self.events, []
        return events or None

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash the blocks that have filled since the last call."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits of every prompt position, so a
        request asking for them computes its whole prompt, cache or not."""
        return self.sampling_params.prompt_logprobs is not None

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        """The priority queue's order, as in vLLM: lower `priority` first,
        then earlier arrival, then `request_id` (string order: "10" < "9"),
        then, for two objects with the same id, their `id()`: an arbitrary
        but fixed order, so two distinct requests never compare equal."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
