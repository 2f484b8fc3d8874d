"""SamplingParams: every rule of the full sampler's fields rejects a bad value
with a message naming the parameter, the value and what is allowed."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"presence_penalty": -2.1}, r"presence_penalty must be in \[-2, 2\], got -2.1"),
        ({"frequency_penalty": 3.0}, r"frequency_penalty must be in \[-2, 2\], got 3.0"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\], got -2.5"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0 .*got 0.0"),
        ({"repetition_penalty": -1.0}, r"repetition_penalty must be > 0 .*got -1.0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\], got -0.1"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 1.5}, "min_tokens must be an integer >= 0, got 1.5"),
        ({"min_tokens": 11, "max_tokens": 10}, "min_tokens must be <= max_tokens=10, got 11"),
        ({"logprobs": -1}, "logprobs must be None or an integer >= 0, got -1"),
        ({"prompt_logprobs": 0.5}, "prompt_logprobs must be None or an integer >= 0, got 0.5"),
        ({"stop": ""}, r"stop must not contain an empty string, got \[''\]"),
        ({"stop": ["ab", ""]}, r"stop must not contain an empty string, got \['ab', ''\]"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop": ["ab", 3]}, r"stop must be a string or a list of strings, got \['ab', 3\]"),
    ],
)
def test_bad_values_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_good_values_are_accepted_and_normalized():
    p = SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.5,
        min_p=1.0,
        min_tokens=16,
        max_tokens=16,
        logprobs=20,
        prompt_logprobs=0,
        stop="ab",
        stop_token_ids=[7],
    )
    assert p.stop == ["ab"] and p.all_stop_token_ids == {7}
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50
    # Greedy ignores truncation, as in vLLM: its logprobs are not truncated.
    greedy = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.3)
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (-1, 1.0, 0.0)


def test_the_engine_caps_logprobs_at_max_logprobs():
    """vLLM's `max_logprobs` (20 by default) is the engine's limit, not the
    parameters': 21 is a valid SamplingParams that an engine with the
    default refuses, naming the field and the option."""
    params = SamplingParams(logprobs=21, prompt_logprobs=3)
    params.check_max_logprobs(21)
    with pytest.raises(ValueError, match="logprobs must be at most max_logprobs=20 .*got 21"):
        params.check_max_logprobs(20)
    with pytest.raises(ValueError, match="^prompt_logprobs must be at most max_logprobs=2 "):
        SamplingParams(prompt_logprobs=3).check_max_logprobs(2)
