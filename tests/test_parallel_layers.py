"""Each tensor-parallel layer on 2 gloo ranks against its unsharded twin
(a plain `F.linear` / `F.embedding` on the full checkpoint tensors), and the
group's collectives. Every rank builds the same full tensors from one seed
and loads them through the layer's own `weight_loader`, as from a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minivllm.distributed import get_tensor_model_parallel_world_size, get_tp_group
from minivllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from tests.distributed_utils import run_ranks

HIDDEN, OUT, TOKENS, VOCAB, HEAD = 16, 24, 5, 100, 4


def _full(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(layer, name: str, tensor: torch.Tensor, *shard_id) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, *shard_id)


def _column_and_row(rank: int) -> dict[str, np.ndarray]:
    x = _full(TOKENS, HIDDEN, seed=1)
    w1, b1, w2, b2 = _full(OUT, HIDDEN, seed=2), _full(OUT, seed=3), _full(HIDDEN, OUT, seed=4), (
        _full(HIDDEN, seed=5))
    gathered = ColumnParallelLinear(HIDDEN, OUT, gather_output=True)
    column = ColumnParallelLinear(HIDDEN, OUT)
    row = RowParallelLinear(OUT, HIDDEN)
    row_whole_input = RowParallelLinear(OUT, HIDDEN, input_is_parallel=False)
    for layer in (gathered, column):
        _load(layer, "weight", w1)
        _load(layer, "bias", b1)
    for layer in (row, row_whole_input):
        _load(layer, "weight", w2)
        _load(layer, "bias", b2)
    mid, _ = column(x)  # this rank's columns of the hidden layer
    return {
        "shard_shape": np.array(column.weight.shape),
        "gathered": gathered(x)[0].numpy(),
        "column_then_row": row(mid)[0].numpy(),
        "row_whole_input": row_whole_input(F.linear(x, w1, b1))[0].numpy(),
    }


def _every_layer(rank: int) -> dict[str, dict]:
    """All the checks below in one world (starting one costs seconds)."""
    return {
        "column_and_row": _column_and_row(rank),
        **{f"qkv{kv}": _merged_and_qkv(rank, kv) for kv in (4, 2, 1)},
        "vocab": _vocab(rank),
        "collectives": _collectives(rank),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict]]:
    return run_ranks(_every_layer)


def test_column_and_row_parallel_linear_equal_the_unsharded_matmuls(ranks):
    x = _full(TOKENS, HIDDEN, seed=1)
    w1, b1, w2, b2 = _full(OUT, HIDDEN, seed=2), _full(OUT, seed=3), _full(HIDDEN, OUT, seed=4), (
        _full(HIDDEN, seed=5))
    hidden = F.linear(x, w1, b1)
    for rank, got in enumerate(r["column_and_row"] for r in ranks):
        assert list(got["shard_shape"]) == [OUT // 2, HIDDEN], rank
        torch.testing.assert_close(torch.from_numpy(got["gathered"]), hidden)
        # Column then row: one all-reduce, the bias added once.
        torch.testing.assert_close(torch.from_numpy(got["column_then_row"]),
                                   F.linear(hidden, w2, b2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(got["row_whole_input"]),
                                   F.linear(hidden, w2, b2), rtol=1e-5, atol=1e-5)


def _merged_and_qkv(rank: int, num_kv_heads: int) -> dict[str, np.ndarray]:
    x = _full(TOKENS, HIDDEN, seed=1)
    gate, up = _full(OUT, HIDDEN, seed=6), _full(OUT, HIDDEN, seed=7)
    merged = MergedColumnParallelLinear(HIDDEN, [OUT, OUT], bias=False)
    _load(merged, "weight", gate, 0)
    _load(merged, "weight", up, 1)
    merged_fused = MergedColumnParallelLinear(HIDDEN, [OUT, OUT], bias=False)
    _load(merged_fused, "weight", torch.cat([gate, up]), None)

    q = _full(4 * HEAD, HIDDEN, seed=8)
    k, v = _full(num_kv_heads * HEAD, HIDDEN, seed=9), _full(num_kv_heads * HEAD, HIDDEN, seed=10)
    qkv = QKVParallelLinear(HIDDEN, HEAD, 4, num_kv_heads, bias=False)
    for shard_id, part in zip("qkv", (q, k, v), strict=True):
        _load(qkv, "weight", part, shard_id)
    qkv_fused = QKVParallelLinear(HIDDEN, HEAD, 4, num_kv_heads, bias=False)
    _load(qkv_fused, "weight", torch.cat([q, k, v]), None)
    return {
        "merged": merged(x)[0].numpy(),
        "merged_fused": merged_fused(x)[0].numpy(),
        "heads": np.array([qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas]),
        "qkv": qkv(x)[0].numpy(),
        "qkv_fused": qkv_fused(x)[0].numpy(),
    }


@pytest.mark.parametrize("num_kv_heads, kv_heads_of_rank", [
    (4, [[0, 1], [2, 3]]),  # multi-head: each rank its own two KV heads
    (2, [[0], [1]]),  # grouped-query: one KV head each
    (1, [[0], [0]]),  # fewer KV heads than ranks: the one KV head on both ranks
])
def test_merged_and_qkv_parallel_linear_hold_whole_heads(ranks, num_kv_heads, kv_heads_of_rank):
    x = _full(TOKENS, HIDDEN, seed=1)
    gate, up = F.linear(x, _full(OUT, HIDDEN, seed=6)), F.linear(x, _full(OUT, HIDDEN, seed=7))
    q = F.linear(x, _full(4 * HEAD, HIDDEN, seed=8)).view(TOKENS, 4, HEAD)
    k = F.linear(x, _full(num_kv_heads * HEAD, HIDDEN, seed=9)).view(TOKENS, -1, HEAD)
    v = F.linear(x, _full(num_kv_heads * HEAD, HIDDEN, seed=10)).view(TOKENS, -1, HEAD)
    half = OUT // 2
    for rank, got in enumerate(r[f"qkv{num_kv_heads}"] for r in ranks):
        # Rank r's fused output is [gate_r, up_r]: its channels of each part.
        want = torch.cat([gate[:, rank * half:(rank + 1) * half],
                          up[:, rank * half:(rank + 1) * half]], dim=-1)
        torch.testing.assert_close(torch.from_numpy(got["merged"]), want)
        torch.testing.assert_close(torch.from_numpy(got["merged_fused"]), want)
        mine = kv_heads_of_rank[rank]
        assert list(got["heads"]) == [2, len(mine), max(1, 2 // num_kv_heads)]
        want = torch.cat([q[:, 2 * rank:2 * rank + 2].flatten(1), k[:, mine].flatten(1),
                          v[:, mine].flatten(1)], dim=-1)
        torch.testing.assert_close(torch.from_numpy(got["qkv"]), want)
        torch.testing.assert_close(torch.from_numpy(got["qkv_fused"]), want)


def _vocab(rank: int) -> dict[str, np.ndarray]:
    table = _full(VOCAB, HIDDEN, seed=11)
    ids = torch.tensor([0, 5, 63, 64, 99, 70, 1])  # both halves of the padded 128 rows
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN)
    _load(embedding, "weight", table)
    head = ParallelLMHead(VOCAB, HIDDEN)
    _load(head, "weight", table)
    logits = LogitsProcessor(VOCAB)(head, _full(3, HIDDEN, seed=12))
    biased = ParallelLMHead(VOCAB, HIDDEN, bias=True)  # the bias is sharded as the rows are
    _load(biased, "weight", table)
    _load(biased, "bias", _full(VOCAB, seed=13))
    biased_logits = LogitsProcessor(VOCAB)(biased, _full(3, HIDDEN, seed=12))
    return {
        "rows": np.array([embedding.vocab_start_index, embedding.vocab_end_index]),
        "embedded": embedding(ids).numpy(),
        "logits": None if logits is None else logits.numpy(),
        "biased_logits": None if biased_logits is None else biased_logits.numpy(),
    }


def test_vocab_parallel_embedding_and_the_head_gathered_on_the_driver(ranks):
    table = _full(VOCAB, HIDDEN, seed=11)
    ids = torch.tensor([0, 5, 63, 64, 99, 70, 1])
    ranks = [r["vocab"] for r in ranks]
    # 100 rows padded to 128: rank 0 holds 0-63, rank 1 64-127 (100-127 padding).
    assert [list(r["rows"]) for r in ranks] == [[0, 64], [64, 128]]
    for got in ranks:
        torch.testing.assert_close(torch.from_numpy(got["embedded"]), F.embedding(ids, table))
    # Only the driver gets logits, the whole vocabulary without the padding.
    torch.testing.assert_close(torch.from_numpy(ranks[0]["logits"]),
                               F.linear(_full(3, HIDDEN, seed=12), table))
    torch.testing.assert_close(torch.from_numpy(ranks[0]["biased_logits"]),
                               F.linear(_full(3, HIDDEN, seed=12), table, _full(VOCAB, seed=13)))
    assert ranks[1]["logits"] is None and ranks[1]["biased_logits"] is None


def _collectives(rank: int) -> dict:
    group = get_tp_group()
    mine = torch.full((2, 3), float(rank + 1))
    sent = {"input_ids": torch.arange(6).view(2, 3), "num_prefills": 1, "name": "step 3"}
    received = group.broadcast_tensor_dict(sent if rank == 0 else None)
    before = (group.stats.calls, group.stats.bytes)
    reduced = group.all_reduce(mine.clone()).numpy()
    return {
        "world": (get_tensor_model_parallel_world_size(), group.rank_in_group),
        "counted": (group.stats.calls - before[0], group.stats.bytes - before[1]),
        "all_reduce": reduced,
        "all_gather": group.all_gather(mine, dim=0).numpy(),
        "gather": None if (g := group.gather(mine, dst=0, dim=-1)) is None else g.numpy(),
        "dict": {k: (v.numpy() if isinstance(v, torch.Tensor) else v)
                 for k, v in received.items()},
    }


def test_collectives_of_the_tensor_parallel_group(ranks):
    ranks = [r["collectives"] for r in ranks]
    ones, twos = np.full((2, 3), 1.0), np.full((2, 3), 2.0)
    for rank, got in enumerate(ranks):
        assert got["world"] == (2, rank)
        assert got["counted"] == (1, 2 * 3 * 4)  # one call, six float32
        np.testing.assert_array_equal(got["all_reduce"], ones + twos)
        np.testing.assert_array_equal(got["all_gather"], np.concatenate([ones, twos], axis=0))
        assert got["dict"]["num_prefills"] == 1 and got["dict"]["name"] == "step 3"
        np.testing.assert_array_equal(got["dict"]["input_ids"], np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(ranks[0]["gather"], np.concatenate([ones, twos], axis=1))
    assert ranks[1]["gather"] is None


def test_without_a_process_group_every_layer_is_whole():
    """One worker (the default) creates no process group: rank 0 of 1."""
    layer = ColumnParallelLinear(HIDDEN, OUT)
    assert (layer.tp_rank, layer.tp_size, tuple(layer.weight.shape)) == (0, 1, (OUT, HIDDEN))
    assert get_tp_group().all_reduce(x := torch.ones(2)) is x
