"""Checkers for Day 4, PagedAttention in PyTorch (labs/day4_paged_attention.ipynb).

Exercises 1-3 are checked against plain references on fixed inputs: slots
by the formula of `minivllm/attention/kv_cache.py`, attention by ordinary
contiguous attention (`torch.nn.functional.scaled_dot_product_attention`).
Exercise 4 runs the learner's backend class inside the real engine
(`LLM(model, attention_backend=TheirClass)`), on a KV cache filled with NaN
so that reading past a sequence's length shows, and compares greedy tokens
with the reference backend. Exercise 5 flattens the batches that a
chunked-prefill engine really ran (one request forks into n=2 sequences)
and compares them with the engine's own `FlatBatch`. When an answer is
wrong, the checker tries the common mistakes and names the one the answer
matches. An unfinished exercise's NotImplementedError propagates; any other
exception from the learner's code becomes an AssertionError saying where it
was raised and what likely caused it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm import LLM, EngineArgs, LLMEngine, SamplingParams
from minivllm import _custom_ops as ops
from minivllm.assets import DEFAULT_MODEL
from minivllm.attention.backends.abstract import AttentionImpl
from minivllm.attention.backends.cuda_paged import CudaPagedAttention
from minivllm.attention.backends.torch_paged import TorchPagedAttention
from minivllm.sequence import SequenceData, SequenceGroupMetadata
from minivllm.worker.model_runner import FlatBatch
from tools.labs.checks._common import needs, passed
from tools.labs.checks._engine_runs import learner_code, quiet_engine, token_prompts

__all__ = ["decode_launch", "describe_argument", "exercise_1", "exercise_2", "exercise_3",
           "exercise_4", "exercise_5", "kernel_parameters", "mixed_step", "needs"]

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


def reference_decode(query, cache, scale, seq_lens=SEQ_LENS, round_robin=False):
    """Per sequence: one query row attends to all its keys, contiguous SDPA.
    `round_robin` pairs query head h with KV head h % num_kv_heads, a common
    mistake the checker recognises."""
    out = []
    group = NUM_HEADS // NUM_KV_HEADS
    for i, (table, seq_len) in enumerate(zip(TABLES, seq_lens, strict=True)):
        k, v = contiguous_kv(cache, table, seq_len)
        if round_robin:
            k, v = k.repeat(1, group, 1), v.repeat(1, group, 1)
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = query[i][:, None, :]  # [heads, 1, head]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [heads, seq_len, head]
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(out)  # [num_seqs, heads, head]


def _index_hint(error: BaseException) -> str:
    """An index out of range is usually a position used where a block number belongs."""
    if isinstance(error, IndexError):
        return (
            "an index ran past the end of a block table. The table has one entry per *block*, "
            "not per position: position p is in block_table[p // block_size]."
        )
    return "print the shapes and values you index with, for the first failing case."


# Exercise 1 ------------------------------------------------------------------


def _slot_mistake(table: list[int], start: int, end: int, block_size: int, got: list[int]) -> str:
    """The common mistake whose slots are `got`, said for the learner, or ''."""
    n = end - start
    if len(got) != n:
        return (
            f"you returned {len(got)} slots for {n} new positions: one slot per position "
            f"from context_len ({start}) up to but not including seq_len ({end})."
        )
    if got == reference_slots(table, 0, n, block_size) and start:
        return (
            f"these are the slots of positions 0..{n - 1}: the new tokens sit at positions "
            f"context_len..seq_len - 1 = {start}..{end - 1}, after the cached ones."
        )
    if got == list(range(start, end)):
        return (
            "each slot equals its position: you used the logical block number p // block_size; "
            "the physical one is block_table[p // block_size]."
        )
    if got == [table[p // block_size] + p % block_size for p in range(start, end)]:
        return "the block number must be multiplied by block_size: a block holds block_size slots."
    if all(p < len(table) for p in range(start, end)) and got == [
        table[p] * block_size + p % block_size for p in range(start, end)
    ]:
        return (
            "you looked up block_table[p]; the table has one entry per block, so position p "
            "is in block_table[p // block_size]."
        )
    return ""


def exercise_1(slot_mapping) -> None:
    cases = [
        ([3, 0, 7, 1], 0, 3, 4, "3 tokens in the first block of 4"),
        ([5], 0, 5, 16, "a 5-token prompt in block 5"),
        ([5, 2], 0, 20, 16, "a 20-token prompt in blocks 5, 2"),
        ([5, 2], 16, 17, 16, "the decode of position 16: the first token of the 2nd block"),
        ([5, 2], 15, 16, 16, "the decode of position 15: the last row of the 1st block"),
        ([3, 0, 7, 1], 0, 13, 4, "13 tokens in blocks of 4"),
        ([3, 0, 7, 1], 8, 13, 4, "a chunk (positions 8-12) after 8 cached tokens"),
    ]
    for table, start, end, block_size, what in cases:
        expected = reference_slots(table, start, end, block_size)
        with learner_code(f"your slot_mapping, on {what},", _index_hint):
            result = slot_mapping(table, start, end, block_size)
        assert result is not None, "your slot_mapping returned None: return the list of slots."
        with learner_code("the value your slot_mapping returned",
                          "return a flat list of ints, one slot per new position."):
            got = [int(s) for s in result]
        if got != expected:
            closer = _slot_mistake(table, start, end, block_size, got)
            raise AssertionError(
                f"{what}: block_table={table}, positions {start}..{end - 1}, block_size="
                f"{block_size}: expected slots {expected}, got {got}.\n"
                + (f"It looks like {closer}\n" if closer else "")
                + "Position p lives in the block block_table[p // block_size], at row "
                "p % block_size of it, so its slot is block_table[p // block_size] * block_size "
                "+ p % block_size (lesson section 2; `FlatBatch.build` in "
                "reference_impl/minivllm/worker/model_runner.py)."
            )
    passed(DAY, 1)


# Exercise 2 ------------------------------------------------------------------


def _gather_hint(error: BaseException) -> str:
    if isinstance(error, IndexError) and "dimension 0 with size 2" in str(error):
        return (
            "kv_cache's first axis is K/V (size 2), not blocks: `kv_cache[block_table]` indexes "
            "it with block numbers. Index the block axis: kv_cache[:, block_table], or "
            "kv_cache[0][block_table] for the keys."
        )
    if isinstance(error, (TypeError, ValueError)) and "unpack" in str(error):
        return "return two tensors, keys and values: `return keys, values`."
    return "print the shape after each step: [2, n, block_size, kv_heads, head] after the gather."


def _gather_mistake(cache, table: list[int], seq_len: int, name: str, got) -> str:
    """The common mistake whose `name` tensor is `got`, or ''."""
    k, v = contiguous_kv(cache, table, seq_len)
    other = v if name == "keys" else k
    if got.shape == other.shape and torch.equal(got, other):
        return "your keys and values are swapped: kv_cache[0] holds keys, kv_cache[1] values."
    logical = list(range(len(table)))
    if logical != table:
        lk, lv = contiguous_kv(cache, logical, seq_len)
        if torch.equal(got, lk if name == "keys" else lv):
            return (
                f"you read blocks {logical}, the logical block numbers, instead of the "
                f"physical ones in the table, {table}."
            )
    return ""


def exercise_2(gather_kv) -> None:
    cache = random_cache(seed=1, poison=False)
    for table, seq_len in zip(TABLES, SEQ_LENS, strict=True):
        k_ref, v_ref = contiguous_kv(cache, table, seq_len)
        with learner_code(f"your gather_kv, for block_table={table}, seq_len={seq_len},",
                          _gather_hint):
            keys, values = gather_kv(cache, torch.tensor(table), seq_len)
        for name, got, ref in (("keys", keys, k_ref), ("values", values, v_ref)):
            if tuple(got.shape) != tuple(ref.shape):
                whole = len(table) * BLOCK_SIZE
                closer = (
                    f"\nYou kept all {whole} rows of the blocks: cut to the first seq_len."
                    if got.shape[0] == whole else
                    "\nYou did not flatten (block, row) into one token axis." if got.dim() == 4
                    else ""
                )
                raise AssertionError(
                    f"block_table={table}, seq_len={seq_len}: {name} should have shape "
                    f"[seq_len, num_kv_heads, head_size] = {list(ref.shape)}, got "
                    f"{list(got.shape)}.{closer}\nGather whole blocks, flatten (block, row) into "
                    "one token axis, then keep the first seq_len tokens: the rest of the last "
                    "block is not this sequence's."
                )
            if not torch.equal(got, ref):
                bad = (got != ref).flatten(1).any(1).nonzero().flatten().tolist()
                closer = _gather_mistake(cache, table, seq_len, name, got)
                raise AssertionError(
                    f"block_table={table}, seq_len={seq_len}: {name} of tokens {bad[:6]} differ "
                    f"from the cache's.\n" + (f"It looks like {closer}\n" if closer else "")
                    + f"Token t is in block block_table[t // {BLOCK_SIZE}], row "
                    f"t % {BLOCK_SIZE}; kv_cache[0] holds keys and kv_cache[1] values "
                    "(`gather_kv` in reference_impl/minivllm/attention/kv_cache.py)."
                )
    passed(DAY, 2)


# Exercise 3 ------------------------------------------------------------------


def _decode_mistake(got, query, cache, scale) -> str:
    """The common mistake that `got` matches, or ''."""
    variants = [
        (reference_decode(query, cache, 1.0), "you did not multiply the scores by `scale`."),
        (reference_decode(query, cache, scale, [n - 1 for n in SEQ_LENS]),
         "you attended to seq_len - 1 keys: the query's own token is the last of its seq_len "
         "keys (its K/V were written before attention ran)."),
        (reference_decode(query, cache, scale, round_robin=True),
         f"you paired query head h with KV head h % {NUM_KV_HEADS} (round-robin, "
         f"`.repeat`); heads are grouped: query head h uses KV head h // "
         f"{NUM_HEADS // NUM_KV_HEADS} (`.repeat_interleave`)."),
    ]
    for want, said in variants:
        if (got - want).abs().max().item() < 1e-4:
            return said
    return ""


def exercise_3(paged_decode) -> None:
    scale = HEAD_SIZE**-0.5
    for seed in (2, 3):
        cache = random_cache(seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        query = torch.randn(len(TABLES), NUM_HEADS, HEAD_SIZE, generator=g)
        expected = reference_decode(query, cache, scale)
        seq_lens = torch.tensor(SEQ_LENS)
        with learner_code("your paged_decode", "print the shapes of the query, keys and values "
                          "you multiply: [num_heads, head_size] and [seq_len, num_heads, "
                          "head_size] once the KV heads are repeated for their group."):
            got = paged_decode(query, cache, padded_tables(), seq_lens, scale)
        assert isinstance(got, torch.Tensor), (
            f"your paged_decode returned {type(got).__name__}, not a tensor: return `out`."
        )
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
            closer = _decode_mistake(got, query, cache, scale)
            raise AssertionError(
                f"the output differs from contiguous attention by up to {err:.3g} (sequence "
                f"{seq}, seq_len {SEQ_LENS[seq]}, block table {TABLES[seq]}).\n"
                + (f"It looks like {closer}\n" if closer else "")
                + "Check: the scale; the softmax over the key axis; that all seq_len keys are "
                "used (the query's own token is the last of them) and positions >= seq_len "
                f"masked; and GQA: query head h uses KV head h // {NUM_HEADS // NUM_KV_HEADS} "
                "(heads grouped in order, not round-robin). Lesson section 3."
            )
    passed(DAY, 3)


# Exercise 4 ------------------------------------------------------------------

PROMPTS = ["Once upon a time", "The little dog", "One day, a girl named Mia went to the park and"]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
_reference_tokens: list[list[int]] | None = None


def _tokens(backend, **kwargs) -> list[list[int]]:
    """Greedy tokens of PROMPTS on a cache filled with NaN first: a fresh
    cache's unwritten slots would hold zeros, which a decode reading past a
    sequence's length barely notices; NaN is stale data it cannot miss."""
    llm = LLM(DEFAULT_MODEL, attention_backend=backend, **kwargs)
    for cache in llm.llm_engine.model_executor.driver_worker.gpu_cache:
        cache.fill_(float("nan"))
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _check_decode_output(name: str, out, query: torch.Tensor) -> None:
    """What the engine needs back from forward_decode, checked before the
    engine copies it into the layer's output (where a wrong shape would
    either broadcast silently or fail deep in the model)."""
    if out is None:
        raise AssertionError(
            f"your {name}.forward_decode returned None: return the attention output "
            "(`return paged_decode(...)`)."
        )
    if not isinstance(out, torch.Tensor):
        raise AssertionError(
            f"your {name}.forward_decode returned a {type(out).__name__}; the engine needs a "
            f"tensor [num_decodes, num_heads, head_size] = {list(query.shape)}."
        )
    if out.shape != query.shape:
        raise AssertionError(
            f"your {name}.forward_decode returned shape {list(out.shape)} for a query of shape "
            f"{list(query.shape)}: the output must be [num_decodes, num_heads, head_size], the "
            "query's shape, one row per decoding sequence (the engine copies it into the "
            "decode rows of the layer's output, `AttentionImpl.forward` in "
            "reference_impl/minivllm/attention/backends/abstract.py)."
        )
    if out.dtype != query.dtype:
        raise AssertionError(
            f"your {name}.forward_decode returned {out.dtype} for a {query.dtype} query: "
            "compute in float32 if you like, but cast the result back (`.to(query.dtype)`)."
        )


