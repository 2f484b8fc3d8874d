"""`reset_prefix_cache(reset_running_requests=...)` on the V1 engine, as vLLM's
`vllm/v1/` has it: refused while requests run, unless they are preempted
first; the hit rate it resets; and the worker, which must drop a preempted
request's stale row when it is resumed in the very next step.

The oracles: the scheduler's queues and blocks worked by hand (blocks of
BS = 4 tokens, block 0 the null block, the free queue [1, 2, ...] at start);
for whole runs, the same engine's greedy tokens without a reset.
"""

from __future__ import annotations

import asyncio

import pytest

from minivllm import LLM, SamplingParams
from minivllm.v1.core.kv_cache_manager import KVCacheManager
from minivllm.v1.metrics.loggers import StatLoggerManager
from minivllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats
from minivllm.v1.request import RequestStatus
from tests.test_v1_scheduler import (
    free_ids,
    make_request,
    make_scheduler,
    step,
    toks,
    worker_output,
)

# -- the scheduler ---------------------------------------------------------------------


def three_running():
    """A, B, C: 6-token prompts (2 blocks each: A [1, 2], B [3, 4], C [5, 6];
    each first block is full, so cached), then one decode step: 8 tokens
    each, 7 of them computed, still 2 blocks each."""
    s = make_scheduler(budget=32)
    reqs = [make_request(rid, toks(100 * (i + 1), 6)) for i, rid in enumerate("ABC")]
    for req in reqs:
        s.add_request(req)
    step(s)
    _, results = step(s)
    assert sorted(results) == ["A", "B", "C"]
    return s, reqs


def test_reset_is_refused_while_requests_run_and_changes_nothing():
    s, reqs = three_running()
    pool = s.kv_cache_manager.block_pool
    free_before = free_ids(s)
    cached_before = dict(pool.cached_block_hash_to_block)
    assert s.reset_prefix_cache() is False
    assert s.running == reqs and len(s.waiting) == 0
    blocks = [s.kv_cache_manager.get_block_ids(r.request_id) for r in reqs]
    assert blocks == [[1, 2], [3, 4], [5, 6]]
    assert free_ids(s) == free_before
    assert pool.cached_block_hash_to_block == cached_before
    assert [pool.blocks[i].block_hash is not None for i in (1, 3, 5)] == [True] * 3
    assert s.prev_step_scheduled_req_ids == {"A", "B", "C"}
    out, stats = step_with_stats(s)  # the refused reset is no reset in the stats
    assert stats.reset is False
    assert out.num_scheduled_tokens == {"A": 1, "B": 1, "C": 1}


def test_reset_running_requests_preempts_them_in_fifo_order_and_empties_the_cache():
    s, reqs = three_running()
    pool = s.kv_cache_manager.block_pool
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert s.running == []
    assert list(s.waiting) == reqs  # popped from the end, prepended: A, B, C again
    for req in reqs:
        assert req.status == RequestStatus.PREEMPTED
        assert req.num_preemptions == 1
        assert req.num_computed_tokens == 0
        assert req.num_tokens == 8  # their tokens are kept
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.cached_block_hash_to_block == {}
    assert s.prev_step_scheduled_req_ids == set()
    assert not s.kv_cache_manager.req_to_blocks


def test_the_next_step_resumes_them_in_order_with_their_whole_token_lists():
    """Freed last request first, each tail first: the uncached last blocks
    6, 4, 2 went to the head of the free queue (2 ends first), the cached
    5, 3, 1 to its tail. So the free queue is [2, 4, 6, 7, 8, ..., 5, 3, 1]:
    A (8 tokens, 2 blocks) gets [2, 4], B [6, 7], C [8, 9]. The cache is
    empty, so each recomputes all 8 of its tokens."""
    s, reqs = three_running()
    s.reset_prefix_cache(reset_running_requests=True)
    out, results = step(s)
    cached = out.scheduled_cached_reqs
    assert out.scheduled_new_reqs == []
    assert cached.req_ids == ["A", "B", "C"]
    assert cached.resumed_req_ids == {"A", "B", "C"}
    assert cached.all_token_ids == {r.request_id: r.all_token_ids[:8] for r in reqs}
    assert all(len(tokens) == 8 for tokens in cached.all_token_ids.values())
    assert cached.new_block_ids == [[2, 4], [6, 7], [8, 9]]
    assert cached.num_computed_tokens == [0, 0, 0]
    assert out.num_scheduled_tokens == {"A": 8, "B": 8, "C": 8}
    assert sorted(results) == ["A", "B", "C"]  # each samples its 9th token
    assert s.running == reqs and all(r.status == RequestStatus.RUNNING for r in reqs)


def step_with_stats(s) -> tuple:
    """One step: (its SchedulerOutput, the PrefixCacheStats it sent)."""
    out = s.schedule()
    return out, s.update_from_output(out, worker_output(s, out)).scheduler_stats.prefix_cache_stats


