"""Linear layers split over the tensor-parallel ranks (vLLM's `layers/linear.py`).

A transformer layer needs one all-reduce per matmul pair this way (Megatron-LM's
scheme, which vLLM follows):

- `ColumnParallelLinear` splits the weight's output rows: rank r computes
  columns [r*n/tp, (r+1)*n/tp) of the output from the whole input, with no
  communication. The q/k/v and gate/up projections are column-parallel, so
  each rank holds whole attention heads and whole MLP channels.
- `RowParallelLinear` splits the input columns: each rank multiplies its
  slice of the input (the column-parallel layer's output, already split) by
  its slice of the weight, and an all-reduce sums the partial results. The
  attention output and MLP down projections are row-parallel.

`MergedColumnParallelLinear` and `QKVParallelLinear` are column-parallel
layers made of several projections of one input (gate/up; q/k/v) run as one
matmul; checkpoints store the parts separately, so each part is sharded and
copied into its rows of the rank's fused weight. With fewer KV heads than
ranks, each KV head is replicated on `tp_size / num_kv_heads` ranks.

As in vLLM, `forward` returns `(output, output_bias)`: output_bias is the
bias when `skip_bias_add=True` (for a later fused add), else None. Every
parameter carries its `weight_loader(param, checkpoint_tensor[, shard_id])`,
which takes the full checkpoint tensor and copies this rank's shard.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from minivllm.distributed.utils import divide
from minivllm.model_executor.layers.utils import unquantized_gemm
from minivllm.model_executor.weight_utils import default_weight_loader


def _parameter(*shape: int, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, skip_bias_add: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.skip_bias_add = skip_bias_add
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()

    def _result(self, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return output, self.bias if self.skip_bias_add else None


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (OPT's project_in/project_out)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 skip_bias_add: bool = False) -> None:
        super().__init__(input_size, output_size, skip_bias_add)
        self.weight = _parameter(output_size, input_size, loader=default_weight_loader)
        self.bias = _parameter(output_size, loader=default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        return self._result(unquantized_gemm(self, x, bias))


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by output rows: rank r holds A's rows
    [r * out/tp, (r+1) * out/tp). With `gather_output`, the ranks' outputs
    are concatenated (all-gather) so every rank gets the whole Y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__(input_size, output_size, skip_bias_add)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size)
        # The parts of a fused projection, per rank (one part when unfused).
        self.output_partition_sizes = [
            divide(size, self.tp_size) for size in (output_sizes or [output_size])
        ]
        self.weight = _parameter(
            self.output_size_per_partition, input_size, loader=self.weight_loader
        )
        self.bias = (
            _parameter(self.output_size_per_partition, loader=self.weight_loader) if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of the checkpoint's [output_size, ...] tensor."""
        shard = param.shape[0]
        if loaded.shape[0] != shard * self.tp_size:
            raise ValueError(
                f"a column-parallel tensor has {loaded.shape[0]} rows in the checkpoint, "
                f"the model expects {shard * self.tp_size}"
            )
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        output = unquantized_gemm(self, x, bias)  # [num_tokens, output_size_per_partition]
        if self.gather_output:
            output = tensor_model_parallel_all_gather(output)  # [num_tokens, output_size]
        return self._result(output)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input as one matmul
    (Llama's gate_proj and up_proj). Rank r's fused weight holds rank r's
    shard of every part, one after the other: [gate_r; up_r]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, gather_output, skip_bias_add,
                         output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      loaded_shard_id: int | None = None) -> None:
        """Part `loaded_shard_id` (0 = gate, 1 = up) of the checkpoint; None:
        the checkpoint stores the parts fused, split it first."""
        if loaded_shard_id is None:
            for shard_id, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, shard_id)
            return
        size = self.output_partition_sizes[loaded_shard_id]
        offset = sum(self.output_partition_sizes[:loaded_shard_id])
        if loaded.shape[0] != self.output_sizes[loaded_shard_id]:
            raise ValueError(
                f"part {loaded_shard_id} has {loaded.shape[0]} rows in the checkpoint, "
                f"the model expects {self.output_sizes[loaded_shard_id]}"
            )
        default_weight_loader(
            param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size)
        )


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections as one column-parallel matmul: each rank
    holds `num_heads = total_num_heads / tp` query heads and `num_kv_heads`
    KV heads. With at least as many ranks as KV heads, each rank holds one
    KV head and each KV head is held by `num_kv_head_replicas` ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = True,
                 skip_bias_add: bool = False) -> None:
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        q_size = self.num_heads * head_size * tp_size
        kv_size = self.num_kv_heads * head_size * tp_size  # counts the replicas
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, False, skip_bias_add,
                         [q_size, kv_size, kv_size])

    def _shard(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in this rank's fused weight, rows, which shard of the checkpoint part)."""
        q_rows = self.num_heads * self.head_size
        kv_rows = self.num_kv_heads * self.head_size
        kv_index = self.tp_rank // self.num_kv_head_replicas
        return {
            "q": (0, q_rows, self.tp_rank),
            "k": (q_rows, kv_rows, kv_index),
            "v": (q_rows + kv_rows, kv_rows, kv_index),
        }[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      loaded_shard_id: str | None = None) -> None:
        """Part "q", "k" or "v" of the checkpoint; None: the checkpoint stores
        them fused (GPT-2's c_attn), split it first."""
        total = {
            "q": self.total_num_heads * self.head_size,
            "k": self.total_num_kv_heads * self.head_size,
            "v": self.total_num_kv_heads * self.head_size,
        }
        if loaded_shard_id is None:
            for shard_id, part in zip("qkv", loaded.split(list(total.values()), dim=0),
                                      strict=True):
                self.weight_loader(param, part, shard_id)
            return
        if loaded.shape[0] != total[loaded_shard_id]:
            raise ValueError(
                f"{loaded_shard_id}_proj has {loaded.shape[0]} rows in the checkpoint, "
                f"the model expects {total[loaded_shard_id]}"
            )
        offset, rows, index = self._shard(loaded_shard_id)
        default_weight_loader(
            param.data.narrow(0, offset, rows), loaded.narrow(0, index * rows, rows)
        )


class RowParallelLinear(LinearBase):
    """Y = X A with A split by input columns: rank r holds A's columns
    [r * in/tp, (r+1) * in/tp) and multiplies the matching slice of X (the
    column-parallel layer before gave it exactly that slice); an all-reduce
    sums the ranks' partial products. The bias is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__(input_size, output_size, skip_bias_add)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.weight = _parameter(
            output_size, self.input_size_per_partition, loader=self.weight_loader
        )
        self.bias = _parameter(output_size, loader=default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's columns of the checkpoint's [output_size, input_size] weight."""
        shard = self.input_size_per_partition
        if loaded.shape[-1] != shard * self.tp_size:
            raise ValueError(
                f"a row-parallel weight has {loaded.shape[-1]} columns in the checkpoint, "
                f"the model expects {shard * self.tp_size}"
            )
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:  # [num_tokens, input_size]: take this rank's slice
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]
        # Only rank 0 adds the bias, so the sum over ranks adds it once.
        bias = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output = unquantized_gemm(self, x, bias)  # [num_tokens, output_size], partial
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output)
        return self._result(output)
