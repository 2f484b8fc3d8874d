"""Tiny randomly initialised Hugging Face checkpoints, made in-process.

Model hubs are unreachable on our machines, so tests build a small
checkpoint with transformers, `save_pretrained` it to a directory and load it
through the engine's real loading path. A byte-level BPE tokenizer is trained
on a few sentences (the trained story model that the demo uses ships in
minivllm/assets/).
"""

from __future__ import annotations

import os

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tools.model.tokenizer import train_byte_level_bpe

_CORPUS = [
    "Once upon a time there was a little dog who lived by the sea.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Hello, my name is Ada and I like to read books about engines.",
    "Paged attention stores the keys and values of every token in blocks.",
    "The scheduler picks which requests run in the next step of the engine.",
    "A quick brown fox jumps over the lazy dog while the cat sleeps.",
]


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE (every string encodes) with BOS id 0 and EOS id 1."""
    return train_byte_level_bpe(_CORPUS * 4, vocab_size)


def _config(arch: str, vocab_size: int, **overrides):
    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1)
    if arch in ("llama", "qwen2", "mistral"):
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
        cfg = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention
            max_position_embeddings=512,
            # Larger than the usual 0.02 so greedy decoding has clear winners
            # (no near-ties) and varied, non-repeating output.
            initializer_range=0.1,
            tie_word_embeddings=False,
        )
        if arch == "mistral":
            cfg["sliding_window"] = None
    elif arch == "opt":
        cls = OPTConfig
        cfg = dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
            init_std=0.2,
            pad_token_id=1,
        )
    elif arch == "gpt2":
        cls = GPT2Config
        cfg = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.2)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    cfg.update(common)
    cfg.update(overrides)
    return cls(**cfg)


_MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "mistral": MistralForCausalLM,
    "opt": OPTForCausalLM,
    "gpt2": GPT2LMHeadModel,
}
ARCHS = tuple(_MODEL_CLASSES)


def make_tiny_model(arch: str, path: str, seed: int = 0, **config_overrides) -> str:
    """Save a random `arch` checkpoint with its tokenizer to `path`; returns it.
    The vocabulary is the tokenizer's unless `vocab_size` overrides it (a
    model may have more rows than its tokenizer has tokens)."""
    tokenizer = build_tokenizer()
    config = _config(arch, config_overrides.pop("vocab_size", len(tokenizer)), **config_overrides)
    torch.manual_seed(seed)
    model = _MODEL_CLASSES[arch](config).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
