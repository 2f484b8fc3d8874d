"""The server's life: the `minivllm serve` command with an API key, a model
without a chat template, a step that fails inside the engine, and shutting
down on SIGINT / SIGTERM with nothing left behind. Each test starts its own
server (a few seconds each), so they are marked slow."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.openai.cli_args import make_arg_parser
from tests.failing_scheduler import FAULT_MAX_TOKENS
from tests.paced_scheduler import LONG_MAX_TOKENS
from tests.server_utils import RemoteOpenAIServer

pytestmark = pytest.mark.slow

CLI = "minivllm.entrypoints.cli"  # the `minivllm` command
MODEL = "minivllm-stories"  # the shipped model's name on a server


def group_is_gone(server: RemoteOpenAIServer) -> bool:
    try:
        os.killpg(server.proc.pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_serve_command_with_an_api_key_and_no_chat_template(tiny_model_dir):
    args = [
        "serve",
        tiny_model_dir("llama"),
        "--api-key",
        "sesame",
        "--served-model-name",
        "tiny",
        "--block-size",
        "8",
        "--allowed-origins",
        '["http://page.example"]',
        "--enable-request-id-headers",
    ]
    with RemoteOpenAIServer(args, module=CLI) as server:
        # A browser's preflight needs no key; only the allowed origin is let in.
        preflight = {"Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        allowed = httpx.options(server.url_for("v1", "completions"),
                                headers={"Origin": "http://page.example", **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "http://page.example"
        other = httpx.options(server.url_for("v1", "completions"),
                              headers={"Origin": "http://other.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # /v1 needs the key; probes and scrapers do not.
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = httpx.get(server.url_for("v1", "models"), headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url_for("health")).status_code == 200
        assert httpx.get(server.url_for("metrics")).status_code == 200
        # Every answer carries X-Request-Id: the request's own, refused or
        # streamed, or a new random one.
        mine = {"X-Request-Id": "trace-42"}
        refused = httpx.get(server.url_for("v1", "models"), headers=mine)
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "trace-42"
        body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", server.url_for("v1", "completions"), json=body,
                          headers={**mine, "Authorization": "Bearer sesame"}) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
            assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
        ids = {httpx.get(server.url_for("health")).headers["x-request-id"] for _ in range(2)}
        assert len(ids) == 2 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
        with pytest.raises(openai.AuthenticationError):
            server.get_client(api_key="wrong").models.list()
        client = server.get_client(api_key="sesame")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        result = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5)
        assert result.usage.completion_tokens == 5
        # The random tiny model has no chat template: a clear 400.
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.body["param"] == "messages"
        assert "no chat template" in info.value.body["message"]
        assert server.stop(signal.SIGINT) == 0
        assert "Application shutdown complete" in server.output()
        assert group_is_gone(server)


def test_a_bad_engine_option_stops_the_server_with_its_name():
    result = subprocess.run(
        [sys.executable, "-m", CLI, "serve", "--block-size", "0", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "block_size" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_shuts_the_server_down_cleanly_mid_stream(tiny_model_dir, sig):
    """uvicorn lets the stream run on for a few seconds, then the server
    shuts down (SIGINT: exit 0; SIGTERM: re-raised after the shutdown, as
    uvicorn does), and nothing of its process group is left."""
    model = tiny_model_dir("llama")
    with RemoteOpenAIServer(["--model", model]) as server:
        body = {
            "model": model,
            "prompt": [5, 6, 7],
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", server.url_for("v1", "completions"), json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            server.send_signal(sig)
            try:  # it ends, or is cut when the grace period ends
                for _ in lines:
                    pass
            except httpx.HTTPError:
                pass
        status = server.proc.wait(30)
        assert status == (0 if sig == signal.SIGINT else -signal.SIGTERM)
        assert "Application shutdown complete" in server.output()
        assert group_is_gone(server)


def test_a_failing_step_fails_requests_in_flight_and_health_turns_503(tiny_model_dir):
    model = tiny_model_dir("llama")
    args = ["--model", model, "--scheduler-cls", "tests.failing_scheduler.FailingScheduler"]
    with RemoteOpenAIServer(args) as server:
        completions = server.url_for("v1", "completions")
        # A long request in flight when the fault comes.
        long = {"model": model, "prompt": [5, 6], "max_tokens": 500, "ignore_eos": True}
        outcome = {}
        thread = threading.Thread(
            target=lambda: outcome.update(r=httpx.post(completions, json=long, timeout=60))
        )
        thread.start()
        while not server.metrics()["vllm:num_requests_running"]:
            assert thread.is_alive()
        doomed = {
            "model": model,
            "prompt": [8, 9],
            "max_tokens": FAULT_MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
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
        assert late.status_code == 503


def test_chunked_prefill_streams_one_event_per_token():
    """Every engine option is a flag: with chunked prefill a long prompt's
    prefill takes several steps that make no token; the stream still has
    the role first, then one event per token, and the offline text."""
    flags = ["--enable-chunked-prefill", "--max-num-batched-tokens", "16", "--max-num-seqs", "8"]
    prompt = "Long ago, there was a shy rabbit called Tom. Tom had a good friend called Poppy."
    with RemoteOpenAIServer(flags) as server:
        body = {
            "model": "minivllm-stories",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 10,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", server.url_for("v1", "chat", "completions"), json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line[6:7] == "{"]
        usage = server.get_client().chat.completions.create(**{**body, "stream": False}).usage
    assert usage.prompt_tokens > 16  # so the prefill was split
    llm = LLM(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8)
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(events) == 1 + 10
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[1:]) == expected.text


@pytest.mark.parametrize("value", ['"*"', "[1]", "[*]", '{"a": "b"}'])
def test_cors_flags_take_a_json_list_of_strings(value):
    parser = make_arg_parser(argparse.ArgumentParser())
    assert parser.parse_args(["--allowed-headers", '["x-a", "x-b"]']).allowed_headers == [
        "x-a", "x-b"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--allowed-origins", value])


@pytest.mark.parametrize("engine", ["classic", "v1"])
def test_a_client_that_gives_up_while_queued_is_aborted(engine):
    """One sequence at a time (--max-num-seqs 1) and a long request running:
    a second request waits in the queue. Its client gives up after half a
    second, plain and then streamed. The server asks whether the client is
    still there while it waits for the engine (every second, as vLLM's
    iterate_with_cancellation), so the request leaves the queue within
    seconds, long before the long one ends, and none of it is computed."""
    paced = "LongRequestPacedV1Scheduler" if engine == "v1" else "LongRequestPacedScheduler"
    flags = ["--max-num-seqs", "1", "--scheduler-cls", f"tests.paced_scheduler.{paced}"]
    with RemoteOpenAIServer(flags + (["--use-v1"] if engine == "v1" else [])) as server:
        url = server.url_for("v1", "completions")
        long_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG_MAX_TOKENS,
                     "ignore_eos": True}
        blocker = threading.Thread(target=lambda: httpx.post(url, json=long_body, timeout=120))
        blocker.start()
        deadline = time.monotonic() + 30
        while server.metrics()["vllm:generation_tokens_total"] < 2:  # running, not queued
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.05)
        before = server.metrics()
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "The little dog", "max_tokens": 5, "stream": stream}
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url, json=body, timeout=0.5)
            deadline = time.monotonic() + 5
            while server.metrics()["vllm:num_requests_waiting"] > 0:
                assert time.monotonic() < deadline, f"the queued request (stream={stream}) stayed"
                time.sleep(0.1)
        after = server.metrics()
        assert after["vllm:num_requests_running"] == 1  # the long request, still running
        assert after["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"]
        blocker.join()
