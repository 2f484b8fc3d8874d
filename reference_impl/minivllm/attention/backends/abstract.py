"""The attention interface, as in vLLM v0: `AttentionMetadata`,
`AttentionImpl`, `AttentionBackend`.

`AttentionMetadata` says how one flattened, mixed batch is laid out.

The model runner packs every scheduled sequence's new tokens into one
`[num_tokens, ...]` batch: the prefill sequences' tokens first, then one token
per decoding sequence. Attention needs to know where each sequence starts,
how long it is, and where its K/V live; that is this record.

`AttentionImpl` computes one layer's attention from it; its `forward_prefill`
and `forward_decode` are what a backend (or a learner) writes.
`AttentionBackend` names an implementation together with the cache
operations that go with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from minivllm.attention.kv_cache import get_kv_cache_shape, write_to_kv_cache


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
    use_cuda_graph: the step replays a captured CUDA graph (a padded decode
        batch; worker/cuda_graph_runner.py).
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
    use_cuda_graph: bool = False

    @cached_property
    def max_decode_seq_len(self) -> int:
        """The longest context among the decodes (0 if none). A kernel's launch
        size depends on it; taking it from the host list `seq_lens` rather
        than from `seq_lens_tensor` spares a GPU sync in every layer. vLLM's
        metadata carries the same field."""
        return max(self.seq_lens[self.num_prefills :], default=0)


class AttentionImpl:
    """One layer's attention over a mixed batch: the part a backend computes.

    `forward` is the same for every backend: it stores this step's K/V (all of
    the batch, before any read: the ordering rule of `attention/kv_cache.py`),
    then hands each prefill to `forward_prefill` and all decodes at once to
    `forward_decode`. A backend, or a learner, overrides those two halves
    (and `write_to_kv_cache` if it has its own cache-write kernel).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads

    # Storing this step's K/V at their slots; the CUDA backend swaps in its kernel.
    write_to_kv_cache = staticmethod(write_to_kv_cache)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        # The kv_cache.py ordering rule: the whole batch's K/V first, then attention.
        self.write_to_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        output = torch.empty_like(query)
        for i in range(attn_metadata.num_prefills):
            start = attn_metadata.query_start_loc[i]
            end = attn_metadata.query_start_loc[i + 1]
            output[start:end] = self.forward_prefill(
                query[start:end],
                kv_cache,
                attn_metadata.block_tables[i : i + 1],
                attn_metadata.context_lens[i],
                attn_metadata.seq_lens[i],
            )
        if attn_metadata.num_decode_tokens:
            n_prefill_tokens = attn_metadata.num_prefill_tokens
            p = attn_metadata.num_prefills
            output[n_prefill_tokens:] = self.forward_decode(
                query[n_prefill_tokens:],
                kv_cache,
                attn_metadata.block_tables[p:],
                attn_metadata.seq_lens_tensor[p:],
                attn_metadata.max_decode_seq_len,
            )
        return output

    def forward_prefill(
        self,
        query: torch.Tensor,  # [q_len, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        block_table: torch.Tensor,  # [1, max_blocks]
        context_len: int,
        seq_len: int,
    ) -> torch.Tensor:  # [q_len, num_heads, head_size]
        """One prefill: `q_len` new tokens after `context_len` cached ones, so
        `seq_len = context_len + q_len`. Query row j sits at position
        context_len + j and attends to keys 0..context_len + j (causal)."""
        raise NotImplementedError

    def forward_decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        block_tables: torch.Tensor,  # [num_decodes, max_blocks], padded with block 0
        seq_lens: torch.Tensor,  # [num_decodes], keys each decode attends to
        max_seq_len: int,  # max(seq_lens), known on the host
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_size]
        """All decodes at once: one query token per sequence, attending to the
        first seq_lens[i] tokens of block_tables[i] (its own included).
        `max_seq_len` is there for kernels whose launch size depends on it:
        reading it from `seq_lens` on a GPU would wait for the GPU."""
        raise NotImplementedError


class AttentionBackend:
    """A backend names its parts: the `AttentionImpl` each layer builds, the
    metadata it reads, the cache layout, and how whole blocks are moved
    (swapping between pools, copy-on-write within one). The cache engine and
    the `Attention` layers ask the chosen backend; neither compares names.

    All methods are static: a backend is a class, never instantiated.
    """

    # Whether its attention can be recorded in a CUDA graph: nothing in it
    # may read a GPU value on the host or size a tensor by one. (vLLM's V1
    # says the same per backend with `AttentionCGSupport`.)
    supports_cuda_graphs: bool = False

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return AttentionMetadata

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # One layout for every backend: attention/kv_cache.py.
        return get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def swap_blocks(
        src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: list[tuple[int, int]]
    ) -> None:
        """One layer: copy block src of `src_cache` onto block dst of
        `dst_cache`, for each (src, dst) pair; the two may be on different
        devices (swap in, swap out)."""
        raise NotImplementedError

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Every layer: copy block src onto block dst of the same cache, for
        each (src, dst) pair (copy-on-write)."""
        raise NotImplementedError
