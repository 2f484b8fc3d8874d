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

For 1 to GEMV_MAX_ROWS rows (a decode step of a few sequences) a packed
layer multiplies instead by our own kernel (gemv_numba.py), which gives the
bits oneDNN gives the same rows in a batch, so the batch invariance holds
across the switch, and which reads the weights at the memory's speed: about
twice oneDNN's on our AMD VM, but slower than oneDNN on our Intel VM. So the
loader times both once per process (`few_row_kernel_pays`), and where oneDNN
wins a few rows go to it, padded with zero rows only to the smallest batch
that oneDNN sums in its batches' order (found per layer at load:
`_onednn_min_rows`; on our Intel VM a lone row of more than 1024 inputs is
summed in another order).

Packed only where it helps and can be used: a float32 weight on an x86 CPU
with oneDNN. A compiled model multiplies by the same packed weights:
TorchDynamo cannot trace an opaque oneDNN tensor, so the product is an op it
does not look into (`cpu_packed_linear`, as attention is `unified_attention`),
and Inductor fuses the element-wise work between the products. The packed copy is a
snapshot: a weight changed after loading must be packed again. The weight
itself is kept (for the lessons, the tests and tensor-parallel checks that
read it), so a packed layer holds its weights three times on the CPU: as
stored, packed for oneDNN and blocked for the few-row kernel.
"""

from __future__ import annotations

import functools
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.compilation.forward_context import get_forward_context
from minivllm.model_executor.layers.gemv_numba import (
    GEMV_MAX_ROWS,
    block_weight,
    gemv,
    matmul_region,
)


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
    layer it does not suit keeps `F.linear` (packed_weight None). A packed
    layer also gets the weight blocked for the few-row kernel, if that
    kernel is the faster here and gives oneDNN's bits for it (gemv_weight
    None if not)."""
    weight = layer.weight
    layer.packed_weight = (
        torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        if supports_packed_cpu_gemm(weight)
        else None
    )
    use_gemv = layer.packed_weight is not None and few_row_kernel_pays()
    layer.gemv_weight = _checked_gemv_weight(layer) if use_gemv else None
    if layer.packed_weight is not None and layer.gemv_weight is None:
        layer.onednn_min_rows = _onednn_min_rows(layer.packed_weight, _biases(layer))


@functools.cache
def few_row_kernel_pays() -> bool:
    """Whether the few-row kernel multiplies 1 and GEMV_MAX_ROWS rows faster
    than oneDNN on this machine: timed once per process, on a 32 MB weight
    (the bits are the same either way, so only speed rides on it). It
    depends on the CPU: on our AMD EPYC VM the kernel was 1.9x faster at one
    row and 1.4x at four; on our Intel Xeon VM (Sapphire Rapids) oneDNN was
    1.07x faster at one row and 1.9x at four."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 2048, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    blocked = block_weight(weight)
    xs = [torch.randn(rows, 2048, generator=g) for rows in (1, GEMV_MAX_ROWS)]

    def best_of(product) -> float:
        product()  # warm up (Numba's first call loads the compiled kernel)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        return min(times)

    min_rows = _onednn_min_rows(packed, [None])
    kernel = best_of(lambda: [gemv(x, blocked, None, 4096) for x in xs])
    onednn = best_of(lambda: [_few_rows_product(x, packed, None, min_rows) for x in xs])
    return kernel < onednn


def _biases(layer: nn.Module) -> list[torch.Tensor | None]:
    """The biases a layer's product is checked with: none, and the layer's
    own if it has one (a row-parallel rank past the first, or skip_bias_add,
    multiplies without it; adding a bias can round a last-bit difference away)."""
    bias = getattr(layer, "bias", None)
    return [None] + ([bias.detach()] if isinstance(bias, torch.Tensor) else [])


def _probe(in_features: int) -> torch.Tensor:  # [GEMV_MAX_ROWS + 1, in]
    """Random rows to check a few-row product's bits with: one more than
    GEMV_MAX_ROWS, the smallest batch every few-row path is compared with."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(GEMV_MAX_ROWS + 1, in_features, generator=g, dtype=torch.float32)


def _onednn_min_rows(packed: torch.Tensor, biases: list[torch.Tensor | None]) -> int:
    """The smallest m such that oneDNN gives m to GEMV_MAX_ROWS rows the bits
    it gives them in a batch of GEMV_MAX_ROWS + 1: fewer rows are padded to
    m (`_few_rows_product`). Usually 1, no padding. On our Intel VM, 2 for
    more than 1024 inputs: there oneDNN sums a lone row of them in another
    order than a batch (2 to 4 rows in the batches' order)."""
    probe = _probe(packed.shape[1])  # the packed tensor keeps the weight's [out, in] shape
    min_rows = 1
    for bias in biases:
        batch = _packed_product(probe, packed, bias)
        for rows in range(GEMV_MAX_ROWS, min_rows - 1, -1):
            if not same_bits(_packed_product(probe[:rows], packed, bias), batch[:rows]):
                min_rows = rows + 1
                break
    return min_rows


