"""`StopChecker`: after each new token, has the sequence finished, and why?"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus


class StopChecker:
    """In vLLM's order: EOS, then stop_token_ids, then stop strings, then the
    length limits. None of the first three ends a sequence that has fewer
    than min_tokens tokens. Stop conditions win over length limits when both
    apply to the same token, so a sequence that ends on EOS at its last
    allowed token reports "stop"."""

    def __init__(self, max_model_len: int, eos_token_ids: set[int]) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def maybe_stop_sequence(
        self, seq: Sequence, new_char_count: int, params: SamplingParams
    ) -> None:
        """new_char_count: characters the newest token added to output_text."""
        if seq.get_output_len() >= params.min_tokens:
            self._check_stop_conditions(seq, new_char_count, params)
        if seq.is_finished():
            return
        if seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        elif params.max_tokens is not None and seq.get_output_len() >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    def _check_stop_conditions(
        self, seq: Sequence, new_char_count: int, params: SamplingParams
    ) -> None:
        last = seq.get_last_token_id()
        if not params.ignore_eos and last in self.eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = last
        elif match := find_stop_string(seq.output_text, new_char_count, params.stop):
            index, stop_str = match
            end = index + len(stop_str) if params.include_stop_str_in_output else index
            seq.output_text = seq.output_text[:end]
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop_str


def find_stop_string(text: str, new_char_count: int, stop: list[str]) -> tuple[int, str] | None:
    """(start index, stop string) of the stop string that completes in the
    last `new_char_count` characters of `text`, or None.

    Earlier text was searched on earlier steps, so each stop string is
    looked for only where it would end in the new characters. If several
    complete, the one that ends first wins (the longest on a tie): the
    answer then does not depend on how the text was split into tokens.
    """
    found = []
    for stop_str in stop:
        start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index != -1:
            found.append((index + len(stop_str), index, stop_str))
    if not found:
        return None
    _, index, stop_str = min(found)
    return index, stop_str
