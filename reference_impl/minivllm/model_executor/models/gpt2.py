"""GPT-2: learned positions, pre-LayerNorm blocks, GELU (tanh) MLP.

Its checkpoints store linear layers as `Conv1D` with weights [in, out]; our
layers hold [out, in], so those tensors are transposed when loading. The
checkpoint's q, k and v are one fused `c_attn` tensor: `QKVParallelLinear`
splits it before taking this rank's heads.
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
    RowParallelLinear,
)
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from minivllm.model_executor.weight_utils import load_named_weights

_CONV1D_LAYERS = ("c_attn", "c_proj", "c_fc")


class GPT2Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        hidden = config.n_embd
        self.head_size = hidden // config.n_head
        self.c_attn = QKVParallelLinear(hidden, self.head_size, config.n_head, bias=True)
        self.num_heads = self.c_attn.num_heads  # this rank's heads
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = self.head_size**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.attn = Attention(self.num_heads, self.head_size, scale)

    def forward(self, hidden_states, kv_cache, attn_metadata) -> torch.Tensor:
        qkv, _ = self.c_attn(hidden_states)  # [num_tokens, 3 * n_embd / tp]
        q, k, v = qkv.chunk(3, dim=-1)
        output, _ = self.c_proj(self.attn(q, k, v, kv_cache, attn_metadata))
        return output


class GPT2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = ColumnParallelLinear(config.n_embd, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, config.n_embd, bias=True)
        self.act = get_act_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.c_fc(x)  # [num_tokens, inner / tp]
        x, _ = self.c_proj(self.act(x))
        return x


class GPT2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states, kv_cache, attn_metadata) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), kv_cache, attn_metadata)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, n_embd]
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            hidden_states = block(hidden_states, kv_cache, attn_metadata)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        # GPT-2 ties its output head to the token embedding, unless its config
        # says otherwise (vLLM 0.6 ignores that and always ties; HF does not).
        if config.tie_word_embeddings:
            self.lm_head = self.transformer.wte
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.n_embd)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, n_embd]
        return self.transformer(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def converted():
            for name, tensor in weights:
                if name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue  # causal-mask buffers of old checkpoints
                if not name.startswith(("transformer.", "lm_head.")):
                    name = "transformer." + name  # the original openai checkpoints
                if name.endswith(".weight") and name.split(".")[-2] in _CONV1D_LAYERS:
                    tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
                yield name, tensor

        load_named_weights(self, converted())
