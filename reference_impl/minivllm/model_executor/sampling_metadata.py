"""`SamplingMetadata`: which logits rows the sampler reads, and what for.

The model runs on every new token of the batch, flattened, but logits are
computed only for the rows the sampler needs: the last new token of each
sequence that samples this step, and, for requests that ask for
`prompt_logprobs`, every prompt position of the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SequenceData, SequenceGroupMetadata


@dataclass
class SequenceGroupToSample:
    """One group of the batch as the sampler sees it.

    seq_data: seq_id -> its SequenceData: the prompt and output tokens that
        the penalties and min_tokens look at.
    prompt_logprob_indices: rows of the selected logits whose logprobs are
        about this step's prompt tokens, in position order (empty unless the
        request asks for prompt_logprobs and this step prefills).
    sample_indices: the row each sequence samples from, in `seq_ids` order;
        empty when this step samples nothing (a prefill chunk that does not
        finish the prompt).
    """

    seq_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    seq_data: dict[int, SequenceData]
    prompt_logprob_indices: list[int]
    sample_indices: list[int]


@dataclass
class SamplingMetadata:
    seq_groups: list[SequenceGroupToSample]
    # [num_selected_rows] the row of the flattened batch (hidden states)
    # each selected logits row is computed from.
    selected_token_indices: torch.Tensor

    @classmethod
    def prepare(
        cls,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        seq_lens: list[int],
        context_lens: list[int],
        device: torch.device,
    ) -> SamplingMetadata:
        """Select the rows to compute logits for.

        seq_lens and context_lens are per sequence, in batch order: each
        sequence's new tokens are positions [context_len, seq_len), laid out
        one sequence after another.
        """
        selected: list[int] = []
        seq_groups: list[SequenceGroupToSample] = []
        seq_index = token_start = 0
        for meta in seq_group_metadata_list:
            prompt_logprob_indices: list[int] = []
            sample_indices: list[int] = []
            for i, data in enumerate(meta.seq_data.values()):
                context_len, seq_len = context_lens[seq_index], seq_lens[seq_index]
                # The logits at position p predict token p + 1. The sequences
                # of a group share the prompt: the first one stands for all.
                if meta.is_prompt and meta.sampling_params.prompt_logprobs is not None and i == 0:
                    end = min(seq_len, len(data.prompt_token_ids) - 1)
                    num = max(end - context_len, 0)
                    prompt_logprob_indices += range(len(selected), len(selected) + num)
                    selected += range(token_start, token_start + num)
                token_start += seq_len - context_len
                if meta.do_sample:
                    sample_indices.append(len(selected))
                    selected.append(token_start - 1)
                seq_index += 1
            seq_groups.append(
                SequenceGroupToSample(
                    seq_ids=list(meta.seq_data),
                    sampling_params=meta.sampling_params,
                    generator=meta.generator,
                    seq_data=meta.seq_data,
                    prompt_logprob_indices=prompt_logprob_indices,
                    sample_indices=sample_indices,
                )
            )
        return cls(seq_groups, torch.tensor(selected, dtype=torch.long, device=device))
