"""`attention_backend="numba"`: the CPU default.

Decodes, one query token per sequence, go to `ops/paged_attn_numba.py`,
which reads K/V straight from the blocks instead of gathering a padded copy
first. Prefills go to torch's fused `scaled_dot_product_attention`, as
vLLM's CPU backend computes them (`vllm/attention/backends/torch_sdpa.py`).
The reference (`torch_paged.py`) is what both are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.backends.abstract import AttentionImpl
from minivllm.attention.backends.torch_paged import TorchAttentionBackend, TorchPagedAttention
from minivllm.attention.kv_cache import gather_kv
from minivllm.attention.ops.paged_attn_numba import paged_attention_decode
from minivllm.utils import cdiv, numba_threads

# K/V rows a thread should have to itself before the kernel uses one more.
# Starting a parallel region wakes the pool's sleeping threads (minivllm sets
# OMP_WAIT_POLICY=PASSIVE, envs.py), which costs more than a few hundred rows
# take. On our 2-core VM, with the pool asleep before each call and blocks
# scattered over a 130 MB cache, one thread took 40-80 ns a row and two were
# faster from 1 024 rows on (one sequence of 256 tokens with 4 KV heads: 71
# against 82 us). In the engine (20M model, steps alternated in one process),
# a second thread from 1 024 rows instead of 6 144 made decode steps of 2-8
# sequences 1.06-1.08x faster, and of one sequence at 1 040 rows 1.01x. Each
# (sequence, KV head) is computed the same way whatever the thread count, so
# outputs do not change with it.
MIN_ROWS_PER_THREAD = 512


def kernel_threads(rows: int) -> int:
    """Threads for a kernel reading `rows` K/V rows: one per
    MIN_ROWS_PER_THREAD, at least 1 (`numba_threads` caps them at torch's
    count and Numba's pool)."""
    return max(1, rows // MIN_ROWS_PER_THREAD)


class NumbaPagedAttention(TorchPagedAttention):
    def forward_prefill(
        self,
        query: torch.Tensor,  # [q_len, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        block_table: torch.Tensor,  # [1, max_blocks]
        context_len: int,
        seq_len: int,
    ) -> torch.Tensor:  # [q_len, num_heads, head_size]
        """One prefill by torch's `scaled_dot_product_attention`: one fused
        kernel, where the reference makes a [q_len, seq_len] score matrix per
        head, masks it, and multiplies twice. It reads only the sequence's own
        blocks (the reference gathers the whole table), in float32 as the
        reference does. 2.4-2.9x faster than the reference for a 256-token
        prompt of the 20M model, 1.5x for 64 new tokens after 192 cached.

        Query row j sits at position context_len + j. SDPA's `is_causal`
        aligns its mask to the top left (row j sees keys 0..j), which is right
        only without a cached context; with one, the mask is given.
        """
        block_size = kv_cache.shape[2]
        keys, values = gather_kv(kv_cache, block_table[:, : cdiv(seq_len, block_size)])
        # SDPA's layout: [1, heads, tokens, head_size].
        q = query.float().transpose(0, 1)[None]
        k = keys[0, :seq_len].float().transpose(0, 1)[None]
        v = values[0, :seq_len].float().transpose(0, 1)[None]
        mask = None
        if context_len:
            q_pos = torch.arange(context_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=not context_len, scale=self.scale, enable_gqa=True
        )  # [1, num_heads, q_len, head_size]
        return out[0].transpose(0, 1).to(query.dtype)

    def forward_decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        block_tables: torch.Tensor,  # [num_decodes, max_blocks]
        seq_lens: torch.Tensor,  # [num_decodes]
        max_seq_len: int,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_size]
        out = torch.empty_like(query)
        rows = int(seq_lens.sum()) * kv_cache.shape[3]  # K/V rows the kernel reads
        with numba_threads(kernel_threads(rows)):
            # .numpy() shares memory with the CPU tensors: no copies.
            paged_attention_decode(
                out.numpy(),
                query.contiguous().numpy(),
                kv_cache[0].numpy(),
                kv_cache[1].numpy(),
                block_tables.numpy(),
                seq_lens.numpy(),
                self.scale,
            )
        return out


class NumbaAttentionBackend(TorchAttentionBackend):
    """The reference's cache operations (CPU tensors), the Numba decode."""

    @staticmethod
    def get_name() -> str:
        return "numba"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return NumbaPagedAttention
