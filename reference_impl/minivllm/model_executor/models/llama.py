"""Llama 2/3 (and Mistral-style configs): pre-norm decoder with RMSNorm,
rotary positions, grouped-query attention and a SwiGLU MLP.

Every model here has the same interface (see models/__init__.py):
`forward(input_ids, positions, kv_caches, attn_metadata)` over the flattened
batch returns hidden states `[num_tokens, hidden_size]`; `compute_logits`
turns the rows that sample into logits; `load_weights` takes Hugging Face
checkpoint tensors by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from minivllm.attention import Attention, AttentionMetadata
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from minivllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from minivllm.model_executor.weight_utils import load_named_weights


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: silu")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        gate_up, _ = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size / tp]
        x, _ = self.down_proj(self.act_fn(gate_up))  # all-reduced
        return x


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = (
            getattr(config, "num_key_value_heads", None) or self.total_num_heads
        )
        self.head_size = getattr(config, "head_dim", None) or hidden_size // self.total_num_heads
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_size, self.total_num_heads, self.total_num_kv_heads,
            bias=qkv_bias,
        )
        # This rank's heads: a share of the query heads, and of the KV heads
        # (or one of them, replicated, when there are fewer KV heads than ranks).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_size, hidden_size,
            bias=getattr(config, "attention_bias", False),
        )
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings, config)
        self.attn = Attention(
            self.num_heads, self.head_size, self.head_size**-0.5, self.num_kv_heads
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))
        return output


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]: the last sublayer's output
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None in the first layer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As vLLM's layers: the residual stream travels beside the hidden
        states, and each norm first adds the sublayer's output to it
        (RMSNorm with `residual`); the last add is in the model's final norm."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                positions, hidden_states, kv_cache, attn_metadata, residual
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # Checkpoint names of the parts of each fused projection.
    stacked_params_mapping = [
        # (fused param, checkpoint part, shard id)
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, qkv_bias=self.qkv_bias(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @staticmethod
    def qkv_bias(config: PretrainedConfig) -> bool:
        return getattr(config, "attention_bias", False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # [num_rows, vocab_size] on the driver; None on the other ranks
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self.stacked_params_mapping)
