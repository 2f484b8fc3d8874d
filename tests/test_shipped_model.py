"""The story model shipped in minivllm/assets/: what the course promises
about it, checked through the engine and against Hugging Face.

Nothing here hard-codes the model's text: the tests check behaviour (equal
to HF, stops by itself, cache hits, seeds vary the samples), so a retrained
checkpoint passes as long as it keeps the promises of its model card.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.assets import DEFAULT_MODEL
from tests.hf_oracle import assert_matches_hf
from tools.model.corpus import generate_stories

OPENINGS = [
    "Once upon a time",
    "The little dog",
    "Lily was a kind girl",
    "There was once a brave fox",
    "Long ago, there was a shy rabbit called Tom",
    "In a small house by the sea",
]


@pytest.fixture(scope="module")
def llm():
    return LLM()  # no model: the shipped one


@pytest.fixture(scope="module")
def hf():
    # float32, as the engine runs on the CPU ("auto" dtype).
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def test_checkpoint_is_small_standard_and_uses_gqa():
    files = set(os.listdir(DEFAULT_MODEL))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    assert "README.md" in files  # the model card
    size = sum(os.path.getsize(os.path.join(DEFAULT_MODEL, f)) for f in files)
    assert size <= 10 * 2**20
    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]


def test_llm_without_a_model_loads_the_shipped_one(llm):
    assert llm.llm_engine.model_config.model == DEFAULT_MODEL


def test_prompts_start_with_bos_and_match_hf_ids(llm, hf):
    hf_tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    for text in OPENINGS:
        ids = hf_tokenizer(text)["input_ids"]
        assert ids[0] == hf.generation_config.bos_token_id == hf_tokenizer.bos_token_id
        assert llm.llm_engine.tokenizer.encode(text) == ids
    assert hf.generation_config.eos_token_id == hf_tokenizer.eos_token_id


def test_greedy_equals_hf_generate(llm, hf):
    max_tokens = 64
    outputs = llm.generate(OPENINGS, SamplingParams(temperature=0, max_tokens=max_tokens))
    prompts = [o.prompt_token_ids for o in outputs]
    assert_matches_hf(hf, prompts, outputs, max_tokens)


def test_greedy_stories_finish_by_themselves(llm):
    """Each opening grows into a whole story that ends with EOS ("stop") well
    within 256 tokens and reuses the names it was given."""
    eos = llm.llm_engine.tokenizer.eos_token_id
    outputs = llm.generate(OPENINGS, SamplingParams(temperature=0, max_tokens=256))
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", out.prompt + completion.text
        assert completion.token_ids[-1] == eos
        assert len(completion.token_ids) < 256
        assert completion.text.count(".") >= 3  # several sentences
    for name in ("Lily", "Tom"):
        story = next(o for o in outputs if name in o.prompt)
        assert name in story.outputs[0].text  # the hero is still the hero


def test_small_max_tokens_finishes_by_length(llm):
    outputs = llm.generate(OPENINGS[:2], SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)


def test_shared_opening_hits_the_prefix_cache(llm):
    """Stories that share a long opening reuse its KV blocks, and caching
    changes no token."""
    opening = generate_stories(1, seed=7)[0].split("\n\n")[0]  # a whole first paragraph
    prompts = [opening + ending for ending in ("\n\nOne day,", "\n\nThe next day,", " Every")]
    params = SamplingParams(temperature=0, max_tokens=32)
    cached = LLM(enable_prefix_caching=True, block_size=8)
    first = cached.generate(prompts[:1], params)  # fills the cache
    rest = cached.generate(prompts[1:], params)
    stats = cached.llm_engine.get_stats()
    shared_blocks = len(cached.llm_engine.tokenizer.encode(opening)) // 8 - 1
    assert stats.prefix_cache_hits >= 2 * shared_blocks > 0
    plain = llm.generate(prompts, params)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == [o.outputs[0].token_ids for o in plain]


def test_temperature_sampling_varies_with_the_seed(llm):
    """Temperature 0.8: a seed reproduces its story, other seeds tell others."""
    def story(seed: int) -> str:
        params = SamplingParams(temperature=0.8, seed=seed, max_tokens=48)
        return llm.generate(["Once upon a time"], params)[0].outputs[0].text

    texts = [story(seed) for seed in (0, 1, 2)]
    assert story(0) == texts[0]
    assert len(set(texts)) == 3
