"""`bad_words` (vLLM's V1 sampling field) on both engines: each word is
tokenized at the start of a text and after a space, as vLLM keeps them; a
one-token word is never sampled, a longer one loses its last token right
after the output ends with its others. The oracles: hand-worked masks, and
Hugging Face's `generate` with the same token sequences (`bad_words_ids`,
its `NoBadWordsLogitsProcessor`), greedy."""

from __future__ import annotations

import copy

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model_executor.layers.sampler import apply_bad_words

PROMPT = [5, 6, 7, 8, 9]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def test_apply_bad_words_bans_the_last_token_after_the_rest():
    logits = torch.zeros(4, 10)
    out = apply_bad_words(
        logits,
        {
            0: [[3], [5, 6]],  # output ends with 5: 6 banned; 3 always
            2: [[5, 6, 7]],  # output ends with 5 only, not 5 6: nothing
            3: [[5, 6, 7], [1, 2]],  # ends with 5 6: 7 banned; 1 2 needs a 1 last
        },
        [[1, 5], [5], [2, 5], [2, 5, 6]],
    )
    banned = [set(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in out]
    assert banned == [{3, 6}, set(), set(), {7}]  # row 1 has no bad words
    assert not torch.isinf(logits).any()  # the input is left as it was
    # Only generated tokens count: before the first, a two-token word cannot apply.
    empty = apply_bad_words(torch.zeros(1, 10), {0: [[5, 6], [4]]}, [[]])
    assert torch.isinf(empty[0]).nonzero().flatten().tolist() == [4]


def test_both_spellings_are_kept_when_they_differ_only_in_the_first_token(model):
    """vLLM's rule: the spelling after a space is kept if its first token
    differs from the plain spelling's and it has as many tokens."""
    tokenizer = LLM(model, max_model_len=64).get_tokenizer()

    def spellings(word: str) -> list[list[int]]:
        params = SamplingParams(bad_words=[word])
        params.update_from_tokenizer(tokenizer)
        return params.bad_words_token_ids

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    kept, dropped = [], []
    for word in ["the", "cat", "and", "dog", "sun", "ball", "a", "tree", "happy"]:
        plain, spaced = encode(word), encode(" " + word)
        if plain[0] != spaced[0] and len(plain) == len(spaced):
            kept.append(word)
            assert spellings(word) == [plain, spaced]
            assert spellings("  " + word) == [plain, spaced]  # leading spaces are stripped
        else:
            dropped.append(word)
            assert spellings(word) == [plain]
    assert kept and dropped  # both cases were seen
    with pytest.raises(ValueError, match="bad_words must be words"):
        SamplingParams(bad_words=["cat", " "])
    with pytest.raises(TypeError, match="bad_words must be None or a list of strings"):
        SamplingParams(bad_words="cat")


def token_ids_of(params: SamplingParams, tokenizer) -> list[list[int]]:
    """The bad words' token ids, as the engine computes them on its copy."""
    tokenized = copy.copy(params)
    tokenized.update_from_tokenizer(tokenizer)
    return tokenized.bad_words_token_ids


def hf_greedy(hf, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, **kwargs)
    return out[0, len(PROMPT):].tolist()


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens)))


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_greedy_runs_avoid_the_words_as_hugging_faces_do(model, hf_model, use_v1):
    hf = hf_model("llama")
    plain = hf_greedy(hf)
    llm = LLM(model, use_v1=use_v1, max_model_len=64)
    tokenizer = llm.get_tokenizer()

    def word_of(length: int) -> str:
        """The text of the plain run's first `length` tokens (after its first)
        that the tokenizer spells back the same way (a random tiny model's
        output has byte fragments, which do not come back)."""
        for i in range(1, len(plain) - length + 1):
            text = tokenizer.decode(plain[i : i + length])
            if tokenizer.encode(text.lstrip(), add_special_tokens=False) == plain[i : i + length]:
                return text
        raise AssertionError(f"no {length}-token word in {plain}")

    # A one-token word and a two-token word of the plain run's: one request
    # each, and a plain one beside them.
    words = [word_of(1), word_of(2)]
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [SamplingParams(**greedy, bad_words=[word]) for word in words]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 3,
                           [*params, SamplingParams(**greedy)], use_tqdm=False)
    assert list(outputs[2].outputs[0].token_ids) == plain
    for p, out in zip(params, outputs, strict=False):
        assert p.bad_words_token_ids is None  # the engine tokenized its own copy
        ids = token_ids_of(p, tokenizer)
        assert any(contains(plain, w) for w in ids)  # the plain run says it: the test can fail
        # HF matches a word's start against the prompt too; none here ends with one.
        assert all(PROMPT[-len(w) + 1 :] != w[:-1] for w in ids if len(w) > 1)
        expected = hf_greedy(hf, bad_words_ids=ids)
        assert expected != plain and not any(contains(expected, w) for w in ids)
        assert list(out.outputs[0].token_ids) == expected
    assert max(len(w) for w in token_ids_of(params[1], tokenizer)) > 1  # several tokens


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_a_word_the_vocabulary_cannot_hold_is_refused(model, use_v1, monkeypatch):
    engine = LLM(model, use_v1=use_v1, max_model_len=64).llm_engine
    vocab = engine.model_config.hf_config.vocab_size
    monkeypatch.setattr(SamplingParams, "update_from_tokenizer",
                        lambda self, tok: setattr(self, "_bad_words_token_ids", [[3, vocab]]))
    with pytest.raises(ValueError, match=r"bad_words token ids \[\d+\] are outside"):
        engine.add_request("r", {"prompt_token_ids": PROMPT}, SamplingParams(bad_words=["x"]))
    assert not engine.has_unfinished_requests()


