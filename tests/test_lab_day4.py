"""Day 4's checkers reject every catalogued mistake with the message that
names it, and pass the solution and a differently written correct answer.

Each mistake is a flag on a copy of the lab's solution (lessons/INSTRUCTOR.md,
Day 4, lists them); the test asserts the checker's AssertionError names it.
"""

from __future__ import annotations

import re

import pytest
import torch

from minivllm.attention.backends.abstract import AttentionImpl
from minivllm.attention.backends.torch_paged import TorchPagedAttention
from tools.labs.checks import day4

# Exercise 1: slot_mapping --------------------------------------------------------


def _slots(table, context_len, seq_len, block_size, *, from_zero=False, by_position=False,
           logical=False, no_multiply=False, one_more=False, none=False):
    if none:
        return None
    start, end = (0, seq_len - context_len) if from_zero else (context_len, seq_len)
    out = []
    for p in range(start, end + one_more):
        block = p if by_position else p // block_size
        number = block if logical else table[block]
        out.append(number + p % block_size if no_multiply else number * block_size + p % block_size)
    return out


def _slots_other(table, context_len, seq_len, block_size):
    """Correct, written otherwise: tensors, divmod."""
    positions = torch.arange(context_len, seq_len)
    blocks, rows = positions // block_size, positions % block_size
    return torch.tensor(table)[blocks] * block_size + rows


