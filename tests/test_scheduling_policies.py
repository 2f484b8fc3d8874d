"""Batch composition (vLLM's default, the course's MixedBatchScheduler,
chunked prefill) and queue order (fcfs, priority) change the batches, never
the tokens."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import CacheConfig, PreemptionMode, SchedulerConfig
from minivllm.core.scheduler import MixedBatchScheduler, Scheduler
from minivllm.sequence import Sequence, SequenceGroup
from tests.engine_spies import batch_shapes, record_schedules
from tests.hf_oracle import GREEDY, assert_matches_hf, make_prompts, poison_kv_cache
from tests.test_block_manager_scheduler import simulate_model_step

COMPOSITIONS = {
    "default": {},
    "mixed": {"scheduler_cls": MixedBatchScheduler},
    "chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
# 13 blocks of 8 preempt; with 12, the 96-token request would hold every
# block and still lack one for its next token (vLLM: preempted forever).
@pytest.mark.parametrize("blocks", [64, 13])
def test_batch_compositions_give_hf_tokens_in_different_batches(
    blocks, policy, tiny_model_dir, hf_model
):
    prompts = make_prompts(384)
    # Different lengths make requests finish at different steps, so new
    # prompts are admitted while others decode.
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i) for i in range(len(prompts))]
    batches = {}
    for name, composition in COMPOSITIONS.items():
        llm = LLM(
            tiny_model_dir("llama"),
            block_size=8,
            num_gpu_blocks_override=blocks,
            swap_space=0.01,
            max_num_seqs=3,
            scheduling_policy=policy,
            **composition,
        )
        poison_kv_cache(llm)
        schedules = record_schedules(llm)
        priority = [i % 3 for i in range(len(prompts))] if policy == "priority" else None
        outputs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
        for prompt, output, p in zip(prompts, outputs, params, strict=True):
            assert_matches_hf(hf_model("llama"), [prompt], [output], max_tokens=p.max_tokens)
        batches[name] = batch_shapes(schedules)
        assert (llm.llm_engine.scheduler.num_cumulative_preemption > 0) == (blocks == 13)

    def mixed(step):
        return any(p for p, _, _ in step) and any(not p for p, _, _ in step)

    assert not any(mixed(step) for step in batches["default"])
    assert any(mixed(step) for step in batches["mixed"])
    assert any(mixed(step) for step in batches["chunked"])
    assert len({str(b) for b in batches.values()}) == 3


@pytest.mark.parametrize(
    ("scheduler_cls", "expected"),
    [
        # MixedBatchScheduler: r0's decode and p's prefill share the step.
        (MixedBatchScheduler, [[("p", 6), ("r0", 1)], [("r0", 1), ("p", 1)]]),
        # vLLM's default: p's prefill runs alone; r0 waits a step.
        (Scheduler, [[("p", 6)], [("r0", 1), ("p", 1)]]),
    ],
)
def test_one_step_by_hand(scheduler_cls, expected):
    cache_config = CacheConfig(block_size=4)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = 16, 0
    sched = scheduler_cls(SchedulerConfig(max_num_seqs=4, max_model_len=64), cache_config)
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
    for wrong in ("lifo", "prefill_first"):  # prefill-first is the default batching now
        with pytest.raises(
            ValueError, match=rf"must be one of \['fcfs', 'priority'\], got '{wrong}'"
        ):
            LLM(tiny_model_dir("llama"), scheduling_policy=wrong)


def make_priority_scheduler(num_gpu_blocks: int, max_num_seqs: int) -> Scheduler:
    cache_config = CacheConfig(block_size=4)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = num_gpu_blocks, 0
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        scheduling_policy="priority",
        preemption_mode="recompute",
    )
    return Scheduler(config, cache_config)


def test_priority_orders_admission():
    sched = make_priority_scheduler(num_gpu_blocks=16, max_num_seqs=1)
    params = SamplingParams(temperature=0)
    for i, prio in enumerate([2, 0, 1, 0]):  # arrivals 0..3
        seq = Sequence(i, None, [10 + i, 11 + i], 4)
        sched.add_seq_group(SequenceGroup(f"r{i}", [seq], params, float(i), prio))
    order = []
    for _ in range(4):
        metadata, out = sched.schedule()
        order += [m.request_id for m in metadata if m.is_prompt]
        simulate_model_step(sched, out, {f"r{i}": 1 for i in range(4)})
    # priority first (0, 0, 1, 2), then arrival among equals (r1 before r3).
    assert order == ["r1", "r3", "r2", "r0"]


def test_priority_picks_the_least_important_victim():
    # 3 blocks of 4 tokens. Two 4-token prompts fill a block each; the first
    # decode needs 2 more blocks but only 1 is free: one request is preempted.
    sched = make_priority_scheduler(num_gpu_blocks=3, max_num_seqs=4)
    params = SamplingParams(temperature=0)
    early = SequenceGroup("early", [Sequence(0, None, [1, 2, 3, 4], 4)], params, 0.0, 5)
    late = SequenceGroup("late", [Sequence(1, None, [5, 6, 7, 8], 4)], params, 1.0, 0)
    sched.add_seq_group(early)
    sched.add_seq_group(late)
    _, out = sched.schedule()
    assert [s.seq_group.request_id for s in out.scheduled_seq_groups] == ["late", "early"]
    simulate_model_step(sched, out, {"early": 10, "late": 10})
    _, out = sched.schedule()
    # FCFS would preempt "late" (last to arrive); by priority, "early" (5) goes.
    assert [(g.request_id, m) for g, m in out.preempted] == [("early", PreemptionMode.RECOMPUTE)]
    assert [s.seq_group.request_id for s in out.scheduled_seq_groups] == ["late"]


def test_priority_runs_through_generate(tiny_model_dir, hf_model):
    llm = LLM(tiny_model_dir("llama"), scheduling_policy="priority", max_num_seqs=2)
    prompts = make_prompts(384)[:4]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[3, 2, 1, 0])
    assert_matches_hf(hf_model("llama"), prompts, outputs)  # input order kept
    # Lower priority values started first.
    firsts = [o.metrics.first_scheduled_time for o in outputs]
    assert firsts[3] <= firsts[2] <= firsts[1] <= firsts[0]
    fcfs = LLM(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'"):
        fcfs.generate(prompts[:1], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority has 1 entries but there are 2 prompts"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[1])
