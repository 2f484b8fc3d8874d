"""`IncrementalDetokenizer`: a request's text, token by token, and its stop
strings (vLLM's `vllm/v1/engine/detokenizer.py`).

In V1 the engine core knows only token ids; text is made here, in the
front end. The decoding is the classic engine's (transformers_utils/
detokenizer.py, which this object feeds as if it were a sequence), but for
a special token among the logprob candidates, which V1 names by its text
even with skip_special_tokens (v0.6 named it ''); what is
V1's is where stop strings are found (here, after which the front end
aborts the request in the core), which one wins when several are found
(`check_stop_strings`), and the hold-back: while a request runs, its last
`max(len(stop)) - 1` characters are not shown, since they could be the
start of a stop string that the next token completes.
"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import PositionLogprobs, output_text_to_return
from minivllm.transformers_utils.detokenizer import Detokenizer


class IncrementalDetokenizer:
    def __init__(
        self, detokenizer: Detokenizer, params: SamplingParams, prompt_token_ids: list[int]
    ) -> None:
        self.detokenizer = detokenizer
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        # What the classic Detokenizer reads and writes on a sequence.
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[PositionLogprobs] = []
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_buffer_length = params.output_text_buffer_length
        self._last_output_text_offset = 0  # the text output_kind=DELTA has returned

    def get_output_token_ids(self) -> list[int]:
        return self.output_token_ids

    def update(
        self, new_token_ids: list[int], new_logprobs: list | None, stop_terminated: bool
    ) -> str | None:
        """Add tokens and their text; returns the stop string that ends the
        request, if one completed (the text is then cut at it).

        `stop_terminated`: the engine core ended the request on its last
        token (EOS or a stop token), whose text is then left out unless
        include_stop_str_in_output (vLLM does not decode it; cutting what it
        added leaves the same text). Stop strings are searched in the text of
        the new tokens past the first min_tokens, and only once there are
        more than min_tokens tokens, as vLLM's V1 does.
        """
        params = self.params
        stop_check_offset = len(self.output_text)
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if new_logprobs is not None:
                self.output_logprobs.append(new_logprobs[i])
            new_char_count = self.detokenizer.decode_sequence_inplace(
                self, params, name_special_candidates=True
            )
            last = i == len(new_token_ids) - 1
            if last and stop_terminated and not params.include_stop_str_in_output:
                self.output_text = self.output_text[: len(self.output_text) - new_char_count]
            elif params.min_tokens and len(self.output_token_ids) <= params.min_tokens:
                stop_check_offset = len(self.output_text)
        if not params.stop or len(self.output_token_ids) <= params.min_tokens:
            return None
        match = check_stop_strings(
            self.output_text,
            len(self.output_text) - stop_check_offset,
            params.stop,
            params.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_str, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool = False) -> str:
        """The text safe to show (all of it once finished); with `delta`,
        only what the previous delta call did not return."""
        return output_text_to_return(self, self.stop_buffer_length, finished, delta)


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """(the stop string found, the length to cut the text to, or -1 to keep
    it all) if a stop string ends in the last `new_char_count` characters of
    `output_text`, else None (vLLM's V1 function of the same name).

    Each string is looked for only where it would end in the new text. If
    several are found, the one that ends first wins, ties going to the one
    listed first: the text is cut where appending one character at a time
    would have stopped it. (The classic engine's twin, engine/stop_checker.py,
    takes the first listed that is found, as v0.6 did.)
    """
    if not new_char_count:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for stop_str in stop:
        first = len(output_text) + 1 - new_char_count - len(stop_str)
        start = output_text.find(stop_str, max(first, 0))
        if start != -1 and (best is None or start + len(stop_str) < best[0]):
            best = (start + len(stop_str), start, stop_str)
    if best is None:
        return None
    end, start, stop_str = best
    if include_in_output:
        return stop_str, -1 if end >= len(output_text) else end
    return stop_str, start
