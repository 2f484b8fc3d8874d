"""The OpenAI-compatible server, started for real (tests/server_utils.py)
on the shipped story model and called with the official `openai` client
and raw HTTP.

Oracles: the offline `LLM.generate` on the same model and parameters (the
text, tokens and logprobs a request must get), and OpenAI's documented wire
format (the stream's events, their order, the error body).
"""

from __future__ import annotations

import json
import math
import time

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from tests.paced_scheduler import LONG_MAX_TOKENS
from tests.server_utils import RemoteOpenAIServer, num_successes

# A real server process for the module (about 10 s to start, a minute in all).
pytestmark = pytest.mark.slow

MODEL = "minivllm-stories"
PACED = "tests.paced_scheduler.LongRequestPacedScheduler"
PROMPTS = ["Once upon a time", "The little dog", "Long ago, there was a shy rabbit called Tom"]


@pytest.fixture(scope="module")
def server():
    # Steps are paced while a LONG_MAX_TOKENS request runs: a client can hang
    # up on it before it finishes, however fast the machine.
    with RemoteOpenAIServer(["--scheduler-cls", PACED]) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.get_client()


@pytest.fixture(scope="module")
def llm():
    return LLM()


def offline(llm: LLM, prompt: str, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def sse_events(response: httpx.Response) -> list[str]:
    """The raw `data:` payloads of a stream, checking the framing: every
    event is exactly one `data: ...` line followed by a blank line."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), body[:500]
    return [e[len("data: ") :] for e in events]


def wait_until_idle(server: RemoteOpenAIServer, timeout: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


# -- the basics -----------------------------------------------------------------


def test_models_version_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    # Any origin may call it by default (vLLM's CORS defaults).
    r = httpx.get(server.url_for("v1", "models"), headers={"Origin": "http://page.example"})
    assert r.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" not in r.headers  # only with --enable-request-id-headers
    assert models[0].root.endswith("minivllm-stories")
    assert models[0].max_model_len == 512
    # vLLM's card lists one permission: sampling and logprobs allowed, fine-tuning not.
    [permission] = models[0].permission
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"]
    assert not permission["allow_fine_tuning"]
    assert httpx.get(server.url_for("version")).json()["version"]
    assert httpx.get(server.url_for("health")).status_code == 200


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_offline(client, llm, prompt):
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    expected = offline(llm, prompt, max_tokens=40, temperature=0)
    choice = result.choices[0]
    assert result.object == "text_completion"
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_several_prompts_in_one_completion_request(client, llm):
    result = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in result.choices] == [0, 1, 2]
    for choice, prompt in zip(result.choices, PROMPTS, strict=True):
        assert choice.text == offline(llm, prompt, max_tokens=12, temperature=0).outputs[0].text
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert result.usage.prompt_tokens == sum(map(len, prompt_ids))


def test_token_id_prompt_and_echo(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    by_text = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, echo=True
    )
    assert by_text.choices[0].text == PROMPTS[0] + by_ids.choices[0].text


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.9, seed=11, top_p=0.9, top_k=20),
        dict(temperature=0.7, seed=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=0, repetition_penalty=1.3, min_tokens=30),
        dict(temperature=0, stop=[" prince", "Ben"], include_stop_str_in_output=True),
        dict(temperature=0, stop_token_ids=[13], ignore_eos=True),
    ],
    ids=["top_p_k", "min_p_penalties", "repetition_min_tokens", "stop", "stop_token_ids"],
)
def test_sampling_fields_reach_the_engine(client, llm, params):
    """Every sampling field does what it does offline (same seed, same text)."""
    extra = {k: v for k, v in params.items() if k not in OPENAI_FIELDS}
    standard = {k: v for k, v in params.items() if k in OPENAI_FIELDS}
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=48, extra_body=extra, **standard
    )
    expected = offline(llm, PROMPTS[1], max_tokens=48, **params).outputs[0]
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage.completion_tokens == len(expected.token_ids)


OPENAI_FIELDS = {"temperature", "seed", "top_p", "presence_penalty", "frequency_penalty", "stop"}


# -- streaming ---------------------------------------------------------------------


def test_streamed_completion_matches_and_follows_the_wire_format(server, llm):
    body = dict(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=25,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *token_chunks, usage_chunk = chunks
    expected = offline(llm, PROMPTS[0], max_tokens=25, temperature=0).outputs[0]
    # One chunk per generated token; the finish_reason on the last only.
    assert len(token_chunks) == len(expected.token_ids)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == expected.text
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * (
        len(token_chunks) - 1
    ) + ["length"]
    assert all(c["usage"] is None for c in token_chunks)  # vLLM's completions chunks
    assert all(set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason",
                                        "stop_reason"} for c in token_chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 25,
        "total_tokens": 30,
    }


def test_streamed_deltas_concatenate_to_the_full_text(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=60, temperature=0.8, seed=3)
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
    )
    assert streamed == full


def test_n2_streams_two_indexed_choices(client, llm):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=1.0, seed=7, n=2)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        assert choice.index not in finishes, "a chunk after the choice's finish"
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    expected = offline(llm, PROMPTS[0], max_tokens=20, temperature=1.0, seed=7, n=2)
    # The outputs come most likely first (v0.6), each with its own index.
    assert texts == {c.index: c.text for c in expected.outputs}
    assert set(finishes) == {0, 1}
    full = client.completions.create(**kwargs)
    assert {c.index: c.text for c in full.choices} == texts
    assert full.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)


def test_chat_equals_offline_on_the_templated_prompt(client, llm):
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": PROMPTS[0]}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_completion_tokens=30
    )
    # The story model's template: BOS, then the non-system contents as they are.
    expected = offline(llm, PROMPTS[0], max_tokens=30, temperature=0).outputs[0]
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage.prompt_tokens == 5
    assert result.usage.completion_tokens == 30


def test_chat_without_a_limit_runs_to_eos(client, llm):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    result = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    expected = offline(llm, PROMPTS[1], max_tokens=None, temperature=0).outputs[0]
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].finish_reason == "stop"


def test_chat_echo_continues_the_assistant_message(server, client, llm):
    """With the story template a last assistant message is continued; echo
    puts it in front of the answer (vLLM's echo), streamed or not."""
    messages = [
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": ", there was a kind duck"},
    ]
    kwargs = dict(model=MODEL, messages=messages, temperature=0, max_tokens=15)
    full = client.chat.completions.create(extra_body={"echo": True}, **kwargs)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, extra_body={"echo": True}, **kwargs)
    )
    continuation = (
        offline(llm, PROMPTS[0] + ", there was a kind duck", max_tokens=15, temperature=0)
        .outputs[0]
        .text
    )
    assert full.choices[0].message.content == ", there was a kind duck" + continuation
    assert streamed == full.choices[0].message.content
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].message.content == continuation
    # With n = 2 the stream opens with both roles, then both echoes (vLLM's order).
    body = {**kwargs, "n": 2, "temperature": 1.0, "max_tokens": 2, "echo": True, "stream": True}
    with httpx.stream("POST", server.url_for("v1", "chat", "completions"), json=body,
                      timeout=60) as response:
        opening = [json.loads(e)["choices"][0] for e in sse_events(response)[:4]]
    assert [(c["index"], c["delta"]) for c in opening] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
        (0, {"content": ", there was a kind duck"}), (1, {"content": ", there was a kind duck"}),
    ]


