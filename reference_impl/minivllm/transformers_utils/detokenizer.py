"""Incremental detokenization: each step, decode only what the new token adds.

Decoding the whole output every step costs O(output length) per token.
Decoding the new token alone is wrong in two ways: a byte-level BPE token
may hold only part of a multi-byte UTF-8 character (it decodes to U+FFFD
until the rest arrives), and a SentencePiece token's text depends on
whether a token precedes it (the first token decoded loses its leading
space). So the new text is the difference between decoding a short window
of recent tokens with and without the new ones:

    prefix_offset          read_offset              len(output tokens)
        |-- already in output_text --|-- not in output_text yet --|

    new text = decode(tokens[prefix_offset:])[len(decode(tokens[prefix_offset:read_offset])):]

Until the first output tokens are in output_text, the context is the
prompt's last 5 tokens instead, as vLLM's (so a SentencePiece word start
keeps its space); unless they do not decode to whole characters, when
there is none. When the new text ends in an incomplete character, nothing
is added and the window waits for the next token. The result equals
decoding all output tokens at once (without `clean_up_tokenization_spaces`,
as vLLM does), except at the very end: a character still incomplete when
the sequence finishes is never added (the full decode would show it as
U+FFFD), and neither is the text of a stop token or EOS that ended it
(engine/stop_checker.py), as in vLLM.
"""

from __future__ import annotations

import os

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import PositionLogprobs, Sequence

# What an incomplete UTF-8 sequence decodes to.
_REPLACEMENT_CHAR = "\ufffd"
# Tokens before a logprob candidate that it is decoded after: enough for the
# rest of a 4-byte UTF-8 character and for a SentencePiece word start.
_LOGPROB_CONTEXT_TOKENS = 4
# Prompt tokens the first output tokens are decoded after (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_PROMPT_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # Every running sequence decodes twice a step, so `decode`'s Python
        # argument handling (several layers of it) cost more than the
        # decoding. A fast tokenizer that keeps the stock `decode` returns
        # exactly its Rust backend's decode when there is no clean-up: call
        # the backend directly then.
        cls = type(tokenizer)
        stock = (
            isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode
        )
        self._backend = tokenizer.backend_tokenizer if stock else None

    def _decode(
        self, token_ids: list[int], params: SamplingParams, skip_special_tokens: bool | None = None
    ) -> str:
        """`skip_special_tokens`: None for the request's own setting."""
        if skip_special_tokens is None:
            skip_special_tokens = params.skip_special_tokens
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def decode_sequence_inplace(
        self, seq: Sequence, params: SamplingParams, name_special_candidates: bool = False
    ) -> int:
        """Append the text of the sequence's newest token to its output_text
        (and name the candidates of its logprobs, if asked).

        Returns how many characters were added: the stop checker searches
        only those for stop strings.

        A special token among the candidates is named as the request's text
        would show it (v0.6: '' with skip_special_tokens), or always by its
        text with `name_special_candidates` (V1, which decodes each candidate
        with the tokenizer's default, `convert_ids_list_to_tokens`).
        """
        if params.logprobs is not None:
            output_ids = seq.get_output_token_ids()
            context = output_ids[-_LOGPROB_CONTEXT_TOKENS - 1 : -1]
            if len(context) < _LOGPROB_CONTEXT_TOKENS:  # the first tokens: after the prompt's
                context = (seq.prompt_token_ids[-_LOGPROB_CONTEXT_TOKENS:] + context)[
                    -_LOGPROB_CONTEXT_TOKENS:
                ]
            skip = False if name_special_candidates else None
            self._decode_candidates(seq.output_logprobs[-1], context, params, skip)
        return self._append_new_text(seq, params)

    def _prompt_context(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last tokens, if they decode to whole characters."""
        tail = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        return [] if _REPLACEMENT_CHAR in self._decode(tail, params) else tail

    def _append_new_text(self, seq: Sequence, params: SamplingParams) -> int:
        token_ids = seq.get_output_token_ids()
        if seq.read_offset == len(token_ids):
            return 0
        if seq.read_offset:
            context = token_ids[seq.prefix_offset : seq.read_offset]
        else:  # no output text yet
            context = self._prompt_context(seq.prompt_token_ids, params)
        prefix_text = self._decode(context, params)
        text = self._decode(context + token_ids[seq.read_offset :], params)
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return 0  # an incomplete character: wait for the next token
        new_text = text[len(prefix_text) :]
        seq.output_text += new_text
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(token_ids)
        return len(new_text)

    def decode_prompt_logprobs_inplace(
        self,
        prompt_token_ids: list[int],
        prompt_logprobs: list[PositionLogprobs | None],
        first: int,
        params: SamplingParams,
        name_special_candidates: bool = False,
    ) -> None:
        """Name the candidates of the prompt logprobs from position `first`
        on (`name_special_candidates` as in `decode_sequence_inplace`)."""
        skip = False if name_special_candidates else None
        for position in range(first, len(prompt_logprobs)):
            context = prompt_token_ids[max(position - _LOGPROB_CONTEXT_TOKENS, 0) : position]
            self._decode_candidates(prompt_logprobs[position], context, params, skip)

    def _decode_candidates(
        self,
        logprobs: PositionLogprobs,
        context: list[int],
        params: SamplingParams,
        skip_special_tokens: bool | None = None,
    ) -> None:
        """Set each candidate's decoded_token: the text it adds after `context`.

        The text is what differs from the context's own decode, so a token
        that completes a multi-byte character shows the whole character, and
        one that leaves it incomplete shows nothing ("", not U+FFFD): vLLM's
        rule, v0.6's (`detokenize_incrementally`) and V1's alike.
        """
        before = self._decode(context, params, skip_special_tokens)
        for token_id, logprob in logprobs.items():
            after = self._decode(context + [token_id], params, skip_special_tokens)
            text = after[len(os.path.commonprefix([before, after])) :]
            logprob.decoded_token = "" if text.endswith(_REPLACEMENT_CHAR) else text
