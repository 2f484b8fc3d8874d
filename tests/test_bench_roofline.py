"""The roofline benchmark's accounting (tools/bench/roofline.py), never its
timings: the FLOPs and bytes it counts for a step against FlopCounterMode
on the real model, Day 8's decode oracles and hand-worked numbers; the time
split against a profile whose every number is known and against a real
profile of the tiny engine; and a `--quick` run end to end."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minivllm import LLM
from tools.bench import roofline
from tools.bench.common import MODEL_PRESETS, sample_requests
from tools.bench.profiling import profile_steps
from tools.bench.roofline import (
    ModelShape,
    StepShape,
    attention_bytes,
    attention_flops,
    grouped,
    profiled_step_us,
    recording_shapes,
    step_work,
    time_by_part,
)
from tools.labs.checks import day8, day12


def _engine(model_dir: str, **kw) -> LLM:
    return LLM(model_dir, block_size=16, seed=0, **kw)


def _add(llm: LLM, lengths: list[int], max_tokens: int, prefix: str) -> None:
    rng = random.Random(len(lengths))
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(2, 384) for _ in range(n)]
        llm.llm_engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt},
                                   roofline.greedy(max_tokens))


def test_the_20m_models_weights_by_hand():
    """hidden 512, MLP 1376, 7 layers, 8 heads and 4 KV heads of 64, vocab 384.
    Per layer: qkv 512 x (512 + 2 x 256) = 524,288; o 512 x 512 = 262,144;
    gate, up and down 3 x 512 x 1376 = 2,113,536: 2,899,968. Seven layers:
    20,299,776; LM head 384 x 512 = 196,608; norms 15 x 512 = 7,680."""
    config = MODEL_PRESETS["20m"][1]
    model = ModelShape(7, 512, 1376, 8, 4, 64, 384)
    assert (config["num_hidden_layers"], config["intermediate_size"]) == (7, 1376)
    assert model.layer_matmul_params == 2_899_968
    assert model.token_matmul_params == 20_299_776
    assert model.weight_bytes == 4 * (20_299_776 + 196_608 + 7_680)  # 82.0 MB
    # A decode of one sequence at 257 tokens: K/V 2 x 257 x 4 x 64 floats per layer,
    # query and output 2 x 8 x 64.
    work = step_work(model, StepShape((1,), (257,), logit_rows=1, num_prefills=0))
    assert work.matmul_flops == 2 * (20_299_776 + 196_608)
    assert work.attention_flops == 7 * 4 * 8 * 64 * 257
    assert work.attention_bytes == 7 * 4 * (2 * 257 * 4 * 64 + 2 * 8 * 64)
    assert work.kv_write_bytes == 7 * 4 * 2 * 4 * 64


def test_decode_attention_bytes_of_a_mixed_step_by_hand():
    """The 20M model's shape. A step of one 5-token prefill and two decodes
    at 10 and 20 tokens: only the decodes count, each K/V of its tokens (2 x
    n x 4 KV heads x 64 floats) plus its query and output rows (2 x 8 x 64),
    in 7 layers of 4-byte floats."""
    model = ModelShape(7, 512, 1376, 8, 4, 64, 384)
    step = StepShape((5, 1, 1), (5, 10, 20), logit_rows=3, num_prefills=1)
    per_decode = lambda n: 7 * 4 * (2 * n * 4 * 64 + 2 * 8 * 64)  # noqa: E731
    assert roofline.decode_attention_bytes(model, step) == per_decode(10) + per_decode(20)
    prefill_only = StepShape((5,), (5,), logit_rows=1, num_prefills=1)
    assert roofline.decode_attention_bytes(model, prefill_only) == 0


def test_floors_of_a_made_up_step_by_hand():
    """Peak 100 GFLOP/s, bandwidth 10 GB/s. Products of 2 GFLOP over 0.1 GB
    of weights: 20 ms of FLOPs, 10 ms of bytes. Attention of 0.05 GFLOP over
    0.3 GB (K/V read) + 0.02 GB (written): 0.5 ms and 32 ms. The roofline's
    floor is the larger of the step's totals, max(20.5, 42) = 42 ms; the
    parts one after another, 20 + 32 = 52 ms."""
    limits = roofline.Limits(100e9, 10e9, threads=1)
    work = roofline.StepWork(matmul_flops=2 * 10**9, attention_flops=5 * 10**7,
                             weight_bytes=10**8, attention_bytes=3 * 10**8,
                             kv_write_bytes=2 * 10**7)
    assert math.isclose(roofline.floor_seconds(work, limits), 0.042)
    assert math.isclose(roofline.phases_floor_seconds(work, limits), 0.052)


def test_floors_of_a_run_are_summed_step_by_step():
    """Same limits. A prefill bound by FLOPs: products of 10 GFLOP (100 ms)
    over 0.1 GB of weights (10 ms). A decode whose products are bound by
    FLOPs, 2 GFLOP (20 ms) over the same weights (10 ms), and whose attention
    is bound by bytes, 0.9 GB (90 ms). Step by step the roofline's floors
    are 100 + max(20, 100) = 200 ms; the floor of the summed work (12 GFLOP,
    1.1 GB) would be max(120, 110) = 120 ms, as if the prefill's idle
    bandwidth could serve the decode. Parts one after another: 100 + (20 + 90)."""
    limits = roofline.Limits(100e9, 10e9, threads=1)
    prefill = roofline.StepWork(matmul_flops=10**10, attention_flops=0, weight_bytes=10**8,
                                attention_bytes=0, kv_write_bytes=0)
    decode = roofline.StepWork(matmul_flops=2 * 10**9, attention_flops=0, weight_bytes=10**8,
                               attention_bytes=9 * 10**8, kv_write_bytes=0)
    floors, phases = roofline.run_floors([prefill, decode], limits)
    assert math.isclose(floors, 0.2) and math.isclose(phases, 0.21)


def test_decode_attention_counts_match_day8_oracles():
    """Day 8's references: the bytes of `moved_bytes` per sequence and layer,
    the FLOPs as FlopCounterMode counts a reference decode on meta tensors."""
    model = ModelShape(4, 192, 512, 6, 2, 32, 384)
    seq_lens = [17, 100, 5]
    sizes = dict(num_layers=4, num_heads=6, num_kv_heads=2, head_size=32)
    assert sum(attention_bytes(model, 1, n) for n in seq_lens) == day8.oracle_bytes(
        seq_lens, dtype=torch.float32, **sizes)
    assert sum(attention_flops(model, 1, n) for n in seq_lens) == day8.oracle_flops(
        seq_lens, **sizes)


def test_step_flops_match_flop_counter_on_the_real_model(tiny_model_dir):
    """FlopCounterMode around whole engine steps of the tiny Llama, on the
    PyTorch attention path (the Numba kernel is invisible to it): the
    products (aten.mm) are the matmul FLOPs, the batched products of
    attention (aten.bmm) the attention FLOPs. Prefills of different lengths
    check the per-sequence q_len x seq_len square; the decode's sequences
    are 32 tokens, two whole blocks, so that the reference's padding to the
    longest block table computes nothing extra."""
    llm = _engine(tiny_model_dir("llama"), attention_backend="torch")
    # FlopCounterMode counts aten.mm, not the oneDNN product of a packed weight:
    # the layers go back to F.linear, the reference (model_executor/layers/utils.py).
    for module in llm.llm_engine.worker.model_runner.model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = None
    model = ModelShape.from_config(llm.llm_engine.model_config.hf_config)
    params = dict(llm.llm_engine.worker.model_runner.model.named_parameters())
    # Every parameter but the (untied) embedding table is read once per step.
    read = sum(p.numel() for name, p in params.items() if "embed_tokens" not in name)
    assert model.weight_bytes == 4 * read

    def counted_steps() -> list[tuple[StepShape, dict[str, int]]]:
        out = []
        while llm.llm_engine.has_unfinished_requests():
            with recording_shapes(llm) as shapes, FlopCounterMode(display=False) as counter:
                llm.llm_engine.step()
            by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
            out.append((shapes[0], by_op))
        return out

    _add(llm, [20, 9, 13], max_tokens=1, prefix="p")
    _add(llm, [31, 31], max_tokens=2, prefix="d")
    steps = counted_steps()
    shapes = [shape for shape, _ in steps]
    assert shapes == [
        StepShape((20, 9, 13, 31, 31), (20, 9, 13, 31, 31), logit_rows=5, num_prefills=5),
        StepShape((1, 1), (32, 32), logit_rows=2, num_prefills=0),
    ]
    for shape, by_op in steps:
        work = step_work(model, shape)
        assert by_op == {"aten.mm": work.matmul_flops, "aten.bmm": work.attention_flops}


def test_split_of_the_made_up_profile_by_hand():
    """Day 12's made-up step, every number known (µs). Matmul: the two
    linears' 10+6+400 and 8+5+200, the addmm's 150, the LM head's 4+2+110;
    model_other: model's own 300, the embedding 20+15, mul and silu 40, index
    18, the second model region's own 45; attention 500+35+90+3+60+30 (its
    products are attention's); sampling 80+12+7+21; prepare 60+4+3; schedule
    120+5; process 200; the step's own 40 and its copy_ 9."""
    events = day12.made_up_profile()
    parts = time_by_part(events)
    assert parts == {
        "matmul": 416 + 213 + 150 + 116, "model_other": 300 + 35 + 40 + 18 + 45,
        "attention": 718, "sampling": 120, "prepare_inputs": 67, "schedule": 125,
        "process": 200, "engine_other": 49,
    }
    assert sum(parts.values()) == profiled_step_us(events) == 2612
    assert grouped(parts) == {"model": 1333, "attention": 718, "sampling": 120,
                              "prepare_inputs": 67, "bookkeeping": 374}


