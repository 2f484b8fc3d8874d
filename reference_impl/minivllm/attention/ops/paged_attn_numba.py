"""Decode paged attention on the CPU, compiled by Numba.

The PyTorch reference (`backends/torch_paged.py`) first *gathers* every
sequence's blocks into a padded contiguous copy, then attends. This kernel
reads each key and value row straight from its block, the way the CUDA kernel
does, and never touches a slot past a sequence's end.

Work is split with `prange` over sequences, each item taking a run of its KV
heads (all of them, unless there are fewer sequences than threads): a token's
K (or V) row for every KV head is one contiguous stretch of its block,
[kv_heads, head_size], so an item reads whole rows front to back, as the
block layout lays them out, instead of one head's slice of each. With
grouped-query attention the query heads that share a KV head are computed
together, so each K/V row is loaded once for the whole group. Scores, softmax
and the weighted sum are accumulated in float32, for each head in the same
order however the work is split: the split changes no bit of the output.

Each pass also asks the CPU for the next block's rows while it reads this
block's (`prefetch`), as vLLM's CPU kernel does for V (csrc/cpu/attention.cpp,
`vec_op::prefetch`). A CPU's own prefetchers follow a stream only within a
4 KB page, and a sequence's next block can be anywhere in the pool, so
without the hint every block starts with a wait for memory. A prefetch is a
hint, not a load: it changes no result, cannot fault, and is only given for
blocks of the sequence's own table. On the engine's own caches at batch 64
(context 275, 20M model, 2 threads) it made the kernel 1.04-1.5x faster
(about 1.2x typically, over 17 interleaved rounds).

The softmax's exponentials are `exp_nonpositive`: a polynomial LLVM can put
into SIMD lanes, where `math.exp` is a scalar call per score (Numba has no
vector math library here), as vLLM's CPU vector types have their own `exp()`.
It is within 1.5e-7 of `math.exp`, relative. On the engine's caches at batch
64 the kernel ran about 1.1x faster with it (1.05x and 1.19x, the medians of
two runs of 12 interleaved rounds on a noisy VM), about what removing the
exponentials altogether gains.

`fastmath={"reassoc", "contract"}` lets LLVM reorder the q.k sums into SIMD
lanes and fuse multiply-adds: without it, a float sum must be added strictly
left to right, one element at a time. That is 2-3.5x faster here
(`python -m tools.bench.attention --device cpu`) and changes results only in
the last bits. The order is fixed at compile time, so a sequence's output
still does not depend on what else is in the batch.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from minivllm.attention.kv_cache import check_decode_args


@intrinsic
def prefetch(typingctx, array, index):
    """`prefetch(array, i)`: ask the CPU to bring the cache line holding
    element i of C-contiguous `array` (counted flat) into its caches. Numba
    has no such call, so this emits LLVM's `llvm.prefetch` (read, keep in
    all cache levels, data), as C's `__builtin_prefetch` does."""
    sig = types.void(array, index)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn_type = ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [byte_ptr], fn_type)
        address = builder.bitcast(builder.gep(data, [args[1]]), byte_ptr)
        # read (0), locality 3 (keep in every level), data cache (1)
        builder.call(fn, [address, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 `bits` (C's type punning).
    Numba has no such call for a scalar; LLVM's bitcast is one instruction."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


_LOG2_E = np.float32(1.4426950408889634)
# ln 2 in two parts: k * _LN2_HIGH is exact for the k that occur, so
# x - k ln 2 loses no bits to rounding.
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)


@numba.njit(inline="always", fastmath={"reassoc", "contract"})
def exp_nonpositive(x: float) -> float:
    """exp(x) for float32 x <= 0, in arithmetic only: x = k ln 2 + r with
    |r| <= ln 2 / 2, exp(r) by Cephes' expf polynomial, and 2^k by writing k
    into a float's exponent bits. Below -87 (exp < 1.7e-38, where float32
    stops being normal) it returns exp(-87), which is 0 to a softmax; NaN
    stays NaN, so a poisoned score still shows."""
    x = np.float32(-87.0) if x < np.float32(-87.0) else x
    # k as a float32: an integer k would make every product below float64,
    # half as many SIMD lanes, for accuracy a float32 result cannot keep.
    k = np.float32(math.floor(x * _LOG2_E + np.float32(0.5)))
    r = x - k * _LN2_HIGH - k * _LN2_LOW
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * _float32_from_bits((np.int32(k) + 127) << 23)


def paged_attention_decode(
    out: np.ndarray,  # [num_seqs, num_heads, head_size]
    query: np.ndarray,  # [num_seqs, num_heads, head_size]
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: np.ndarray,  # [num_seqs, max_blocks_per_seq], int64
    seq_lens: np.ndarray,  # [num_seqs], int64, each >= 1
    scale: float,
) -> None:
    """Check the decode contract (attention/kv_cache.py), then run the kernel.

    Compiled code does not check bounds: a block number past the pool or a
    length past the table would read other memory, or crash the process.
    Everything is on the host here, so the values are checked too.
    """
    if out.shape != query.shape or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"out {out.shape} must match query {query.shape}, and the value cache "
            f"{value_cache.shape} the key cache {key_cache.shape}"
        )
    max_seq_len = int(seq_lens.max(initial=0))
    check_decode_args(query.shape, key_cache.shape, block_tables.shape, seq_lens.shape, max_seq_len)
    if len(seq_lens) and seq_lens.min() < 1:
        raise ValueError(f"every sequence attends to at least 1 token, got seq_lens {seq_lens}")
    if block_tables.size and not 0 <= block_tables.min() <= block_tables.max() < len(key_cache):
        raise ValueError(
            f"block numbers must be in [0, {len(key_cache)}), got "
            f"{block_tables.min()}..{block_tables.max()}"
        )
    for name, array, dtype in (
        ("out", out, np.float32), ("query", query, np.float32),
        ("key_cache", key_cache, np.float32), ("value_cache", value_cache, np.float32),
        ("block_tables", block_tables, np.int64), ("seq_lens", seq_lens, np.int64),
    ):  # fmt: skip
        if array.dtype != dtype or not array.flags.c_contiguous:
            layout = "C-contiguous" if array.flags.c_contiguous else "not C-contiguous"
            raise ValueError(
                f"{name} must be a C-contiguous {np.dtype(dtype).name} array "
                f"(DECODE_SIGNATURE), got {array.dtype}, {layout}"
            )
    # Items per sequence: enough for every thread when sequences are few.
    num_kv_heads = key_cache.shape[2]
    items_per_seq = min(num_kv_heads, -(-numba.get_num_threads() // max(len(seq_lens), 1)))
    kv_heads_per_item = -(-num_kv_heads // items_per_seq)
    kernel = decode_kernel(query.shape[2], query.shape[1] // num_kv_heads)
    kernel(out, query, key_cache, value_cache, block_tables, seq_lens, scale, kv_heads_per_item)


# What the kernel is compiled for, and all it accepts: float32 arrays and int64
# tables, C-contiguous, as the Numba backend passes them (`.numpy()` of its tensors).
_F32_3D, _F32_4D = numba.float32[:, :, ::1], numba.float32[:, :, :, ::1]
DECODE_SIGNATURE = types.void(
    _F32_3D,  # out
    _F32_3D,  # query
    _F32_4D,  # key_cache
    _F32_4D,  # value_cache
    numba.int64[:, ::1],  # block_tables
    numba.int64[::1],  # seq_lens
    types.float64,  # scale
    types.int64,  # kv_heads_per_item
)


@functools.cache
def decode_kernel(head_size: int, group: int):
    """The kernel for one head size and GQA group (query heads per KV head),
    compiled when first asked for: both are constants inside it, as vLLM's
    CPU kernel takes HEAD_SIZE as a template parameter and instantiates it per
    head size (csrc/cpu/attention.cpp, `paged_attention_v1_impl<scalar_t,
    HEAD_SIZE, BLOCK_SIZE>`).

    A head's row is short: 64 floats fill 8 AVX2 registers (4 of AVX-512's).
    With `head_size` known, LLVM unrolls each row loop into those few
    instructions. Known only at run time, every row pays for a trip-count
    test, a remainder loop and the setup of the SIMD sums, and those cost more
    than the row's arithmetic. With `group` known, the loop over a group's
    query heads unrolls too, and each K or V row is loaded into registers once
    for the whole group. For the 20M model (head_size 64, group 2), against
    the kernel with both read from the shapes: 1.3-1.5x faster on one thread
    with K/V in cache, 1.2x on two threads over caches the size of the
    engine's at batch 64, where memory holds it more than arithmetic. The
    order of every sum is still fixed at compile time, so the batch still
    changes no bit of a sequence's output.

    Compiled once per checkout (about 5 s) into Numba's disk cache, for one
    signature (`DECODE_SIGNATURE`) under a qualified name of its own per
    (head_size, group), so every cache index holds exactly one entry. Numba
    adds an entry to an index by reading it, numbering the entry's file after
    the first free number and writing both back, without a lock: two
    processes adding *different* entries to one index at once could both
    take number 1 and leave the index pointing at a kernel built for another
    head size. Processes that write the same single entry write the same thing.
    """

    def _paged_attention_decode(
        out: np.ndarray,  # [num_seqs, num_heads, head_size]
        query: np.ndarray,  # [num_seqs, num_heads, head_size]
        key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_size]
        block_tables: np.ndarray,  # [num_seqs, max_blocks_per_seq], int64
        seq_lens: np.ndarray,  # [num_seqs], int64, each >= 1
        scale: float,
        kv_heads_per_item: int,  # KV heads one work item computes (the last may have fewer)
    ) -> None:
        num_seqs = query.shape[0]
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        row = num_kv_heads * head_size  # elements in a token's K (or V) row
        line = 64 // key_cache.itemsize  # elements in a 64-byte cache line
        items_per_seq = (num_kv_heads + kv_heads_per_item - 1) // kv_heads_per_item
        for work in numba.prange(num_seqs * items_per_seq):
            seq, item = work // items_per_seq, work % items_per_seq
            first_kv = item * kv_heads_per_item
            last_kv = min(first_kv + kv_heads_per_item, num_kv_heads)
            first_head, heads = first_kv * group, (last_kv - first_kv) * group
            seq_len = seq_lens[seq]
            last_block = (seq_len - 1) // block_size
            # The item's stretch of a row, [first, end) in elements from the row's start.
            first, end = first_kv * head_size, last_kv * head_size
            q = query[seq, first_head : first_head + heads].astype(np.float32)  # [heads, head_size]

            # Scores for every token, for each query head of the item.
            logits = np.empty((heads, seq_len), dtype=np.float32)
            for t in range(seq_len):
                i, offset = t // block_size, t % block_size
                block = block_tables[seq, i]
                if i < last_block:  # the same row of the next block, line by line
                    ahead = (block_tables[seq, i + 1] * block_size + offset) * row
                    for f in range(ahead + first, ahead + end, line):
                        prefetch(key_cache, f)
                k_row = key_cache[block, offset]  # [num_kv_heads, head_size], contiguous
                for kv in range(last_kv - first_kv):
                    k = k_row[first_kv + kv]  # [head_size], shared by the group's heads
                    for g in range(group):
                        h = kv * group + g
                        dot = np.float32(0.0)
                        for d in range(head_size):
                            dot += q[h, d] * k[d]
                        logits[h, t] = dot * scale

            # Softmax numerators, relative to each head's max for stability.
            inv_sums = np.empty(heads, dtype=np.float32)
            for h in range(heads):
                m = logits[h].max()
                s = np.float32(0.0)
                for t in range(seq_len):
                    e = exp_nonpositive(logits[h, t] - m)
                    logits[h, t] = e
                    s += e
                inv_sums[h] = 1.0 / s

            # Probability-weighted sum of V rows.
            acc = np.zeros((heads, head_size), dtype=np.float32)
            for t in range(seq_len):
                i, offset = t // block_size, t % block_size
                block = block_tables[seq, i]
                if i < last_block:
                    ahead = (block_tables[seq, i + 1] * block_size + offset) * row
                    for f in range(ahead + first, ahead + end, line):
                        prefetch(value_cache, f)
                v_row = value_cache[block, offset]  # [num_kv_heads, head_size]
                for kv in range(last_kv - first_kv):
                    v = v_row[first_kv + kv]  # [head_size], shared by the group's heads
                    for g in range(group):
                        h = kv * group + g
                        p = logits[h, t]
                        for d in range(head_size):
                            acc[h, d] += p * v[d]
            for h in range(heads):
                for d in range(head_size):
                    out[seq, first_head + h, d] = acc[h, d] * inv_sums[h]

    _paged_attention_decode.__qualname__ = f"decode_kernel_{head_size}_{group}"
    return numba.njit(
        DECODE_SIGNATURE, parallel=True, cache=True, fastmath={"reassoc", "contract"}
    )(_paged_attention_decode)
