"""Request ids in V1: the user's id (external) and the engine's (internal).

The front end gives each request an internal id (`InputProcessor.
assign_request_id`, vLLM's PR #27987), keeps the user's as
`external_req_id`, and answers with the user's. With the engine core in
its own process the core runs ahead of the front end: outputs of a request
the front end has already ended (a stop string, an abort) are still on
their way, and must not land in a new request that reuses the user's id;
nor may a user's id collide with an `n > 1` request's child, nor an abort
by the user's id reach anything but that user's requests.

The oracle is each request run alone on the in-process engine
(`LLM(use_v1=True)`): whatever ran before or beside it, a request gets
exactly those tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.sampling_params import RequestOutputKind
from minivllm.v1.engine.async_llm import AsyncLLM
from minivllm.v1.engine.llm_engine import LLMEngine

LONG = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PAIR = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=20, ignore_eos=True)


def tokens(output) -> list[list[int]]:
    return [list(c.token_ids) for c in output.outputs]


@pytest.fixture(scope="module")
def alone():
    """prompt, params -> the completions' tokens of that request run alone."""
    llm = LLM(use_v1=True)
    cache: dict = {}

    def run(prompt: str, params: SamplingParams) -> list[list[int]]:
        key = (prompt, repr(params))
        if key not in cache:
            cache[key] = tokens(llm.generate([prompt], params, use_tqdm=False)[0])
        return cache[key]

    run.llm = llm
    return run


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The engine under test, its core in this process."""
    return LLM(use_v1=True).llm_engine


async def collect(llm: AsyncLLM, prompt: str, params: SamplingParams, request_id: str) -> list:
    return [out async for out in llm.generate(prompt, params, request_id)]


def run_engine(engine: LLMEngine) -> list:
    """Step until nothing is left; the finished outputs, in order."""
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    return finished


def nothing_left_async(llm: AsyncLLM) -> bool:
    processor = llm.output_processor
    return not (processor.request_states or processor.parent_requests
                or processor.external_req_ids)


def assert_engine_empty(engine: LLMEngine) -> None:
    """Nothing of any request in the front end or the (in-process) core."""
    core = engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert not core.scheduler.requests
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


# -- the core in its own process: stale outputs never reach a reused id ---------------------


def stop_string(alone) -> str:
    """Three characters from the middle of a greedy continuation: the
    request stops there while the core would run it for 300 tokens."""
    text = alone.llm.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    return text[len(text) // 2:][:3]


def test_reusing_an_id_after_a_stop_string_gets_only_its_own_tokens(async_llm, loop, alone):
    stop = stop_string(alone)
    stopped = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, stop=[stop])

    async def run():
        results = []
        for i in range(3):
            first = await collect(async_llm, "Once upon a time", stopped, f"a{i}")
            assert first[-1].outputs[0].finish_reason == "stop"
            again = await collect(async_llm, "The cat", SHORT, f"a{i}")  # at once
            results.append((again[-1].request_id, tokens(again[-1])))
        return results

    for i, (request_id, got) in enumerate(loop.run_until_complete(run())):
        assert request_id == f"a{i}"
        assert got == alone("The cat", SHORT)
    assert nothing_left_async(async_llm)


def test_reusing_an_id_after_abort_gets_only_its_own_tokens(async_llm, loop, alone):
    async def run():
        results, aborted = [], []
        for i in range(3):
            gen = async_llm.generate("Once upon a time", LONG, f"b{i}")
            for _ in range(3):
                await gen.__anext__()
            await async_llm.abort(f"b{i}")
            results.append(tokens((await collect(async_llm, "The cat", SHORT, f"b{i}"))[-1]))
            last = await gen.__anext__()  # the aborted one's last output, its own tokens
            assert last.finished and last.outputs[0].finish_reason == "abort"
            aborted.append(tokens(last)[0])
            with pytest.raises(StopAsyncIteration):
                await gen.__anext__()
        return results, aborted

    results, aborted = loop.run_until_complete(run())
    assert results == [alone("The cat", SHORT)] * 3
    full = alone("Once upon a time", LONG)[0]
    assert all(3 <= len(got) < len(full) and got == full[: len(got)] for got in aborted)
    assert nothing_left_async(async_llm)


def test_sync_engine_with_its_core_apart_reuses_an_aborted_id_cleanly(alone):
    engine = LLMEngine.from_engine_args(EngineArgs(use_v1=True), multiprocess_mode=True)
    try:
        internal = engine.add_request("a", "Once upon a time", LONG)
        for _ in range(3):
            engine.step()
        engine.abort_request("a")  # the core has stepped "a" meanwhile
        engine.add_request("a", "The cat", SHORT)
        [out] = run_engine(engine)
        assert out.request_id == "a"
        assert tokens(out) == alone("The cat", SHORT)
        assert internal != "a" and internal.startswith("a-")  # the core apart: always a suffix
    finally:
        engine.shutdown()


# -- a user's id that looks like a child's ------------------------------------------------


def test_a_user_id_named_like_a_child_runs_beside_the_parent(engine, alone):
    """"1_y" is child 1's name of a request "y" with n=2: both run, each
    gets its own tokens, and nothing is left behind."""
    internal = engine.add_request("1_y", "The cat", SHORT)
    engine.add_request("y", "One day", PAIR)
    outputs = {o.request_id: o for o in run_engine(engine)}
    assert sorted(outputs) == ["1_y", "y"]
    assert tokens(outputs["1_y"]) == alone("The cat", SHORT)
    assert tokens(outputs["y"]) == alone("One day", PAIR)
    assert_engine_empty(engine)
    assert internal == "1_y"  # a free id: the core's is the user's (what a learner sees)


def test_async_user_id_named_like_a_child_runs_beside_the_parent(async_llm, loop, alone):
    async def run():
        return await asyncio.gather(collect(async_llm, "The cat", LONG, "1_z"),
                                    collect(async_llm, "One day", PAIR, "z"))

    single, pair = loop.run_until_complete(asyncio.wait_for(run(), 120))
    assert (single[-1].request_id, pair[-1].request_id) == ("1_z", "z")
    assert tokens(single[-1]) == alone("The cat", LONG)
    assert tokens(pair[-1]) == alone("One day", PAIR)
    assert nothing_left_async(async_llm)


def test_abort_by_a_childs_name_leaves_the_parent_alone(engine, alone):
    engine.add_request("x", "One day", PAIR)
    engine.step()
    engine.abort_request("0_x")  # no user request has that id
    [out] = run_engine(engine)
    assert out.request_id == "x" and tokens(out) == alone("One day", PAIR)
    assert_engine_empty(engine)


def test_async_abort_by_a_childs_name_leaves_the_parent_alone(async_llm, loop, alone):
    async def run():
        gen = async_llm.generate("One day", PAIR, "w")
        outputs = [await gen.__anext__()]
        await async_llm.abort("0_w")
        outputs += [o async for o in gen]
        return outputs

    outputs = loop.run_until_complete(asyncio.wait_for(run(), 30))
    assert outputs[-1].finished and tokens(outputs[-1]) == alone("One day", PAIR)
    assert nothing_left_async(async_llm)


# -- an add that fails part-way undoes itself ---------------------------------------------


class RefuseSecondChild:
    """A step observer that raises when told of the second request added."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_add_request(self, engine, request_id: str) -> None:
        self.seen.append(request_id)
        if len(self.seen) == 2:
            raise RuntimeError("refused")

    def on_step(self, engine, record) -> None:
        pass


