"""`OutputProcessor`: the engine core's token ids, turned into the
`RequestOutput`s a user sees (vLLM's `vllm/v1/engine/output_processor.py`).

For each live request it keeps a `RequestState`: the detokenizer, the
logprobs, the times. Each step it takes the core's `EngineCoreOutput`s,
detokenizes, finds stop strings (those requests must also be aborted in
the core: `reqs_to_abort`), and makes a `RequestOutput` for every request
that changed. A request with `n > 1` was split into `n` child requests
(`ParentRequest`); their outputs are merged back into one here.

Requests are kept by their internal ids (those the engine core knows), and
by the user's id (`external_req_ids`), which every `RequestOutput` carries
and by which a user aborts. For `AsyncLLM` each request's outputs go
straight into its `RequestOutputCollector`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.sequence import PositionLogprobs, RequestMetrics
from minivllm.transformers_utils.detokenizer import Detokenizer
from minivllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
)
from minivllm.v1.engine.detokenizer import IncrementalDetokenizer
from minivllm.v1.metrics.stats import IterationStats


class RequestOutputCollector:
    """One request's outputs, from the output handler to its generator
    (vLLM's name). If the generator falls behind, the unread outputs are
    merged into one (`RequestOutput.add`): a cumulative output replaces the
    one before it, DELTA outputs are added up, so a slow reader gets fewer
    outputs, never less text. An exception takes the place of any output
    and is raised to the reader."""

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.request_id = request_id  # the internal id (a parent's for n > 1)
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if isinstance(output, BaseException):
            self.output = output
        elif self.output is None:
            # A copy to merge into: the output itself is also the step's
            # (the stat loggers read it after this).
            self.output = replace(output, outputs=list(output.outputs))
        elif not isinstance(self.output, BaseException):
            self.output.add(output, aggregate=self.aggregate)
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


def child_request_id(index: int, parent_id: str) -> str:
    """The internal id of a parent's child `index` (vLLM's naming)."""
    return f"{index}_{parent_id}"


class ParentRequest:
    """A request with `n > 1`: `n` independent child requests (vLLM's
    `vllm/v1/engine/parallel_sampling.py`). Child i is named `"{i}_{id}"`
    after the parent's internal id and, if the request is seeded, uses
    seed + i so the children differ."""

    def __init__(self, request: EngineCoreRequest) -> None:
        assert request.external_req_id is not None, "assign_request_id first"
        self.request_id = request.request_id
        self.external_req_id = request.external_req_id
        self.params = request.sampling_params
        self.completions: dict[int, CompletionOutput] = {}
        self.child_requests: set[str] = set()  # the children not finished

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        seed = None if self.params.seed is None else self.params.seed + index
        params = replace(self.params, n=1, best_of=None, seed=seed)
        # `replace` runs __init__, which rebuilds the fields the engine fills
        # (init=False): keep the parent's, the EOS ids the input processor
        # added to the stop set and the bad words' token ids (vLLM copies
        # the parent's params, which keeps them).
        for f in fields(SamplingParams):
            if not f.init:
                setattr(params, f.name, copy.copy(getattr(self.params, f.name)))
        child_id = child_request_id(index, self.request_id)
        self.child_requests.add(child_id)
        return child_id, params

    @property
    def finished(self) -> bool:
        return not self.child_requests


def fan_out(
    request: EngineCoreRequest,
) -> list[tuple[EngineCoreRequest, ParentRequest | None, int]]:
    """The requests the engine core runs for one user request, each with its
    parent and its index among the parent's n: itself alone when n == 1."""
    if request.sampling_params.n == 1:
        return [(request, None, 0)]
    parent = ParentRequest(request)
    children = []
    for index in range(parent.params.n):
        child_id, child_params = parent.get_child_info(index)
        child = replace(request, request_id=child_id, sampling_params=child_params)
        children.append((child, parent, index))
    return children


