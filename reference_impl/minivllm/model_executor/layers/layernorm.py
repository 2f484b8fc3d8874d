"""RMSNorm (Llama, Qwen2, Mistral). GPT-2 and OPT use torch's LayerNorm."""

from __future__ import annotations

from collections.abc import Container

import torch
from torch import nn

from minivllm import _custom_ops
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.layers import cpu_ops_numba


class RMSNorm(CustomOp):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 like the
    Hugging Face reference so that half-precision runs round the same way.

    Given `residual`, as vLLM's RMSNorm: first `x + residual`, which becomes
    the new residual, then the norm of it; returns (normed, new residual).
    A decoder layer's residual add and the next norm are one call this way,
    which vLLM's kernel (`fused_add_rms_norm`) does in place in one pass over
    the hidden states. Both `x`, the sublayer's output, and the residual may
    be overwritten: nothing else reads them.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward_native(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            residual = x.add_(residual)
            return self._norm(residual), residual
        return self._norm(x)

    def forward_cpu(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One Numba pass, for what the kernels read without bounds checks:
        float32 rows of the weight's width, a residual of the same shape,
        contiguous, no autograd. Anything else runs the native code."""
        if not self._kernel_fits(x, residual):
            return self.forward_native(x, residual)
        if residual is None:
            return cpu_ops_numba.rms_norm(x, self.weight, self.variance_epsilon)
        cpu_ops_numba.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        return x, residual

    def forward_cuda(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One kernel (`csrc/layernorm_kernels.cu`), for what it reads
        without bounds checks: rows of the weight's width in one of the
        kernels' dtypes, the weight's too, contiguous, no autograd."""
        if not self._kernel_fits(x, residual, _custom_ops.CUDA_DTYPES):
            return self.forward_native(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            _custom_ops.rms_norm(out, x, self.weight, self.variance_epsilon)
            return out
        _custom_ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        return x, residual

    def _kernel_fits(
        self, x: torch.Tensor, residual: torch.Tensor | None, dtypes: Container = (torch.float32,)
    ) -> bool:
        tensors = (x, self.weight) if residual is None else (x, residual, self.weight)
        return (
            x.dim() == 2
            and self.weight.shape == (x.shape[1],)
            and (residual is None or residual.shape == x.shape)
            and x.dtype in dtypes
            and all(t.dtype == x.dtype and t.is_contiguous() for t in tensors)
            and not (x.requires_grad or (residual is not None and residual.requires_grad))
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)