def test_an_add_refused_after_its_first_child_leaves_nothing(engine, alone):
    observer = RefuseSecondChild()
    engine.add_step_observer(observer)
    try:
        with pytest.raises(RuntimeError, match="refused"):
            engine.add_request("v", "One day", PAIR)
    finally:
        engine.remove_step_observer(observer)
    assert observer.seen == ["0_v", "1_v"]
    assert_engine_empty(engine)
    engine.add_request("v", "One day", PAIR)  # the id is free, and runs as if new
    [out] = run_engine(engine)
    assert tokens(out) == alone("One day", PAIR)


def test_async_add_cancelled_between_children_leaves_nothing(async_llm, loop, alone):
    """The task is cancelled while the second child is being sent: the
    first child, already in the engine core, is aborted there too."""
    send = async_llm.engine_core.add_request_async
    sent = []

    async def cancelled_on_second(request) -> None:
        sent.append(request.request_id)
        if len(sent) == 2:
            raise asyncio.CancelledError
        await send(request)

    async def run():
        async_llm.engine_core.add_request_async = cancelled_on_second
        try:
            with pytest.raises(asyncio.CancelledError):
                await collect(async_llm, "One day", PAIR, "u")
        finally:
            async_llm.engine_core.add_request_async = send
        # The core handles messages in order: the reset sees the abort done.
        assert await async_llm.engine_core.reset_prefix_cache_async() is True
        return await collect(async_llm, "One day", PAIR, "u")

    out = loop.run_until_complete(asyncio.wait_for(run(), 60))
    assert len(sent) == 2
    assert tokens(out[-1]) == alone("One day", PAIR)
    assert nothing_left_async(async_llm)


