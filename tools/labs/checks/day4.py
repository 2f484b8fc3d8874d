"""Checkers for Day 4, PagedAttention in PyTorch (labs/day4_paged_attention.ipynb).

Exercises 1-3 are checked against plain references on fixed inputs: slots
by the formula of `minivllm/attention/kv_cache.py`, attention by ordinary
contiguous attention (`torch.nn.functional.scaled_dot_product_attention`).
Exercise 4 runs the learner's backend class inside the real engine
(`LLM(model, attention_backend=TheirClass)`) and compares greedy tokens
with the reference backend. A NotImplementedError propagates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.assets import DEFAULT_MODEL
from minivllm.attention.backends.torch_paged import TorchPagedAttention
from tools.labs.checks._common import needs, passed

__all__ = ["exercise_1", "exercise_2", "exercise_3", "exercise_4", "needs"]

BLOCK_SIZE = 4
NUM_BLOCKS = 12
NUM_KV_HEADS, NUM_HEADS, HEAD_SIZE = 2, 6, 8  # GQA: 3 query heads per KV head
DAY = 4


def reference_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def random_cache(seed: int = 0, poison: bool = True) -> torch.Tensor:
    """A KV cache [2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE] of random
    values; with `poison`, block 0 (never in a table below) is all NaN."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=g)
    if poison:
        cache[:, 0] = float("nan")
    return cache


# Sequences over the pool above: scattered blocks, lengths that end inside a
# block and on a block boundary. Block 0 pads the tables and holds NaN.
TABLES = [[7, 2, 9], [4], [11, 3, 5, 8], [6, 10]]
SEQ_LENS = [10, 3, 16, 5]


def padded_tables() -> torch.Tensor:
    width = max(len(t) for t in TABLES)
    return torch.tensor([t + [0] * (width - len(t)) for t in TABLES], dtype=torch.long)


def contiguous_kv(cache: torch.Tensor, table: list[int], seq_len: int):
    """The sequence's keys and values [seq_len, kv_heads, head], slot by slot."""
    slots = torch.tensor(reference_slots(table, 0, seq_len, BLOCK_SIZE))
    flat = cache.view(2, NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    return flat[0, slots], flat[1, slots]


def reference_decode(query, cache, scale):
    """Per sequence: one query row attends to all its keys, contiguous SDPA."""
    out = []
    for i, (table, seq_len) in enumerate(zip(TABLES, SEQ_LENS, strict=True)):
        k, v = contiguous_kv(cache, table, seq_len)
        group = NUM_HEADS // NUM_KV_HEADS
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, head]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[i][:, None, :]  # [heads, 1, head]
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(out)  # [num_seqs, heads, head]


# Exercise 1 ------------------------------------------------------------------


def exercise_1(slot_mapping) -> None:
    cases = [
        ([5], 0, 5, 16, "a 5-token prompt in block 5"),
        ([5, 2], 0, 20, 16, "a 20-token prompt in blocks 5, 2"),
        ([5, 2], 16, 17, 16, "the decode of position 16: the first token of the 2nd block"),
        ([5, 2], 15, 16, 16, "the decode of position 15: the last row of the 1st block"),
        ([3, 0, 7, 1], 0, 13, 4, "13 tokens in blocks of 4"),
        ([3, 0, 7, 1], 8, 13, 4, "a chunk (positions 8-12) after 8 cached tokens"),
    ]
    for table, start, end, block_size, what in cases:
        expected = reference_slots(table, start, end, block_size)
        got = [int(s) for s in slot_mapping(table, start, end, block_size)]
        if got != expected:
            raise AssertionError(
                f"{what}: block_table={table}, positions {start}..{end - 1}, block_size="
                f"{block_size}: expected slots {expected}, got {got}. Position p lives in the "
                "block block_table[p // block_size], at row p % block_size of it, so its slot is "
                "block_table[p // block_size] * block_size + p % block_size; one slot per new "
                "position, from the context length up to (not including) the sequence length."
            )
    passed(DAY, 1)


# Exercise 2 ------------------------------------------------------------------


def exercise_2(gather_kv) -> None:
    cache = random_cache(seed=1, poison=False)
    for table, seq_len in zip(TABLES, SEQ_LENS, strict=True):
        k_ref, v_ref = contiguous_kv(cache, table, seq_len)
        keys, values = gather_kv(cache, torch.tensor(table), seq_len)
        for name, got, ref in (("keys", keys, k_ref), ("values", values, v_ref)):
            if tuple(got.shape) != tuple(ref.shape):
                raise AssertionError(
                    f"block_table={table}, seq_len={seq_len}: {name} should have shape "
                    f"[seq_len, num_kv_heads, head_size] = {list(ref.shape)}, got "
                    f"{list(got.shape)}. Gather whole blocks, flatten (block, row) into one token "
                    "axis, then keep the first seq_len tokens: the rest of the last block is not "
                    "this sequence's."
                )
            if not torch.equal(got, ref):
                bad = (got != ref).flatten(1).any(1).nonzero().flatten().tolist()
                raise AssertionError(
                    f"block_table={table}, seq_len={seq_len}: {name} of tokens {bad[:6]} differ "
                    f"from the cache's. Token t is in block block_table[t // {BLOCK_SIZE}], row "
                    f"t % {BLOCK_SIZE}; kv_cache[0] holds keys and kv_cache[1] values."
                )
    passed(DAY, 2)