def test_refusals_name_the_field_the_request_sent(server, client):
    """The param of a 400 is the field the client sent: chat's
    max_completion_tokens, n (not the best_of it stands for), and the text
    field holding a lone surrogate (valid JSON, not Unicode text a tokenizer
    takes: a 500 inside the tokenizer before)."""
    def refused(route: tuple[str, ...], body: dict) -> dict:
        # json.dumps escapes the surrogate ("\\ud800"); httpx's json= cannot encode it.
        response = httpx.post(server.url_for(*route), content=json.dumps(body), timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        return response.json()["error"]

    chat = ("v1", "chat", "completions")
    assert refused(chat, {**CHAT, "max_completion_tokens": 600})["param"] == "max_completion_tokens"
    too_many = {**COMPLETION, "n": 300, "temperature": 1.0}
    error = refused(("v1", "completions"), too_many)
    assert error["param"] == "n" and error["message"].startswith("n=300 sequences")
    assert refused(("v1", "completions"), {**COMPLETION, "prompt": "Once \ud800"})["param"] == (
        "prompt"
    )
    lone = {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}
    assert refused(chat, lone)["param"] == "messages"
    assert refused(("tokenize",), {"prompt": "\ud800"})["param"] == "prompt"
    # Unicode checked in every text field a tokenizer reads (a TypeError
    # from the tokenizer, a 500, before).
    error = refused(chat, {**CHAT, "bad_words": ["fine", "\ud800"]})
    assert error["param"] == "bad_words" and error["message"].startswith("bad_words[1]")
    # NaN is valid to Python's JSON; clipped into [-100, 100] it became a ban.
    assert refused(("v1", "completions"), {**COMPLETION, "logit_bias": {"5": float("nan")}})[
        "param"
    ] == "logit_bias"


def test_an_error_that_quotes_a_lone_surrogate_is_still_sent(server):
    """A 404 naming an unknown model quotes its name, which may hold a lone
    surrogate: the error body escapes it (it once failed to encode, a 500
    that also dropped the connection), and the connection serves on."""
    body = json.dumps({**COMPLETION, "model": "\ud800"})  # escaped: "\\ud800"
    with httpx.Client(timeout=30) as http:
        response = http.post(server.url_for("v1", "completions"), content=body,
                             headers={"content-type": "application/json"})
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        assert "\ud800" in error["message"]
        assert http.post(server.url_for("v1", "completions"), json=COMPLETION).status_code == 200


def test_empty_stream_options_ask_for_usage(server):
    """vLLM's StreamOptions: include_usage defaults to true once the object
    is given; an empty one without stream is not refused."""
    body = {**COMPLETION, "stream": True, "stream_options": {}}
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body, timeout=60) as r:
        last = json.loads(sse_events(r)[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    plain = httpx.post(server.url_for("v1", "completions"), timeout=60,
                       json={**COMPLETION, "stream_options": {}})
    assert plain.status_code == 200


def test_streamed_chat_follows_the_wire_format(server, llm):
    body = dict(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    with httpx.stream("POST", server.url_for("v1", "chat", "completions"), json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    role, *content, usage = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in [role, *content, usage])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["choices"][0]["finish_reason"] is None
    expected = offline(llm, PROMPTS[0], max_tokens=12, temperature=0).outputs[0]
    assert len(content) == 12
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == expected.text
    assert [c["choices"][0]["finish_reason"] for c in content][-2:] == [None, "length"]
    # stop_reason only on the last chunk, as vLLM's exclude_unset sends it
    assert not any("stop_reason" in c["choices"][0] for c in [role, *content[:-1]])
    assert content[-1]["choices"][0]["stop_reason"] is None
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12


def test_streamed_chat_with_the_client_and_n2(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[2]}],
        n=2,
        temperature=0.9,
        seed=4,
        max_tokens=15,
    )
    texts, roles = {0: "", 1: ""}, set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        if delta.role:
            roles.add(chunk.choices[0].index)
        texts[chunk.choices[0].index] += delta.content or ""
    full = client.chat.completions.create(**kwargs)
    assert roles == {0, 1}
    assert [c.message.content for c in full.choices] == [texts[0], texts[1]]


def test_logprobs_equal_offline(client, llm):
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3
    )
    expected = offline(llm, PROMPTS[1], max_tokens=8, temperature=0, logprobs=3).outputs[0]
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == 8 and "".join(lp.tokens) == expected.text
    for got, token_id, position in zip(
        lp.token_logprobs, expected.token_ids, expected.logprobs, strict=True
    ):
        assert math.isclose(got, position[token_id].logprob, rel_tol=1e-5, abs_tol=1e-6)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == expected.text
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_logprobs_of_filtered_tokens_are_clamped_as_vllm_does(server, client, llm):
    """top_k=2 gives the tokens it removes a logprob of -inf (the offline
    oracle), which JSON cannot carry: vLLM sends -9999.0 for them. Plain,
    streamed and chat responses alike."""
    params = dict(max_tokens=4, temperature=1.0, seed=7, top_k=2)
    expected = offline(llm, PROMPTS[0], logprobs=5, **params).outputs[0]
    assert any(lp.logprob == -math.inf for p in expected.logprobs for lp in p.values())

    def clamped(position) -> dict[str, float]:
        return {lp.decoded_token: max(lp.logprob, -9999.0) for lp in position.values()}

    extra = {"top_k": 2, "seed": 7}
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=5,
                                      max_tokens=4, temperature=1.0, extra_body=extra)
    top = plain.choices[0].logprobs.top_logprobs
    assert len(top) == 4
    for got, position in zip(top, expected.logprobs, strict=True):
        assert got.keys() == clamped(position).keys()
        for token, value in got.items():
            assert math.isclose(value, clamped(position)[token], rel_tol=1e-5, abs_tol=1e-6)
    body = {"model": MODEL, "prompt": PROMPTS[0], "logprobs": 5, "stream": True, **params}
    with httpx.stream("POST", server.url_for("v1/completions"), json=body) as response:
        assert response.status_code == 200
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    streamed = [t for c in chunks for ch in c["choices"] if ch["logprobs"]
                for t in ch["logprobs"]["top_logprobs"]]
    assert [sorted(t.values()) for t in streamed] == [sorted(t.values()) for t in top]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=4,
        temperature=1.0, logprobs=True, top_logprobs=5, extra_body=extra)
    values = [t.logprob for c in chat.choices[0].logprobs.content for t in c.top_logprobs]
    assert -9999.0 in values and all(v >= -9999.0 for v in values)


