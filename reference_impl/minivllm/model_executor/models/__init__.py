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


class _ModelRegistry:
    """vLLM's `ModelRegistry`: architecture name -> model class.

    `register_model(architecture, model_cls)` adds an architecture, or
    replaces one of ours (an out-of-tree model; a lab's variant of a layer).
    The executors hand the registrations to every worker process, where the
    class is imported again by its module and name: define it in a module,
    not in a notebook cell."""

    def __init__(self) -> None:
        self._registered: dict[str, type[nn.Module]] = {}

    def register_model(self, architecture: str, model_cls: type[nn.Module]) -> None:
        self._registered[architecture] = model_cls

    def registered(self) -> dict[str, type[nn.Module]]:
        """What `register_model` added in this process (for the workers)."""
        return dict(self._registered)

    def get_supported_archs(self) -> list[str]:
        return sorted({*_MODELS, *self._registered})

    def resolve_model_cls(self, architecture: str) -> type[nn.Module]:
        if architecture in self._registered:
            return self._registered[architecture]
        if architecture not in _MODELS:
            raise ValueError(
                f"Model architecture {architecture!r} is not supported. "
                f"Supported architectures: {', '.join(self.get_supported_archs())}"
            )
        module_name, class_name = _MODELS[architecture]
        module = importlib.import_module(f"minivllm.model_executor.models.{module_name}")
        return getattr(module, class_name)


ModelRegistry = _ModelRegistry()