@pytest.mark.parametrize("mistake, message", [
    ("from_zero", "the new tokens sit at positions context_len..seq_len - 1"),
    ("by_position", "you looked up block_table[p]"),
    ("logical", "you used the logical block number"),
    ("no_multiply", "must be multiplied by block_size"),
    ("one_more", "one slot per position from context_len"),
    ("none", "returned None"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day4.exercise_1(lambda *a: _slots(*a, **{mistake: True}))


def test_exercise_1_turns_an_index_error_into_a_hint():
    def crashes(table, context_len, seq_len, block_size):
        return [table[p] * block_size + p % block_size for p in range(context_len, seq_len)]

    message = r"raised IndexError(.|\n)*the line `return \[table\[p\](.|\n)*one entry per \*block"
    with pytest.raises(AssertionError, match=message):
        day4.exercise_1(lambda t, c, s, b: crashes(t, c, s + 8, b))


@pytest.mark.parametrize("answer", [_slots, _slots_other], ids=["solution", "other"])
def test_exercise_1_passes(answer, capsys):
    day4.exercise_1(answer)
    assert capsys.readouterr().out == "Day 4, exercise 1: passed\n"


# Exercise 2: gather_kv -----------------------------------------------------------


def _gather(kv_cache, block_table, seq_len, *, wrong_axis=False, no_cut=False, swapped=False,
            logical=False, no_flatten=False, one_tensor=False):
    if logical:
        block_table = torch.arange(len(block_table))
    blocks = kv_cache[block_table] if wrong_axis else kv_cache[:, block_table]
    if no_flatten:
        return blocks[0], blocks[1]
    tokens = blocks.flatten(1, 2)
    keys, values = (tokens[0], tokens[1]) if no_cut else (tokens[0, :seq_len], tokens[1, :seq_len])
    if one_tensor:
        return keys
    return (values, keys) if swapped else (keys, values)


def _gather_other(kv_cache, block_table, seq_len):
    """Correct, written otherwise: slot by slot."""
    _, num_blocks, block_size, kv_heads, head = kv_cache.shape
    flat = kv_cache.reshape(2, num_blocks * block_size, kv_heads, head)
    slots = [int(block_table[p // block_size]) * block_size + p % block_size
             for p in range(seq_len)]
    return flat[0, slots], flat[1, slots]


@pytest.mark.parametrize("mistake, message", [
    ("wrong_axis", "kv_cache's first axis is K/V (size 2)"),
    ("no_cut", "You kept all 12 rows of the blocks"),
    ("swapped", "your keys and values are swapped"),
    ("logical", "the logical block numbers"),
    ("no_flatten", "You did not flatten (block, row)"),
    ("one_tensor", "return two tensors"),
])
def test_exercise_2_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day4.exercise_2(lambda *a: _gather(*a, **{mistake: True}))


@pytest.mark.parametrize("answer", [_gather, _gather_other], ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day4.exercise_2(answer)
    assert capsys.readouterr().out == "Day 4, exercise 2: passed\n"


# Exercise 3: paged_decode --------------------------------------------------------


def _decode(query, kv_cache, block_tables, seq_lens, scale, *, no_scale=False, minus_one=False,
            round_robin=False, nan_values=False, no_return=False):
    num_seqs, num_heads, head_size = query.shape
    group = num_heads // kv_cache.shape[3]
    out = torch.empty_like(query)
    if nan_values:  # batched: scores masked, padded values multiplied in
        keys = kv_cache[0][block_tables].flatten(1, 2).repeat_interleave(group, dim=2)
        values = kv_cache[1][block_tables].flatten(1, 2).repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,bshd->bhs", query, keys) * scale
        beyond = torch.arange(keys.shape[1])[None, :] >= seq_lens[:, None]
        scores = scores.masked_fill(beyond[:, None, :], float("-inf"))
        return torch.einsum("bhs,bshd->bhd", torch.softmax(scores, -1), values)
    for i in range(num_seqs):
        n = int(seq_lens[i]) - minus_one
        k, v = _gather(kv_cache, block_tables[i], n)
        repeat = (lambda t: t.repeat(1, group, 1)) if round_robin else (
            lambda t: t.repeat_interleave(group, dim=1))
        k, v = repeat(k), repeat(v)
        scores = torch.einsum("hd,shd->hs", query[i], k) * (1.0 if no_scale else scale)
        out[i] = torch.einsum("hs,shd->hd", torch.softmax(scores, -1), v)
    return None if no_return else out


def _decode_other(query, kv_cache, block_tables, seq_lens, scale):
    """Correct, written otherwise: expand the KV heads with a view, SDPA per sequence."""
    num_seqs, num_heads, _ = query.shape
    kv_heads = kv_cache.shape[3]
    rows = []
    for i in range(num_seqs):
        k, v = _gather_other(kv_cache, block_tables[i], int(seq_lens[i]))
        group = num_heads // kv_heads
        k = k[:, :, None].expand(-1, -1, group, -1).reshape(k.shape[0], num_heads, -1)
        v = v[:, :, None].expand(-1, -1, group, -1).reshape(v.shape[0], num_heads, -1)
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            query[i][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale)[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("mistake, message", [
    ("no_scale", "you did not multiply the scores by `scale`"),
    ("minus_one", "you attended to seq_len - 1 keys"),
    ("round_robin", "(round-robin, `.repeat`)"),
    ("nan_values", "0 * NaN is NaN"),
    ("no_return", "returned NoneType, not a tensor"),
])
def test_exercise_3_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day4.exercise_3(lambda *a: _decode(*a, **{mistake: True}))


@pytest.mark.parametrize("answer", [_decode, _decode_other], ids=["solution", "other"])
def test_exercise_3_passes(answer, capsys):
    day4.exercise_3(answer)
    assert capsys.readouterr().out == "Day 4, exercise 3: passed\n"


# Exercise 4: the backend inside the engine ----------------------------------------


def _backend(*, no_return=False, no_scale=False, flat=False, first_only=False,
             args_swapped=False, transposed=False, longest=False, nan_values=False):
    class MyPagedAttention(TorchPagedAttention):
        def forward_decode(self, query, kv_cache, block_tables, seq_lens, max_seq_len):
            scale = 1.0 if no_scale else self.scale
            if longest:  # every sequence attends to max_seq_len keys
                seq_lens = torch.full_like(seq_lens, max_seq_len)
            if args_swapped:
                out = _decode(query, block_tables, kv_cache, seq_lens, scale)
            else:
                out = _decode(query, kv_cache, block_tables, seq_lens, scale, nan_values=nan_values)
            if no_return:
                return None
            if flat:
                return out.flatten(1)
            if transposed:
                return out.transpose(1, 2)
            return out[:1] if first_only else out

    return MyPagedAttention


class _OtherBackend(TorchPagedAttention):
    """Correct, written otherwise: the other decode, written through forward_decode's names."""

    def forward_decode(self, query, kv_cache, block_tables, seq_lens, max_seq_len):
        return _decode_other(query, kv_cache, block_tables, seq_lens, self.scale)


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("no_return", "forward_decode returned None"),
    ("no_scale", "use self.scale"),
    ("flat", "returned shape [3, 192] for a query of shape [3, 6, 32]"),
    ("first_only", "returned shape [1, 6, 32] for a query of shape [3, 6, 32]"),
    ("transposed", "the output must be [num_decodes, num_heads, head_size]"),
    ("args_swapped", "pass them to paged_decode in that order"),
    ("longest", "read keys or values past a sequence's length (the rest of its last block"),
    ("longest", "you attended to max_seq_len = "),
    ("nan_values", "multiplied their values by the zero weight: 0 * NaN is NaN"),
])
def test_exercise_4_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day4.exercise_4(_backend(**{mistake: True}))


def test_exercise_4_rejects_an_instance_and_classes_missing_a_half():
    with pytest.raises(AssertionError, match=re.escape("pass the class itself")):
        day4.exercise_4(_backend()(6, 8, 1.0, 2))

    class OnlyForward(TorchPagedAttention):
        def forward(self, *args):
            return super().forward(*args)

    with pytest.raises(AssertionError, match="does not override forward_decode"):
        day4.exercise_4(OnlyForward)

    class OnlyDecode(AttentionImpl):
        forward_decode = _backend().forward_decode

    with pytest.raises(AssertionError, match=re.escape("subclass TorchPagedAttention (not")):
        day4.exercise_4(OnlyDecode)


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_backend(), _OtherBackend], ids=["solution", "other"])
def test_exercise_4_passes(answer, capsys):
    day4.exercise_4(answer)
    assert capsys.readouterr().out == "Day 4, exercise 4: passed\n"


# Exercise 5: one step's flat batch ------------------------------------------------


def _flatten(seq_group_metadata_list, block_size, *, from_zero=False, decode_len=False,
             by_position=False, first_token=False, whole_prompt=False, decodes_first=False,
             first_seq_only=False, none=False):
    if none:
        return None
    metas = seq_group_metadata_list
    if decodes_first:
        metas = [m for m in metas if not m.is_prompt] + [m for m in metas if m.is_prompt]
    input_ids, positions, slots = [], [], []
    for meta in metas:
        seqs = list(meta.seq_data.items())
        for seq_id, data in seqs[:1] if first_seq_only else seqs:
            table = meta.block_tables[seq_id]
            if meta.is_prompt:
                start = 0 if from_zero else data.num_computed_tokens
                end = data.get_len() if whole_prompt else start + meta.token_chunk_size
                input_ids += data.get_token_ids()[start:end]
            else:
                start = data.get_len() - (0 if decode_len else 1)
                end = start + 1
                last = data.prompt_token_ids[-1] if first_token else data.get_last_token_id()
                input_ids.append(last)
            positions += range(start, end)
            slots += _slots(table, start, end, block_size, by_position=by_position)
    return input_ids, positions, slots


def _flatten_other(seq_group_metadata_list, block_size):
    """Correct, written otherwise: token by token, the decode's token by name."""
    rows = []
    for meta in seq_group_metadata_list:
        for seq_id in meta.seq_data:
            data, table = meta.seq_data[seq_id], meta.block_tables[seq_id]
            for j in range(meta.token_chunk_size):
                p = data.num_computed_tokens + j
                token = data.get_token_ids()[p] if meta.is_prompt else data.get_last_token_id()
                block, row = divmod(p, block_size)
                rows.append((token, p, table[block] * block_size + row))
    return tuple(list(column) for column in zip(*rows, strict=True))


@pytest.mark.parametrize("mistake, message", [
    ("from_zero", "your positions of the prefill chunk start at 0"),
    ("decode_len", "a decode's position is its length minus one"),
    ("by_position", "A block table has one entry per block"),
    ("first_token", "a decode's input is its last token"),
    ("whole_prompt", "each prefill chunk brings token_chunk_size tokens"),
    ("decodes_first", "prefills first, then decodes"),
    ("first_seq_only", "you flattened one sequence per group: request P (n=2)"),
    ("none", "returned None"),
])
def test_exercise_5_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day4.exercise_5(lambda *a: _flatten(*a, **{mistake: True}))


@pytest.mark.parametrize("answer", [_flatten, _flatten_other], ids=["solution", "other"])
def test_exercise_5_passes(answer, capsys):
    day4.exercise_5(answer)
    assert capsys.readouterr().out == "Day 4, exercise 5: passed\n"


def test_exercise_5_runs_a_chunk_that_does_not_start_at_0_beside_decodes():
    step = day4.mixed_step()
    assert step.batch.context_lens[0] > 0 and len(step.batch.seq_ids) > step.batch.num_prefills


def test_exercise_5_runs_a_group_of_two_sequences_with_their_own_tables():
    groups = [meta for step in day4.mixed_run() for meta in step.seq_group_metadata_list
              if len(meta.seq_data) == 2]
    assert any(len({tuple(t) for t in meta.block_tables.values()}) == 2 for meta in groups)


# Part 6: the kernel's parameters against the decode path's launch -------------------


def test_every_kernel_parameter_gets_one_launch_argument_of_its_kind():
    launch = day4.decode_launch()
    params = day4.kernel_parameters("paged_attention_v1_kernel")
    assert len(params) == len(launch.args)
    for (decl, _), arg in zip(params, launch.args, strict=True):
        assert ("*" in decl) == isinstance(arg, torch.Tensor), decl
    assert launch.grid == (4, 3)