def _checked_gemv_weight(layer: nn.Module) -> np.ndarray | None:
    """`layer.weight` blocked for `gemv`, or None if `gemv` does not give
    GEMV_MAX_ROWS random rows the bits the packed product gives them in a
    batch one row larger (the smallest that oneDNN multiplies), with each
    of `_biases`. A batch, not the rows alone: on our Intel VM oneDNN sums a
    single row in another order than a batch. None means a
    oneDNN that sums batches in another order than gemv_numba.py's: at 1
    and 2 threads on our CPUs it does not."""
    out_features, in_features = layer.weight.shape
    blocked = block_weight(layer.weight)
    probe = _probe(in_features)
    for b in _biases(layer):
        ours = gemv(probe[:GEMV_MAX_ROWS], blocked, b, out_features)
        batch = _packed_product(probe, layer.packed_weight, b)
        if not same_bits(ours, batch[:GEMV_MAX_ROWS]):
            return None
    return blocked


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, float32: torch.equal would take -0.0 for 0.0."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _few_rows_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, min_rows: int
) -> torch.Tensor:
    """oneDNN's product of up to GEMV_MAX_ROWS rows, in a batch of at least
    `min_rows` (the rest zeros), the smallest that oneDNN sums in its
    batches' order (`_onednn_min_rows`): fewer rows alone would get other
    last bits than in a batch."""
    if x.shape[0] >= min_rows:
        return _packed_product(x, packed, bias)
    with matmul_region("minivllm::few_rows"):
        batch = x.new_zeros(min_rows, x.shape[1])
        batch[: x.shape[0]] = x
        return _packed_product(batch, packed, bias)[: x.shape[0]]


def _cpu_packed_gemm(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A packed layer's product. A few rows go to the few-row kernel where it
    is faster (same bits, read at the memory's speed), else to oneDNN, inside
    a batch where oneDNN needs one for the batches' bits; more rows to oneDNN."""
    if x.shape[0] > GEMV_MAX_ROWS:
        return _packed_product(x, layer.packed_weight, bias)
    if layer.gemv_weight is not None:
        return gemv(x, layer.gemv_weight, bias, layer.weight.shape[0])
    return _few_rows_product(x, layer.packed_weight, bias, layer.onednn_min_rows)


def unquantized_gemm(
    layer: nn.Module,
    x: torch.Tensor,  # [num_tokens, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [num_tokens, out]
    """x @ layer.weight.T + bias: by the packed weight when there is one.

    Traced by TorchDynamo, a packed layer becomes the opaque op
    `cpu_packed_linear` (the packed tensor stays out of the graph); a layer
    that is not packed, or not numbered by `packed_gemm_layers`, is a plain
    `F.linear` that Inductor compiles its own way."""
    if torch.compiler.is_compiling():
        index = getattr(layer, "packed_index", None)
        if index is None:
            return F.linear(x, layer.weight, bias)
        return torch.ops.minivllm.cpu_packed_linear(x, layer.weight, bias, index)
    if getattr(layer, "packed_weight", None) is None:
        return F.linear(x, layer.weight, bias)
    return _cpu_packed_gemm(layer, x, bias)


def packed_gemm_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers with a packed weight, in module order, each told
    its index (`packed_index`): the forward context lists them in this order
    for `cpu_packed_linear`, as it lists the attention layers."""
    layers = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    for index, layer in enumerate(layers):
        layer.packed_index = index
    return layers


@torch.library.custom_op("minivllm::cpu_packed_linear", mutates_args=())
def cpu_packed_linear(
    x: torch.Tensor,  # [num_tokens, in]
    weight: torch.Tensor,  # [out, in]: for the output's shape when traced; not read
    bias: torch.Tensor | None,  # [out]
    layer_index: int,
) -> torch.Tensor:  # [num_tokens, out]
    """A compiled model's packed product (the role of vLLM's `onednn_mm` op,
    which takes a handle to the layer's oneDNN weights). The handle here is
    the layer's number: the packed weight is found through the forward
    context, so a graph compiled for one engine runs with another engine's
    weights, as the attention op does."""
    return _cpu_packed_gemm(get_forward_context().packed_layers[layer_index], x, bias)


@cpu_packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer_index: int):
    return x.new_empty((x.shape[0], weight.shape[0]))
