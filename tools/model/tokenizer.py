"""Byte-level BPE tokenizers trained with the `tokenizers` library.

Byte-level so every string encodes (no unknown token), saved through
`PreTrainedTokenizerFast.save_pretrained` as a standard `tokenizer.json`
that `transformers.AutoTokenizer` loads (see FIELD_NOTES: transformers 5
picks the tokenizer class from the model type, and this form loads
correctly for Llama). Used by the shipped model and the random tiny test
models alike.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS = "<s>", "</s>"
BOS_ID, EOS_ID = 0, 1  # the special tokens come first in the vocabulary


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, add_bos: bool = False
) -> PreTrainedTokenizerFast:
    """Train on `texts`; BOS is id 0 and EOS id 1.

    With `add_bos`, encoding prepends BOS the way Llama's tokenizer does, so
    a prompt reaches the model exactly as its training stories began (and
    Hugging Face and the engine see the same ids).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