def test_logit_bias_and_allowed_token_ids_answer_as_offline(server, client, llm):
    """OpenAI's logit_bias (token ids as string keys; -1000 clamped to -100,
    as vLLM does) and vLLM's allowed_token_ids: the offline engine's text for
    the same parameters, and a plain run's first token banned is gone."""
    greedy = dict(temperature=0, max_tokens=6)
    plain = offline(llm, PROMPTS[0], **greedy).outputs[0]
    banned = plain.token_ids[0]
    expected = offline(llm, PROMPTS[0], logit_bias={banned: -100.0}, **greedy).outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0],
                                     logit_bias={str(banned): -1000}, **greedy)
    assert got.choices[0].text == expected.text != plain.text
    allowed = sorted(set(plain.token_ids) | {banned + 1, banned + 2})[:4]
    expected = offline(llm, PROMPTS[0], allowed_token_ids=allowed, **greedy).outputs[0]
    assert set(expected.token_ids) <= set(allowed)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0],
                                    extra_body={"allowed_token_ids": allowed}, **greedy)
    assert got.choices[0].text == expected.text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], logit_bias={"dog": 1},
                                  **greedy)
    assert info.value.body["param"] == "logit_bias"


def test_bad_words_answer_as_offline(server, client, llm):
    """vLLM's bad_words: on completions the offline engine's text for the
    same word, without the word the plain run said; on chat, an answer that
    no longer starts with the plain answer's first word."""
    greedy = dict(temperature=0, max_tokens=8)
    plain = offline(llm, PROMPTS[0], **greedy).outputs[0]
    word = plain.text.split()[0]
    expected = offline(llm, PROMPTS[0], bad_words=[word], **greedy).outputs[0]
    assert expected.text != plain.text
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0],
                                    extra_body={"bad_words": [word]}, **greedy)
    assert got.choices[0].text == expected.text
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat_plain = client.chat.completions.create(model=MODEL, messages=messages, **greedy)
    said = chat_plain.choices[0].message.content.split()[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages,
                                          extra_body={"bad_words": [said]}, **greedy)
    answer = chat.choices[0].message.content.split()
    assert answer and answer[0] != said


