"""The token embedding and the output head, split over the ranks by vocabulary
rows (vLLM's `layers/vocab_parallel_embedding.py`).

The vocabulary is padded to a multiple of 64 rows (`DEFAULT_VOCAB_PADDING_SIZE`),
then rank r holds the contiguous rows [r * V/tp, (r+1) * V/tp). To embed, each
rank looks up the ids that fall in its range, writes zeros for the others,
and an all-reduce sums the ranks' rows: each token's row comes from exactly
one rank. The head is the same table used the other way round: each rank
scores its slice of the vocabulary and the logits are gathered to the driver
(`LogitsProcessor`), which samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from minivllm.distributed.utils import divide

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return -(-vocab_size // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> None:
        super().__init__()
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size)
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size)
        # This rank's vocabulary rows; the padding rows past org_vocab_size stay zero.
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of the checkpoint's [vocab_size, embedding_dim]
        table, or of an LM head's [vocab_size] bias."""
        expected = (self.org_vocab_size, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"the embedding has shape {tuple(loaded.shape)} in the checkpoint, the model "
                f"expects {expected}"
            )
        start = min(self.vocab_start_index, self.org_vocab_size)
        end = min(self.vocab_end_index, self.org_vocab_size)
        param.data.zero_()
        param.data[: end - start].copy_(loaded[start:end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [num_tokens, embedding_dim]
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        output = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(output)  # [num_tokens, embedding_dim]


class ParallelLMHead(VocabParallelEmbedding):
    """The output head: the same sharded table, used by `LogitsProcessor`
    (a model whose head is tied to its embedding uses the embedding instead)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_size)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.num_embeddings_per_partition), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head's weights are used by LogitsProcessor, not called")
