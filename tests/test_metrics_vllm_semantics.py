"""The server's metrics and the log line count what vLLM v0.6 counts.

Every scenario is small enough to count by hand: which steps run, which
tokens they compute and sample, which requests finish and how. The
classic engine is stepped by hand and its `PrometheusStatLogger` fed as
`AsyncLLMEngine` feeds it (`feed`); the async engines and the server's
lifespan run on `asyncio.run`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import pytest
from prometheus_client import generate_latest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.async_llm_engine import AsyncLLMEngine
from minivllm.engine.metrics import PrometheusStatLogger, Stats
from minivllm.entrypoints.openai import api_server
from minivllm.entrypoints.openai.cli_args import make_arg_parser
from minivllm.sequence import RequestMetrics

GREEDY = dict(temperature=0, ignore_eos=True)


def prompt(n: int, start: int = 2) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


def value(logger: PrometheusStatLogger, name: str, **labels) -> float | None:
    return logger.registry.get_sample_value(name, {"model_name": "m", **labels})


def run(llm: LLM, requests: list[tuple[str, dict, SamplingParams]]) -> PrometheusStatLogger:
    """Each request alone, to the end, with a Prometheus logger fed every
    step's `Stats` and outputs."""
    engine = llm.llm_engine
    prometheus = PrometheusStatLogger(labels={"model_name": "m"})
    for request_id, request_prompt, params in requests:
        engine.add_request(request_id, request_prompt, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            prometheus.log(engine.get_stats(), outputs)
    return prometheus


def log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "minivllm.engine.metrics"]


# -- (classic) what a step counts ---------------------------------------------------


def test_generation_tokens_count_each_finished_prefills_token(tiny_model_dir):
    """The same 40-token prompt twice, one after the other, 4 tokens each,
    blocks of 8 with prefix caching. Each request: a prefill step that
    samples token 1, then 3 decode steps. v0.6 counts the prefill's token
    as generated; the log line's generation throughput too."""
    llm = LLM(
        tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=64,
        enable_prefix_caching=True,
    )
    params = SamplingParams(max_tokens=4, **GREEDY)
    prometheus = run(llm, [("a", prompt(40), params), ("b", prompt(40), params)])
    totals = llm.llm_engine.stat_logger

    assert value(prometheus, "vllm:generation_tokens_total") == 2 * 4
    assert totals.total_generation_tokens == 2 * 4
    assert totals.total_decode_tokens == 2 * 3  # the model's decode rows
    # Computed prompt tokens (vllm_differences row 69): a computes 40; b finds
    # (40 - 1) // 8 = 4 full blocks cached and computes the last 8.
    assert value(prometheus, "vllm:prompt_tokens_total") == 40 + 8
    # Blocks looked up / found: a 4 / 0, b 4 / 4.
    assert value(prometheus, "vllm:gpu_prefix_cache_hit_rate") == 4 / 8
    assert value(prometheus, "vllm:request_success_total", finished_reason="length") == 2


def test_tokens_after_a_recompute_preemption(tiny_model_dir):
    """Two 16-token prompts fill 4 blocks of 8; a's 17th token preempts b
    (recompute). Steps: 1 both prefill (a1, b1); 2-4 a decodes a2..a4 and
    finishes; 5 b's 17 tokens prefill again and sample b2; 6-7 b3, b4."""
    llm = LLM(
        tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=4,
        swap_space=0.01, preemption_mode="recompute",
    )
    engine = llm.llm_engine
    prometheus = PrometheusStatLogger(labels={"model_name": "m"})
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request("a", prompt(16), params)
    engine.add_request("b", prompt(16, start=40), params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        prometheus.log(engine.get_stats(), outputs)

    # Sampled: 2 in step 1, 1 in each of steps 2-7.
    assert value(prometheus, "vllm:generation_tokens_total") == 2 + 6
    assert engine.stat_logger.total_generation_tokens == 2 + 6
    assert engine.stat_logger.total_decode_tokens == 5  # steps 2, 3, 4, 6, 7
    assert value(prometheus, "vllm:prompt_tokens_total") == 16 + 16 + 17
    assert value(prometheus, "vllm:num_preemptions_total") == 1
    # One TTFT each; b's step 5 is a TPOT here (v0.6: a second TTFT; row 70).
    assert value(prometheus, "vllm:time_to_first_token_seconds_count") == 2
    assert value(prometheus, "vllm:time_per_output_token_seconds_count") == 3 + 3


def test_best_of_counts_every_sequence(tiny_model_dir):
    """n=1, best_of=3, 4 tokens each: the prefill forks 3 sequences and
    samples 3 tokens, then 3 decode steps sample 3 each; all 3 sequences
    finish by length, though one is returned."""
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=64)
    params = SamplingParams(
        n=1, best_of=3, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True
    )
    prometheus = run(llm, [("r", prompt(10), params)])

    assert value(prometheus, "vllm:generation_tokens_total") == 3 + 3 * 3
    assert llm.llm_engine.stat_logger.total_generation_tokens == 3 + 3 * 3
    assert value(prometheus, "vllm:request_success_total", finished_reason="length") == 3
    assert value(prometheus, "vllm:e2e_request_latency_seconds_count") == 1


