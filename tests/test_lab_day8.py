"""Day 8's checkers (tools/labs/checks/day8.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer; and tools/bench/machine.py's arithmetic
(never its timings).

The answers are written here as plain functions (tests never import
notebooks); each mistake is the solution with one thing changed.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from tools.bench import machine
from tools.labs.checks import day8


def _re(text: str) -> str:
    return re.escape(text)


# -- exercise 1: merging the partitions ---------------------------------------------------


def _merge(*, all_partitions=False, floor=False, no_max=False, batch_max=False,
           no_rescale=False, no_exp_sum=False, unnormalised=False, no_division=False,
           wrong_sum=False, flipped=False, plain_sum=False, mean=False, keep_axis=False,
           none=False):
    """The solution, one sequence and head at a time, as the reduce kernel
    does it; each flag is one mistake."""

    def merge_partitions(max_logits, exp_sums, tmp_out, seq_lens, partition_size):
        num_seqs, num_heads, max_parts, head_size = tmp_out.shape
        out = torch.zeros(num_seqs, num_heads, head_size)
        batch_top = max_logits.nan_to_num(nan=-math.inf).max()
        for i in range(num_seqs):
            n = int(seq_lens[i])
            parts = n // partition_size if floor else -(-n // partition_size)
            if all_partitions:
                parts = max_parts
            for h in range(num_heads):
                m, s, o = max_logits[i, h, :parts], exp_sums[i, h, :parts], tmp_out[i, h, :parts]
                top = batch_top if batch_max else m.max()
                if no_max:
                    scale = torch.exp(m)
                elif flipped:
                    scale = torch.exp(top - m)
                else:
                    scale = torch.exp(m - top)
                w = s * scale
                if no_rescale:
                    w = s
                if no_exp_sum:
                    w = scale
                if plain_sum:
                    out[i, h] = o.sum(0)
                elif mean:
                    out[i, h] = o.mean(0)
                elif unnormalised:
                    out[i, h] = (scale[:, None] * o).sum(0) / (s * scale).sum()
                elif no_division:
                    out[i, h] = (w[:, None] * o).sum(0)
                elif wrong_sum:
                    out[i, h] = (w[:, None] * o).sum(0) / s.sum()
                else:
                    out[i, h] = (w[:, None] * o).sum(0) / w.sum()
        if none:
            return None
        return out[:, :, None, :] if keep_axis else out

    return merge_partitions


def _merge_other(max_logits, exp_sums, tmp_out, seq_lens, partition_size):
    """Correct, written otherwise: log-sum-exp per partition, a softmax over
    partitions, vectorised with masks."""
    parts = (seq_lens + partition_size - 1) // partition_size
    used = (torch.arange(max_logits.shape[-1]) < parts[:, None])[:, None, :]
    lse = max_logits + torch.log(exp_sums)
    lse = torch.where(used, lse, torch.tensor(-math.inf))
    weights = torch.softmax(lse, dim=-1)
    return torch.einsum("shp,shpd->shd", weights,
                        torch.where(used[..., None], tmp_out, torch.zeros(())))


@pytest.mark.parametrize("mistake, message", [
    ("all_partitions", "you combined every partition slot"),
    ("floor", "drops the partly filled last one"),
    ("no_max", "without subtracting the largest max first"),
    ("batch_max", "over the whole batch instead of per (sequence, head)"),
    ("no_rescale", "you weighted partition i by its exp_sum s_i alone"),
    ("no_exp_sum", "forgetting its exp_sum s_i"),
    ("unnormalised", "you treated tmp_out as unnormalised partial sums"),
    ("no_division", "you did not divide by the total weight"),
    ("wrong_sum", "you divided by sum_i s_i, the raw exp-sums"),
    ("flipped", "you rescaled by exp(M - m_i)"),
    ("plain_sum", "you added the partitions' outputs"),
    ("mean", "you averaged the partitions' outputs with equal weights"),
    ("keep_axis", "You kept the partition axis"),
    ("none", "returned None"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day8.exercise_1(_merge(**{mistake: True}))


def test_exercise_1_turns_a_crash_into_a_hint():
    def crashes(max_logits, exp_sums, tmp_out, seq_lens, partition_size):
        return tmp_out.sum(dim=1) @ exp_sums  # mixes up the axes

    with pytest.raises(AssertionError, match=r"raised RuntimeError(.|\n)*partition axis"):
        day8.exercise_1(crashes)


@pytest.mark.parametrize("answer", [_merge(), _merge_other], ids=["solution", "other"])
def test_exercise_1_passes_and_runs_in_the_engine(answer, capsys):
    day8.exercise_1(answer)
    assert capsys.readouterr().out == "Day 8, exercise 1: passed\n"


def test_the_engine_run_really_spans_several_partitions():
    longest = max(max(s.calls[0].seq_lens) for s in day8.decode_steps())
    assert longest > 2 * day8.ENGINE_PARTITION_SIZE
    assert all(len(s.calls) == 4 for s in day8.decode_steps())  # one call per layer


# -- exercise 2: the bytes of a decode step -----------------------------------------------


def _bytes(*, gqa=False, no_v=False, one_layer=False, padded=False, max_pad=False, fp32=False,
           elements=False, no_qo=False, none=False):
    def decode_bytes(seq_lens, num_layers, num_heads, num_kv_heads, head_size, block_size,
                     dtype):
        elem = 1 if elements else 4 if fp32 else torch.tensor([], dtype=dtype).element_size()
        heads = num_heads if gqa else num_kv_heads
        lens = [max(seq_lens)] * len(seq_lens) if max_pad else seq_lens
        if padded:
            lens = [math.ceil(n / block_size) * block_size for n in lens]
        kv = (1 if no_v else 2) * sum(lens) * heads * head_size * elem
        qo = 0 if no_qo else 2 * len(seq_lens) * num_heads * head_size * elem
        return None if none else (1 if one_layer else num_layers) * (kv + qo)

    return decode_bytes


def _bytes_other(seq_lens, num_layers, num_heads, num_kv_heads, head_size, block_size, dtype):
    """Correct, written otherwise: per token and layer, dtype.itemsize, a float."""
    per_token = 2 * num_kv_heads * head_size * dtype.itemsize
    per_seq = 2 * num_heads * head_size * dtype.itemsize
    return float(sum(num_layers * (n * per_token + per_seq) for n in seq_lens))


@pytest.mark.parametrize("mistakes, message", [
    ("gqa", "you counted K/V for every query head (num_heads)"),
    ("no_v", "you counted the keys only"),
    ("one_layer", "you counted one layer"),
    ("padded", "you counted whole blocks"),
    ("max_pad", "you counted max(seq_lens) tokens for every sequence"),
    ("fp32", "you assumed 4 bytes per element"),
    ("elements", "you counted elements, not bytes"),
    ("no_qo", "you left out the query read and the output written"),
    ("gqa one_layer", "(num_heads)(.|\n)*; and you counted one layer"),
    ("none", "returned None"),
])
def test_exercise_2_rejects(mistakes, message):
    pattern = message if "(.|\n)" in message else _re(message)
    with pytest.raises(AssertionError, match=pattern):
        day8.exercise_2(_bytes(**{m: True for m in mistakes.split()}))


def test_exercise_2_compares_with_the_engine():
    """Right on the fixed configurations, off by one byte on the engine's
    steps (its blocks are of 8): the message gives the step's real count."""
    def off_in_the_engine(seq_lens, num_layers, num_heads, num_kv_heads, head_size, block_size,
                          dtype):
        right = _bytes()(seq_lens, num_layers, num_heads, num_kv_heads, head_size, block_size,
                         dtype)
        return right + (block_size == day8.ENGINE_BLOCK_SIZE)

    with pytest.raises(AssertionError, match=r"decode step \d+ of a real run of the shipped"):
        day8.exercise_2(off_in_the_engine)


