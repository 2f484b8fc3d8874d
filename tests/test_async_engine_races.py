"""AsyncLLMEngine at its edges: a request id reused right after an abort, a
step that hangs, a duplicate id, and a second event loop.

Each test runs the real engine on the tiny checkpoint. What a hang or a
race leaves behind is counted through the engine itself: no request still
unfinished, every device block free, and no worker thread still alive.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine import async_llm_engine
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine, RequestTracker

ENGINE = dict(block_size=8, max_num_seqs=4)
OLD_PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
NEW_PROMPT = {"prompt_token_ids": [9, 10]}
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
TIMEOUT_VAR = "MINIVLLM_ENGINE_ITERATION_TIMEOUT_S"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def short_tokens(model) -> list[int]:
    """What NEW_PROMPT under SHORT gives offline: a new request's own tokens."""
    out = LLM(model, **ENGINE).generate([NEW_PROMPT], SHORT, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def make_engine(model: str) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, **ENGINE))


class FinalSpy:
    """A stat logger that keeps every final output, in order: two requests
    of one id are told apart by their finish reason."""

    def __init__(self) -> None:
        self.finals: list[tuple[str, str, int]] = []

    def log(self, stats, request_outputs) -> None:
        for o in request_outputs:
            if o.finished:
                c = o.outputs[0]
                self.finals.append((o.request_id, c.finish_reason, len(c.token_ids)))


def assert_engine_clean(engine: AsyncLLMEngine) -> None:
    """Nothing left running, and every device block back in the pool."""
    bm = engine.engine.scheduler.block_manager
    assert not engine.engine.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks


async def wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.engine.has_unfinished_requests() or len(engine._request_tracker):
        assert asyncio.get_running_loop().time() < deadline, "the engine never went idle"
        await asyncio.sleep(0.01)


async def collect(engine: AsyncLLMEngine, request_id: str) -> list:
    return [o async for o in engine.generate(NEW_PROMPT, SHORT, request_id)]


async def drain(stream) -> list:
    return [o async for o in stream.generator()]


# -- an id reused right after its abort -------------------------------------------------


def test_the_tracker_holds_a_reused_id_back_until_its_abort_has_reached_the_engine():
    """The engine keeps an aborted id until the step that returns its final
    output, so the new request of that id enters one step later."""
    tracker = RequestTracker()
    old = tracker.add_request("a", prompt="old")
    tracker.get_new_and_aborted_requests()
    tracker.abort_request("a")
    new = tracker.add_request("a", prompt="new")
    assert old.finished and not new.finished
    assert tracker.get_new_and_aborted_requests() == ([], {"a"})
    assert tracker.get_new_and_aborted_requests() == ([{"request_id": "a", "prompt": "new"}], set())
    assert not new.finished


async def run_then_abort_a(model: str):
    """An engine with a FinalSpy, where request "a" has started (its first
    output read) and has just been aborted: (engine, spy, a's generator)."""
    engine = make_engine(model)
    spy = FinalSpy()
    engine.add_logger("spy", spy)
    old = engine.generate(OLD_PROMPT, LONG, "a")
    await anext(old)
    await engine.abort("a")
    return engine, spy, old


def test_a_new_request_reusing_an_aborted_id_runs_and_the_old_one_is_aborted(model, short_tokens):
    """abort("a") then a new "a" before the next step: the old request is
    aborted (its blocks freed), the new one runs to its own end."""

    async def main():
        engine, spy, old = await run_then_abort_a(model)
        stream = engine.add_request("a", NEW_PROMPT, SHORT)  # in the same tick as the abort
        new = await asyncio.wait_for(drain(stream), 30)
        with pytest.raises(asyncio.CancelledError):
            await anext(old)
        await wait_idle(engine)
        return engine, new, spy.finals

    engine, new, finals = asyncio.run(main())
    assert new[-1].finished and new[-1].outputs[0].finish_reason == "length"
    assert list(new[-1].outputs[0].token_ids) == short_tokens
    (old_id, old_reason, old_len), new_final = finals
    assert (old_id, old_reason) == ("a", "abort") and old_len < 10
    assert new_final == ("a", "length", len(short_tokens))
    assert_engine_clean(engine)


def test_aborting_a_queued_reused_id_cancels_only_that_request(model, short_tokens):
    """abort, new "a", abort again, newer "a": the second abort cancels the
    queued new request alone, and the newest still runs."""

    async def main():
        # (old is kept: a dropped generator would abort "a" when collected)
        engine, spy, old = await run_then_abort_a(model)
        queued = engine.add_request("a", NEW_PROMPT, SHORT)
        await engine.abort("a")
        newest = await asyncio.wait_for(collect(engine, "a"), 30)
        with pytest.raises(asyncio.CancelledError):
            await anext(queued.generator())
        await wait_idle(engine)
        return engine, newest, spy.finals

    engine, newest, finals = asyncio.run(main())
    assert list(newest[-1].outputs[0].token_ids) == short_tokens
    # The queued one never reached the engine: one abort, one full run.
    assert [reason for _, reason, _ in finals] == ["abort", "length"]
    assert_engine_clean(engine)


# -- a step that hangs ---------------------------------------------------------------------


