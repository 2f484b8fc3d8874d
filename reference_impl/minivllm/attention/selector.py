"""Choosing the attention backend: `attention_backend="torch" | "numba" | "cuda"`.

- "torch": the PyTorch reference (`backends/torch_paged.py`), any device, any dtype.
- "numba": decode attention by the Numba CPU kernel; CPU, float32.
- "cuda": decode attention by the CUDA kernels of `csrc/`, compiled with CuPy;
  a GPU, fp32/fp16/bf16, the head and block sizes the kernels are built for.

Prefills always run through the PyTorch path: like vLLM v0's PagedAttention,
the kernels here are decode kernels.

The option comes from `LLM(attention_backend=...)`, else from the environment
variable MINIVLLM_ATTENTION_BACKEND (vLLM reads VLLM_ATTENTION_BACKEND), else
"auto": "cuda" when a GPU and CuPy are present, else the CPU kernel, else the
reference.

`ModelConfig.attention_backend` keeps what was asked for; the model runner
resolves it once, when the block size is known (`get_attn_backend`, vLLM's
name, called from vLLM's same place), and builds the model inside
`set_attn_backend(backend)`, so that every `Attention` layer picks the same
implementation without models passing it down (vLLM does the same with its
current-config context). The cache engine gets the same class.

A name stands for an `AttentionBackend` class (`backends/abstract.py`): the
layers build its `get_impl_cls()`, the cache engine moves blocks with its
`swap_blocks` and `copy_blocks`. A class may be given instead of a name: an
`AttentionBackend` subclass is used as it is; any other class is taken as an
`AttentionImpl` (such as a learner's `TorchPagedAttention` subclass in the
labs) and gets the torch backend's cache operations.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from minivllm import _custom_ops as ops
from minivllm import envs
from minivllm.attention.backends.abstract import AttentionBackend, AttentionImpl
from minivllm.attention.backends.torch_paged import TorchAttentionBackend
from minivllm.utils import check_choice

ATTENTION_BACKENDS = ("torch", "numba", "cuda")

_current_backend: ContextVar[type[AttentionBackend]] = ContextVar(
    "attention_backend", default=TorchAttentionBackend
)


def _cuda_problems(device: str, dtype: torch.dtype, head_size: int, block_size: int) -> list[str]:
    """Why the CUDA kernels cannot serve this configuration (empty: they can)."""
    problems = []
    if not torch.cuda.is_available():
        problems.append(
            "an NVIDIA GPU visible to torch (torch.cuda.is_available() is False: no GPU, "
            "or a CPU-only build of torch)"
        )
    elif device != "cuda":
        problems.append(f"device='cuda' (got device={device!r})")
    if importlib.util.find_spec("cupy") is None:
        problems.append(ops.CUPY_MISSING)
    if dtype not in ops.CUDA_DTYPES:
        problems.append(f"dtype float32, float16 or bfloat16 (got {dtype})")
    if head_size not in ops.SUPPORTED_HEAD_SIZES:
        problems.append(f"head_size in {ops.SUPPORTED_HEAD_SIZES} (the model's is {head_size})")
    if block_size not in ops.SUPPORTED_BLOCK_SIZES:
        problems.append(f"block_size in {ops.SUPPORTED_BLOCK_SIZES} (got {block_size})")
    return problems


def get_attn_backend(
    requested: str | type | None, device: str, dtype: torch.dtype, head_size: int, block_size: int
) -> type[AttentionBackend]:
    """The `AttentionBackend` class for `requested` (None: the environment
    variable, else "auto"), refusing a backend that cannot serve this
    configuration. A class is used as it is: an `AttentionBackend`, or an
    `AttentionImpl` such as a learner's in the labs (see the module docstring)."""
    if isinstance(requested, type):
        return _backend_class(requested)
    if requested is None:
        requested = envs.MINIVLLM_ATTENTION_BACKEND
        if requested is None:  # unset; set but empty is refused below
            requested = "auto"
    check_attention_backend(requested)
    if requested == "auto":
        if device == "cuda":
            cuda_ok = not _cuda_problems(device, dtype, head_size, block_size)
            return _backend_class("cuda" if cuda_ok else "torch")
        return _backend_class("numba" if dtype == torch.float32 else "torch")
    if requested == "numba" and (device != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"attention_backend='numba' runs on the CPU in float32, got "
            f"device={device!r}, dtype={dtype}; use attention_backend='torch' otherwise"
        )
    if requested == "cuda":
        problems = _cuda_problems(device, dtype, head_size, block_size)
        if problems:
            raise RuntimeError(
                "attention_backend='cuda' needs: " + "; ".join(problems) + ". "
                "Without a GPU use attention_backend='numba' (CPU kernel) or 'torch' (reference)."
            )
    return _backend_class(requested)


def check_attention_backend(value: object) -> None:
    """Refuse what cannot name a backend (a class is checked when it is used)."""
    if value is None or isinstance(value, type):
        return
    check_choice(
        "attention_backend",
        value,
        (*ATTENTION_BACKENDS, "auto"),
        f"one of {ATTENTION_BACKENDS}, 'auto', a class or None (from the argument or "
        "$MINIVLLM_ATTENTION_BACKEND)",
    )


@contextlib.contextmanager
def set_attn_backend(backend: type[AttentionBackend]) -> Iterator[None]:
    """Within this block, new `Attention` layers use `backend`."""
    token = _current_backend.set(backend)
    try:
        yield
    finally:
        _current_backend.reset(token)


def current_attn_backend() -> type[AttentionBackend]:
    """The backend class in effect (the reference outside `set_attn_backend`)."""
    return _current_backend.get()


def _backend_class(choice: str | type) -> type[AttentionBackend]:
    """The `AttentionBackend` class for a backend name, a backend class, or
    an implementation class (wrapped, see the module docstring)."""
    if isinstance(choice, type):
        if issubclass(choice, AttentionBackend):
            return choice
        return _backend_for_impl(choice)
    if choice == "numba":
        from minivllm.attention.backends.numba_paged import NumbaAttentionBackend

        return NumbaAttentionBackend
    if choice == "cuda":
        from minivllm.attention.backends.cuda_paged import CudaAttentionBackend

        return CudaAttentionBackend
    return TorchAttentionBackend


@functools.cache
def _backend_for_impl(impl_cls: type[AttentionImpl]) -> type[AttentionBackend]:
    """A torch backend whose layers build `impl_cls` (one class per impl_cls)."""

    def get_impl_cls() -> type[AttentionImpl]:
        return impl_cls

    def get_name() -> str:
        return impl_cls.__name__

    return type(
        f"{impl_cls.__name__}Backend",
        (TorchAttentionBackend,),
        {"get_impl_cls": staticmethod(get_impl_cls), "get_name": staticmethod(get_name)},
    )
