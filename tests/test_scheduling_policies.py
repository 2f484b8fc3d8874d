"""The two scheduling policies form different batches but the same tokens."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.scheduler import Scheduler
from minivllm.sequence import Sequence, SequenceGroup
from tests.hf_oracle import assert_matches_hf, make_prompts, poison_kv_cache
from tests.test_block_manager_scheduler import simulate_model_step
from tests.test_chunked_prefill import record_batches


@pytest.mark.parametrize("blocks", [64, 12])
def test_policies_give_hf_tokens_in_different_batches(blocks, tiny_model_dir, hf_model):
    prompts = make_prompts(384)
    # Different lengths make requests finish at different steps, so new
    # prompts are admitted while others decode.
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i) for i in range(len(prompts))]
    batches = {}
    for policy in ("fcfs", "prefill_first"):
        llm = LLM(
            tiny_model_dir("llama"),
            block_size=8,
            num_gpu_blocks_override=blocks,
            swap_space=0.01,
            max_num_seqs=3,
            scheduling_policy=policy,
        )
        poison_kv_cache(llm)
        steps = record_batches(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, output, p in zip(prompts, outputs, params, strict=True):
            assert_matches_hf(hf_model("llama"), [prompt], [output], max_tokens=p.max_tokens)
        batches[policy] = steps
        assert (llm.llm_engine.scheduler.num_cumulative_preemption > 0) == (blocks == 12)

    def mixed(step):
        return any(p for p, _, _ in step) and any(not p for p, _, _ in step)

    assert any(mixed(step) for step in batches["fcfs"])
    assert not any(mixed(step) for step in batches["prefill_first"])
    assert batches["fcfs"] != batches["prefill_first"]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # fcfs: r0's decode and p's prefill share the step.
        ("fcfs", [[("p", 6), ("r0", 1)], [("r0", 1), ("p", 1)]]),
        # prefill_first: p's prefill runs alone; r0 waits a step.
        ("prefill_first", [[("p", 6)], [("r0", 1), ("p", 1)]]),
    ],
)
def test_one_step_by_hand(policy, expected):
    cache_config = CacheConfig(block_size=4)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = 16, 0
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_model_len=64, scheduling_policy=policy), cache_config
    )
    params = SamplingParams(temperature=0)
    sched.add_seq_group(SequenceGroup("r0", [Sequence(0, None, [5, 6, 7], 4)], params, 0.0))
    _, out = sched.schedule()
    simulate_model_step(sched, out, {"r0": 10, "p": 10})
    sched.add_seq_group(
        SequenceGroup("p", [Sequence(1, None, list(range(20, 26)), 4)], params, 1.0)
    )
    seen = []
    for _ in expected:
        metadata, out = sched.schedule()
        seen.append([(m.request_id, m.token_chunk_size) for m in metadata])
        simulate_model_step(sched, out, {"r0": 10, "p": 10})
    assert seen == expected


def test_policy_arguments_are_checked(tiny_model_dir):
    with pytest.raises(
        ValueError,
        match=r"scheduling_policy must be one of \['fcfs', 'prefill_first'\], got 'lifo'",
    ):
        LLM(tiny_model_dir("llama"), scheduling_policy="lifo")
    with pytest.raises(ValueError, match="cannot chunk prefills"):
        LLM(tiny_model_dir("llama"), scheduling_policy="prefill_first", enable_chunked_prefill=True)
