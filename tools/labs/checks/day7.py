"""Checkers for Day 7, the paged-attention kernel (labs/day7_paged_attention_kernel.ipynb).

Exercise 1 (the launch configuration, in Python) is compared with the launch that
`minivllm._custom_ops.paged_attention_v1` really makes (recorded on CPU tensors: no GPU, nothing
computed) and with the kernel's compile-time constants.

Exercises 2-4 are CUDA C: each is one `__device__` function that this module splices into a
copy of reference_impl/csrc/paged_attention.cu in place of the stage it replaces, compiles for
the CPU emulator (`minivllm.cuda_emu`: one fiber per CUDA thread, real barriers and warp
shuffles) and runs twice:

- in a small *probe* kernel that calls only the learner's function and writes what it computed
  (logits; softmax numerators, max and sum; an output row) to memory, so that a wrong answer
  can be named precisely;
- in the whole v1 kernel, launched by the real launcher `_custom_ops.paged_attention_v1`,
  against the engine's PyTorch reference (`TorchPagedAttention.forward_decode`): permuted
  block tables with a shared block, GQA (4 query heads on 2 KV heads), lengths 1,
  block_size - 1, block_size, block_size + 1 and one longer than the four warps cover in one
  pass; float32 with blocks of 8 (4 lanes a token), float16 with blocks of 16 (2 lanes a
  token, loads of 4 elements). Cache rows that no sequence owns hold a huge key and a NaN
  value, so reading one shows.

Exercise 4 then runs the engine (the shipped model, greedy) with the learner's kernel as its
decode attention and compares the tokens with the PyTorch backend's.

Launches run in a forked child process with a time limit, so that an infinite loop or a wild
pointer in the learner's CUDA costs an error message, not the notebook. Compiles use -O0 (the
emulator's time goes to switching fibers, not to the kernel's arithmetic, and -O0 compiles
several times faster than the emulator's own -O2) and are cached on disk by content.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import re
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from minivllm import LLM, SamplingParams, cuda_emu
from minivllm import _custom_ops as ops
from minivllm.assets import DEFAULT_MODEL
from minivllm.attention.backends.torch_paged import TorchPagedAttention
from tools.labs.checks._common import needs, passed
from tools.labs.checks._engine_runs import quiet_engine
from tools.labs.checks.day4 import recorded_launches

__all__ = ["exercise_1", "exercise_2", "exercise_3", "exercise_4", "engine_texts", "gpu_compare",
           "gpu_problem", "kernel_lines", "needs", "real_launch", "thread_map"]

DAY = 7
KERNEL_FILE = ops.CSRC_DIR / "paged_attention.cu"
WARP_SIZE = 32
NUM_WARPS = ops.NUM_THREADS // WARP_SIZE
# Large enough that a stale q.k dwarfs every real logit, small enough for float16.
STALE_KEY = 1e4


# -- reading the kernel ---------------------------------------------------------------


def kernel_lines(*patterns: str) -> list[tuple[int, str]]:
    """(line number, line) of paged_attention.cu for each line containing one of `patterns`."""
    lines = KERNEL_FILE.read_text().splitlines()
    return [(i, line.rstrip()) for i, line in enumerate(lines, 1)
            if any(p in line for p in patterns)]


def thread_map(thread: int, *, block_size: int, seq_len: int, block_table: list[int],
               head_size: int = 64, dtype: torch.dtype = torch.float32) -> list[str]:
    """What one CUDA thread of a v1 thread block does, stage by stage, following
    paged_attention.cu: the tokens it loads keys for (stage 2), and the output dimensions it
    accumulates (stage 4). A plain-Python reading aid, no kernel runs."""
    tgs = WARP_SIZE // block_size
    vec = max(16 // (tgs * dtype.itemsize), 1)
    chunk = tgs * vec
    warp, lane = divmod(thread, WARP_SIZE)
    group, rank = divmod(lane, tgs)
    num_blocks = -(-seq_len // block_size)
    out = [f"thread {thread}: warp {warp}, lane {lane}, thread group {group}, rank {rank} in it"]
    for b in range(warp, num_blocks, NUM_WARPS):
        token = b * block_size + group
        if token >= seq_len:
            out.append(f"  stage 2, logical block {b} -> physical {block_table[b]}: token {token} "
                       f">= seq_len {seq_len}: loads nothing, still joins the shuffles")
            continue
        elems = [base + j for base in range(rank * vec, head_size, chunk) for j in range(vec)]
        shown = ", ".join(map(str, elems[:8])) + (", ..." if len(elems) > 8 else "")
        out.append(f"  stage 2, logical block {b} -> physical {block_table[b]}, row {group}: "
                   f"token {token}, key elements {shown} ({len(elems)} of {head_size})")
    dims = list(range(lane, head_size, WARP_SIZE))
    blocks = list(range(warp, num_blocks, NUM_WARPS))
    out.append(f"  stage 4: output dimensions {dims}, summed over the tokens of blocks {blocks}")
    return out


# -- exercise 1: the launch configuration --------------------------------------------


@dataclass
class Launch:
    """One launch of the v1 kernel as `_custom_ops.paged_attention_v1` makes it."""

    kernel: str  # the template instantiation
    grid: tuple[int, ...]
    block: tuple[int, ...]
    shared_mem: int  # dynamic shared memory, bytes


def real_launch(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                block_size: int, max_seq_len: int, dtype: torch.dtype = torch.float32) -> Launch:
    """Call the real launcher on empty CPU tensors with the kernel lookup and the launch
    replaced by a recorder: the launch it would make on a GPU, computing nothing."""
    max_blocks = -(-max_seq_len // block_size)
    query = torch.empty(num_seqs, num_heads, head_size, dtype=dtype)
    cache = torch.empty(1, block_size, num_kv_heads, head_size, dtype=dtype)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
    seq_lens = torch.full((num_seqs,), max_seq_len, dtype=torch.int64)
    with recorded_launches() as launches:
        ops.paged_attention_v1(torch.empty_like(query), query, cache, cache, tables, seq_lens,
                               head_size**-0.5, max_seq_len)
    launch = launches[0]
    return Launch(launch.kernel, launch.grid, (ops.NUM_THREADS,), launch.shared_mem)


def reference_config(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                     block_size: int, max_seq_len: int, dtype: torch.dtype) -> dict:
    """The answer to exercise 1: the recorded launch, and the constants the kernel derives
    from its template parameters (the constexpr lines of paged_attention_partition)."""
    launch = real_launch(num_seqs, num_heads, num_kv_heads, head_size, block_size, max_seq_len,
                         dtype)
    tgs = WARP_SIZE // block_size
    group_bytes = tgs * dtype.itemsize
    num_warps = launch.block[0] // WARP_SIZE
    return {
        "kernel": launch.kernel,
        "grid": launch.grid,
        "threads": launch.block[0],
        "num_warps": num_warps,
        "thread_group_size": tgs,
        "vec_size": 1 if group_bytes >= 16 else 16 // group_bytes,
        "dims_per_lane": -(-head_size // WARP_SIZE),
        # q_smem[HEAD_SIZE], red_smem[NUM_WARPS], out_smem[NUM_WARPS][HEAD_SIZE]: floats
        "static_smem_bytes": 4 * (head_size + num_warps + num_warps * head_size),
        "dynamic_smem_bytes": launch.shared_mem,
    }


# (num_seqs, num_heads, num_kv_heads, head_size, block_size, max_seq_len, dtype, what)
LAUNCH_CASES = [
    (3, 6, 2, 64, 16, 40, torch.float32, "3 sequences, 6 query heads on 2 KV heads"),
    (2, 8, 8, 128, 8, 17, torch.float16, "float16, blocks of 8, no GQA"),
    (5, 4, 1, 64, 32, 100, torch.bfloat16, "bfloat16, blocks of 32, one KV head"),
    (1, 32, 8, 128, 16, 8192, torch.float16, "the longest context v1 takes"),
    (4, 16, 4, 256, 16, 1000, torch.float32, "head_size 256"),
    (2, 10, 2, 80, 16, 50, torch.float16, "head_size 80, not a multiple of 32"),
]

KEYS = ("kernel", "grid", "threads", "num_warps", "thread_group_size", "vec_size",
        "dims_per_lane", "static_smem_bytes", "dynamic_smem_bytes")


def _config_mistake(key: str, got, want: dict, case: tuple) -> str:
    """The likely misconception behind one wrong entry of exercise 1, or ''."""
    num_seqs, num_heads, num_kv_heads, head_size, block_size, max_seq_len, dtype, _ = case
    size = dtype.itemsize
    tgs = want["thread_group_size"]
    if key == "grid":
        if isinstance(got, int) or len(got) == 1:
            return "v1's grid has two dimensions, (num_heads, num_seqs)."
        if tuple(got) == (num_seqs, num_heads):
            return ("the grid is (num_heads, num_seqs): blockIdx.x is the query head, "
                    "blockIdx.y the sequence (the kernel reads `head = blockIdx.x`).")
        if tuple(got) in ((num_kv_heads, num_seqs), (num_seqs, num_kv_heads)):
            return ("one thread block per *query* head: with GQA several thread blocks read "
                    "the same KV head, each for its own query row.")
    if key == "dynamic_smem_bytes":
        if got == max_seq_len * 4:
            return ("the launcher rounds max_seq_len up to whole blocks before sizing the "
                    "logits (stage 2 walks whole blocks).")
        if got == want[key] // 4:
            return "shared memory is given in bytes: one float (4 bytes) per token."
        if got == want[key] * size // 4:
            return "the logits are float32 whatever the cache's dtype: 4 bytes per token."
    if key == "thread_group_size" and got == block_size:
        return ("a thread group is the lanes that share one token: WARP_SIZE / BLOCK_SIZE "
                "lanes, so that one warp covers one block of BLOCK_SIZE tokens.")
    if key == "vec_size":
        if got == max(16 // (tgs * 4), 1) and size != 4:
            return (f"VEC_SIZE depends on the dtype: a group loads 16 bytes at once, "
                    f"{size}-byte elements here.")
        if got == 16 // size:
            return ("16 bytes is what a whole thread *group* loads at once, shared by its "
                    "THREAD_GROUP_SIZE lanes: VEC_SIZE = 16 / (THREAD_GROUP_SIZE * sizeof).")
    if key == "static_smem_bytes" and got == 4 * (head_size + want["num_warps"]):
        return ("count out_smem too: stage 4 keeps one float per (warp, dimension) for the "
                "cross-warp sum.")
    if key == "dims_per_lane" and got == head_size // 32:
        return ("a lane owns ceil(HEAD_SIZE / WARP_SIZE) dimensions: rounded up, so that "
                "the warp covers every dimension when HEAD_SIZE is not a multiple of 32 "
                "(the lanes past it skip their last one).")
    if key == "kernel":
        return ("the instantiation is paged_attention_v1_kernel<dtype, HEAD_SIZE, BLOCK_SIZE, "
                "NUM_THREADS>, with the dtypes.cuh names float / fp16_t / bf16_t "
                "(`paged_attention_kernel_names` in _custom_ops.py).")
    return ""


def exercise_1(launch_config) -> None:
    for case in LAUNCH_CASES:
        *args, what = case
        want = reference_config(*args)
        result = launch_config(*args)
        assert isinstance(result, dict), (
            f"launch_config returned {type(result).__name__}; return a dict with the keys "
            f"{', '.join(KEYS)}."
        )
        missing = [k for k in KEYS if k not in result]
        assert not missing, f"your dict has no {', '.join(missing)}."
        for key in KEYS:
            got = result[key]
            if key == "grid":
                got = tuple(int(g) for g in got) if not isinstance(got, int) else got
            if got == want[key]:
                continue
            closer = _config_mistake(key, got, want, case)
            raise AssertionError(
                f"{what} (num_seqs={args[0]}, num_heads={args[1]}, num_kv_heads={args[2]}, "
                f"head_size={args[3]}, block_size={args[4]}, max_seq_len={args[5]}, "
                f"{str(args[6]).removeprefix('torch.')}): {key} should be {want[key]!r}, "
                f"got {got!r}.\n" + (f"It looks like {closer}\n" if closer else "")
                + "The launcher is `paged_attention_v1` in reference_impl/minivllm/_custom_ops.py; "
                "the constants are the constexpr lines at the top of paged_attention_partition "
                "in reference_impl/csrc/paged_attention.cu."
            )
    passed(DAY, 1)


# -- the learner's CUDA: fragments, splicing, compiling --------------------------------

FUNCTIONS = {2: "qk_logit", 3: "softmax_numerators", 4: "weighted_values"}
_MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


def _fragment(source, k: int) -> str:
    """The learner's CUDA for exercise k, markers dropped; NotImplementedError while the
    lab's placeholder is still in it."""
    name = FUNCTIONS[k]
    if not isinstance(source, str):
        raise AssertionError(
            f"exercise {k} takes the CUDA source of `{name}` as a string (the r\"\"\"...\"\"\" of "
            f"the exercise cell), got {type(source).__name__}."
        )
    if f'raise NotImplementedError("Day {DAY}, exercise {k}")' in source:
        raise NotImplementedError(f"Day {DAY}, exercise {k}")
    # Marker lines become blank ones: compiler messages keep the cell's line numbers.
    text = "\n".join("" if line.strip() in _MARKERS else line for line in source.split("\n"))
    if not re.search(rf"\b{name}\s*\(", text):
        raise AssertionError(
            f"the source has no function `{name}`: keep the template line and the signature of "
            "the exercise cell, and write the body."
        )
    return text


