"""Every combination of batch composition (vLLM's default, chunked prefill,
the course's MixedBatchScheduler), queue order, prefix caching and
preemption mode, under a KV cache small enough to preempt: greedy tokens
equal Hugging Face's."""

from __future__ import annotations

import itertools

import pytest

from minivllm import LLM
from minivllm.core.scheduler import MixedBatchScheduler, Scheduler
from tests.hf_oracle import GREEDY, assert_matches_hf, make_prompts, poison_kv_cache

COMPOSITIONS = {
    "default": (Scheduler, False),
    "chunked": (Scheduler, True),
    "mixed": (MixedBatchScheduler, False),
}
COMBINATIONS = list(
    itertools.product(COMPOSITIONS, ["fcfs", "priority"], [False, True], ["recompute", "swap"])
)


@pytest.mark.parametrize(("composition", "policy", "caching", "mode"), COMBINATIONS)
def test_combination_matches_hf(composition, policy, caching, mode, tiny_model_dir, hf_model):
    scheduler_cls, chunked = COMPOSITIONS[composition]
    llm = LLM(
        tiny_model_dir("llama"),
        block_size=8,
        # The 8 prompts need more: preemption must happen. (With 12 blocks
        # one request would fill them all and, as in vLLM, never run.)
        num_gpu_blocks_override=13,
        scheduler_cls=scheduler_cls,
        swap_space=0.01,
        max_num_seqs=8,
        max_num_batched_tokens=16 if chunked else None,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        scheduling_policy=policy,
        preemption_mode=mode,
    )
    poison_kv_cache(llm)
    # Half the prompts share a 24-token prefix so the cache has something to hit.
    prompts = make_prompts(384)
    prompts[4:] = [prompts[7][:24] + p[:8] for p in prompts[4:]]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model("llama"), prompts, outputs)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_cumulative_preemption > 0
    assert (scheduler.block_manager.prefix_cache_hits > 0) == caching
    assert scheduler.block_manager.get_num_free_gpu_blocks() == 13
