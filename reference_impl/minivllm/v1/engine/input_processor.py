"""`InputProcessor`: a user's request, checked and tokenized, as an
`EngineCoreRequest` (vLLM's `vllm/v1/engine/input_processor.py`).

It runs in the front end, so the engine core never sees text: tokenizing
is off its busy loop, and a refused request never reaches it. The checks
are the classic engine's (inputs/preprocess.py) plus V1's own.
"""

from __future__ import annotations

import copy
import time

from minivllm.config import EngineConfig
from minivllm.inputs import InputPreprocessor, PromptType, get_eos_token_ids
from minivllm.sampling_params import SamplingParams
from minivllm.v1.engine import EngineCoreRequest


class InputProcessor:
    def __init__(self, engine_config: EngineConfig, tokenizer) -> None:
        self.model_config = engine_config.model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = get_eos_token_ids(tokenizer, self.model_config.local_path)
        self.input_preprocessor = InputPreprocessor(
            tokenizer, self.model_config, engine_config.scheduler_config, self.eos_token_ids
        )

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None,
        priority: int,
        live_request_ids: set[str],
    ) -> tuple[str | None, EngineCoreRequest]:
        """(the prompt's text, if any; the request for the engine core)."""
        prompt_text, prompt_token_ids = self.input_preprocessor.validate_request(
            request_id, prompt, params, arrival_time, priority, live_request_ids
        )
        max_len = self.model_config.max_model_len
        if len(prompt_token_ids) == max_len:
            # V1 refuses it up front, as vLLM's `_validate_prompt_len` does: a
            # sequence's row holds max_model_len tokens, and the sampled token
            # would be one past it. (The classic engine, as v0.6, samples that
            # one token and caps the request by length.)
            raise ValueError(
                f"Request {request_id!r}: the prompt has {max_len} tokens, which with at "
                f"least 1 output token is longer than max_model_len={max_len}; prompts "
                f"may have at most {max_len - 1} tokens"
            )
        if params.best_of > params.n:
            raise ValueError(
                f"Request {request_id!r}: best_of={params.best_of} is not supported by the V1 "
                "engine (vLLM V1 removed it); use n, or the classic engine"
            )
        if params.prompt_logprobs is not None:
            raise ValueError(
                f"Request {request_id!r}: prompt_logprobs is not supported by minivllm's V1 "
                "engine yet; use the classic engine"
            )
        params = copy.deepcopy(params)
        eos_token_id = self.tokenizer.eos_token_id
        params.update_from_generation_config(self.eos_token_ids, eos_token_id)
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - len(prompt_token_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=eos_token_id,
            arrival_time=time.time() if arrival_time is None else float(arrival_time),
            priority=int(priority),
        )
        return prompt_text, request
