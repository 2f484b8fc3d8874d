"""`SamplingMetadata`: what V1's sampler needs of one step's sampling rows
(vLLM's `vllm/v1/sample/metadata.py`).

vLLM keeps these values as tensors in the persistent batch, updated when a
request joins or leaves it; our runner gathers them from the rows' requests
(`GPUModelRunner._sampling_metadata`) when the batch's rows change, and
reuses them until then (`_step_sampling_metadata`). A stage that no row
uses is None, so the sampler skips it (a sort of the vocabulary, the token
counts of the penalties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [num_rows] float; 0 for greedy rows
    greedy: torch.Tensor  # [num_rows] bool: the row takes the argmax
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [num_rows] int64; vocab_size keeps all
    top_p: torch.Tensor | None  # [num_rows] float; 1.0 keeps all
    min_p: torch.Tensor | None  # [num_rows] float; 0.0 keeps all
    # Row -> the generator of a request with a seed: its noise is its own.
    generators: dict[int, torch.Generator]
    # Per row, the tokens that would end it while it has fewer outputs than
    # min_tokens (vLLM's MinTokensLogitsProcessor bans them).
    min_tokens_banned: list[list[int]]
    # Per row, the only tokens it may sample (None: all), and the biases
    # added to its logits (None: none).
    allowed_token_ids: list[list[int] | None]
    logit_bias: list[dict[int, float] | None]
    # Row -> its bad words' token ids, for the rows that have any.
    bad_words_token_ids: dict[int, list[list[int]]]
    # The penalties: None when every row has them off.
    presence_penalties: torch.Tensor | None  # [num_rows]
    frequency_penalties: torch.Tensor | None  # [num_rows]
    repetition_penalties: torch.Tensor | None  # [num_rows]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
