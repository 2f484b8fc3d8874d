"""The CPU kernels of the `CustomOp` layers (model_executor/custom_op.py), compiled by Numba.

vLLM's CPU build has C++ kernels for these (csrc/cpu/layernorm.cpp,
csrc/cpu/pos_encoding.cpp), called through `vllm._custom_ops` as
`rms_norm` (into a new tensor), `fused_add_rms_norm` (in place) and
`rotary_embedding` (in place; ours is not, and says why). Each is one pass
over the rows instead of the 7-12 PyTorch operators of the layer's
`forward_native`, whose fixed cost dominates a decode step of a few
sequences.

Compiled code checks no bounds: the layers call these only with shapes
they have checked (`_kernel_fits`). What they compute, against
`forward_native`:
- `rotary_embedding`: the same bits. Each output is one product, one
  product and one sum or difference, rounded in the same order as the
  native operators; no `fastmath`, so LLVM fuses no multiply-add.
- `rms_norm`, `fused_add_rms_norm`: the same arithmetic, except that the sum
  of squares is added in Numba's order rather than torch's (within a few
  float32 steps). The order depends only on the row's length, so a row's
  result does not depend on the batch.

They are serial: a decode step's rows are few, and waking a thread pool
costs more than the work. Each is compiled for one signature (float32), so
its Numba disk-cache index holds one entry
(attention/ops/paged_attn_numba.py::decode_kernel says why that matters),
and at its first call, not at import: a run on a GPU never calls them.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba import types

_ROWS = numba.float32[:, ::1]  # [num_tokens, hidden_size], C-contiguous
_VECTOR = numba.float32[::1]


def _compiled_at_first_call(signature):
    """`numba.njit(signature, cache=True)`, compiled (or loaded from the disk
    cache) when first called: with a signature, Numba compiles at import."""

    def decorate(fn):
        kernel = functools.cache(lambda: numba.njit(signature, cache=True)(fn))
        return functools.wraps(fn)(lambda *args: kernel()(*args))

    return decorate


@numba.njit(fastmath={"reassoc"})
def _mean_square(row: np.ndarray) -> np.float32:
    """mean(row ** 2), summed in SIMD lanes: `reassoc` here only, so the
    element-wise arithmetic of the callers keeps the native rounding."""
    total = np.float32(0.0)
    for j in range(row.size):
        total += row[j] * row[j]
    return total / np.float32(row.size)


@_compiled_at_first_call(types.void(_ROWS, _ROWS, _VECTOR, types.float32))
def _rms_norm(out, x, weight, eps):
    for i in range(x.shape[0]):
        inv_rms = np.float32(1.0) / np.sqrt(_mean_square(x[i]) + eps)
        for j in range(x.shape[1]):
            out[i, j] = weight[j] * (x[i, j] * inv_rms)


@_compiled_at_first_call(types.void(_ROWS, _ROWS, _VECTOR, types.float32))
def _fused_add_rms_norm(x, residual, weight, eps):
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            residual[i, j] = x[i, j] + residual[i, j]
        inv_rms = np.float32(1.0) / np.sqrt(_mean_square(residual[i]) + eps)
        for j in range(x.shape[1]):
            x[i, j] = weight[j] * (residual[i, j] * inv_rms)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size], float32, contiguous
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden_size], a new tensor
    out = torch.empty_like(x)
    _rms_norm(out.numpy(), x.numpy(), weight.detach().numpy(), eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size], float32, contiguous: the sublayer's output
    residual: torch.Tensor,  # [num_tokens, hidden_size], float32, contiguous
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> None:
    """In place, as vLLM's: `residual` becomes x + residual, and `x` its norm."""
    _fused_add_rms_norm(x.numpy(), residual.numpy(), weight.detach().numpy(), eps)


_STRIDED_ROWS = numba.float32[:, :]  # rows may be strided: views of the fused qkv projection


@_compiled_at_first_call(
    types.void(
        numba.int64[::1],  # positions [num_tokens]
        _STRIDED_ROWS,  # query [num_tokens, num_heads * head_size]
        _STRIDED_ROWS,  # key [num_tokens, num_kv_heads * head_size]
        _ROWS,  # query_out, like query
        _ROWS,  # key_out, like key
        _ROWS,  # cos [max_position, head_size / 2]
        _ROWS,  # sin
        types.int64,  # head_size
    )
)
def _rotary_embedding(positions, query, key, query_out, key_out, cos_cache, sin_cache, head_size):
    half = head_size // 2
    for i in range(positions.size):
        position = positions[i]
        if not 0 <= position < cos_cache.shape[0]:
            raise IndexError("a position is outside the rotary cache (max_position_embeddings)")
        cos, sin = cos_cache[position], sin_cache[position]
        for x, out in ((query[i], query_out[i]), (key[i], key_out[i])):
            for start in range(0, x.size, head_size):
                for j in range(half):
                    x1, x2 = x[start + j], x[start + half + j]
                    out[start + j] = x1 * cos[j] - x2 * sin[j]
                    out[start + half + j] = x2 * cos[j] + x1 * sin[j]


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens], int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_size], float32, unit stride in a row
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size], float32
    head_size: int,
    cos_cache: torch.Tensor,  # [max_position, head_size / 2], float32
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # new, contiguous
    """Query and key rotated in the neox layout (the pairs are (i, i + head_size / 2)
    within each head). vLLM's `rotary_embedding` rotates them in place; this writes
    new tensors, as `forward_native` does: q and k are strided views of the fused
    projection, and attention would copy them into contiguous rows anyway."""
    query_out = torch.empty(query.shape, dtype=query.dtype)
    key_out = torch.empty(key.shape, dtype=key.dtype)
    _rotary_embedding(
        positions.numpy(), query.numpy(), key.numpy(), query_out.numpy(), key_out.numpy(),
        cos_cache.numpy(), sin_cache.numpy(), head_size,
    )
    return query_out, key_out
