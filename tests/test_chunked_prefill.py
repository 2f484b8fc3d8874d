"""Chunked prefill: long prompts split across steps to fit the token budget,
decodes running beside the chunks, and outputs equal to Hugging Face's."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.scheduler import Scheduler
from minivllm.sequence import Sequence, SequenceGroup
from tests.engine_spies import batch_shapes, record_schedules
from tests.hf_oracle import GREEDY, assert_matches_hf, make_prompts, poison_kv_cache
from tests.test_block_manager_scheduler import simulate_model_step


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"enable_prefix_caching": True},
        {"num_gpu_blocks_override": 13, "preemption_mode": "recompute"},
        {"num_gpu_blocks_override": 13, "preemption_mode": "swap", "enable_prefix_caching": True},
    ],
)
def test_chunked_outputs_match_hf(arch, extra, tiny_model_dir, hf_model):
    kwargs = {"num_gpu_blocks_override": 64} | extra
    llm = LLM(
        tiny_model_dir(arch),
        block_size=8,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        swap_space=0.01,
        **kwargs,
    )
    poison_kv_cache(llm)
    schedules = record_schedules(llm)
    prompts = make_prompts(384)  # lengths 1..60, most longer than the 16-token budget
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    steps = batch_shapes(schedules)
    assert_matches_hf(hf_model(arch), prompts, outputs)
    assert all(sum(n for _, n, _ in step) <= 16 for step in steps)
    # Chunking happened: some prefill chunks did not finish their prompt.
    assert any(is_prompt and not do_sample for step in steps for is_prompt, _, do_sample in step)
    # ... while decodes ran in the same steps.
    assert any(
        any(p and not s for p, _, s in step) and any(not p for p, _, _ in step) for step in steps
    )
    preempted = llm.llm_engine.scheduler.num_cumulative_preemption > 0
    assert preempted == ("preemption_mode" in extra)


def test_a_lone_long_prompt_samples_only_on_its_last_chunk(tiny_model_dir, hf_model):
    llm = LLM(
        tiny_model_dir("llama"),
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    schedules = record_schedules(llm)
    prompt = make_prompts(384)[-1]  # 60 tokens: chunks of 16, 16, 16, 12
    out = llm.generate([prompt], GREEDY, use_tqdm=False)
    steps = batch_shapes(schedules)
    assert steps[:4] == [
        [(True, 16, False)],
        [(True, 16, False)],
        [(True, 16, False)],
        [(True, 12, True)],
    ]
    assert steps[4] == [(False, 1, True)]
    assert_matches_hf(hf_model("llama"), [prompt], out)


@pytest.mark.parametrize(("caching", "chunks"), [(False, [15, 15, 10]), (True, [12, 12, 12, 4])])
def test_chunks_beside_a_decode_by_hand(caching, chunks):
    # Budget 16 tokens, block_size 4. r0 is decoding (1 token a step); the
    # 40-token prompt p gets the remaining 15 tokens each step, or with
    # prefix caching 12 (whole blocks) until its last chunk.
    cache_config = CacheConfig(block_size=4, enable_prefix_caching=caching)
    cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = 32, 0
    scheduler_config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=True
    )
    sched = Scheduler(scheduler_config, cache_config)
    r0 = Sequence(0, None, [7, 8, 9, 10], 4)
    p = Sequence(1, None, list(range(200, 240)), 4)  # shares no block with r0
    params = SamplingParams(temperature=0)
    sched.add_seq_group(SequenceGroup("r0", [r0], params, 0.0))
    targets = {"r0": 20, "p": 1}
    _, out = sched.schedule()
    simulate_model_step(sched, out, targets)
    sched.add_seq_group(SequenceGroup("p", [p], params, 1.0))
    seen = []
    for _ in chunks:
        metadata, out = sched.schedule()
        by_id = {m.request_id: m for m in metadata}
        assert by_id["r0"].token_chunk_size == 1 and by_id["r0"].do_sample
        assert out.num_batched_tokens == 1 + by_id["p"].token_chunk_size
        seen.append((by_id["p"].token_chunk_size, by_id["p"].do_sample))
        simulate_model_step(sched, out, targets)
    assert seen == [(n, i == len(chunks) - 1) for i, n in enumerate(chunks)]
    assert p.get_output_len() == 1 and not p.is_prefill()
