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

Both engines capture with `capture_decode_graphs`: the classic runner at
vLLM v0.6's batch sizes, V1's at current vLLM's (each runner says which).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from minivllm.attention import AttentionMetadata
from minivllm.attention.backends.abstract import AttentionBackend
from minivllm.attention.kv_cache import PAD_SLOT_ID
from minivllm.compilation import set_forward_context

logger = logging.getLogger(__name__)

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


def capture_decode_graphs(
    model_forward: Callable[..., torch.Tensor],
    attn_backend: type[AttentionBackend],
    batch_sizes: list[int],  # ascending
    max_seq_len_to_capture: int,
    block_size: int,
    kv_caches: list[torch.Tensor],
    forward_context_layers: tuple[list, list],  # (attention layers, packed layers)
) -> dict[int, CUDAGraphRunner]:
    """One graph per decode batch size, largest first so the smaller ones
    reuse its memory pool (vLLM's `capture_model`). None for a backend whose
    attention cannot be captured (`AttentionBackend.supports_cuda_graphs`):
    every step then runs eagerly."""
    if not attn_backend.supports_cuda_graphs:
        logger.info(
            "attention backend %r cannot run in a CUDA graph: every step runs eagerly",
            attn_backend.get_name(),
        )
        return {}
    start = time.perf_counter()
    max_batch = batch_sizes[-1]
    device = kv_caches[0].device
    # The buffers every graph reads, sliced to its size: token 0 at position
    # 0, slots PAD_SLOT_ID (nothing is written), contexts of 1 token in block
    # 0; each replay first copies the real step into them.
    input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
    positions = torch.zeros(max_batch, dtype=torch.long, device=device)
    memory_pool = torch.cuda.graph_pool_handle()
    metadata = _graph_capture_metadata(
        attn_backend, max_batch, max_seq_len_to_capture, block_size, device
    )
    runners: dict[int, CUDAGraphRunner] = {}
    for batch_size in reversed(batch_sizes):
        attn_metadata = metadata(batch_size)
        runner = CUDAGraphRunner(model_forward)
        with set_forward_context(attn_metadata, kv_caches, *forward_context_layers):
            runner.capture(
                input_ids[:batch_size], positions[:batch_size], kv_caches, attn_metadata,
                memory_pool,
            )
        runners[batch_size] = runner
    logger.info(
        "captured CUDA graphs for decode batches of %s sequences in %.1f s",
        batch_sizes, time.perf_counter() - start,
    )
    return runners


def _graph_capture_metadata(
    attn_backend: type[AttentionBackend],
    max_batch: int,
    max_seq_len_to_capture: int,
    block_size: int,
    device: torch.device,
) -> Callable[[int], AttentionMetadata]:
    """The dummy decode metadata of each captured size, its tensors slices
    of buffers shared by every graph (vLLM's
    `graph_capture_get_metadata_for_batch`)."""
    on_device = dict(dtype=torch.long, device=device)
    slot_mapping = torch.full((max_batch,), PAD_SLOT_ID, **on_device)
    seq_lens = torch.ones(max_batch, **on_device)
    max_blocks = -(-max_seq_len_to_capture // block_size)
    block_tables = torch.zeros(max_batch, max_blocks, **on_device)

    def for_batch(batch_size: int) -> AttentionMetadata:
        attn_metadata = attn_backend.get_metadata_cls()(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=batch_size,
            slot_mapping=slot_mapping[:batch_size],
            seq_lens=[1] * batch_size,
            context_lens=[0] * batch_size,
            query_start_loc=[0],
            block_tables=block_tables[:batch_size],
            seq_lens_tensor=seq_lens[:batch_size],
        )
        # The kernels' launch is sized for the longest context a replay may
        # bring, not for the dummy rows' 1 token (the host list's).
        attn_metadata.max_decode_seq_len = max_seq_len_to_capture
        return attn_metadata

    return for_batch
