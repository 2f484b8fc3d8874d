"""The benchmarks' core functions on tiny workloads: their accounting, never
their timings (tools/bench/)."""

from __future__ import annotations

import json

import pytest
import torch

from tools.bench import step_cost
from tools.bench.common import (
    BenchRequest,
    Repeated,
    WorkloadSpec,
    percentile,
    poisson_arrival_times,
    sample_requests,
)
from tools.bench.kv_efficiency import StepUsage, contiguous_usage, paged_usage
from tools.bench.latency import (
    TokenTimes,
    hf_decode,
    run_latency,
    run_single_request,
    time_per_output_token,
)
from tools.bench.step_cost import linear_fit, measure_step_cost, measure_step_cost_v1
from tools.bench.step_split import PARTS, decode_split
from tools.bench.throughput import (
    RunResult,
    add_repetition,
    agreement,
    make_static_batch,
    run_key_runs,
    run_throughput,
)
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


def test_step_cost_at_one_size_runs_without_a_fit(tmp_path):
    """One `--num-seqs` is a point, not a line: the report leaves the fit out
    (it divided by zero)."""
    out = tmp_path / "step_cost.json"
    step_cost.main(["--num-seqs", "4", "--steps", "2", "--repeats", "1", "--no-plot",
                    "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["linear_fit"] == {}
    assert {(r["num_seqs"], r["prefix_caching"]) for r in result["results"]} == {
        (4, False), (4, True)}


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


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_step_split_charges_each_part_its_own_time(tiny_model_dir, use_v1):
    """A sampler made 20 ms slower shows in `sampler`, and (V1) input
    preparation made 20 ms slower in `prepare_inputs`, not in `model` (which
    is execute_model minus those); the parts add up to the step, and the
    engine's objects are as before once the timing is over."""
    import time

    from minivllm import LLM
    from tools.bench.step_split import v1_engine_core

    llm = LLM(tiny_model_dir("llama"), max_num_seqs=4, use_v1=use_v1, max_model_len=64)
    engine, core = llm.llm_engine, v1_engine_core(llm)
    scheduler = engine.scheduler if core is None else core.scheduler
    runner = (engine.worker if core is None else core.model_executor.driver_worker).model_runner
    sampler = runner.sampler
    slow = sampler.forward
    sampler.forward = lambda *a, **k: time.sleep(0.02) or slow(*a, **k)
    slowed = sampler.forward
    if core is not None:
        prepare = runner._prepare_inputs
        runner._prepare_inputs = lambda *a: time.sleep(0.02) or prepare(*a)
    ms = decode_split(llm, batch=4, prompt_len=6, steps=3, sync=False)
    assert ms["sampler"] >= 20 > ms["model"] > 0
    assert min(ms[p] for p in ("schedule", "prepare_inputs", "process")) > 0
    if core is not None:
        assert ms["prepare_inputs"] >= 20
    assert ms["step"] == pytest.approx(sum(ms[p] for p in PARTS))
    assert "step" not in vars(engine) and "schedule" not in vars(scheduler)
    assert sampler.forward is slowed and "execute_model" not in vars(runner)
    assert not engine.has_unfinished_requests()


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
        tiny_model_dir("llama"),
        spec,
        max_num_seqs=4,
        budget_seqs=2,
        single_requests=2,
        repeats=2,
        hf_cb_batch_sizes=[2],
        extra_runs=True,
    )
    requests = sample_requests(spec, VOCAB)
    runs = {r.name: r for r in result.runs}
    budget = f"KV 2x{spec.max_model_len}"
    assert set(runs) == {
        "engine, batch 4", "HF generate_batch, batch 4", "HF generate_batch, batch 2",
        "HF static, batch 4", "HF one at a time",
        f"engine, {budget}", "HF static, batch 2", "V1, batch 4", f"V1, {budget}",
    }
    assert len(result.runs) == len(runs)
    for run in result.runs:
        lens = [r.output_len for r in requests[: run.num_requests]]
        assert [len(o) for o in run.outputs] == lens  # each request its own length
        assert run.output_tokens == sum(lens)
    assert runs["HF one at a time"].output_tokens == sum(r.output_len for r in requests[:2])
    # Static batches of 4 then 1 request: every row is padded to its batch's
    # longest prompt, then runs until its batch's longest output.
    first, last = requests[:4], requests[4]
    longest_prompt = max(len(r.prompt_token_ids) for r in first)
    assert runs["HF static, batch 4"].computed_tokens == 4 * (
        longest_prompt + max(r.output_len for r in first) - 1
    ) + (len(last.prompt_token_ids) + last.output_len - 1)
    # The engine runs each prompt once and each output token but the last
    # (the budgeted run may recompute preempted requests: at least as many);
    # so does HF's continuous batching, counted at its decoder's input.
    exact = sum(len(r.prompt_token_ids) + r.output_len - 1 for r in requests)
    assert runs["engine, batch 4"].computed_tokens == exact
    assert runs["HF generate_batch, batch 4"].computed_tokens == exact
    assert runs["HF generate_batch, batch 2"].computed_tokens == exact
    assert runs[f"engine, {budget}"].computed_tokens >= exact
    # V1 the same: its counts come from its own SchedulerStats.
    assert runs["V1, batch 4"].computed_tokens == exact
    assert runs[f"V1, {budget}"].computed_tokens >= exact
    # Greedy on the same weights: the engine, V1 and HF's continuous batching
    # (each request's tokens back in request order) agree token for token.
    assert runs["V1, batch 4"].outputs == runs["engine, batch 4"].outputs
    assert runs["HF generate_batch, batch 4"].outputs == runs["engine, batch 4"].outputs
    assert runs["HF generate_batch, batch 2"].outputs == runs["engine, batch 4"].outputs
    assert result.agreement["engine_vs_hf_generate_batch_4"]["identical"] == 5
    assert result.agreement["engine_vs_hf_one_at_a_time"]["compared"] == 2
    assert runs["HF static, batch 4"].kv_cache_tokens == 4 * spec.max_model_len
    assert runs["HF generate_batch, batch 2"].kv_cache_tokens == 4 * spec.max_model_len
    assert runs[f"engine, {budget}"].kv_cache_tokens == 2 * spec.max_model_len
    # The key runs twice (the best batch size's too), the rest once.
    best = f"HF generate_batch, batch {result.hf_cb_best_batch_size}"
    repeated = {"engine, batch 4", "HF generate_batch, batch 4", best, "HF static, batch 4"}
    assert {name: len(r.seconds) for name, r in runs.items()} == {
        name: 2 if name in repeated else 1 for name in runs
    }
    assert all(r.repeats_identical for r in result.runs)
    assert set(result.hf_cb_sweep) == {2, 4}
    assert result.hf_cb_best_batch_size == max(result.hf_cb_sweep, key=result.hf_cb_sweep.get)
    assert set(result.ratios) == {
        "vs_generate_batch_matched", "vs_generate_batch_best", "equal_batch",
        "vs_one_at_a_time", "equal_kv_memory",
        "v1_over_classic_equal_batch", "v1_over_classic_equal_kv_memory",
    }
    ours, matched = runs["engine, batch 4"], runs["HF generate_batch, batch 4"]
    assert result.ratios["vs_generate_batch_matched"] == pytest.approx(
        ours.tokens_per_s / matched.tokens_per_s
    )
    # Repetition by repetition: run i of the engine over run i of the peer;
    # the same tokens, so the ratio of rates is the inverse ratio of times.
    assert result.paired_ratios["vs_generate_batch_matched"].values == pytest.approx(
        [hf_s / engine_s for engine_s, hf_s in zip(ours.seconds, matched.seconds, strict=True)]
    )


def _fake_run(name: str, batch_size: int, seconds: float) -> RunResult:
    """A run of 100 output tokens in `seconds`."""
    return RunResult(name, batch_size, 0, 1, 100, [seconds], 0, outputs=[[7]])


def test_key_runs_interleave_and_repeat_the_best_batch():
    """Repetition 1: the engine, the sweep (matched size included), static;
    then the engine, matched, best and static again, in that order. Seconds
    are handed out from a script: the sweep's batch 16 is fastest (2 s)."""
    calls: list[str] = []
    script = {"engine": [10.0, 8.0, 12.0], "static": [5.0, 5.0, 6.0],
              "cb 8": [4.0], "cb 16": [2.0, 3.0, 2.5], "cb 64": [4.0, 5.0, 4.5]}

    def fake(kind: str, batch: int = 0) -> RunResult:
        calls.append(kind)
        return _fake_run(kind, batch, script[kind].pop(0))

    key = run_key_runs(
        lambda: fake("engine"), lambda b: fake(f"cb {b}", b), lambda: fake("static"),
        matched_batch=64, sweep_sizes=[16, 8], repeats=3,
    )
    assert calls == ["engine", "cb 8", "cb 16", "cb 64", "static"] + 2 * [
        "engine", "cb 64", "cb 16", "static"
    ]
    assert (key.hf_cb_best.batch_size, key.hf_cb_matched.batch_size) == (16, 64)
    assert key.engine.seconds == [10.0, 8.0, 12.0]
    assert key.hf_cb_best.seconds == [2.0, 3.0, 2.5]
    assert key.sweep[8].seconds == [4.0]
    # Median of 100 / [10, 8, 12] tokens/s = 10; spread (12.5 - 8.33) / 10.
    assert key.engine.tokens_per_s == pytest.approx(10.0)
    assert key.engine.rates.spread == pytest.approx((100 / 8 - 100 / 12) / 10)
    assert key.engine.median_seconds == 10.0


def test_repeated_median_and_spread_by_hand():
    r = Repeated((200.0, 180.0, 250.0, 220.0))
    assert r.median == 210.0  # between the middle two
    assert r.spread == pytest.approx((250 - 180) / 210)
    assert r.summary()["values"] == [200.0, 180.0, 250.0, 220.0]
    assert Repeated((3.0,)).spread == 0.0
    run = _fake_run("x", 1, 2.0)
    add_repetition(run, _fake_run("x", 1, 4.0))
    assert run.seconds == [2.0, 4.0] and run.repeats_identical
    add_repetition(run, RunResult("x", 1, 0, 1, 100, [1.0], 0, outputs=[[8]]))
    assert not run.repeats_identical
    with pytest.raises(ValueError):
        add_repetition(run, _fake_run("y", 1, 1.0))
    # The same tokens out from fewer positions computed (a prefix cache hit) is other work.
    with pytest.raises(ValueError, match="not a repetition"):
        add_repetition(run, RunResult("x", 1, 0, 1, 100, [1.0], -5, outputs=[[7]]))


def test_throughput_with_v1_repeats_v1_on_the_same_work(tiny_model_dir):
    """`use_v1`: the repeated engine runs are V1's, with its defaults. Its
    prefix cache is emptied before each run: otherwise the second repetition
    would find every prompt cached, compute fewer positions and be refused
    as a repetition. HF gets V1's tokens per step."""
    spec = WorkloadSpec(num_requests=5, min_prompt_len=20, max_prompt_len=40,
                        min_output_len=2, max_output_len=6, seed=3)
    result = run_throughput(tiny_model_dir("llama"), spec, max_num_seqs=4, budget_seqs=2,
                            single_requests=1, repeats=2, hf_cb_batch_sizes=[4],
                            use_v1=True)
    runs = {r.name: r for r in result.runs}
    requests = sample_requests(spec, VOCAB)
    v1 = runs["V1, batch 4"]
    assert len(v1.seconds) == 2 and v1.repeats_identical
    assert v1.computed_tokens == sum(len(r.prompt_token_ids) + r.output_len - 1
                                     for r in requests)
    assert v1.outputs == runs["HF generate_batch, batch 4"].outputs
    assert result.workload["engine"] == "V1"
    assert result.workload["max_num_batched_tokens"] == 4096  # V1 on a CPU
    with pytest.raises(ValueError, match="use_v1"):
        run_throughput(tiny_model_dir("llama"), spec, 4, 2, 1, repeats=1,
                       hf_cb_batch_sizes=[4], extra_runs=True, use_v1=True)


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


def test_tpot_is_the_mean_gap_after_the_first_token():
    """vLLM's TPOT: 5 tokens at t = 1.0 (after the prefill), 1.5, 2.0, 2.5,
    3.0 s: 4 gaps over 2 s, 0.5 s each; the prefill is not in it."""
    assert time_per_output_token(1.0, 3.0, 5) == 0.5
    assert time_per_output_token(1.0, 1.0, 1) is None
    streamer = TokenTimes()
    streamer.put(torch.tensor([[5, 6, 7]]))  # the prompt: no time recorded
    for token in (9, 4):
        streamer.put(torch.tensor([token]))
    streamer.end()
    assert streamer.tokens == [9, 4] and len(streamer.times) == 2


def test_single_request_tpot_on_both_peers(tiny_model_dir, hf_model):
    """One 8-token prompt, 6 outputs, 2 runs each: every output token is
    timed once (HF's streamed tokens are exactly `generate`'s), the TPOTs
    are positive and the tokens agree with HF's."""
    single = run_single_request(tiny_model_dir("llama"), prompt_len=8, output_len=6, repeats=2)
    assert len(single.engine_tpot.values) == len(single.hf_tpot.values) == 2
    assert min(single.engine_tpot.values + single.hf_tpot.values) > 0
    assert single.agreement["compared"] == single.agreement["identical"] == 2
    hf = hf_model("llama")
    assert single.weight_bytes == 4 * sum(p.numel() for p in hf.parameters())
    assert single.weight_floor == single.weight_bytes / single.read_bandwidth
    request = sample_requests(WorkloadSpec(1, 8, 8, 6, 6, 0), VOCAB)[0]
    decoded = hf_decode(hf, request)
    ids = torch.tensor([request.prompt_token_ids])
    with torch.inference_mode():
        plain = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=6, min_new_tokens=6, eos_token_id=None,
                            pad_token_id=0)
    assert decoded.tokens == plain[0, 8:].tolist()
    summary = single.summary()
    # The engine's own threshold, whatever this machine's timing chose.
    assert summary["one_thread_max_tokens"] in (0, 1, 2, 4, 8, 16, 32)
    assert summary["hf_over_engine"] == pytest.approx(
        summary["hf_tpot_ms"]["median"] / summary["engine_tpot_ms"]["median"]
    )
    torch.manual_seed(0)  # leave the global RNG as other tests expect it
