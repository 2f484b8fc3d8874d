"""How a linear layer multiplies on a CPU (vLLM's `dispatch_cpu_unquantized_gemm`
and `cpu_unquantized_gemm`, in `vllm/model_executor/layers/utils.py`).

`F.linear` hands the weight as stored, [out, in], to MKL's sgemm at every
call, and MKL picks its kernel by the number of rows: a matrix-vector
product for one token, a blocked product for more. vLLM's CPU backend does
something else on x86: right after loading, it packs each weight once into
the blocked layout oneDNN's matmul reads fastest, and every step multiplies
by the packed copy. We do the same with torch's own oneDNN operators (those
Inductor uses for frozen CPU weights): `torch.ops.mkldnn._reorder_linear_weight`
packs, `torch.ops.mkldnn._linear_pointwise` multiplies.

Measured on the 20.7M benchmark Llama's 28 projections, 2 threads, float32:
1.4x faster than `F.linear` at 1 token and 256, 1.9x at 8 (the decode batch
sizes where MKL's choice is worst). And a row's result no longer depends on
the other rows: oneDNN computes each row of the packed product the same way
whatever the batch, where `F.linear` gives a token alone (gemv) other last
bits than the same token in a batch (gemm). `F.linear` stays the reference
(`tests/test_cpu_gemm.py` holds the two equal to rounding).

Packed only where it helps and can be used: a float32 weight on an x86 CPU
with oneDNN, in an eager model (`torch.compile` cannot trace an opaque
oneDNN tensor; Inductor packs weights its own way). The packed copy is a
snapshot: a weight changed after loading must be packed again. The weight
itself is kept (for the lessons, the tests and tensor-parallel checks that
read it), so a packed layer holds its weights twice on the CPU.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import nn


def supports_packed_cpu_gemm(weight: torch.Tensor) -> bool:
    """Whether `weight` is one vLLM's CPU backend would pack for oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and platform.machine().lower() in ("x86_64", "amd64")
    )


def dispatch_cpu_unquantized_gemm(layer: nn.Module) -> None:
    """Pack `layer.weight` ([out, in]) for oneDNN, once, after loading; a
    layer it does not suit keeps `F.linear` (packed_weight None)."""
    weight = layer.weight
    layer.packed_weight = (
        torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        if supports_packed_cpu_gemm(weight)
        else None
    )


def unquantized_gemm(
    layer: nn.Module,
    x: torch.Tensor,  # [num_tokens, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [num_tokens, out]
    """x @ layer.weight.T + bias: by the packed weight when there is one."""
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