def test_a_prompt_the_scheduler_ignores_counts_nowhere(tiny_model_dir):
    """60 tokens need 8 blocks of 8; the cache has 4: the scheduler finishes
    it as ignored, with no token. v0.6 counts only scheduled groups."""
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=4, max_model_len=128)
    prometheus = run(llm, [("big", prompt(60), SamplingParams(max_tokens=4))])

    assert value(prometheus, "vllm:request_success_total", finished_reason="length") is None
    assert value(prometheus, "vllm:e2e_request_latency_seconds_count") == 0
    assert value(prometheus, "vllm:time_to_first_token_seconds_count") == 0
    assert value(prometheus, "vllm:prompt_tokens_total") == 0


def test_prefix_cache_hit_rate_is_minus_one_without_a_cache(tiny_model_dir, caplog):
    """v0.6: -1 means no prefix cache; its own log line only with one."""
    caplog.set_level(logging.INFO, logger="minivllm.engine.metrics")
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=16,
              disable_log_stats=False)
    llm.llm_engine.stat_logger.last_log_time = 0.0  # the first step logs
    prometheus = run(llm, [("a", prompt(16), SamplingParams(max_tokens=1, **GREEDY))])

    assert value(prometheus, "vllm:gpu_prefix_cache_hit_rate") == -1
    lines = log_lines(caplog)
    assert len(lines) == 1 and lines[0].endswith("CPU KV cache usage: 0.0%.")


def test_metrics_have_no_created_samples():
    """v0.6 turns prometheus_client's `*_created` samples off."""
    prometheus = PrometheusStatLogger(labels={"model_name": "m"})
    text = generate_latest(prometheus.registry).decode()
    assert "vllm:prompt_tokens_total" in text
    assert "_created" not in text


# -- (classic) the forced log --------------------------------------------------------


def test_do_log_stats_counts_nothing_twice_and_shows_the_state_now(tiny_model_dir, caplog):
    """One request of 20 prompt tokens and 1 output token runs to the end;
    then a second is queued with no step run: three forced logs count
    nothing again, and show the queue as it is now, log line included."""
    caplog.set_level(logging.INFO, logger="minivllm.engine.metrics")

    async def main() -> PrometheusStatLogger:
        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model=tiny_model_dir("llama"), block_size=8,
                            num_gpu_blocks_override=32, disable_log_stats=False)
        )
        prometheus = PrometheusStatLogger(labels={"model_name": "m"})
        engine.add_logger("prometheus", prometheus)
        params = SamplingParams(max_tokens=1, **GREEDY)
        async for _ in engine.generate(prompt(20), params, "r1"):
            pass
        engine.engine.add_request("r2", prompt(20, start=40), params)  # the loop sleeps
        engine.engine.stat_logger.last_log_time = 0.0  # the next log prints its line
        for _ in range(3):
            await engine.do_log_stats()
        engine.shutdown()
        return prometheus

    prometheus = asyncio.run(main())
    assert value(prometheus, "vllm:prompt_tokens_total") == 20
    assert value(prometheus, "vllm:generation_tokens_total") == 1
    assert value(prometheus, "vllm:request_success_total", finished_reason="length") == 1
    assert value(prometheus, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(prometheus, "vllm:num_requests_waiting") == 1  # r2, queued after the last step
    # The first forced log prints; the next two fall within its 5 s.
    lines = [line for line in log_lines(caplog) if "Pending: 1 reqs" in line]
    assert len(lines) == 1 and "Running: 0 reqs, Swapped: 0 reqs, Pending: 1 reqs" in lines[0]


# -- the server's forced-log task ----------------------------------------------------


def test_server_forces_a_stats_log_while_it_runs(tiny_model_dir, monkeypatch):
    """vLLM's server calls do_log_stats every 10 s when it logs stats (here
    every 0.02 s), and cancels that task on shutdown; with
    --disable-log-stats only the startup call is made."""
    monkeypatch.setattr(api_server, "FORCE_LOG_INTERVAL_S", 0.02)

    async def serve(argv: list[str], until_calls: int) -> tuple[int, int, bool]:
        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model=tiny_model_dir("llama"), block_size=8)
        )
        calls = 0
        do_log_stats = engine.do_log_stats

        async def counted() -> None:
            nonlocal calls
            calls += 1
            await do_log_stats()

        engine.do_log_stats = counted
        args = make_arg_parser(argparse.ArgumentParser()).parse_args(argv)
        app = api_server.init_app(engine, args)
        async with app.router.lifespan_context(app):
            for _ in range(500):
                if calls >= until_calls:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            running = calls
        await asyncio.sleep(0.1)  # after shutdown: nothing more
        left = any(task.get_name() == "force_log" for task in asyncio.all_tasks())
        return running, calls, left

    running, after, left = asyncio.run(serve([], until_calls=3))
    assert running >= 3 and after == running and not left
    # 0.1 s of 0.02 s intervals would have made 5 more calls: none is made.
    assert asyncio.run(serve(["--disable-log-stats"], until_calls=1)) == (1, 1, False)