def test_the_iteration_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_VAR, raising=False)
    assert async_llm_engine.engine_iteration_timeout_s() == 60.0  # vLLM's default
    monkeypatch.setenv(TIMEOUT_VAR, "1.5")
    assert async_llm_engine.engine_iteration_timeout_s() == 1.5
    for bad in ["0", "-3", "nan", "inf", "soon", ""]:
        monkeypatch.setenv(TIMEOUT_VAR, bad)
        with pytest.raises(ValueError, match=TIMEOUT_VAR):
            async_llm_engine.engine_iteration_timeout_s()


def test_a_step_that_hangs_fails_its_requests_and_stops_the_engine(model, monkeypatch):
    """The third step blocks on an Event: after the timeout (1 s) the engine
    is errored, both requests in flight fail with a TimeoutError naming the
    variable, and health checks and new requests fail. Releasing the Event
    lets the stuck thread end: no thread is left behind."""
    monkeypatch.setenv(TIMEOUT_VAR, "1")
    threads_before = set(threading.enumerate())
    release = threading.Event()

    async def main():
        engine = make_engine(model)
        step, calls = engine.engine.step, []

        def hanging_step():
            calls.append(1)
            if len(calls) == 3:
                release.wait(60)  # bounded: a broken teardown cannot hang the run
            return step()

        engine.engine.step = hanging_step
        try:
            tasks = [asyncio.create_task(collect(engine, f"r{i}")) for i in range(2)]
            gathered = asyncio.gather(*tasks, return_exceptions=True)
            results = await asyncio.wait_for(gathered, 10)
            with pytest.raises(AsyncEngineDeadError, match="TimeoutError"):
                await engine.check_health()
            with pytest.raises(AsyncEngineDeadError, match=TIMEOUT_VAR):
                await anext(engine.generate(NEW_PROMPT, SHORT, "late"))
            return engine, results
        finally:
            release.set()

    engine, results = asyncio.run(main())
    assert all(isinstance(r, TimeoutError) for r in results), results
    assert TIMEOUT_VAR in str(results[0]) and "1 s" in str(results[0])
    assert engine.errored and engine.is_stopped and not engine.is_running
    assert isinstance(engine.dead_error, TimeoutError)
    # asyncio.run joined the step's thread once the Event let it go.
    assert [t for t in threading.enumerate() if t not in threads_before] == []


# -- a duplicate id --------------------------------------------------------------------------


def test_a_duplicate_id_raises_key_error_as_vllm():
    async def main():
        tracker = RequestTracker()
        tracker.add_request("same")
        with pytest.raises(KeyError, match="Request same already exists."):
            tracker.add_request("same")  # still queued
        tracker.get_new_and_aborted_requests()
        with pytest.raises(KeyError, match="Request same already exists."):
            tracker.add_request("same")  # in the engine

    asyncio.run(main())


# -- a second event loop ---------------------------------------------------------------------


def test_a_second_event_loop_starts_a_new_background_loop(model, short_tokens):
    """The first `asyncio.run` ends with "a" in flight: that is a graceful
    stop, not a dead engine. The next one starts a new loop, which aborts
    the left-over "a" before it runs a new request of the same id."""
    engine = make_engine(model)

    async def leave_one_running():
        await anext(engine.generate(OLD_PROMPT, LONG, "a"))

    asyncio.run(leave_one_running())
    assert not engine.is_running and not engine.is_stopped and not engine.errored

    async def again():
        outputs = await asyncio.wait_for(collect(engine, "a"), 30)
        await wait_idle(engine)
        return outputs

    outputs = asyncio.run(again())
    assert list(outputs[-1].outputs[0].token_ids) == short_tokens
    assert_engine_clean(engine)


def test_a_cancelled_loop_s_last_step_ends_before_the_next_loop_touches_the_engine(
    model, short_tokens
):
    """Cancel the loop while its step runs in its thread: its request fails
    at once, and a new request starts a new loop, which waits for that step
    to end before it adds, aborts or steps (never two at once)."""
    gate, entered = threading.Event(), threading.Event()
    overlaps: list[int] = []
    running = [0]

    async def main():
        engine = make_engine(model)
        step = engine.engine.step

        def watched_step():
            running[0] += 1
            overlaps.append(running[0])
            try:
                if not entered.is_set():
                    entered.set()
                    gate.wait(60)
                return step()
            finally:
                running[0] -= 1

        engine.engine.step = watched_step
        try:
            reader = asyncio.create_task(anext(engine.generate(OLD_PROMPT, LONG, "a")))
            await asyncio.to_thread(entered.wait, 30)
            engine.background_loop.cancel()
            with pytest.raises(AsyncEngineDeadError, match="cancelled"):
                await reader
            new = asyncio.create_task(collect(engine, "b"))
            await asyncio.sleep(0.3)
            assert not new.done()  # waiting for the old step
        finally:
            gate.set()
        outputs = await asyncio.wait_for(new, 30)
        await wait_idle(engine)
        return engine, outputs

    engine, outputs = asyncio.run(main())
    assert max(overlaps) == 1
    assert list(outputs[-1].outputs[0].token_ids) == short_tokens
    assert_engine_clean(engine)
