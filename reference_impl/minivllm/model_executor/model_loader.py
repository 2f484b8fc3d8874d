"""`get_model`: build our module for a checkpoint, load its weights, then
prepare them for the device (vLLM's `process_weights_after_loading`)."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.attention.backends.abstract import AttentionBackend
from minivllm.attention.selector import set_attn_backend
from minivllm.config import ModelConfig
from minivllm.model_executor.layers.linear import LinearBase
from minivllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from minivllm.model_executor.models import ModelRegistry
from minivllm.model_executor.weight_utils import safetensors_weights_iterator


def get_model(
    model_config: ModelConfig, device: torch.device, attn_backend: type[AttentionBackend]
) -> nn.Module:
    model_class = ModelRegistry.resolve_model_cls(model_config.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        # Parameters are created directly on the device in the model dtype;
        # buffers made with an explicit dtype (RoPE's cos/sin) stay float32.
        # Every Attention layer picks up the engine's attention backend.
        with torch.device(device), set_attn_backend(attn_backend):
            model = model_class(model_config.hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.load_weights(safetensors_weights_iterator(model_config.local_path))
    process_weights_after_loading(model, model_config)
    return model.eval()


def process_weights_after_loading(model: nn.Module, model_config: ModelConfig) -> None:
    """Pack the weights of every linear layer and of the LM head for the
    CPU's oneDNN matmul (layers/utils.py), as vLLM's CPU backend does,
    whether the model is then run eagerly or compiled."""
    head = getattr(model, "lm_head", None)  # the embedding itself, when tied
    for module in model.modules():
        if isinstance(module, LinearBase) or module is head:
            dispatch_cpu_unquantized_gemm(module)
