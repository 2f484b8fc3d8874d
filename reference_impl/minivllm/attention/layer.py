"""`Attention`: the layer every model calls; it caches K/V then attends.

The model hands it this step's projected q, k, v for every token in the
batch. It writes k and v into the paged cache at `slot_mapping`, then lets
the backend compute attention reading K/V back through the block tables.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.attention.backends.abstract import AttentionMetadata
from minivllm.attention.selector import get_attn_backend


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        # The backend chosen by the engine (attention/selector.py).
        self.impl = get_attn_backend()(num_heads, head_size, scale, self.num_kv_heads)

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
        # The kv_cache.py ordering rule: the whole batch's K/V first, then attention.
        self.impl.write_to_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        output = self.impl.forward(query, kv_cache, attn_metadata)
        return output.view(num_tokens, self.num_heads * self.head_size)
