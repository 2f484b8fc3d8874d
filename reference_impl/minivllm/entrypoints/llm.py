"""`LLM`: the offline batch interface, `from minivllm import LLM`."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence

from tqdm.auto import tqdm

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.utils import WrongTypeError, show


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
        self.llm_engine = LLMEngine.from_engine_args(engine_args, trace=trace)
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
        prompt_list = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are "
                    f"{len(prompt_list)} prompts: pass one SamplingParams or one per prompt"
                )
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(
                f"priority has {len(priorities)} entries but there are {len(prompt_list)} prompts"
            )
        request_ids = []
        for prompt, params, prio in zip(prompt_list, params_list, priorities, strict=True):
            request_id = str(next(self.request_counter))
            self.llm_engine.add_request(request_id, prompt, params, priority=prio)
            request_ids.append(request_id)
        return self._run_engine(request_ids, use_tqdm)

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
