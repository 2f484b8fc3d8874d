from minivllm.attention.backends.abstract import AttentionMetadata
from minivllm.attention.layer import Attention

__all__ = ["Attention", "AttentionMetadata"]