# -- V1 ------------------------------------------------------------------------------


def test_token_latencies_are_recorded_per_request_and_logged_from_stats():
    """Two requests (V1 may give them the same id: the metrics objects, not
    ids, tell them apart), their tokens at hand-picked times: each first
    token is a TTFT from its arrival, each later step's a TPOT from the
    request's previous token; the logger observes the Stats' lists."""
    first, second = RequestMetrics(arrival_time=10.0), RequestMetrics(arrival_time=11.0)
    steps: list[tuple[list[float], list[float]]] = []
    for now, requests in ((12.0, [first]), (14.0, [second]), (14.5, [first]), (15.0, [second])):
        ttfts, tpots = [], []
        for metrics in requests:
            metrics.record_token(now, ttfts, tpots)
        steps.append((ttfts, tpots))
    assert steps == [([2.0], []), ([3.0], []), ([], [2.5]), ([], [1.0])]
    assert (first.first_token_time, first.last_token_time) == (12.0, 14.5)

    prometheus = PrometheusStatLogger(labels={"model_name": "m"})
    for ttfts, tpots in steps:
        stats = Stats(
            now=0.0, num_running=2, num_waiting=0, num_swapped=0, gpu_cache_usage=0.0,
            cpu_cache_usage=0.0, num_prefill_tokens=0, num_decode_tokens=0, num_preemptions=0,
            prefix_cache_queries=0, prefix_cache_hits=0,
            time_to_first_tokens_iter=ttfts, time_per_output_tokens_iter=tpots,
        )
        prometheus.log(stats, [])
    assert value(prometheus, "vllm:time_to_first_token_seconds_count") == 2
    assert value(prometheus, "vllm:time_to_first_token_seconds_sum") == 2.0 + 3.0
    assert value(prometheus, "vllm:time_per_output_token_seconds_count") == 2
    assert value(prometheus, "vllm:time_per_output_token_seconds_sum") == 2.5 + 1.0


def v1_async_llm_with_prometheus(model: str):
    """A V1 AsyncLLM (prefix caching off) with a Prometheus logger added;
    made inside the event loop that will run it."""
    from minivllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model, use_v1=True, block_size=8, enable_prefix_caching=False)
    )
    prometheus = PrometheusStatLogger(labels={"model_name": "m"})
    engine.add_logger("prometheus", prometheus)
    return engine, prometheus


