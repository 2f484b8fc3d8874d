"""`CUDAGraphRunner`: one decode batch size's model forward, captured as a CUDA graph.

Why graphs: a decode step of a small model launches hundreds of short
kernels, and launching each from Python costs the CPU several microseconds,
more than the GPU spends running it. A CUDA graph records the launches once;
a replay issues the whole forward with one call.

A replay repeats exactly what was recorded: the same kernels, launch sizes
and addresses. So, as in vLLM v0.6's `CUDAGraphRunner` (except the last
point's detail):

- there is one graph per captured batch size, and a decode batch is padded
  up to the next one (`FlatBatch.padded_to`; padding rows write nowhere);
- every input lives in a buffer fixed at capture, and each step copies its
  tensors into it before the replay; the output is a fixed buffer too,
  overwritten by the next replay;
- the attention kernels were launched for the longest context a graph
  covers (`max_seq_len_to_capture`): they read each sequence's own length
  from `seq_lens` on the GPU and stop there, so shorter contexts are right;
- the block-table buffer is as wide as that context; a step's narrower
  table fills its left columns, and the stale ones beyond are never read.
  (vLLM builds each step's table at that full width on the host instead.)

Only the model forward is captured; logits and sampling run eagerly on its
output rows, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.attention import AttentionMetadata

# vLLM's: forward runs before the capture, so that lazy work (the CUDA
# kernels' compilation, cuBLAS handles, the allocator's first blocks) happens
# outside the graph.
_NUM_WARMUP_ITERS = 2


class CUDAGraphRunner:
    def __init__(self, model_forward: Callable[..., torch.Tensor]) -> None:
        self.model_forward = model_forward
        self.graph: torch.cuda.CUDAGraph | None = None
        self.input_buffers: dict[str, torch.Tensor] = {}
        self.output_buffers: dict[str, torch.Tensor] = {}

    def capture(
        self,
        input_ids: torch.Tensor,  # [batch_size], the buffer replays read
        positions: torch.Tensor,  # [batch_size]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,  # its tensors are buffers too
        memory_pool: tuple[int, int],
    ) -> torch.Tensor:  # [batch_size, hidden_size]
        """Warm up, then record one forward into the shared memory pool
        (graphs captured largest first reuse the same memory)."""
        for _ in range(_NUM_WARMUP_ITERS):
            self.model_forward(input_ids, positions, kv_caches, attn_metadata)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=memory_pool):
            hidden_states = self.model_forward(input_ids, positions, kv_caches, attn_metadata)
        torch.cuda.synchronize()
        self.input_buffers = {
            "input_ids": input_ids,
            "positions": positions,
            "slot_mapping": attn_metadata.slot_mapping,
            "seq_lens_tensor": attn_metadata.seq_lens_tensor,
            "block_tables": attn_metadata.block_tables,
        }
        self.output_buffers = {"hidden_states": hidden_states}
        return hidden_states

    def __call__(
        self,
        input_ids: torch.Tensor,  # [batch_size], padded to the captured size
        positions: torch.Tensor,  # [batch_size]
        kv_caches: list[torch.Tensor],  # the captured caches: their addresses are in the graph
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [batch_size, hidden_size], valid until the next replay
        buffers = self.input_buffers
        buffers["input_ids"].copy_(input_ids, non_blocking=True)
        buffers["positions"].copy_(positions, non_blocking=True)
        buffers["slot_mapping"].copy_(attn_metadata.slot_mapping, non_blocking=True)
        buffers["seq_lens_tensor"].copy_(attn_metadata.seq_lens_tensor, non_blocking=True)
        tables = attn_metadata.block_tables  # [batch_size, max_blocks of this step]
        buffers["block_tables"][:, : tables.shape[1]].copy_(tables, non_blocking=True)
        self.graph.replay()
        return self.output_buffers["hidden_states"]