def test_echo_with_logprobs_scores_the_prompt(server, client, llm):
    """vLLM's echo: the prompt's tokens and logprobs come first (the first
    token's null: nothing predicts it), then the answer's; with max_tokens=0
    the prompt alone, as a client scoring a text asks for it. The oracle: the
    offline engine's prompt_logprobs and logprobs for the same request."""
    prompt, k = PROMPTS[2], 2
    expected = offline(llm, prompt, max_tokens=3, temperature=0, logprobs=k, prompt_logprobs=k)
    ids = expected.prompt_token_ids
    completion = expected.outputs[0]
    scores = [None] + [p[t].logprob for t, p in zip(ids[1:], expected.prompt_logprobs[1:],
                                                     strict=True)]
    answer_scores = [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs,
                                                   strict=True)]

    def check(lp, want):
        assert len(lp.tokens) == len(want) == len(lp.text_offset)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(want))]
        for got, value in zip(lp.token_logprobs[1:], want[1:], strict=True):
            assert math.isclose(got, value, rel_tol=1e-5, abs_tol=1e-6)

    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=k, temperature=0)
    assert only.choices[0].text == prompt and only.choices[0].finish_reason == "length"
    check(only.choices[0].logprobs, scores)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True,
                                     logprobs=k, temperature=0)
    assert full.choices[0].text == prompt + completion.text
    check(full.choices[0].logprobs, scores + answer_scores)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True,
                                         logprobs=k, temperature=0, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == prompt + completion.text
    merged = [t for c in chunks for t in c.logprobs.tokens]
    assert merged == full.choices[0].logprobs.tokens
    # The first chunk's offsets are the whole answer's; each later chunk's
    # first token starts at the length of the text sent before it, the echoed
    # prompt included (vLLM counts only the generated text: row 83).
    first = len(chunks[0].logprobs.tokens)
    assert chunks[0].logprobs.text_offset == full.choices[0].logprobs.text_offset[:first]
    for j, chunk in enumerate(chunks[1:], start=1):
        assert chunk.logprobs.text_offset[0] == sum(len(c.text) for c in chunks[:j])
    # A larger prompt_logprobs scores the prompt with more candidates, in the
    # response's prompt_logprobs; the echoed positions still list at most
    # logprobs + 1 tokens, as vLLM's (and OpenAI's) logprobs mean.
    wide = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=k, temperature=0,
                                     extra_body={"prompt_logprobs": 5})
    assert max(len(p) for p in wide.choices[0].model_extra["prompt_logprobs"][1:]) > k + 1
    tops = wide.choices[0].logprobs.top_logprobs[1:]
    assert max(len(top) for top in tops) == k + 1


