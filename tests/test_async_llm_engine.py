"""AsyncLLMEngine: the background loop, its hand-off, aborts and faults.

The oracle is the offline `LLM.generate` on the same checkpoint: requests
run concurrently through the async engine must end with exactly its text
and tokens. Blocks are counted through the block manager: after an abort
or a failure every device block must be free again.
"""

from __future__ import annotations

import asyncio

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine

ENGINE = dict(block_size=8, max_num_seqs=4)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 41)), [3, 4], list(range(50, 62))]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=15, ignore_eos=True),
]


class Fault(Exception):
    """The injected failure."""


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def offline(model):
    llm = LLM(model, **ENGINE)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return llm.generate(prompts, PARAMS, use_tqdm=False)


def make_engine(model: str, **kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, **{**ENGINE, **kwargs}))


def free_blocks_back(engine: AsyncLLMEngine) -> bool:
    bm = engine.engine.scheduler.block_manager
    return bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks


async def collect(engine: AsyncLLMEngine, i: int, request_id: str) -> list:
    prompt = {"prompt_token_ids": PROMPTS[i]}
    return [out async for out in engine.generate(prompt, PARAMS[i], request_id)]


class OutputSpy:
    """A stat logger that keeps every final output the engine made."""

    def __init__(self) -> None:
        self.final: dict = {}

    def log(self, stats, request_outputs) -> None:
        self.final.update({o.request_id: o for o in request_outputs if o.finished})


