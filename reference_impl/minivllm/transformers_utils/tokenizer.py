"""Loading the tokenizer that goes with a checkpoint."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def get_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"Could not load a tokenizer from {path!r}: expected tokenizer.json or the "
            f"tokenizer files of a Hugging Face checkpoint ({e})"
        ) from e
