"""Incremental detokenization equals decoding the whole output at once,
including characters whose UTF-8 bytes arrive in separate tokens, except
that a character still incomplete at the end is left out, as vLLM leaves it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.sequence import Logprob, Sequence
from minivllm.transformers_utils.detokenizer import Detokenizer
from minivllm.v1.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def byte_tokens(tokenizer, char: str) -> list[int]:
    """The ids of char's UTF-8 bytes: one token per byte (the tiny byte-level
    BPE learned no merges for non-ASCII text)."""
    ids = tokenizer.encode(char)
    assert len(ids) == len(char.encode()) > 1
    return ids


def detokenize(tokenizer, token_ids: list[int], params: SamplingParams) -> tuple[Sequence, list]:
    """Feed token_ids one at a time, as the engine does; returns the sequence
    and its output_text after each token."""
    seq = Sequence(0, None, [5, 6], block_size=16)
    detokenizer = Detokenizer(tokenizer)
    texts = []
    for token_id in token_ids:
        seq.append_token_id(token_id, 0.0)
        seq.output_logprobs.append({token_id: Logprob(0.0)})
        detokenizer.decode_sequence_inplace(seq, params)
        texts.append(seq.output_text)
    return seq, texts


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_multibyte_characters_across_tokens(tokenizer, skip_special_tokens):
    e_acute, emoji = byte_tokens(tokenizer, "é"), byte_tokens(tokenizer, "😀")
    ascii_ids = tokenizer.encode(" the cat")
    eos = tokenizer.eos_token_id
    token_ids = ascii_ids + e_acute + emoji + [eos] + emoji + ascii_ids + e_acute + [eos]
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    seq, texts = detokenize(tokenizer, token_ids, params)
    full = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert seq.output_text == full
    assert "é" in full and "😀" in full and ("</s>" in full) != skip_special_tokens
    for k, text in enumerate(texts):
        # Never a half character: what is shown stays, and is whole.
        assert full.startswith(text) and "\ufffd" not in text
        prefix = tokenizer.decode(token_ids[: k + 1], skip_special_tokens=skip_special_tokens)
        if not prefix.endswith("\ufffd"):
            assert text == prefix


def test_an_unfinished_character_at_the_end_is_left_out(tokenizer):
    """vLLM's detokenizer waits for the rest of a character and never adds
    it if the output ends first: the full decode's U+FFFD does not show."""
    token_ids = tokenizer.encode("ab") + byte_tokens(tokenizer, "😀")[:2]
    seq, texts = detokenize(tokenizer, token_ids, SamplingParams())
    assert texts[-2:] == ["ab", "ab"]  # waiting for the rest of the character
    assert seq.output_text == "ab" and tokenizer.decode(token_ids) == "ab\ufffd"


def test_logprob_candidates_are_named_with_their_context(tokenizer):
    emoji = byte_tokens(tokenizer, "😀")
    seq, _ = detokenize(tokenizer, tokenizer.encode("ab") + emoji, SamplingParams(logprobs=0))
    decoded = [
        entry[t].decoded_token for entry, t in zip(seq.output_logprobs[-4:], emoji, strict=True)
    ]
    # A byte that leaves the character incomplete is named "" (vLLM's
    # detokenize_incrementally, and V1's logprobs processor, never show
    # U+FFFD for it); the byte that completes the character names all of it.
    assert decoded == ["", "", "", "😀"]


def test_engine_text_equals_full_decode(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
        for seed in range(6)
    ]
    # This prompt leads the random model into non-ASCII bytes.
    outs = llm.generate(["The capital of France is"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    tok = llm.get_tokenizer()
    decoded = [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]
    # The whole decode, less a last character the output ended inside of.
    assert texts == [d.rstrip("\ufffd") for d in decoded]
    assert any(not text.isascii() for text in texts)  # multi-byte characters were made


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_backend_shortcut_decodes_like_the_tokenizer(tokenizer, skip_special_tokens):
    """A stock fast tokenizer is decoded by its Rust backend directly (the
    per-token cost of `decode`'s argument handling is skipped): the text is
    the tokenizer's own, special tokens and partial characters included."""
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer._backend is tokenizer.backend_tokenizer
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    ids = [0, *tokenizer.encode(" the cat é"), 1, *byte_tokens(tokenizer, "😀")[:2], 7]
    for end in range(len(ids) + 1):
        expected = tokenizer.decode(
            ids[:end], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert detokenizer._decode(ids[:end], params) == expected


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's, Mistral's kind), trained
    here: "▁there" is a word start, which decodes to "there" at the start of
    a text and to " there" after another word."""
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = ["Once upon a time there was a little dog who lived by the sea."] * 20
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(corpus, vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=trained, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def test_the_first_output_token_is_decoded_after_the_prompt(sentencepiece_tokenizer):
    """vLLM decodes the first output tokens after the prompt's last tokens,
    so the output's text is what it adds to the prompt's: " there was ...",
    not "there was ..." (the output decoded alone), in both engines."""
    tok = sentencepiece_tokenizer
    prompt, out = tok.encode("Once upon a time"), tok.encode(" there was a little dog")
    added = tok.decode(prompt + out)[len(tok.decode(prompt)):]
    assert added.startswith(" there") and not tok.decode(out).startswith(" ")
    params = SamplingParams(logprobs=0)
    seq = Sequence(0, None, prompt, block_size=16)
    detokenizer = Detokenizer(tok)
    v1 = IncrementalDetokenizer(detokenizer, params, prompt)
    for token_id in out:
        seq.append_token_id(token_id, 0.0)
        seq.output_logprobs.append({token_id: Logprob(0.0)})
        detokenizer.decode_sequence_inplace(seq, params)
        v1.update([token_id], [{token_id: Logprob(0.0)}], stop_terminated=False)
    assert seq.output_text == v1.output_text == added
    # The first token's logprob entry is named the same way.
    assert seq.output_logprobs[0][out[0]].decoded_token == " there"


def test_spaces_between_special_tokens_reaches_the_tokenizers_decode(tokenizer):
    """vLLM's flag: a slow tokenizer puts spaces between special tokens
    unless told not to. A tokenizer with its own `decode` is called with it
    (a stock fast one decodes the same either way, and takes the shortcut)."""
    calls = []

    class Recording(type(tokenizer)):
        def decode(self, token_ids, **kwargs):
            calls.append(kwargs["spaces_between_special_tokens"])
            return super().decode(token_ids, **kwargs)

    recording = Recording.from_pretrained(tokenizer.name_or_path)
    detokenizer = Detokenizer(recording)
    assert detokenizer._backend is None
    for flag in (False, True):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=flag)
        assert detokenizer._decode([0, 1, 2], params) == tokenizer.decode([0, 1, 2])  # '<s></s>!'
        assert calls[-1] is flag
