"""Qwen2: the Llama architecture with a bias on the q/k/v projections.

(Qwen2's optional sliding-window attention is off in its released configs
and not implemented here: a window caps the context instead, in
`ModelConfig.derive_max_model_len`.)
"""

from __future__ import annotations

from transformers import PretrainedConfig

from minivllm.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(config: PretrainedConfig) -> bool:
        return True
