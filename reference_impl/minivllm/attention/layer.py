"""`Attention`: the layer every model calls; it caches K/V then attends.

The model hands it this step's projected q, k, v for every token in the
batch. Its `AttentionImpl` writes k and v into the paged cache at
`slot_mapping`, then computes attention reading K/V back through the block
tables.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.attention.backends.abstract import AttentionMetadata
from minivllm.attention.selector import current_attn_backend


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        # The implementation of the backend chosen by the engine (attention/selector.py).
        impl_cls = current_attn_backend().get_impl_cls()
        self.impl = impl_cls(num_heads, head_size, scale, self.num_kv_heads)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        kv_cache: torch.Tensor,  # see attention/kv_cache.py
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        # The impl writes key/value into kv_cache, then attends (AttentionImpl.forward).
        output = self.impl.forward(query, key, value, kv_cache, attn_metadata)
        return output.view(num_tokens, self.num_heads * self.head_size)
