"""The benchmarks' core functions on tiny workloads: their accounting, never
their timings (tools/bench/)."""

from __future__ import annotations

import pytest
import torch

from tools.bench.common import (
    BenchRequest,
    WorkloadSpec,
    percentile,
    poisson_arrival_times,
    sample_requests,
)
from tools.bench.kv_efficiency import StepUsage, contiguous_usage, paged_usage
from tools.bench.latency import run_latency
from tools.bench.step_cost import linear_fit, measure_step_cost, measure_step_cost_v1
from tools.bench.throughput import agreement, make_static_batch, run_throughput
from tools.bench.tp import run_tp

VOCAB = 384  # the tiny checkpoints' tokenizer


def test_workload_is_seeded_and_in_range():
    spec = WorkloadSpec(
        num_requests=50,
        min_prompt_len=3,
        max_prompt_len=9,
        min_output_len=2,
        max_output_len=5,
        seed=7,
    )
    requests = sample_requests(spec, VOCAB)
    assert requests == sample_requests(spec, VOCAB)
    assert requests != sample_requests(WorkloadSpec(50, 3, 9, 2, 5, seed=8), VOCAB)
    assert {len(r.prompt_token_ids) for r in requests} <= set(range(3, 10))
    assert {r.output_len for r in requests} <= set(range(2, 6))
    assert all(2 <= t < VOCAB for r in requests for t in r.prompt_token_ids)
    assert spec.max_model_len == 14


def test_poisson_arrivals_are_seeded_and_reproducible():
    times = poisson_arrival_times(2000, rate=4.0, seed=3)
    assert times == poisson_arrival_times(2000, rate=4.0, seed=3)
    assert times != poisson_arrival_times(2000, rate=4.0, seed=4)
    assert times[0] == 0.0
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    # Exponential gaps of mean 1/rate: 2000 of them average within 10 %.
    assert abs(times[-1] / 1999 - 0.25) < 0.025


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0], 99) == pytest.approx(2.98)


