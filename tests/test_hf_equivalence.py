"""The engine's greedy output equals Hugging Face `generate` token for token,
for every supported architecture, batched or alone, with and without
preemption. Hugging Face runs each prompt alone (no padding) as the oracle."""

from __future__ import annotations

import pytest

from minivllm import LLM
from tests.engine_spies import record_block_moves
from tests.hf_oracle import GREEDY, MAX_TOKENS, assert_matches_hf, make_prompts, poison_kv_cache
from tools.tiny_models import ARCHS


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
    # 13 blocks of 8 tokens hold at most 104 tokens: the longest request alone
    # needs 60 + 32 = 92 (12 blocks), so the batch of 8 must preempt to make
    # progress. (In 12 blocks that request, alone, would hold them all and
    # still lack the free block vLLM's can_append_slots wants: it would never
    # run.)
    llm = LLM(
        tiny_model_dir(arch),
        block_size=8,
        num_gpu_blocks_override=13,
        swap_space=0.01,
        preemption_mode=mode,
    )
    poison_kv_cache(llm)
    engine = llm.llm_engine
    moves = record_block_moves(llm, monkeypatch)

    prompts = make_prompts(engine.model_config.hf_config.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model(arch), prompts, outputs)
    assert engine.scheduler.num_cumulative_preemption > 0
    if mode == "swap":
        num_out, num_in = len(moves["swap_out"]), len(moves["swap_in"])
        assert num_out > 0 and num_in == num_out
    else:
        assert moves["swap_in"] == moves["swap_out"] == []
    # Every block is back in the pools.
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 13
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
