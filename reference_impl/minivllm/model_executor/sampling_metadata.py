"""`SamplingMetadata`: which logits rows sample, and with what parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sampling_params import SamplingParams


@dataclass
class SequenceGroupToSample:
    """One group of the batch as the sampler sees it: its sequences own
    consecutive rows of the logits, in `seq_ids` order."""

    seq_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None


@dataclass
class SamplingMetadata:
    seq_groups: list[SequenceGroupToSample]
    # [num_sampled_rows] the hidden-state row each sampled token is read from:
    # the last new token of every sequence.
    selected_token_indices: torch.Tensor
