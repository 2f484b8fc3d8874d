"""What the opaque ops of a compiled model read at run time.

A compiled graph must not depend on the per-step Python values of
`AttentionMetadata` (lists of sequence lengths, the number of prefills):
TorchDynamo would guard on each of them and recompile nearly every step. So
the graph only carries each layer's q, k and v into an opaque attention op
(`attention/layer.py::unified_attention`), and the op takes the step's
metadata and the layer's KV cache from here. The model runner sets them
around each forward (vLLM's `set_forward_context`, vllm/forward_context.py).
The CPU's packed linear products (model_executor/layers/utils.py) find their
layer's packed weight here the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minivllm.attention.backends.abstract import AttentionMetadata


@dataclass
class ForwardContext:
    """One forward pass: the batch layout, and per attention layer (in the
    order `Attention.layer_index` numbers them) its module and KV cache."""

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer: [2, num_blocks, block_size, kv_heads, head]
    attn_layers: list[Any]  # the model's `Attention` modules
    # The layers with packed CPU weights, as `packed_gemm_layers` numbers
    # them, for the compiled model's `cpu_packed_linear` op.
    packed_layers: list[Any]


_forward_context: ContextVar[ForwardContext | None] = ContextVar("forward_context", default=None)


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata,
    kv_caches: list[torch.Tensor],
    attn_layers: list[Any],
    packed_layers: list[Any],
) -> Iterator[None]:
    context = ForwardContext(attn_metadata, kv_caches, attn_layers, packed_layers)
    token = _forward_context.set(context)
    try:
        yield
    finally:
        _forward_context.reset(token)


def get_forward_context() -> ForwardContext:
    context = _forward_context.get()
    if context is None:
        raise RuntimeError(
            "a compiled model's attention ran outside a forward context: run the model "
            "through ModelRunner.execute_model, or inside compilation.set_forward_context"
        )
    return context
