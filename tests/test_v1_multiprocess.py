"""V1's engine core in a process of its own: SyncMPClient (LLMEngine),
AsyncMPClient (AsyncLLM), and what happens when that process dies.

The oracle is `LLM(use_v1=True)` with the engine core in this process: the
same prompts must give the same tokens and text through the sockets. Each
engine process costs a few seconds to spawn, so engines are shared by
module-scoped fixtures; the async ones run on one event loop for the module,
as an AsyncLLM belongs to the loop that first uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import psutil
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import EngineDeadError
from minivllm.v1.engine.async_llm import AsyncLLM
from minivllm.v1.engine.core_client import InprocClient, SyncMPClient
from minivllm.v1.engine.llm_engine import LLMEngine, resolve_multiprocess_mode

PROMPTS = ["Once upon a time", "The cat", "One day, Tom"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10),
    SamplingParams(temperature=0, max_tokens=40, stop=["friend"]),  # stops after ~10 tokens
]
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def summary(output) -> list[tuple]:
    return [(c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in output.outputs]


def children() -> set[int]:
    """This process's live children, but multiprocessing's resource tracker
    (one per interpreter, started by the first pool or queue)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                child.cmdline()
            ):
                pids.add(child.pid)
    return pids


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def expected():
    """The in-process engine's outputs (no process is started for it)."""
    llm = LLM(use_v1=True)
    assert isinstance(llm.llm_engine.engine_core, InprocClient)
    return [summary(o) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def mp_llm():
    """LLM(use_v1=True) with the engine core in a process, by the env var."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
        llm = LLM(use_v1=True)
    yield llm
    llm.llm_engine.shutdown()


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [out async for out in llm.generate(prompt, params, request_id)]


async def consume(llm: AsyncLLM, prompt, params, request_id, started: asyncio.Event) -> list:
    """Like `collect`, setting `started` at the first output."""
    outputs = []
    async for out in llm.generate(prompt, params, request_id):
        outputs.append(out)
        started.set()
    return outputs


# -- choosing the client ---------------------------------------------------------


def test_multiprocess_mode_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.delenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert resolve_multiprocess_mode(None) is False  # minivllm's default (vLLM's is 1)
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert resolve_multiprocess_mode(None) is True
    assert resolve_multiprocess_mode(False) is False
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "yes")
    with pytest.raises(ValueError, match="MINIVLLM_ENABLE_V1_MULTIPROCESSING"):
        resolve_multiprocess_mode(None)
    with pytest.raises(TypeError, match="multiprocess_mode"):
        resolve_multiprocess_mode("1")


def test_a_startup_failure_is_raised_here_with_its_message():
    """The engine core's exception (a KV cache too small, found only once
    the model is loaded there) comes back through the handshake."""
    before = children()
    with pytest.raises(ValueError, match="too few for one request") as excinfo:
        LLMEngine.from_engine_args(
            EngineArgs(use_v1=True, num_gpu_blocks_override=2), multiprocess_mode=True
        )
    assert "_initialize_kv_caches" in str(excinfo.value.__cause__)  # the remote traceback
    assert wait_until(lambda: children() <= before)


# -- SyncMPClient (LLMEngine) -------------------------------------------------------


def test_sync_mp_client_gives_the_in_process_outputs(mp_llm, expected):
    """Greedy, seeded with n=2, and a stop string (found in the front end,
    then aborted in the engine core) are as with the engine core here."""
    assert isinstance(mp_llm.llm_engine.engine_core, SyncMPClient)
    outputs = mp_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [summary(o) for o in outputs] == expected
    assert outputs[2].outputs[0].stop_reason == "friend"


def test_utility_calls_and_the_handshake_reach_the_front_end(mp_llm):
    engine = mp_llm.llm_engine
    assert engine.engine_config.cache_config.num_gpu_blocks > 0  # from the READY message
    # True only if no request holds a block: the stop-string request was
    # aborted in the engine core, not left running there.
    assert engine.reset_prefix_cache() is True


def test_a_killed_engine_core_fails_the_step_and_later_calls(mp_llm):
    """Last user of the module's SyncMPClient engine: SIGKILL mid-run."""
    engine = mp_llm.llm_engine
    client = engine.engine_core
    proc, socket_dir = client.resources.proc, client.resources.socket_dir
    engine.add_request("long", PROMPTS[0], LONG)
    assert engine.step() is not None and proc.pid in children()
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=r"exit code -9 \(SIGKILL\)"):
        for _ in range(LONG.max_tokens):  # outputs made before the kill may come first
            engine.step()
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        mp_llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)
    assert wait_until(lambda: proc.pid not in children())
    engine.shutdown()
    assert not os.path.exists(socket_dir)


# -- AsyncLLM (AsyncMPClient) -------------------------------------------------------


def test_concurrent_generate_gives_the_llm_outputs(async_llm, loop, expected):
    async def run():
        return await asyncio.gather(
            *(
                collect(async_llm, prompt, params, f"c{i}")
                for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True))
            )
        )

    results = loop.run_until_complete(run())
    assert [summary(outputs[-1]) for outputs in results] == expected
    assert [outputs[-1].request_id for outputs in results] == ["c0", "c1", "c2"]
    assert not async_llm.output_processor.request_states
    assert not async_llm.output_processor.external_req_ids


