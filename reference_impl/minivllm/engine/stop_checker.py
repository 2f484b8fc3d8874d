"""`StopChecker`: after each new token, has the sequence finished, and why?"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus


class StopChecker:
    """In vLLM's order: EOS, then stop_token_ids, then stop strings, then the
    length limits. None of the first three ends a sequence that has fewer
    than min_tokens tokens. Stop conditions win over length limits when both
    apply to the same token, so a sequence that ends on EOS at its last
    allowed token reports "stop".

    `eos_token_id` is the tokenizer's EOS (v0.6 keeps it on each sequence as
    `seq.eos_token_id`); other EOS ids of the generation config reach here as
    stop tokens (`SamplingParams.update_from_generation_config`).
    """

    def __init__(self, max_model_len: int, eos_token_id: int | None) -> None:
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

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
        eos = not params.ignore_eos and last == self.eos_token_id
        if eos or last in params.stop_token_ids:
            # The token that stopped the request keeps its id but loses its
            # text ("</s>" unless special tokens are skipped, " was" for a
            # stop token), unless include_stop_str_in_output.
            if new_char_count and not params.include_stop_str_in_output:
                seq.output_text = seq.output_text[:-new_char_count]
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = None if eos else last
        elif match := check_stop_strings(
            seq.output_text, new_char_count, params.stop, params.include_stop_str_in_output
        ):
            stop_str, truncate_to = match
            if truncate_to != -1:
                seq.output_text = seq.output_text[:truncate_to]
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop_str


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """(the stop string found, the length to cut the text to, or -1 to keep
    it all) if a stop string ends in the last `new_char_count` characters of
    `output_text`, else None (vLLM's function of the same name).

    Earlier text was searched on earlier steps, so each stop string is
    looked for only where it would end in the new characters. (v0.6 starts
    the search one character earlier, so a string that ended just before
    them could match a step late: one completed before min_tokens, which
    must not stop the request, ended it on the next token and cut text
    already streamed. V1's twin starts where we do.) The strings are tried
    in the order given and the first found wins, as in v0.6, even if another
    one ends earlier in the text (V1's twin, v1/engine/detokenizer.py, takes
    the one that ends first).
    """
    if not new_char_count:
        return None
    for stop_str in stop:
        start = max(len(output_text) + 1 - new_char_count - len(stop_str), 0)
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        if include_in_output:
            index += len(stop_str)
            if index >= len(output_text):
                return stop_str, -1
        return stop_str, index
    return None
