"""The v1 paged-attention kernel of `csrc/paged_attention.cu`, in Python.

A teaching twin: the same grid (one thread block per query head and
sequence), the same thread groups (one group of lanes per token of a KV
block), the same four stages and the same two-level reductions, written with
`numba.cuda` so it can be stepped through on a laptop. With
`NUMBA_ENABLE_CUDASIM=1` set *before numba is first imported*, Numba's CUDA
simulator runs every thread of every block as a Python thread:

    cd lessons && NUMBA_ENABLE_CUDASIM=1 python -c "from day4_paged_attn_numba_cuda import ..."

(or `os.environ[...]` first thing in a notebook). It is Day 4's teaching
material, kept beside the lesson: no attention backend runs it; the test that
holds it equal to the PyTorch reference is tests/test_attention_kernels.py.

Keep shapes tiny there (a few sequences, heads and blocks): it is slow.

Where it differs from the .cu file, and why:
- Template parameters (HEAD_SIZE, BLOCK_SIZE, NUM_THREADS) become arguments
  of `make_paged_attention_v1`, whose closure constants Numba compiles in.
- Everything is float32; the .cu file also reads fp16 and bf16.
- The simulator has no warp shuffles, so `shfl_xor` below exchanges lane
  values through shared memory with two block barriers. Barriers must be
  reached by every thread of the block, so the stage-2 and stage-4 loops run
  the same number of iterations in every warp (the .cu loops need not).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

WARP_SIZE = 32


def make_paged_attention_v1(head_size: int, block_size: int, num_threads: int = 128):
    """Compile the v1 kernel for one (HEAD_SIZE, BLOCK_SIZE, NUM_THREADS)."""
    HEAD_SIZE, BLOCK_SIZE, NUM_THREADS = head_size, block_size, num_threads
    NUM_WARPS = NUM_THREADS // WARP_SIZE
    THREAD_GROUP_SIZE = WARP_SIZE // BLOCK_SIZE  # lanes per token
    VEC_SIZE = max(16 // (THREAD_GROUP_SIZE * 4), 1)  # float32: 4 bytes
    GROUP_CHUNK = THREAD_GROUP_SIZE * VEC_SIZE
    DIMS_PER_LANE = (HEAD_SIZE + WARP_SIZE - 1) // WARP_SIZE
    assert NUM_THREADS % WARP_SIZE == 0 and BLOCK_SIZE * THREAD_GROUP_SIZE == WARP_SIZE
    assert HEAD_SIZE % GROUP_CHUNK == 0

    @cuda.jit(device=True)
    def shfl_xor(scratch, value, lane_mask):
        """__shfl_xor_sync(FULL_MASK, value, lane_mask): lane i receives lane
        (i ^ lane_mask)'s value. lane_mask < 32 keeps the exchange in the warp."""
        tid = cuda.threadIdx.x
        scratch[tid] = value
        cuda.syncthreads()
        other = scratch[tid ^ lane_mask]
        cuda.syncthreads()
        return other

    @cuda.jit(device=True)
    def block_reduce(x, is_max, scratch, red_smem):
        """Warp butterfly, then lane 0 of each warp posts to red_smem and every
        thread combines the NUM_WARPS posted values."""
        offset = WARP_SIZE // 2
        while offset > 0:
            other = shfl_xor(scratch, x, offset)
            x = max(x, other) if is_max else x + other
            offset //= 2
        if cuda.threadIdx.x % WARP_SIZE == 0:
            red_smem[cuda.threadIdx.x // WARP_SIZE] = x
        cuda.syncthreads()
        result = red_smem[0]
        for w in range(1, NUM_WARPS):
            result = max(result, red_smem[w]) if is_max else result + red_smem[w]
        cuda.syncthreads()
        return result

    @cuda.jit
    def paged_attention_v1_kernel(
        out,  # [num_seqs, num_heads, HEAD_SIZE]
        query,  # [num_seqs, num_heads, HEAD_SIZE]
        key_cache,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
        value_cache,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
        block_tables,  # [num_seqs, max_blocks_per_seq]
        seq_lens,  # [num_seqs]
        scale,
    ):
        head = cuda.blockIdx.x
        num_heads = cuda.gridDim.x
        seq = cuda.blockIdx.y
        num_kv_heads = key_cache.shape[2]
        kv_head = head // (num_heads // num_kv_heads)
        seq_len = seq_lens[seq]
        num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        tid = cuda.threadIdx.x
        warp = tid // WARP_SIZE
        lane = tid % WARP_SIZE

        q_smem = cuda.shared.array(HEAD_SIZE, float32)
        red_smem = cuda.shared.array(NUM_WARPS, float32)
        out_smem = cuda.shared.array((NUM_WARPS, HEAD_SIZE), float32)
        scratch = cuda.shared.array(NUM_THREADS, float32)  # for shfl_xor
        logits = cuda.shared.array(0, float32)  # dynamic: [seq_len]

        # 1. The scaled query into shared memory.
        for d in range(tid, HEAD_SIZE, NUM_THREADS):
            q_smem[d] = query[seq, head, d] * scale
        cuda.syncthreads()

        # 2. q.k: warp w takes blocks w, w + NUM_WARPS, ...; group g of the
        #    warp takes token g of the block.
        group = lane // THREAD_GROUP_SIZE
        rank = lane % THREAD_GROUP_SIZE
        qk_max = -math.inf
        for first_block in range(0, num_blocks, NUM_WARPS):
            b = first_block + warp
            token = b * BLOCK_SIZE + group
            valid = token < seq_len  # never read a slot past the end
            dot = float32(0.0)
            if valid:
                k = key_cache[block_tables[seq, b], group, kv_head]  # [HEAD_SIZE]
                for base in range(rank * VEC_SIZE, HEAD_SIZE, GROUP_CHUNK):
                    for j in range(VEC_SIZE):
                        dot += q_smem[base + j] * k[base + j]
            offset = THREAD_GROUP_SIZE // 2
            while offset > 0:
                dot += shfl_xor(scratch, dot, offset)
                offset //= 2
            if valid and rank == 0:
                logits[token] = dot
                qk_max = max(qk_max, dot)

        # 3. Softmax: block max, exponentials, block sum.
        qk_max = block_reduce(qk_max, True, scratch, red_smem)
        exp_sum = float32(0.0)
        for i in range(tid, seq_len, NUM_THREADS):
            e = math.exp(logits[i] - qk_max)
            logits[i] = e
            exp_sum += e
        exp_sum = block_reduce(exp_sum, False, scratch, red_smem)

        # 4. Weighted sum of V: lane l owns dimensions l, l + 32, ...
        acc = cuda.local.array(DIMS_PER_LANE, float32)
        for i in range(DIMS_PER_LANE):
            acc[i] = 0.0
        for first_block in range(0, num_blocks, NUM_WARPS):
            b = first_block + warp
            if b < num_blocks:
                physical_block = block_tables[seq, b]
                count = min(BLOCK_SIZE, seq_len - b * BLOCK_SIZE)  # last block may be partial
                for t in range(count):
                    p = logits[b * BLOCK_SIZE + t]
                    for i in range(DIMS_PER_LANE):
                        d = lane + i * WARP_SIZE
                        if d < HEAD_SIZE:
                            acc[i] += p * value_cache[physical_block, t, kv_head, d]
        for i in range(DIMS_PER_LANE):
            d = lane + i * WARP_SIZE
            if d < HEAD_SIZE:
                out_smem[warp, d] = acc[i]
        cuda.syncthreads()
        for d in range(tid, HEAD_SIZE, NUM_THREADS):
            total = float32(0.0)
            for w in range(NUM_WARPS):
                total += out_smem[w, d]
            out[seq, head, d] = total / exp_sum

    return paged_attention_v1_kernel


def paged_attention_v1(
    query: np.ndarray,  # [num_seqs, num_heads, head_size], float32
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_size], float32
    value_cache: np.ndarray,
    block_tables: np.ndarray,  # [num_seqs, max_blocks_per_seq], int64
    seq_lens: np.ndarray,  # [num_seqs], int64, each >= 1
    scale: float,
    num_threads: int = 128,
) -> np.ndarray:  # [num_seqs, num_heads, head_size]
    """Launch the kernel the way `_custom_ops.paged_attention_v1` launches the .cu one."""
    num_seqs, num_heads, head_size = query.shape
    block_size = key_cache.shape[1]
    kernel = make_paged_attention_v1(head_size, block_size, num_threads)
    out = np.zeros_like(query)
    max_seq_len = int(seq_lens.max())
    grid = (num_heads, num_seqs)
    kernel[grid, num_threads, 0, max_seq_len * 4](
        out, query, key_cache, value_cache, block_tables, seq_lens, np.float32(scale)
    )
    return out
