"""`LLM`: the offline batch interface, `from minivllm import LLM`."""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Iterable, Sequence

from tqdm.auto import tqdm

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.utils import WrongTypeError, show
from minivllm.v1.engine.llm_engine import LLMEngine as V1LLMEngine


class LLM:
    """Loads a model once, then `generate` runs batches of prompts to the end.

    Keyword arguments are engine options by their vLLM names (`block_size`,
    `max_num_seqs`, `swap_space`, `gpu_memory_utilization`, ...): see
    `EngineArgs`. `trace="run.jsonl"` records every step for the tracer
    (`minivllm-trace show run.jsonl`), as MINIVLLM_TRACE does.
    """

    def __init__(self, model: str | None = None, trace: str | None = None, **kwargs) -> None:
        if not (trace is None or isinstance(trace, (str, os.PathLike))):
            # open(3) would write the trace into file descriptor 3.
            raise WrongTypeError(f"trace must be None or a file path, got {show(trace)}")
        engine_args = EngineArgs.from_kwargs("LLM()", model=model, **kwargs)
        # use_v1=True (or MINIVLLM_USE_V1=1): vLLM's V1 engine, minivllm/v1/.
        engine_cls = V1LLMEngine if engine_args.resolve_use_v1() else LLMEngine
        self.llm_engine = engine_cls.from_engine_args(engine_args, trace=trace)
        self.request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | PromptType | Sequence[str | PromptType | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        prompts: a string, a {"prompt_token_ids": [...]} dict, or a list of
            strings, dicts or token-id lists.
        sampling_params: one for all prompts, or one per prompt.
        priority: one per prompt, with scheduling_policy="priority" (lower
            values first).
        """
        request_ids: list[str] = []
        try:
            self._validate_and_add_requests(prompts, sampling_params, priority, request_ids)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            # A refused prompt, or an interrupted call: nothing of this call
            # may linger in the engine and run in the next one.
            self.llm_engine.abort_request(request_ids)
            raise

    def _validate_and_add_requests(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        request_ids: list[str],
    ) -> None:
        """Pair each prompt with its parameters and priority, and add them
        one by one (vLLM's names), appending each request's id as it goes:
        if one is refused, those before it are in `request_ids`."""
        prompt_list = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = _one_per_prompt(
                "sampling_params", sampling_params, len(prompt_list), "one SamplingParams or "
            )
        priorities = (
            [0] * len(prompt_list)
            if priority is None
            else _one_per_prompt("priority", priority, len(prompt_list))
        )
        for prompt, params, prio in zip(prompt_list, params_list, priorities, strict=True):
            request_ids.append(self._add_request(prompt, params, prio))

    def _add_request(self, prompt: PromptType, params: SamplingParams, priority: int = 0) -> str:
        """One request into the engine, under the next number as its id
        (a good place for a breakpoint: every prompt of `generate` passes
        here). Returns the id.

        Only the final outputs are wanted, so the request asks for nothing
        else (output_kind FINAL_ONLY, as vLLM's `LLM` sets): the engine then
        builds no `RequestOutput` for it until it finishes. vLLM sets it on
        the caller's object; we set it on a copy, which leaves the caller's
        parameters as they were for any later use."""
        if params.output_kind != RequestOutputKind.FINAL_ONLY:
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.FINAL_ONLY
        request_id = str(next(self.request_counter))
        self.llm_engine.add_request(request_id, prompt, params, priority=priority)
        return request_id

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the V1 engine's prefix cache, so the next prompts find
        nothing cached (a benchmark's runs, new weights); True if it was
        emptied. Refused (False) while a request holds blocks, unless
        `reset_running_requests`: see `Scheduler.reset_prefix_cache`."""
        if not isinstance(self.llm_engine, V1LLMEngine):
            raise NotImplementedError(
                "LLM.reset_prefix_cache needs the V1 engine: vLLM v0.6's engine, which this "
                "LLM runs, had no reset_prefix_cache. Pass use_v1=True."
            )
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    @staticmethod
    def _normalize_prompts(prompts) -> list[PromptType]:
        """A list of prompts; a list (or tuple) in it is token ids, which
        add_request checks (numpy integers are integers too)."""
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if not isinstance(prompts, Iterable):
            raise WrongTypeError(
                "prompts must be a string, a prompt dict, or a list of strings, dicts or "
                f"token-id lists, got {show(prompts)}"
            )
        return [
            {"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p for p in prompts
        ]

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[rid] for rid in request_ids]


def _one_per_prompt(name: str, values, num_prompts: int, single: str = "") -> list:
    """`values` as a list of one entry per prompt (each entry is checked
    where it is used, by add_request). `single` names the other form
    accepted, for the error message."""
    allowed = f"{single}a list with one entry per prompt"
    if isinstance(values, (str, dict)) or not isinstance(values, Iterable):
        raise WrongTypeError(f"{name} must be {allowed}, got {show(values)}")
    values = list(values)
    if len(values) != num_prompts:
        raise ValueError(
            f"{name} has {len(values)} entries but there are {num_prompts} prompts: "
            f"pass {allowed}"
        )
    return values