def test_tokenize_and_detokenize(server, llm):
    tokens = httpx.post(server.url_for("tokenize"), json={"prompt": PROMPTS[2]}).json()
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    assert tokens == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    back = httpx.post(server.url_for("detokenize"), json={"model": MODEL, "tokens": ids}).json()
    assert back["prompt"].endswith(PROMPTS[2])
    chat = httpx.post(
        server.url_for("tokenize"), json={"messages": [{"role": "user", "content": PROMPTS[2]}]}
    ).json()
    assert chat["tokens"] == ids  # the template writes BOS, then the text


def test_the_answer_continues_the_last_message_without_a_generation_prompt(server, client):
    """vLLM's get_chat_request_role: without a generation prompt the model
    continues the last message, so the answer has that message's role."""
    body = dict(model=MODEL, max_tokens=3, temperature=0,
                messages=[{"role": "user", "content": PROMPTS[0]}],
                extra_body={"add_generation_prompt": False})
    assert client.chat.completions.create(**body).choices[0].message.role == "user"
    first = next(iter(client.chat.completions.create(**body, stream=True)))
    assert first.choices[0].delta.role == "user"
    with_prompt = {**body, "extra_body": {}}
    assert client.chat.completions.create(**with_prompt).choices[0].message.role == "assistant"