@pytest.mark.parametrize("answer", [_bytes(), _bytes_other], ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day8.exercise_2(answer)
    assert capsys.readouterr().out == "Day 8, exercise 2: passed\n"


# -- exercise 3: the FLOPs of a decode step -------------------------------------------------


def _flops(*, kv_heads=False, macs=False, qk_only=False, one_layer=False, max_pad=False,
           d_squared=False):
    def decode_flops(seq_lens, num_layers, num_heads, num_kv_heads, head_size):
        heads = num_kv_heads if kv_heads else num_heads
        lens = [max(seq_lens)] * len(seq_lens) if max_pad else seq_lens
        per_dot = head_size**2 if d_squared else head_size
        per_token = (1 if qk_only else 2) * (1 if macs else 2) * per_dot
        return (1 if one_layer else num_layers) * heads * per_token * sum(lens)

    return decode_flops


def _flops_other(seq_lens, num_layers, num_heads, num_kv_heads, head_size):
    """Correct, written otherwise: the two products' matmul shapes, summed."""
    total = 0
    for n in seq_lens:
        scores = 2 * num_heads * 1 * n * head_size  # [h, 1, d] @ [h, d, n]
        weighted = 2 * num_heads * 1 * head_size * n  # [h, 1, n] @ [h, n, d]
        total += scores + weighted
    return total * num_layers


@pytest.mark.parametrize("mistake, message", [
    ("kv_heads", "GQA shares the K/V *rows*, not the arithmetic"),
    ("macs", "you counted multiply-adds: each is 2 FLOPs"),
    ("qk_only", "Or perhaps you counted the scores q.k but not the weighted sum of V"),
    ("one_layer", "you counted one layer"),
    ("max_pad", "you counted max(seq_lens) tokens for every sequence"),
    ("d_squared", "you counted head_size^2 per token"),
])
def test_exercise_3_rejects(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day8.exercise_3(_flops(**{mistake: True}))


@pytest.mark.parametrize("answer", [_flops(), _flops_other], ids=["solution", "other"])
def test_exercise_3_passes(answer, capsys):
    day8.exercise_3(answer)
    assert capsys.readouterr().out == "Day 8, exercise 3: passed\n"


# -- exercise 4: the roofline -----------------------------------------------------------------


def _roofline(*, use_min=False, use_sum=False, memory_only=False, compute_only=False,
              inverted=False, reversed_bound=False, vs_one=False, no_pair=False, word=False):
    def roofline(flops, nbytes, peak_flops, bandwidth):
        t_mem, t_math = nbytes / bandwidth, flops / peak_flops
        if inverted:
            t_mem, t_math = bandwidth / nbytes, peak_flops / flops
        seconds = (min(t_mem, t_math) if use_min else t_mem + t_math if use_sum
                   else t_mem if memory_only else t_math if compute_only else max(t_mem, t_math))
        memory = t_mem >= t_math
        if vs_one:
            memory = flops / nbytes < 1
        if reversed_bound:
            memory = not memory
        bound = "memory" if memory else "compute"
        if word:
            bound = "bandwidth" if memory else "flops"
        return seconds if no_pair else (seconds, bound)

    return roofline


def _fraction(*, inverted=False, percent=False, no_bandwidth=False, floor_only=False):
    def bandwidth_fraction(nbytes, seconds, bandwidth):
        if inverted:
            return seconds * bandwidth / nbytes
        if no_bandwidth:
            return nbytes / seconds
        if floor_only:
            return nbytes / bandwidth
        return (100 if percent else 1) * nbytes / seconds / bandwidth

    return bandwidth_fraction


def _roofline_other(flops, nbytes, peak_flops, bandwidth):
    """Correct, written otherwise: intensity against the ridge point, 'Memory-bound'."""
    intensity, ridge = flops / nbytes, peak_flops / bandwidth
    if intensity <= ridge:
        return nbytes / bandwidth, "Memory-bound"
    return flops / peak_flops, "compute-bound"


@pytest.mark.parametrize("mistake, message", [
    ("use_min", "you took the smaller of the two times"),
    ("use_sum", "you added the two times"),
    ("memory_only", "you returned bytes / bandwidth whatever the case"),
    ("compute_only", "you returned flops / peak_flops whatever the case"),
    ("inverted", "you divided the rates by the work"),
    ("reversed_bound", "you named the other bound"),
    ("vs_one", "you compared flops with bytes directly"),
    ("no_pair", "return a pair (seconds, bound)"),
    ("word", "return 'memory' or 'compute'"),
])
def test_exercise_4_rejects_roofline(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day8.exercise_4(_roofline(**{mistake: True}), _fraction())


@pytest.mark.parametrize("mistake, message", [
    ("inverted", "you inverted it"),
    ("percent", "you returned a percentage"),
    ("no_bandwidth", "divide by the bandwidth"),
    ("floor_only", "divide that by the measured seconds"),
])
def test_exercise_4_rejects_fraction(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day8.exercise_4(_roofline(), _fraction(**{mistake: True}))


@pytest.mark.parametrize("answer", [(_roofline(), _fraction()), (_roofline_other, _fraction())],
                         ids=["solution", "other"])
def test_exercise_4_passes(answer, capsys):
    day8.exercise_4(*answer)
    assert capsys.readouterr().out == "Day 8, exercise 4: passed\n"


# -- the notebook's helpers ----------------------------------------------------------------------


def test_v2_launches_are_recorded_without_a_gpu():
    partition, reduce = day8.v2_launches(seq_lens=(1100, 300), num_heads=4)
    assert partition.kernel.startswith("paged_attention_v2_kernel<")
    assert partition.grid == (4, 2, 3)  # heads, sequences, ceil(1100 / 512) partitions
    assert reduce.kernel.startswith("paged_attention_v2_reduce_kernel<")
    assert reduce.grid == (4, 2) and reduce.shared_mem == 3 * 4
    assert [tuple(t.shape) for t in partition.args[:3]] == [(2, 4, 3), (2, 4, 3), (2, 4, 3, 64)]


# -- tools/bench/machine.py: its arithmetic, never its timings --------------------------------


def test_rate_arithmetic_and_formatting():
    rate = machine.Rate("read", work=2e9, seconds=0.25, unit="B")
    assert rate.per_second == 8e9
    assert str(rate) == "read on cpu: 8 GB/s"
    assert machine.format_rate(4.5e12, "FLOP") == "4.5 TFLOP/s"
    assert machine.format_rate(12.34e9, "B") == "12.3 GB/s"
    assert machine.format_rate(512.0, "B") == "512 B/s"


def test_traffic_flops_and_ridge_point():
    assert machine.copy_traffic(1000) == 2000
    assert machine.matmul_flops(2, 3, 4) == 48
    assert machine.ridge_point(989e12, 3.35e12) == pytest.approx(295.2, abs=0.1)


def test_best_seconds_keeps_the_shortest_run_after_a_warm_up():
    ticks = iter([0.0, 5.0, 10.0, 12.0, 20.0, 23.0])  # runs of 5, 2 and 3 seconds
    calls = []
    best = machine.best_seconds(lambda: calls.append(1), repeats=3, clock=lambda: next(ticks))
    assert best == 2.0 and len(calls) == 4  # the warm-up call is not timed
    with pytest.raises(ValueError, match="at least 1"):
        machine.best_seconds(lambda: None, repeats=0)


def test_measurements_record_the_work_they_time():
    read = machine.read_bandwidth(nbytes=4098, repeats=1)
    assert (read.work, read.unit, read.what) == (4096, "B", "read")  # whole floats only
    copy = machine.copy_bandwidth(nbytes=4096, repeats=1)
    assert copy.work == 8192  # read once and written once
    matmul = machine.matmul_peak(n=8, repeats=1)
    assert (matmul.work, matmul.unit) == (2 * 8**3, "FLOP")
    assert read.seconds > 0 and math.isfinite(read.per_second)
