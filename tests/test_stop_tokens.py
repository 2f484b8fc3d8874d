"""Stop tokens, EOS and min_tokens in both engines, as vLLM handles them
(v0.6's `StopChecker` and `update_from_generation_config`; V1's
`IncrementalDetokenizer.update`): the token that stopped a request keeps its
id but not its text, the generation config's extra EOS ids are stop tokens,
and every EOS is banned before min_tokens, ignore_eos or not.

Every expectation is worked from a first, unconstrained greedy run of the
shipped story model, decoded by its own tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from minivllm import LLM, SamplingParams
from minivllm.assets import DEFAULT_MODEL
from minivllm.sampling_params import RequestOutputKind
from minivllm.v1.engine.llm_engine import LLMEngine as V1LLMEngine

PROMPT = "Once upon a time"


@pytest.fixture(scope="module", params=[False, True], ids=["classic", "v1"])
def llm(request):
    return LLM(use_v1=request.param)


@pytest.fixture(scope="module")
def free_run() -> list[int]:
    """The greedy run's tokens (both engines give the same, tests/test_v1_engine.py)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return LLM().generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def text_of(llm: LLM, token_ids: list[int]) -> str:
    return llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_keeps_its_id_but_not_its_text(llm, free_run, include):
    k = 5
    stop_at = free_run[k]
    assert stop_at not in free_run[:k] and text_of(llm, [stop_at]).strip()
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                            include_stop_str_in_output=include)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    assert out.text == text_of(llm, free_run[: k + 1] if include else free_run[:k])


def test_every_eos_is_banned_before_min_tokens_even_with_ignore_eos():
    """vLLM's update_from_generation_config, worked by hand: the tokenizer's
    EOS 2 and the generation config's 2 and 219."""
    for ignore_eos in (False, True):
        params = SamplingParams(stop_token_ids=[7], ignore_eos=ignore_eos)
        params.update_from_generation_config({2, 219}, model_eos_token_id=2)
        assert params.all_stop_token_ids == {2, 7, 219}
        # The extra EOS becomes a stop token (stop_reason names it) unless ignored.
        assert params.stop_token_ids == ([7] if ignore_eos else [7, 219])


@pytest.fixture(scope="module")
def extra_eos_model(tmp_path_factory, free_run) -> tuple[str, int]:
    """The story model with a generation config that lists, beside the
    tokenizer's EOS, the 4th token of the greedy run (as Llama 3 lists
    <|eot_id|> beside <|end_of_text|>)."""
    path = tmp_path_factory.mktemp("extra-eos") / "model"
    shutil.copytree(DEFAULT_MODEL, path)
    extra = free_run[3]
    config = path / "generation_config.json"
    gen = json.loads(config.read_text()) if config.exists() else {}
    tokenizer_eos = LLM(str(path)).get_tokenizer().eos_token_id
    gen["eos_token_id"] = [tokenizer_eos, extra]
    config.write_text(json.dumps(gen))
    return str(path), extra


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_an_extra_eos_of_the_generation_config_is_a_stop_token(extra_eos_model, free_run,
                                                               use_v1):
    path, extra = extra_eos_model
    assert extra not in free_run[:3]
    llm = LLM(path, use_v1=use_v1)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[:4]
    assert (out.finish_reason, out.stop_reason) == ("stop", extra)
    assert out.text == text_of(llm, free_run[:3])
    # With ignore_eos it is not a stop, yet still banned before min_tokens.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=5)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:3] == free_run[:3] and extra not in out.token_ids[:5]
    assert (len(out.token_ids), out.finish_reason) == (12, "length")


def test_a_stop_string_on_the_last_allowed_token_reports_stop(llm, free_run):
    """A stop string that the max_tokens-th token completes: both apply, the
    stop string wins (v0.6 checks it before the length; V1's front end
    overrides the core's "length")."""
    k = 4
    text = text_of(llm, free_run[: k + 1])
    stop = text[len(text_of(llm, free_run[:k])) - 1 :]  # ends with the (k+1)-th token
    assert stop not in text[:-1]
    params = SamplingParams(temperature=0, max_tokens=k + 1, stop=[stop])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == free_run[: k + 1] and out.text == text[: -len(stop)]


def test_a_stop_string_within_min_tokens(llm, free_run):
    """A stop string that the min_tokens-th token completes: v0.6 checks stop
    strings from the min_tokens-th token on, so it stops there; vLLM's V1
    searches only the text of the tokens after the first min_tokens, so it
    runs on (to max_tokens, when the string does not come back)."""
    k = 3
    text = text_of(llm, free_run[:k])
    stop = text[len(text_of(llm, free_run[: k - 1])) - 1 :]
    assert text.find(stop) == len(text) - len(stop)
    full = text_of(llm, free_run)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=k,
                            stop=[stop])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    if isinstance(llm.llm_engine, V1LLMEngine):
        assert full.count(stop) == 1
        assert (out.token_ids, out.finish_reason, out.text) == (free_run, "length", full)
    else:
        assert (out.token_ids, out.finish_reason) == (free_run[:k], "stop")
        assert out.text == text[: -len(stop)]


def test_a_running_request_holds_back_the_longest_stop_string_less_one(llm, free_run):
    """vLLM's rule in both engines: while a request runs, its last
    max(len(stop)) - 1 characters are not shown, whether or not they could
    start a stop string; the final output shows everything."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["zz", "zzzzzz"])
    engine.add_request("held", PROMPT, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.outputs[0].text, len(o.outputs[0].token_ids), o.finished)
                 for o in engine.step()]
    assert [n for _, n, _ in seen] == list(range(1, 9))
    for text, n, finished in seen:
        full = text_of(llm, free_run[:n])
        assert text == (full if finished else full[:-5])


def test_a_stop_string_completed_before_min_tokens_never_stops_the_request(llm, free_run):
    """A stop string that a token before the min_tokens-th completes is
    skipped then, and a later token's check must not find it either: only
    text the new token completes is searched. (v0.6 searched from one
    character earlier, so it matched there one token late, ended the request
    and took back text it had already streamed.) Both engines run on to
    max_tokens when the string does not come back."""
    full = text_of(llm, free_run)
    # The end of the text after token k - 1, found nowhere else in the run.
    k, stop = next(
        (k, stop)
        for k in range(3, 10)
        for stop in (text_of(llm, free_run[: k - 1])[-n:] for n in (1, 2, 3))
        if stop.strip() and full.count(stop) == 1
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=k,
                            stop=[stop], output_kind=RequestOutputKind.DELTA)
    engine = llm.llm_engine
    engine.add_request("late", PROMPT, params)
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text
            final = out.outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("length", None)
    assert streamed == full