def test_split_of_a_real_profile_adds_up_to_the_steps(tiny_model_dir):
    """Decode steps of 3 sequences on the default (Numba) backend: every
    part has time, the parts add up to the `step` regions' total, and the
    labels are gone afterwards."""
    llm = _engine(tiny_model_dir("llama"))
    _add(llm, [12, 20, 7], max_tokens=8, prefix="r")
    engine = llm.llm_engine
    engine.step()  # the prefills
    events = profile_steps(llm, 2)
    parts = time_by_part(events)
    assert all(parts[p] > 0 for p in roofline.PARTS), parts
    assert math.isclose(sum(parts.values()), profiled_step_us(events), rel_tol=1e-6)
    assert "forward" not in vars(engine.worker.model_runner.model)
    roofline.drain(llm)


@pytest.fixture
def restore_threads():
    import numba

    before = torch.get_num_threads(), numba.get_num_threads()
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])


def test_quick_run_end_to_end(tmp_path, capsys, restore_threads):
    """`--quick` on the tiny model: the report's rows, with the counted work
    of the steps it ran (64-token prompts; decodes at 65-68 tokens)."""
    out = tmp_path / "roofline.json"
    roofline.main(["--quick", "--model-size", "tiny", "--threads", "1", "--device", "cpu",
                   "--json", str(out)])
    result = json.loads(out.read_text())
    assert "% bookkeeping" in capsys.readouterr().out
    rows = {r["step"]: r for r in result["rows"]}
    assert list(rows) == ["decode b=1", "decode b=8", "prefill 2x64", "workload"]
    assert result["config"]["attention_backend"] == "numba"
    model = ModelShape(**result["config"]["model_shape"])
    prefill = rows["prefill 2x64"]
    assert prefill["work"] == step_work(model, StepShape((64, 64), (64, 64), 2, 2)).__dict__
    decode = rows["decode b=8"]
    assert (decode["tokens"], decode["sequences"]) == (8, 8)
    assert 65 <= decode["context"] <= 68
    for row in result["rows"][:3]:
        assert len(row["step_seconds"]) == 3
        assert math.isclose(sum(row["shares"].values()), 1.0, rel_tol=1e-6)
        assert row["fraction_of_peak"] > 0 and row["fraction_of_bandwidth"] > 0
    # Decode attention timed: every layer's decode half once in each of the 3
    # timed steps, over 8 sequences' K/V; a prefill step never calls it.
    assert decode["decode_attention_calls"] == 3 * model.num_layers
    assert decode["decode_attention_bytes"] == pytest.approx(
        sum(attention_bytes(model, 1, n) for n in decode_seq_lens(decode)) / 3)
    _check_rate(decode, result["limits"])
    assert prefill["decode_attention_calls"] == 0
    assert prefill["decode_attention_bytes_per_second"] is None
    limits = result["limits"]
    assert limits["threads"] == 1 and limits["matmul_flops"] > 0
    _check_the_workloads_row(rows["workload"], model, limits)


