"""`ModelRunner`: turns the scheduled groups into tensors and runs the model.

One step's batch is flattened (`FlatBatch`): every scheduled sequence
contributes its new tokens (its whole uncomputed prompt when prefilling, one
token when decoding), prefills first. For each token we build its
`input_ids`, `positions` and `slot_mapping` (where its K/V go); per sequence
its `seq_lens`, `context_lens` and block table. Logits are computed only for
the rows `SamplingMetadata.prepare` selects: the last token of each sequence
that samples, and the prompt positions of requests with prompt_logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minivllm.attention import AttentionMetadata
from minivllm.attention.backends.abstract import AttentionBackend
from minivllm.attention.selector import get_attn_backend
from minivllm.config import CacheConfig, DeviceConfig, ModelConfig
from minivllm.model_executor.layers.sampler import Sampler, SamplerOutput
from minivllm.model_executor.model_loader import get_model
from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sequence import SequenceGroupMetadata


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
    what the model was given.
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
        self, model_config: ModelConfig, cache_config: CacheConfig, device_config: DeviceConfig
    ) -> None:
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = device_config.torch_device
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

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, self.attn_backend)

    def prepare_model_input(
        self, seq_group_metadata_list: list[SequenceGroupMetadata]
    ) -> ModelInput:
        batch = FlatBatch.build(seq_group_metadata_list, self.block_size)
        max_blocks = max(len(t) for t in batch.block_tables)
        padded_tables = [t + [0] * (max_blocks - len(t)) for t in batch.block_tables]

        def as_tensor(values, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        attn_metadata = self.attn_backend.get_metadata_cls()(
            num_prefills=batch.num_prefills,
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=len(batch.input_ids) - batch.num_prefill_tokens,
            slot_mapping=as_tensor(batch.slot_mapping),
            seq_lens=batch.seq_lens,
            context_lens=batch.context_lens,
            query_start_loc=batch.query_start_loc,
            block_tables=as_tensor(padded_tables),
            seq_lens_tensor=as_tensor(batch.seq_lens),
        )
        sampling_metadata = SamplingMetadata.prepare(
            seq_group_metadata_list, batch.seq_lens, batch.context_lens, self.device
        )
        return ModelInput(
            input_ids=as_tensor(batch.input_ids),
            positions=as_tensor(batch.positions),
            attn_metadata=attn_metadata,
            selected_token_indices=sampling_metadata.selected_token_indices,
            batch=batch,
            sampling_metadata=sampling_metadata,
        )

    @torch.inference_mode()
    def execute_model(
        self, model_input: ModelInput, kv_caches: list[torch.Tensor]
    ) -> SamplerOutput | None:
        """Run the model and sample; on the ranks other than the driver, run
        this rank's shard of the model and return None (the driver samples)."""
        hidden_states = self.model(
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