def test_a_ban_that_would_leave_nothing_to_sample_is_not_applied():
    """Row 0 allows only tokens 3 and 4 (the rest -inf) and its output ends
    with 1: the words "1 3" and "1 4" would ban both, so neither is banned.
    Row 1, with 5 also allowed, loses 3 and 4."""
    logits = torch.full((2, 8), float("-inf"))
    logits[0, [3, 4]] = 0.0
    logits[1, [3, 4, 5]] = 0.0
    words = [[1, 3], [1, 4]]
    out = apply_bad_words(logits, {0: words, 1: words}, [[1], [1]])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 4]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5]


def test_the_ids_follow_the_words_and_a_failed_tokenization_leaves_none(model):
    tokenizer = LLM(model, max_model_len=64).get_tokenizer()
    params = SamplingParams(bad_words=["cat"])
    params.update_from_tokenizer(tokenizer)
    assert params.bad_words_token_ids
    params.bad_words = None
    params.update_from_tokenizer(tokenizer)
    assert params.bad_words_token_ids is None


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_every_sample_of_n_avoids_the_words(model, use_v1):
    """n=2 with a seed: each sample of the plain request says a word (one
    of its tokens); with both words banned, neither sample says either. (V1 fans n out into
    child requests, each with its own params.)"""
    llm = LLM(model, use_v1=use_v1, max_model_len=64)
    tokenizer = llm.get_tokenizer()
    sampled = dict(n=2, temperature=0.7, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    [plain] = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**sampled),
                           use_tqdm=False)
    samples = [list(c.token_ids) for c in plain.outputs]
    # A word from each sample: a token the tokenizer spells back alone.
    words = [
        next(tokenizer.decode([t]) for t in sample
             if tokenizer.encode(tokenizer.decode([t]).lstrip(), add_special_tokens=False) == [t])
        for sample in samples
    ]
    params = SamplingParams(**sampled, bad_words=words)
    ids = token_ids_of(params, tokenizer)
    assert all(any(contains(s, w) for w in ids) for s in samples)  # the test can fail
    [out] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert not any(contains(list(completion.token_ids), w) for w in ids)


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_words_that_could_leave_nothing_to_sample_are_refused(model, use_v1):
    engine = LLM(model, use_v1=use_v1, max_model_len=64).llm_engine
    tokenizer = engine.tokenizer
    one = [t for t in range(40, 400) if tokenizer.encode(
        tokenizer.decode([t]).lstrip(), add_special_tokens=False) == [t]][:2]
    words = [tokenizer.decode([t]) for t in one]
    banned = set()
    for w in words:
        banned |= {ids[-1] for ids in token_ids_of(SamplingParams(bad_words=[w]), tokenizer)}
    eos = tokenizer.eos_token_id
    cases = [
        (dict(allowed_token_ids=sorted(banned), bad_words=words), "ban every token"),
        (dict(allowed_token_ids=[*sorted(banned), eos], bad_words=words, min_tokens=2),
         "could have none left"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.add_request("r", {"prompt_token_ids": PROMPT}, SamplingParams(**kwargs))
        assert not engine.has_unfinished_requests()
    # One allowed token that is not banned is enough.
    free = next(t for t in range(40, 400) if t not in banned and t != eos)
    engine.add_request("ok", {"prompt_token_ids": PROMPT},
                       SamplingParams(allowed_token_ids=[*sorted(banned), free], bad_words=words,
                                      max_tokens=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert set(outputs[-1].outputs[0].token_ids) == {free}