@dataclass
class RequestState:
    request_id: str  # internal: the engine core's
    external_req_id: str  # the user's
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    parent: ParentRequest | None = None
    index: int = 0  # the child's place among its parent's n
    queue: RequestOutputCollector | None = None  # AsyncLLM's; LLMEngine's step returns them
    cumulative_logprob: float = 0.0
    # With prompt_logprobs: [] until the core sends them, then None (nothing
    # predicts the first token) and one entry per later prompt token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_returned: bool = False  # DELTA returns them once
    num_cached_tokens: int = 0  # vLLM's start: an abort before any output reports 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]  # every one made (queued ones too)
    reqs_to_abort: list[str]  # stopped by a stop string: abort them in the core


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.request_states: dict[str, RequestState] = {}  # by internal id
        self.parent_requests: dict[str, ParentRequest] = {}  # by the parent's internal id
        # The user's id -> the internal ids of its live requests (children for n > 1).
        self.external_req_ids: defaultdict[str, list[str]] = defaultdict(list)

    def get_num_unfinished_requests(self) -> int:
        """Live requests in the engine core's count: children one by one."""
        return len(self.request_states)

    def get_num_unfinished_user_requests(self) -> int:
        """Live requests as users count them: a parent and its children once."""
        singles = sum(state.parent is None for state in self.request_states.values())
        return singles + len(self.parent_requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def is_request_active(self, request_id: str) -> bool:
        """Whether an internal id is live (a request's, or an n > 1 parent's)."""
        return request_id in self.request_states or request_id in self.parent_requests

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        assert request.external_req_id is not None, "assign_request_id first"
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already running")
        params = request.sampling_params
        self.request_states[request.request_id] = RequestState(
            request.request_id,
            request.external_req_id,
            prompt,
            request.prompt_token_ids,
            params,
            IncrementalDetokenizer(self.detokenizer, params, request.prompt_token_ids),
            parent,
            index,
            queue,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(request.arrival_time),
        )
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
        self.external_req_ids[request.external_req_id].append(request.request_id)

    def abort_requests(self, request_ids: Iterable[str], internal: bool = False) -> list[str]:
        """Forget requests; returns the internal ids to abort in the engine
        core. The ids are users' (every live request given that id), or with
        `internal` the engine's own (a parent's means its children): the
        front end aborts its own request that way, not another that shares
        the user's id. A generator still reading (AsyncLLM) gets a last
        output, finished with finish_reason "abort" and the tokens so far,
        as in current vLLM (`LLMEngine.step` returns none: no one reads a
        queue there). Unknown or finished ids are ignored."""
        to_abort = []
        for request_id in self._internal_ids(request_ids, internal):
            state = self.request_states.get(request_id)
            if state is None:
                continue  # finished, or a child already aborted with its parent
            self._finish_request(state)
            if state.queue is not None:
                state.metrics.finished_time = time.time()
                final = self._make_request_output(state, FinishReason.ABORT, None)
                if final is not None:  # None: a FINAL_ONLY parent's other children still run
                    state.queue.put(final)
            to_abort.append(request_id)
        return to_abort

    def _internal_ids(self, request_ids: Iterable[str], internal: bool) -> list[str]:
        """The internal ids of the requests `request_ids` name (see abort_requests)."""
        ids: list[str] = []
        for request_id in request_ids:
            if not internal:
                ids += self.external_req_ids.get(request_id, [])
            elif request_id in self.parent_requests:
                ids += sorted(self.parent_requests[request_id].child_requests)
            else:
                ids.append(request_id)
        return ids

    def _finish_request(self, state: RequestState) -> None:
        """Drop a finished or aborted request from every map."""
        del self.request_states[state.request_id]
        siblings = self.external_req_ids[state.external_req_id]
        siblings.remove(state.request_id)
        if not siblings:
            del self.external_req_ids[state.external_req_id]
        parent = state.parent
        if parent is not None:
            parent.child_requests.discard(state.request_id)
            if parent.finished:
                self.parent_requests.pop(parent.request_id, None)

    def propagate_error(self, error: BaseException) -> None:
        """Every waiting generator raises `error`; every request is dropped
        (the engine core that held them is gone)."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put(error)
        self.request_states.clear()
        self.parent_requests.clear()
        self.external_req_ids.clear()

    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        """The step's `RequestOutput`s; `iteration_stats`, if given, gets the
        token latencies (TTFT, TPOT) of the requests that got tokens."""
        now = time.time()
        stats = IterationStats() if iteration_stats is None else iteration_stats
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted meanwhile
            metrics = state.metrics
            if output.events and metrics.first_scheduled_time is None:
                record_first_scheduling(metrics, output.events)
            if output.new_token_ids:
                metrics.record_token(
                    now, stats.time_to_first_tokens_iter, stats.time_per_output_tokens_iter
                )
            state.num_cached_tokens = output.num_cached_tokens
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            stop_str = state.detokenizer.update(
                output.new_token_ids, output.new_logprobs, finish_reason == FinishReason.STOP
            )
            if stop_str is not None:  # wins over a length limit reached on the same token
                if finish_reason is None:  # the core still runs it
                    reqs_to_abort.append(output.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_str
            if output.new_logprobs is not None:
                for token_id, entry in zip(output.new_token_ids, output.new_logprobs, strict=True):
                    state.cumulative_logprob += entry[token_id].logprob
            if output.new_prompt_logprobs is not None:
                state.prompt_logprobs = [None, *output.new_prompt_logprobs]
                self.detokenizer.decode_prompt_logprobs_inplace(
                    state.prompt_token_ids,
                    state.prompt_logprobs,
                    1,
                    state.params,
                    name_special_candidates=True,
                )
            if finish_reason is not None:
                metrics.finished_time = now
                self._finish_request(state)
            request_output = self._make_request_output(
                state, finish_reason, stop_reason, output.new_token_ids
            )
            if request_output is None:
                continue  # FINAL_ONLY, not finished
            if state.queue is not None:
                state.queue.put(request_output)
            request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def _make_request_output(
        self,
        state: RequestState,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        new_token_ids: Sequence[int] = (),
    ) -> RequestOutput | None:
        """The user's view: under the user's id, an n > 1 parent's
        completions merged; None where `output_kind` wants none yet.

        CUMULATIVE: everything so far. FINAL_ONLY: None until the request
        (all of a parent's children) has finished. DELTA: the text,
        `new_token_ids` and their logprobs, the prompt logprobs once; a
        parent's other children appear with nothing new (their finish
        reasons kept), so that adding up a stream's deltas by `index`
        gives each completion whole. (vLLM's streamed output of a parent
        holds the child that moved alone.)"""
        kind = state.params.output_kind
        finished = finish_reason is not None
        parent = state.parent
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._completion(state, finish_reason, stop_reason, new_token_ids)
        prompt_logprobs = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            prompt_logprobs = None if state.prompt_logprobs_returned else prompt_logprobs or None
            state.prompt_logprobs_returned |= prompt_logprobs is not None
        if prompt_logprobs is not None:
            prompt_logprobs = list(prompt_logprobs)
        if parent is None:
            completions = [completion]
        else:
            parent.completions[state.index] = completion
            if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
                return None
            completions = [
                c if i == state.index or kind != RequestOutputKind.DELTA else _nothing_new(c)
                for i, c in sorted(parent.completions.items())
            ]
        return RequestOutput(
            state.external_req_id if parent is None else parent.external_req_id,
            state.prompt,
            list(state.prompt_token_ids),
            prompt_logprobs,
            completions,
            finished if parent is None else parent.finished,
            state.metrics,
            state.num_cached_tokens,
        )

    @staticmethod
    def _completion(
        state: RequestState,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        new_token_ids: Sequence[int],
    ) -> CompletionOutput:
        """One request's completion: cumulative, or (DELTA) only what is new."""
        finished = finish_reason is not None
        detok = state.detokenizer
        delta = state.params.output_kind == RequestOutputKind.DELTA
        token_ids = list(new_token_ids) if delta else list(detok.output_token_ids)
        logprobs = None
        if state.params.logprobs is not None:
            logprobs = detok.output_logprobs[len(detok.output_logprobs) - len(token_ids) :]
        return CompletionOutput(
            index=state.index,
            text=detok.get_next_output_text(finished, delta),
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob
            if state.params.logprobs is not None
            else None,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
        )


def _nothing_new(completion: CompletionOutput) -> CompletionOutput:
    """A DELTA completion of a child that did not move this step."""
    empty_logprobs = None if completion.logprobs is None else []
    return replace(completion, text="", token_ids=[], logprobs=empty_logprobs)


def record_first_scheduling(metrics: RequestMetrics, events: list[EngineCoreEvent]) -> None:
    """The request's first SCHEDULED event, as the classic engine times it:
    when it first left the queue, and its time in the queue since arrival
    (vLLM V1's `scheduled_ts`; a resumed request's later ones are ignored)."""
    for event in events:
        if event.type == EngineCoreEventType.SCHEDULED:
            metrics.first_scheduled_time = event.timestamp
            metrics.time_in_queue = event.timestamp - metrics.arrival_time
            return