# Each stage of paged_attention_partition that a learner's function replaces: the text of
# the .cu file from `start` up to (not including) `end`, and what stands in its place.
_STAGES = {
    2: ("  float qk_max = neg_infinity();\n", "\n  // 3. Softmax",
        "  float qk_max = neg_infinity();\n"
        "  for (int b = block_start + warp; b < block_end; b += NUM_WARPS) {\n"
        "    const int token = b * BLOCK_SIZE + group;\n"
        "    const float dot = qk_logit<scalar_t, HEAD_SIZE, BLOCK_SIZE>(\n"
        "        q_smem, scale, key_cache, block_table, b, token_end, head, num_heads,\n"
        "        num_kv_heads);\n"
        "    if (token < token_end && rank == 0) {\n"
        "      logits[token - token_start] = dot;\n"
        "      qk_max = fmaxf(qk_max, dot);\n"
        "    }\n"
        "  }\n"),
    3: ("  qk_max = block_reduce<NUM_WARPS, true>(qk_max, red_smem);\n",
        "\n  // 4. Weighted sum of V.",
        "  const float exp_sum = softmax_numerators<NUM_THREADS>(logits, num_tokens, qk_max,"
        " red_smem);\n"),
    4: ("  float acc[DIMS_PER_LANE];\n", "  if (PARTITION_SIZE > 0 && threadIdx.x == 0) {",
        "  static_assert(PARTITION_SIZE == 0, \"the lab's weighted_values is v1's\");\n"
        "  weighted_values<scalar_t, out_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(\n"
        "      out_row, logits, exp_sum, value_cache, block_table, token_end, kv_head,"
        " num_kv_heads);\n"),
}
_INSERT_BEFORE = "// The shared body"
# With the lab's qk_logit, stage 1 keeps the query unscaled and qk_logit applies `scale`
# (where vLLM applies it: to each dot product).
_STAGE_1 = ("q_smem[d] = to_float(q[d]) * scale;", "q_smem[d] = to_float(q[d]);")


def kernel_source(fragments: dict[int, str]) -> str:
    """paged_attention.cu with the stages of `fragments` ({exercise: CUDA function}) replaced
    by calls to the learner's functions, which are inserted before the shared body.
    `#line` directives make compiler messages point at the learner's own lines."""
    source = KERNEL_FILE.read_text()
    if 2 in fragments:
        if _STAGE_1[0] not in source:
            raise RuntimeError(f"paged_attention.cu changed: update _STAGE_1 in {__file__}")
        source = source.replace(*_STAGE_1)
    for k in sorted(fragments):
        start, end, call = _STAGES[k]
        i, j = source.find(start), source.find(end)
        if i < 0 or j < i:
            raise RuntimeError(f"paged_attention.cu changed: update _STAGES[{k}] in {__file__}")
        source = source[:i] + call + source[j:]
    at = source.index(_INSERT_BEFORE)
    line = source[:at].count("\n") + 1
    inserted = "".join(
        f'#line 1 "exercise {k} ({FUNCTIONS[k]})"\n{fragments[k]}\n'
        for k in sorted(fragments)
    )
    return (source[:at] + inserted + f'#line {line} "paged_attention.cu"\n' + source[at:])


