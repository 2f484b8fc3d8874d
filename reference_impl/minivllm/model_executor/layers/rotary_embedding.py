"""Rotary position embedding (RoPE), as Llama-family models use it.

Each pair of dimensions (i, i + head_size/2) of q and k is rotated by the
angle position * inv_freq[i] ("neox" layout, Hugging Face's rotate_half).
cos and sin for every position are computed once, in float32, and rounded to
the activations' dtype when applied, as Hugging Face does.
"""

from __future__ import annotations

import math
from collections.abc import Container

import torch
from transformers import PretrainedConfig

from minivllm import _custom_ops
from minivllm.config import SUPPORTED_ROPE_TYPES, rope_parameters
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.layers import cpu_ops_numba


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context rescaling: slow (long-wavelength) frequencies
    are divided by `factor`, fast ones are kept, and the band between is
    interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen) - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(in_band, interpolated, out)


class RotaryEmbedding(CustomOp):
    def __init__(self, head_size: int, max_position: int, config: PretrainedConfig) -> None:
        super().__init__()
        self.head_size = head_size
        base, scaling = rope_parameters(config)
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:  # ModelConfig refuses it first
            raise ValueError(f"rope type {rope_type!r} is not supported")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        if rope_type == "linear":
            # Positions stretched by `factor`: the context grows by it too
            # (vLLM's LinearScalingRotaryEmbedding).
            factor = scaling["factor"]
            positions = torch.arange(int(max_position * factor), dtype=torch.float32) / factor
        else:
            positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [num_positions, head_size / 2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward_native(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions][:, None, :]  # [num_tokens, 1, head_size / 2]
        sin = self.sin_cache[positions][:, None, :]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def forward_cpu(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One Numba pass, the native bits, for what the kernel reads without
        bounds checks: int64 positions, one per row of float32 query and key
        rows of whole heads, unit stride within a row (as the split of the
        fused qkv projection gives), no autograd. Anything else runs native."""
        if not self._kernel_fits(positions, query, key):
            return self.forward_native(positions, query, key)
        return cpu_ops_numba.rotary_embedding(
            positions, query, key, self.head_size, self.cos_cache, self.sin_cache
        )

    def forward_cuda(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel (`csrc/pos_encoding_kernels.cu`) for q and k, under the
        same conditions as the CPU's, in any of the kernels' dtypes. Like
        the CPU kernel it trusts the positions to be below max_position (the
        engine's are); the native code raises on one past it."""
        if not self._kernel_fits(positions, query, key, _custom_ops.CUDA_DTYPES):
            return self.forward_native(positions, query, key)
        return _custom_ops.rotary_embedding(
            positions, query, key, self.head_size, self.cos_cache, self.sin_cache
        )

    def _kernel_fits(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        dtypes: Container = (torch.float32,),
    ) -> bool:
        rows = (query, key)
        return (
            self.head_size % 2 == 0
            # float32 caches, as built (a model cast with .to() casts them too)
            and all(c.dtype == torch.float32 and c.is_contiguous()
                    for c in (self.cos_cache, self.sin_cache))
            and positions.dtype == torch.int64
            and positions.dim() == 1
            and positions.is_contiguous()
            and all(t.dim() == 2 and t.shape[0] == positions.shape[0] for t in rows)
            and all(t.shape[1] % self.head_size == 0 for t in rows)
            and query.dtype in dtypes
            and all(t.dtype == query.dtype and t.stride(-1) == 1 for t in rows)
            and not (query.requires_grad or key.requires_grad)
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)  # [num_tokens, heads, head_size]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.view(num_tokens, -1)