def test_streaming_yields_growing_outputs_then_a_finished_one(async_llm, loop):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = loop.run_until_complete(collect(async_llm, PROMPTS[0], params, "stream"))
    assert len(outputs) > 1
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    token_ids = [o.outputs[0].token_ids for o in outputs]
    final = outputs[-1].outputs[0]
    assert len(final.token_ids) == 16
    assert all(len(a) < len(b) for a, b in zip(token_ids, token_ids[1:], strict=False))
    assert all(final.token_ids[: len(t)] == t for t in token_ids)
    assert all(final.text.startswith(o.outputs[0].text) for o in outputs)


def test_cancelling_a_generator_aborts_its_request(async_llm, loop, expected):
    async def run():
        started = asyncio.Event()
        victim = asyncio.create_task(consume(async_llm, PROMPTS[1], LONG, "victim", started))
        await started.wait()
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        # The engine keeps serving others...
        other = await collect(async_llm, PROMPTS[0], PARAMS[0], "other")
        assert summary(other[-1]) == expected[0]
        # ...and the victim is gone from both ends: the prefix cache can only
        # be reset when no request holds a block in the engine core.
        assert "victim" not in async_llm.output_processor.external_req_ids
        assert not async_llm.output_processor.request_states
        assert await async_llm.engine_core.reset_prefix_cache_async() is True

    loop.run_until_complete(run())


def test_abort_ends_a_request_and_closing_early_aborts_too(async_llm, loop):
    async def run():
        started = asyncio.Event()
        task = asyncio.create_task(consume(async_llm, PROMPTS[2], LONG, "aborted", started))
        await started.wait()
        await async_llm.abort("aborted")
        outputs = await task  # ends: a last output, finished as aborted (current vLLM)
        *before, last = outputs
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert not any(o.finished for o in before)
        got = list(last.outputs[0].token_ids)
        assert 1 <= len(got) < LONG.max_tokens
        assert list(before[-1].outputs[0].token_ids) == got[: len(before[-1].outputs[0].token_ids)]
        gen = async_llm.generate(PROMPTS[0], LONG, "closed")
        await gen.__anext__()
        await gen.aclose()  # GeneratorExit: aborted as well
        assert not async_llm.output_processor.request_states
        assert await async_llm.engine_core.reset_prefix_cache_async() is True

    loop.run_until_complete(run())


@pytest.mark.slow  # its own engine process: 7-10 s
def test_a_killed_engine_core_fails_pending_and_later_requests():
    """SIGKILL mid-run: both generators waiting, and any later call, raise
    EngineDeadError naming the death; no process is left behind."""
    before = children()
    loop = asyncio.new_event_loop()
    llm = AsyncLLM.from_engine_args(EngineArgs(use_v1=True))
    proc = llm.engine_core.resources.proc

    async def run():
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [
            asyncio.create_task(consume(llm, PROMPTS[i], LONG, f"k{i}", started[i]))
            for i in range(2)
        ]
        await asyncio.gather(*(s.wait() for s in started))
        os.kill(proc.pid, signal.SIGKILL)
        for task in tasks:
            with pytest.raises(EngineDeadError, match=r"exit code -9 \(SIGKILL\)"):
                await task
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await collect(llm, PROMPTS[0], PARAMS[0], "later")
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await llm.check_health()

    try:
        loop.run_until_complete(run())
        assert llm.errored
        assert wait_until(lambda: children() <= before)
        llm.shutdown()
        assert not os.path.exists(llm.engine_core.resources.socket_dir)
    finally:
        llm.shutdown()
        loop.close()


def test_a_request_on_another_event_loop_is_refused_not_left_waiting(async_llm, loop, expected):
    """The AsyncLLM serves the event loop it was first used on: its output
    handler is a task there. A request from another event loop is refused
    at once (it waited forever before), and the first loop still serves."""
    loop.run_until_complete(collect(async_llm, PROMPTS[0], PARAMS[0], "home"))
    with pytest.raises(RuntimeError, match="serves the event loop it was first used on"):
        asyncio.run(collect(async_llm, PROMPTS[0], PARAMS[0], "away"))
    again = loop.run_until_complete(collect(async_llm, PROMPTS[0], PARAMS[0], "home-again"))
    assert summary(again[-1]) == expected[0]


def test_shutdown_ends_waiting_requests_and_leaves_no_process_or_socket_file(async_llm, loop):
    """Last user of the module's AsyncLLM: shut it down with a request in flight."""
    resources = async_llm.engine_core.resources
    proc, socket_dir = resources.proc, resources.socket_dir
    assert proc.pid in children() and os.listdir(socket_dir)

    async def run():
        started = asyncio.Event()
        task = asyncio.create_task(consume(async_llm, PROMPTS[0], LONG, "in-flight", started))
        await started.wait()
        async_llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await task
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(async_llm, PROMPTS[0], PARAMS[0], "later")

    loop.run_until_complete(run())
    assert proc.exitcode == 0  # it left its loop when asked (SHUTDOWN), not killed
    assert proc.pid not in children()
    assert not os.path.exists(socket_dir)
    async_llm.shutdown()  # twice is harmless
