"""Checkers for Day 8, long contexts and the memory wall
(labs/day8_long_contexts_memory_wall.ipynb).

Exercise 1 (the v2 reduce: merging partitions) is checked against full
softmax attention computed in float64, on partitions cut from scores and
values with ordinary and very large logits, partly filled last partitions
and unused partition slots holding NaN (as the kernel's `torch.empty`
buffers hold garbage); then the learner's merge runs inside the real engine,
behind a backend that splits every decode into 16-token partitions, and its
greedy tokens must equal the reference backend's. Exercise 2 (bytes a decode
step must read) is checked against `tools/bench/attention.py::moved_bytes`
and against the bytes counted from the tensors the engine's attention layers
were really handed during a run; exercise 3 (FLOPs) against
`torch.utils.flop_counter.FlopCounterMode` counting a reference decode on
meta tensors; exercise 4 (the roofline) on given numbers, never on a timing.
A wrong answer is compared with the common mistakes, and the one it matches
is named.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from minivllm import LLM, SamplingParams
from minivllm import _custom_ops as ops
from minivllm.assets import DEFAULT_MODEL
from minivllm.attention.backends.torch_paged import TorchPagedAttention
from minivllm.attention.kv_cache import gather_kv
from tools.bench.attention import moved_bytes
from tools.labs.checks._common import needs, passed
from tools.labs.checks._engine_runs import learner_code, quiet_engine
from tools.labs.checks.day4 import (
    Launch,
    describe_argument,
    kernel_parameters,
    recorded_launches,
)

__all__ = ["ENGINE_BLOCK_SIZE", "ENGINE_PARTITION_SIZE", "LLAMA_8B", "SHIPPED", "EmulatedV2",
           "Launch", "decode_steps", "emulated_v2", "exercise_1", "exercise_2", "exercise_3",
           "exercise_4", "describe_argument", "gpu_problem", "kernel_parameters", "needs",
           "partition_pass", "v2_launches"]

DAY = 8

# The engine's decodes in exercise 1 are cut into partitions of this many
# tokens, one block of ENGINE_BLOCK_SIZE (vLLM's are 512 tokens, 32 blocks of
# 16: the lab's short contexts would never be split).
ENGINE_BLOCK_SIZE = 8
ENGINE_PARTITION_SIZE = 8


# Exercise 1: the merge of partitions ------------------------------------------------


def _num_partitions(seq_lens: torch.Tensor, partition_size: int) -> torch.Tensor:
    return (seq_lens + partition_size - 1) // partition_size


def _partials(scores: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor,
              partition_size: int, poison: bool = True):
    """What the v2 kernel's first pass writes, from per-head scores
    [num_seqs, num_heads, max_len] and values [num_seqs, num_heads, max_len,
    head_size] (computed in their own dtype): per partition its max logit,
    its exp-sum relative to that max, and its output normalised by that sum.
    Partition slots past a sequence's end are NaN with `poison` (the kernel
    never writes them: they hold whatever `torch.empty` gave)."""
    num_seqs, num_heads, max_len = scores.shape
    head_size = values.shape[-1]
    max_parts = -(-int(seq_lens.max()) // partition_size)
    shape = (num_seqs, num_heads, max_parts)
    max_logits = torch.full(shape, math.nan, dtype=scores.dtype)
    exp_sums = torch.full(shape, math.nan, dtype=scores.dtype)
    tmp_out = torch.full(shape + (head_size,), math.nan, dtype=scores.dtype)
    if not poison:
        max_logits.fill_(-math.inf)
        exp_sums.zero_()
        tmp_out.zero_()
    for i, n in enumerate(seq_lens.tolist()):
        for p in range(-(-n // partition_size)):
            lo, hi = p * partition_size, min((p + 1) * partition_size, n)
            s = scores[i, :, lo:hi]  # [num_heads, tokens]
            m = s.max(dim=-1).values
            e = torch.exp(s - m[:, None])
            total = e.sum(-1)
            max_logits[i, :, p] = m
            exp_sums[i, :, p] = total
            tmp_out[i, :, p] = torch.einsum("ht,htd->hd", e, values[i, :, lo:hi]) / total[:, None]
    return max_logits, exp_sums, tmp_out


def _full_attention(scores: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor):
    """softmax(scores) @ values over each sequence's seq_len tokens: the oracle."""
    out = []
    for i, n in enumerate(seq_lens.tolist()):
        probs = torch.softmax(scores[i, :, :n], dim=-1)
        out.append(torch.einsum("ht,htd->hd", probs, values[i, :, :n]))
    return torch.stack(out)


@dataclass
class _MergeCase:
    what: str
    seq_lens: torch.Tensor
    partition_size: int
    scores: torch.Tensor  # float64, [num_seqs, num_heads, max_len]
    values: torch.Tensor  # float64, [num_seqs, num_heads, max_len, head_size]

    def inputs(self):
        """(max_logits, exp_sums, tmp_out) in float32, unused slots NaN."""
        parts = _partials(self.scores, self.values, self.seq_lens, self.partition_size)
        return tuple(t.float() for t in parts)

    def expected(self) -> torch.Tensor:
        return _full_attention(self.scores, self.values, self.seq_lens)


