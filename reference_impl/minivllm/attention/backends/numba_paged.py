"""`attention_backend="numba"`: decodes by the Numba CPU kernel.

Prefills keep the PyTorch reference path; decodes, one query token per
sequence, go to `ops/paged_attn_numba.py`, which reads K/V straight from the
blocks instead of gathering a padded copy first.
"""

from __future__ import annotations

import torch

from minivllm.attention.backends.abstract import AttentionImpl
from minivllm.attention.backends.torch_paged import TorchAttentionBackend, TorchPagedAttention
from minivllm.attention.ops.paged_attn_numba import paged_attention_decode
from minivllm.utils import numba_threads

# K/V rows a thread should have to itself before the kernel uses one more.
# Starting a parallel region wakes the pool's sleeping threads (minivllm sets
# OMP_WAIT_POLICY=PASSIVE, envs.py): about 50 us on our 2-core VM, where one
# thread reads a row in about 35 ns, so a second thread pays off from about
# 3 000 rows (a batch of 8 at 67 tokens and 4 KV heads is 2 144: 75 us on one
# thread, 86 on two). Each (sequence, KV head) is computed the same way
# whatever the thread count, so outputs do not change with it.
MIN_ROWS_PER_THREAD = 3072


def kernel_threads(rows: int) -> int:
    """Threads for a kernel reading `rows` K/V rows: one per
    MIN_ROWS_PER_THREAD, at least 1 (`numba_threads` caps them at torch's
    count and Numba's pool)."""
    return max(1, rows // MIN_ROWS_PER_THREAD)


class NumbaPagedAttention(TorchPagedAttention):
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