def test_completion_chunks_carry_a_null_usage_chat_chunks_none(server):
    """vLLM's streams: each completions chunk has "usage": null until the
    usage chunk; chat chunks leave usage out."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["total_tokens"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url_for("v1", "chat", "completions"), json=chat) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert chunks and all("usage" not in c for c in chunks)


def test_vllms_spaces_between_special_tokens_is_accepted(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    flagged = client.completions.create(
        **kwargs, extra_body={"spaces_between_special_tokens": False}).choices[0].text
    assert flagged == plain  # a fast tokenizer decodes the same either way


def test_text_parts_of_a_message_are_joined_one_per_line(server):
    """vLLM joins a message's text parts with newlines: the prompt is the
    one a single string with the newline gives."""
    def tokens(content) -> list[int]:
        body = {"messages": [{"role": "user", "content": content}]}
        return httpx.post(server.url_for("tokenize"), json=body).json()["tokens"]

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert tokens(parts) == tokens("Hello\nworld") != tokens("Helloworld")


# -- refusals -------------------------------------------------------------------------

# (field, value, where): each request is refused with a 400 naming `field`.
BAD_FIELDS = [
    ("temperature", -0.5),
    ("temperature", "hot"),
    ("temperature", [1]),
    ("temperature", 1e40),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", "x"),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", "5"),
    ("min_p", -0.1),
    ("min_p", 2),
    ("presence_penalty", 3),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", "a"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("best_of", 0),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1.5),
    ("max_tokens", "10"),
    ("max_tokens", 10**6),
    ("min_tokens", -1),
    ("seed", "abc"),
    ("seed", 1.5),
    ("seed", 2**80),
    ("stop", 5),
    ("stop", [1, 2]),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "1"),
    ("stop_token_ids", [10**7]),
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("stream", "yes"),
    ("echo", 3),
    ("prompt", 5),
    ("prompt", [1, "a"]),
    ("prompt", [-1]),
    ("prompt", [10**7]),
    ("prompt", None),
    ("model", 5),
    ("model", None),
    ("user", 7),
    ("logit_bias", {"one": 2}),
    ("logit_bias", {"1": "2"}),
    ("logit_bias", {"1000000": 2}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-3]),
    ("bad_words", "cat"),
    ("bad_words", ["cat", " "]),
    ("suffix", "x"),
    ("stream_options", {"include_usage": True}),
    ("skip_special_tokens", "no"),
    ("include_stop_str_in_output", 2),
    ("cache_salt", ""),
    ("cache_salt", 5),
    ("cache_salt", "salt"),  # the classic engine (this module's) refuses any salt
    ("unknown_field", 1),
]
BAD_CHAT_FIELDS = [
    ("messages", []),
    ("messages", "hi"),
    ("messages", [{"content": "x"}]),
    ("messages", [{"role": "user", "content": 5}]),
    ("messages", [{"role": 1, "content": "x"}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]),
    ("messages", [{"role": "user", "content": "x", "extra": 1}]),
    ("max_completion_tokens", 0),
    ("max_completion_tokens", "5"),
    ("max_tokens", -1),
    ("logprobs", 3),
    ("top_logprobs", 30),
    ("top_logprobs", -1),
    ("temperature", -1),
    ("n", 0),
    ("tools", []),
    ("response_format", {"type": "json_object"}),
    ("echo", "yes"),
]
COMPLETION_ONLY = {"prompt", "echo", "logprobs", "suffix", "max_tokens"}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _expect_400(server, route: tuple[str, ...], body: dict, field: str) -> None:
    response = httpx.post(server.url_for(*route), json=body, timeout=30)
    assert response.status_code == 400, (field, body, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field or field in error["message"], (field, error)


def test_malformed_requests_are_400_naming_the_field_and_the_server_keeps_serving(server, client):
    cases = [(("v1", "completions"), {**COMPLETION, f: v}, f) for f, v in BAD_FIELDS]
    cases += [(("v1", "chat", "completions"), {**CHAT, f: v}, f) for f, v in BAD_CHAT_FIELDS]
    # The sampling fields both endpoints share, through the chat endpoint too.
    cases += [
        (("v1", "chat", "completions"), {**CHAT, f: v}, f)
        for f, v in BAD_FIELDS
        if f not in COMPLETION_ONLY
    ]
    cases += [
        (("v1", "completions"), {**COMPLETION, "n": 2, "temperature": 0}, "n"),
        (
            ("v1", "completions"),
            {**COMPLETION, "best_of": 3, "n": 2, "temperature": 1, "stream": True},
            "best_of",
        ),
        (("v1", "completions"), {**COMPLETION, "max_tokens": 0}, "max_tokens"),  # echo's only
        (("v1", "completions"), {**COMPLETION, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        (("v1", "completions"), {**COMPLETION, "best_of": 300, "temperature": 1}, "best_of"),
        (("v1", "completions"), {k: v for k, v in COMPLETION.items() if k != "prompt"}, "prompt"),
        (("v1", "completions"), {k: v for k, v in COMPLETION.items() if k != "model"}, "model"),
        (("v1", "completions"), {**COMPLETION, "prompt": "a " * 600}, "prompt"),
        (
            ("v1", "completions"),
            {**COMPLETION, "prompt": "a " * 200, "max_tokens": 400},
            "max_tokens",
        ),
        (("tokenize",), {"prompt": 5}, "prompt"),
        (("detokenize",), {"tokens": [-3]}, "tokens"),
        (("detokenize",), {"tokens": "abc"}, "tokens"),
    ]
    assert len(cases) >= 100
    for route, body, field in cases:
        _expect_400(server, route, body, field)
    # Not JSON at all, or not an object: no field to name.
    for raw in (b"{not json", b'{"model":', b"[1, 2]", b""):
        r = httpx.post(
            server.url_for("v1", "completions"),
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
        if raw.startswith(b"{"):
            assert "the body is not JSON" in r.json()["error"]["message"]
    assert client.completions.create(**COMPLETION).choices[0].text
    assert httpx.get(server.url_for("health")).status_code == 200


def test_unknown_model_route_and_method(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(**{**COMPLETION, "model": "gpt-4"})
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    for method, path in [("GET", "v1/nothing"), ("POST", "v2/completions")]:
        r = httpx.request(method, server.url_for(path))
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url_for("v1", "completions"))
    assert r.status_code == 405 and "error" in r.json()


# -- metrics and disconnects ------------------------------------------------------


def test_metrics_move_as_requests_run(server, client):
    before = wait_until_idle(server)
    for name in (
        "vllm:num_requests_swapped",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:time_per_output_token_seconds_count",
    ):
        assert name in before
    result = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = wait_until_idle(server)

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert moved("vllm:prompt_tokens_total") == result.usage.prompt_tokens
    assert moved("vllm:generation_tokens_total") == 20
    assert moved("vllm:request_success_total{finished_reason=length}") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:time_per_output_token_seconds_count") == 19
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert after["vllm:gpu_cache_usage_perc"] == 0


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(server):
    """Not streamed: the handler notices the hang-up at the next output."""
    before = wait_until_idle(server)
    body = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=LONG_MAX_TOKENS, temperature=0,
                ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url_for("v1", "completions"), json=body, timeout=0.5)
    after = wait_until_idle(server)
    assert after["vllm:gpu_cache_usage_perc"] == 0
    assert num_successes(after) == num_successes(before)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 400


def test_a_client_that_disconnects_mid_stream_is_aborted(server, client, llm):
    """The abandoned request stops (it never finishes, so it counts in no
    request_success), its blocks are freed, and a request running beside
    it still gets exactly the offline text."""
    before = wait_until_idle(server)
    body = dict(
        model=MODEL, prompt=PROMPTS[0], max_tokens=LONG_MAX_TOKENS, temperature=0, stream=True,
        ignore_eos=True
    )
    other = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=60, temperature=0, stream=True
    )
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body) as r:
        lines = r.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert len(received) == 3  # three chunks, then hang up
        while_running = server.metrics()
    assert while_running["vllm:gpu_cache_usage_perc"] > 0
    other_text = "".join(c.choices[0].text for c in other)
    after = wait_until_idle(server)
    assert after["vllm:gpu_cache_usage_perc"] == 0
    assert num_successes(after) - num_successes(before) == 1  # the other request only
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 200
    assert other_text == offline(llm, PROMPTS[1], max_tokens=60, temperature=0).outputs[0].text


def test_serving_benchmark_client_counts_what_it_got(server):
    """tools/bench/serving.py against this server: every request completes
    with its asked output length, one ITL per token gap."""
    import asyncio

    from tools.bench.common import BenchRequest
    from tools.bench.serving import run_rate, summarize

    requests = [BenchRequest([5, 6, 7, 8], 6), BenchRequest(list(range(20, 40)), 9)]
    results, duration = asyncio.run(run_rate(server.base_url, MODEL, requests, math.inf, seed=0))
    assert [r.output_len for r in results] == [6, 9]
    assert [len(r.itl) for r in results] == [5, 8]
    assert all(0 < r.ttft <= r.e2e for r in results)
    row = summarize(math.inf, results, duration, {"ttft": 1e9})
    assert row["completed"] == 2 and row["failed"] == 0
    assert row["goodput_req_per_s"] == row["req_per_s"]
    assert row["output_tok_per_s"] == pytest.approx(15 / duration)


def _texts_as_vllm_benchmark_reads_them(body: str, chat: bool) -> str:
    """What vLLM's benchmarks/backend_request_func.py keeps from a stream:
    each non-empty line minus "data: ", [DONE] ends it, a chunk counts
    when its first choice carries text (completions) or delta content (chat)."""
    text = ""
    for line in body.splitlines():
        chunk = line.strip().removeprefix("data: ")
        if not chunk or chunk == "[DONE]":
            continue
        choice = json.loads(chunk)["choices"][0]
        text += (choice["delta"].get("content") or "") if chat else choice["text"]
    return text


def test_vllm_serving_benchmark_requests_are_served(server, llm):
    """The exact payloads vLLM's serving benchmark sends (its "vllm"/"openai"
    and "openai-chat" backends): best_of=1, logprobs=null, temperature 0, an
    `Authorization: Bearer None` header when OPENAI_API_KEY is unset, and chat
    content as a list of typed parts. Each is answered with the greedy text."""
    headers = {"Authorization": "Bearer None"}
    prompt = PROMPTS[0]
    completion = {
        "model": MODEL, "prompt": prompt, "temperature": 0.0, "best_of": 1,
        "max_tokens": 12, "logprobs": None, "stream": True,
    }
    r = httpx.post(f"{server.base_url}/v1/completions", json=completion, headers=headers)
    assert r.status_code == 200, r.text
    expected = offline(llm, prompt, max_tokens=12, temperature=0).outputs[0].text
    assert _texts_as_vllm_benchmark_reads_them(r.text, chat=False) == expected

    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "temperature": 0.0, "max_tokens": 12, "stream": True,
    }
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, headers=headers)
    assert r.status_code == 200, r.text
    plain = dict(chat, messages=[{"role": "user", "content": prompt}], stream=False)
    same = httpx.post(f"{server.base_url}/v1/chat/completions", json=plain, headers=headers)
    assert _texts_as_vllm_benchmark_reads_them(r.text, chat=True) == (
        same.json()["choices"][0]["message"]["content"]
    )
