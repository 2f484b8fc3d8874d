"""Day 14's checkers (tools/labs/checks/day14.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

The answers are written here as plain functions (tests never import
notebooks). Exercise 2's run in other processes from their source, so each
of its mistakes is a function of its own, self-contained like a learner's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.models import ModelRegistry
from minivllm.tracer.trace import Trace
from tools.labs.checks import day14

# -- exercise 1: the collectives of a decode step --------------------------------------


def _collectives(num_layers, hidden_size, vocab_size, batch, tp, *, embedding=True,
                 per_layer=2, broadcasts=7, per_rank=False, value_bytes=4, ar_over_tp=False,
                 full_vocab=False, unpadded=False, tp1_zero=True, logits_all_reduce=False,
                 per_sequence=False):
    if tp == 1 and tp1_zero:
        return dict.fromkeys(day14.KEYS, 0)
    all_reduces = per_layer * num_layers + (1 if embedding else 0)
    gathers = 1
    if logits_all_reduce:
        all_reduces, gathers = all_reduces + 1, 0
    vocab = vocab_size if unpadded else math.ceil(vocab_size / 64) * 64
    tokens = 1 if per_sequence else batch
    ar_bytes = all_reduces * tokens * hidden_size * value_bytes
    if ar_over_tp:
        ar_bytes //= tp
    gather_bytes = batch * (vocab if full_vocab else vocab // tp) * value_bytes * gathers
    scale = tp if per_rank else 1
    return dict(broadcast_calls=broadcasts * scale, all_reduce_calls=all_reduces * scale,
                all_reduce_bytes=ar_bytes, gather_calls=gathers * scale,
                gather_bytes=gather_bytes)


def _collectives_alternative(num_layers, hidden_size, vocab_size, batch, tp):
    """Correct, written otherwise: from the list of collectives in order."""
    if tp < 2:
        return {k: 0 for k in day14.KEYS}
    padded = -(-vocab_size // 64) * 64
    ops = [("broadcast", 0)] * 7 + [("all_reduce", batch * hidden_size * 4)] * (
        2 * num_layers + 1) + [("gather", batch * padded // tp * 4)]
    result = {k: 0 for k in day14.KEYS}
    for kind, size in ops:
        result[f"{kind}_calls"] += 1
        if kind != "broadcast":
            result[f"{kind}_bytes"] += size
    return result


@pytest.mark.parametrize("mistake, message", [
    ({"embedding": False}, "forgot the embedding's all-reduce"),
    ({"per_layer": 1}, "each layer has two blocks"),
    ({"broadcasts": 0}, "broadcasting its input"),
    ({"broadcasts": 1}, "one broadcast per tensor"),
    ({"broadcasts": 6}, "one broadcast per tensor"),
    ({"per_rank": True}, "you counted every rank's collectives"),
    ({"value_bytes": 2}, "4 bytes per value, not 2"),
    ({"ar_over_tp": True}, "does not shrink with tp"),
    ({"full_vocab": True}, "only its own slice of the logits"),
    ({"unpadded": True}, "padded to a multiple of 64"),
    ({"tp1_zero": False}, "with one worker there is no process group"),
    ({"logits_all_reduce": True}, "the logits are not all-reduced"),
    ({"per_sequence": True}, "one per sequence"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=message):
        day14.exercise_1(lambda *cfg: _collectives(*cfg, **mistake))


def test_exercise_1_rejects_a_wrong_return_type():
    with pytest.raises(AssertionError, match="should return a dict with the keys"):
        day14.exercise_1(lambda *cfg: 13)


def test_reference_counts_the_13_collectives_of_the_tiny_llama():
    """tests/test_bench.py counts 13 per decode step of the 2-layer tiny model."""
    counts = day14.reference_collectives(2, 64, 256, 2, 2)
    assert sum(v for k, v in counts.items() if k.endswith("_calls")) == 13


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_collectives, _collectives_alternative])
def test_exercise_1_passes(answer, capsys):
    day14.exercise_1(answer)
    assert capsys.readouterr().out == "Day 14, exercise 1: passed\n"


# -- exercise 2: a row-parallel layer ---------------------------------------------------


def row_shard(weight, tp_rank, tp_size):
    columns = weight.shape[1] // tp_size
    return weight[:, tp_rank * columns:(tp_rank + 1) * columns]


def row_parallel_linear(x, weight, bias, tp_rank, all_reduce):
    return all_reduce(F.linear(x, weight, bias if tp_rank == 0 else None))


def row_shard_chunked(weight, tp_rank, tp_size):
    return weight.chunk(tp_size, dim=1)[tp_rank].contiguous()


def row_parallel_bias_after(x, weight, bias, tp_rank, all_reduce):
    """Correct, written otherwise: the bias after the sum, on every rank."""
    y = all_reduce(x @ weight.t())
    return y if bias is None else y + bias


def row_shard_wrong_dim(weight, tp_rank, tp_size):
    return weight.chunk(tp_size, dim=0)[tp_rank]


def row_shard_rank_zero(weight, tp_rank, tp_size):
    columns = weight.shape[1] // tp_size
    return weight[:, :columns]


def row_forward_no_all_reduce(x, weight, bias, tp_rank, all_reduce):
    return F.linear(x, weight, bias if tp_rank == 0 else None)


def row_forward_bias_every_rank(x, weight, bias, tp_rank, all_reduce):
    return all_reduce(F.linear(x, weight, bias))


def row_forward_average(x, weight, bias, tp_rank, all_reduce):
    return all_reduce(F.linear(x, weight)) / 2 + (0 if bias is None else bias)


def row_forward_no_bias(x, weight, bias, tp_rank, all_reduce):
    return all_reduce(F.linear(x, weight))


def row_forward_reduce_input(x, weight, bias, tp_rank, all_reduce):
    y = F.linear(all_reduce(x), weight)
    return y if bias is None else y + bias


def _helper_matmul(x, weight):
    return x @ weight.t()


def row_forward_uses_a_helper(x, weight, bias, tp_rank, all_reduce):
    y = all_reduce(_helper_matmul(x, weight))
    return y if bias is None else y + bias


@pytest.mark.parametrize("shard, message", [
    (row_shard_wrong_dim, r"splits the weight's \*input\* columns"),
    (row_shard_rank_zero, "rank r's columns start at r \\* in / tp"),
])
def test_exercise_2_rejects_the_shard(shard, message):
    with pytest.raises(AssertionError, match=message):
        day14.exercise_2(shard, row_parallel_linear)


@pytest.mark.slow
@pytest.mark.parametrize("forward, message", [
    (row_forward_no_all_reduce, "must add them up with `all_reduce`"),
    (row_forward_bias_every_rank, "the bias was added on every rank before the all-reduce"),
    (row_forward_average, "all_reduce sums, it does not average"),
    (row_forward_no_bias, "the bias is missing"),
    (row_forward_reduce_input, "multiply the rank's input slice by its weight slice"),
    (row_forward_uses_a_helper, "must not use anything defined elsewhere"),
])
def test_exercise_2_rejects_the_forward(forward, message):
    with pytest.raises(AssertionError, match=message):
        day14.exercise_2(row_shard, forward)


def test_exercise_2_asks_for_a_def():
    with pytest.raises(AssertionError, match="Define it with `def`"):
        day14._source(eval("lambda w, r, t: w"))  # noqa: S307 - a function without source


@pytest.mark.slow
@pytest.mark.parametrize("shard, forward", [
    (row_shard, row_parallel_linear),
    (row_shard_chunked, row_parallel_bias_after),
])
def test_exercise_2_passes(shard, forward, capsys):
    day14.exercise_2(shard, forward)
    assert capsys.readouterr().out == "Day 14, exercise 2: passed\n"
    # A later TP engine ships every registration to its workers: the
    # checker's, whose module is deleted by now, must be gone.
    assert not [a for a in ModelRegistry.registered() if a.startswith("Day14")]


# -- exercise 3: QKVParallelLinear's shards ---------------------------------------------


def _qkv(q, k, v, tp_rank, tp_size, num_heads, num_kv_heads, head_size, *, fused=False,
         no_replication=False, round_robin=False, kv_by_rank=False, order="qkv"):
    if fused:
        return torch.cat([q, k, v]).chunk(tp_size)[tp_rank]
    q_rows = num_heads // tp_size * head_size
    if num_kv_heads >= tp_size or no_replication:
        kv_rows, index = num_kv_heads * head_size // tp_size, tp_rank
    else:
        kv_rows = head_size
        index = (tp_rank % num_kv_heads if round_robin else tp_rank if kv_by_rank
                 else tp_rank // (tp_size // num_kv_heads))
    parts = {"q": q[tp_rank * q_rows:(tp_rank + 1) * q_rows],
             "k": k[index * kv_rows:(index + 1) * kv_rows],
             "v": v[index * kv_rows:(index + 1) * kv_rows]}
    return torch.cat([parts[p] for p in order])


def _qkv_alternative(q, k, v, tp_rank, tp_size, num_heads, num_kv_heads, head_size):
    """Correct, written otherwise: view the tensors as heads and pick them."""
    hidden = q.shape[1]
    q_heads = q.view(num_heads, head_size, hidden)
    k_heads = k.view(num_kv_heads, head_size, hidden)
    v_heads = v.view(num_kv_heads, head_size, hidden)
    per_rank = num_heads // tp_size
    mine = list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    # The KV heads my query heads attend with (grouped-query attention).
    group = num_heads // num_kv_heads
    kv = sorted({h // group for h in mine})
    return torch.cat([q_heads[mine].reshape(-1, hidden), k_heads[kv].reshape(-1, hidden),
                      v_heads[kv].reshape(-1, hidden)])


@pytest.mark.parametrize("mistake, message", [
    ({"fused": True}, "split q, k and v separately"),
    ({"no_replication": True}, "replicated on"),
    ({"round_robin": True}, "round-robin"),
    ({"kv_by_rank": True}, "replicated on"),
    ({"order": "kqv"}, "the right heads in the wrong order"),
    ({"order": "qk"}, "should have shape"),
])
def test_exercise_3_rejects(mistake, message):
    with pytest.raises(AssertionError, match=message):
        day14.exercise_3(lambda *args: _qkv(*args, **mistake))


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_qkv, _qkv_alternative])
def test_exercise_3_passes(answer, capsys):
    day14.exercise_3(answer)
    assert capsys.readouterr().out == "Day 14, exercise 3: passed\n"
    assert not [a for a in ModelRegistry.registered() if a.startswith("Day14")]


def _qkv_via_a_helper(q, k, v, tp_rank, tp_size, num_heads, num_kv_heads, head_size):
    return _qkv(q, k, v, tp_rank, tp_size, num_heads, num_kv_heads, head_size)


@pytest.mark.slow
def test_exercise_3_in_the_engine_needs_a_self_contained_function():
    """Right on every made-up layout, but it calls a helper the engine's
    copy of its source does not have."""
    with pytest.raises(AssertionError, match="use only torch, F and math"):
        day14.exercise_3(_qkv_via_a_helper)


def test_exercise_3_names_a_crash_in_the_learners_code():
    def crashes(q, k, v, tp_rank, tp_size, num_heads, num_kv_heads, head_size):
        return k.split(head_size)[tp_size]  # IndexError: there are fewer KV heads than ranks

    with pytest.raises(AssertionError, match="(?s)in your `crashes`.*replicated on"):
        day14.exercise_3(lambda *a: crashes(*a) if a[6] < a[4] else _qkv(*a))


# -- exercise 4: the communication share ------------------------------------------------


def _trace() -> Trace:
    """A small 2-rank trace: a prefill, then decodes (the checker replaces the timings)."""
    def step(i, prefill):
        return {"step": i, "scheduled": [{"request_id": "0", "seq_id": 0, "is_prefill": prefill,
                                          "num_tokens": 5 if prefill else 1}],
                "timings": {"schedule_ms": 0.2, "execute_ms": 10.0 + i, "process_ms": 0.3},
                "collectives": {"calls": 17, "bytes": 1000, "ms": 1.0 + i / 2}}

    return Trace(header={"parallel_config": {"tensor_parallel_size": 2}}, requests={},
                 steps=[step(0, True)] + [step(i, False) for i in range(1, 6)])


def _share(trace, *, prefill=False, whole_step=False, compute=False, percent=False,
           mean_of_ratios=False):
    steps = [s for s in trace.steps
             if prefill or not any(e["is_prefill"] for e in s["scheduled"])]
    comm = sum(s["collectives"]["ms"] for s in steps)
    execute = sum(trace.step_ms(s) if whole_step else s["timings"]["execute_ms"] for s in steps)
    if mean_of_ratios:
        return sum(s["collectives"]["ms"] / s["timings"]["execute_ms"] for s in steps) / len(steps)
    share = comm / (execute - comm) if compute else comm / execute
    return 100 * share if percent else share


def _share_alternative(trace):
    comm = execute = 0.0
    for step in trace.steps:
        if all(not e["is_prefill"] for e in step["scheduled"]):
            comm += step["collectives"]["ms"]
            execute += step["timings"]["execute_ms"]
    return comm / execute


@pytest.mark.parametrize("mistake, message", [
    ({"prefill": True}, "you included the prefill steps"),
    ({"whole_step": True}, "not the whole step"),
    ({"compute": True}, "communication / compute"),
    ({"percent": True}, "not a percentage"),
    ({"mean_of_ratios": True}, "the mean of the steps' shares"),
])
def test_exercise_4_rejects(mistake, message):
    with pytest.raises(AssertionError, match=message):
        day14.exercise_4(lambda t: _share(t, **mistake), _trace())


@pytest.mark.parametrize("answer", [_share, _share_alternative])
def test_exercise_4_passes(answer, capsys):
    day14.exercise_4(answer, _trace())
    assert capsys.readouterr().out == "Day 14, exercise 4: passed\n"