def test_the_reset_flag_travels_with_the_next_steps_stats():
    """The resumed requests' lookups (8 tokens each, nothing found) are
    counted apart from new requests'."""
    s, _ = three_running()
    s.reset_prefix_cache(reset_running_requests=True)
    _, stats = step_with_stats(s)
    assert stats.reset is True
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (3, 24, 0)
    _, stats = step_with_stats(s)
    assert stats.reset is False  # once only


def test_reset_with_nothing_running_leaves_the_waiting_queue_alone():
    s = make_scheduler()
    req = make_request("W", toks(10, 5))
    s.add_request(req)
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert list(s.waiting) == [req] and req.status == RequestStatus.WAITING
    assert req.num_preemptions == 0


def test_a_block_still_held_makes_a_forced_reset_raise():
    """Nothing in minivllm holds a block outside a running request (vLLM's
    case is a request waiting for remote K/V); one taken from the pool by
    hand stands for it."""
    s, _ = three_running()
    s.kv_cache_manager.block_pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="could not be reset"):
        s.reset_prefix_cache(reset_running_requests=True)


def test_the_kv_cache_manager_flags_its_stats_only_when_the_reset_succeeds():
    manager = KVCacheManager(num_gpu_blocks=8, block_size=4, max_model_len=16, log_stats=True)
    held = manager.block_pool.get_new_blocks(1)
    assert manager.reset_prefix_cache() is False
    assert manager.prefix_cache_stats.reset is False
    manager.block_pool.free_blocks(held)
    assert manager.reset_prefix_cache() is True
    assert manager.make_prefix_cache_stats().reset is True
    assert manager.make_prefix_cache_stats().reset is False
    quiet = KVCacheManager(num_gpu_blocks=8, block_size=4, max_model_len=16, log_stats=False)
    assert quiet.reset_prefix_cache() is True
    assert quiet.make_prefix_cache_stats() is None


# -- the hit rate ----------------------------------------------------------------------


def scheduler_stats(**prefix) -> SchedulerStats:
    return SchedulerStats(prefix_cache_stats=PrefixCacheStats(**prefix))


def test_a_reset_restarts_the_hit_rate_totals_from_its_steps_lookups():
    manager = StatLoggerManager(enable_prefix_caching=True)
    manager.make_stats(scheduler_stats(requests=2, queries=100, hits=60), IterationStats())
    stats = manager.make_stats(scheduler_stats(requests=1, queries=20, hits=16), IterationStats())
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (120, 76)
    stats = manager.make_stats(
        scheduler_stats(reset=True, requests=1, queries=10, hits=3), IterationStats()
    )
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10, 3)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.3)
    stats = manager.make_stats(scheduler_stats(requests=1, queries=10, hits=7), IterationStats())
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 10)
    # A step without SchedulerStats keeps the totals.
    stats = manager.make_stats(None, IterationStats())
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 10)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def test_the_engines_hit_rate_counts_only_lookups_after_a_reset(tiny_llama):
    """A 13-token prompt looks up 13 tokens; a second run of it hits its 3
    full blocks (12 tokens), capped below its last token anyway."""
    llm = LLM(tiny_llama, use_v1=True, block_size=4, max_model_len=64, disable_log_stats=False)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(10, 23))}
    params = SamplingParams(temperature=0, max_tokens=3)
    llm.generate([prompt, prompt], params, use_tqdm=False)  # B hits A's blocks in one step
    llm.generate([prompt], params, use_tqdm=False)
    before = engine.stat_loggers.last_stats
    assert (before.prefix_cache_queries, before.prefix_cache_hits) == (39, 24)
    assert llm.reset_prefix_cache() is True
    llm.generate([prompt], params, use_tqdm=False)
    after = engine.stat_loggers.last_stats
    assert (after.prefix_cache_queries, after.prefix_cache_hits) == (13, 0)
    llm.generate([prompt], params, use_tqdm=False)
    again = engine.stat_loggers.last_stats
    assert (again.prefix_cache_queries, again.prefix_cache_hits) == (26, 12)
    assert again.prefix_cache_hit_rate == pytest.approx(12 / 26)


# -- whole runs ------------------------------------------------------------------------