# -- two live requests with one id (vLLM accepts them) -------------------------------------


def test_two_live_requests_may_share_an_id_and_abort_ends_both(engine, alone):
    first = engine.add_request("dup", "The cat", SHORT)
    second = engine.add_request("dup", "One day", SHORT)
    outputs = run_engine(engine)
    assert [o.request_id for o in outputs] == ["dup", "dup"]
    assert sorted(tokens(o) for o in outputs) == sorted(
        [alone("The cat", SHORT), alone("One day", SHORT)])
    engine.add_request("dup", "The cat", LONG)
    engine.add_request("dup", "One day", LONG)
    engine.step()
    engine.abort_request("dup")
    assert_engine_empty(engine)
    # The second's id was taken in the core: it got a suffix.
    assert first == "dup" and second != first and second.startswith("dup-")


def test_async_two_live_requests_may_share_an_id(async_llm, loop, alone):
    async def run():
        return await asyncio.gather(collect(async_llm, "The cat", SHORT, "same"),
                                    collect(async_llm, "One day", SHORT, "same"))

    cat, day = loop.run_until_complete(asyncio.wait_for(run(), 60))
    assert cat[-1].request_id == day[-1].request_id == "same"
    assert tokens(cat[-1]) == alone("The cat", SHORT)
    assert tokens(day[-1]) == alone("One day", SHORT)
    assert nothing_left_async(async_llm)


# -- shutting down between event loops ---------------------------------------------------


def test_shutdown_outside_a_stopped_loop_closes_the_sockets_now(loop):
    """A test fixture's teardown: the loop is stopped, not closed. The
    zmq.asyncio sockets must close at once: left for a loop that never runs
    again, they stayed open, and the garbage collector's Context.term()
    then hung the interpreter (pytest at exit)."""
    llm = AsyncLLM.from_engine_args(EngineArgs(use_v1=True))

    async def one() -> list:
        return await collect(llm, "The cat", SHORT, "one")

    assert loop.run_until_complete(one())[-1].finished
    llm.shutdown()
    resources = llm.engine_core.resources
    assert resources.output_socket.closed and resources.input_socket.closed
    assert resources.ctx.closed


def test_a_request_aborted_before_its_first_output_ends_with_zero_cached_tokens(alone):
    """AsyncLLM's last output for an abort comes from the front end alone; a
    request the engine core never reported on has 0 cached tokens in it (vLLM's
    RequestState starts at 0), not None."""
    from minivllm.v1.engine import EngineCoreRequest
    from minivllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    tokenizer = alone.llm.get_tokenizer()
    processor = OutputProcessor(tokenizer)
    request = EngineCoreRequest("a", tokenizer.encode("Once"), SamplingParams(), None, 0.0,
                                external_req_id="a")
    queue = RequestOutputCollector(RequestOutputKind.CUMULATIVE, "a")
    processor.add_request(request, "Once", queue=queue)
    processor.abort_requests(["a"])
    output = queue.get_nowait()
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert output.num_cached_tokens == 0 and output.outputs[0].token_ids == []
