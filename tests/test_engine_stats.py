"""Engine statistics: each step's `Stats` against hand-counted queues, blocks
and tokens, and the `StatLogger` line against hand-computed throughputs."""

from __future__ import annotations

import logging

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.metrics import StatLogger, Stats

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt(n: int, start: int = 2) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


def queues_and_tokens(stats: Stats) -> tuple[int, int, int, int, int, int]:
    return (
        stats.num_running,
        stats.num_waiting,
        stats.num_swapped,
        stats.num_prefill_tokens,
        stats.num_decode_tokens,
        stats.num_preemptions,
    )


def test_step_stats_count_queues_blocks_and_tokens(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=16, max_num_seqs=2)
    engine = llm.llm_engine
    engine.add_request("a", prompt(16), PARAMS)
    engine.add_request("b", prompt(20, start=40), PARAMS)
    engine.add_request("c", prompt(5, start=80), PARAMS)

    # Before any step: the current state, nothing computed yet.
    stats = engine.get_stats()
    assert queues_and_tokens(stats) == (0, 3, 0, 0, 0, 0)
    assert (stats.gpu_cache_usage, stats.cpu_cache_usage) == (0.0, 0.0)

    # Step 1: max_num_seqs=2 admits a and b; c waits. 16 + 20 prompt tokens
    # in 2 + 3 blocks of 8.
    engine.step()
    stats = engine.get_stats()
    assert queues_and_tokens(stats) == (2, 1, 0, 36, 0, 0)
    assert stats.gpu_cache_usage == 5 / 16
    assert stats.cpu_cache_usage == 0.0

    # Step 2: one decode token each; a's 17th token opens its 3rd block.
    engine.step()
    stats = engine.get_stats()
    assert queues_and_tokens(stats) == (2, 1, 0, 0, 2, 0)
    assert stats.gpu_cache_usage == 6 / 16

    # Steps 3..8: both finish in step 8 (token 8). Their last decodes count
    # although they are no longer running, and their blocks are free.
    for _ in range(6):
        engine.step()
    stats = engine.get_stats()
    assert queues_and_tokens(stats) == (0, 1, 0, 0, 2, 0)
    assert stats.gpu_cache_usage == 0.0

    # Step 9: c's prefill, 5 tokens in 1 block.
    engine.step()
    stats = engine.get_stats()
    assert queues_and_tokens(stats) == (1, 0, 0, 5, 0, 0)
    assert stats.gpu_cache_usage == 1 / 16

    while engine.has_unfinished_requests():
        engine.step()
    totals = engine.stat_logger
    # Prompts 16 + 20 + 5; 7 decode tokens each (the first token comes from the prefill).
    assert (totals.total_prefill_tokens, totals.total_decode_tokens) == (41, 3 * 7)
    assert totals.total_preemptions == 0


