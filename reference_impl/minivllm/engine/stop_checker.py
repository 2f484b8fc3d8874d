"""`StopChecker`: after each new token, has the sequence finished, and why?"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus


class StopChecker:
    """Stop tokens win over length limits when both apply to the same token,
    so a sequence that ends on EOS at its last allowed token reports "stop"."""

    def __init__(self, max_model_len: int, eos_token_ids: set[int]) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def maybe_stop_sequence(self, seq: Sequence, params: SamplingParams) -> None:
        last = seq.get_last_token_id()
        if not params.ignore_eos and last in self.eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = last
        elif seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        elif params.max_tokens is not None and seq.get_output_len() >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