# Probes: one learner function each, on inputs the checker chose; results to memory.
_PROBES = {
    2: r"""
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void probe_qk_logit(float* __restrict__ logits_out,  // [num_seqs, num_heads, max_len]
                               const scalar_t* __restrict__ query,
                               const scalar_t* __restrict__ key_cache,
                               const long long* __restrict__ block_tables,
                               const long long* __restrict__ seq_lens, const int num_kv_heads,
                               const int max_num_blocks_per_seq, const int max_len,
                               const float scale) {
  constexpr int NUM_WARPS = 4;
  constexpr int THREAD_GROUP_SIZE = WARP_SIZE / BLOCK_SIZE;
  const int head = blockIdx.x, num_heads = gridDim.x, seq = blockIdx.y;
  const int seq_len = static_cast<int>(seq_lens[seq]);
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  __shared__ float q_smem[HEAD_SIZE];
  const scalar_t* q = query + (static_cast<long long>(seq) * num_heads + head) * HEAD_SIZE;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += blockDim.x) q_smem[d] = to_float(q[d]);
  __syncthreads();
  const long long* table = block_tables + static_cast<long long>(seq) * max_num_blocks_per_seq;
  float* row = logits_out + (static_cast<long long>(seq) * num_heads + head) * max_len;
  const int num_blocks = (seq_len + BLOCK_SIZE - 1) / BLOCK_SIZE;
  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const float dot = qk_logit<scalar_t, HEAD_SIZE, BLOCK_SIZE>(
        q_smem, scale, key_cache, table, b, seq_len, head, num_heads, num_kv_heads);
    const int token = b * BLOCK_SIZE + lane / THREAD_GROUP_SIZE;
    if (token < seq_len && lane % THREAD_GROUP_SIZE == 0) row[token] = dot;
  }
}
""",
    3: r"""
template <int NUM_THREADS, int BLOCK_SIZE>
__global__ void probe_softmax(float* __restrict__ numerators_out,  // [num_cases, max_len]
                              float* __restrict__ max_out,         // [num_cases, NUM_THREADS]
                              float* __restrict__ sum_out,         // [num_cases, NUM_THREADS]
                              const float* __restrict__ logits_in, // [num_cases, max_len]
                              const long long* __restrict__ lens, const int max_len) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  constexpr int THREAD_GROUP_SIZE = WARP_SIZE / BLOCK_SIZE;
  extern __shared__ float logits[];
  __shared__ float red_smem[NUM_WARPS];
  const int c = blockIdx.x;
  const int n = static_cast<int>(lens[c]);
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  // Stage 2's stores, as in the kernel: token t of block b is written by warp b % NUM_WARPS,
  // the first lane of its thread group, which keeps the max of what it wrote.
  float qk_max = neg_infinity();
  for (int b = warp; b < (n + BLOCK_SIZE - 1) / BLOCK_SIZE; b += NUM_WARPS) {
    const int token = b * BLOCK_SIZE + lane / THREAD_GROUP_SIZE;
    if (token < n && lane % THREAD_GROUP_SIZE == 0) {
      const float l = logits_in[static_cast<long long>(c) * max_len + token];
      logits[token] = l;
      qk_max = fmaxf(qk_max, l);
    }
  }
  const float exp_sum = softmax_numerators<NUM_THREADS>(logits, n, qk_max, red_smem);
  max_out[c * NUM_THREADS + threadIdx.x] = qk_max;
  sum_out[c * NUM_THREADS + threadIdx.x] = exp_sum;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += NUM_THREADS)
    numerators_out[static_cast<long long>(c) * max_len + i] = logits[i];
}
""",
    4: r"""
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void probe_weighted_values(scalar_t* __restrict__ out,  // [seqs, heads, HEAD_SIZE]
                                      const float* __restrict__ probs_in,  // [.., max_len]
                                      const float* __restrict__ exp_sums,  // [seqs, heads]
                                      const scalar_t* __restrict__ value_cache,
                                      const long long* __restrict__ block_tables,
                                      const long long* __restrict__ seq_lens,
                                      const int num_kv_heads, const int max_num_blocks_per_seq,
                                      const int max_len) {
  extern __shared__ float probs[];
  const int head = blockIdx.x, num_heads = gridDim.x, seq = blockIdx.y;
  const int seq_len = static_cast<int>(seq_lens[seq]);
  const long long row = static_cast<long long>(seq) * num_heads + head;
  for (int i = threadIdx.x; i < seq_len; i += NUM_THREADS) probs[i] = probs_in[row * max_len + i];
  __syncthreads();
  weighted_values<scalar_t, scalar_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>(
      out + row * HEAD_SIZE, probs, exp_sums[row], value_cache,
      block_tables + static_cast<long long>(seq) * max_num_blocks_per_seq, seq_len,
      head / (num_heads / num_kv_heads), num_kv_heads);
}
""",
}



@dataclass(frozen=True)
class Variant:
    """One copy of the kernel: the learner's fragments spliced in, and the template
    instantiations to compile (kernels of the .cu file and probes)."""

    fragments: tuple[tuple[int, str], ...]
    names: tuple[str, ...]


class Library:
    """A compiled set of variants; `kernel(variant, name, seed)` is an EmulatedKernel."""

    def __init__(self, dll: ctypes.PyDLL, entries: list[tuple[Variant, str]]):
        self.dll = dll
        self.index = {entry: i for i, entry in enumerate(entries)}

    def kernel(self, variant: Variant, name: str, seed: int = 0) -> cuda_emu.EmulatedKernel:
        return cuda_emu.EmulatedKernel(self.dll, self.index[(variant, name)], name, seed)


def _unit(variants: list[Variant]) -> tuple[str, list[tuple[Variant, str]]]:
    """One translation unit: each variant in its own namespace (the kernel file with the
    learner's functions, and the probes of those functions), then the emulator's entry
    points, one per (variant, instantiation), numbered as `Library.kernel` looks them up."""
    parts = ['#include "dtypes.cuh"\n']
    entries = []
    for i, variant in enumerate(variants):
        fragments = dict(variant.fragments)
        code = kernel_source(fragments).replace('#include "dtypes.cuh"', "")
        probes = "".join(_PROBES[k] for k in sorted(fragments))
        parts.append(f"namespace day7_v{i} {{\n{code}\n"
                     f'#line 1 "day7 checker probes"\n{probes}\n}}\n')
        entries += [(i, variant, name) for name in variant.names]
    unit = cuda_emu.emulator_unit(
        "".join(parts), [f"day7_v{i}::{name}" for i, _, name in entries])
    return unit, [(variant, name) for _, variant, name in entries]


class CompileError(AssertionError):
    pass


_BUILT: dict[Variant, Library] = {}


def build(variants: list[Variant]) -> list[Library]:
    """The library of each variant, for the CPU emulator. Those not built yet in this process
    are compiled together, as one translation unit (one compiler start for all: most of a
    compile is parsing the emulator's header), cached on disk by content."""
    todo = [v for v in dict.fromkeys(variants) if v not in _BUILT]
    if todo:
        unit, entries = _unit(todo)
        library = Library(_compile(unit), entries)
        _BUILT.update((v, library) for v in todo)
    return [_BUILT[v] for v in variants]


def _compile(unit: str) -> ctypes.PyDLL:
    if cuda_emu.compiler() is None:
        raise AssertionError(
            "the CUDA exercises run in the CPU emulator, which needs a C++ compiler: install "
            "g++ (GCC 12 or newer, for _Float16) or set $CXX"
        )
    try:
        return cuda_emu.build(unit, "day7", opt="-O0")
    except cuda_emu.CompileError as error:
        raise CompileError(_compile_message(error.stderr)) from None


_COMPILE_HINTS = [
    ("__expf", "the emulator has no __expf (a GPU intrinsic): use expf."),
    ("__shfl_down_sync", "the emulator implements __shfl_xor_sync only (the butterfly the "
     "kernel uses): `x += __shfl_xor_sync(FULL_MASK, x, offset)`."),
    ("__shfl_sync", "the emulator implements __shfl_xor_sync only."),
    ("fp16_t", "an fp16_t is a raw 16-bit pattern, not a number: read it with to_float(...)."),
    ("bf16_t", "a bf16_t is a raw 16-bit pattern, not a number: read it with to_float(...)."),
    ("out_t", "write the output with from_float<out_t>(value)."),
    ("no matching function for call", "keep the template line and the parameters as the "
     "exercise cell gives them: the kernel calls your function with exactly those."),
]


def _compile_message(stderr: str) -> str:
    """The compiler's complaints about the learner's lines, with a hint where one fits."""
    lines = stderr.splitlines()
    mine = [ln for ln in lines if ln.startswith("exercise ") and ("error" in ln or "note" in ln)]
    first_error = [ln for ln in lines if ": error:" in ln][:1]
    shown = list(dict.fromkeys(
        [ln for ln in mine if ": error:" in ln][:1] or first_error + mine))[:8]
    hints = [h for word, h in _COMPILE_HINTS if any(word in ln for ln in shown)]
    return ("your CUDA does not compile (g++, in front of the emulator's cuda_emu.h; line "
            "numbers are those of your exercise cell):\n  " + "\n  ".join(shown)
            + ("\nHint: " + " ".join(hints[:2]) if hints else ""))


