"""`IncrementalDetokenizer`: a request's text, token by token, and its stop
strings (vLLM's `vllm/v1/engine/detokenizer.py`).

In V1 the engine core knows only token ids; text is made here, in the
front end. The decoding is the classic engine's (transformers_utils/
detokenizer.py, which this object feeds as if it were a sequence); what is
V1's is where stop strings are found (here, after which the front end
aborts the request in the core) and the hold-back: while a request runs,
its last `max(len(stop)) - 1` characters are not shown, since they could
be the start of a stop string that the next token completes.
"""

from __future__ import annotations

from minivllm.engine.stop_checker import find_stop_string
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import PositionLogprobs
from minivllm.transformers_utils.detokenizer import Detokenizer


class IncrementalDetokenizer:
    def __init__(self, detokenizer: Detokenizer, params: SamplingParams) -> None:
        self.detokenizer = detokenizer
        self.params = params
        # What the classic Detokenizer reads and writes on a sequence.
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[PositionLogprobs] = []
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_buffer_length = (
            0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
        )

    def get_output_token_ids(self) -> list[int]:
        return self.output_token_ids

    def update(
        self, new_token_ids: list[int], new_logprobs: list | None, finished: bool
    ) -> str | None:
        """Add tokens and their text; returns the stop string that ends the
        request, if one completed (the text is then cut at it)."""
        params = self.params
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if new_logprobs is not None:
                self.output_logprobs.append(new_logprobs[i])
            new_char_count = self.detokenizer.decode_sequence_inplace(self, params)
            if len(self.output_token_ids) < params.min_tokens:
                continue
            match = find_stop_string(self.output_text, new_char_count, params.stop)
            if match is not None:
                index, stop_str = match
                end = index + len(stop_str) if params.include_stop_str_in_output else index
                self.output_text = self.output_text[:end]
                return stop_str
        if finished:
            self.detokenizer.flush(self, params)
        return None

    def get_next_output_text(self, finished: bool) -> str:
        """The text safe to show: all of it once finished."""
        if finished or not self.stop_buffer_length:
            return self.output_text
        return self.output_text[: max(len(self.output_text) - self.stop_buffer_length, 0)]