# Exercise 3 ------------------------------------------------------------------


def exercise_3(paged_decode) -> None:
    scale = HEAD_SIZE**-0.5
    for seed in (2, 3):
        cache = random_cache(seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        query = torch.randn(len(TABLES), NUM_HEADS, HEAD_SIZE, generator=g)
        expected = reference_decode(query, cache, scale)
        seq_lens = torch.tensor(SEQ_LENS)
        got = paged_decode(query, cache, padded_tables(), seq_lens, scale)
        if tuple(got.shape) != tuple(expected.shape):
            raise AssertionError(
                f"the output should be [num_seqs, num_heads, head_size] = {list(expected.shape)}, "
                f"got {list(got.shape)}"
            )
        if torch.isnan(got).any():
            seqs = torch.isnan(got).flatten(1).any(1).nonzero().flatten().tolist()
            raise AssertionError(
                f"NaN in the output of sequences {seqs}. Padding entries of the block tables "
                "point at block 0, which holds NaN here (a real cache holds stale data there): "
                "mask scores at positions >= seq_len with -inf *and* make sure the values at "
                "those positions are not multiplied in (0 * NaN is NaN): zero them, or slice "
                "each sequence to its length."
            )
        err = (got - expected).abs().max().item()
        if err > 1e-4:
            worst = (got - expected).abs().flatten(1).max(1).values
            seq = int(worst.argmax())
            raise AssertionError(
                f"the output differs from contiguous attention by up to {err:.3g} (sequence "
                f"{seq}, seq_len {SEQ_LENS[seq]}, block table {TABLES[seq]}). Check: the scale; "
                "the softmax over the key axis; that all seq_len keys are used (the query's own "
                "token is the last of them) and positions >= seq_len masked; and GQA: "
                f"query head h uses KV head h // {NUM_HEADS // NUM_KV_HEADS} "
                "(heads grouped in order, not round-robin)."
            )
    passed(DAY, 3)


# Exercise 4 ------------------------------------------------------------------

PROMPTS = ["Once upon a time", "The little dog", "One day, a girl named Mia went to the park and"]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
_reference_tokens: list[list[int]] | None = None


def _tokens(backend, **kwargs) -> list[list[int]]:
    llm = LLM(DEFAULT_MODEL, attention_backend=backend, **kwargs)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def exercise_4(backend_cls) -> None:
    global _reference_tokens
    if not isinstance(backend_cls, type):
        raise AssertionError(
            f"pass the class itself (attention_backend=MyAttention), not {backend_cls!r}"
        )
    if getattr(backend_cls, "forward_decode", None) is TorchPagedAttention.forward_decode:
        raise AssertionError(
            f"{backend_cls.__name__} does not override forward_decode: the engine would run the "
            "reference's decode, not yours. Define forward_decode(self, query, kv_cache, "
            "block_tables, seq_lens, max_seq_len) and call your paged decode there."
        )
    calls = {"decode": 0}
    backend = backend_cls
    if hasattr(backend_cls, "forward_decode"):
        original = backend_cls.forward_decode

        class Counting(backend_cls):  # counts the learner's decodes, changes nothing
            def forward_decode(self, *args, **kwargs):
                calls["decode"] += 1
                return original(self, *args, **kwargs)

        Counting.__name__ = backend_cls.__name__
        backend = Counting
    else:
        calls["decode"] = None  # a class with its own forward: nothing to count
    if _reference_tokens is None:
        _reference_tokens = _tokens("torch", num_gpu_blocks_override=16)
    # A small cache (16 blocks of 16 tokens), so that tables are short and reused.
    got = _tokens(backend, num_gpu_blocks_override=16)
    if calls["decode"] == 0:
        raise AssertionError(
            f"{backend_cls.__name__}.forward_decode was never called by the engine"
        )
    for prompt, ref, mine in zip(PROMPTS, _reference_tokens, got, strict=True):
        if ref != mine:
            i = next(i for i, (a, b) in enumerate(zip(ref, mine, strict=False)) if a != b)
            raise AssertionError(
                f"prompt {prompt!r}: greedy tokens differ from the reference backend at output "
                f"token {i} (reference {ref[i]}, yours {mine[i]}); token 0 comes from the prefill, "
                "so a difference from token 1 on points at your decode. Inside the engine, "
                "block_tables is padded with block 0 and seq_lens is a tensor; the query is "
                "[num_decodes, num_heads, head_size] and the output must be the same shape "
                "and dtype."
            )
    passed(DAY, 4)