def _merge_case(what, seq_lens, partition_size, spread, shift, seed, small=()) -> _MergeCase:
    """Random scores: N(0, spread) plus, per partition, an offset up to
    +-shift (so the partitions' maxima differ); sequences in `small` get
    plain N(0, 1) scores."""
    g = torch.Generator().manual_seed(seed)
    num_heads, head_size = 3, 8
    lens = torch.tensor(seq_lens)
    max_len = max(seq_lens)
    scores = torch.randn(len(seq_lens), num_heads, max_len, generator=g, dtype=torch.float64)
    scores *= spread
    parts = -(-max_len // partition_size)
    offsets = (torch.rand(len(seq_lens), num_heads, parts, generator=g, dtype=torch.float64)
               * 2 - 1) * shift
    scores += offsets.repeat_interleave(partition_size, dim=-1)[..., :max_len]
    for i in small:
        scores[i] = torch.randn(num_heads, max_len, generator=g, dtype=torch.float64)
    values = torch.randn(len(seq_lens), num_heads, max_len, head_size, generator=g,
                         dtype=torch.float64)
    return _MergeCase(what, lens, partition_size, scores, values)


def merge_cases() -> list[_MergeCase]:
    """Ordinary logits first (40 tokens in partitions of 16: 3 partitions, the
    last half full; 17 tokens: a 1-token partition and an unused slot; one
    sequence of exactly one partition), then large ones (several hundred:
    exp() of them overflows float32) beside a sequence of small ones."""
    return [
        _merge_case("ordinary logits", [40, 17, 33, 16], 16, spread=2.0, shift=4.0, seed=1),
        _merge_case("large logits (some near +-300) beside a sequence of small ones",
                    [70, 64, 5], 16, spread=40.0, shift=300.0, seed=2, small=(2,)),
    ]


def _variant(name: str, max_logits, exp_sums, tmp_out, seq_lens, partition_size):
    """The output of a common mistake, computed in float32 as the learner would."""
    max_parts = max_logits.shape[-1]
    n = (seq_lens // partition_size) if name == "floor" else _num_partitions(seq_lens,
                                                                            partition_size)
    used = (torch.arange(max_parts)[None, :] < n[:, None])[:, None, :]
    if name == "all_partitions":
        used = torch.ones_like(used)
    m = max_logits.masked_fill(~used, -math.inf)
    if name == "batch_max":
        big = m.amax()
        top = big.expand_as(m[..., :1])
    else:
        top = m.amax(-1, keepdim=True)
    if name == "flipped":
        scale = torch.exp(top - m)
    elif name == "no_max":
        scale = torch.exp(m)
    else:
        scale = torch.exp(m - top)
    s = exp_sums
    if name == "all_partitions":
        w, o = s * scale, tmp_out
    else:
        zero = torch.zeros((), dtype=tmp_out.dtype)
        s = torch.where(used, s, zero)
        o = torch.where(used[..., None], tmp_out, zero)
        w = torch.where(used, s * scale, zero)
    if name == "no_rescale":
        w = s
    if name == "no_exp_sum":
        w = torch.where(used, scale, torch.zeros(()))
    if name == "plain_sum":
        return o.sum(-2)
    if name == "mean":
        return o.sum(-2) / n[:, None, None].clamp(min=1)
    weighted = (w[..., None] * o).sum(-2)
    if name == "no_division":
        return weighted
    if name == "wrong_sum":
        return weighted / s.sum(-1, keepdim=True)
    if name == "unnormalised":
        e = torch.where(used, scale, torch.zeros(()))
        return (e[..., None] * o).sum(-2) / w.sum(-1, keepdim=True)
    return weighted / w.sum(-1, keepdim=True)


_MERGE_MISTAKES = [
    ("all_partitions",
     "you combined every partition slot, max_num_partitions of them, for every sequence. A "
     "sequence of seq_len tokens has only ceil(seq_len / partition_size) partitions; the kernel "
     "never writes the slots after them (here they hold NaN, on a GPU whatever torch.empty "
     "gave). Take the first num_partitions of each sequence, and keep the other slots out "
     "entirely: a zero weight is not enough, 0 * NaN is NaN."),
    ("floor",
     "you counted seq_len // partition_size partitions, which drops the partly filled last "
     "one: there are ceil(seq_len / partition_size) = (seq_len + partition_size - 1) // "
     "partition_size."),
    ("no_max",
     "you weighted each partition by exp(max_logit) without subtracting the largest max first: "
     "exp() of a logit of a few hundred overflows float32 (exp(89) is already inf), and "
     "inf / inf is NaN. Use exp(m_i - M), M the largest of the sequence's m_i: the common "
     "factor exp(M) cancels between numerator and denominator."),
    ("batch_max",
     "you took M, the max logit, over the whole batch instead of per (sequence, head). That "
     "is exact in theory (a common factor cancels), but for a sequence whose logits are far "
     "below another's, every exp(m_i - M) underflows to 0 and the result is 0 / 0 = NaN. "
     "Take the max over one row's partitions."),
    ("no_rescale",
     "you weighted partition i by its exp_sum s_i alone. Each s_i is a sum of exp(logit - m_i), "
     "taken relative to its own partition's max m_i: sums relative to different maxima cannot "
     "be compared until they are brought to one reference, s_i * exp(m_i - M)."),
    ("no_exp_sum",
     "you weighted partition i by exp(m_i - M) alone, forgetting its exp_sum s_i: a partition's "
     "share of the softmax mass is s_i * exp(m_i - M) (how many tokens, and how large, not "
     "only its largest one)."),
    ("unnormalised",
     "you treated tmp_out as unnormalised partial sums. The first pass has already divided "
     "each partition's output by its own s_i (tmp_out is a weighted average of V rows), so "
     "the weight of partition i is s_i * exp(m_i - M), and the result is divided by the sum "
     "of those weights."),
    ("no_division",
     "you did not divide by the total weight: out = sum_i w_i * tmp_out_i / sum_i w_i, with "
     "w_i = s_i * exp(m_i - M). Without the division the output is scaled by the softmax "
     "denominator."),
    ("wrong_sum",
     "you divided by sum_i s_i, the raw exp-sums. The denominator must be in the same "
     "reference as the weights: sum_i s_i * exp(m_i - M)."),
    ("flipped",
     "you rescaled by exp(M - m_i): the sign is reversed. Partition i's sums are relative to "
     "exp(m_i); to express them relative to exp(M) multiply by exp(m_i - M) <= 1."),
    ("plain_sum",
     "you added the partitions' outputs. Each tmp_out_i is already a weighted average of its "
     "V rows; the merge is a weighted average of those averages, with weights "
     "s_i * exp(m_i - M) / sum_j s_j * exp(m_j - M)."),
    ("mean",
     "you averaged the partitions' outputs with equal weights. A partly filled last "
     "partition, or one whose logits are lower, holds less of the softmax mass: weight "
     "partition i by s_i * exp(m_i - M), then divide by the sum of the weights."),
]


def _merge_hint(error: BaseException) -> str:
    if isinstance(error, (IndexError, RuntimeError)) and (
        "size" in str(error) or "shape" in str(error) or "index" in str(error)
    ):
        return (
            "max_logits and exp_sums are [num_seqs, num_heads, max_num_partitions], tmp_out "
            "[num_seqs, num_heads, max_num_partitions, head_size], seq_lens [num_seqs]: the "
            "partition axis is the last of the first two and the third of tmp_out."
        )
    return "print the shapes of the four tensors, then merge one (sequence, head) by hand."


def _check_merge_output(got, expected: torch.Tensor, what: str) -> None:
    assert got is not None, "your merge_partitions returned None: return the merged output."
    assert isinstance(got, torch.Tensor), (
        f"your merge_partitions returned {type(got).__name__}, not a tensor."
    )
    if tuple(got.shape) != tuple(expected.shape):
        closer = ""
        if got.dim() == 4:
            closer = " You kept the partition axis: the merge sums over it."
        raise AssertionError(
            f"{what}: the output should be [num_seqs, num_heads, head_size] = "
            f"{list(expected.shape)}, got {list(got.shape)}.{closer}"
        )


def _merge_verdict(case: _MergeCase, merge) -> None:
    max_logits, exp_sums, tmp_out = case.inputs()
    expected = case.expected()
    args = (max_logits.clone(), exp_sums.clone(), tmp_out.clone(), case.seq_lens.clone(),
            case.partition_size)
    with learner_code(f"your merge_partitions, on {case.what},", _merge_hint):
        got = merge(*args)
    _check_merge_output(got, expected, case.what)
    got64 = got.detach().double()
    err = (got64 - expected).abs().nan_to_num(nan=math.inf).flatten(1).amax(1)
    if bool((err <= 1e-4).all()):
        return
    seq = int(err.argmax())
    n = int(case.seq_lens[seq])
    closer = ""
    for name, said in _MERGE_MISTAKES:
        want = _variant(name, max_logits, exp_sums, tmp_out, case.seq_lens, case.partition_size)
        if torch.allclose(got.detach().float(), want, atol=1e-4, rtol=1e-4, equal_nan=True):
            closer = said
            break
    nan_seqs = torch.isnan(got64).flatten(1).any(1).nonzero().flatten().tolist()
    seen = (f"NaN in sequences {nan_seqs}" if nan_seqs else
            f"an error of up to {float(err[seq]):.3g}")
    raise AssertionError(
        f"{case.what}: seq_lens {case.seq_lens.tolist()}, partitions of {case.partition_size} "
        f"tokens: your merge differs from full softmax attention: {seen} (sequence {seq}: "
        f"{n} tokens, {-(-n // case.partition_size)} partitions).\n"
        + (f"It looks like {closer}\n" if closer else "")
        + "Per (sequence, head): M = max of the used partitions' max_logits m_i; weights "
        "w_i = exp_sums[i] * exp(m_i - M); out = sum_i w_i * tmp_out_i / sum_i w_i "
        "(lesson section 2; `paged_attention_v2_reduce_kernel` in "
        "reference_impl/csrc/paged_attention.cu)."
    )


def partition_pass(query, kv_cache, block_tables, seq_lens, scale, partition_size):
    """The first pass of v2 in PyTorch: (max_logits, exp_sums, tmp_out) of each
    (sequence, query head, partition), float32, unused partition slots NaN.
    What `paged_attention_v2_kernel` writes, computed slowly."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    lens = seq_lens.cpu()
    max_len = int(lens.max())
    keys, values = gather_kv(kv_cache, block_tables)  # [B, blocks * block_size, kv_heads, head]
    keys = keys[:, :max_len].float().repeat_interleave(group, dim=2)
    values = values[:, :max_len].float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", query.float(), keys) * scale
    return _partials(scores, values.permute(0, 2, 1, 3), lens, partition_size)


def partitioned_backend(merge, partition_size: int = ENGINE_PARTITION_SIZE):
    """An attention class for `LLM(attention_backend=...)` whose decodes run
    `partition_pass`, then `merge` (the learner's), as v2 does."""

    class PartitionedAttention(TorchPagedAttention):
        def forward_decode(self, query, kv_cache, block_tables, seq_lens, max_seq_len):
            parts = partition_pass(query, kv_cache, block_tables, seq_lens, self.scale,
                                   partition_size)
            out = merge(*parts, seq_lens.clone(), partition_size)
            if not isinstance(out, torch.Tensor) or out.shape != query.shape:
                raise AssertionError(
                    "inside the engine, your merge_partitions returned "
                    f"{getattr(out, 'shape', type(out).__name__)} for a query of shape "
                    f"{list(query.shape)}: it must be [num_seqs, num_heads, head_size]."
                )
            return out.to(query.dtype)

    return PartitionedAttention


# The engine runs: two prompts of Day 4; the last decodes span 2 and 3 partitions.
PROMPTS = ["The little dog", "One day, a girl named Mia went to the park and"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@dataclass
class DecodeCall:
    """One layer's `forward_decode` call, as the engine made it."""

    seq_lens: list[int]
    num_heads: int
    head_size: int
    num_kv_heads: int
    block_size: int
    dtype: torch.dtype
    bytes_read: int  # K and V of every context token, the query and the output


@dataclass
class DecodeStep:
    step: int
    calls: list[DecodeCall]  # one per attention layer


@dataclass
class _Reference:
    tokens: list[list[int]]
    steps: list[DecodeStep]
    config: dict


_reference: _Reference | None = None


def _run(backend, observer=None) -> tuple[list[list[int]], LLM]:
    with quiet_engine():
        llm = LLM(DEFAULT_MODEL, attention_backend=backend, block_size=ENGINE_BLOCK_SIZE,
                  num_gpu_blocks_override=16, disable_log_stats=True)
        if observer is not None:
            llm.llm_engine.add_step_observer(observer)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def reference_run() -> _Reference:
    """The reference backend on PROMPTS, with every decode call's inputs
    recorded (run once, then kept): the greedy tokens of exercise 1 and the
    real decode steps of exercise 2."""
    global _reference
    if _reference is not None:
        return _reference
    calls: list[DecodeCall] = []

    class Recording(TorchPagedAttention):
        def forward_decode(self, query, kv_cache, block_tables, seq_lens, max_seq_len):
            elem = kv_cache.element_size()
            _, _, block_size, kv_heads, head = kv_cache.shape
            lens = [int(n) for n in seq_lens]
            kv = 2 * sum(lens) * kv_heads * head * elem  # the rows each sequence owns
            qo = query.numel() * query.element_size() * 2  # the query in, the output out
            calls.append(DecodeCall(lens, query.shape[1], head, kv_heads, block_size,
                                    kv_cache.dtype, kv + qo))
            return super().forward_decode(query, kv_cache, block_tables, seq_lens, max_seq_len)

    steps: list[DecodeStep] = []

    class Steps:
        seen = 0

        def on_add_request(self, engine, seq_group) -> None:
            pass

        def on_step(self, engine, record) -> None:
            new = calls[Steps.seen:]
            Steps.seen = len(calls)
            if new:
                steps.append(DecodeStep(len(steps), new))

    tokens, llm = _run(Recording, Steps())
    cfg = llm.llm_engine.model_config
    config = dict(num_layers=cfg.get_num_layers(), num_heads=cfg.get_num_attention_heads(),
                  num_kv_heads=cfg.get_num_kv_heads(), head_size=cfg.get_head_size())
    _reference = _Reference(tokens, steps, config)
    return _reference


def decode_steps() -> list[DecodeStep]:
    """The decode steps of the reference run, each with its layers' calls."""
    return reference_run().steps


def exercise_1(merge_partitions) -> None:
    for case in merge_cases():
        _merge_verdict(case, merge_partitions)
    ref = reference_run()
    with learner_code("your merge_partitions, inside the engine (partitions of "
                      f"{ENGINE_PARTITION_SIZE} tokens),", _merge_hint):
        got, _ = _run(partitioned_backend(merge_partitions))
    for prompt, want, mine in zip(PROMPTS, ref.tokens, got, strict=True):
        if want != mine:
            i = next(i for i, (a, b) in enumerate(zip(want, mine, strict=False)) if a != b)
            raise AssertionError(
                f"inside the engine, prompt {prompt!r}: greedy tokens differ from the reference "
                f"backend's at output token {i} (reference {want[i]}, yours {mine[i]}). Your "
                "merge passed the checks on fixed inputs; inside the engine seq_lens is an int64 "
                "tensor and every sequence of the batch has its own number of partitions."
            )
    passed(DAY, 1)


# Exercise 2: the bytes a decode step reads ------------------------------------------


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def oracle_bytes(seq_lens, num_layers, num_heads, num_kv_heads, head_size, dtype) -> int:
    """`moved_bytes` of each sequence (tools/bench/attention.py), every layer."""
    return num_layers * sum(
        moved_bytes(1, n, num_heads, num_kv_heads, head_size, dtype) for n in seq_lens
    )


_BYTES_MISTAKES = {
    "gqa": "you counted K/V for every query head (num_heads); with grouped-query attention the "
           "cache holds num_kv_heads heads, and a query head group shares one KV head's rows",
    "no_v": "you counted the keys only: the values are read too (2 x)",
    "one_layer": "you counted one layer: every layer has its own cache and reads it each step",
    "padded": "you counted whole blocks (ceil(seq_len / block_size) x block_size slots); the "
              "slots past seq_len in the last block are never read",
    "max_pad": "you counted max(seq_lens) tokens for every sequence, as a padded batch would "
               "(the PyTorch reference gathers that much); each sequence must read only its "
               "own seq_len tokens",
    "fp32": "you assumed 4 bytes per element; the size comes from the dtype "
            "(float16/bfloat16: 2 bytes, `torch.tensor([], dtype=dtype).element_size()`)",
    "elements": "you counted elements, not bytes: multiply by the dtype's element size",
    "no_qo": "you left out the query read and the output written (num_seqs x num_heads x "
             "head_size elements each, per layer)",
    "q_only": "you counted the query but not the output written back",
}


def _bytes_variant(seq_lens, num_layers, num_heads, num_kv_heads, head_size, block_size, dtype,
                   flags=()) -> int:
    elem = 1 if "elements" in flags else 4 if "fp32" in flags else _element_size(dtype)
    kv_heads = num_heads if "gqa" in flags else num_kv_heads
    lens = [max(seq_lens)] * len(seq_lens) if "max_pad" in flags else list(seq_lens)
    if "padded" in flags:
        lens = [-(-n // block_size) * block_size for n in lens]
    kv = (1 if "no_v" in flags else 2) * sum(lens) * kv_heads * head_size * elem
    rows = len(seq_lens) * num_heads * head_size * elem
    qo = 0 if "no_qo" in flags else rows if "q_only" in flags else 2 * rows
    return (1 if "one_layer" in flags else num_layers) * (kv + qo)


def _find_flags(got, variant, catalogue, exclusive=()) -> list[tuple[str, ...]]:
    """The fewest catalogued mistakes (one, else two) that reproduce `got`:
    every such set, since some give the same number; [] if none does."""
    names = list(catalogue)
    for size in (1, 2):
        found = []
        for flags in itertools.combinations(names, size):
            if any(set(pair) <= set(flags) for pair in exclusive):
                continue
            want = variant(flags)
            if want and math.isclose(got, want, rel_tol=1e-9):
                found.append(flags)
        if found:
            return found
    return []


def _name_mistakes(found, catalogue) -> str:
    """'It looks like ...' for the sets of mistakes `_find_flags` returned."""
    if not found:
        return ""
    said = ["; and ".join(catalogue[f] for f in flags) for flags in found]
    return "It looks like " + ".\nOr perhaps ".join(said) + ".\n"


def _as_number(value, what: str) -> float:
    assert value is not None, f"your {what} returned None: return the number."
    with learner_code(f"the value your {what} returned", "return one number (an int or a float)."):
        return float(value)


LLAMA_8B = dict(num_layers=32, num_heads=32, num_kv_heads=8, head_size=128)
SHIPPED = dict(num_layers=4, num_heads=6, num_kv_heads=2, head_size=32)

_BYTES_CASES = [
    ("a Llama-3-8B-like model (32 layers, 32 query heads, 8 KV heads of 128, float16), "
     "4 sequences", [4096, 1000, 37, 2049], LLAMA_8B, 16, torch.float16),
    ("the shipped model (4 layers, 6 query heads, 2 KV heads of 32, float32)",
     [17, 100, 5], SHIPPED, 16, torch.float32),
    ("a model without GQA (12 layers, 12 heads of 64, bfloat16), one sequence",
     [300], dict(num_layers=12, num_heads=12, num_kv_heads=12, head_size=64), 32,
     torch.bfloat16),
]


def exercise_2(decode_bytes) -> None:
    for what, seq_lens, model, block_size, dtype in _BYTES_CASES:
        args = dict(seq_lens=list(seq_lens), **model, block_size=block_size, dtype=dtype)
        want = oracle_bytes(seq_lens, dtype=dtype, **model)
        with learner_code(f"your decode_bytes, for {what},",
                          "use the arguments by name: seq_lens, num_layers, num_heads, "
                          "num_kv_heads, head_size, block_size, dtype."):
            result = decode_bytes(**{**args, "seq_lens": list(seq_lens)})
        got = _as_number(result, "decode_bytes")
        if got == want:
            continue
        flags = _find_flags(
            got, lambda f, a=args: _bytes_variant(**a, flags=f), _BYTES_MISTAKES,
            exclusive=[("fp32", "elements"), ("no_qo", "q_only")],
        )
        raise AssertionError(
            f"{what}, seq_lens {seq_lens}, block_size {block_size}: expected {want:,} bytes, "
            f"got {got:,.0f}.\n"
            + _name_mistakes(flags, _BYTES_MISTAKES)
            + "Per layer: K and V (2) of every context token (sum of seq_lens) for every KV head, "
            "head_size elements each, plus the query read and the output written (num_seqs x "
            "num_heads x head_size each); all times the element size, times num_layers. "
            "block_size does not enter: only the tokens a sequence has are read."
        )
    ref = reference_run()
    for step in (ref.steps[0], ref.steps[-1]):
        counted = sum(c.bytes_read for c in step.calls)
        call = step.calls[0]
        args = dict(seq_lens=call.seq_lens, **ref.config, block_size=call.block_size,
                    dtype=call.dtype)
        with learner_code("your decode_bytes, for a step of the engine,", ""):
            got = _as_number(decode_bytes(**args), "decode_bytes")
        assert got == counted, (
            f"decode step {step.step} of a real run of the shipped model: its "
            f"{len(step.calls)} attention layers were handed {len(call.seq_lens)} sequences of "
            f"{call.seq_lens} tokens and read {counted:,} bytes of K, V, query and output; your "
            f"decode_bytes({args}) gives {got:,.0f}."
        )
    passed(DAY, 2)


# Exercise 3: the FLOPs of a decode step ------------------------------------------------


def oracle_flops(seq_lens, num_layers, num_heads, num_kv_heads, head_size) -> int:
    """FlopCounterMode's count of a reference decode, layer by layer and
    sequence by sequence, on meta tensors (shapes only, nothing computed)."""
    return _counted_flops(tuple(seq_lens), num_layers, num_heads, num_kv_heads, head_size)


@functools.cache
def _counted_flops(seq_lens, num_layers, num_heads, num_kv_heads, head_size) -> int:
    group = num_heads // num_kv_heads
    meta = dict(device="meta", dtype=torch.float16)
    with FlopCounterMode(display=False) as counter:
        for _ in range(num_layers):
            for n in seq_lens:
                q = torch.empty(num_heads, 1, head_size, **meta)
                k = torch.empty(num_kv_heads, n, head_size, **meta).repeat_interleave(group, 0)
                v = torch.empty(num_kv_heads, n, head_size, **meta).repeat_interleave(group, 0)
                probs = torch.softmax(q @ k.transpose(1, 2), dim=-1)
                probs @ v
    return counter.get_total_flops()


_FLOPS_MISTAKES = {
    "kv_heads": "you counted num_kv_heads heads; GQA shares the K/V *rows*, not the arithmetic: "
                "every query head computes its own q.k and p.v, so FLOPs scale with num_heads",
    "macs": "you counted multiply-adds: each is 2 FLOPs (a multiply and an add)",
    "qk_only": "you counted the scores q.k but not the weighted sum of V (p.v), which costs "
               "as much",
    "one_layer": "you counted one layer: every layer does its own attention",
    "max_pad": "you counted max(seq_lens) tokens for every sequence: each attends to its own "
               "seq_len tokens",
    "per_token_d2": "you counted head_size^2 per token: a dot product of length head_size is "
                    "head_size multiply-adds",
}


def _flops_variant(seq_lens, num_layers, num_heads, num_kv_heads, head_size, flags=()) -> int:
    heads = num_kv_heads if "kv_heads" in flags else num_heads
    lens = [max(seq_lens)] * len(seq_lens) if "max_pad" in flags else list(seq_lens)
    per_mac = 1 if "macs" in flags else 2
    products = 1 if "qk_only" in flags else 2
    d = head_size**2 if "per_token_d2" in flags else head_size
    layers = 1 if "one_layer" in flags else num_layers
    return layers * products * per_mac * heads * d * sum(lens)


def exercise_3(decode_flops) -> None:
    cases = [(what, seq_lens, model) for what, seq_lens, model, _, _ in _BYTES_CASES[:2]]
    for what, seq_lens, model in cases:
        args = dict(seq_lens=list(seq_lens), **model)
        want = oracle_flops(seq_lens, **model)
        with learner_code(f"your decode_flops, for {what},",
                          "use the arguments by name: seq_lens, num_layers, num_heads, "
                          "num_kv_heads, head_size."):
            result = decode_flops(**{**args, "seq_lens": list(seq_lens)})
        got = _as_number(result, "decode_flops")
        if got == want:
            continue
        flags = _find_flags(got, lambda f, a=args: _flops_variant(**a, flags=f), _FLOPS_MISTAKES)
        raise AssertionError(
            f"{what}, seq_lens {seq_lens}: FlopCounterMode counts {want:,} FLOPs for a "
            f"reference decode (q @ k^T and p @ v per sequence and layer), you got {got:,.0f}.\n"
            + _name_mistakes(flags, _FLOPS_MISTAKES)
            + "Per layer, per sequence, per query head: the scores are seq_len dot products of "
            "length head_size, the weighted sum of V another seq_len x head_size multiply-adds; "
            "2 FLOPs per multiply-add. The softmax is left out, as FlopCounterMode does."
        )
    passed(DAY, 3)


# Exercise 4: the roofline --------------------------------------------------------------

# (what, flops, bytes, peak FLOP/s, bandwidth B/s): an H100's decode attention
# and a prefill-sized matmul, and this kind of CPU.
_ROOFLINE_CASES = [
    ("adding two float32 vectors of 1e8 elements on an H100 (1e8 FLOPs, 1.2e9 bytes; 989 "
     "TFLOP/s, 3.35 TB/s)", 1e8, 1.2e9, 989e12, 3.35e12),
    ("decode attention of 32 x 4096 tokens, Llama-3-8B-like, on an H100 (989 TFLOP/s, "
     "3.35 TB/s)", 6.87e10, 1.72e10, 989e12, 3.35e12),
    ("an 8192 x 8192 x 8192 matmul in float16 on the same H100 (1.1e12 FLOPs, 4e8 bytes)",
     1.1e12, 4.0e8, 989e12, 3.35e12),
    ("the shipped model's decode attention on a laptop CPU (50 GFLOP/s, 20 GB/s)",
     1.2e7, 8.1e6, 5.0e10, 2.0e10),
]

_ROOFLINE_MISTAKES = {
    "min": "you took the smaller of the two times: a kernel cannot finish before *both* its "
           "bytes are moved and its FLOPs done, so the floor is the larger (max)",
    "sum": "you added the two times: that assumes no overlap; the roofline assumes the "
           "arithmetic hides under the memory traffic (or the other way round), so the floor "
           "is max(flops / peak, bytes / bandwidth)",
    "memory_only": "you returned bytes / bandwidth whatever the case: a compute-bound kernel "
                   "(the matmul) is limited by flops / peak_flops",
    "compute_only": "you returned flops / peak_flops whatever the case: a memory-bound kernel "
                    "(decode attention) is limited by bytes / bandwidth",
    "inverted": "you divided the rates by the work (bandwidth / bytes): time = work / rate",
}

_BOUND_MISTAKES = {
    "reversed": "you named the other bound: the kernel is memory-bound when moving its bytes "
                "takes longer than doing its FLOPs (its arithmetic intensity, flops / bytes, "
                "is below the ridge point peak_flops / bandwidth)",
    "vs_one": "you compared flops with bytes directly (intensity above 1 means compute-bound?). "
              "The threshold is the machine's ridge point, peak_flops / bandwidth (about 295 "
              "FLOPs per byte on an H100), not 1",
}


def _bound_name(value) -> str:
    text = str(value).lower().strip()
    if text.startswith("memory"):
        return "memory"
    if text.startswith("compute"):
        return "compute"
    return text


def exercise_4(roofline, bandwidth_fraction) -> None:
    for what, flops, nbytes, peak, bw in _ROOFLINE_CASES:
        t_mem, t_math = nbytes / bw, flops / peak
        want = max(t_mem, t_math)
        want_bound = "memory" if t_mem >= t_math else "compute"
        with learner_code(f"your roofline, for {what},",
                          "return (seconds, bound): the floor on the time and 'memory' or "
                          "'compute'."):
            result = roofline(flops, nbytes, peak, bw)
            assert isinstance(result, (tuple, list)) and len(result) == 2, (
                f"your roofline returned {result!r}: return a pair (seconds, bound), e.g. "
                "(0.0051, 'memory')."
            )
            seconds, bound = result
        got = _as_number(seconds, "roofline's seconds")
        if not math.isclose(got, want, rel_tol=1e-6):
            variants = {"min": min(t_mem, t_math), "sum": t_mem + t_math, "memory_only": t_mem,
                        "compute_only": t_math, "inverted": max(bw / nbytes, peak / flops)}
            named = [(k,) for k, v in variants.items() if math.isclose(got, v, rel_tol=1e-6)]
            raise AssertionError(
                f"{what}: the floor is max({flops:.3g} / {peak:.3g}, {nbytes:.3g} / {bw:.3g}) = "
                f"max({t_math:.3g} s, {t_mem:.3g} s) = {want:.3g} s; you returned {got:.3g} s.\n"
                + _name_mistakes(named, _ROOFLINE_MISTAKES)
                + "All quantities are in base units: FLOPs, bytes, FLOP/s, bytes/s, seconds."
            )
        assert _bound_name(bound) in ("memory", "compute"), (
            f"{what}: your roofline said the bound is {bound!r}: return 'memory' or 'compute'."
        )
        if _bound_name(bound) != want_bound:
            # The first case (intensity below 1, memory-bound) tells the two apart.
            vs_one = "compute" if flops > nbytes else "memory"
            named = "vs_one" if _bound_name(bound) == vs_one else "reversed"
            raise AssertionError(
                f"{what}: moving the bytes takes {t_mem:.3g} s, the FLOPs {t_math:.3g} s, so the "
                f"kernel is {want_bound}-bound; you said {bound!r}.\n"
                f"It looks like {_BOUND_MISTAKES[named]}. Return 'memory' or 'compute'."
            )
    fraction_cases = [
        ("v2 on the H100 case above, measured 6.4 ms", 1.72e10, 6.4e-3, 3.35e12),
        ("the Numba kernel on a CPU, 8.4 MB in 12 ms against 13 GB/s", 8.4e6, 1.2e-2, 1.3e10),
    ]
    for what, nbytes, seconds, bw in fraction_cases:
        want = nbytes / seconds / bw
        with learner_code(f"your bandwidth_fraction, for {what},",
                          "return one number: the achieved bytes/s over the bandwidth."):
            got = _as_number(bandwidth_fraction(nbytes, seconds, bw), "bandwidth_fraction")
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        variants = {
            "you inverted it (seconds x bandwidth / bytes): the fraction is achieved / available "
            "= (bytes / seconds) / bandwidth, at most 1": seconds * bw / nbytes,
            "you returned a percentage: return the fraction (0.8, not 80)": 100 * want,
            "you returned the achieved bytes/s; divide by the bandwidth": nbytes / seconds,
            "you returned the time the bytes need at full bandwidth (bytes / bandwidth); "
            "divide that by the measured seconds": nbytes / bw,
        }
        named = next((k for k, v in variants.items() if math.isclose(got, v, rel_tol=1e-6)), None)
        raise AssertionError(
            f"{what}: (bytes / seconds) / bandwidth = ({nbytes:.3g} / {seconds:.3g}) / "
            f"{bw:.3g} = {want:.3g}; you returned {got:.3g}.\n"
            + (f"It looks like {named}.\n" if named else "")
        )
    passed(DAY, 4)


# Part 1: what v2 launches -----------------------------------------------------------


def v2_launches(seq_lens=(1100, 300), num_heads: int = 4, num_kv_heads: int = 2,
                head_size: int = 64, block_size: int = 16) -> list[Launch]:
    """The two launches `_custom_ops.paged_attention_v2` makes (the partition
    kernel, then the reduce), recorded on CPU tensors: nothing is computed."""
    max_len = max(seq_lens)
    max_blocks = -(-max_len // block_size)
    num_seqs = len(seq_lens)
    query = torch.zeros(num_seqs, num_heads, head_size)
    kv_cache = torch.zeros(2, num_seqs * max_blocks + 1, block_size, num_kv_heads, head_size)
    tables = torch.arange(1, num_seqs * max_blocks + 1).view(num_seqs, max_blocks)
    with recorded_launches() as launches:
        ops.paged_attention_v2(torch.empty_like(query), query, kv_cache[0], kv_cache[1], tables,
                               torch.tensor(seq_lens), head_size**-0.5, max_len)
    return launches


@dataclass
class EmulatedV2:
    """The buffers of one emulated `paged_attention_v2` run: what the first
    kernel wrote, and what the reduce kernel made of it."""

    seq_lens: torch.Tensor
    max_logits: torch.Tensor
    exp_sums: torch.Tensor
    tmp_out: torch.Tensor
    out: torch.Tensor  # the reduce kernel's output
    reference: torch.Tensor  # the PyTorch backend's decode on the same inputs


def emulated_v2(seq_lens=(1100, 300, 520), num_heads: int = 4, num_kv_heads: int = 2,
                head_size: int = 64, block_size: int = 16, seed: int = 0) -> EmulatedV2 | None:
    """Run the real `paged_attention_v2` of reference_impl/csrc/paged_attention.cu
    in the CPU emulator (minivllm/cuda_emu) and keep its intermediate buffers.
    None if there is no C++ compiler. The first call compiles the kernels
    (several seconds); later calls reuse them."""
    from minivllm import cuda_emu

    if cuda_emu.compiler() is None:
        return None
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g)
    tables = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=g)
    lens = torch.tensor(seq_lens)
    out = torch.empty_like(query)
    buffers: list = []
    with cuda_emu.emulated_custom_ops():
        launch = ops._launch

        def keep(kernel, grid, args, shared_mem=0):
            buffers.append(args)
            launch(kernel, grid, args, shared_mem)

        ops._launch = keep
        try:
            ops.paged_attention_v2(out, query, kv_cache[0], kv_cache[1], tables, lens,
                                   head_size**-0.5, max(seq_lens))
        finally:
            ops._launch = launch
    exp_sums, max_logits, tmp_out = buffers[0][:3]
    reference = TorchPagedAttention(num_heads, head_size, head_size**-0.5,
                                    num_kv_heads).forward_decode(query, kv_cache, tables, lens,
                                                                 max(seq_lens))
    return EmulatedV2(lens, max_logits, exp_sums, tmp_out, out, reference)


def gpu_problem() -> str | None:
    """Why the CUDA kernels cannot run here, or None where they can."""
    if not torch.cuda.is_available():
        return "no NVIDIA GPU here (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is missing: pip install -e '.[cuda]'"
    return None
