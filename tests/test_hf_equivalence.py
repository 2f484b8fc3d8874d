"""The engine's greedy output equals Hugging Face `generate` token for token,
for every supported architecture, batched or alone, with and without
preemption. Hugging Face runs each prompt alone (no padding) as the oracle."""

from __future__ import annotations

import pytest
import torch
from minivllm import LLM, SamplingParams

from tools.tiny_models import ARCHS

# Around the block boundaries of block_size 16 and 8.
PROMPT_LENS = [1, 3, 7, 15, 16, 17, 33, 60]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# Below this gap between Hugging Face's top-2 logits, float rounding may
# legitimately pick the other token.
TIE_MARGIN = 1e-4


def poison_kv_cache(llm: LLM) -> None:
    """Fill both block pools with NaN: a read of any slot not written this
    run (a stale or padding slot) would turn the output into NaN."""
    cache_engine = llm.llm_engine.worker.cache_engine
    for layer in cache_engine.gpu_cache + cache_engine.cpu_cache:
        layer.fill_(float("nan"))


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


_HF_CACHE: dict[tuple, tuple[list[int], list[float]]] = {}


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and, per step, the gap between its top-2 logits."""
    key = (id(hf), tuple(prompt))
    if key not in _HF_CACHE:
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            pad_token_id=hf.generation_config.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        gaps = [float(t[0] - t[1]) for t in (step[0].topk(2).values for step in out.logits)]
        _HF_CACHE[key] = (tokens, gaps)
    return _HF_CACHE[key]


def assert_matches_hf(hf, prompts, outputs) -> None:
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        ref, gaps = hf_greedy(hf, prompt)
        diverge = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
        if diverge is None:
            assert len(ours) == len(ref), f"prompt of {len(prompt)}: {ours} vs HF {ref}"
        else:
            assert gaps[diverge] < TIE_MARGIN, (
                f"prompt of {len(prompt)} tokens diverges from HF at output {diverge}: "
                f"{ours} vs {ref} (HF top-2 gap {gaps[diverge]:.2e})"
            )
        expected = "stop" if ref[-1] == hf.generation_config.eos_token_id else "length"
        assert output.outputs[0].finish_reason == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_hf(arch, tiny_model_dir, hf_model):
    llm = LLM(tiny_model_dir(arch), num_gpu_blocks_override=64, swap_space=0.01)
    poison_kv_cache(llm)
    prompts = make_prompts(llm.llm_engine.model_config.hf_config.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model(arch), prompts, outputs)
    # The oracle is not degenerate: most prompts run to max_tokens.
    assert sum(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs) >= 4


@pytest.mark.parametrize("arch", ARCHS)
def test_one_at_a_time_matches_hf(arch, tiny_model_dir, hf_model):
    llm = LLM(tiny_model_dir(arch), block_size=8)
    prompts = make_prompts(llm.llm_engine.model_config.hf_config.vocab_size)
    outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert_matches_hf(hf_model(arch), prompts, outputs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches_hf(arch, mode, tiny_model_dir, hf_model, monkeypatch):
    # 12 blocks of 8 tokens hold at most 96 tokens: the longest request alone
    # needs 60 + 32 = 92, so the batch of 8 must preempt to make progress.
    llm = LLM(
        tiny_model_dir(arch),
        block_size=8,
        num_gpu_blocks_override=12,
        swap_space=0.01,
        preemption_mode=mode,
    )
    poison_kv_cache(llm)
    engine = llm.llm_engine
    moved = {"swap_in": 0, "swap_out": 0}
    for name in moved:
        original = getattr(engine.worker.cache_engine, name)

        def spy(pairs, _name=name, _original=original):
            moved[_name] += len(pairs)
            _original(pairs)

        monkeypatch.setattr(engine.worker.cache_engine, name, spy)

    prompts = make_prompts(engine.model_config.hf_config.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model(arch), prompts, outputs)
    assert engine.scheduler.num_cumulative_preemption > 0
    if mode == "swap":
        assert moved["swap_out"] > 0 and moved["swap_in"] == moved["swap_out"]
    else:
        assert moved == {"swap_in": 0, "swap_out": 0}
    # Every block is back in the pools.
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 12
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
