"""The KV-cache layout: the one contract shared by the cache engine, the
model runner and every attention backend.

Each decoder layer owns one tensor

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]

where kv_cache[0] is the key cache and kv_cache[1] the value cache. A *slot*
is one token position in the pool: slot = block_number * block_size + offset,
so the K of the token in slot s is kv_cache[0, s // block_size, s % block_size].
A sequence's block table lists its physical block numbers in logical order;
its token i lives in slot block_table[i // block_size] * block_size
+ i % block_size. Slot -1 means "padding, write nothing".

Swapping and copy-on-write move whole blocks: kv_cache[:, block_number].

Ordering rule for every backend: in each layer, the new K/V of the *whole
batch* are written before any attention reads the cache. With prefix
caching, a request may read blocks that another request of the same batch is
writing in that very step.
"""

from __future__ import annotations

import torch


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def write_to_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int64; -1 = padding
) -> None:
    """Store this step's new K/V at their slots (vLLM's reshape_and_cache)."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0, slots] = key[valid]
    flat[1, slots] = value[valid]


def gather_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq], int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each sequence's blocks into one contiguous run of tokens.

    Returns keys and values [num_seqs, max_blocks_per_seq * block_size,
    num_kv_heads, head_size]; positions past a sequence's length hold
    whatever the padding blocks hold and must be masked by the caller.
    """
    num_seqs, max_blocks = block_tables.shape
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    shape = (num_seqs, max_blocks * block_size, num_kv_heads, head_size)
    keys = kv_cache[0][block_tables].view(shape)
    values = kv_cache[1][block_tables].view(shape)
    return keys, values
