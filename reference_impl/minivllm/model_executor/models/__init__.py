"""The model registry: Hugging Face architecture name -> our module.

Every model class takes the Hugging Face config and provides
`forward(input_ids, positions, kv_caches, attn_metadata) -> hidden_states`,
`compute_logits(hidden_states) -> logits` and `load_weights(weights)`.
"""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under models/, class name)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    # Mistral's layers are Llama's; its sliding window only matters past
    # `sliding_window` tokens, which max_model_len is capped to.
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
}


def get_supported_archs() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported. "
            f"Supported architectures: {', '.join(get_supported_archs())}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"minivllm.model_executor.models.{module_name}")
    return getattr(module, class_name)
