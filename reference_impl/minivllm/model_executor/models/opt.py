"""OPT (facebook/opt-125m and family): learned positions, LayerNorm, ReLU MLP.

Quirks kept from the original: position embeddings are offset by 2 rows;
the embedding width (`word_embed_proj_dim`) may differ from the hidden size,
with projections in and out; OPT-350m normalises after, not before, each
sub-layer (`do_layer_norm_before=False`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from minivllm.attention import Attention, AttentionMetadata
from minivllm.model_executor.layers.activation import get_act_fn
from minivllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from minivllm.model_executor.weight_utils import load_named_weights

_POSITION_OFFSET = 2  # OPT's position table starts with two unused rows


class OPTAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_size = hidden // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_size, config.num_attention_heads, bias=config.enable_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.out_proj = RowParallelLinear(hidden, hidden, bias=config.enable_bias)
        self.attn = Attention(self.num_heads, self.head_size, self.head_size**-0.5)

    def forward(self, hidden_states, kv_cache, attn_metadata) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [num_tokens, 3 * hidden / tp]
        q, k, v = qkv.chunk(3, dim=-1)
        output, _ = self.out_proj(self.attn(q, k, v, kv_cache, attn_metadata))
        return output


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        affine = config.layer_norm_elementwise_affine
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=config.enable_bias)
        self.activation_fn = get_act_fn(config.activation_function)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, hidden_states, kv_cache, attn_metadata) -> torch.Tensor:
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, kv_cache, attn_metadata)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)

        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states, _ = self.fc1(hidden_states)  # [num_tokens, ffn_dim / tp]
        hidden_states, _ = self.fc2(self.activation_fn(hidden_states))
        hidden_states = residual + hidden_states
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + _POSITION_OFFSET, hidden
        )
        self.project_in = ReplicatedLinear(proj, hidden, bias=False) if proj != hidden else None
        self.project_out = ReplicatedLinear(hidden, proj, bias=False) if proj != hidden else None
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = nn.LayerNorm(
                hidden, elementwise_affine=config.layer_norm_elementwise_affine
            )
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
        if self.project_in is not None:
            hidden_states, _ = self.project_in(hidden_states)
        hidden_states = hidden_states + self.embed_positions(positions + _POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, kv_cache, attn_metadata)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states, _ = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    ]

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        # OPT ties its output head to the input embedding, unless its config
        # says otherwise (vLLM 0.6 ignores that and always ties; HF does not).
        if config.tie_word_embeddings:
            self.lm_head = self.model.decoder.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, word_embed_proj_dim]
        return self.model.decoder(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed():
            for name, tensor in weights:
                # Older checkpoints (the original facebook/opt-*) drop "model.".
                if name.startswith("decoder."):
                    name = "model." + name
                yield name, tensor

        load_named_weights(self, renamed(), self.stacked_params_mapping)
