"""From hidden states to logits (vLLM's `layers/logits_processor.py`).

Each rank scores its slice of the (padded) vocabulary with its shard of the
head; the slices are gathered on the driver, the only rank that samples, and
the padding columns are cut off. The other ranks get None.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed import tensor_model_parallel_gather
from minivllm.model_executor.layers.utils import unquantized_gemm
from minivllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self,
        lm_head: VocabParallelEmbedding,
        hidden_states: torch.Tensor,  # [num_rows, hidden_size]: the rows that sample
    ) -> torch.Tensor | None:
        bias = getattr(lm_head, "bias", None)
        logits = unquantized_gemm(lm_head, hidden_states, bias)  # [num_rows, vocab / tp]
        logits = tensor_model_parallel_gather(logits)  # driver: [num_rows, padded vocab]
        if logits is None:
            return None
        return logits[..., : self.vocab_size]  # [num_rows, vocab_size]
