"""`InputProcessor`: a user's request, checked and tokenized, as an
`EngineCoreRequest` (vLLM's `vllm/v1/engine/input_processor.py`).

It runs in the front end, so the engine core never sees text: tokenizing
is off its busy loop, and a refused request never reaches it. The checks
are the classic engine's (inputs/preprocess.py) plus V1's own.

It also names requests for the engine (`assign_request_id`): the user's id
becomes `external_req_id`, and the request gets an internal id no request
the engine core may still hold has. The user's id cannot be that id: with
the engine core in its own process, outputs of a request the front end
has already ended (a stop string, an abort) are still on their way when a
new request reuses its id, and an `n > 1` request's children ("0_x", "1_x")
may share a user's id. So two live requests may share a user's id, as in
vLLM.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable

from minivllm.config import EngineConfig
from minivllm.inputs import InputPreprocessor, PromptType, get_eos_token_ids
from minivllm.sampling_params import SamplingParams
from minivllm.v1.engine import EngineCoreRequest
from minivllm.v1.engine.output_processor import child_request_id


class InputProcessor:
    def __init__(self, engine_config: EngineConfig, tokenizer) -> None:
        self.model_config = engine_config.model_config
        self.max_num_seqs = engine_config.scheduler_config.max_num_seqs
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
    ) -> tuple[str | None, EngineCoreRequest]:
        """(the prompt's text, if any; the request for the engine core, still
        under the user's id: see `assign_request_id`)."""
        # No live id is refused (the classic engine refuses one): ids are
        # made unique by assign_request_id.
        prompt_text, prompt_token_ids = self.input_preprocessor.validate_request(
            request_id, prompt, params, arrival_time, priority, set()
        )
        cache_salt = self.input_preprocessor.cache_salt_of(prompt, request_id)
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
        if params.n > self.max_num_seqs:
            # vLLM V1 takes any n and fans it out into n requests at once. A
            # larger n could run in turns, but an n of 2**63 froze our front
            # end building its children: it is capped as the classic engine
            # caps it (there the n sequences must run together).
            raise ValueError(
                f"Request {request_id!r}: n={params.n} must be at most max_num_seqs="
                f"{self.max_num_seqs}, the requests the engine runs at once"
            )
        params = copy.deepcopy(params)
        eos_token_id = self.tokenizer.eos_token_id
        params.update_from_generation_config(self.eos_token_ids, eos_token_id)
        params.update_from_tokenizer(self.tokenizer)
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - len(prompt_token_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=eos_token_id,
            arrival_time=time.time() if arrival_time is None else float(arrival_time),
            cache_salt=cache_salt,
            priority=int(priority),
        )
        return prompt_text, request

    @staticmethod
    def assign_request_id(
        request: EngineCoreRequest, is_request_active: Callable[[str], bool] | None
    ) -> None:
        """Move the user's id to `external_req_id` and give the request an
        internal id: the user's, plus "-" and 8 random hex digits when it
        might clash. `is_request_active` tells which internal ids are live;
        it is given when the engine core runs in this process, which then
        holds exactly the front end's live requests: a free id (and, for
        n > 1, free child ids) is kept as it is, so the scheduler, the
        tracer and a debugger show the user's ids. None (the core in its own
        process, where an ended request's outputs may still be on their
        way): always a suffix, as vLLM always adds one."""
        if request.external_req_id is not None:
            raise ValueError(
                f"Request {request.request_id!r}: external_req_id is set by the engine; "
                "give the user's id as request_id"
            )
        request.external_req_id = request_id = request.request_id
        if is_request_active is None or any(map(is_request_active, _core_ids(request))):
            request.request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"


def _core_ids(request: EngineCoreRequest) -> list[str]:
    """The ids `request` would hold in the front end and the engine core:
    its own (an n > 1 parent's in the front end) and its children's."""
    n = request.sampling_params.n
    children = [child_request_id(i, request.request_id) for i in range(n)] if n > 1 else []
    return [request.request_id, *children]