async def wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    """Until the loop has nothing in flight (it then sleeps)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.engine.has_unfinished_requests() or len(engine._request_tracker):
        assert asyncio.get_running_loop().time() < deadline, "the engine never went idle"
        await asyncio.sleep(0.01)


def test_concurrent_requests_equal_offline_and_stream_cumulatively(model, offline):
    async def main():
        engine = make_engine(model)
        runs = await asyncio.gather(*(collect(engine, i, f"r{i}") for i in range(len(PROMPTS))))
        await wait_idle(engine)
        return engine, runs

    engine, runs = asyncio.run(main())
    for outputs, expected in zip(runs, offline, strict=True):
        final = outputs[-1]
        assert final.finished and not any(o.finished for o in outputs[:-1])
        assert [(c.text, c.token_ids) for c in final.outputs] == [
            (c.text, c.token_ids) for c in expected.outputs
        ]
        # Cumulative: each sequence's output (by index: with n > 1 the most
        # likely comes first, so the order can change) extends the one before.
        for before, after in zip(outputs, outputs[1:], strict=False):
            by_index = {c.index: c for c in after.outputs}
            assert by_index.keys() == {c.index for c in before.outputs}
            for b in before.outputs:
                a = by_index[b.index]
                assert a.token_ids[: len(b.token_ids)] == b.token_ids
                assert a.text.startswith(b.text)
                assert len(a.token_ids) - len(b.token_ids) <= 1
        # Nothing before the prefill: the first output already has a token.
        assert all(len(c.token_ids) == 1 for c in outputs[0].outputs)
    assert free_blocks_back(engine)


def test_loop_sleeps_when_idle_and_wakes_for_new_requests(model, offline):
    async def main():
        engine = make_engine(model)
        steps = []
        step = engine.engine.step
        engine.engine.step = lambda: steps.append(1) or step()
        first = await collect(engine, 0, "a")
        await wait_idle(engine)
        count = len(steps)
        await asyncio.sleep(0.2)
        idle_steps = len(steps) - count
        running = engine.is_running
        second = await collect(engine, 0, "b")
        return first, second, idle_steps, running

    first, second, idle_steps, running = asyncio.run(main())
    assert idle_steps == 0 and running
    assert first[-1].outputs[0].token_ids == second[-1].outputs[0].token_ids
    assert second[-1].outputs[0].token_ids == offline[0].outputs[0].token_ids


@pytest.mark.parametrize("how", ["aclose", "cancel", "abort"])
def test_a_client_that_goes_away_aborts_its_request(model, offline, how):
    """The abort reaches the engine at the next step: the blocks are freed,
    and the other request runs on to exactly the offline result."""

    async def main():
        engine = make_engine(model)
        spy = OutputSpy()
        engine.add_logger("spy", spy)
        long_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = engine.generate({"prompt_token_ids": PROMPTS[1]}, long_params, "leaver")
        other = asyncio.create_task(collect(engine, 2, "stayer"))
        seen = [await anext(gen), await anext(gen)]
        if how == "aclose":
            await gen.aclose()
        elif how == "cancel":
            reader = asyncio.create_task(anext(gen))
            await asyncio.sleep(0)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
        else:
            await engine.abort("leaver")
            with pytest.raises(asyncio.CancelledError):
                async for _ in gen:
                    pass
        stayer = await other
        await wait_idle(engine)
        return engine, seen, stayer, spy.final["leaver"]

    engine, seen, stayer, leaver = asyncio.run(main())
    assert len(seen[-1].outputs[0].token_ids) == 2
    # Aborted at the next step or so, not run to its 200 tokens.
    assert leaver.outputs[0].finish_reason == "abort"
    assert len(leaver.outputs[0].token_ids) <= 4
    assert free_blocks_back(engine)
    assert stayer[-1].outputs[0].token_ids == offline[2].outputs[0].token_ids
    assert not engine.errored


def test_a_refused_request_fails_alone(model, offline):
    async def main():
        engine = make_engine(model, max_model_len=32)
        good = asyncio.create_task(collect(engine, 0, "good"))
        too_long = engine.generate({"prompt_token_ids": list(range(40))}, PARAMS[0], "long")
        with pytest.raises(ValueError, match="max_model_len=32"):
            await anext(too_long)
        with pytest.raises(KeyError, match="Request good already exists."):
            engine.add_request("good", {"prompt_token_ids": [1]}, PARAMS[0])
        # Refused naming the field (it was a bare "unhashable type" from the tracker).
        for bad_id in (["good"], None):
            with pytest.raises(TypeError, match="request_id must be a string"):
                await anext(engine.generate({"prompt_token_ids": [1]}, PARAMS[0], bad_id))
        return engine, await good

    engine, good = asyncio.run(main())
    assert good[-1].outputs[0].token_ids == offline[0].outputs[0].token_ids
    assert free_blocks_back(engine) and not engine.errored


def test_a_request_on_another_loop_while_the_first_holds_the_engine_loop(model, offline):
    """An event loop ended by asyncio.run cancels the engine's loop, and the
    next request, on another event loop, starts a new one. An event loop
    left (or closed) without cancelling its tasks keeps it as a pending task
    that will never run again: a request on another event loop is then
    refused at once, where it waited forever."""
    engine = make_engine(model)
    for request_id in ("run-1", "run-2"):
        out = asyncio.run(collect(engine, 0, request_id))
        assert out[-1].outputs[0].token_ids == offline[0].outputs[0].token_ids
    first = asyncio.new_event_loop()
    try:
        out = first.run_until_complete(collect(engine, 0, "first"))
        assert out[-1].outputs[0].token_ids == offline[0].outputs[0].token_ids
        with pytest.raises(RuntimeError, match="still a task of another event loop"):
            asyncio.run(collect(engine, 0, "second"))
        engine.shutdown_background_loop()
        first.run_until_complete(asyncio.sleep(0))  # the cancel reaches the loop
    finally:
        first.close()


def test_a_failing_step_fails_every_request_and_kills_the_engine(model):
    """Fault injection: the model raises in the third step. Every request in
    flight, and one still queued, gets that error; none hangs; the engine
    refuses new work with AsyncEngineDeadError naming the cause."""

    async def main():
        engine = make_engine(model)
        forward = engine.engine.worker.model_runner.model.forward
        calls = []

        def faulty(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise Fault("injected in step 3")
            return forward(*args, **kwargs)

        engine.engine.worker.model_runner.model.forward = faulty
        tasks = [asyncio.create_task(collect(engine, i, f"r{i}")) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        return engine, results

    engine, results = asyncio.run(main())
    assert all(isinstance(r, Fault) for r in results), results
    assert engine.errored and engine.is_stopped and not engine.is_running
    assert isinstance(engine.dead_error, Fault)

    async def after():
        with pytest.raises(AsyncEngineDeadError, match="Fault: injected in step 3"):
            await anext(engine.generate({"prompt_token_ids": [1, 2]}, PARAMS[0], "late"))
        with pytest.raises(AsyncEngineDeadError):
            await engine.check_health()

    asyncio.run(after())


def test_shutdown_fails_requests_in_flight(model):
    async def main():
        engine = make_engine(model)
        long_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = engine.generate({"prompt_token_ids": PROMPTS[0]}, long_params, "r")
        await anext(gen)
        engine.shutdown_background_loop()
        with pytest.raises(AsyncEngineDeadError, match="shut down"):
            async for _ in gen:
                pass
        return engine

    engine = asyncio.run(main())
    assert engine.is_stopped and not engine.errored


def test_tracing_works_under_the_async_engine(model, tmp_path):
    trace = tmp_path / "serve.jsonl"

    async def main():
        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model=model, **ENGINE), trace=str(trace)
        )
        await asyncio.gather(*(collect(engine, i, f"r{i}") for i in range(2)))
        engine.engine.stop_trace()

    asyncio.run(main())
    text = trace.read_text()
    assert '"r0"' in text and '"r1"' in text