def _nan_message(name: str, impl, decode, out, query, kv_cache, block_tables, seq_lens,
                 max_seq_len) -> str:
    """What a NaN from the learner's decode means: it read slots no token was
    written to. Their decode is rerun with those slots zeroed to tell which
    read: keys past seq_len, or masked values multiplied in."""
    seqs = torch.isnan(out).flatten(1).any(1).nonzero().flatten().tolist()
    clean = kv_cache.nan_to_num(0.0)
    mine = decode(impl, query, clean, block_tables, seq_lens, max_seq_len).float()

    def reference(lens):
        return TorchPagedAttention.forward_decode(
            impl, query, clean, block_tables, lens, max_seq_len).float()

    if (mine - reference(seq_lens)).abs().max().item() < 1e-3:
        closer = (
            "you masked the scores past seq_lens[i] but multiplied their values by the zero "
            "weight: 0 * NaN is NaN. Zero those values, or slice each sequence to its length."
        )
    elif (mine - reference(torch.full_like(seq_lens, max_seq_len))).abs().max().item() < 1e-3:
        closer = (
            f"you attended to max_seq_len = {max_seq_len} keys for every sequence: sequence i "
            "has only seq_lens[i]; max_seq_len, the longest, is for sizing a GPU kernel's launch."
        )
    else:
        closer = ""
    return (
        f"your {name}.forward_decode returned NaN for the decodes {seqs} of a batch with "
        f"seq_lens {seq_lens.tolist()}. The checker fills the KV cache with NaN before the run, "
        "as stale data of earlier requests would fill a reused one: only a sequence's first "
        "seq_lens[i] slots hold its keys and values, so your decode read keys or values past "
        "a sequence's length (the rest of its last block, or the padding block 0).\n"
        + (f"It looks like {closer}\n" if closer else "")
        + "Sequence i attends to exactly the first seq_lens[i] tokens of block_tables[i]: use "
        "seq_lens[i] keys, not max_seq_len, and keep the slots past them out of the scores and "
        "the values (exercise 3's NaN block 0 asked the same)."
    )


def _backend_hint(error: BaseException) -> str:
    """The likely mistake behind an exception raised inside the engine's
    attention, from the learner's decode or from what it returned."""
    text = str(error)
    if isinstance(error, IndexError) or (
        isinstance(error, (RuntimeError, ValueError)) and ("shape" in text or "size" in text)
    ):
        return (
            "a shape or an index did not fit. Inside the engine, query is [num_decodes, num_heads, "
            "head_size], kv_cache [2, num_blocks, block_size, num_kv_heads, head_size], "
            "block_tables [num_decodes, max_blocks] (padded with block 0) and seq_lens a "
            "[num_decodes] tensor; pass them to paged_decode in that order, with self.scale."
        )
    if isinstance(error, TypeError) and "argument" in text:
        return (
            "the engine calls forward_decode(self, query, kv_cache, block_tables, seq_lens, "
            "max_seq_len): keep that signature, and call paged_decode(query, kv_cache, "
            "block_tables, seq_lens, self.scale)."
        )
    return "run your forward_decode on the exercise 3 fixtures first, then inside the engine."


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
    if getattr(backend_cls, "forward_prefill", None) is AttentionImpl.forward_prefill:
        raise AssertionError(
            f"{backend_cls.__name__} has no forward_prefill: subclass TorchPagedAttention (not "
            "AttentionImpl), so that prefills keep the reference path and only your "
            "forward_decode replaces its decode."
        )
    name = backend_cls.__name__
    calls = {"decode": 0}
    backend = backend_cls
    if hasattr(backend_cls, "forward_decode"):
        original = backend_cls.forward_decode

        class Counting(backend_cls):  # counts the learner's decodes and checks their output
            def forward_decode(self, query, *args, **kwargs):
                calls["decode"] += 1
                out = original(self, query, *args, **kwargs)
                _check_decode_output(name, out, query)
                if torch.isnan(out).any():  # the engine calls with the five arguments, in order
                    raise AssertionError(_nan_message(name, self, original, out, query, *args))
                return out

        Counting.__name__ = name
        backend = Counting
    else:
        calls["decode"] = None  # a class with its own forward: nothing to count
    if _reference_tokens is None:
        _reference_tokens = _tokens("torch", num_gpu_blocks_override=16)
    # A small cache (16 blocks of 16 tokens), so that tables are short and
    # reused; filled with NaN, so that reading past seq_len shows.
    with learner_code(f"your {name}, inside the engine,", _backend_hint):
        got = _tokens(backend, num_gpu_blocks_override=16)
    if calls["decode"] == 0:
        raise AssertionError(f"{name}.forward_decode was never called by the engine")
    for prompt, ref, mine in zip(PROMPTS, _reference_tokens, got, strict=True):
        if ref != mine:
            i = next(i for i, (a, b) in enumerate(zip(ref, mine, strict=False)) if a != b)
            raise AssertionError(
                f"prompt {prompt!r}: greedy tokens differ from the reference backend at output "
                f"token {i} (reference {ref[i]}, yours {mine[i]}); token 0 comes from the prefill, "
                "so a difference from token 1 on points at your decode. Inside the engine, "
                "block_tables is padded with block 0 and seq_lens is a tensor; use self.scale "
                "(the layer's 1 / sqrt(head_size)), and all seq_lens[i] keys of sequence i."
            )
    passed(DAY, 4)


# Part 6: what the decode path hands the CUDA kernel --------------------------


def kernel_parameters(kernel: str = "paged_attention_v1_kernel") -> list[tuple[str, str]]:
    """(C++ declaration, its shape comment) of each parameter of `kernel`,
    read from reference_impl/csrc/paged_attention.cu."""
    source = (ops.CSRC_DIR / "paged_attention.cu").read_text()
    start = source.index("(", source.index(f" {kernel}(")) + 1
    params = []
    for line in source[start : source.index(") {", start)].splitlines():
        code, _, comment = line.partition("//")
        for decl in filter(None, (d.strip() for d in code.split(","))):
            params.append((decl.replace("__restrict__ ", ""), comment.strip()))
    return params


@dataclass
class Launch:
    """One kernel launch as `_custom_ops` makes it: template, grid, arguments."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple
    shared_mem: int


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Inside the block, `_custom_ops` looks up no kernel and launches nothing:
    each launch it would make is appended to the list yielded, so a launcher's
    grid, arguments and shared memory can be read on a CPU."""
    launches: list[Launch] = []
    saved = ops._kernel, ops._launch
    ops._kernel = lambda source, names, name: name
    ops._launch = lambda kernel, grid, args, shared_mem=0: launches.append(
        Launch(kernel, tuple(grid), args, shared_mem))
    try:
        yield launches
    finally:
        ops._kernel, ops._launch = saved


def decode_launch(num_seqs: int = 3, seq_lens: tuple[int, ...] = (40, 7, 19),
                  num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 64,
                  block_size: int = 16) -> Launch:
    """Run the CUDA backend's `forward_decode` on CPU tensors with the
    kernel launch replaced by a recorder: the launch the decode path builds,
    without a GPU (nothing is computed)."""
    max_blocks = -(-max(seq_lens) // block_size)
    query = torch.zeros(num_seqs, num_heads, head_size)
    kv_cache = torch.zeros(2, num_seqs * max_blocks + 1, block_size, num_kv_heads, head_size)
    tables = torch.arange(1, num_seqs * max_blocks + 1).view(num_seqs, max_blocks)
    with recorded_launches() as launches:
        CudaPagedAttention(num_heads, head_size, head_size**-0.5, num_kv_heads).forward_decode(
            query, kv_cache, tables, torch.tensor(seq_lens), max(seq_lens))
    return launches[0]


def describe_argument(value) -> str:
    """A launch argument as the kernel sees it: a tensor's shape and dtype
    (the kernel gets its address), or a scalar's C type and value."""
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return f"{type(value).__name__} {value.item():.4g}"


# Exercise 5 ------------------------------------------------------------------

# A chunked-prefill engine without the model: blocks of 4 tokens, at most 16
# tokens per step. Z finishes in step 0 and gives its blocks back, so the
# later tables are not in order; C's 30-token prompt arrives in step 1 and is
# prefilled in chunks beside A's and B's decodes. P (n=2) comes once C is
# prefilled (the lab's worked example is unchanged) and forks after its
# prompt: a group of two sequences, each with its own table past the shared
# prefix, so that an answer flattening one sequence per group is caught.
_MIXED_ENGINE = dict(
    block_size=4,
    num_gpu_blocks_override=24,
    enable_chunked_prefill=True,
    max_num_batched_tokens=16,
    max_num_seqs=4,
)
_MIXED_REQUESTS = [  # (request id, arrival step, prompt length, max_tokens, n)
    ("Z", 0, 5, 1, 1),
    ("A", 0, 6, 8, 1),
    ("B", 1, 3, 7, 1),
    ("C", 2, 30, 3, 1),
    ("P", 5, 6, 3, 2),
]


@dataclass
class MixedStep:
    """One step of the run: its scheduled groups as they were before the
    model ran, and the batch the engine built from them."""

    step: int
    seq_group_metadata_list: list[SequenceGroupMetadata]
    batch: FlatBatch


class _Recorder:
    """A step observer keeping each step's metadata as it was before the
    step (the step appends the sampled tokens and moves num_computed_tokens
    on; the batch says by how much) and the FlatBatch the worker ran."""

    def __init__(self) -> None:
        self.steps: list[MixedStep] = []

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        batch = record.batch
        sampled = {seq_id for seq_id, _, _ in record.samples}
        metas = []
        for meta in record.seq_group_metadata_list:
            seq_data, tables = {}, {}
            for seq_id, data in meta.seq_data.items():
                i = batch.seq_ids.index(seq_id)
                outputs = data.output_token_ids[: len(data.output_token_ids) - (seq_id in sampled)]
                seq_data[seq_id] = SequenceData(list(data.prompt_token_ids), list(outputs),
                                                num_computed_tokens=batch.context_lens[i])
                tables[seq_id] = list(batch.block_tables[i])
            metas.append(SequenceGroupMetadata(
                meta.request_id, meta.is_prompt, seq_data, meta.sampling_params, tables,
                meta.token_chunk_size, meta.do_sample,
            ))
        self.steps.append(MixedStep(len(self.steps), metas, batch))


_MIXED: list[MixedStep] = []


def mixed_run() -> list[MixedStep]:
    """Every step of the chunked-prefill run above (run once, then kept)."""
    if not _MIXED:
        args = EngineArgs.from_kwargs("day 4", model=DEFAULT_MODEL, dry_run=True, **_MIXED_ENGINE)
        with quiet_engine():
            engine = LLMEngine.from_engine_args(args)
            recorder = _Recorder()
            engine.add_step_observer(recorder)
            prompts = token_prompts([length for _, _, length, _, _ in _MIXED_REQUESTS])
            pending = sorted(zip(_MIXED_REQUESTS, prompts, strict=True), key=lambda r: r[0][1])
            step = 0
            while pending or engine.has_unfinished_requests():
                while pending and pending[0][0][1] <= step:
                    (rid, _, _, max_tokens, n), prompt = pending.pop(0)
                    # Greedy allows n=1 only; the dry run's tokens ignore the temperature.
                    params = SamplingParams(n=n, temperature=0 if n == 1 else 1.0,
                                            max_tokens=max_tokens, ignore_eos=True)
                    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
                engine.step()
                step += 1
        _MIXED.extend(s for s in recorder.steps if s.seq_group_metadata_list)
    return _MIXED


def mixed_step() -> MixedStep:
    """The first step that holds a prefill chunk starting after position 0
    next to decodes: the lab's worked example."""
    return next(
        s for s in mixed_run()
        if s.batch.num_prefills and len(s.batch.seq_ids) > s.batch.num_prefills
        and any(c for c in s.batch.context_lens[: s.batch.num_prefills])
    )


def describe_metadata(metas: list[SequenceGroupMetadata], block_size: int) -> str:
    """One line per scheduled sequence, in batch order."""
    lines = []
    for meta in metas:
        for seq_id, data in meta.seq_data.items():
            kind = "prefill" if meta.is_prompt else "decode "
            lines.append(
                f"  request {meta.request_id} seq {seq_id} {kind}: {data.get_len()} tokens, "
                f"num_computed_tokens {data.num_computed_tokens}, token_chunk_size "
                f"{meta.token_chunk_size}, block table {meta.block_tables[seq_id]}"
            )
    return "\n".join(lines)


def _spans(batch: FlatBatch) -> list[tuple[int, int, int]]:
    """(seq index, first token, end) of each sequence's tokens in the batch."""
    spans, start = [], 0
    for i, (n, c) in enumerate(zip(batch.seq_lens, batch.context_lens, strict=True)):
        spans.append((i, start, start + n - c))
        start += n - c
    return spans


def _flatten_mistake(metas, batch: FlatBatch, field: str, got: list[int], block_size: int) -> str:
    """The common mistake behind a wrong `field` list, or ''."""
    want = getattr(batch, field)
    if sorted(got) == sorted(want):
        return (
            "you have the right values in another order. The batch lists sequences in the "
            "order of seq_group_metadata_list, prefills first, then decodes: attention reads "
            "the first num_prefill_tokens rows as prefills."
        )
    for i, start, end in _spans(batch):
        mine, theirs = got[start:end], want[start:end]
        if mine == theirs:
            continue
        prefill = i < batch.num_prefills
        context = batch.context_lens[i]
        table = batch.block_tables[i]
        positions = batch.positions[start:end]
        if field == "positions" and prefill and mine == [p - context for p in theirs]:
            return (
                f"your positions of the prefill chunk start at 0; this chunk continues a prompt "
                f"whose first {context} tokens are already in the cache: its positions are "
                f"{theirs[0]}..{theirs[-1]} (num_computed_tokens .. num_computed_tokens + "
                "token_chunk_size - 1)."
            )
        if field == "positions" and not prefill and mine == [theirs[0] + 1]:
            return (
                f"a decode's position is its length minus one ({theirs[0]}), not its length "
                f"({theirs[0] + 1}): the new token is the last one of the sequence."
            )
        if field == "input_ids" and not prefill:
            return (
                "a decode's input is its last token (`data.get_last_token_id()`, the token "
                "sampled in the previous step), the one at position seq_len - 1."
            )
        if field == "input_ids" and prefill:
            return (
                "a prefill chunk's tokens are `get_token_ids()[num_computed_tokens : "
                "num_computed_tokens + token_chunk_size]`, not the prompt's first tokens."
            )
        if field == "slot_mapping" and all(p < len(table) for p in positions) and mine == [
            table[p] * block_size + p % block_size for p in positions
        ]:
            return (
                "you looked up block_table[position]; the table has one entry per block: "
                "block_table[position // block_size]."
            )
        return ""
    return ""


def _count_mistake(metas, batch: FlatBatch, count: int) -> str:
    """Why the learner's lists hold `count` entries, not one per token of the batch."""
    firsts = {next(iter(meta.seq_data)) for meta in metas}
    first_only = sum(end - start for i, start, end in _spans(batch) if batch.seq_ids[i] in firsts)
    group = next((meta for meta in metas if len(meta.seq_data) > 1), None)
    if group and count == first_only:
        return (
            f"you flattened one sequence per group: request {group.request_id} "
            f"(n={group.sampling_params.n}) has {len(group.seq_data)} sequences, seq_ids "
            f"{list(group.seq_data)}, each with its own tokens and block table. Loop over all "
            "of meta.seq_data: every sequence computes its token_chunk_size tokens."
        )
    return (
        f"the step computes {len(batch.input_ids)} tokens: each prefill chunk brings "
        "token_chunk_size tokens (not the rest of its prompt), each decode one."
    )


def _flatten_hint(error: BaseException) -> str:
    if isinstance(error, IndexError):
        return (
            "an index ran past the end of a list. A block table has one entry per block: "
            "position p is in block_table[p // block_size]; and a sequence's token ids stop at "
            "its length (a decode's new token is the last one, at seq_len - 1)."
        )
    if isinstance(error, (TypeError, ValueError)) and "unpack" in str(error):
        return "return three lists: `return input_ids, positions, slot_mapping`."
    if isinstance(error, AttributeError):
        return (
            "each entry of seq_group_metadata_list is a SequenceGroupMetadata: its seq_data "
            "maps seq_id to SequenceData (get_token_ids(), num_computed_tokens, get_len()), "
            "block_tables maps seq_id to a list of block numbers."
        )
    return "print the first entry of seq_group_metadata_list and walk it by hand."


def exercise_5(flatten_batch) -> None:
    for recorded in mixed_run():
        metas, batch = recorded.seq_group_metadata_list, recorded.batch
        block_size = _MIXED_ENGINE["block_size"]
        with learner_code(f"your flatten_batch, on step {recorded.step},", _flatten_hint):
            result = flatten_batch(metas, block_size)
        assert result is not None, (
            "your flatten_batch returned None: return (input_ids, positions, slot_mapping)."
        )
        with learner_code("the value your flatten_batch returned", _flatten_hint):
            input_ids, positions, slots = ([int(x) for x in xs] for xs in result)
        for field, got in (("positions", positions), ("input_ids", input_ids),
                           ("slot_mapping", slots)):
            want = getattr(batch, field)
            if got == want:
                continue
            if len(got) != len(want):
                closer = _count_mistake(metas, batch, len(got))
            else:
                closer = _flatten_mistake(metas, batch, field, got, block_size)
            raise AssertionError(
                f"step {recorded.step}: your {field} differ from the batch the engine built.\n"
                f"  engine: {want}\n  yours:  {got}\n"
                + (f"It looks like {closer}\n" if closer else "")
                + "The step's sequences, in batch order:\n"
                + describe_metadata(metas, block_size)
                + "\nThe engine's code: `FlatBatch.build` in "
                "reference_impl/minivllm/worker/model_runner.py."
            )
    passed(DAY, 5)
