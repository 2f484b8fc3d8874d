"""The OpenAI server on either engine: the same requests to a server on the
classic `AsyncLLMEngine` and to one on V1's `AsyncLLM` (`--use-v1`, its
engine core in a process of its own), each checked against the offline
`LLM` of the same engine (the text, tokens and logprobs a request must
get) and OpenAI's wire format.

One server per engine for the module (tests/server_utils.py); its last test
shuts it down and checks that nothing of it is left (on V1, the engine
core's process too). The engine core's death has a V1 server of its own,
with a scheduler that fails on purpose (the classic engine's twin is in
test_openai_server_lifecycle.py)."""

from __future__ import annotations

import json
import math
import signal
import threading
import time

import httpx
import psutil
import pytest

from minivllm import LLM, SamplingParams
from minivllm.v1.core.sched.scheduler import Scheduler as V1Scheduler
from tests.failing_scheduler import FAULT_AFTER, FAULT_MAX_TOKENS, InjectedFault
from tests.paced_scheduler import LONG_MAX_TOKENS
from tests.server_utils import RemoteOpenAIServer, num_successes
from tests.test_openai_server import BAD_FIELDS, COMPLETION, sse_events, wait_until_idle

pytestmark = pytest.mark.slow

MODEL = "minivllm-stories"
PROMPTS = ["Once upon a time", "The little dog", "Long ago, there was a shy rabbit called Tom"]
ENGINES = ["classic", "v1"]


class FailingV1Scheduler(V1Scheduler):
    """V1's twin of tests/failing_scheduler.py's: `schedule()` raises once a
    request that asked for exactly FAULT_MAX_TOKENS tokens has FAULT_AFTER."""

    def schedule(self):
        for request in self.running:
            if request.max_tokens == FAULT_MAX_TOKENS and request.num_output_tokens >= FAULT_AFTER:
                raise InjectedFault("injected scheduler fault")
        return super().schedule()


def engine_flags(engine: str) -> list[str]:
    """Steps are paced while a LONG_MAX_TOKENS request runs, so a client can
    hang up on it before it finishes however fast the machine."""
    details = ["--enable-prompt-tokens-details"]
    if engine == "v1":
        return ["--use-v1", "--scheduler-cls", "tests.paced_scheduler.LongRequestPacedV1Scheduler",
                *details]
    return ["--scheduler-cls", "tests.paced_scheduler.LongRequestPacedScheduler", *details]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(engine):
    with RemoteOpenAIServer(engine_flags(engine)) as remote:
        remote.processes = [psutil.Process(remote.proc.pid), *descendants(remote)]
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.get_client()


@pytest.fixture(scope="module")
def llm(engine):
    """The offline engine of the same kind (V1's: prefix caching and chunked
    prefill on, as on the server)."""
    return LLM(use_v1=engine == "v1")


