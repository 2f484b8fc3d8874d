"""Day 2's checkers reject every catalogued mistake with the message that
names it, and pass the solution and a differently written correct answer.

Each mistake is a flag on a copy of the solution's code (as the Day 13
tests in tests/test_labs.py do); nothing is imported from the notebooks.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tools.labs.checks import day2


def _passes(capsys, k: int) -> None:
    assert capsys.readouterr().out == f"Day 2, exercise {k}: passed\n"


# Exercise 1 -------------------------------------------------------------------


def _bytes_per_token(config, dtype_bytes, *, query_heads=False, no_kv=False, no_dtype=False,
                     one_layer=False, no_head_dim=False, strict_fields=False, no_fallback=False,
                     true_division=False, gpt2_names=False):
    num_heads = config.n_head if gpt2_names else config.num_attention_heads
    if strict_fields:
        num_kv_heads = config.num_key_value_heads
    elif no_fallback:
        num_kv_heads = getattr(config, "num_key_value_heads", None)
    else:
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if query_heads:
        num_kv_heads = num_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    if no_head_dim:
        head_size = config.hidden_size // num_heads
    if true_division:
        head_size = config.hidden_size / num_heads if not getattr(config, "head_dim", None) \
            else config.head_dim
    layers = 1 if one_layer else config.num_hidden_layers
    return ((1 if no_kv else 2) * layers * num_kv_heads * head_size
            * (1 if no_dtype else dtype_bytes))


def _bytes_per_token_other(config, dtype_bytes):
    """Correct, written otherwise: hasattr and the elements of one K and one V."""
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads if hasattr(config, "num_key_value_heads") else heads
    kv_heads = kv_heads or heads
    head_dim = config.head_dim if getattr(config, "head_dim", None) else config.hidden_size // heads
    per_layer = kv_heads * head_dim
    return config.num_hidden_layers * (per_layer + per_layer) * dtype_bytes


@pytest.mark.parametrize("mistake, message", [
    ("query_heads", "you counted the query heads"),
    ("no_kv", "both K and V are cached (the factor 2)"),
    ("no_dtype", "that is the number of elements; multiply by dtype_bytes"),
    ("one_layer", "that is one layer"),
    ("no_head_dim", "use head_dim when the config sets it"),
    ("strict_fields", "GPT-2 has no num_key_value_heads"),
    ("no_fallback", "fall back with `or`"),
    ("true_division", "use // (integer division)"),
    ("gpt2_names", "are GPT-2's own names"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day2.exercise_1(lambda c, b: _bytes_per_token(c, b, **{mistake: True}))


@pytest.mark.parametrize("answer", [_bytes_per_token, _bytes_per_token_other])
def test_exercise_1_passes(answer, capsys):
    day2.exercise_1(answer)
    _passes(capsys, 1)


# Exercise 2 -------------------------------------------------------------------


@pytest.mark.parametrize("blocks_needed, message", [
    (lambda n, b: n // b + 1, "no extra block when the last one is exactly full"),
    (lambda n, b: n // b, "a partly filled block is still a whole block"),
    (lambda n, b: round(n / b), "round up (ceiling division)"),
    (lambda n, b: (n + b) // b, "no extra block when the last one is exactly full"),
    (lambda n, b: np.ceil(n / b), "numpy's np.ceil a float"),
    (lambda n, b: max(1, -(-n // b)), "no tokens, no blocks"),
], ids=["plus_one", "floor", "round", "n_plus_b", "numpy_float", "at_least_one"])
def test_exercise_2_rejects(blocks_needed, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day2.exercise_2(blocks_needed)


@pytest.mark.parametrize("blocks_needed", [
    lambda n, b: -(-n // b),
    lambda n, b: math.ceil(n / b),
    lambda n, b: (n + b - 1) // b,
], ids=["solution", "math_ceil", "add_then_floor"])
def test_exercise_2_passes(blocks_needed, capsys):
    day2.exercise_2(blocks_needed)
    _passes(capsys, 2)


# Exercise 3 -------------------------------------------------------------------


def _kv_usage(step, block_size, max_model_len, *, all_seqs=False, num_tokens=False,
              one_block=False, blocks_not_slots=False, int_keys=False, contiguous_all=False):
    tables = step["block_tables"]
    holders = list(step["seqs"]) if all_seqs else list(tables)
    if int_keys:
        holders = [int(k) for k in holders]
    field = "num_tokens" if num_tokens else "num_computed_tokens"
    live = sum(step["seqs"][sid][field] for sid in holders)
    blocks = len(tables) if one_block else sum(len(t) for t in tables.values())
    counted = step["seqs"] if contiguous_all else tables
    return {
        "live": live,
        "paged": blocks * (1 if blocks_not_slots else block_size),
        "contiguous": len(counted) * max_model_len,
    }


def _kv_usage_other(step, block_size, max_model_len):
    """Correct, written otherwise: one pass over the block tables."""
    live = paged = 0
    for seq_id, table in step["block_tables"].items():
        live += step["seqs"][seq_id]["num_computed_tokens"]
        paged += block_size * len(table)
    return dict(paged=paged, live=live, contiguous=max_model_len * len(step["block_tables"]))


@pytest.mark.parametrize("mistake, message", [
    ("all_seqs", "you counted every sequence in step['seqs']"),
    ("num_tokens", "num_tokens is the sequence's length"),
    ("one_block", "a sequence may hold several blocks"),
    ("blocks_not_slots", "that is blocks; the answer is in token slots"),
    ("int_keys", "keyed by the sequence id as a string"),
    ("contiguous_all", "you counted every sequence in step['seqs']"),
])
def test_exercise_3_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day2.exercise_3(lambda *a: _kv_usage(*a, **{mistake: True}))


@pytest.mark.parametrize("answer", [_kv_usage, _kv_usage_other])
def test_exercise_3_passes(answer, capsys):
    day2.exercise_3(answer)
    _passes(capsys, 3)


# Exercise 4 -------------------------------------------------------------------


def _how_many_fit(budget_bytes, bytes_per_token, block_size, max_model_len, seq_lens, *,
                  uncapped=False, by_length=False, overtake=False, sort=False, strict=False,
                  tokens=False):
    slots = budget_bytes // bytes_per_token
    contiguous = slots // max_model_len
    if not uncapped:
        contiguous = min(len(seq_lens), contiguous)
    if by_length:
        contiguous, left = 0, slots
        for length in seq_lens:
            if length > left:
                break
            left -= length
            contiguous += 1
    free = budget_bytes // (bytes_per_token * block_size)
    paged = 0
    for length in sorted(seq_lens) if sort else seq_lens:
        need = length / block_size if tokens else -(-length // block_size)
        if need > free or (strict and need >= free):
            if overtake:
                continue
            break
        free -= need
        paged += 1
    return contiguous, paged


def _how_many_fit_other(budget_bytes, bytes_per_token, block_size, max_model_len, seq_lens):
    """Correct, written otherwise: running sums of the blocks needed."""
    blocks = budget_bytes // bytes_per_token // block_size
    used = 0
    paged = 0
    for length in seq_lens:
        used += math.ceil(length / block_size)
        if used > blocks:
            break
        paged += 1
    contiguous = min(budget_bytes // (bytes_per_token * max_model_len), len(seq_lens))
    return contiguous, paged


@pytest.mark.parametrize("mistake, message", [
    ("uncapped", "cap the answer with min(...)"),
    ("by_length", "that counts each sequence's own length"),
    ("overtake", "first come, first served: no overtaking"),
    ("sort", "first come, first served: no overtaking"),
    ("strict", "need > free"),
    ("tokens", "each sequence takes ceil(length / block_size) whole blocks"),
])
def test_exercise_4_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day2.exercise_4(lambda *a: _how_many_fit(*a, **{mistake: True}))


@pytest.mark.parametrize("answer", [_how_many_fit, _how_many_fit_other])
def test_exercise_4_passes(answer, capsys):
    day2.exercise_4(answer)
    _passes(capsys, 4)