def test_v1_async_llm_times_the_first_token_of_aborted_requests(tiny_model_dir):
    """Five clients hang up after their first output: five TTFTs, and no
    TPOT is recorded for requests that make no further token. Prefix
    caching off: -1."""
    async def main() -> PrometheusStatLogger:
        engine, prometheus = v1_async_llm_with_prometheus(tiny_model_dir("llama"))
        params = SamplingParams(max_tokens=50, **GREEDY)
        try:
            for i in range(5):
                stream = engine.generate(prompt(20), params, f"r{i}")
                async for _ in stream:
                    break  # the client hangs up
                await stream.aclose()
            await engine.do_log_stats()
        finally:
            engine.shutdown()
        return prometheus

    prometheus = asyncio.run(main())
    assert value(prometheus, "vllm:time_to_first_token_seconds_count") == 5
    assert value(prometheus, "vllm:gpu_prefix_cache_hit_rate") == -1


@pytest.mark.parametrize("disable_log_stats", [True, False])
def test_v1_offline_engine_logs_stats_when_asked(disable_log_stats, tiny_model_dir, caplog):
    """V1's LLMEngine records every step and logs vLLM's line, as the
    classic one. One 16-token prompt, 3 tokens: step 1 prefills it into 2
    of the 16 usable blocks (17 less V1's null block) and logs; V1 caches
    prefixes by default: one lookup, no hit."""
    caplog.set_level(logging.INFO, logger="minivllm.engine.metrics")
    llm = LLM(tiny_model_dir("llama"), use_v1=True, block_size=8, num_gpu_blocks_override=17,
              max_model_len=128,
              disable_log_stats=disable_log_stats)
    stat_loggers = llm.llm_engine.stat_loggers
    if disable_log_stats:
        assert stat_loggers is None
    else:
        stat_loggers.log_line.last_log_time = 0.0  # the first step logs
    llm.generate([prompt(16)], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    if disable_log_stats:
        assert log_lines(caplog) == []
        return
    lines = log_lines(caplog)
    assert len(lines) == 2
    assert "Running: 1 reqs, Swapped: 0 reqs, Pending: 0 reqs" in lines[0]
    assert lines[0].endswith("GPU KV cache usage: 12.5%, CPU KV cache usage: 0.0%.")
    assert lines[1] == "Prefix cache hit rate: GPU: 0.00%, CPU: 0.00%"
    totals = stat_loggers.log_line
    assert (totals.total_prefill_tokens, totals.total_generation_tokens) == (16, 3)


class PerStep:
    """A stat logger that keeps each step's preemption count."""

    def __init__(self) -> None:
        self.preemptions: list[int] = []

    def log(self, stats: Stats, request_outputs) -> None:
        self.preemptions.append(stats.num_preemptions)


def v1_preempting_run(tiny_model_dir, abort_b_after_step: int | None = None):
    """V1, 4 usable blocks of 8 (5 less the null block): two 16-token
    prompts take all 4 in step 1 (a1, b1); a's 17th token needs a 5th, so
    step 2 preempts b, the tail of RUNNING (a2); b, which needs 3 blocks
    for its 17 tokens, waits while a makes a3, a4 (steps 3-4) and finishes;
    step 5 recomputes b and samples b2: that output brings b's PREEMPTED
    event; b3, b4 in steps 6-7. Returns (the per-step logger, the engine,
    the finished outputs by id)."""
    llm = LLM(tiny_model_dir("llama"), use_v1=True, block_size=8, num_gpu_blocks_override=5,
              max_model_len=32, disable_log_stats=False)
    engine = llm.llm_engine
    per_step = PerStep()
    engine.stat_loggers.add_logger("per_step", per_step)
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request("a", prompt(16), params)
    engine.add_request("b", prompt(16, start=40), params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        if steps == abort_b_after_step:
            engine.abort_request("b")
    return per_step, engine, finished


def test_v1_counts_a_preemption_when_the_request_next_makes_a_token(tiny_model_dir):
    """vLLM V1's rule: the PREEMPTED event travels with b's next output, so
    the counter moves in step 5, not in step 2 where the scheduler preempted
    b (which the engine's own total, from SchedulerStats, counted)."""
    per_step, engine, finished = v1_preempting_run(tiny_model_dir)
    assert per_step.preemptions == [0, 0, 0, 0, 1, 0, 0]
    assert engine.stat_loggers.log_line.total_preemptions == 1
    assert engine.total_preemptions == 1
    assert [len(finished[r].outputs[0].token_ids) for r in "ab"] == [4, 4]


def test_v1_never_counts_the_preemption_of_a_request_aborted_before_it_runs_again(
    tiny_model_dir,
):
    per_step, engine, finished = v1_preempting_run(tiny_model_dir, abort_b_after_step=3)
    assert sum(per_step.preemptions) == 0
    assert engine.stat_loggers.log_line.total_preemptions == 0
    assert engine.total_preemptions == 1  # the scheduler's count: it did preempt b
    assert list(finished) == ["a"]


def test_v1_outputs_carry_the_time_a_request_first_left_the_queue(tiny_model_dir):
    """With one request at a time (max_num_seqs=1), b waits for a: it is
    first scheduled in the step after the one that finished a, so after a's
    output was made, and its time in the queue is that wait. a is
    scheduled in the step that makes its first token."""
    llm = LLM(tiny_model_dir("llama"), use_v1=True, block_size=8, max_model_len=64,
              max_num_seqs=1)
    outputs = llm.generate([prompt(6), prompt(6, start=40)], SamplingParams(max_tokens=3, **GREEDY),
                           use_tqdm=False)
    a, b = (o.metrics for o in outputs)
    for m in (a, b):
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    assert b.first_scheduled_time > a.finished_time
    assert a.time_in_queue < a.finished_time - a.first_scheduled_time < b.time_in_queue


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA"])
def test_v1_streamed_n2_counts_each_request_once(tiny_model_dir, kind):
    """AsyncLLM, one streamed request with n=2 (prefix caching off, so both
    children prefill and finish in the same step), and a forced log in the
    middle of it: 2 successes (one per completion), 1 end-to-end latency,
    2 TTFTs and 2 x 5 TPOTs (each child timed as a request), however the
    reader's outputs are merged and however often do_log_stats shows the
    last step again."""
    from minivllm.sampling_params import RequestOutputKind
    async def main() -> PrometheusStatLogger:
        engine, prometheus = v1_async_llm_with_prometheus(tiny_model_dir("llama"))
        params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True,
                                output_kind=RequestOutputKind[kind])
        try:
            async for output in engine.generate(prompt(20), params, "r"):
                if not output.finished:
                    await engine.do_log_stats()
        finally:
            engine.shutdown()
        return prometheus

    prometheus = asyncio.run(main())
    assert value(prometheus, "vllm:request_success_total", finished_reason="length") == 2
    assert value(prometheus, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(prometheus, "vllm:time_to_first_token_seconds_count") == 2
    assert value(prometheus, "vllm:time_per_output_token_seconds_count") == 2 * 5


def test_the_tpot_after_a_chunked_rebuild_counts_from_the_previous_token(
    tiny_model_dir, monkeypatch
):
    """Two 4-token prompts, 20 tokens each, in 4 blocks of 8, chunks of at
    most 8 tokens a step, on a clock that moves one second per step: b is
    preempted (recompute) after its first tokens, and its rebuild (its
    prompt and tokens so far, in chunks) takes steps without a token; its
    next token's TPOT is the gap since its previous token, all of them
    included (row 70). The oracle is the outputs: when each request's
    token count grew."""
    import minivllm.engine.llm_engine as llm_engine_module

    clock = [0.0]
    monkeypatch.setattr(llm_engine_module.time, "time", lambda: clock[0])
    llm = LLM(
        tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=4, swap_space=0.01,
        preemption_mode="recompute", enable_chunked_prefill=True, max_num_batched_tokens=8,
        max_num_seqs=2,
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=20, **GREEDY)
    engine.add_request("a", prompt(4), params)
    engine.add_request("b", prompt(4, start=40), params)
    token_times: dict[str, list[float]] = {"a": [], "b": []}
    counts = {"a": 0, "b": 0}
    ttfts, tpots, preemptions = [], [], 0
    while engine.has_unfinished_requests():
        clock[0] += 1.0
        for output in engine.step():
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens > counts[output.request_id]:
                token_times[output.request_id].append(clock[0])
                counts[output.request_id] = num_tokens
        stats = engine.get_stats()
        ttfts += stats.time_to_first_tokens_iter
        tpots += stats.time_per_output_tokens_iter
        preemptions += stats.num_preemptions
    assert preemptions >= 1
    want_tpots = [later - earlier for times in token_times.values()
                  for earlier, later in zip(times, times[1:], strict=False)]
    assert sorted(ttfts) == sorted(times[0] for times in token_times.values())
    assert sorted(tpots) == sorted(want_tpots)
    assert max(tpots) >= 3.0, "b's rebuild took several steps, all in its TPOT"
