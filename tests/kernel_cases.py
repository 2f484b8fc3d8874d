"""Random decode-attention inputs in the KV-cache layout, and the reference.

Shared by the CPU kernel tests, the simulator test (run in a subprocess) and
the CUDA tests (GPU and emulated). Every cache row that no sequence may read
(past a sequence's end, or a padding entry of a block table) is poisoned so
that a kernel touching it fails loudly instead of by a small error: its value
half is NaN, which spreads into any output it reaches, and its key half is
STALE_KEY, whose huge logit would take over the softmax. The key poison is not
NaN on purpose: `fmaxf(m, NaN)` is `m`, so a stale q.k that only reached the
running max would go unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.attention.backends.torch_paged import TorchPagedAttention

# Large enough that q.k * scale dwarfs every real logit (about 1e4 times the
# sum of a query row), small enough for float16.
STALE_KEY = 1e4


@dataclass
class DecodeCase:
    query: torch.Tensor  # [num_seqs, num_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor  # [num_seqs, max_blocks], int64
    seq_lens: torch.Tensor  # [num_seqs], int64
    scale: float

    @property
    def num_kv_heads(self) -> int:
        return self.kv_cache.shape[3]

    def reference(self) -> torch.Tensor:
        """The PyTorch backend's decode (gather, mask, softmax in float32)."""
        _, num_heads, head_size = self.query.shape
        impl = TorchPagedAttention(num_heads, head_size, self.scale, self.num_kv_heads)
        max_seq_len = int(self.seq_lens.max())
        return impl.forward_decode(
            self.query, self.kv_cache, self.block_tables, self.seq_lens, max_seq_len
        )


def make_decode_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
) -> DecodeCase:
    """Block tables drawn with replacement from a small pool, so blocks repeat
    within and across sequences (as shared prefix blocks do)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = max(4, sum(-(-n // block_size) for n in seq_lens) // 2 + 1)
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    readable = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, n in enumerate(seq_lens):
        t = torch.arange(n)
        readable[block_tables[i, t // block_size], t % block_size] = True
    kv_cache[0, ~readable] = STALE_KEY
    kv_cache[1, ~readable] = float("nan")
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    return DecodeCase(
        query=query.to(device, dtype),
        kv_cache=kv_cache.to(device, dtype),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        scale=head_size**-0.5,
    )


def lengths_around_blocks(block_size: int) -> list[int]:
    """1, both sides of the first block boundary, and several blocks with a partial last one."""
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