# -- running launches in a child process -------------------------------------------

TIME_LIMIT_S = 30.0


def shared_tensor(shape: tuple[int, ...], dtype: torch.dtype, fill: float = float("nan")):
    """A tensor in anonymous shared memory: what a forked child writes there, the parent
    reads."""
    numel = int(np.prod(shape)) if shape else 1
    size = torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(numel * size, 1))
    t = torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
    t.fill_(fill)
    return t


class KernelFailure(Exception):
    """A launch that did not finish: the emulator's error, a crash or a time-out."""


def isolated(run: Callable[[], None], time_limit: float | None = None) -> None:
    """Run `run` (kernel launches writing into shared tensors) in a forked child; raise
    KernelFailure if it raises, crashes or runs past `time_limit` (TIME_LIMIT_S). Without
    fork (Windows), in this process."""
    time_limit = TIME_LIMIT_S if time_limit is None else time_limit
    if not hasattr(os, "fork"):
        try:
            run()
        except RuntimeError as error:
            raise KernelFailure(str(error)) from error
        return
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process
        pid = os.fork()
    if pid == 0:  # the child: run, report, leave without cleanup
        os.close(read_end)
        code, message = 0, b""
        try:
            run()
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            code, message = 1, str(error).encode()[:4000]
        os.write(write_end, message)
        os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + time_limit
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise KernelFailure(
                    f"the launch did not finish in {time_limit:.0f} s (these are tiny shapes "
                    "that take well under a second): an endless loop? A shuffle loop whose "
                    "offset never reaches 0 (`offset *= 2`), or a loop whose index never moves."
                )
            time.sleep(0.002)
        message = os.read(read_end, 8192).decode(errors="replace")
    finally:
        os.close(read_end)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        raise KernelFailure(
            f"the emulated kernel crashed ({name}): a pointer far outside its array. Check "
            "the address arithmetic: a row of the cache is num_kv_heads * HEAD_SIZE elements, "
            "a block BLOCK_SIZE rows."
        )
    if os.WEXITSTATUS(status) != 0:
        raise KernelFailure(message)


# -- the checker's inputs -----------------------------------------------------------


