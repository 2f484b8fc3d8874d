"""Stop strings: where the text ends, which stop string wins, and streaming
that never shows part of a stop string it would have to take back.

Every stop string is cut from the text of a first, unconstrained greedy run,
so the tests do not depend on what the random tiny model happens to say.
"""

from __future__ import annotations

import itertools

import pytest

from minivllm import LLM, SamplingParams

PROMPT = "Hello, my name is"
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), block_size=8)


@pytest.fixture(scope="module")
def free_run(llm) -> tuple[str, list[int], list[int]]:
    """(text, token ids, text length after each token) of the greedy run."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    ends = [len(tok.decode(tokens[: k + 1])) for k in range(len(tokens))]
    return out[0].outputs[0].text, tokens, ends


def tokens_to_reach(ends: list[int], num_chars: int) -> int:
    """How many tokens the greedy run needs for its text to hold num_chars."""
    return next(k + 1 for k, end in enumerate(ends) if end >= num_chars)


def split_stop(text: str, ends: list[int]) -> tuple[str, int]:
    """A 4-character stop string that a token boundary cuts in two, at its
    first occurrence (not at the start of the text); and that boundary."""
    for b in ends:
        stop = text[b - 2 : b + 2]
        if b > 2 and len(stop) == 4 and stop.isprintable() and text.find(stop) == b - 2:
            return stop, b
    raise AssertionError(f"no token boundary to cut a stop string at in {text!r}")


def generate(llm, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kwargs)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(llm, free_run, include):
    text, tokens, ends = free_run
    stop, b = split_stop(text, ends)
    out = generate(llm, stop=[stop], include_stop_str_in_output=include)
    start = b - 2
    assert out.text == (text[: start + 4] if include else text[:start])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # Generation ended with the token that completed the stop string.
    assert out.token_ids == tokens[: tokens_to_reach(ends, start + 4)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_at_the_very_start(llm, free_run, include):
    text, tokens, ends = free_run
    stop = text[:3]
    out = generate(llm, stop=stop, include_stop_str_in_output=include)
    # With include_stop_str_in_output the text ends right after the stop
    # string, even when its last token carries more.
    assert out.text == (stop if include else "")
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == tokens[: tokens_to_reach(ends, 3)]


def first_at(text: str, i: int, *pieces: tuple[int, int]) -> bool:
    return all(text.find(text[i + a : i + b]) == i + a for a, b in pieces)


def test_a_stop_string_completed_on_an_earlier_token_wins(llm, free_run):
    """"ab" and "abc" at i, with a token ending right after "ab": "ab" is
    found on that token, before "abc" exists, whatever the list order."""
    text, _, ends = free_run
    i = next(i for i in range(1, len(text) - 3)
             if i + 2 in ends and first_at(text, i, (0, 2), (0, 3)))
    short, long = text[i : i + 2], text[i : i + 3]
    for stops in ([short, long], [long, short]):
        out = generate(llm, stop=stops)
        assert (out.text, out.stop_reason) == (text[:i], short)


def test_stop_strings_completed_on_the_same_token_the_first_listed_wins(llm, free_run):
    """v0.6 tries the stop strings in the order given and takes the first it
    finds. A token of 2+ characters ending at e completes both "xy" (ending
    at e - 1) and "yz" (ending at e): listed first, each one wins, and the
    text is cut where it starts."""
    text, _, ends = free_run
    e = next(e for prev, e in itertools.pairwise(ends) if e - prev >= 2 and e >= 4
             and first_at(text, e - 3, (0, 2), (1, 3)))
    xy, yz = text[e - 3 : e - 1], text[e - 2 : e]
    out = generate(llm, stop=[xy, yz])
    assert (out.text, out.stop_reason) == (text[: e - 3], xy)
    out = generate(llm, stop=[yz, xy])
    assert (out.text, out.stop_reason) == (text[: e - 2], yz)
    # vLLM's V1 takes the one that ends first, whatever the order.
    v1 = LLM(llm.llm_engine.model_config.model, use_v1=True, block_size=8)
    for stops in ([xy, yz], [yz, xy]):
        out = generate(v1, stop=stops)
        assert (out.text, out.stop_reason) == (text[: e - 3], xy)


def stream(llm, request_id: str, params: SamplingParams) -> list[str]:
    """The text of every RequestOutput the engine's step loop hands out."""
    engine = llm.llm_engine
    engine.add_request(request_id, PROMPT, params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    return texts


def test_streaming_never_shows_part_of_a_stop_string_that_completes(llm, free_run):
    text, tokens, ends = free_run
    stop, b = split_stop(text, ends)
    tok = llm.get_tokenizer()
    # The scenario arises: after the token ending at b, the text ends with
    # the first half of the stop string.
    assert tok.decode(tokens[: tokens_to_reach(ends, b)]).endswith(stop[:2])
    texts = stream(llm, "completes", SamplingParams(temperature=0, max_tokens=30, stop=stop))
    final = text[: b - 2]
    assert texts[-1] == final
    assert all(final.startswith(t) for t in texts)  # nothing shown is ever taken back
    assert len(texts) == tokens_to_reach(ends, b + 2)


def test_held_back_text_is_released(llm, free_run):
    """v0.6 holds back the longest stop string's length less one, 3
    characters here, while the request runs, and releases all of it once it
    finishes, here on max_tokens."""
    text, tokens, ends = free_run
    _, b = split_stop(text, ends)
    k = tokens_to_reach(ends, b)
    # A stop string that starts like the text at b but never completes.
    never = next(c for c in "#~§¶" if c not in text)
    stop = text[b - 2 : b] + never * 2
    texts = stream(llm, "released", SamplingParams(temperature=0, max_tokens=30, stop=stop))
    # The text so far: the decode, less a last character still incomplete.
    so_far = [llm.get_tokenizer().decode(tokens[: j + 1]).rstrip("\ufffd")
              for j in range(len(texts))]
    assert texts[:-1] == [t[:-3] for t in so_far[:-1]]
    assert texts[-1] == text
    texts = stream(llm, "capped", SamplingParams(temperature=0, max_tokens=k, stop=stop))
    assert texts[-1] == text[: ends[k - 1]] and len(texts) == k
