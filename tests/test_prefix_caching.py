"""Prefix caching: outputs unchanged (HF oracle), shared prefixes computed
once (hand-counted blocks and prefill tokens), LRU eviction, ref counts."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.block_allocator import Device
from minivllm.core.block_manager import BlockSpaceManager
from minivllm.core.prefix_caching import CachedBlockAllocator, hash_block_tokens
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.engine_spies import prefill_tokens, record_schedules
from tests.hf_oracle import GREEDY, assert_matches_hf, poison_kv_cache


def shared_prefix_prompts(system_len: int, suffix_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(2, 384, (system_len,), generator=g).tolist()
    return [system + torch.randint(2, 384, (n,), generator=g).tolist() for n in suffix_lens]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
@pytest.mark.parametrize("preempt", [False, True])
def test_outputs_match_hf_with_prefix_caching(arch, preempt, tiny_model_dir, hf_model):
    prompts = shared_prefix_prompts(40, [1, 5, 8, 13, 20]) + shared_prefix_prompts(0, [3, 30], 1)
    # 14 blocks of 8 tokens cannot hold the batch: preemption must happen.
    blocks = 14 if preempt else 64
    llm = LLM(
        tiny_model_dir(arch),
        block_size=8,
        num_gpu_blocks_override=blocks,
        swap_space=0.01,
        enable_prefix_caching=True,
    )
    poison_kv_cache(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf_model(arch), prompts, outputs)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.block_manager.prefix_cache_hits > 0
    assert (scheduler.num_cumulative_preemption > 0) == preempt


def test_shared_system_prompt_is_computed_once(tiny_model_dir):
    # 6 prompts: a 48-token system prompt (3 blocks of 16) + 5 own tokens = 53.
    prompts = shared_prefix_prompts(48, [5] * 6)
    params = SamplingParams(temperature=0, max_tokens=4)
    results = {}
    for caching in (False, True):
        llm = LLM(tiny_model_dir("llama"), enable_prefix_caching=caching)
        schedules = record_schedules(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in outs]
        bm = llm.llm_engine.scheduler.block_manager
        if caching:
            # The first request computes all 53; the other five find the
            # system prompt's 3 blocks, admitted in the same step, and compute 5.
            assert prefill_tokens(schedules)[0] == 53 + 5 * 5
            assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (6 * 3, 5 * 3)
            assert bm.prefix_cache_hit_rate == pytest.approx(15 / 18)
        else:
            assert prefill_tokens(schedules)[0] == 6 * 53
            assert bm.prefix_cache_queries == 0
    assert results[True] == results[False]


def test_freed_blocks_stay_cached_until_evicted(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), enable_prefix_caching=True, block_size=8)
    bm = llm.llm_engine.scheduler.block_manager
    prompt = list(range(2, 35))  # 33 tokens: 4 full blocks, the 5th holds token 33
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (4, 0)
    # The request finished and freed its blocks; they wait in the evictor.
    schedules = record_schedules(llm)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (8, 4)
    assert prefill_tokens(schedules)[0] == 1  # only the last token is computed
    assert again == first


def test_a_fully_cached_prompt_still_computes_its_last_block(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), enable_prefix_caching=True, block_size=8)
    prompt = list(range(2, 34))  # 32 tokens: exactly 4 full blocks
    llm.generate([prompt], GREEDY, use_tqdm=False)
    schedules = record_schedules(llm)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    # (32 - 1) // 8 = 3 blocks may come from the cache; the 4th holds the
    # last token, whose logits are needed, and is computed: 8 tokens.
    assert prefill_tokens(schedules)[0] == 8


# -- the allocator and block manager, by hand ---------------------------------------


def make_seq(seq_id: int, tokens: list[int], block_size: int) -> SequenceGroup:
    seq = Sequence(seq_id, None, tokens, block_size)
    return SequenceGroup(str(seq_id), [seq], SamplingParams(temperature=0), 0.0)


def admit(bm: BlockSpaceManager, group: SequenceGroup) -> int:
    cached = bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.mark_blocks_as_computed(seq, seq.get_len())
    return cached


def test_identical_content_is_allocated_once():
    # block_size 4; a 9-token prompt = 2 full blocks + 1 block for the last token.
    bm = BlockSpaceManager(4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0, enable_caching=True)
    prompt = list(range(10, 19))
    groups = [make_seq(i, prompt, 4) for i in range(4)]
    assert admit(bm, groups[0]) == 0
    for g in groups[1:]:
        assert admit(bm, g) == 8  # the two full blocks are shared
    tables = [bm.get_block_table(g.seqs[0]) for g in groups]
    assert [t[:2] for t in tables] == [[0, 1]] * 4
    assert [t[2] for t in tables] == [2, 3, 4, 5]  # each last block is its own
    # 4 requests of 3 blocks each fit in 2 + 4 = 6 blocks instead of 12.
    assert bm.get_num_free_gpu_blocks() == 2
    assert [bm.gpu_allocator.lookup(b.block_hash).ref_count for b in bm.block_tables[0][:2]] == [
        4,
        4,
    ]


def test_evictor_releases_least_recently_freed_first():
    alloc = CachedBlockAllocator(Device.GPU, block_size=2, num_blocks=3)
    blocks = []
    for tokens in ((1, 2), (3, 4), (5, 6)):
        block = alloc.allocate()
        block.block_hash = hash_block_tokens(None, tokens)
        alloc.register(block)
        blocks.append(block)
    a, b, c = blocks
    for block in (b, a, c):  # freed in this order: b is least recently used
        alloc.free(block)
    assert alloc.get_num_free_blocks() == 3 and not alloc.free_block_numbers
    # Reusing a revives it; it leaves the evictor.
    assert alloc.reuse(alloc.lookup(a.block_hash)) is a and a.ref_count == 1
    new = alloc.allocate()  # the pool is full of cached blocks: evict b
    assert new.block_number == b.block_number and new.block_hash is None
    assert alloc.lookup(b.block_hash) is None
    assert alloc.lookup(c.block_hash) is c
    with pytest.raises(ValueError, match="Double free"):
        alloc.free(b)


def test_chained_hash_depends_on_the_whole_prefix():
    h1 = hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(h1, (3, 4)) != hash_block_tokens(
        hash_block_tokens(None, (9, 9)), (3, 4)
    )
    assert hash_block_tokens(h1, (3, 4)) == hash_block_tokens(
        hash_block_tokens(None, (1, 2)), (3, 4)
    )
