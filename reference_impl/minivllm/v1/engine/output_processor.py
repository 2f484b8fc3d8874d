"""`OutputProcessor`: the engine core's token ids, turned into the
`RequestOutput`s a user sees (vLLM's `vllm/v1/engine/output_processor.py`).

For each live request it keeps a `RequestState`: the detokenizer, the
logprobs, the times. Each step it takes the core's `EngineCoreOutput`s,
detokenizes, finds stop strings (those requests must also be aborted in
the core: `reqs_to_abort`), and makes a `RequestOutput` for every request
that changed. A request with `n > 1` was split into `n` child requests
(`ParentRequest`); their outputs are merged back into one here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import RequestMetrics
from minivllm.transformers_utils.detokenizer import Detokenizer
from minivllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from minivllm.v1.engine.detokenizer import IncrementalDetokenizer


class ParentRequest:
    """A request with `n > 1`: `n` independent child requests (vLLM's
    `vllm/v1/engine/parallel_sampling.py`). Child i is named `"{i}_{id}"`
    and, if the request is seeded, uses seed + i so the children differ."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.completions: dict[int, CompletionOutput] = {}
        self.num_finished = 0

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        seed = None if self.params.seed is None else self.params.seed + index
        params = replace(self.params, n=1, best_of=None, seed=seed)
        # `replace` builds the stop set afresh from stop_token_ids: keep the
        # EOS ids the input processor added, which the sampler bans before
        # min_tokens.
        params.all_stop_token_ids = set(self.params.all_stop_token_ids)
        return f"{index}_{self.request_id}", params

    @property
    def finished(self) -> bool:
        return self.num_finished == self.params.n


def fan_out(
    request: EngineCoreRequest,
) -> list[tuple[EngineCoreRequest, ParentRequest | None, int]]:
    """The requests the engine core runs for one user request, each with its
    parent and its index among the parent's n: itself alone when n == 1."""
    if request.sampling_params.n == 1:
        return [(request, None, 0)]
    parent = ParentRequest(request.request_id, request.sampling_params)
    children = []
    for index in range(parent.params.n):
        child_id, child_params = parent.get_child_info(index)
        child = replace(request, request_id=child_id, sampling_params=child_params)
        children.append((child, parent, index))
    return children


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    parent: ParentRequest | None = None
    index: int = 0  # the child's place among its parent's n
    cumulative_logprob: float = 0.0
    num_cached_tokens: int | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # stopped by a stop string: abort them in the core


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.request_states: dict[str, RequestState] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already running")
        params = request.sampling_params
        self.request_states[request.request_id] = RequestState(
            request.request_id,
            prompt,
            request.prompt_token_ids,
            params,
            IncrementalDetokenizer(self.detokenizer, params, request.prompt_token_ids),
            parent,
            index,
            metrics=RequestMetrics(request.arrival_time),
        )

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (and, for a parent id, its children); returns the
        ids to abort in the engine core."""
        to_abort = []
        for rid, state in list(self.request_states.items()):
            if rid in request_ids or (state.parent and state.parent.request_id in request_ids):
                del self.request_states[rid]
                to_abort.append(rid)
        return to_abort

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        now = time.time()
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted meanwhile
            metrics = state.metrics
            if metrics.first_token_time is None and output.new_token_ids:
                metrics.first_token_time = now
            metrics.last_token_time = now
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
            if finish_reason is not None:
                metrics.finished_time = now
                del self.request_states[output.request_id]
            request_output = self._make_request_output(state, finish_reason, stop_reason)
            if request_output is not None:
                request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def _make_request_output(
        self, state: RequestState, finish_reason: FinishReason | None, stop_reason: int | str | None
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        detok = state.detokenizer
        completion = CompletionOutput(
            index=state.index,
            text=detok.get_next_output_text(finished),
            token_ids=list(detok.output_token_ids),
            cumulative_logprob=state.cumulative_logprob
            if state.params.logprobs is not None
            else None,
            logprobs=list(detok.output_logprobs) if state.params.logprobs is not None else None,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
        )
        parent = state.parent
        if parent is None:
            return RequestOutput(
                state.request_id,
                state.prompt,
                list(state.prompt_token_ids),
                None,
                [completion],
                finished,
                state.metrics,
                state.num_cached_tokens,
            )
        parent.completions[state.index] = completion
        parent.num_finished += finished
        return RequestOutput(
            parent.request_id,
            state.prompt,
            list(state.prompt_token_ids),
            None,
            [parent.completions[i] for i in sorted(parent.completions)],
            parent.finished,
            state.metrics,
            state.num_cached_tokens,
        )