def test_step_stats_count_each_parallel_sample(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=16)
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", prompt(16), params)
    # Step 1: one sequence computes the prompt, then forks; the two share 2 blocks.
    engine.step()
    stats = engine.get_stats()
    assert queues_and_tokens(stats) == (1, 0, 0, 16, 0, 0)
    assert stats.gpu_cache_usage == 2 / 16
    # Step 2: both sequences decode; each 17th token opens its own 3rd block.
    engine.step()
    stats = engine.get_stats()
    assert queues_and_tokens(stats) == (1, 0, 0, 0, 2, 0)
    assert stats.gpu_cache_usage == 4 / 16
    # Step 3: both decode their last token and finish.
    engine.step()
    stats = engine.get_stats()
    assert queues_and_tokens(stats) == (0, 0, 0, 0, 2, 0)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_step_stats_count_preemptions(mode, tiny_model_dir):
    # 4 blocks of 8: two 16-token prompts fill them; a's 17th token preempts b.
    llm = LLM(
        tiny_model_dir("llama"),
        block_size=8,
        num_gpu_blocks_override=4,
        swap_space=0.01,
        preemption_mode=mode,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompt(16), params)
    engine.add_request("b", prompt(16, start=40), params)
    scheduler = engine.scheduler
    per_step = []
    while engine.has_unfinished_requests():
        before = scheduler.num_cumulative_preemption
        engine.step()
        stats = engine.get_stats()
        assert stats.num_preemptions == scheduler.num_cumulative_preemption - before
        per_step.append(stats)

    assert queues_and_tokens(per_step[0]) == (2, 0, 0, 32, 0, 0)
    assert per_step[0].gpu_cache_usage == 1.0
    # Step 2: b gives up its 2 blocks; a takes one for its 17th token.
    step2 = per_step[1]
    assert step2.gpu_cache_usage == 3 / 4
    num_cpu_blocks = engine.cache_config.num_cpu_blocks
    if mode == "recompute":
        assert queues_and_tokens(step2) == (1, 1, 0, 0, 1, 1)
        assert step2.cpu_cache_usage == 0.0
    else:
        assert queues_and_tokens(step2) == (1, 0, 1, 0, 1, 1)
        assert step2.cpu_cache_usage == 2 / num_cpu_blocks
    # b needs 3 blocks (17 tokens, or 2 swapped + 1 to grow): it returns in
    # step 5, once a has finished in step 4.
    assert [s.num_preemptions for s in per_step] == [1 if i == 1 else 0 for i in range(7)]
    step5 = per_step[4]
    if mode == "recompute":
        # Its 16 prompt tokens and 1 generated token are computed again.
        assert queues_and_tokens(step5) == (1, 0, 0, 17, 0, 0)
    else:
        assert queues_and_tokens(step5) == (1, 0, 0, 0, 1, 0)
        assert step5.cpu_cache_usage == 0.0
    assert step5.gpu_cache_usage == 3 / 4
    totals = engine.stat_logger
    assert totals.total_preemptions == scheduler.num_cumulative_preemption == 1
    assert totals.total_prefill_tokens == (32 + 17 if mode == "recompute" else 32)


def test_step_stats_report_prefix_cache_hits(tiny_model_dir):
    llm = LLM(
        tiny_model_dir("llama"),
        block_size=8,
        num_gpu_blocks_override=16,
        enable_prefix_caching=True,
    )
    engine = llm.llm_engine
    # 33 tokens: (33 - 1) // 8 = 4 full blocks may come from the cache.
    engine.add_request("a", prompt(33), PARAMS)
    engine.add_request("b", prompt(33), PARAMS)
    engine.step()
    stats = engine.get_stats()
    # a computes all 33 and its 4 full blocks become findable; b, admitted
    # after it in the same step, finds them and computes its last token.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 + 4, 0 + 4)
    assert stats.prefix_cache_hit_rate == 0.5
    assert stats.num_prefill_tokens == 33 + 1
    # a holds 5 blocks; b shares 4 of them and has its own 5th.
    assert stats.gpu_cache_usage == 6 / 16

    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("c", prompt(33), PARAMS)
    engine.step()
    stats = engine.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12, 8)
    assert stats.prefix_cache_hit_rate == 8 / 12
    assert stats.num_prefill_tokens == 1


def make_stats(
    now: float, prefill: int = 0, decode: int = 0, generation: int = 0, **kwargs
) -> Stats:
    fields = dict(
        num_running=0,
        num_waiting=0,
        num_swapped=0,
        gpu_cache_usage=0.0,
        cpu_cache_usage=0.0,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    fields.update(kwargs)
    return Stats(
        now=now,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_generation_tokens=generation,
        **fields,
    )


def log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "minivllm.engine.metrics"]


