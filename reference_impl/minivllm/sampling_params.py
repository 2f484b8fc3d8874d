"""`SamplingParams`: how to pick each next token and when to stop.

Validated on construction, like vLLM's: a bad value raises `ValueError`
naming the parameter, the value and what is allowed, before any request
is queued.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5
# vLLM's default `max_logprobs`: the most top tokens a request may ask for.
MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


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
    # Every token id that ends this request: stop_token_ids, plus the EOS ids
    # that the engine adds when it accepts the request. The sampler masks
    # them while fewer than min_tokens tokens exist.
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = self._normalize_stop(self.stop)
        self._verify_args()
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.sampling_type == SamplingType.GREEDY:
            # As in vLLM: the argmax ignores these, and logprobs then
            # describe the distribution before truncation.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @staticmethod
    def _normalize_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            return [stop]
        if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            return list(stop)
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")

    def _verify_args(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}"
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1 or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be -1 (disable) or an integer >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer from 0 to {MAX_LOGPROBS}, got {value!r}"
                )
        if "" in self.stop:
            raise ValueError(f"stop must not contain an empty string, got {self.stop!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {bad}")
        if self.sampling_type == SamplingType.GREEDY and self.best_of > 1:
            raise ValueError(
                "n and best_of must be 1 when sampling greedily (temperature=0), "
                f"got n={self.n}, best_of={self.best_of}"
            )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM
