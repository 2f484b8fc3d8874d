"""Checkers for Day 2, the KV cache and why paging (labs/day2_kv_cache.ipynb).

Each `exercise_k` runs the learner's function on fixed inputs and compares
it with the engine: `CacheEngine.get_cache_block_size` for the bytes per
token of real model configurations, the block tables of a traced run for
the blocks a sequence needs and the reserved memory, and the scheduler's
admissions under a fixed KV budget for how many sequences fit. It prints
one line when everything agrees, or raises AssertionError saying what was
expected, what came back and a hint. A NotImplementedError from an
unfinished exercise propagates unchanged.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from typing import Any

from transformers import AutoConfig, GemmaConfig, GPT2Config, LlamaConfig, Qwen2Config

from minivllm import LLM, SamplingParams
from minivllm.assets import DEFAULT_MODEL
from minivllm.config import ModelConfig
from minivllm.tracer import load_trace
from minivllm.worker.cache_engine import CacheEngine
from tools.labs.checks._common import passed
from tools.labs.checks._engine_runs import learner_code, quiet_engine, token_prompts

DAY = 2

# Prompt token ids in this day's runs: 2 + (7 * i + j) % 500 for token j of prompt i.
_IDS = dict(token_stride=1, modulo=500, first=2)


# The configurations of real models (their published config.json fields; no
# weights), and the dtype each is served in here.
def real_configs() -> dict[str, tuple[Any, int]]:
    """name -> (Hugging Face config, bytes per element)."""
    return {
        "Llama-2-7B": (
            LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                        intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096),
            2,
        ),
        "Llama-3-8B": (
            LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                        max_position_embeddings=8192),
            2,
        ),
        "Qwen2-0.5B": (
            Qwen2Config(num_hidden_layers=24, hidden_size=896, num_attention_heads=14,
                        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                        max_position_embeddings=32768),
            2,
        ),
        "GPT-2": (GPT2Config(), 2),
        "Gemma-7B": (
            GemmaConfig(num_hidden_layers=28, hidden_size=3072, num_attention_heads=16,
                        num_key_value_heads=16, head_dim=256, intermediate_size=24576,
                        vocab_size=256000),
            2,
        ),
        "minivllm-stories (float32)": (AutoConfig.from_pretrained(DEFAULT_MODEL), 4),
    }


_DTYPE = {2: "float16", 4: "float32"}


@functools.cache
def _engine_bytes_per_token(name: str) -> int:
    """What the engine allocates per token for this config: its own
    CacheEngine.get_cache_block_size with a block of one token."""
    config, dtype_bytes = real_configs()[name]
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        model_config = ModelConfig(model=tmp, dtype=_DTYPE[dtype_bytes])
        return CacheEngine.get_cache_block_size(1, model_config)


def _shape(config) -> dict[str, int]:
    heads = config.num_attention_heads
    return {
        "layers": config.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_size": getattr(config, "head_dim", None) or config.hidden_size // heads,
    }


_GPT2_NAMES = ("n_layer", "n_head", "n_embd")


def _bytes_error(error: BaseException) -> str:
    """The likely mistake behind an exception from kv_cache_bytes_per_token."""
    text = str(error)
    if isinstance(error, AttributeError) and any(n in text for n in _GPT2_NAMES):
        return ("n_layer, n_head and n_embd are GPT-2's own names; every Hugging Face config "
                "(GPT-2's too) answers to num_hidden_layers, num_attention_heads and hidden_size")
    if isinstance(error, AttributeError):
        return ("not every config has every field. GPT-2 has no num_key_value_heads (each head "
                "keeps its own K and V), Qwen2 has no head_dim (it is hidden_size // "
                "num_attention_heads): fall back the way ModelConfig.get_num_kv_heads and "
                "get_head_size do")
    if isinstance(error, TypeError) and "NoneType" in text:
        return ("a field was None: getattr(config, name, None) gives None where the config "
                "lacks it (or sets it to None); fall back with `or`, e.g. "
                "getattr(config, 'num_key_value_heads', None) or config.num_attention_heads")
    return "bytes = 2 (K and V) x layers x kv_heads x head_size x dtype_bytes"


def _wrong_bytes(config, dtype_bytes: int, want: int) -> list[tuple[int, str]]:
    """(what a usual mistake gives for this config, why), the mistakes in order."""
    s = _shape(config)
    return [
        (want * s["heads"] // s["kv_heads"], "you counted the query heads (hidden_size is "
         "num_attention_heads x head_size); only the KV heads are cached (grouped-query "
         "attention: num_key_value_heads)"),
        (want // 2, "did you forget that both K and V are cached (the factor 2)?"),
        (want // dtype_bytes, "that is the number of elements; multiply by dtype_bytes"),
        (want // s["layers"], "that is one layer; every layer has its own K and V"),
        (want * (config.hidden_size // s["heads"]) // s["head_size"],
         "use head_dim when the config sets it: the head size need not be "
         "hidden_size // num_attention_heads"),
    ]


def exercise_1(kv_cache_bytes_per_token) -> None:
    wrong = []  # (where, the engine's bytes, yours, the mistakes that would give yours)
    for name, (config, dtype_bytes) in real_configs().items():
        want = _engine_bytes_per_token(name)
        s = _shape(config)
        where = (
            f"{name} ({s['layers']} layers, {s['heads']} query heads, {s['kv_heads']} KV heads, "
            f"head size {s['head_size']}, {dtype_bytes} bytes per element)"
        )
        with learner_code(f"For {where} your kv_cache_bytes_per_token", _bytes_error):
            got = kv_cache_bytes_per_token(config, dtype_bytes)
        assert isinstance(got, int) and not isinstance(got, bool), (
            f"For {where} your function returned {got!r}, a {type(got).__name__}: a number of "
            "bytes is a whole number, an int. Hint: use // (integer division) for the head "
            "size, not /."
        )
        if got != want:
            explains = [h for value, h in _wrong_bytes(config, dtype_bytes, want)
                        if got == value != want]
            wrong.append((where, want, got, explains))
    if not wrong:
        passed(DAY, 1)
        return
    # The mistake that explains every wrong answer (two can coincide on one
    # config: the factor 2 and 2-byte elements), else the first config's.
    every = [h for h in wrong[0][3] if all(h in explains for *_, explains in wrong)]
    hint = next(iter(every or wrong[0][3]),
                "bytes = 2 (K and V) x layers x kv_heads x head_size x dtype_bytes")
    where, want, got, _ = wrong[0]
    raise AssertionError(
        f"For {where} the engine allocates {want} bytes per token "
        f"(CacheEngine.get_cache_block_size with a 1-token block), your function gave "
        f"{got!r}. Hint: {hint}."
    )


# Exercise 2 ---------------------------------------------------------------------


def _traced_run(prompt_lens, max_tokens, arrivals=None, **engine_kwargs):
    """The shipped model's dry run (no weights: the real scheduler and block
    manager), traced; prompts are token ids. `arrivals[i]` is the number of
    steps taken before request i is added."""
    arrivals = arrivals or [0] * len(prompt_lens)
    prompts = token_prompts(prompt_lens, **_IDS)
    with tempfile.TemporaryDirectory() as tmp, quiet_engine():
        path = os.path.join(tmp, "run.jsonl")
        llm = LLM(dry_run=True, trace=path, **engine_kwargs)
        engine = llm.llm_engine
        pending = sorted(zip(arrivals, range(len(prompt_lens)), strict=True))
        step = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, i = pending.pop(0)
                engine.add_request(
                    "ABCDEFGH"[i], {"prompt_token_ids": prompts[i]},
                    SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True),
                )
            engine.step()
            step += 1
        engine.stop_trace()
        return load_trace(path)


def exercise_2(blocks_needed) -> None:
    for block_size in (16, 8, 32, 1):
        for num_tokens in range(1, 3 * block_size + 2):
            want = math.ceil(num_tokens / block_size)
            with learner_code(f"Your blocks_needed({num_tokens}, {block_size})"):
                got = blocks_needed(num_tokens, block_size)
            assert isinstance(got, int) and not isinstance(got, bool), (
                f"blocks_needed({num_tokens}, {block_size}) returned {got!r}, a "
                f"{type(got).__name__}: a number of blocks is an int. Hint: math.ceil returns "
                "an int (numpy's np.ceil a float), and -(-n // b) is one too."
            )
            full, rest = divmod(num_tokens, block_size)
            why = (
                f"{num_tokens} tokens fill exactly {full} block(s): no extra block when the "
                "last one is exactly full"
                if rest == 0
                else f"{num_tokens} tokens fill {full} whole block(s) with {rest} token(s) "
                "left over, and a partly filled block is still a whole block"
            )
            assert got == want, (
                f"blocks_needed({num_tokens}, {block_size}) should be {want}, got {got!r}. "
                f"Hint: {why}; round up (ceiling division)."
            )
    got = blocks_needed(0, 16)
    assert got == 0, f"blocks_needed(0, 16) should be 0 (no tokens, no blocks), got {got!r}"
    trace = _traced_run([1, 7, 8, 9, 16, 17], [10, 3, 9, 8, 1, 12], block_size=8)
    for step in trace.steps:
        for seq_id, table in step["block_tables"].items():
            seq = step["seqs"][seq_id]
            got = blocks_needed(seq["num_computed_tokens"], trace.block_size)
            assert got == len(table), (
                f"In a traced run (block_size {trace.block_size}), after step {step['step']} "
                f"sequence {seq_id} had {seq['num_computed_tokens']} tokens in the cache and "
                f"the block manager gave it {len(table)} blocks, {table}; your "
                f"blocks_needed said {got}."
            )
    passed(DAY, 2)


# Exercise 3 ---------------------------------------------------------------------


def reference_kv_usage(step: dict[str, Any], block_size: int, max_model_len: int) -> dict:
    tables = step["block_tables"]
    return {
        "live": sum(step["seqs"][sid]["num_computed_tokens"] for sid in tables),
        "paged": sum(len(t) for t in tables.values()) * block_size,
        "contiguous": len(tables) * max_model_len,
    }


# A tight pool (12 blocks of 16 for four requests that need 20 in the end):
# requests arrive at different steps, one is preempted (RECOMPUTE) and
# holds no blocks while it waits again.
_EX3 = dict(
    prompt_lens=[40, 20, 70, 10], max_tokens=[30, 60, 20, 50], arrivals=[0, 0, 3, 5],
    block_size=16, num_gpu_blocks_override=12, max_model_len=256, preemption_mode="recompute",
)


def _usage_error(error: BaseException) -> str:
    if isinstance(error, KeyError):
        return ("a step line is JSON, whose keys are strings: step['block_tables'] and "
                "step['seqs'] are keyed by the sequence id as a string ('0', not 0); use the "
                "keys of step['block_tables'] as they are")
    return ("print one step line (step['seqs'], step['block_tables']) and read its fields; "
            "reference_impl/minivllm/tracer/SCHEMA.md describes them")


def exercise_3(kv_usage) -> None:
    kwargs = dict(_EX3)
    trace = _traced_run(kwargs.pop("prompt_lens"), kwargs.pop("max_tokens"),
                        kwargs.pop("arrivals"), **kwargs)
    block_size, max_model_len = trace.block_size, trace.header["max_model_len"]
    for step in trace.steps:
        want = reference_kv_usage(step, block_size, max_model_len)
        # The engine's own accounting agrees: blocks in use = pool - free.
        in_use = (trace.num_gpu_blocks - step["free_blocks"]["gpu"]) * block_size
        assert want["paged"] == in_use, "internal: the trace's free blocks disagree"
        with learner_code(f"Your kv_usage (step {step['step']})", _usage_error):
            got = kv_usage(step, block_size, max_model_len)
        assert isinstance(got, dict) and set(got) == set(want), (
            f"kv_usage should return a dict with the keys {sorted(want)}, got {got!r}"
        )
        for key in ("live", "paged", "contiguous"):
            if got[key] == want[key]:
                continue
            holders = sorted(step["block_tables"], key=int)
            others = sorted(set(step["seqs"]) - set(holders), key=int)
            hint = _usage_hint(key, got[key], step, block_size, max_model_len) or {
                "live": "live tokens are those whose K/V are in the cache: each sequence's "
                "num_computed_tokens (the token sampled this step has no K/V yet), summed over "
                "the sequences in step['block_tables']",
                "paged": "the paged engine reserves whole blocks: the length of each block "
                "table times block_size",
                "contiguous": "a contiguous reservation gives every sequence that holds KV "
                "cache max_model_len slots",
            }[key]
            raise AssertionError(
                f"Step {step['step']} (block_size {block_size}, max_model_len {max_model_len}): "
                f"{key} should be {want[key]}, got {got[key]!r} (the whole answer: {want}). "
                f"Sequences holding blocks after this step: {holders}; in step['seqs'] but "
                f"holding none (finished, or preempted and waiting): {others or 'none'}. "
                f"Hint: {hint}."
            )
    passed(DAY, 3)


def _usage_hint(key: str, got: Any, step: dict, block_size: int, max_model_len: int) -> str:
    """The closest reason for a wrong kv_usage field, or ''."""
    tables, seqs = step["block_tables"], step["seqs"]
    everyone = {
        "live": sum(seq["num_computed_tokens"] for seq in seqs.values()),
        "contiguous": len(seqs) * max_model_len,
    }
    if key in everyone and got == everyone[key] != reference_kv_usage(
        step, block_size, max_model_len
    )[key]:
        return ("you counted every sequence in step['seqs'], those that finished in this step "
                "or wait preempted (holding no blocks) included; count the sequences in "
                "step['block_tables']")
    if key == "live" and got == sum(seqs[sid]["num_tokens"] for sid in tables):
        return ("num_tokens is the sequence's length, including the token sampled in this step, "
                "whose K/V are not in the cache yet; count num_computed_tokens")
    if key == "paged" and got == len(tables) * block_size:
        return "a sequence may hold several blocks: count them all, len(table) for each table"
    if key == "paged" and got == sum(len(t) for t in tables.values()):
        return "that is blocks; the answer is in token slots, blocks x block_size"
    return ""


# Exercise 4 ---------------------------------------------------------------------


def reference_how_many_fit(budget_bytes, bytes_per_token, block_size, max_model_len, seq_lens):
    slots = budget_bytes // bytes_per_token
    contiguous = min(len(seq_lens), slots // max_model_len)
    free = budget_bytes // (bytes_per_token * block_size)
    paged = 0
    for n in seq_lens:
        need = -(-n // block_size)
        if need > free:
            break
        free -= need
        paged += 1
    return contiguous, paged


_REAL_SCALE_CASES = [
    # Llama-3-8B (128 KiB per token) with 40 GiB of KV cache, max_model_len 8192.
    (40 << 30, 131072, 16, 8192, [1000] * 400),
    (40 << 30, 131072, 16, 8192, [8192] * 50),
    # Room for 40 contiguous reservations, but only 10 requests.
    (40 << 30, 131072, 16, 8192, [1000] * 10),
    # Llama-2-7B (512 KiB per token), 20 GiB, max_model_len 4096, mixed lengths.
    (20 << 30, 524288, 16, 4096, [300, 1200, 4096, 50, 700, 2000, 3500, 900, 100] * 4),
]
# The shipped model with budgets under 100 blocks (no watermark held back), so
# the real scheduler admits exactly what fits.
_SMALL_CASES = [
    (30 * 16 * 2048, 2048, 16, 512, [100, 30, 64, 17, 200, 5, 90]),
    (25 * 16 * 2048, 2048, 16, 512, [100, 300, 10]),
    # 4 + 6 blocks fill the 10 exactly; the third request finds none left.
    (10 * 16 * 2048, 2048, 16, 512, [64, 96, 1]),
    (64 * 8 * 2048, 2048, 8, 256, [9, 8, 7, 16, 17, 1, 64, 120, 33]),
]
_PLAIN_CASES = _REAL_SCALE_CASES + _SMALL_CASES


def _contiguous_hint(got, budget_bytes, bytes_per_token, block_size, max_model_len,
                     seq_lens) -> str:
    slots = budget_bytes // bytes_per_token
    if got == slots // max_model_len > len(seq_lens):
        return (f"the budget has room for {got} reservations of max_model_len slots, but there "
                f"are only {len(seq_lens)} sequences: no more than len(seq_lens) can run, so "
                "cap the answer with min(...)")
    by_length = 0
    for n in seq_lens:
        if n > slots:
            break
        slots -= n
        by_length += 1
    if got == by_length:
        return ("that counts each sequence's own length; a contiguous server cannot know how "
                "long a sequence will grow, so it reserves max_model_len slots for each")
    return ("each sequence reserves max_model_len slots whatever its length; the budget holds "
            "budget_bytes // bytes_per_token slots, and there are only len(seq_lens) sequences")


def _paged_strict(budget_bytes, bytes_per_token, block_size, max_model_len, seq_lens) -> int:
    """The paged count that stops when a sequence needs all the blocks left."""
    free = budget_bytes // (bytes_per_token * block_size)
    paged = 0
    for n in seq_lens:
        need = -(-n // block_size)
        if need >= free:
            break
        free -= need
        paged += 1
    return paged


def _engine_admits(budget_bytes, block_size, max_model_len, seq_lens) -> int:
    """How many of these prompts the real scheduler admits in its first step,
    with nothing but the KV budget in the way."""
    with quiet_engine():
        llm = LLM(dry_run=True, kv_cache_memory_bytes=budget_bytes, block_size=block_size,
                  max_model_len=max_model_len,
                  max_num_batched_tokens=max(sum(seq_lens), max_model_len),
                  max_num_seqs=len(seq_lens))
    engine = llm.llm_engine
    prompts = token_prompts(seq_lens, request_stride=0, **_IDS)  # one prompt, cut to each length
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=1))
    return len(engine.step())


def exercise_4(how_many_fit) -> None:
    for case in _PLAIN_CASES:
        budget, per_token, block_size, max_model_len, lens = case
        want = reference_how_many_fit(*case)
        with learner_code("Your how_many_fit"):
            got = how_many_fit(budget, per_token, block_size, max_model_len, list(lens))
        described = (
            f"how_many_fit({budget}, {per_token}, {block_size}, {max_model_len}, "
            f"{len(lens)} sequences of lengths {lens[:9]}{' ...' if len(lens) > 9 else ''})"
        )
        assert isinstance(got, tuple) and len(got) == 2, (
            f"{described} should return a pair (contiguous, paged), got {got!r}"
        )
        assert got[0] == want[0], (
            f"{described}: contiguous should be {want[0]}, got {got[0]}. Hint: "
            f"{_contiguous_hint(got[0], *case)}."
        )
        if got[1] != want[1]:
            skipped = reference_how_many_fit(
                budget, per_token, block_size, max_model_len, sorted(lens)
            )[1]
            hint = (
                "the scheduler admits in arrival order and stops at the first sequence that "
                "does not fit (first come, first served: no overtaking)"
                if got[1] > want[1] and skipped >= got[1]
                else "a sequence that needs exactly the blocks left still fits: stop when it "
                "needs more than are free (need > free), not as many"
                if got[1] == _paged_strict(*case)
                else "each sequence takes ceil(length / block_size) whole blocks, and the "
                "budget holds budget_bytes // (bytes_per_token * block_size) blocks"
            )
            raise AssertionError(f"{described}: paged should be {want[1]}, got {got[1]}. "
                                 f"Hint: {hint}.")
    # The real scheduler agrees.
    for budget, per_token, block_size, max_model_len, lens in _SMALL_CASES:
        admitted = _engine_admits(budget, block_size, max_model_len, lens)
        got = how_many_fit(budget, per_token, block_size, max_model_len, list(lens))[1]
        assert got == admitted, (
            f"With a {budget}-byte KV cache and block_size {block_size}, the engine's "
            f"scheduler admitted {admitted} of the prompts {lens} in its first step; your "
            f"how_many_fit says {got} fit."
        )
    passed(DAY, 4)
