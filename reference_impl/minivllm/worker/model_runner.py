"""`ModelRunner`: turns the scheduled groups into tensors and runs the model.

One step's batch is flattened (`FlatBatch`): every scheduled sequence
contributes its new tokens (its whole uncomputed prompt when prefilling, one
token when decoding), prefills first. For each token we build its
`input_ids`, `positions` and `slot_mapping` (where its K/V go); per sequence
its `seq_lens`, `context_lens` and block table. Logits are computed only for
the rows `SamplingMetadata.prepare` selects: the last token of each sequence
that samples, and the prompt positions of requests with prompt_logprobs.

With `compilation_level` > 0 the model forward runs through `torch.compile`
(compilation/wrapper.py::CompiledModel); each step then sets the forward
context its attention op reads.

On a GPU, unless `enforce_eager`, `capture_model` records the forward of
each decode batch size in `_BATCH_SIZES_TO_CAPTURE` (up to max_num_seqs,
padded) as a CUDA graph (worker/cuda_graph_runner.py). A decode-only batch
that one covers is padded up to its size (`FlatBatch.padded_to`) and replayed
from it; any other step (a prefill in it, a context longer than
`max_seq_len_to_capture`, more sequences) runs eagerly. vLLM v0.6 decides
the same way (`_use_captured_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minivllm.attention import AttentionMetadata
from minivllm.attention.backends.abstract import AttentionBackend
from minivllm.attention.kv_cache import PAD_SLOT_ID
from minivllm.attention.layer import attention_layers
from minivllm.attention.selector import get_attn_backend
from minivllm.compilation import model_forward, set_forward_context
from minivllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from minivllm.model_executor.layers.sampler import Sampler, SamplerOutput
from minivllm.model_executor.layers.utils import packed_gemm_layers
from minivllm.model_executor.model_loader import get_model
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sequence import SequenceGroupMetadata
from minivllm.worker.cuda_graph_runner import CUDAGraphRunner, capture_decode_graphs

# vLLM v0.6.3's decode batch sizes that CUDA graphs are captured for: 1, 2, 4,
# then every multiple of 8 up to 256 (no more than max_num_seqs, padded).
_BATCH_SIZE_ALIGNMENT = 8
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4] + [_BATCH_SIZE_ALIGNMENT * i for i in range(1, 33)]


def _get_graph_batch_size(batch_size: int) -> int:
    """The captured size a decode batch of `batch_size` sequences is padded
    up to (vLLM's function): 1 and 2 as they are, 3 and 4 to 4, then the
    next multiple of 8."""
    if batch_size <= 2:
        return batch_size
    if batch_size <= 4:
        return 4
    return -(-batch_size // _BATCH_SIZE_ALIGNMENT) * _BATCH_SIZE_ALIGNMENT


def _get_max_graph_batch_size(max_num_seqs: int) -> int:
    """The largest size worth capturing: max_num_seqs padded, at most 256."""
    return min(_get_graph_batch_size(max_num_seqs), _BATCH_SIZES_TO_CAPTURE[-1])


@dataclass
class ModelInput:
    """What the model runs on in one step. Under tensor parallelism the
    driver builds it and broadcasts its tensors; the other ranks rebuild it
    without `batch` and `sampling_metadata` (only the driver samples) but
    with the rows to compute logits for, which they help gather."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    selected_token_indices: torch.Tensor  # [num_selected_rows]
    batch: FlatBatch | None = None  # what the tensors above are made from (driver)
    sampling_metadata: SamplingMetadata | None = None  # driver only

    # The AttentionMetadata fields, all broadcast as they are.
    _ATTN_FIELDS = (
        "num_prefills", "num_prefill_tokens", "num_decode_tokens", "slot_mapping", "seq_lens",
        "context_lens", "query_start_loc", "block_tables", "seq_lens_tensor",
    )

    def as_broadcastable_tensor_dict(self) -> dict[str, Any]:
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "selected_token_indices": self.selected_token_indices,
            **{name: getattr(self.attn_metadata, name) for name in self._ATTN_FIELDS},
        }

    @classmethod
    def from_broadcasted_tensor_dict(
        cls, tensors: dict[str, Any], attn_backend: type[AttentionBackend]
    ) -> ModelInput:
        attn_metadata = attn_backend.get_metadata_cls()(
            **{name: tensors[name] for name in cls._ATTN_FIELDS}
        )
        return cls(
            tensors["input_ids"], tensors["positions"], attn_metadata,
            tensors["selected_token_indices"],
        )


