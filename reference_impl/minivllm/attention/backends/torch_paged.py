"""Paged attention in plain PyTorch: the reference every faster backend is
checked against.

K and V are always read back *through the block tables*, for prefills as
for decodes, so this backend exercises the same paging a kernel does.
Scores and softmax are computed in float32.
"""

from __future__ import annotations

import torch

from minivllm.attention import kv_cache as cache_ops
from minivllm.attention.backends.abstract import AttentionBackend, AttentionImpl
from minivllm.attention.kv_cache import gather_kv


class TorchPagedAttention(AttentionImpl):
    """Causal attention over a mixed prefill + decode batch with GQA.

    `forward` (from `AttentionImpl`) writes the K/V, then calls the two
    halves below."""

    def forward_prefill(
        self,
        query: torch.Tensor,  # [q_len, num_heads, head_size]
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,  # [1, max_blocks]
        context_len: int,
        seq_len: int,
    ) -> torch.Tensor:
        """One prefill: q_len new tokens after `context_len` cached ones.

        Query row j sits at position context_len + j and sees keys 0..that.
        """
        keys, values = gather_kv(kv_cache, block_table)
        keys, values = keys[0, :seq_len], values[0, :seq_len]  # [seq_len, kv_heads, head]
        q_len = query.shape[0]
        q = query.view(q_len, self.num_kv_heads, self.num_queries_per_kv, self.head_size)
        # [kv_heads, group, q_len, seq_len]
        scores = torch.einsum("qkgd,skd->kgqs", q.float(), keys.float()) * self.scale
        q_pos = torch.arange(context_len, context_len + q_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        future = k_pos[None, :] > q_pos[:, None]  # [q_len, seq_len]
        scores.masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("kgqs,skd->qkgd", probs, values.float())
        return out.reshape(q_len, self.num_heads, self.head_size).to(query.dtype)

    def forward_decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_decodes, max_blocks]
        seq_lens: torch.Tensor,  # [num_decodes]
        max_seq_len: int,
    ) -> torch.Tensor:
        """All decodes at once: one query token each, padded to the longest."""
        keys, values = gather_kv(kv_cache, block_tables)  # [B, max_len, kv_heads, head]
        b = query.shape[0]
        q = query.view(b, self.num_kv_heads, self.num_queries_per_kv, self.head_size)
        # [B, kv_heads, group, max_len]
        scores = torch.einsum("bkgd,bskd->bkgs", q.float(), keys.float()) * self.scale
        k_pos = torch.arange(keys.shape[1], device=query.device)
        beyond = k_pos[None, :] >= seq_lens[:, None]  # [B, max_len]
        scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # Slots past a sequence's end hold stale data, possibly NaN, and
        # 0 * NaN is NaN: zero them rather than trust the zero weight.
        values = values.float().masked_fill(beyond[:, :, None, None], 0.0)
        out = torch.einsum("bkgs,bskd->bkgd", probs, values)
        return out.reshape(b, self.num_heads, self.head_size).to(query.dtype)


class TorchAttentionBackend(AttentionBackend):
    """`attention_backend="torch"`: the reference, and block copies by indexing."""

    @staticmethod
    def get_name() -> str:
        return "torch"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchPagedAttention

    swap_blocks = staticmethod(cache_ops.swap_blocks)
    copy_blocks = staticmethod(cache_ops.copy_blocks)
