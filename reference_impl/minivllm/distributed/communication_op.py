"""The collectives the model calls, on the tensor-parallel group (vLLM's
`vllm/distributed/communication_op.py`): each is one line into
`get_tp_group()`, so a layer reads like vLLM's."""

from __future__ import annotations

from typing import Any

import torch

from minivllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum the partial results of every rank (after a row-parallel matmul)."""
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's slice along `dim`, on every rank."""
    return get_tp_group().all_gather(input_, dim)


def tensor_model_parallel_gather(
    input_: torch.Tensor, dst: int = 0, dim: int = -1
) -> torch.Tensor | None:
    """Concatenate every rank's slice along `dim` on rank `dst` only (None elsewhere)."""
    return get_tp_group().gather(input_, dst, dim)


def broadcast_tensor_dict(
    tensor_dict: dict[str, Any] | None = None, src: int = 0
) -> dict[str, Any]:
    """The driver's dict of tensors and values, on every rank of the group."""
    return get_tp_group().broadcast_tensor_dict(tensor_dict, src)