def offline(llm: LLM, prompt: str, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def descendants(server: RemoteOpenAIServer) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def has_exited(process: psutil.Process) -> bool:
    """Gone, or a zombie its parent has yet to reap."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- completions and chat ----------------------------------------------------------


def test_the_server_runs_on_the_engine_asked_for(server, engine):
    name = "AsyncLLM" if engine == "v1" else "AsyncLLMEngine"
    assert f"({name})" in server.output()
    cores = [p for p in server.processes if "spawn_main" in " ".join(p.cmdline())]
    assert len(cores) == (1 if engine == "v1" else 0)  # V1's engine core process


def test_greedy_completion_and_chat_equal_offline(client, llm):
    expected = offline(llm, PROMPTS[2], max_tokens=30, temperature=0)
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0)
    assert result.choices[0].text == expected.outputs[0].text
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == 30
    # The story model's chat template: BOS, then the user's text.
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], temperature=0,
        max_completion_tokens=30,
    )
    assert chat.choices[0].message.content == expected.outputs[0].text
    assert chat.usage.prompt_tokens == len(expected.prompt_token_ids)


def chunks_for_tokens(engine: str, num_chunks: int, num_tokens: int) -> bool:
    """The classic engine streams one chunk per token. V1's collector keeps
    only the newest output for a reader that fell behind (RequestOutputCollector,
    as vLLM's), so on a loaded machine one chunk can carry several tokens:
    fewer chunks, never lost or repeated text."""
    return num_chunks == num_tokens if engine == "classic" else 1 <= num_chunks <= num_tokens


def test_streamed_completion_follows_the_wire_format(server, llm, engine):
    body = dict(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    *token_chunks, usage_chunk = [json.loads(e) for e in events[:-1]]
    expected = offline(llm, PROMPTS[0], max_tokens=12, temperature=0).outputs[0]
    assert chunks_for_tokens(engine, len(token_chunks), 12)
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == expected.text
    finishes = [c["choices"][0]["finish_reason"] for c in token_chunks]
    assert finishes == [None] * (len(token_chunks) - 1) + ["length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12


def test_streamed_chat_sends_the_role_then_one_delta_per_token(server, llm, engine):
    body = dict(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=10,
        temperature=0, stream=True,
    )
    with httpx.stream("POST", server.url_for("v1", "chat", "completions"), json=body) as r:
        events = sse_events(r)
    role, *content = [json.loads(e) for e in events[:-1]]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    expected = offline(llm, PROMPTS[1], max_tokens=10, temperature=0).outputs[0]
    assert chunks_for_tokens(engine, len(content), 10)
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == expected.text
    assert content[-1]["choices"][0]["finish_reason"] == "length"


def test_n2_streams_two_indexed_choices(client, llm):
    """V1 runs n=2 as two child requests; they come back as choices 0 and 1,
    streamed or not, with the offline V1 engine's text."""
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=7, n=2)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        (choice,) = chunk.choices
        assert choice.index not in finishes, "a chunk after the choice's finish"
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    expected = offline(llm, PROMPTS[0], max_tokens=12, temperature=1.0, seed=7, n=2)
    assert texts == {c.index: c.text for c in expected.outputs}
    full = client.completions.create(**kwargs)
    assert {c.index: c.text for c in full.choices} == texts
    assert full.usage.completion_tokens == 24


@pytest.mark.parametrize("include", [True, False])
def test_stop_strings_end_the_request_as_offline(server, client, llm, include):
    """On V1 the front end finds the stop string and aborts the request in
    the engine core; afterwards nothing runs and no block is held."""
    params = dict(temperature=0, stop=[" prince", "Ben"], include_stop_str_in_output=include)
    expected = offline(llm, PROMPTS[0], max_tokens=40, **params).outputs[0]
    assert expected.finish_reason == "stop"
    extra = {"include_stop_str_in_output": include}
    full = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=params["stop"],
        extra_body=extra,
    )
    assert full.choices[0].text == expected.text
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].stop_reason == expected.stop_reason
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=params["stop"],
        extra_body=extra, stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert wait_until_idle(server)["vllm:gpu_cache_usage_perc"] == 0


def test_logprobs_equal_offline(client, llm):
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3
    )
    expected = offline(llm, PROMPTS[1], max_tokens=6, temperature=0, logprobs=3).outputs[0]
    lp = result.choices[0].logprobs
    assert "".join(lp.tokens) == expected.text
    for got, token_id, position in zip(
        lp.token_logprobs, expected.token_ids, expected.logprobs, strict=True
    ):
        assert math.isclose(got, position[token_id].logprob, rel_tol=1e-5, abs_tol=1e-6)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == expected.text
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_echo_with_logprobs_scores_the_prompt_on_either_engine(client, llm):
    """echo with max_tokens=0 and logprobs: the prompt's logprobs, which the
    server takes from prompt_logprobs (on V1 computed in the worker, chunk
    by chunk, without reading the prefix cache): those of the offline engine
    of the same kind."""
    prompt, k = PROMPTS[2], 2
    expected = offline(llm, prompt, max_tokens=1, temperature=0, prompt_logprobs=k)
    ids = expected.prompt_token_ids
    for _ in range(2):  # the second run's prompt is cached: V1 computes it again
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                           logprobs=k, temperature=0)
        lp = result.choices[0].logprobs
        assert result.choices[0].text == prompt
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
        for got, token_id, position in zip(lp.token_logprobs[1:], ids[1:],
                                           expected.prompt_logprobs[1:], strict=True):
            assert math.isclose(got, position[token_id].logprob, rel_tol=1e-5, abs_tol=1e-6)
        assert all(k <= len(top) <= k + 1 for top in lp.top_logprobs[1:])


