"""`CustomOp`: a layer with a plain PyTorch forward and a faster one for a platform.

vLLM writes its small, frequent layers (RMSNorm, rotary embedding, ...) as
`CustomOp`s (vllm/model_executor/custom_op.py): `forward_native` is the
reference in PyTorch operators, and `forward_cuda`, `forward_cpu`, ... call
the platform's own kernels (`vllm._custom_ops`, built from csrc/). Eagerly,
a decode step of a small batch is mostly the fixed cost of launching
operators: an RMSNorm is seven of them, a rotary embedding a dozen, each a
few microseconds of dispatch for a few hundred floats of work. One kernel
per layer removes that. Under Inductor vLLM turns the custom ops off
(`VLLM_CUSTOM_OPS` in v0.6, later `CompilationConfig.custom_ops`), so that
the compiler sees the native code and fuses it with its neighbours, which an
opaque kernel would prevent.

Ours has `forward_native`, `forward_cpu` (Numba kernels) and `forward_cuda`
(our CUDA kernels in `csrc/`, launched through CuPy; without CuPy a GPU runs
the native code). And it chooses on every call, where vLLM chooses once,
when the layer is built, from the engine's config (`get_current_vllm_config()`,
set while the model is built). Our layers take no config (a notebook builds
them outside any engine), so the call asks `torch.compiler.is_compiling()`,
as `Attention` does.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm import _custom_ops


class CustomOp(nn.Module):
    def forward(self, x: torch.Tensor, *args, **kwargs):
        """Run eagerly: `forward_cpu` for CPU tensors, `forward_cuda` for GPU
        ones when CuPy is there; under torch.compile, `forward_native`."""
        if not torch.compiler.is_compiling():
            if x.is_cpu:
                return self.forward_cpu(x, *args, **kwargs)
            if x.is_cuda and _custom_ops.cupy_available():
                return self.forward_cuda(x, *args, **kwargs)
        return self.forward_native(x, *args, **kwargs)

    def forward_native(self, *args, **kwargs):
        """The reference, in PyTorch operators: any device, traceable."""
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        """The CPU's kernels; by default the reference."""
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        """The GPU's kernels; by default the reference."""
        return self.forward_native(*args, **kwargs)
