"""`SamplingParams`: how to pick each next token and when to stop.

Validated on construction, like vLLM's: a bad value raises `ValueError`
naming the parameter, the value and what is allowed, before any request
is queued.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules (a subset of vLLM's, same names).

    temperature: 0 means greedy (argmax); higher flattens the distribution.
    top_p: keep the smallest set of tokens whose probability reaches top_p.
    top_k: keep the k most likely tokens; -1 keeps all.
    seed: a private random stream for this request, so its tokens do not
        depend on what else shares the batch.
    max_tokens: the most tokens to generate.
    stop_token_ids: finish when one of these is generated (it is kept in the
        output tokens, as vLLM does).
    ignore_eos: keep generating past the end-of-sequence token.
    n: sequences to return for the prompt.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify_args()

    def _verify_args(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1 or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be -1 (disable) or an integer >= 1, got {self.top_k!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {bad}")
        if self.sampling_type == SamplingType.GREEDY and self.n > 1:
            raise ValueError(f"n must be 1 when sampling greedily (temperature=0), got n={self.n}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM
