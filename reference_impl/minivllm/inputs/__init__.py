"""From what a user sends to token ids (vLLM's `vllm/inputs/`)."""

from minivllm.inputs.preprocess import InputPreprocessor, PromptType, get_eos_token_ids

__all__ = ["InputPreprocessor", "PromptType", "get_eos_token_ids"]
