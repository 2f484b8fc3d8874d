"""A few rows times a weight on the CPU, at the memory's speed, compiled by Numba.

A decode step of one sequence multiplies one row by every weight of the
model: it must read every weight once and does two FLOPs per weight, so its
speed is the memory's. oneDNN's packed product (model_executor/layers/utils.py),
built for many rows, read the 20M benchmark Llama's weights at about half the
read bandwidth for 1-4 rows on our AMD VM (on our Intel VM it was the faster
of the two, so the loader times both: `few_row_kernel_pays`). This kernel
streams a copy of the weight blocked as [out / GEMV_BLOCK, in, GEMV_BLOCK]:
work item b reads one contiguous slab, row k of it the GEMV_BLOCK weights
that row k of the input multiplies, and keeps GEMV_BLOCK sums per input row.

It gives oneDNN's bits, not just its values. For a batch of rows the packed
product computes each output from 0 by one fused multiply-add per input
element, in order, in chunks of ONEDNN_K_CHUNK elements, then adds the
chunks' sums in order, then the bias (found by experiment on oneDNN 3 in
torch 2.13, on an AMD EPYC and an Intel Xeon VM; nothing documents it).
This kernel sums in exactly that order: `fastmath` allows only "contract",
which fuses a * b + c into one FMA and reorders nothing. So a row gets the
same bits from this kernel as in a oneDNN batch of 64, and a row's result
does not depend on the rest of the batch. (oneDNN alone does not always
give that: on the Intel VM it sums a single row of more than 1024 inputs in
another order, so a row alone and the same row in a batch differed in the
last bits.) In case another oneDNN or CPU sums batches in another order,
the loader checks each layer against oneDNN (`dispatch_cpu_unquantized_gemm`),
and a layer that differs by one bit keeps oneDNN for every batch.
"""

from __future__ import annotations

from contextlib import nullcontext

import numba
import numpy as np
import torch

from minivllm.utils import numba_threads

# Rows up to which the kernel beat oneDNN's packed product on our AMD VM: the
# 20M benchmark Llama's 28 projections in turn (81 MB), 2 threads: 1.9x at 1
# row, 1.6x at 2, 1.4x at 4, 0.9x at 8 (it reads the weights once, but its
# sums per row take more instructions than oneDNN's register tiles).
GEMV_MAX_ROWS = 4
# Output columns per work item: four 16-float AVX-512 vectors of sums.
GEMV_BLOCK = 64
# oneDNN's packed product sums the input dimension of a batch in chunks this long.
ONEDNN_K_CHUNK = 1024
_NO_BIAS = np.empty(0, dtype=np.float32)  # the kernel's "no bias": a bias of length 0


def block_weight(weight: torch.Tensor) -> np.ndarray:  # [cdiv(out, GEMV_BLOCK), in, GEMV_BLOCK]
    """`weight` [out, in] as the kernel reads it: column block b holds
    weight[b * GEMV_BLOCK : (b + 1) * GEMV_BLOCK].T, zero past `out`."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // GEMV_BLOCK)
    padded = torch.zeros(blocks * GEMV_BLOCK, in_features, dtype=torch.float32)
    padded[:out_features] = weight.detach()
    return np.ascontiguousarray(
        padded.view(blocks, GEMV_BLOCK, in_features).transpose(1, 2).numpy()
    )


def gemv(
    x: torch.Tensor,  # [num_rows <= GEMV_MAX_ROWS, in], float32
    blocked: np.ndarray,  # [cdiv(out, GEMV_BLOCK), in, GEMV_BLOCK], from block_weight
    bias: torch.Tensor | None,  # [out], float32
    out_features: int,
) -> torch.Tensor:  # [num_rows, out]
    """x @ weight.T + bias with oneDNN's bits."""
    _check_args(x, blocked, bias, out_features)
    # The profiler sees no Numba code: a profile gets the call as a region of
    # its own, counted as a matmul (with the output's allocation, as oneDNN's).
    with matmul_region("minivllm::gemv"), numba_threads():
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        _gemv(
            x.contiguous().numpy(),  # .numpy() shares memory with the tensor: no copies
            blocked,
            _NO_BIAS if bias is None else bias.detach().contiguous().numpy(),
            out.numpy(),
            ONEDNN_K_CHUNK,
        )
    return out


def matmul_region(name: str):
    """A profiler region around a matrix product's own work, which
    tools/bench/profiling.py counts as a matmul. Only while profiling: a
    region costs about 12 us, as much as a few-row product itself."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()


def _check_args(
    x: torch.Tensor, blocked: np.ndarray, bias: torch.Tensor | None, out_features: int
) -> None:
    """Compiled code checks no bounds: a row of another width, a bias of
    another length or more outputs than the blocks hold would read past an
    array. (A layer's own arguments always fit.)"""
    in_features, width = blocked.shape[1], blocked.shape[0] * GEMV_BLOCK
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype != torch.float32:
        raise ValueError(
            f"gemv multiplies float32 rows of {in_features}, got {x.dtype} {tuple(x.shape)}"
        )
    if not width - GEMV_BLOCK < out_features <= width:
        low = width - GEMV_BLOCK
        raise ValueError(f"out_features must be in ({low}, {width}], got {out_features}")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32):
        raise ValueError(
            f"the bias must be float32 of shape ({out_features},), "
            f"got {bias.dtype} {tuple(bias.shape)}"
        )


# Compiled for the argument types of the first call, and `gemv` builds every
# argument alike (float32, contiguous, an int chunk): one signature in practice,
# so its disk-cache index holds one entry. Numba adds an entry to an index
# without a lock (attention/ops/paged_attn_numba.py::decode_kernel).
@numba.njit(parallel=True, cache=True, fastmath={"contract"})
def _gemv(
    x: np.ndarray,  # [num_rows, in]
    blocked: np.ndarray,  # [num_blocks, in, block]
    bias: np.ndarray,  # [out], or [0] for none
    out: np.ndarray,  # [num_rows, out]
    k_chunk: int,
) -> None:
    num_rows, in_features = x.shape
    num_blocks, _, block = blocked.shape
    out_features = out.shape[1]
    for b in numba.prange(num_blocks):
        chunk = np.empty((num_rows, block), dtype=np.float32)  # one chunk's sums
        total = np.empty((num_rows, block), dtype=np.float32)  # the chunks' sums, in order
        for k0 in range(0, in_features, k_chunk):
            chunk[:] = 0.0
            for k in range(k0, min(k0 + k_chunk, in_features)):
                w = blocked[b, k]  # [block], contiguous
                for m in range(num_rows):
                    xk = x[m, k]
                    for j in range(block):
                        chunk[m, j] = chunk[m, j] + xk * w[j]  # one FMA
            if k0 == 0:
                total[:] = chunk
            else:
                for m in range(num_rows):
                    for j in range(block):
                        total[m, j] = total[m, j] + chunk[m, j]
        n0 = b * block
        for m in range(num_rows):
            for j in range(min(block, out_features - n0)):
                out[m, n0 + j] = total[m, j] + bias[n0 + j] if len(bias) else total[m, j]
