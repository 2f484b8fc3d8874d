"""Paged attention (PyTorch backend) against plain dense causal attention.

K/V are written into randomly permuted, non-contiguous blocks through
`slot_mapping`, then read back through the block tables; the result must
equal `scaled_dot_product_attention` on the contiguous tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.attention import Attention, AttentionMetadata
from minivllm.attention.kv_cache import get_kv_cache_shape, write_to_kv_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 8, 2, 16


def dense_reference(q, k, v, context_len):
    """q [q_len, H, D] at positions context_len.., k/v [seq_len, KVH, D]."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q_len, seq_len = q.shape[0], k.shape[0]
    allowed = torch.arange(seq_len)[None, :] <= (context_len + torch.arange(q_len))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_matches_dense(block_size):
    g = torch.Generator().manual_seed(block_size)
    # (context_len, q_len): fresh prefills, a prefill after a cached prefix,
    # and decodes (q_len 1) of various lengths.
    seqs = [(0, 9), (5, 7), (0, 1), (12, 1), (block_size * 3 - 1, 1), (30, 1)]
    num_prefills = 3
    num_blocks = 128
    # Unwritten slots hold NaN, like stale memory: attention must never let them in.
    kv_cache = torch.full(
        get_kv_cache_shape(num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE), float("nan")
    )
    free = torch.randperm(num_blocks, generator=g).tolist()

    full_k, full_v, queries, block_tables, new_slots, expected = [], [], [], [], [], []
    for context_len, q_len in seqs:
        seq_len = context_len + q_len
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=g)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=g)
        q = torch.randn(q_len, NUM_HEADS, HEAD_SIZE, generator=g)
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        # The cached prefix is already in the cache; the new tokens are written
        # by the layer itself.
        write_to_kv_cache(
            k[:context_len],
            v[:context_len],
            kv_cache,
            torch.tensor(slots[:context_len], dtype=torch.long),
        )
        full_k.append(k)
        full_v.append(v)
        queries.append(q)
        block_tables.append(table)
        new_slots += slots[context_len:]
        expected.append(dense_reference(q, k, v, context_len))

    max_blocks = max(len(t) for t in block_tables)
    q_lens = [q for _, q in seqs]
    metadata = AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=sum(q_lens[:num_prefills]),
        num_decode_tokens=sum(q_lens[num_prefills:]),
        slot_mapping=torch.tensor(new_slots),
        seq_lens=[c + q for c, q in seqs],
        context_lens=[c for c, _ in seqs],
        query_start_loc=[0, *torch.tensor(q_lens[:num_prefills]).cumsum(0).tolist()],
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables]),
        seq_lens_tensor=torch.tensor([c + q for c, q in seqs]),
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)])
    attn = Attention(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS)
    out = attn(
        torch.cat(queries).flatten(1), new_k.flatten(1), new_v.flatten(1), kv_cache, metadata
    )
    torch.testing.assert_close(
        out.view(-1, NUM_HEADS, HEAD_SIZE), torch.cat(expected), atol=1e-5, rtol=1e-5
    )


def test_write_to_kv_cache_skips_padding_slots():
    kv_cache = torch.zeros(get_kv_cache_shape(2, 4, 1, 2))
    key = torch.arange(6.0).view(3, 1, 2)
    value = -key
    write_to_kv_cache(key, value, kv_cache, torch.tensor([5, -1, 2]))
    # slot 5 = block 1, offset 1; slot 2 = block 0, offset 2; the -1 row is dropped.
    assert kv_cache[0, 1, 1, 0].tolist() == [0.0, 1.0]
    assert kv_cache[0, 0, 2, 0].tolist() == [4.0, 5.0]
    assert kv_cache[1, 0, 2, 0].tolist() == [-4.0, -5.0]
    # Nothing else was written: K holds 1, 4, 5 and V -1, -4, -5 as non-zeros.
    assert int((kv_cache != 0).sum()) == 6