def test_prompt_logprobs_come_back_in_vllms_field(server, llm):
    """vLLM's `prompt_logprobs` request field: each prompt token's logprob,
    rank and name, and the top k at each position, in the choice (chat: the
    response) as vLLM sends them (token ids as JSON keys; null for the first
    token and when not asked for); the oracle is the offline engine of the
    same kind. Not with stream, unless 0 (vLLM's rule)."""
    prompt, k = PROMPTS[1], 3
    expected = offline(llm, prompt, max_tokens=2, temperature=0, prompt_logprobs=k)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": k}
    completions, chat = server.url_for("v1", "completions"), server.url_for(
        "v1", "chat", "completions")
    got = httpx.post(completions, json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected.prompt_token_ids)
    for position, want in zip(got[1:], expected.prompt_logprobs[1:], strict=True):
        assert {int(token_id) for token_id in position} == set(want)
        for token_id, logprob in want.items():
            entry = position[str(token_id)]
            assert math.isclose(entry["logprob"], logprob.logprob, rel_tol=1e-5, abs_tol=1e-6)
            assert (entry["rank"], entry["decoded_token"]) == (logprob.rank,
                                                               logprob.decoded_token)
    plain = httpx.post(completions, json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    messages = [{"role": "user", "content": prompt}]
    answer = httpx.post(chat, json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                    "prompt_logprobs": 0}, timeout=60).json()
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert answer["prompt_logprobs"][0] is None
    assert all(len(position) == 1 for position in answer["prompt_logprobs"][1:])
    refused = httpx.post(completions, json={**body, "stream": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    with httpx.stream("POST", completions, json={**body, "stream": True, "prompt_logprobs": 0},
                      timeout=60) as streamed:
        assert streamed.status_code == 200 and sse_events(streamed)[-1] == "[DONE]"


# -- refusals ------------------------------------------------------------------------


def expect_400(server, body: dict, field: str) -> dict:
    r = httpx.post(server.url_for("v1", "completions"), json=body, timeout=30)
    assert r.status_code == 400, (field, body, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field or field in error["message"], (field, error)
    return error


# A few of test_openai_server.py's BAD_FIELDS: the server refuses them before any engine.
SERVER_REFUSALS = [("temperature", -0.5), ("top_p", 0), ("n", 0), ("max_tokens", 10**6),
                   ("stop", [""]), ("prompt", [-1]), ("logprobs", 21)]


def test_refused_requests_are_400_naming_the_field(server, client, engine):
    """The same refusals on both engines: the server's own checks, and the
    engine's (stop_token_ids outside the vocabulary: the classic engine's
    add_request, V1's InputProcessor). best_of > n is V1's alone."""
    assert all(case in BAD_FIELDS for case in SERVER_REFUSALS)
    for field, value in SERVER_REFUSALS:
        expect_400(server, {**COMPLETION, field: value}, field)
    error = expect_400(server, {**COMPLETION, "stop_token_ids": [32000]}, "stop_token_ids")
    assert error["param"] == "stop_token_ids" and "outside the vocabulary" in error["message"]
    # An n no batch holds, refused on both engines before anything is fanned
    # out (V1 took an n of 2**63 and froze the server building its children).
    error = expect_400(server, {**COMPLETION, "n": 2**63, "temperature": 1.0}, "n")
    assert error["param"] == "n" and "max_num_seqs" in error["message"]
    best_of = {**COMPLETION, "best_of": 3, "temperature": 1.0}
    if engine == "v1":
        error = expect_400(server, best_of, "best_of")
        assert error["param"] == "best_of" and "V1" in error["message"]
    else:
        assert httpx.post(server.url_for("v1", "completions"), json=best_of).status_code == 200
    assert client.completions.create(**COMPLETION).choices[0].text
    assert httpx.get(server.url_for("health")).status_code == 200


def test_cache_salt_must_be_a_non_empty_string_and_runs_on_v1_only(server, client, llm, engine):
    """vLLM's `cache_salt`: refused when empty or not a string, on both
    engines; the classic engine's add_request refuses any salt (vLLM V0 had
    none), which shows the field reaches the engine; V1 runs a salted
    request, completion and chat, with the tokens it gets without a salt."""
    expect_400(server, {**COMPLETION, "cache_salt": ""}, "cache_salt")
    expect_400(server, {**COMPLETION, "cache_salt": 5}, "cache_salt")
    salted = {"cache_salt": "tenant-a"}
    if engine == "classic":
        error = expect_400(server, {**COMPLETION, **salted}, "cache_salt")
        assert "classic engine" in error["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **salted}
        r = httpx.post(server.url_for("v1", "chat", "completions"), json=chat, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        return
    expected = offline(llm, PROMPTS[1], max_tokens=12, temperature=0).outputs[0].text
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, extra_body=salted
    )
    assert result.choices[0].text == expected
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0,
        max_completion_tokens=12, extra_body=salted,
    )
    assert chat.choices[0].message.content == expected


def cached_tokens(usage) -> int | None:
    details = usage.prompt_tokens_details
    return None if details is None else details.cached_tokens


def test_cached_prompt_tokens_are_reported_and_kept_apart_by_salt(client, engine):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    is the prefix-cache hit, V1's full blocks of 16 below the prompt's last
    token, and absent without a hit (vLLM's rule), so always on the classic
    engine, which does not report hits. A salt sees only its own blocks."""
    prompt = "A salted tale. " + " ".join(PROMPTS * 2)  # more than two blocks of 16 tokens

    def usage(salt: str | None = None, stream: bool = False):
        body = {"cache_salt": salt} if salt else {}
        if not stream:
            return client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=2, extra_body=body).usage
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body=body, stream=True,
            stream_options={"include_usage": True})
        return [c for c in chunks if c.usage is not None][-1].usage

    if engine == "classic":  # no salts there, and no hits reported
        assert usage().prompt_tokens > 32
        assert cached_tokens(usage()) is None and cached_tokens(usage(stream=True)) is None
        return
    first = usage("a")
    assert first.prompt_tokens > 32 and cached_tokens(first) is None  # the first: no hit
    hit = (first.prompt_tokens - 1) // 16 * 16
    assert cached_tokens(usage("a")) == hit
    assert cached_tokens(usage("a", stream=True)) == hit
    assert cached_tokens(usage("b")) is None  # another salt: nothing shared
    assert cached_tokens(usage()) is None  # nor without one
    assert cached_tokens(usage()) == hit


# -- metrics and disconnects --------------------------------------------------------

METRIC_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_hit_rate",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
]


def test_metrics_have_vllms_names_and_move(server, client, engine):
    before = wait_until_idle(server)
    assert all(name in before for name in METRIC_NAMES)
    prompt = " ".join(PROMPTS)  # two full blocks of 16 tokens
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    after = wait_until_idle(server)

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    # V1 counts the prompt when its first token comes, prefix-cache hits too.
    assert moved("vllm:prompt_tokens_total") == result.usage.prompt_tokens
    assert moved("vllm:generation_tokens_total") == 20
    assert moved("vllm:request_success_total{finished_reason=length}") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:time_per_output_token_seconds_count") == 19
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert after["vllm:gpu_cache_usage_perc"] == 0
    assert after["vllm:num_requests_swapped"] == 0 and after["vllm:cpu_cache_usage_perc"] == 0
    if engine == "v1":  # V1 caches prefixes by default: the same prompt again hits
        # (The rate is over every lookup so far; other tests' hits may be in it.)
        rate = "vllm:gpu_prefix_cache_hit_rate"
        assert after[rate] <= before[rate]  # a new prompt: a miss
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert wait_until_idle(server)[rate] > after[rate]  # its two full blocks hit


def test_a_client_that_disconnects_is_aborted(server, client, llm):
    """Mid-stream and while waiting for a plain answer: the abandoned
    requests stop (no request_success), their blocks are freed, and a
    request running beside them gets exactly the offline text."""
    before = wait_until_idle(server)
    body = dict(
        model=MODEL, prompt=PROMPTS[0], max_tokens=LONG_MAX_TOKENS, temperature=0, stream=True,
        ignore_eos=True,
    )
    other = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=60, temperature=0, stream=True
    )
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body) as r:
        # The iterator is kept: a discarded one would close the connection here.
        lines = r.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert len(received) == 3  # three chunks; the client hangs up when the block ends
        # Still connected and paced, the request runs on. The gauge is set from a
        # step's stats after its outputs are sent: wait for it.
        deadline = time.monotonic() + 5
        while (server.metrics()["vllm:gpu_cache_usage_perc"] == 0
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert server.metrics()["vllm:gpu_cache_usage_perc"] > 0
    other_text = "".join(c.choices[0].text for c in other)
    assert other_text == offline(llm, PROMPTS[1], max_tokens=60, temperature=0).outputs[0].text
    middle = wait_until_idle(server)
    assert middle["vllm:gpu_cache_usage_perc"] == 0
    assert num_successes(middle) - num_successes(before) == 1  # the other request only
    # A plain request alone, given up on: nothing else runs to step the engine after it.
    plain = {**body, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url_for("v1", "completions"), json=plain, timeout=0.5)
    after = wait_until_idle(server)
    assert after["vllm:gpu_cache_usage_perc"] == 0
    assert num_successes(after) == num_successes(middle)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 300


# -- the end ---------------------------------------------------------------------------


def test_sigint_shuts_down_and_leaves_no_process(server):
    """The module's last use of its server: SIGINT with a stream running. The
    stream finishes within the grace period, the server exits 0, and none of
    its processes is left (on V1: the engine core process, stopped by the
    server's shutdown, not by the signal, which it ignores)."""
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True,
                ignore_eos=True)
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.send_signal(signal.SIGINT)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert server.proc.wait(30) == 0
    assert "Application shutdown complete" in server.output()
    _, alive = psutil.wait_procs(server.processes, timeout=10)
    assert alive == []


def test_v1_engine_core_death_fails_requests_in_flight_and_health_turns_503():
    """As the classic engine's failing step (test_openai_server_lifecycle.py):
    the request in flight gets a 500 naming the fault, the stream an error
    event, /health a 503, and a new request a 503."""
    args = ["--use-v1", "--scheduler-cls", "tests.test_openai_server_v1.FailingV1Scheduler"]
    with RemoteOpenAIServer(args) as server:
        core = [p for p in descendants(server) if "spawn_main" in " ".join(p.cmdline())]
        completions = server.url_for("v1", "completions")
        long = {"model": MODEL, "prompt": [5, 6], "max_tokens": 500, "ignore_eos": True}
        outcome = {}
        thread = threading.Thread(
            target=lambda: outcome.update(r=httpx.post(completions, json=long, timeout=60))
        )
        thread.start()
        deadline = time.monotonic() + 30
        while not server.metrics()["vllm:num_requests_running"]:
            assert thread.is_alive() and time.monotonic() < deadline
        doomed = {**long, "prompt": [8, 9], "max_tokens": FAULT_MAX_TOKENS, "stream": True}
        with httpx.stream("POST", completions, json=doomed, timeout=60) as r:
            assert r.status_code == 200
            events = [line[len("data: ") :] for line in r.iter_lines() if line]
        thread.join(60)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "InjectedFault" in error["message"] and error["type"] == "server_error"
        assert all("choices" in json.loads(e) for e in events[:-2])
        assert outcome["r"].status_code == 500
        assert "InjectedFault" in outcome["r"].json()["error"]["message"]
        health = httpx.get(server.url_for("health"))
        assert health.status_code == 503 and "InjectedFault" in health.json()["error"]["message"]
        late = httpx.post(completions, json={**long, "max_tokens": 3})
        assert late.status_code == 503 and "EngineCore is dead" in late.json()["error"]["message"]
        assert len(core) == 1 and wait_until(lambda: has_exited(core[0]))  # with its failure
        assert server.stop(signal.SIGINT) == 0
        assert psutil.wait_procs(core, timeout=10)[1] == []  # reaped: gone for good
