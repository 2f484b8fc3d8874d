"""`Attention`: the layer every model calls; it caches K/V then attends.

The model hands it this step's projected q, k, v for every token in the
batch. Its `AttentionImpl` writes k and v into the paged cache at
`slot_mapping`, then computes attention reading K/V back through the block
tables.

Under `torch.compile` (`compilation_level` > 0) the layer is not traced: it
becomes one opaque op, `unified_attention` (vLLM's name), which finds the
step's metadata and this layer's KV cache in the forward context
(`compilation/forward_context.py`) and runs exactly the eager code. Why:
`compilation/wrapper.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.attention.backends.abstract import AttentionMetadata
from minivllm.attention.selector import current_attn_backend
from minivllm.compilation.forward_context import get_forward_context


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
        # Which of the model's KV caches is this layer's when compiled
        # (`attention_layers` numbers them); eagerly it is handed in.
        self.layer_index: int | None = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        kv_cache: torch.Tensor,  # see attention/kv_cache.py
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        if torch.compiler.is_compiling():
            # Traced by TorchDynamo: only q, k, v enter the graph.
            if self.layer_index is None:
                raise RuntimeError(
                    "an Attention layer was compiled before attention_layers(model) numbered it"
                )
            return torch.ops.minivllm.unified_attention(query, key, value, self.layer_index)
        return self.attend(query, key, value, kv_cache, attn_metadata)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        # The impl writes key/value into kv_cache, then attends (AttentionImpl.forward).
        output = self.impl.forward(query, key, value, kv_cache, attn_metadata)
        return output.view(num_tokens, self.num_heads * self.head_size)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's `Attention` layers in module order, each told its index.

    The index picks the layer's tensor in the engine's `kv_caches` list: the
    models here pass `kv_caches[i]` to their i-th decoder layer, which is the
    i-th `Attention` in module order."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for index, layer in enumerate(layers):
        layer.layer_index = index
    return layers


@torch.library.custom_op("minivllm::unified_attention", mutates_args=())
def unified_attention(
    query: torch.Tensor,  # [num_tokens, num_heads * head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    layer_index: int,
) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
    """One compiled layer's attention, run eagerly: the layer's `attend` with
    the step's metadata and the layer's cache from the forward context.

    It writes the KV cache, which the compiler does not see (no argument is
    declared mutated): the cache is no input of the graph, and nothing in the
    graph reads it but this op, so declaring it would only make the compiler
    copy it (functionalisation) to no purpose."""
    context = get_forward_context()
    layer = context.attn_layers[layer_index]
    return layer.attend(
        query, key, value, context.kv_caches[layer_index], context.attn_metadata
    )


@unified_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_index: int):
    # The output's shape for tracing: one row per token, like the query (contiguous).
    return query.new_empty(query.shape)