@dataclass
class FlatBatch:
    """One step's batch flattened into plain lists, before any tensor.

    Per token (prefills first, sequence after sequence): `input_ids`,
    `positions` and `slot_mapping`. Per sequence, in the same order: its id,
    `seq_lens` (tokens once this step is done), `context_lens` (tokens
    already in the cache) and block table. `ModelRunner` turns it into the
    model's tensors; the tracer records it as it is, so a trace shows exactly
    what the model was given (less the dummy rows `padded_to` adds for a
    CUDA graph).
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_ids: list[int]
    seq_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    query_start_loc: list[int]  # where each prefill's tokens start, then the end
    num_prefills: int
    num_prefill_tokens: int

    @classmethod
    def build(
        cls, seq_group_metadata_list: list[SequenceGroupMetadata], block_size: int
    ) -> FlatBatch:
        batch = cls([], [], [], [], [], [], [], [0], 0, 0)
        for meta in seq_group_metadata_list:
            cls._check_group(meta, num_decodes=len(batch.seq_ids) - batch.num_prefills)
            for seq_id, data in meta.seq_data.items():
                context_len = data.num_computed_tokens
                seq_len = context_len + meta.token_chunk_size
                block_table = meta.block_tables[seq_id]
                new_positions = range(context_len, seq_len)
                batch.input_ids += data.get_token_ids()[context_len:seq_len]
                batch.positions += new_positions
                batch.slot_mapping += [
                    block_table[p // block_size] * block_size + p % block_size
                    for p in new_positions
                ]
                batch.seq_ids.append(seq_id)
                batch.seq_lens.append(seq_len)
                batch.context_lens.append(context_len)
                batch.block_tables.append(block_table)
                if meta.is_prompt:
                    batch.num_prefills += 1
                    batch.num_prefill_tokens += meta.token_chunk_size
                    batch.query_start_loc.append(len(batch.input_ids))
        return batch

    def padded_to(self, graph_batch_size: int) -> FlatBatch:
        """This decode batch with dummy sequences appended up to
        `graph_batch_size` rows, as vLLM pads a batch for a captured graph:
        token 0 at position 0, slot PAD_SLOT_ID (its K/V are written
        nowhere), sequence length 1 over an empty block table (padded with
        block 0 like any table: attention reads one slot of block 0 and the
        row's output is thrown away). The real rows come first, unchanged."""
        num_seqs = len(self.seq_ids)
        if self.num_prefills:
            raise ValueError("only a decode batch is padded (graphs are captured for decodes)")
        if graph_batch_size < num_seqs:
            raise ValueError(
                f"cannot pad a batch of {num_seqs} sequences down to {graph_batch_size}"
            )
        pad = graph_batch_size - num_seqs
        return FlatBatch(
            input_ids=self.input_ids + [0] * pad,
            positions=self.positions + [0] * pad,
            slot_mapping=self.slot_mapping + [PAD_SLOT_ID] * pad,
            seq_ids=self.seq_ids + [-1] * pad,
            seq_lens=self.seq_lens + [1] * pad,
            context_lens=self.context_lens + [0] * pad,
            block_tables=self.block_tables + [[] for _ in range(pad)],
            query_start_loc=list(self.query_start_loc),
            num_prefills=0,
            num_prefill_tokens=0,
        )

    @staticmethod
    def _check_group(meta: SequenceGroupMetadata, num_decodes: int) -> None:
        """The layout attention relies on: prefills before decodes, and one
        new token per decoding sequence. A group that breaks it (a prefill
        scheduled as a decode) would be attended over the wrong keys."""
        if meta.is_prompt and num_decodes:
            raise ValueError(
                f"request {meta.request_id}: a prefill after {num_decodes} decodes; "
                "the batch must list prefills first"
            )
        if not meta.is_prompt and meta.token_chunk_size != 1:
            raise ValueError(
                f"request {meta.request_id}: a decode computes 1 token per sequence, but "
                f"{meta.token_chunk_size} were scheduled (a prefill marked is_prompt=False?)"
            )


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        scheduler_config: SchedulerConfig,
    ) -> None:
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = device_config.torch_device
        # CUDA graphs: the largest decode batch and context one covers, and
        # the captured graphs by batch size (none until capture_model).
        self.max_batchsize_to_capture = _get_max_graph_batch_size(scheduler_config.max_num_seqs)
        self.max_seq_len_to_capture = model_config.max_seq_len_to_capture
        self.graph_runners: dict[int, CUDAGraphRunner] = {}
        self.sampler = Sampler(seed=model_config.seed)
        # Resolved once, as vLLM's model runner does: the layers build its
        # implementation, the cache engine uses its block copies, and its
        # metadata class carries each step's batch layout.
        self.attn_backend = get_attn_backend(
            model_config.attention_backend,
            device_config.device,
            model_config.dtype,
            model_config.get_head_size(),
            cache_config.block_size,
        )
        self.model: torch.nn.Module | None = None
        # What runs the forward: the model itself, or its compiled form.
        self.model_forward: Any = None
        self.attn_layers: list = []  # the model's Attention layers, numbered
        self.packed_layers: list = []  # its layers with packed CPU weights, numbered

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, self.attn_backend)
        self.attn_layers = attention_layers(self.model)
        self.packed_layers = packed_gemm_layers(self.model)
        self.model_forward = model_forward(self.model, self.model_config.compilation_level)

    def prepare_model_input(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        graph_batch_size: int | None = None,
    ) -> ModelInput:
        """The step's tensors. A decode batch that a captured graph covers is
        padded with dummy rows up to the graph's size (`FlatBatch.padded_to`)
        and marked `use_cuda_graph`; `graph_batch_size` pads to that many
        rows whether or not a graph exists (the padding's tests). The
        sampler reads only the real rows, and `ModelInput.batch` is the real
        batch."""
        batch = FlatBatch.build(seq_group_metadata_list, self.block_size)
        use_cuda_graph = self._use_captured_graph(batch)
        if use_cuda_graph and graph_batch_size is None:
            graph_batch_size = _get_graph_batch_size(len(batch.seq_ids))
        rows = batch if graph_batch_size is None else batch.padded_to(graph_batch_size)
        max_blocks = max(len(t) for t in rows.block_tables)
        padded_tables = [t + [0] * (max_blocks - len(t)) for t in rows.block_tables]

        def as_tensor(values, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        attn_metadata = self.attn_backend.get_metadata_cls()(
            num_prefills=rows.num_prefills,
            num_prefill_tokens=rows.num_prefill_tokens,
            num_decode_tokens=len(rows.input_ids) - rows.num_prefill_tokens,
            slot_mapping=as_tensor(rows.slot_mapping),
            seq_lens=rows.seq_lens,
            context_lens=rows.context_lens,
            query_start_loc=rows.query_start_loc,
            block_tables=as_tensor(padded_tables),
            seq_lens_tensor=as_tensor(rows.seq_lens),
            use_cuda_graph=use_cuda_graph and graph_batch_size in self.graph_runners,
        )
        # The real rows only: the padding rows come after them and are never selected.
        sampling_metadata = SamplingMetadata.prepare(
            seq_group_metadata_list, batch.seq_lens, batch.context_lens, self.device
        )
        return ModelInput(
            input_ids=as_tensor(rows.input_ids),
            positions=as_tensor(rows.positions),
            attn_metadata=attn_metadata,
            selected_token_indices=sampling_metadata.selected_token_indices,
            batch=batch,
            sampling_metadata=sampling_metadata,
        )

    def _use_captured_graph(self, batch: FlatBatch) -> bool:
        """vLLM's rule: a graph runs a step of decodes only, of no more
        sequences and no longer contexts than the graphs were captured for."""
        return (
            bool(self.graph_runners)
            and batch.num_prefills == 0
            and len(batch.seq_ids) <= self.max_batchsize_to_capture
            and max(batch.seq_lens) <= self.max_seq_len_to_capture
        )

    @torch.inference_mode()
    def capture_model(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture one CUDA graph per decode batch size of
        `_BATCH_SIZES_TO_CAPTURE` up to the largest worth it (vLLM's
        `capture_model`; the worker calls it on a GPU only)."""
        self.graph_runners = capture_decode_graphs(
            self.model_forward,
            self.attn_backend,
            [size for size in _BATCH_SIZES_TO_CAPTURE if size <= self.max_batchsize_to_capture],
            self.max_seq_len_to_capture,
            self.block_size,
            kv_caches,
            (self.attn_layers, self.packed_layers),
        )

    @torch.inference_mode()
    def execute_model(
        self, model_input: ModelInput, kv_caches: list[torch.Tensor]
    ) -> SamplerOutput | None:
        """Run the model and sample; on the ranks other than the driver, run
        this rank's shard of the model and return None (the driver samples)."""
        attn_metadata = model_input.attn_metadata
        if attn_metadata.use_cuda_graph:
            model_executable = self.graph_runners[model_input.input_ids.shape[0]]
        else:
            model_executable = self.model_forward
        # The context is read only by a compiled model's opaque ops.
        with set_forward_context(attn_metadata, kv_caches, self.attn_layers, self.packed_layers):
            hidden_states = model_executable(
                model_input.input_ids,
                model_input.positions,
                kv_caches,
                model_input.attn_metadata,
            )  # [num_tokens, hidden_size]
        # Only the rows the sampler reads need logits.
        hidden_states = hidden_states[model_input.selected_token_indices]
        # [num_selected_rows, vocab_size] on the driver (gathered), None elsewhere
        logits = self.model.compute_logits(hidden_states)
        if logits is None:
            return None
        output = self.sampler(logits, model_input.sampling_metadata)
        output.batch = model_input.batch
        return output
