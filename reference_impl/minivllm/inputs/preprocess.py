"""Turning what a user sends into a request an engine can run: the prompt
in its accepted forms, tokenized, and every check made before anything is
queued (vLLM's `vllm/inputs/preprocess.py` and the validation of its input
processor). Both engines use it, so a request is refused by the same rules,
with the same message, whichever engine runs it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from minivllm.config import ModelConfig, SchedulerConfig
from minivllm.sampling_params import SamplingParams
from minivllm.utils import WrongTypeError, check_float, check_int, check_text, is_int, show

PromptType = str | dict


def check_request_id(request_id: object) -> str:
    """A request id must be a string: engines key their requests by it."""
    if not isinstance(request_id, str):
        raise WrongTypeError(f"request_id must be a string, got {show(request_id)}")
    return request_id


def get_eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str) -> set[int]:
    """The tokenizer's EOS plus any the generation config adds (Llama 3
    lists several), as Hugging Face `generate` stops on all of them."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    try:
        gen = GenerationConfig.from_pretrained(model_path)
    except OSError:
        gen = None
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    return ids


class InputPreprocessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model_config: ModelConfig,
        scheduler_config: SchedulerConfig,
        eos_token_ids: set[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.scheduler_config = scheduler_config
        self.eos_token_ids = eos_token_ids

    def validate_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None,
        priority: int,
        live_request_ids: set[str],
    ) -> tuple[str | None, list[int]]:
        """The checks both engines make in `add_request` (vLLM's
        `_validate_model_inputs` and more); returns the prompt's text (if
        any) and token ids. Each engine adds its own checks after these."""
        check_request_id(request_id)
        if not isinstance(params, SamplingParams):
            raise WrongTypeError(
                f"Request {request_id!r}: params must be a SamplingParams, got {show(params)}"
            )
        priority = check_int(
            f"priority of request {request_id!r}",
            priority,
            allowed="an integer (lower values run first)",
        )
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            raise ValueError(
                f"Request {request_id!r}: priority={priority} needs scheduling_policy='priority'"
            )
        if arrival_time is not None:
            check_float(
                f"arrival_time of request {request_id!r}",
                arrival_time,
                allowed="None (now) or a finite number of seconds, like time.time()",
            )
        if request_id in live_request_ids:
            raise ValueError(
                f"Request id {request_id!r} is already in use by an unfinished request"
            )
        try:
            params.check_max_logprobs(self.model_config.max_logprobs)
        except ValueError as e:
            raise ValueError(f"Request {request_id!r}: {e}") from None
        vocab = self.model_config.hf_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:  # a max_logprobs above the vocabulary
                raise ValueError(
                    f"Request {request_id!r}: {name} must be at most the vocabulary's "
                    f"{vocab} tokens, got {value}"
                )
        prompt_text, prompt_token_ids = self.process_prompt(prompt, request_id)
        if not prompt_token_ids:
            raise ValueError(f"Request {request_id!r}: the prompt is empty (0 tokens)")
        max_len = self.model_config.max_model_len
        if len(prompt_token_ids) > max_len:
            raise ValueError(
                f"Request {request_id!r}: the prompt has {len(prompt_token_ids)} tokens, "
                f"longer than max_model_len={max_len}"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"Request {request_id!r}: prompt token ids {bad[:5]} are outside the "
                f"vocabulary [0, {vocab})"
            )
        # The bad words' token ids, on a copy: the engine fills its own copy
        # (as vLLM tokenizes its clone), the caller's object is left alone.
        tokenized = copy.copy(params)
        try:
            tokenized.update_from_tokenizer(self.tokenizer)
        except ValueError as e:
            raise ValueError(f"Request {request_id!r}: {e}") from None
        bad_words = tokenized.bad_words_token_ids or []
        # The sampler indexes the logits with them (stop tokens are banned
        # before min_tokens): an id past the vocabulary would fail in a step.
        for what, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias token ids", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words token ids", [t for word in bad_words for t in word]),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(
                    f"Request {request_id!r}: {what} {bad[:5]} are outside the "
                    f"vocabulary [0, {vocab})"
                )
        stops = set(params.stop_token_ids) | self.eos_token_ids  # all banned, ignore_eos or not
        bans_stops = params.min_tokens > 0 or self.model_config.dry_run
        if bans_stops and len(stops) >= vocab and stops >= set(range(vocab)):
            # The sampler bans them before min_tokens (the dry run always):
            # nothing would be left to draw.
            raise ValueError(
                f"Request {request_id!r}: stop_token_ids and EOS cover the whole vocabulary "
                f"({vocab} tokens), so no token could be sampled before min_tokens="
                f"{params.min_tokens}"
            )
        if bans_stops and params.allowed_token_ids and stops >= set(params.allowed_token_ids):
            raise ValueError(
                f"Request {request_id!r}: allowed_token_ids {params.allowed_token_ids[:5]} are "
                f"all stop or EOS tokens, so none could be sampled before min_tokens="
                f"{params.min_tokens}"
            )
        self._check_bad_words_leave_a_token(request_id, params, bad_words, stops, bans_stops)
        return prompt_text, prompt_token_ids

    def _check_bad_words_leave_a_token(
        self,
        request_id: str,
        params: SamplingParams,
        bad_words: list[list[int]],
        stops: set[int],
        bans_stops: bool,
    ) -> None:
        """Refuse bad words that could leave a step nothing to sample: the
        one-token ones (banned at every step) covering every allowed token,
        or, while min_tokens bans the stop tokens, the stops and the last
        tokens of all bad words (each banned at some step) covering them.
        (A step's other bans by longer words that leave nothing are undone
        by the sampler: `apply_bad_words`.)"""
        if not bad_words:
            return
        vocab = self.model_config.hf_config.vocab_size
        candidates = set(params.allowed_token_ids or range(vocab))
        if candidates <= {word[0] for word in bad_words if len(word) == 1}:
            raise ValueError(
                f"Request {request_id!r}: bad_words of one token ban every token "
                f"{'allowed_token_ids allows' if params.allowed_token_ids else 'of the vocabulary'}"
                ", so none could be sampled"
            )
        if bans_stops and candidates <= stops | {word[-1] for word in bad_words}:
            raise ValueError(
                f"Request {request_id!r}: the stop and EOS tokens and the bad_words' last tokens "
                f"cover every token that could be sampled, so a step before min_tokens="
                f"{params.min_tokens} could have none left"
            )

    def process_prompt(
        self, prompt: PromptType, request_id: str = ""
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt in one of its accepted forms;
        the ids are checked to be integers (numpy's too, not bools)."""
        forms = (
            "a string, {'prompt_token_ids': [...]} (with an optional 'prompt') or {'prompt': str}, "
            "each dict with an optional 'cache_salt'"
        )
        where = f"Request {request_id!r}: "
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(check_text(f"{where}prompt", prompt))
        if not isinstance(prompt, dict):
            raise WrongTypeError(f"{where}prompt must be {forms}, got {show(prompt)}")
        unknown = sorted(map(str, set(prompt) - {"prompt_token_ids", "prompt", "cache_salt"}))
        if unknown:
            raise ValueError(f"{where}prompt dict has unknown keys {unknown}: it must be {forms}")
        text = prompt.get("prompt")
        if not (text is None or isinstance(text, str)):
            raise WrongTypeError(f"{where}the prompt's 'prompt' must be a string, got {show(text)}")
        if "prompt_token_ids" not in prompt:
            if text is None:
                raise ValueError(f"{where}prompt must be {forms}, got {show(prompt)}")
            return text, self.tokenizer.encode(check_text(f"{where}the prompt's 'prompt'", text))
        return text, self.check_token_ids(prompt["prompt_token_ids"], where)

    @staticmethod
    def cache_salt_of(prompt: PromptType, request_id: str = "") -> str | None:
        """The prompt dict's 'cache_salt', checked (vLLM's rule: None, or a
        non-empty string). Only V1 uses it (kv_cache_utils hashes it into
        the request's first block); the classic engine refuses it."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is None:
            return None
        where = f"Request {request_id!r}: cache_salt must be a non-empty string"
        if not isinstance(salt, str):
            raise WrongTypeError(f"{where}, got {show(salt)}")
        if not salt:
            raise ValueError(f"{where}, got ''")
        return salt

    @staticmethod
    def check_token_ids(ids: object, where: str) -> list[int]:
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            ids = ids.tolist()  # plain ints, or floats / bools / lists to refuse below
        if isinstance(ids, (str, bytes, dict, set, frozenset)) or not isinstance(ids, Iterable):
            raise WrongTypeError(
                f"{where}prompt_token_ids must be a list of integers, got {show(ids)}"
            )
        ids = list(ids)
        bad = [(i, t) for i, t in enumerate(ids) if not is_int(t)]
        if bad:
            i, t = bad[0]
            raise WrongTypeError(
                f"{where}prompt_token_ids must be integers (token ids), got {show(t)} at "
                f"position {i}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
            )
        return [int(t) for t in ids]
