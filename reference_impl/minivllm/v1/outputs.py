"""What the worker returns for one step (vLLM's `vllm/v1/outputs.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sequence import PositionLogprobs


@dataclass
class ModelRunnerOutput:
    """Per request of the batch, in batch order (`req_id_to_index`).

    sampled_token_ids: the tokens each request sampled: one, or none for a
        request whose prompt is not finished yet.
    logprobs: per request, the logprobs of its sampled token (None unless it
        asked for them, or when it sampled nothing).
    prompt_logprobs_dict: by request id, the logprobs of its prompt tokens
        from the second on, for each request asking for them whose prompt
        this step finished (its chunks' gathered in the worker till then).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs_dict: dict[str, list[PositionLogprobs]] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], {}, [])