SHARED = list(range(30, 42))  # 3 blocks of 4
PROMPTS = [SHARED + list(range(50, 50 + n)) for n in (1, 4, 7)]
# Long enough that the engine core in its own process, which steps ahead of
# the front end, is still running them when the reset reaches it.
LONG_GREEDY = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_with_reset(llm: LLM, steps_before: int) -> list[list[int]]:
    """Run PROMPTS step by step; after `steps_before` steps with outputs,
    reset with the running requests preempted; run to the end."""
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, LONG_GREEDY)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        finished.update({o.request_id: o for o in outputs if o.finished})
        steps += bool(outputs)
        if steps == steps_before:
            assert not finished
            assert engine.reset_prefix_cache(reset_running_requests=True) is True
    return token_ids([finished[str(i)] for i in range(len(PROMPTS))])


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "multiprocess"])
def test_a_reset_mid_run_gives_the_tokens_of_a_run_without_it(tiny_llama, monkeypatch,
                                                               multiprocess):
    """Three requests sharing a 3-block prefix (the 2nd hits the 1st's
    blocks, the 3rd the 2nd's too), reset after 3 steps: each is recomputed
    in new blocks and ends with the tokens it had without the reset. (A
    worker that kept a resumed request's old row would put its new blocks
    after the old ones, and read and write slots that are no longer its.)

    The stat totals then hold only the lookups after the reset: the resumed
    requests' are counted apart, so none; the run without the reset counted
    its 3 new requests'."""
    monkeypatch.setenv("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")
    llm = LLM(tiny_llama, use_v1=True, block_size=4, max_model_len=512, max_num_seqs=4,
              disable_log_stats=False)
    engine = llm.llm_engine
    try:
        expected = token_ids(
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], LONG_GREEDY, use_tqdm=False)
        )
        totals = engine.stat_loggers.last_stats
        assert (totals.prefix_cache_queries, totals.prefix_cache_hits) == (13 + 16 + 19, 12 + 16)
        assert llm.reset_prefix_cache() is True  # start as cold as the run above
        preempted = []
        if not multiprocess:
            spy_on_preemptions(engine, monkeypatch, preempted)
        assert run_with_reset(llm, steps_before=3) == expected
        totals = engine.stat_loggers.last_stats
        assert (totals.prefix_cache_queries, totals.prefix_cache_hits) == (0, 0)
        if not multiprocess:
            assert preempted == ["2", "1", "0"]  # from the tail of RUNNING
            scheduler = engine.engine_core.engine_core.scheduler
            pool = scheduler.kv_cache_manager.block_pool
            assert not scheduler.requests
            assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    finally:
        engine.shutdown()


def spy_on_preemptions(engine, monkeypatch, preempted: list[str]) -> None:
    scheduler = engine.engine_core.engine_core.scheduler
    original = scheduler._preempt_request

    def spy(request, *timestamp):
        preempted.append(request.request_id)
        original(request, *timestamp)

    monkeypatch.setattr(scheduler, "_preempt_request", spy)


# -- the front ends ----------------------------------------------------------------------


def test_llm_reset_prefix_cache_needs_the_v1_engine(tiny_llama):
    classic = LLM(tiny_llama, max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(NotImplementedError, match=r"reset_prefix_cache.*use_v1=True"):
        classic.reset_prefix_cache()
    # tools/bench/throughput.py skips the reset on an engine without one.
    assert getattr(classic.llm_engine, "reset_prefix_cache", None) is None


def test_llm_reset_prefix_cache_empties_the_v1_cache(tiny_llama):
    """Nothing running: True, and the same prompt then finds nothing cached
    (it found its 3 full blocks before)."""
    llm = LLM(tiny_llama, use_v1=True, block_size=4, max_model_len=64)
    prompt = [{"prompt_token_ids": list(range(10, 23))}]
    params = SamplingParams(temperature=0, max_tokens=3)
    first = llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 12
    assert llm.reset_prefix_cache() is True
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    again = llm.generate(prompt, params, use_tqdm=False)
    assert again[0].num_cached_tokens == 0
    assert token_ids(again) == token_ids(first)


async def collect(async_llm, prompt: str, params: SamplingParams, request_id: str,
                  started: asyncio.Event | None = None) -> list:
    outputs = []
    async for out in async_llm.generate(prompt, params, request_id):
        outputs.append(out)
        if started is not None:
            started.set()
    return outputs


def test_async_llm_reset_while_a_stream_runs_gives_the_same_tokens(async_llm, loop):
    """While the stream runs, a plain reset is refused; a forced one
    preempts it, and the stream ends with the tokens it has alone. The hit
    rate then counts no lookup: the only one since the reset was its
    resumption."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompt = "Once upon a time, there was a little"

    async def run():
        expected = await collect(async_llm, prompt, params, "alone")
        started = asyncio.Event()
        task = asyncio.create_task(collect(async_llm, prompt, params, "reset", started))
        await started.wait()
        refused = await async_llm.reset_prefix_cache()
        reset = await async_llm.reset_prefix_cache(reset_running_requests=True)
        return expected, refused, reset, await task

    expected, refused, reset, outputs = loop.run_until_complete(asyncio.wait_for(run(), 120))
    assert (refused, reset) == (False, True)
    assert len(outputs[-1].outputs[0].token_ids) == 200
    assert outputs[-1].outputs[0].token_ids == expected[-1].outputs[0].token_ids
    totals = async_llm.stat_loggers.last_stats
    assert (totals.prefix_cache_queries, totals.prefix_cache_hits) == (0, 0)
