"""`SamplingParams`: how to pick each next token and when to stop.

Validated on construction, like vLLM's: a bad value raises `ValueError`
naming the parameter, the value and what is allowed, before any request
is queued; a value of the wrong type (a string, None, a bool for a count,
a float for an integer) raises `WrongTypeError`, a TypeError that is also
a ValueError. Nothing accepted here can fail later inside a step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from minivllm.utils import (
    WrongTypeError,
    check_bool,
    check_float,
    check_int,
    check_seed,
    check_text,
    is_int,
    show,
)

_SAMPLING_EPS = 1e-5
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request holds (vLLM's enum)."""

    CUMULATIVE = 0  # everything generated so far, every step
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules (vLLM's names and meanings).

    n: sequences to return for the prompt.
    best_of: sequences to generate, of which the n with the highest
        cumulative logprob are returned (default n).
    presence_penalty: subtracted once from the logit of every token already
        in the output (> 0 favours new tokens), in [-2, 2] as in OpenAI's API.
    frequency_penalty: subtracted from a token's logit once per time it is
        already in the output, in [-2, 2].
    repetition_penalty: divides the positive logits (multiplies the negative
        ones) of every token seen in the prompt or output; 1 disables it.
    temperature: 0 means greedy (argmax); higher flattens the distribution.
    top_p: keep the smallest set of tokens whose probability reaches top_p.
    top_k: keep the k most likely tokens; -1 keeps all.
    min_p: drop tokens less likely than min_p times the most likely one.
    seed: a private random stream for this request, so its tokens do not
        depend on what else shares the batch.
    stop: strings that end the generation; the text ends before the first
        one generated (or after it with include_stop_str_in_output).
    stop_token_ids: finish when one of these is generated (it is kept in the
        output tokens, as vLLM does).
    ignore_eos: keep generating past the end-of-sequence token.
    max_tokens: the most tokens to generate.
    min_tokens: no EOS or stop token can be sampled, and no stop string ends
        the generation, before this many tokens.
    logprobs: also return, for each generated token, the log-probabilities of
        this many most likely tokens (the sampled one is always included).
    prompt_logprobs: the same for every prompt token after the first.
    skip_special_tokens: leave special tokens out of the output text.
    spaces_between_special_tokens: put a space between special tokens in
        the text, as a slow tokenizer does by default (fast tokenizers, the
        shipped model's included, decode the same either way).
    logit_bias: token id -> a number added to its logit before any other
        stage (OpenAI's, in [-100, 100]: -100 all but bans a token, +100 all
        but forces it).
    allowed_token_ids: only these tokens can be sampled.
    bad_words: words not to generate, as token sequences: each is tokenized
        as it would appear at the start of a text and after a space
        (`update_from_tokenizer`); a word of one token is never sampled, one
        of several loses its last token whenever the generated tokens end
        with the others (vLLM's V1 `bad_words`). The same text spelled with
        other tokens, or begun in the prompt, is not caught.
    output_kind: what each of the request's `RequestOutput`s holds
        (`RequestOutputKind`). `LLM.generate` sets FINAL_ONLY on its copy, as
        vLLM's does: it returns the final outputs only, so the engine need
        not build one per request per step. DELTA needs best_of == n: of
        more sequences than it returns, which n lead changes from step to
        step, and a delta of another sequence means nothing.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Every token id that ends this request: stop_token_ids, plus the EOS ids
    # that the engine adds when it accepts the request
    # (`update_from_generation_config`). The sampler masks them while fewer
    # than min_tokens tokens exist.
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False, compare=False)
    # The bad words as token ids, both spellings of each: filled by
    # `update_from_tokenizer` when the engine accepts the request.
    _bad_words_token_ids: list[list[int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._verify_args()
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.sampling_type == SamplingType.GREEDY:
            # As in vLLM: the argmax ignores these, and logprobs then
            # describe the distribution before truncation.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @property
    def output_text_buffer_length(self) -> int:
        """Characters of a running request's text not shown yet: one fewer
        than the longest stop string, which they could be the start of (none
        when the stop string stays in the text anyway). vLLM's name."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def update_from_generation_config(
        self, eos_token_ids: set[int], model_eos_token_id: int | None
    ) -> None:
        """Add the model's EOS ids to this request's copy, as vLLM's method of
        the same name does when the engine accepts a request (vLLM reads them
        from the generation config; `eos_token_ids` holds the tokenizer's and
        the generation config's, inputs/preprocess.py::get_eos_token_ids).

        Every one is banned before min_tokens, even with ignore_eos. The
        tokenizer's own (`model_eos_token_id`) ends the request as EOS
        (stop_reason None); the others (Llama 3's <|eot_id|>) become stop
        tokens, so stop_reason names them, unless ignore_eos.
        """
        self.all_stop_token_ids |= eos_token_ids
        extra = eos_token_ids - {model_eos_token_id} - set(self.stop_token_ids)
        if extra and not self.ignore_eos:
            self.stop_token_ids = list(self.stop_token_ids) + sorted(extra)

    def update_from_tokenizer(self, tokenizer) -> None:
        """Turn `bad_words` into token ids (vLLM's method of the same name,
        called when the engine accepts the request). A tokenizer spells a
        word differently at the start of a text and after a space (" word"
        is often one token where "word" is two), so each word is encoded
        both ways; the second spelling is kept only if it differs in its
        first token and has as many tokens as the first, as vLLM keeps it."""
        if not self.bad_words:
            self._bad_words_token_ids = None
            return
        words: list[list[int]] = []
        for bad_word in self.bad_words:
            for add_prefix_space in (False, True):
                text = (" " if add_prefix_space else "") + bad_word.lstrip()
                token_ids = tokenizer.encode(text, add_special_tokens=False)
                if not token_ids:
                    raise ValueError(f"bad_words: {bad_word!r} encodes to no token")
                last = words[-1] if add_prefix_space else None
                if last is None or (token_ids[0] != last[0] and len(token_ids) == len(last)):
                    words.append(token_ids)
        self._bad_words_token_ids = words

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    def _verify_args(self) -> None:
        """Check every field, and store it in its plain type (an int given
        for a float field becomes a float, a numpy integer an int).

        Integer fields take integers only (not 2.0, and not True: bool is an
        int to Python, but logprobs=True is no count); float fields take
        finite numbers; the flags take bools only (ignore_eos="no" is not
        False). A wrong type is a WrongTypeError (a TypeError, and a
        ValueError like every other refusal here).
        """
        self.n = check_int("n", self.n, low=1)
        if self.best_of is None:
            self.best_of = self.n
        self.best_of = check_int(
            "best_of", self.best_of, low=self.n, allowed=f"an integer >= n ({self.n})"
        )
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(
                self,
                name,
                check_float(name, getattr(self, name), low=-2, high=2, allowed="in [-2, 2]"),
            )
        # The sampler applies these two to float32 logits: a value float32
        # cannot hold (1e39 is inf there) turns logits into NaN.
        self.repetition_penalty = check_float(
            "repetition_penalty",
            self.repetition_penalty,
            low=_FLOAT32_TINY,
            high=_FLOAT32_MAX,
            allowed=(
                f"> 0 (1 disables it) and a normal float32, in [{_FLOAT32_TINY:.4g}, "
                f"{_FLOAT32_MAX:.4g}], as the sampler applies it to float32 logits"
            ),
        )
        self.temperature = check_float(
            "temperature",
            self.temperature,
            low=0,
            high=_FLOAT32_MAX,
            allowed=(
                f">= 0 (0 means greedy) and at most {_FLOAT32_MAX:.4g} (float32's largest: "
                "the sampler divides float32 logits by it)"
            ),
        )
        self.top_p = check_float(
            "top_p", self.top_p, low=0, high=1, low_open=True, allowed="in (0, 1]"
        )
        self.top_k = check_int(
            "top_k", self.top_k, low=-1, allowed="-1 (disable) or an integer >= 1"
        )
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disable) or an integer >= 1, got 0")
        self.min_p = check_float("min_p", self.min_p, low=0, high=1, allowed="in [0, 1]")
        if self.max_tokens is not None:
            self.max_tokens = check_int(
                "max_tokens", self.max_tokens, low=1, allowed="None or an integer >= 1"
            )
        self.min_tokens = check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:  # the engine caps it: check_max_logprobs
                allowed = "None or an integer >= 0"
                setattr(self, name, check_int(name, value, low=0, allowed=allowed))
        self.stop = self._normalize_stop(self.stop)
        if "" in self.stop:
            raise ValueError(f"stop must not contain an empty string, got {self.stop!r}")
        if self.seed is not None:
            self.seed = check_seed(self.seed, allowed_prefix="None or ")
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or a non-empty list, got []")
        self.bad_words = self._normalize_bad_words(self.bad_words)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens"):
            check_bool(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise WrongTypeError(
                "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                f"got {show(self.output_kind)}"
            )
        if self.output_kind == RequestOutputKind.DELTA and self.best_of != self.n:
            raise ValueError(
                f"best_of must equal n to use output_kind=DELTA, got n={self.n}, "
                f"best_of={self.best_of}"
            )
        if self.sampling_type == SamplingType.GREEDY and self.best_of > 1:
            raise ValueError(
                "n and best_of must be 1 when sampling greedily (temperature=0), "
                f"got n={self.n}, best_of={self.best_of}"
            )

    def check_max_logprobs(self, max_logprobs: int) -> None:
        """The engine's limit (its `max_logprobs` option, vLLM's 20 by
        default) on the top tokens a request may ask for, per position."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(
                    f"{name} must be at most max_logprobs={max_logprobs} (an engine option), "
                    f"got {value}"
                )

    @staticmethod
    def _normalize_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            return [stop]
        if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            return list(stop)
        raise WrongTypeError(f"stop must be a string or a list of strings, got {show(stop)}")

    @staticmethod
    def _normalize_stop_token_ids(ids: list[int] | None) -> list[int]:
        return [] if ids is None else _token_ids("stop_token_ids", ids)

    @staticmethod
    def _normalize_logit_bias(bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise WrongTypeError(
                f"logit_bias must be None or a dict of token id -> bias, got {show(bias)}"
            )
        token_ids = _token_ids("logit_bias", list(bias))
        values = [
            check_float("logit_bias", value, low=-100, high=100, allowed="in [-100, 100]")
            for value in bias.values()
        ]
        return dict(zip(token_ids, values, strict=True))

    @staticmethod
    def _normalize_bad_words(words: list[str] | None) -> list[str] | None:
        if words is None:
            return None
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise WrongTypeError(f"bad_words must be None or a list of strings, got {show(words)}")
        blank = [w for w in words if not w.strip()]
        if blank:
            raise ValueError(f"bad_words must be words, not empty or blank strings, got {blank}")
        return [check_text(f"bad_words[{i}]", word) for i, word in enumerate(words)]

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM


def _token_ids(name: str, ids) -> list[int]:
    """`ids` as a list of plain ints, each a token id (>= 0); the engine
    checks them against the vocabulary when it takes the request."""
    if not isinstance(ids, (list, tuple, set, frozenset)):
        raise WrongTypeError(f"{name} must be a list of non-negative integers, got {show(ids)}")
    wrong_type = [t for t in ids if not is_int(t)]
    if wrong_type:
        raise WrongTypeError(f"{name} must be non-negative integers, got {show(wrong_type)}")
    negative = [int(t) for t in ids if t < 0]
    if negative:
        raise ValueError(f"{name} must be non-negative integers, got {negative}")
    return [int(t) for t in ids]
