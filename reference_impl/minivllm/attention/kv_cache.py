"""The KV-cache layout: the one contract shared by the cache engine, the
model runner and every attention backend.

Each decoder layer owns one tensor

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]

where kv_cache[0] is the key cache and kv_cache[1] the value cache. A *slot*
is one token position in the pool: slot = block_number * block_size + offset,
so the K of the token in slot s is kv_cache[0, s // block_size, s % block_size].
A sequence's block table lists its physical block numbers in logical order;
its token i lives in slot block_table[i // block_size] * block_size
+ i % block_size. Slot -1 (`PAD_SLOT_ID`) means "padding, write nothing":
the dummy rows that pad a decode batch up to a captured batch size
(worker/model_runner.py::FlatBatch.padded_to) have no place in the cache.

Swapping and copy-on-write move whole blocks: kv_cache[:, block_number].

A decode kernel reads one query row per sequence and, for sequence i, the
first seq_lens[i] slots of block_tables[i]: `check_decode_args` is that
contract, checked before any kernel runs so that a bad batch is refused
instead of read out of bounds.

Ordering rule for every backend: in each layer, the new K/V of the *whole
batch* are written before any attention reads the cache. With prefix
caching, a request may read blocks that another request of the same batch is
writing in that very step.
"""

from __future__ import annotations

import torch

# The slot of a token whose K/V go nowhere (vLLM's PAD_SLOT_ID, in
# vllm/attention/backends/utils.py): every cache write skips negative slots,
# `write_to_kv_cache` below and the CUDA `reshape_and_cache` alike.
PAD_SLOT_ID = -1


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def write_to_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int64; PAD_SLOT_ID = padding
) -> None:
    """Store this step's new K/V at their slots (vLLM's reshape_and_cache);
    a token at a negative slot (PAD_SLOT_ID) is not stored."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    if (slot_mapping < 0).any():  # padding rows: keep the others
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    # index_copy_ rather than flat[0, slots] = key: the same rows written,
    # 4x faster for one token and 17x for 64 here (indexed assignment goes
    # through the general index_put_ machinery).
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def swap_blocks(
    src_cache: torch.Tensor,  # one layer, [2, num_blocks, ...], on one device
    dst_cache: torch.Tensor,  # one layer, same layout, maybe on another device
    pairs: list[tuple[int, int]],  # (src block, dst block)
) -> None:
    """Copy whole blocks, K and V, from one layer's cache to another's."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], device=src_cache.device)
    dst = torch.tensor([d for _, d in pairs], device=dst_cache.device)
    # Both K and V: dim 1 is the block number.
    dst_cache[:, dst] = src_cache[:, src].to(dst_cache.device, non_blocking=True)


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write in every layer: block src onto block dst of the same cache
    (vLLM's copy_blocks; `_custom_ops.copy_blocks` is the CUDA kernel)."""
    for layer in kv_caches:
        swap_blocks(layer, layer, pairs)


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


def check_decode_args(
    query_shape: tuple[int, ...],  # [num_seqs, num_heads, head_size]
    cache_shape: tuple[int, ...],  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_shape: tuple[int, ...],  # [num_seqs, max_blocks_per_seq]
    seq_lens_shape: tuple[int, ...],  # [num_seqs]
    max_seq_len: int,
) -> None:
    """Refuse a decode batch that a kernel would read out of bounds.

    Shapes only (and the host-side longest context), so it costs nothing and
    never waits for a GPU: one query row per sequence, one block table row
    and one length per sequence, and tables wide enough for the longest
    context.
    """
    num_seqs = query_shape[0]
    if block_tables_shape[0] != num_seqs or seq_lens_shape[0] != num_seqs:
        raise ValueError(
            "paged decode attention takes one query row per sequence: query has "
            f"{num_seqs} rows, block_tables {block_tables_shape[0]}, seq_lens "
            f"{seq_lens_shape[0]} (a prefill scheduled as a decode?)"
        )
    if query_shape[2] != cache_shape[3] or query_shape[1] % cache_shape[2]:
        raise ValueError(
            f"query [.., {query_shape[1]} heads, {query_shape[2]}] does not fit a cache of "
            f"{cache_shape[2]} KV heads of size {cache_shape[3]}"
        )
    capacity = block_tables_shape[1] * cache_shape[1]
    if max_seq_len > capacity:
        raise ValueError(
            f"a context of {max_seq_len} tokens needs more than the block tables' "
            f"{block_tables_shape[1]} blocks of {cache_shape[1]} tokens"
        )
