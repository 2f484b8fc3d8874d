"""`attention_backend="cuda"`: the CUDA kernels of `csrc/` (see `_custom_ops.py`).

K/V are written by `reshape_and_cache`; decodes run `paged_attention_v1` or
`_v2`; prefills keep the PyTorch reference path on the GPU. Copy-on-write
runs the `copy_blocks` kernel; swapping (device <-> host) stays a torch copy.
"""

from __future__ import annotations

import torch

from minivllm import _custom_ops as ops
from minivllm.attention.backends.abstract import AttentionImpl
from minivllm.attention.backends.torch_paged import TorchAttentionBackend, TorchPagedAttention


def use_v1(max_seq_len: int, num_seqs: int, num_heads: int) -> bool:
    """v1 when one partition covers the context, or when there are already
    enough (sequence, head) thread blocks to fill the GPU without splitting."""
    if max_seq_len > ops.V1_MAX_SEQ_LEN:
        return False
    num_partitions = -(-max_seq_len // ops.PARTITION_SIZE)
    return num_partitions == 1 or num_seqs * num_heads > 512


class CudaPagedAttention(TorchPagedAttention):
    write_to_kv_cache = staticmethod(ops.reshape_and_cache)

    def forward_decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        block_tables: torch.Tensor,  # [num_decodes, max_blocks]
        seq_lens: torch.Tensor,  # [num_decodes]
        max_seq_len: int,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_size]
        # The kernels' launch size needs the longest decode context: the
        # metadata's host-side value, since seq_lens.max() on the GPU tensor
        # would stall the CPU until the GPU caught up, once per layer.
        query = query.contiguous()
        out = torch.empty_like(query)
        if use_v1(max_seq_len, num_seqs=query.shape[0], num_heads=query.shape[1]):
            kernel = ops.paged_attention_v1
        else:
            kernel = ops.paged_attention_v2
        kernel(
            out, query, kv_cache[0], kv_cache[1], block_tables, seq_lens, self.scale, max_seq_len
        )
        return out


class CudaAttentionBackend(TorchAttentionBackend):
    """The CUDA kernels for attention and copy-on-write; swaps by torch copies."""

    @staticmethod
    def get_name() -> str:
        return "cuda"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CudaPagedAttention

    # Its kernels take every length from the GPU's tensors. (The torch
    # backend's K/V write asks the GPU whether any slot is padding.)
    supports_cuda_graphs = True

    copy_blocks = staticmethod(ops.copy_blocks)