def test_stat_logger_logs_interval_throughput(caplog):
    """vLLM v0.6's lines: generation throughput counts every token sampled
    (a finished prompt's first token too), and the prefix-cache line comes
    apart, only with a prefix cache."""
    caplog.set_level(logging.INFO, logger="minivllm.engine.metrics")
    stat_logger = StatLogger(log_interval=5.0, last_log_time=100.0)
    # Two prompts finish: 60 prompt tokens, their 2 first tokens.
    stat_logger.log(make_stats(101.0, prefill=60, generation=2))
    # A third prompt finishes beside 20 decodes: 20 + 1 tokens.
    stat_logger.log(make_stats(103.0, prefill=40, decode=20, generation=21))
    stat_logger.log(make_stats(104.9, decode=10, generation=10))
    assert log_lines(caplog) == []  # 4.9 s: the interval has not elapsed

    # 100 prompt and 2 + 21 + 10 + 7 = 40 generated tokens in the 5 s since 100.0.
    last = make_stats(
        105.0,
        decode=7,
        generation=7,
        num_running=3,
        num_swapped=1,
        num_waiting=2,
        gpu_cache_usage=0.625,
        cpu_cache_usage=0.125,
        prefix_cache_queries=8,
        prefix_cache_hits=4,
        enable_prefix_caching=True,
    )
    stat_logger.log(last)
    assert log_lines(caplog) == [
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 8.0 tokens/s, "
        "Running: 3 reqs, Swapped: 1 reqs, Pending: 2 reqs, GPU KV cache usage: 62.5%, "
        "CPU KV cache usage: 12.5%.",
        "Prefix cache hit rate: GPU: 50.00%, CPU: 0.00%",
    ]

    # A new interval starts at 105.0: only its own tokens count. No prefix
    # cache: no second line.
    stat_logger.log(make_stats(107.0, prefill=30))
    stat_logger.log(make_stats(110.0, decode=6, generation=6))
    assert len(log_lines(caplog)) == 3
    assert log_lines(caplog)[2].startswith(
        "Avg prompt throughput: 6.0 tokens/s, Avg generation throughput: 1.2 tokens/s, "
    )
    assert stat_logger.last_stats.now == 110.0
    totals = (stat_logger.total_prefill_tokens, stat_logger.total_decode_tokens)
    assert totals == (130, 20 + 10 + 7 + 6)
    assert stat_logger.total_generation_tokens == 2 + 21 + 10 + 7 + 6


def test_stat_logger_disabled_logs_nothing_but_keeps_totals(caplog):
    caplog.set_level(logging.INFO, logger="minivllm.engine.metrics")
    stat_logger = StatLogger(log_interval=5.0, enabled=False, last_log_time=0.0)
    stat_logger.log(make_stats(10.0, prefill=7, num_preemptions=2))
    stat_logger.log(make_stats(20.0, decode=3))
    assert log_lines(caplog) == []
    assert stat_logger.last_stats.now == 20.0
    assert (stat_logger.total_prefill_tokens, stat_logger.total_decode_tokens) == (7, 3)
    assert stat_logger.total_preemptions == 2


def test_stat_logger_rejects_a_non_positive_interval():
    with pytest.raises(ValueError, match="log_interval must be > 0 seconds, got 0"):
        StatLogger(log_interval=0)


@pytest.mark.parametrize("disable_log_stats", [True, False])
def test_engine_logs_stats_only_when_enabled(disable_log_stats, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="minivllm.engine.metrics")
    kwargs = {} if disable_log_stats else {"disable_log_stats": False}
    llm = LLM(tiny_model_dir("llama"), block_size=8, num_gpu_blocks_override=16, **kwargs)
    stat_logger = llm.llm_engine.stat_logger
    assert stat_logger.enabled is not disable_log_stats
    # The last line was long ago: the first step logs, the rest fall within 5 s.
    stat_logger.last_log_time = 0.0
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([prompt(16)], params, use_tqdm=False)
    lines = log_lines(caplog)
    if disable_log_stats:
        assert lines == []
    else:
        assert len(lines) == 1
        # After step 1: the request runs in 2 of the 16 blocks.
        assert "Running: 1 reqs, Swapped: 0 reqs, Pending: 0 reqs" in lines[0]
        assert "GPU KV cache usage: 12.5%, CPU KV cache usage: 0.0%" in lines[0]
    assert stat_logger.total_prefill_tokens == 16
    assert stat_logger.total_decode_tokens == 2
    # The prefill's token and the 2 decoded ones.
    assert stat_logger.total_generation_tokens == 3