def decode_seq_lens(row: dict) -> list[int]:
    """The tokens each decode of a `--quick` decode row's timed steps attends
    to: its prompts' 64 tokens, the first output token (from the prefill),
    one warm-up decode, then one more token each of the 3 timed steps."""
    plan = roofline.QUICK
    first = plan.prompt_len + plan.warmup + 1
    return [first + step for step in range(plan.steps) for _ in range(row["sequences"])]


def _check_rate(row: dict, limits: dict) -> None:
    seconds = row["decode_attention_seconds"]
    assert seconds > 0
    assert math.isclose(row["decode_attention_bytes_per_second"],
                        row["decode_attention_bytes"] / seconds)
    assert math.isclose(row["decode_attention_fraction_of_bandwidth"],
                        row["decode_attention_bytes"] / seconds / limits["read_bandwidth"])


def _check_the_workloads_row(row: dict, model: ModelShape, limits: dict) -> None:
    """The quick workload (4 requests, all at once, batch 4, no preemption):
    every prompt token and every output token but the last goes through the
    model once, and every output token is sampled from one row of logits."""
    requests = sample_requests(roofline.QUICK.workload, model.vocab_size)
    tokens = sum(r.total_len - 1 for r in requests)
    sampled = sum(r.output_len for r in requests)
    assert row["tokens"] == tokens and row["sequences"] == 4
    assert row["work"]["matmul_flops"] == 2 * (model.token_matmul_params * tokens
                                               + model.lm_head_params * sampled)
    assert row["spread"] is None and len(row["step_seconds"]) == 1
    # Decode attention: request r decodes its outputs 2..n at r.prompt + 1 ..
    # r.prompt + n - 1 tokens, all requests together, so the run has
    # max(n) - 1 steps with decodes, each calling every layer's decode half.
    decode_bytes = sum(attention_bytes(model, 1, len(r.prompt_token_ids) + j)
                       for r in requests for j in range(1, r.output_len))
    assert row["decode_attention_bytes"] == decode_bytes
    longest = max(r.output_len for r in requests)
    assert row["decode_attention_calls"] == model.num_layers * (longest - 1)
    _check_rate(row, limits)
    assert math.isclose(sum(row["shares"].values()), 1.0, rel_tol=1e-6)
    # Summed per step, the floors are at least the floor of the summed work
    # (equal, to rounding, when every step is on the same side of the ridge).
    whole = roofline.floor_seconds(roofline.StepWork(**row["work"]),
                                   roofline.Limits(limits["matmul_flops"],
                                                   limits["read_bandwidth"], 1))
    at_most = lambda a, b: a <= b * (1 + 1e-9)  # noqa: E731
    assert at_most(whole, row["roofline_seconds"])
    assert at_most(row["roofline_seconds"], row["phases_floor_seconds"])
    assert row["phases_floor_seconds"] < row["seconds"]
