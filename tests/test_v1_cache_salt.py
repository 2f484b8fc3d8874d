"""`cache_salt` (vLLM V1's per-request prefix-cache salt): the salt is an
extra key of a request's first block hash only, so through the chain every
later block differs too; requests share cached blocks exactly when their
salts are equal (no salt being a salt of its own); the tokens never change.
Hand-worked against `hash_block_tokens`, then end to end in the V1 engine
with the classic engine (no prefix sharing across salts to worry about) as
the oracle for the tokens. The classic engine refuses a salt, as vLLM V0 did.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    hash_block_tokens,
    hash_request_tokens,
)
from minivllm.v1.request import Request

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def make_request(tokens: list[int], cache_salt: str | None) -> Request:
    return Request(
        "r", tokens, GREEDY, eos_token_id=None, block_hasher=get_request_block_hasher(4),
        cache_salt=cache_salt,
    )


def test_the_salt_is_an_extra_key_of_the_first_block_only():
    tokens = list(range(10, 20))  # two full blocks of 4, and two tokens
    salted = make_request(tokens, "tenant-a")
    first = hash_block_tokens(None, tokens[0:4], ("tenant-a",))
    assert salted.block_hashes == [first, hash_block_tokens(first, tokens[4:8])]
    # Without a salt: the plain chain, which differs from the first block on.
    plain = make_request(tokens, None)
    assert plain.block_hashes == hash_request_tokens(4, tokens)
    assert all(a != b for a, b in zip(plain.block_hashes, salted.block_hashes, strict=True))
    assert make_request(tokens, "tenant-b").block_hashes[0] != first
    # Blocks filled by output tokens chain on without the salt.
    salted.append_output_token_ids([20, 21])
    third = hash_block_tokens(salted.block_hashes[1], tokens[8:] + [20, 21])
    assert salted.block_hashes[2] == third


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    model = tiny_model_dir("llama")
    v1 = LLM(model, use_v1=True, block_size=8, max_model_len=128, enable_prefix_caching=True)
    classic = LLM(model, block_size=8, max_model_len=128)
    return v1, classic


def prompts_sharing_40_tokens(llm: LLM) -> list[list[int]]:
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    g = torch.Generator().manual_seed(5)
    system = torch.randint(2, vocab, (40,), generator=g).tolist()
    return [system + torch.randint(2, vocab, (n,), generator=g).tolist() for n in (3, 6, 9, 4, 7)]


def test_requests_share_cached_blocks_only_with_their_own_salt(engines):
    v1, classic = engines
    v1.llm_engine.engine_core.reset_prefix_cache()
    prompts = prompts_sharing_40_tokens(v1)
    salts = ["a", "a", "b", None, None]
    expected = [o.outputs[0].token_ids for o in classic.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    hits, tokens = [], []
    # One at a time: each request sees the blocks of those before it.
    for prompt, salt in zip(prompts, salts, strict=True):
        (output,) = v1.generate([{"prompt_token_ids": prompt, "cache_salt": salt}], GREEDY,
                                use_tqdm=False)
        hits.append(output.num_cached_tokens)
        tokens.append(output.outputs[0].token_ids)
    # 40 shared tokens = 5 blocks of 8: found by the same salt, and by no other.
    assert hits == [0, 40, 0, 0, 40]
    assert tokens == expected


def test_a_bad_salt_is_refused_naming_it_and_the_classic_engine_refuses_any(engines):
    v1, classic = engines
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=r"cache_salt must be a non-empty string, got ''"):
        v1.generate([{**prompt, "cache_salt": ""}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=r"cache_salt must be a non-empty string, got 7"):
        v1.generate([{**prompt, "cache_salt": 7}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"cache_salt is not supported by the classic engine"):
        classic.generate([{**prompt, "cache_salt": "a"}], GREEDY, use_tqdm=False)
    # None is no salt, on both; the refusals left both engines working.
    for llm in (v1, classic):
        (output,) = llm.generate([{**prompt, "cache_salt": None}], GREEDY, use_tqdm=False)
        assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