def test_static_batch_left_pads_and_runs_to_the_longest():
    batch = make_static_batch([BenchRequest([5, 6, 7], 4), BenchRequest([8, 9, 10, 11, 12], 7)])
    assert batch.input_ids.tolist() == [[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.padding_tokens == 2
    assert batch.max_new_tokens == 7  # the 4-token request computes 3 tokens it drops


def test_agreement_finds_the_first_divergence():
    a = agreement([[1, 2, 3], [1, 2, 3], [4, 5]], [[1, 2, 3], [1, 9, 3], [4, 5, 6]])
    assert (a.compared, a.identical, a.first_divergence) == (3, 1, [1, 2])


def test_paged_kv_accounting_by_hand(tiny_model_dir):
    """Two requests, 16-token blocks, a 4-block pool. A: 20-token prompt, 3
    outputs; B: 16-token prompt, 2 outputs.
    Step 1 (both prefill): A holds 2 blocks for 20 tokens, B 1 for 16:
      48 slots reserved, 36 live.
    Step 2 (both decode): A computes token 21 in its 2 blocks; B's 17th
      token opens its 2nd block, then B finishes and is freed: 32 reserved
      (A's 2 blocks), 21 live.
    Step 3: A finishes; nothing is reserved (not recorded)."""
    requests = [BenchRequest(list(range(2, 22)), 3), BenchRequest(list(range(30, 46)), 2)]
    result = paged_usage(
        tiny_model_dir("llama"), requests, budget_tokens=64, max_num_seqs=8, max_model_len=64
    )
    assert result.steps == [StepUsage(48, 36, 2), StepUsage(32, 21, 1)]
    assert result.steps[0].utilization == 0.75
    summary = result.summary()
    assert summary["utilization"] == (36 + 21) / (48 + 32)
    assert summary["max_batch"] == 2


def test_contiguous_kv_accounting_by_hand():
    """The same two requests, each reserving max_model_len = 64 slots of a
    128-slot budget: 128 reserved then 64 (A alone), with the same live
    tokens; reserving exact lengths (23 and 18): 41 then 23."""
    requests = [BenchRequest(list(range(2, 22)), 3), BenchRequest(list(range(30, 46)), 2)]
    worst = contiguous_usage(requests, 128, lambda r: 64, 8, 2048, "max")
    assert worst.steps == [StepUsage(128, 36, 2), StepUsage(64, 21, 1)]
    exact = contiguous_usage(requests, 128, lambda r: r.total_len, 8, 2048, "exact")
    assert exact.steps == [StepUsage(41, 36, 2), StepUsage(23, 21, 1)]
    # A budget of one reservation runs them one after the other: B is
    # admitted the step after A's last (steps 3 and 5 end empty: unrecorded).
    serial = contiguous_usage(requests, 64, lambda r: 64, 8, 2048, "one slot")
    assert serial.steps == [StepUsage(64, 20, 1), StepUsage(64, 21, 1), StepUsage(64, 16, 1)]


def test_step_cost_counts_only_full_decode_steps(tiny_model_dir):
    cost = measure_step_cost(
        tiny_model_dir("llama"), 4, prefix_caching=True, num_steps=3, vocab_size=VOCAB
    )
    assert cost.steps == 3
    assert cost.schedule_us_per_seq > 0 and cost.process_us_per_seq > 0
    assert cost.total_us_per_seq >= max(cost.schedule_us_per_seq, cost.process_us_per_seq)


def test_v1_step_cost_counts_only_full_decode_steps(tiny_model_dir):
    """max_tokens = 3 + 3: the prefill samples the first token, 5 decode
    steps follow, and the first and the last of them are left out: 3."""
    cost = measure_step_cost_v1(
        tiny_model_dir("llama"), 4, prefix_caching=True, num_steps=3, vocab_size=VOCAB
    )
    assert cost.steps == 3
    assert min(cost.schedule_us_per_seq, cost.prepare_us_per_seq, cost.update_us_per_seq) > 0
    assert cost.model_us_per_seq > 0
    assert cost.total_us_per_seq >= max(cost.schedule_us_per_seq, cost.process_us_per_seq)


@pytest.mark.slow
def test_tp_counts_the_collectives_of_a_decode_step(tiny_model_dir):
    """Per decode step on 2 ranks the driver runs, by hand: the broadcast of
    the step (one object with the plain values, then 6 tensors: input_ids,
    positions, selected_token_indices, slot_mapping, block_tables,
    seq_lens_tensor), one all-reduce for the embedding, two per layer (2
    layers), and the gather of the logits."""
    one = run_tp(tiny_model_dir("llama"), 1, batch=2, prompt_len=8, output_len=4)
    two = run_tp(tiny_model_dir("llama"), 2, batch=2, prompt_len=8, output_len=4)
    assert one.steps == two.steps == 3  # every decode after the first step's
    assert (one.collectives_per_step, one.kb_per_step_per_layer) == (0, 0)
    assert two.collectives_per_step == 1 + 6 + 1 + 2 * 2 + 1
    # Each all-reduce moves the batch's hidden states, 2 x 64 float32: at
    # least 2 of them per layer.
    assert two.kb_per_step_per_layer >= 2 * (2 * 64 * 4) / 1e3
    assert two.weights_mb_per_rank < 0.6 * one.weights_mb_per_rank


def test_linear_fit_recovers_a_line():
    slope, intercept = linear_fit([16, 64, 256, 1024], [3 * n + 50 for n in (16, 64, 256, 1024)])
    assert slope == pytest.approx(3) and intercept == pytest.approx(50)


def test_throughput_runs_every_baseline_on_the_same_work(tiny_model_dir):
    spec = WorkloadSpec(
        num_requests=5,
        min_prompt_len=3,
        max_prompt_len=20,
        min_output_len=2,
        max_output_len=6,
        seed=1,
    )
    result = run_throughput(
        tiny_model_dir("llama"), spec, max_num_seqs=4, budget_seqs=2, single_requests=2
    )
    requests = sample_requests(spec, VOCAB)
    wanted = sum(r.output_len for r in requests)
    runs = {r.name: r for r in result.runs}
    assert [r.output_tokens for r in result.runs] == [wanted] * 4 + [
        sum(r.output_len for r in requests[:2])
    ] + [wanted] * 2
    for run in result.runs:
        lens = [r.output_len for r in requests[: run.num_requests]]
        assert [len(o) for o in run.outputs] == lens
    # Static batches of 4 then 1 request: every row is padded to its batch's
    # longest prompt, then runs until its batch's longest output.
    first, last = requests[:4], requests[4]
    longest_prompt = max(len(r.prompt_token_ids) for r in first)
    assert runs["HF static, batch 4"].computed_tokens == 4 * (
        longest_prompt + max(r.output_len for r in first) - 1
    ) + (len(last.prompt_token_ids) + last.output_len - 1)
    # The engine runs each prompt once and each output token but the last
    # (the budgeted run may recompute preempted requests: at least as many).
    exact = sum(len(r.prompt_token_ids) + r.output_len - 1 for r in requests)
    assert runs["engine, batch 4"].computed_tokens == exact
    assert runs[f"engine, KV 2x{spec.max_model_len}"].computed_tokens >= exact
    # V1 the same: its counts come from its own SchedulerStats.
    assert runs["V1, batch 4"].computed_tokens == exact
    assert runs[f"V1, KV 2x{spec.max_model_len}"].computed_tokens >= exact
    assert runs["V1, batch 4"].outputs == runs["engine, batch 4"].outputs
    assert runs["HF static, batch 4"].kv_cache_tokens == 4 * spec.max_model_len
    assert runs[f"engine, KV 2x{spec.max_model_len}"].kv_cache_tokens == 2 * spec.max_model_len
    assert set(result.ratios) == {
        "equal_batch", "equal_kv_memory", "vs_one_at_a_time",
        "v1_over_classic_equal_batch", "v1_over_classic_equal_kv_memory",
    }
    assert result.agreement["engine_vs_hf_one_at_a_time"]["compared"] == 2


def test_latency_measures_every_request(tiny_model_dir):
    spec = WorkloadSpec(
        num_requests=4,
        min_prompt_len=3,
        max_prompt_len=40,
        min_output_len=2,
        max_output_len=5,
        seed=2,
    )
    runs = run_latency(tiny_model_dir("llama"), spec, rate=50.0, chunk_size=16, max_num_seqs=4)
    assert [(run.engine, run.chunked_prefill) for run in runs] == [
        ("classic", False), ("classic", True), ("V1", True)
    ]
    assert [run.max_num_batched_tokens for run in runs] == [2048, 16, 16]
    lens = [r.output_len for r in sample_requests(spec, VOCAB)]
    for run in runs:
        assert [r.output_len for r in run.requests] == lens
        assert [r.arrival for r in run.requests] == poisson_arrival_times(4, 50.0, 2)
        assert all(r.ttft > 0 and r.tpot > 0 for r in run.requests)
        assert set(run.summary()) >= {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"}
    torch.manual_seed(0)  # leave the global RNG as other tests expect it
