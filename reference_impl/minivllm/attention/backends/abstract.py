"""`AttentionMetadata`: how one flattened, mixed batch is laid out.

The model runner packs every scheduled sequence's new tokens into one
`[num_tokens, ...]` batch: the prefill sequences' tokens first, then one token
per decoding sequence. Attention needs to know where each sequence starts,
how long it is, and where its K/V live; that is this record.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the batch (sequences ordered prefills, then decodes).

    num_prefills: prefill sequences, the first in the batch.
    num_prefill_tokens: their tokens, the first `num_prefill_tokens` rows.
    num_decode_tokens: one per decoding sequence, the remaining rows.
    slot_mapping: [num_tokens] the cache slot each new token's K/V goes to.
    seq_lens: [num_seqs] tokens each sequence attends to after this step.
    context_lens: [num_seqs] tokens of each sequence already in the cache
        before this step (0 for a fresh prefill, seq_len - 1 for a decode).
    query_start_loc: [num_prefills + 1] row where each prefill's tokens start.
    block_tables: [num_seqs, max_blocks_per_seq] physical block numbers,
        padded with 0 (never read past a sequence's length).
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: list[int]
    context_lens: list[int]
    query_start_loc: list[int]
    block_tables: torch.Tensor
    seq_lens_tensor: torch.Tensor

    @cached_property
    def max_decode_seq_len(self) -> int:
        """The longest context among the decodes (0 if none). A kernel's launch
        size depends on it; taking it from the host list `seq_lens` rather
        than from `seq_lens_tensor` spares a GPU sync in every layer. vLLM's
        metadata carries the same field."""
        return max(self.seq_lens[self.num_prefills :], default=0)