@dataclass
class Case:
    """A decode batch in the cache layout, with guard blocks past the cache's end."""

    dtype: torch.dtype
    block_size: int
    head_size: int
    num_heads: int
    num_kv_heads: int
    query: torch.Tensor  # [num_seqs, num_heads, head_size]
    key_full: torch.Tensor  # [num_blocks + GUARD, block_size, num_kv_heads, head_size]
    value_full: torch.Tensor
    num_blocks: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks], int64
    seq_lens: torch.Tensor  # [num_seqs], int64

    @property
    def scale(self) -> float:
        return self.head_size**-0.5

    @property
    def key_cache(self) -> torch.Tensor:
        return self.key_full[: self.num_blocks]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.value_full[: self.num_blocks]

    @property
    def lens(self) -> list[int]:
        return [int(n) for n in self.seq_lens]

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def describe(self, seq: int | None = None) -> str:
        where = (f"sequence {seq} (seq_len {self.lens[seq]}, block table "
                 f"{self.table(seq)})" if seq is not None else f"seq_lens {self.lens}")
        return (f"{str(self.dtype).removeprefix('torch.')}, block_size {self.block_size}, "
                f"{self.num_heads} query heads on {self.num_kv_heads} KV heads, {where}")

    def table(self, seq: int) -> list[int]:
        n = -(-self.lens[seq] // self.block_size)
        return [int(b) for b in self.block_tables[seq, :n]]


GUARD_BLOCKS = 2
CONFIGS = [(torch.float32, 8), (torch.float16, 16)]


def make_case(dtype: torch.dtype, block_size: int, seed: int = 7) -> Case:
    """Five sequences of lengths 1, bs - 1, bs, bs + 1 and 4 bs + 3 (five blocks: warp 0 takes
    two); blocks permuted so that no logical block is its own physical one; sequences 3 and 4
    share their first block (a shared prefix); block 0 pads the tables. Rows that no sequence
    owns, and the guard blocks, hold STALE_KEY keys and NaN values. Sequence 4's query is 40
    times larger: its logits reach the hundreds."""
    gen = torch.Generator().manual_seed(seed + block_size)
    bs, head_size, num_heads, num_kv_heads = block_size, 64, 4, 2
    lens = [1, bs - 1, bs, bs + 1, 4 * bs + 3]
    counts = [-(-n // bs) for n in lens]
    num_blocks = sum(counts) + 3
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for i, c in enumerate(counts):
        row = [pool.pop() for _ in range(c)]
        if i == 4:
            row[0] = tables[3][0]  # a shared first block
        tables.append(row)
    for row in tables:  # make every entry differ from its logical index
        for b, p in enumerate(row):
            if p == b:
                spare = pool.pop()
                for other in tables:
                    other[:] = [spare if x == p else x for x in other]
    width = max(counts)
    block_tables = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int64)
    shape = (num_blocks + GUARD_BLOCKS, bs, num_kv_heads, head_size)
    key = torch.randn(shape, generator=gen)
    value = torch.randn(shape, generator=gen)
    readable = torch.zeros(num_blocks + GUARD_BLOCKS, bs, dtype=torch.bool)
    for row, n in zip(tables, lens, strict=True):
        t = torch.arange(n)
        readable[torch.tensor(row)[t // bs], t % bs] = True
    key[~readable] = STALE_KEY
    value[~readable] = float("nan")
    query = torch.randn(len(lens), num_heads, head_size, generator=gen)
    query[4] *= 40
    return Case(dtype, bs, head_size, num_heads, num_kv_heads, query.to(dtype),
                key.to(dtype).contiguous(), value.to(dtype).contiguous(), num_blocks,
                block_tables, torch.tensor(lens, dtype=torch.int64))


@functools.cache
def cases() -> list[Case]:
    return [make_case(dtype, bs) for dtype, bs in CONFIGS]


def v1_name(case: Case) -> str:
    return ops.paged_attention_kernel_names(case.dtype, case.head_size, case.block_size)[0]


def _tname(dtype: torch.dtype) -> str:
    return ops.CUDA_DTYPES[dtype]


def probe_name(k: int, case: Case) -> str:
    t, hs, bs = _tname(case.dtype), case.head_size, case.block_size
    return {2: f"probe_qk_logit<{t}, {hs}, {bs}>",
            4: f"probe_weighted_values<{t}, {hs}, {bs}, {ops.NUM_THREADS}>"}[k]


# -- references ----------------------------------------------------------------------


def _starts(case: Case, seq: int, *, logical=False, kv_of=None, row_stride=None) -> torch.Tensor:
    """[num_heads, seq_len] flat offsets into key_full/value_full of the rows that head h
    reads for token t, following the layout, or a common mistake's version of it."""
    bs, nkv, hs = case.block_size, case.num_kv_heads, case.head_size
    t = torch.arange(case.lens[seq])
    blocks = t // bs if logical else case.block_tables[seq, t // bs]
    rows = blocks * bs + t % bs  # [seq_len]
    heads = torch.arange(case.num_heads)
    kv = kv_of(heads) if kv_of is not None else heads // case.group
    stride = nkv * hs if row_stride is None else row_stride
    return rows[None, :] * stride + kv[:, None] * hs


def _rows(full: torch.Tensor, starts: torch.Tensor, head_size: int) -> torch.Tensor:
    flat = full.float().reshape(-1)
    index = (starts[..., None] + torch.arange(head_size)).clamp(max=flat.numel() - 1)
    return flat[index]  # [..., head_size]


def reference_logits(case: Case, **mistake) -> list[torch.Tensor]:
    """Per sequence, [num_heads, seq_len]: scale * q.k, each key read through the table."""
    out = []
    for s in range(len(case.lens)):
        keys = _rows(case.key_full, _starts(case, s, **mistake), case.head_size)
        q = case.query[s].float() * case.scale  # [num_heads, head_size]
        out.append(torch.einsum("hd,htd->ht", q, keys))
    return out


def reference_weighted(case: Case, probs: list[torch.Tensor], exp_sums: torch.Tensor,
                       **mistake) -> torch.Tensor:
    """[num_seqs, num_heads, head_size]: sum_t probs[t] * v_t / exp_sum."""
    out = []
    for s in range(len(case.lens)):
        values = _rows(case.value_full, _starts(case, s, **mistake), case.head_size)
        out.append(torch.einsum("ht,htd->hd", probs[s], values) / exp_sums[s][:, None])
    return torch.stack(out)


def reference_output(case: Case) -> torch.Tensor:
    """The engine's PyTorch reference backend on the same batch."""
    kv = torch.stack([case.key_cache, case.value_cache])
    impl = TorchPagedAttention(case.num_heads, case.head_size, case.scale, case.num_kv_heads)
    return impl.forward_decode(case.query, kv, case.block_tables, case.seq_lens,
                               max(case.lens)).float()


def _close(got: torch.Tensor, want: torch.Tensor, dtype=torch.float32) -> bool:
    """Equal within the dtype's rounding; NaN only where `want` has NaN (a mistake's
    reference may read the poisoned rows too)."""
    tol = 1e-3 if dtype == torch.float32 else 4e-3
    return got.shape == want.shape and bool(
        torch.allclose(got.float(), want.float(), rtol=tol, atol=tol, equal_nan=True))


# -- launching ----------------------------------------------------------------------


@contextlib.contextmanager
def launcher_runs(library: Library, variant: Variant, seed: int = 0,
                  head_sizes: tuple[int, ...] = ()) -> Iterator[None]:
    """Within this block `_custom_ops.paged_attention_v1` (the real launcher: its checks,
    grid, shared memory and arguments) launches `variant`'s kernel in the emulator.
    `head_sizes` are added to the launcher's supported sizes for the duration (the template
    compiles for any multiple of the group's load width)."""
    saved = ops._module, ops._launch, ops.SUPPORTED_HEAD_SIZES

    class Module:
        def __init__(self, source, names):
            self.names = names

        def get_function(self, name):
            return library.kernel(variant, name, seed)

    ops._module = Module
    ops._launch = lambda kernel, grid, args, shared_mem=0: kernel(
        grid, (ops.NUM_THREADS,), args, shared_mem=shared_mem)
    ops.SUPPORTED_HEAD_SIZES = tuple(sorted({*saved[2], *head_sizes}))
    try:
        yield
    finally:
        ops._module, ops._launch, ops.SUPPORTED_HEAD_SIZES = saved


def run_kernel(library: Library, variant: Variant, case: Case, seed: int = 0) -> torch.Tensor:
    """The whole v1 kernel (the variant's) on `case`, through the real launcher."""
    out = shared_tensor(tuple(case.query.shape), case.dtype)

    def run():
        with launcher_runs(library, variant, seed):
            ops.paged_attention_v1(out, case.query, case.key_cache, case.value_cache,
                                   case.block_tables, case.seq_lens, case.scale, max(case.lens))

    isolated(run)
    return out.float().clone()


def _padded(n: int, block_size: int) -> int:
    return -(-n // block_size) * block_size


def run_probe_qk(library: Library, variant: Variant, case: Case) -> list[torch.Tensor]:
    max_len = max(case.lens)
    out = shared_tensor((len(case.lens), case.num_heads, max_len), torch.float32)
    kernel = library.kernel(variant, probe_name(2, case))
    args = (out, case.query, case.key_cache, case.block_tables, case.seq_lens,
            np.int32(case.num_kv_heads), np.int32(case.block_tables.shape[1]),
            np.int32(max_len), np.float32(case.scale))
    isolated(lambda: kernel((case.num_heads, len(case.lens)), (ops.NUM_THREADS,), args))
    return [out[s, :, :n].clone() for s, n in enumerate(case.lens)]


def run_probe_values(library: Library, variant: Variant, case: Case, probs: list[torch.Tensor],
                     exp_sums: torch.Tensor, seed: int = 0) -> torch.Tensor:
    max_len = max(case.lens)
    probs_in = torch.zeros(len(case.lens), case.num_heads, max_len)
    for s, p in enumerate(probs):
        probs_in[s, :, : p.shape[1]] = p
    out = shared_tensor(tuple(case.query.shape), case.dtype)
    kernel = library.kernel(variant, probe_name(4, case), seed)
    args = (out, probs_in, exp_sums.contiguous(), case.value_cache, case.block_tables,
            case.seq_lens, np.int32(case.num_kv_heads), np.int32(case.block_tables.shape[1]),
            np.int32(max_len))
    smem = _padded(max_len, case.block_size) * 4
    isolated(lambda: kernel((case.num_heads, len(case.lens)), (ops.NUM_THREADS,), args,
                            shared_mem=smem))
    return out.float().clone()


# -- exercise 2: q.k, the thread group and the block-table walk --------------------------


def _qk_variant(fragment: str) -> Variant:
    names = tuple(n for c in cases() for n in (v1_name(c), probe_name(2, c)))
    return Variant(((2, fragment),), names)


def _qk_mistake(case: Case, got: list[torch.Tensor]) -> str:
    """The common mistake whose logits are `got`, or ''."""
    bs = case.block_size
    tgs = WARP_SIZE // bs
    vec = max(16 // (tgs * case.dtype.itemsize), 1)
    nkv, hs = case.num_kv_heads, case.head_size
    right = reference_logits(case)

    def same(alt):
        return all(_close(g, a) for g, a in zip(got, alt, strict=True))

    if same([r / case.scale for r in right]):
        return (f"your logits are q.k without the scale (1/sqrt({hs}) = {case.scale:.4g}): here "
                "q_smem holds the query as it is, and qk_logit multiplies the dot product by "
                "`scale`, as vLLM's kernel does.")
    if same([r * case.scale for r in right]):
        return ("your logits are multiplied by scale twice.")
    if same(reference_logits(case, logical=True)):
        return ("you read logical block b of the cache; the block table maps it to the "
                "physical block: block_table[b].")
    if same(reference_logits(case, kv_of=lambda h: h % nkv)):
        return (f"query head h read KV head h % {nkv} (round-robin); consecutive query heads "
                f"share a KV head: kv_head = head / (num_heads / num_kv_heads) = h / "
                f"{case.group}.")
    if same(reference_logits(case, kv_of=lambda h: h)):
        return (f"query head h read KV head h: with GQA there are only {nkv} KV heads; "
                "kv_head = head / (num_heads / num_kv_heads).")
    if same(reference_logits(case, row_stride=hs)):
        return (f"you stepped {hs} elements (HEAD_SIZE) from one cache row to the next; a row "
                f"holds every KV head of its token: num_kv_heads * HEAD_SIZE = {nkv * hs}.")
    if tgs > 1 and same([r * tgs for r in right]):
        return (f"every lane summed the whole row, so the group's sum is {tgs} times the dot "
                f"product: lane `rank` starts at rank * VEC_SIZE and steps by THREAD_GROUP_SIZE "
                f"* VEC_SIZE, so that the group's {tgs} lanes split the {hs} elements.")
    if tgs > 1:
        dims = torch.arange(hs)
        own = ((dims // vec) % tgs == 0).float()
        partial = []
        for s in range(len(case.lens)):
            keys = _rows(case.key_full, _starts(case, s), hs)
            q = case.query[s].float() * case.scale * own
            partial.append(torch.einsum("hd,htd->ht", q, keys))
        if same(partial):
            return (f"the logit is lane rank 0's partial sum alone ({hs // tgs} of {hs} "
                    f"elements): add the {tgs} lanes of the group with __shfl_xor_sync, "
                    f"offsets THREAD_GROUP_SIZE / 2 down to 1.")
        block_sums = []
        for r in right:
            t = torch.arange(r.shape[1])
            sums = torch.zeros(r.shape[0], -(-r.shape[1] // bs)).index_add_(1, t // bs, r)
            block_sums.append(sums[:, t // bs])
        if same(block_sums):
            return ("each logit is the sum over a whole block's tokens: the shuffles ran over "
                    "the whole warp (offsets from 16). Only the THREAD_GROUP_SIZE lanes of one "
                    "token belong together: offsets THREAD_GROUP_SIZE / 2, ..., 1.")
    return ""


def _describe_logits(case: Case, got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        bad = ~torch.isclose(g, w, rtol=1e-3, atol=1e-3)
        if bad.any():
            h, t = (int(x) for x in bad.nonzero()[0])
            return (f"{case.describe(s)}: query head {h}, token {t} (logical block "
                    f"{t // case.block_size}, row {t % case.block_size}): logit "
                    f"{float(g[h, t]):.5g}, expected {float(w[h, t]):.5g}; "
                    f"{int(bad.sum())} of {bad.numel()} logits of this sequence differ")
    return ""


def _kernel_failure(k: int, error: KernelFailure) -> AssertionError:
    text = str(error)
    if "divergent barrier" in text:
        hint = ("every lane of a warp must reach every __shfl_xor_sync (and every thread of the "
                "block every __syncthreads): a shuffle inside `if (token < seq_len)` leaves "
                "the lanes of a partial last block out. Load inside the if, shuffle after it.")
    elif "wrote past" in text:
        hint = "an index into shared memory ran past the sequence's tokens."
    else:
        hint = ""
    return AssertionError(f"your {FUNCTIONS[k]} made the kernel fail: {text}"
                          + (f"\nHint: {hint}" if hint else ""))


def _check_whole_kernel(k: int, library: Library, variant: Variant, case: Case) -> None:
    """The v1 kernel with the learner's stage, through the real launcher, against the
    PyTorch reference backend."""
    try:
        got = run_kernel(library, variant, case)
    except KernelFailure as error:
        raise _kernel_failure(k, error) from None
    want = reference_output(case)
    if _close(got, want, case.dtype):
        return
    if got.isnan().any():
        seqs = got.isnan().flatten(1).any(1).nonzero().flatten().tolist()
        closer = (f"NaN in the output of sequences {seqs}: NaN is what the cache holds in rows "
                  "that no sequence owns (past seq_len, or blocks not in the table).")
    else:
        err = (got - want).abs().flatten(1).max(1).values
        seq = int(err.argmax())
        closer = (f"the output of {case.describe(seq)} differs from the PyTorch reference by "
                  f"up to {float(err[seq]):.3g}.")
    raise AssertionError(
        f"the whole v1 kernel with your {FUNCTIONS[k]}, launched by "
        f"_custom_ops.paged_attention_v1 ({v1_name(case)}): {closer}\nYour function passed "
        "the checker's own probe, so look at what it assumes beyond its contract (shared "
        "state, the thread count, a token range)."
    )


def exercise_2(qk_logit_source: str) -> None:
    fragment = _fragment(qk_logit_source, 2)
    variant = _qk_variant(fragment)
    library, = build([variant])
    for case in cases():
        try:
            got = run_probe_qk(library, variant, case)
        except KernelFailure as error:
            raise _kernel_failure(2, error) from None
        want = reference_logits(case)
        if not all(_close(g, w) for g, w in zip(got, want, strict=True)):
            closer = _qk_mistake(case, got)
            raise AssertionError(
                f"your qk_logit's logits differ from scale * q.k: "
                f"{_describe_logits(case, got, want)}.\n"
                + (f"It looks like {closer}\n" if closer else "")
                + "The logit is scale * q.k. Token b * BLOCK_SIZE + group lives in row `group` of "
                "physical block "
                "block_table[b]; its key for query head h starts at ((physical_block * "
                "BLOCK_SIZE + group) * num_kv_heads + kv_head) * HEAD_SIZE, kv_head = h / "
                "(num_heads / num_kv_heads). The group's lanes split the elements in runs of "
                "VEC_SIZE and add their partial sums with __shfl_xor_sync (lesson section 3)."
            )
    for case in cases():
        _check_whole_kernel(2, library, variant, case)
    passed(DAY, 2)


# -- exercise 3: the softmax with the block-wide max ------------------------------------

SOFTMAX_BLOCK = 16  # the probe stores logits as stage 2 does with blocks of 16
SOFTMAX_PROBE = f"probe_softmax<{ops.NUM_THREADS}, {SOFTMAX_BLOCK}>"
# (length, offset added to the logits, logical block that holds the maximum)
SOFTMAX_CASES = [(1, 0.0, 0), (15, 0.0, 0), (16, 3.0, 0), (17, -2.0, 1), (70, 0.0, 2),
                 (70, 150.0, 3), (200, -120.0, 5), (200, 40.0, 10)]


def softmax_inputs(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_cases, max_len] logits and their lengths; the largest of each case is put in the
    block named above (owned by warp block % 4), and two cases sit far from 0: exp() of
    them overflows or underflows float32 unless the max is subtracted."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max(n for n, _, _ in SOFTMAX_CASES)
    logits = torch.zeros(len(SOFTMAX_CASES), max_len)
    for c, (n, offset, block) in enumerate(SOFTMAX_CASES):
        row = torch.randn(n, generator=gen) * 3 + offset
        top = min(block * SOFTMAX_BLOCK + 5, n - 1)
        row[top] = row.max() + 4.0
        logits[c, :n] = row
    return logits, torch.tensor([n for n, _, _ in SOFTMAX_CASES], dtype=torch.int64)


def _softmax_variant(fragment: str) -> Variant:
    names = (SOFTMAX_PROBE,) + tuple(v1_name(c) for c in cases())
    return Variant(((3, fragment),), names)


@dataclass
class SoftmaxRun:
    numerators: torch.Tensor  # [num_cases, max_len] (positions >= len are NaN)
    maxes: torch.Tensor  # [num_cases, NUM_THREADS]
    sums: torch.Tensor  # [num_cases, NUM_THREADS]


def run_probe_softmax(library: Library, variant: Variant, seed: int = 0) -> SoftmaxRun:
    logits, lens = softmax_inputs()
    num_cases, max_len = logits.shape
    numerators = shared_tensor((num_cases, max_len), torch.float32)
    maxes = shared_tensor((num_cases, ops.NUM_THREADS), torch.float32)
    sums = shared_tensor((num_cases, ops.NUM_THREADS), torch.float32)
    kernel = library.kernel(variant, SOFTMAX_PROBE, seed)
    args = (numerators, maxes, sums, logits, lens, np.int32(max_len))
    smem = _padded(max_len, SOFTMAX_BLOCK) * 4
    isolated(lambda: kernel((num_cases,), (ops.NUM_THREADS,), args, shared_mem=smem))
    return SoftmaxRun(numerators.clone(), maxes.clone(), sums.clone())


def _owner(t: int) -> int:
    """The thread that stores logit t in stage 2 (blocks of SOFTMAX_BLOCK): lane 0 of the
    token's thread group, in warp (block % NUM_WARPS)."""
    block, row = divmod(t, SOFTMAX_BLOCK)
    return (block % NUM_WARPS) * WARP_SIZE + row * (WARP_SIZE // SOFTMAX_BLOCK)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def _max_patterns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per thread: the max of the logits it stored itself, and the max of its warp's."""
    own = torch.full((ops.NUM_THREADS,), float("-inf"))
    for t in range(x.shape[0]):
        own[_owner(t)] = max(float(own[_owner(t)]), float(x[t]))
    per_warp = own.view(NUM_WARPS, WARP_SIZE).max(1).values.repeat_interleave(WARP_SIZE)
    return own, per_warp


def _softmax_mistake(run: SoftmaxRun, again: SoftmaxRun) -> str:
    """What is wrong with the learner's softmax, said for the learner, or ''."""
    logits, lens = softmax_inputs()
    described = []
    for c, n in enumerate(lens.tolist()):
        x = logits[c, :n]
        described.append((x, f"logits case {c} ({n} tokens, max {float(x.max()):.4g} at "
                              f"token {int(x.argmax())})"))
    for c, (x, what) in enumerate(described):  # qk_max: a reduction that stopped short
        got_m = run.maxes[c]
        if torch.allclose(got_m, torch.full_like(got_m, float(x.max()))):
            continue
        own, per_warp = _max_patterns(x)
        if torch.equal(got_m, own):
            return (f"{what}: qk_max came back as each thread's own max (-inf in the threads "
                    "that stored no logit): reduce it over the whole thread block "
                    "(block_reduce<NUM_WARPS, true>), and use that one max everywhere. Its "
                    "barrier also makes the other warps' logits visible before you read them.")
        if torch.equal(got_m, per_warp):
            return (f"{what}: after your function each warp held its own max (thread 0: "
                    f"{float(got_m[0]):.4g}, thread 32: {float(got_m[32]):.4g}): the shuffles "
                    "reduce within a warp only. The second level goes through shared memory: "
                    "lane 0 of each warp posts its warp's max to red_smem, a __syncthreads(), "
                    "then every thread combines the NUM_WARPS values.")
    if not (_same(run.numerators, again.numerators) and _same(run.sums, again.sums)
            and _same(run.maxes, again.maxes)):
        return ("the results change with the order the emulator runs the threads in (seed 0 "
                "against seed 1): a race. Either two threads handled the same logits[i] (split "
                "the tokens: i from threadIdx.x, step NUM_THREADS), or a value another thread "
                "wrote to shared memory (logits, red_smem) was read before a __syncthreads() "
                "made it visible (block_reduce holds the barriers: read it).")
    for c, (x, what) in enumerate(described):
        n = x.shape[0]
        m = float(x.max())
        e = torch.exp(x - m)
        s = float(e.sum())
        got_e, got_m, got_s = run.numerators[c, :n], run.maxes[c], run.sums[c]
        if not torch.allclose(x, e) and torch.allclose(got_e, x, rtol=1e-5, atol=1e-5):
            return (f"{what}: the logits came back unchanged. Write each numerator back: "
                    "logits[i] = expf(logits[i] - max); stage 4 reads them from there.")
        if abs(m) < 20 and torch.allclose(got_e, torch.exp(x), rtol=1e-4, atol=1e-6):
            return (f"{what}: your numerators are exp(logit), without subtracting the max. "
                    "With logits of a few hundred (a large query, or a long context), expf "
                    "overflows float32 (above e^88.7) to inf, and inf / inf is NaN; "
                    "exp(logit - max) is at most 1 and gives the same softmax.")
        if not torch.allclose(got_m, torch.full_like(got_m, m)):
            return (f"{what}: qk_max must come back as the block-wide max {m:.6g} in every "
                    f"thread; thread 0 has {float(got_m[0]):.6g}, thread 127 "
                    f"{float(got_m[-1]):.6g}.")
        if not torch.isfinite(got_e).all() or not torch.isfinite(got_s).all():
            if abs(m) > 80:
                return (f"{what}: inf or NaN. expf(logit) overflows float32 above e^88.7 "
                        "(and underflows to 0 below e^-103, making the sum 0): subtract the "
                        "block-wide max first.")
            return (f"{what}: NaN. Shared memory past the sequence's tokens holds garbage "
                    "(the emulator fills it with NaN): loop while i < num_tokens.")
        if not torch.allclose(got_e, e, rtol=1e-4, atol=1e-6):
            return (f"{what}: the numerators are not exp(logit - max) for every token: is "
                    "each logit handled by exactly one thread (i from threadIdx.x, step "
                    "NUM_THREADS)?")
        if not torch.allclose(got_s, torch.full_like(got_s, s), rtol=1e-4):
            share = float(e[0::ops.NUM_THREADS].sum())
            if abs(float(got_s[0]) - share) <= 1e-4 * s:
                return (f"{what}: the sum you returned is thread 0's own share "
                        f"({float(got_s[0]):.6g} of {s:.6g}): reduce it across the block "
                        "like the max (block_reduce<NUM_WARPS, false>).")
            return (f"{what}: every thread must return the block-wide sum {s:.6g}; thread 0 "
                    f"returned {float(got_s[0]):.6g}.")
    return ""


def exercise_3(softmax_source: str) -> None:
    fragment = _fragment(softmax_source, 3)
    variant = _softmax_variant(fragment)
    library, = build([variant])
    try:
        run = run_probe_softmax(library, variant)
        again = run_probe_softmax(library, variant, seed=1)
    except KernelFailure as error:
        raise _kernel_failure(3, error) from None
    closer = _softmax_mistake(run, again)
    if closer:
        raise AssertionError(
            f"your softmax_numerators: {closer}\nStage 3 in paged_attention.cu: the block-wide "
            "max (block_reduce), then each thread turns its logits i = threadIdx.x, "
            "threadIdx.x + NUM_THREADS, ... into expf(logit - max) in place, then the "
            "block-wide sum (lesson section 4)."
        )
    for case in cases():
        _check_whole_kernel(3, library, variant, case)
    passed(DAY, 3)


# -- exercise 4: the value accumulation, then the engine ---------------------------------


def value_inputs(case: Case, seed: int = 5) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per sequence [num_heads, seq_len] weights in (0.1, 1), and their sums."""
    gen = torch.Generator().manual_seed(seed + case.block_size)
    probs = [torch.rand(case.num_heads, n, generator=gen) * 0.9 + 0.1 for n in case.lens]
    return probs, torch.stack([p.sum(1) for p in probs])


def _values_mistake(case: Case, got: torch.Tensor, again: torch.Tensor,
                    probs: list[torch.Tensor], exp_sums: torch.Tensor) -> str:
    if not _same(got, again):
        return ("the output changes with the order the emulator runs the threads in (seed 0 "
                "against seed 1): a race. Before any thread reads out_smem[w][d] of another "
                "warp, every warp must have written its partial sums: __syncthreads() between "
                "the writes and the reads.")
    past_end = ("NaN: you read value rows past seq_len (the cache holds NaN there, stale data "
                "on a GPU, and 0 * NaN is NaN) or weights past it in shared memory. The last "
                "block holds only seq_len - b * BLOCK_SIZE of this sequence's tokens.")
    want = reference_weighted(case, probs, exp_sums)
    whole_blocks = want.clone()
    whole_blocks[[n % case.block_size != 0 for n in case.lens]] = float("nan")
    if got.isnan().any() and _close(got, whole_blocks, case.dtype):
        return past_end
    if _close(got, want * exp_sums[..., None], case.dtype):
        return ("you did not divide by exp_sum: the weights are stage 3's numerators "
                "exp(logit - max); the softmax divides their weighted sum by their sum.")
    if _close(got, reference_weighted(case, probs, exp_sums, logical=True), case.dtype):
        return ("you read logical block b of the value cache; the block table maps it to "
                "block_table[b].")
    hs, nkv = case.head_size, case.num_kv_heads
    if _close(got, reference_weighted(case, probs, exp_sums, row_stride=hs), case.dtype):
        return (f"a row of the value cache holds every KV head of its token: rows are "
                f"num_kv_heads * HEAD_SIZE = {nkv * hs} elements apart, not {hs}.")
    mine = []
    for p in probs:  # the weights of warp 0's blocks only
        t = torch.arange(p.shape[1])
        mine.append(p * ((t // case.block_size) % NUM_WARPS == 0).float())
    if _close(got, reference_weighted(case, mine, exp_sums), case.dtype):
        return ("only warp 0's blocks reached the output: each warp sums a different subset "
                "of the blocks, so the output of dimension d is the sum of out_smem[w][d] over "
                "all NUM_WARPS warps.")
    shifted = [torch.cat([p[:, : case.block_size]] * -(-p.shape[1] // case.block_size),
                         1)[:, : p.shape[1]] for p in probs]
    if _close(got, reference_weighted(case, shifted, exp_sums), case.dtype):
        return ("every block used the weights of block 0: token t's weight is "
                "probs[b * BLOCK_SIZE + t], not probs[t].")
    if got.isnan().any():
        return past_end
    return ""


def _values_variants(fragment: str, qk: str | None, softmax: str | None
                     ) -> tuple[Variant, Variant]:
    unit_names = tuple(n for c in cases() for n in (v1_name(c), probe_name(4, c)))
    unit = Variant(((4, fragment),), unit_names)
    whole = {2: qk, 3: softmax, 4: fragment}
    engine = Variant(tuple((k, f) for k, f in sorted(whole.items()) if f is not None),
                     (f"paged_attention_v1_kernel<float, {ENGINE_HEAD_SIZE}, 16, "
                      f"{ops.NUM_THREADS}>",))
    return unit, engine


# The engine run: the shipped model (6 query heads of 32 on 2 KV heads, 4 layers), greedy.
ENGINE_HEAD_SIZE = 32
ENGINE_PROMPTS = ["Once upon a time", "The little dog"]
# logprobs=0: the sampled token's log-probability, a sharper comparison than the token.
ENGINE_PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)


class _KernelAttention(TorchPagedAttention):
    """The PyTorch backend whose decodes run a v1 kernel through the real launcher when
    `use_kernel` is set (prefills stay on the reference path, as in the cuda backend)."""

    use_kernel = False
    decodes = 0

    def forward_decode(self, query, kv_cache, block_tables, seq_lens, max_seq_len):
        if not type(self).use_kernel:
            return super().forward_decode(query, kv_cache, block_tables, seq_lens, max_seq_len)
        type(self).decodes += 1
        query = query.contiguous()
        out = torch.empty_like(query)
        ops.paged_attention_v1(out, query, kv_cache[0], kv_cache[1], block_tables, seq_lens,
                               self.scale, max_seq_len)
        return out


@dataclass
class Generated:
    tokens: list[list[int]]
    texts: list[str]
    logprobs: list[list[float]]  # of each sampled token


@dataclass
class EngineRun:
    prompts: list[str]
    reference: Generated
    yours: Generated
    fragments: list[int]


_ENGINE: dict[str, object] = {}


def _engine() -> LLM:
    if "llm" not in _ENGINE:
        with quiet_engine():
            _ENGINE["llm"] = LLM(DEFAULT_MODEL, attention_backend=_KernelAttention,
                                 block_size=16, num_gpu_blocks_override=16)
    return _ENGINE["llm"]  # type: ignore[return-value]


def _generate(llm: LLM) -> Generated:
    outs = [o.outputs[0] for o in llm.generate(ENGINE_PROMPTS, ENGINE_PARAMS, use_tqdm=False)]
    return Generated([list(o.token_ids) for o in outs], [o.text for o in outs],
                     [[p[t].logprob for p, t in zip(o.logprobs, o.token_ids, strict=True)]
                      for o in outs])


def run_engine(library: Library, variant: Variant) -> EngineRun:
    """Greedy tokens of the shipped model with the PyTorch decode, then with `variant`'s
    kernel (the learner's) as its decode attention."""
    llm = _engine()
    if "reference" not in _ENGINE:
        _KernelAttention.use_kernel = False
        _ENGINE["reference"] = _generate(llm)
    _KernelAttention.use_kernel, _KernelAttention.decodes = True, 0
    try:
        with launcher_runs(library, variant, head_sizes=(ENGINE_HEAD_SIZE,)):
            yours = _generate(llm)
    finally:
        _KernelAttention.use_kernel = False
    assert _KernelAttention.decodes > 0, "the engine ran no decode through the kernel"
    return EngineRun(ENGINE_PROMPTS, _ENGINE["reference"], yours,  # type: ignore[arg-type]
                     [k for k, _ in variant.fragments])


_LAST_ENGINE_RUN: list[EngineRun] = []


def _optional_fragment(source, k: int) -> str | None:
    """An earlier exercise's CUDA for the engine run, or None (the reference stage) while it
    is unfinished."""
    if source is None:
        return None
    try:
        return _fragment(source, k)
    except NotImplementedError:
        print(f"(exercise {k} is not done yet: the engine runs the reference {FUNCTIONS[k]})")
        return None


def exercise_4(weighted_values_source: str, qk_logit_source: str | None = None,
               softmax_source: str | None = None) -> None:
    fragment = _fragment(weighted_values_source, 4)
    qk = _optional_fragment(qk_logit_source, 2)
    softmax = _optional_fragment(softmax_source, 3)
    unit, whole = _values_variants(fragment, qk, softmax)
    library, whole_library = build([unit, whole])
    for case in cases():
        probs, exp_sums = value_inputs(case)
        try:
            got = run_probe_values(library, unit, case, probs, exp_sums)
            again = run_probe_values(library, unit, case, probs, exp_sums, seed=1)
        except KernelFailure as error:
            raise _kernel_failure(4, error) from None
        want = reference_weighted(case, probs, exp_sums)
        if _same(got, again) and _close(got, want, case.dtype):
            continue
        closer = _values_mistake(case, got, again, probs, exp_sums)
        err = (got - want).abs().nan_to_num(float("inf")).flatten(1).max(1).values
        seq = int(err.argmax())
        raise AssertionError(
            f"your weighted_values: the output of {case.describe(seq)} differs from "
            f"sum_t p_t * v_t / exp_sum by up to {float(err[seq]):.3g}.\n"
            + (f"It looks like {closer}\n" if closer else "")
            + "Warp w takes logical blocks w, w + NUM_WARPS, ...; for each of the block's "
            "tokens below seq_len, lane l adds p * v[d] for d = l, l + 32, ...; the warps' sums "
            "meet in out_smem after a __syncthreads(); each output is their sum / exp_sum "
            "(lesson section 5)."
        )
    for case in cases():
        _check_whole_kernel(4, library, unit, case)
    try:
        run = run_engine(whole_library, whole)
    except RuntimeError as error:
        raise AssertionError(f"inside the engine, your kernel failed: {error}") from None
    _LAST_ENGINE_RUN[:] = [run]
    stages = ", ".join(FUNCTIONS[k] for k in run.fragments)
    where = (f"inside the engine (the shipped model, greedy), with your {stages} in the kernel: "
             "prompt")
    advice = ("Position 0 comes from the prefill (PyTorch in both); from 1 on, every token "
              "went through your kernel. Re-run the checkers of the exercises whose functions "
              "are in it.")
    for i, prompt in enumerate(run.prompts):
        ref, mine = run.reference, run.yours
        if ref.tokens[i] != mine.tokens[i]:
            p = next(p for p, (a, b) in enumerate(zip(ref.tokens[i], mine.tokens[i],
                                                      strict=False)) if a != b)
            raise AssertionError(
                f"{where} {prompt!r} gives token {mine.tokens[i][p]} at output position {p}, "
                f"the PyTorch backend {ref.tokens[i][p]}. {advice}")
        for p, (a, b) in enumerate(zip(ref.logprobs[i], mine.logprobs[i], strict=True)):
            if not abs(a - b) <= 1e-3:
                raise AssertionError(
                    f"{where} {prompt!r} gives the same tokens, but at output position {p} the "
                    f"chosen token's log-probability is {b:.5f}, against {a:.5f} with the "
                    f"PyTorch backend: the attention output is off. {advice}")
    passed(DAY, 4)


def engine_texts() -> list[str]:
    """What the last successful exercise-4 engine run generated, for the notebook."""
    if not _LAST_ENGINE_RUN:
        raise NotImplementedError(f"Day {DAY}, exercise 4")
    run = _LAST_ENGINE_RUN[0]
    stages = ", ".join(FUNCTIONS[k] for k in run.fragments)
    lines = [f"decode attention: the v1 kernel with your {stages}"]
    for i, prompt in enumerate(run.prompts):
        same = run.yours.tokens[i] == run.reference.tokens[i] and all(
            abs(a - b) <= 1e-3 for a, b in zip(run.yours.logprobs[i], run.reference.logprobs[i],
                                               strict=True))
        lines.append(f"  {prompt!r} -> {run.yours.texts[i]!r}  "
                     f"({'same tokens and log-probabilities as' if same else 'DIFFERENT from'} "
                     "the PyTorch backend)")
    return lines


# -- on a GPU ------------------------------------------------------------------------


def gpu_problem() -> str | None:
    """Why the GPU part cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no NVIDIA GPU here (torch.cuda.is_available() is False)"
    try:
        ops._cupy()
    except RuntimeError as error:
        return str(error)
    return None


def gpu_compare(qk_logit_source: str, softmax_source: str, weighted_values_source: str,
                seq_len: int = 2048, num_seqs: int = 32, repeats: int = 20) -> list[str]:
    """On a GPU: the kernel with the learner's three functions, compiled by NVRTC, against
    the reference kernel and the PyTorch backend; timings of both kernels. Lines to print
    (one saying why, where there is no GPU)."""
    problem = gpu_problem()
    if problem:
        return [f"skipped: {problem}"]
    cupy = ops._cupy()
    fragments = {2: _fragment(qk_logit_source, 2), 3: _fragment(softmax_source, 3),
                 4: _fragment(weighted_values_source, 4)}
    code = kernel_source(fragments)
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_heads, num_kv_heads, head_size, block_size = 32, 8, 128, 16
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device="cuda",
                     dtype=torch.float16, generator=gen)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), seq_len, device="cuda", dtype=torch.int64)
    query = torch.randn(num_seqs, num_heads, head_size, device="cuda", dtype=torch.float16,
                        generator=gen)
    scale = head_size**-0.5

    def launch(out):
        ops.paged_attention_v1(out, query, kv[0], kv[1], tables, seq_lens, scale, seq_len)

    def timed(fn) -> tuple[torch.Tensor, float]:
        out = torch.empty_like(query)
        fn(out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn(out)
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end) / repeats

    reference, ref_ms = timed(launch)
    saved = ops._module
    # v1 only: the lab's weighted_values refuses v2's partitions (a static_assert).
    names = tuple(ops.paged_attention_kernel_names(torch.float16, head_size, block_size))[:1]
    module = cupy.RawModule(code=code, options=ops.NVRTC_OPTIONS, name_expressions=names)
    ops._module = lambda source, name_expressions: module
    try:
        yours, your_ms = timed(launch)
    finally:
        ops._module = saved
    impl = TorchPagedAttention(num_heads, head_size, scale, num_kv_heads)
    torch_out = impl.forward_decode(query, kv, tables, seq_lens, seq_len)
    gb = 2 * num_seqs * seq_len * num_kv_heads * head_size * 2 / 1e9
    return [
        f"{num_seqs} sequences of {seq_len} tokens, {num_heads} heads on {num_kv_heads} KV "
        f"heads of {head_size}, float16, blocks of {block_size}",
        f"max |yours - reference kernel|  {float((yours - reference).abs().max()):.3g}",
        f"max |yours - PyTorch backend|  {float((yours - torch_out).abs().max()):.3g}",
        f"reference kernel {ref_ms:.3f} ms ({gb / ref_ms * 1e3:.0f} GB/s of K/V), "
        f"yours {your_ms:.3f} ms ({gb / your_ms * 1e3:.0f} GB/s)",
    ]
