"""Hand-worked scenarios for the block manager and the scheduler.

No model runs: `simulate_model_step` does what `LLMEngine._process_model_outputs`
does after a forward pass (mark the scheduled tokens computed, append one
sampled token per running sequence, finish and free the sequences that reached
their target). Every expected value below was worked out by hand from the
rules of the scheduler; the comments show the arithmetic.

Free block numbers are a stack: a fresh pool of N blocks hands out 0, 1, ...,
N-1, and a freed block is the next one handed out (last freed, first reused).
"""

from __future__ import annotations

import pytest

from minivllm.config import CacheConfig, PreemptionMode, SchedulerConfig
from minivllm.core.block_manager import (
    AllocStatus,
    BlockAllocator,
    BlockSpaceManager,
    Device,
)
from minivllm.core.scheduler import MixedBatchScheduler, Scheduler, SchedulerOutputs
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

# -- helpers -------------------------------------------------------------------


def make_scheduler(
    block_size: int,
    num_gpu_blocks: int,
    num_cpu_blocks: int = 0,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    preemption_mode: str | None = "recompute",
    watermark: float = 0.0,
    scheduler_cls: type[Scheduler] = Scheduler,
) -> Scheduler:
    cache_config = CacheConfig(block_size=block_size)
    cache_config.num_gpu_blocks = num_gpu_blocks
    cache_config.num_cpu_blocks = num_cpu_blocks
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        preemption_mode=preemption_mode,
    )
    return scheduler_cls(scheduler_config, cache_config, watermark=watermark)


def make_group(
    request_id: str, seq_id: int, prompt_len: int, block_size: int, arrival: float
) -> SequenceGroup:
    prompt = [100 + i for i in range(prompt_len)]
    seq = Sequence(seq_id, None, prompt, block_size)
    return SequenceGroup(request_id, [seq], SamplingParams(temperature=0, max_tokens=64), arrival)


def make_shared_group(
    request_id: str, seq_ids: list[int], prompt_len: int, block_size: int
) -> SequenceGroup:
    """A group of several sequences sharing one prompt (n > 1 needs temperature > 0)."""
    prompt = [100 + i for i in range(prompt_len)]
    seqs = [Sequence(sid, None, prompt, block_size) for sid in seq_ids]
    params = SamplingParams(n=len(seq_ids), temperature=1.0, max_tokens=64)
    return SequenceGroup(request_id, seqs, params, 0.0)


def simulate_model_step(
    scheduler: Scheduler, out: SchedulerOutputs, targets: dict[str, int]
) -> None:
    """What the engine does after the forward pass of `out`'s batch.

    targets: request_id -> output length at which its sequences finish.
    """
    for scheduled in out.scheduled_seq_groups:
        group = scheduled.seq_group
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.data.update_num_computed_tokens(scheduled.token_chunk_size)
            if seq.get_num_new_tokens() > 0:
                continue  # a chunk that does not finish the prompt samples nothing
            seq.append_token_id(1000 + seq.get_output_len(), 0.0)
            if seq.get_output_len() >= targets[group.request_id]:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                scheduler.free_seq(seq)
    scheduler.free_finished_seq_groups()


def ids(groups) -> list[str]:
    return [g.request_id for g in groups]


def scheduled_ids(out: SchedulerOutputs) -> list[tuple[str, int]]:
    return [(s.seq_group.request_id, s.token_chunk_size) for s in out.scheduled_seq_groups]


def table(scheduler: Scheduler, group: SequenceGroup) -> list[int]:
    return scheduler.block_manager.get_block_table(group.seqs[0])


# -- 1. max_num_seqs (MixedBatchScheduler: decodes and prompts share a step) -----


def test_admission_limited_by_max_num_seqs_counting_running():
    # vLLM's default would run r1's prefill alone (test_scheduler_vllm_scenarios.py).
    sched = make_scheduler(
        block_size=4, num_gpu_blocks=16, max_num_seqs=2, scheduler_cls=MixedBatchScheduler
    )
    targets = {f"r{i}": 10 for i in range(4)}
    r0 = make_group("r0", 0, 4, 4, 0.0)
    sched.add_seq_group(r0)
    _, out = sched.schedule()
    assert scheduled_ids(out) == [("r0", 4)]
    simulate_model_step(sched, out, targets)

    for i in (1, 2, 3):
        sched.add_seq_group(make_group(f"r{i}", i, 4, 4, float(i)))
    _, out = sched.schedule()
    # r0 decodes (1 seq); max_num_seqs=2 leaves room for exactly one prompt.
    # Tokens and blocks are plentiful (1 + 4 + 4 + 4 <= 64, 16 blocks).
    assert scheduled_ids(out) == [("r1", 4), ("r0", 1)]
    assert out.num_prefill_groups == 1
    assert out.num_batched_tokens == 5
    assert ids(sched.running) == ["r0", "r1"]
    assert ids(sched.waiting) == ["r2", "r3"]
    simulate_model_step(sched, out, targets)

    # Both still running: the next step admits nobody.
    _, out = sched.schedule()
    assert scheduled_ids(out) == [("r0", 1), ("r1", 1)]
    assert ids(sched.waiting) == ["r2", "r3"]


# -- 2. token budget (MixedBatchScheduler: the Day 3 worked example) ----------------


def test_token_budget_admits_prefill_that_fits_and_keeps_next_waiting():
    sched = make_scheduler(
        scheduler_cls=MixedBatchScheduler,
        block_size=16,
        num_gpu_blocks=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    targets = {"run": 10, "p50": 10, "p30": 10}
    running = make_group("run", 0, 10, 16, 0.0)
    sched.add_seq_group(running)
    _, out = sched.schedule()
    simulate_model_step(sched, out, targets)

    sched.add_seq_group(make_group("p50", 1, 50, 16, 1.0))
    sched.add_seq_group(make_group("p30", 2, 30, 16, 2.0))
    _, out = sched.schedule()
    # 1 decode token + 50 prompt tokens = 51 <= 64; + 30 more = 81 > 64.
    assert scheduled_ids(out) == [("p50", 50), ("run", 1)]  # prefills first
    assert out.num_prefill_groups == 1
    assert out.num_batched_tokens == 51
    assert out.scheduled_seq_groups[0].seq_group.is_prefill()
    assert not out.scheduled_seq_groups[1].seq_group.is_prefill()
    assert ids(sched.waiting) == ["p30"]
    assert out.ignored_seq_groups == []


# -- 3. a prompt waits for blocks (LATER) ------------------------------------------


def test_prompt_waits_while_blocks_short_then_admitted_after_free():
    sched = make_scheduler(block_size=4, num_gpu_blocks=4)
    targets = {"small": 2, "big": 5}
    small = make_group("small", 0, 3, 4, 0.0)  # 3 tokens: 1 block
    big = make_group("big", 1, 13, 4, 1.0)  # 13 tokens: ceil(13/4) = 4 blocks
    sched.add_seq_group(small)
    sched.add_seq_group(big)

    _, out = sched.schedule()
    assert scheduled_ids(out) == [("small", 3)]
    assert table(sched, small) == [0]
    # 3 free blocks < 4 needed, and 4 <= 4 total: LATER, not NEVER.
    assert sched.block_manager.get_num_free_gpu_blocks() == 3
    assert sched.block_manager.can_allocate(big) == AllocStatus.LATER
    assert ids(sched.waiting) == ["big"]
    assert out.ignored_seq_groups == []
    simulate_model_step(sched, out, targets)

    # small has 4 tokens now: they still fit block 0, so nothing is freed or taken.
    _, out = sched.schedule()
    assert scheduled_ids(out) == [("small", 1)]
    assert ids(sched.waiting) == ["big"]
    assert big.seqs[0].status == SequenceStatus.WAITING
    assert big.seqs[0].seq_id not in sched.block_manager.block_tables
    simulate_model_step(sched, out, targets)  # small reaches 2 outputs: block 0 freed

    assert sched.block_manager.get_num_free_gpu_blocks() == 4
    _, out = sched.schedule()
    assert scheduled_ids(out) == [("big", 13)]
    assert table(sched, big) == [0, 1, 2, 3]  # block 0 was freed last, reused first
    assert sched.block_manager.get_num_free_gpu_blocks() == 0
    assert not sched.waiting


# -- 4. decode allocates a block exactly when the last one is full -----------------


def test_decode_allocates_new_block_only_when_last_block_full():
    sched = make_scheduler(block_size=4, num_gpu_blocks=8)
    targets = {"full": 10, "partial": 10}
    full = make_group("full", 0, 4, 4, 0.0)  # 4 tokens fill block 0
    partial = make_group("partial", 1, 3, 4, 1.0)  # 3 tokens leave one slot free
    sched.add_seq_group(full)
    sched.add_seq_group(partial)

    _, out = sched.schedule()
    assert table(sched, full) == [0]
    assert table(sched, partial) == [1]
    simulate_model_step(sched, out, targets)

    # full: its 5th token opens logical block 1 -> physical block 2.
    # partial: its 4th token goes to the last slot of block 1.
    _, out = sched.schedule()
    assert scheduled_ids(out) == [("full", 1), ("partial", 1)]
    assert table(sched, full) == [0, 2]
    assert table(sched, partial) == [1]
    assert out.blocks_to_copy == []
    assert sched.block_manager.get_num_free_gpu_blocks() == 5
    simulate_model_step(sched, out, targets)

    # full: token 6 fits block 2; partial: token 5 opens a block -> 3.
    _, out = sched.schedule()
    assert table(sched, full) == [0, 2]
    assert table(sched, partial) == [1, 3]
    assert sched.block_manager.get_num_free_gpu_blocks() == 4


# -- 5/6. RECOMPUTE preemption ---------------------------------------------------------


def _recompute_setup():
    """4 blocks of 4; r0 (4 tokens), r1 (3), r2 (4) take blocks 0, 1, 2; r3
    (5 tokens: 2 blocks) waits, as 1 block is free.

    After one step r0 and r2 have 5 tokens and each need a second block; r1
    has 4 and needs none, but vLLM's can_append_slots still asks for one
    free block per running sequence.
    """
    sched = make_scheduler(block_size=4, num_gpu_blocks=4, preemption_mode="recompute")
    targets = {"r0": 2, "r1": 2, "r2": 5, "r3": 3}
    groups = {
        "r0": make_group("r0", 0, 4, 4, 0.0),
        "r1": make_group("r1", 1, 3, 4, 1.0),
        "r2": make_group("r2", 2, 4, 4, 2.0),
        "r3": make_group("r3", 3, 5, 4, 3.0),
    }
    for g in groups.values():
        sched.add_seq_group(g)
    _, out = sched.schedule()
    assert scheduled_ids(out) == [("r0", 4), ("r1", 3), ("r2", 4)]
    assert [table(sched, groups[r]) for r in ("r0", "r1", "r2")] == [[0], [1], [2]]
    assert ids(sched.waiting) == ["r3"]  # 1 free block < 2: LATER
    simulate_model_step(sched, out, targets)
    return sched, groups, targets


def test_recompute_preempts_last_arrived_running_request():
    sched, groups, _ = _recompute_setup()
    r2_seq = groups["r2"].seqs[0]
    assert r2_seq.data.num_computed_tokens == 4

    _, out = sched.schedule()
    # r3 still cannot be admitted (LATER), so the step decodes. r0 takes the
    # free block 3; then r1 finds none free: the victim is r2 (the tail of
    # running, the last arrival), not r1 itself, and r1 decodes.
    assert [(g.request_id, mode) for g, mode in out.preempted] == [("r2", PreemptionMode.RECOMPUTE)]
    assert ids(sched.waiting) == ["r2", "r3"]  # to the front
    assert ids(sched.running) == ["r0", "r1"]
    assert r2_seq.status == SequenceStatus.WAITING
    assert r2_seq.seq_id not in sched.block_manager.block_tables
    assert r2_seq.data.num_computed_tokens == 0
    assert r2_seq.is_prefill()
    assert r2_seq.get_output_len() == 1  # generated tokens are kept
    assert table(sched, groups["r0"]) == [0, 3]
    assert table(sched, groups["r1"]) == [1]
    assert sched.block_manager.get_num_free_gpu_blocks() == 1  # r2's block 2
    assert scheduled_ids(out) == [("r0", 1), ("r1", 1)]
    assert out.num_prefill_groups == 0
    assert out.num_batched_tokens == 2


def test_recomputed_request_prefills_prompt_plus_generated_tokens():
    sched, groups, targets = _recompute_setup()
    _, out = sched.schedule()  # preempts r2 (previous test)
    simulate_model_step(sched, out, targets)  # r0 and r1 reach 2 outputs and finish
    assert sched.block_manager.get_num_free_gpu_blocks() == 4

    _, out = sched.schedule()
    # r2 (at the head): 4 prompt + 1 generated = 5 tokens = 2 blocks; r3: 5
    # tokens = 2 blocks. Freed in order: 2 (r2), then 0, 3 (r0), then 1 (r1);
    # the last freed is handed out first: 1, 3 for r2, then 0, 2 for r3.
    assert scheduled_ids(out) == [("r2", 5), ("r3", 5)]
    assert out.num_prefill_groups == 2
    assert out.num_batched_tokens == 10
    scheduled_r2 = out.scheduled_seq_groups[0]
    assert scheduled_r2.seq_group.is_prefill()
    r2_seq = groups["r2"].seqs[0]
    assert scheduled_r2.token_chunk_size == r2_seq.get_prompt_len() + r2_seq.get_output_len()
    assert table(sched, groups["r2"]) == [1, 3]
    assert table(sched, groups["r3"]) == [0, 2]
    simulate_model_step(sched, out, targets)
    assert r2_seq.data.num_computed_tokens == 5
    assert not r2_seq.is_prefill()
    assert r2_seq.get_output_len() == 2


# -- 7. SWAP preemption ---------------------------------------------------------------


def _swap_setup():
    """6 gpu blocks of 4, 8 cpu blocks. a (8 tokens) gets gpu [0, 1], b (16
    tokens) gets [2, 3, 4, 5]; after one step both need a new block."""
    sched = make_scheduler(block_size=4, num_gpu_blocks=6, num_cpu_blocks=8, preemption_mode="swap")
    targets = {"a": 2, "b": 5, "c": 3}
    a = make_group("a", 0, 8, 4, 0.0)
    b = make_group("b", 1, 16, 4, 1.0)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    _, out = sched.schedule()
    assert scheduled_ids(out) == [("a", 8), ("b", 16)]
    assert table(sched, a) == [0, 1]
    assert table(sched, b) == [2, 3, 4, 5]
    simulate_model_step(sched, out, targets)
    return sched, a, b, targets


def test_swap_out_then_swap_in_round_trip():
    sched, a, b, targets = _swap_setup()
    bm = sched.block_manager
    gpu_before = table(sched, b)

    _, out = sched.schedule()
    # a needs a 3rd block, none free: b (last arrival) is swapped out to cpu
    # blocks 0..3 in logical order; freed gpu stack [2, 3, 4, 5] -> a gets 5.
    assert [(g.request_id, mode) for g, mode in out.preempted] == [("b", PreemptionMode.SWAP)]
    assert out.blocks_to_swap_out == [(2, 0), (3, 1), (4, 2), (5, 3)]
    swapped_out = out.blocks_to_swap_out
    assert b.seqs[0].status == SequenceStatus.SWAPPED
    assert ids(sched.swapped) == ["b"]
    assert ids(sched.running) == ["a"]
    assert all(blk.device == Device.CPU for blk in bm.block_tables[b.seqs[0].seq_id])
    assert table(sched, b) == [0, 1, 2, 3]
    assert table(sched, a) == [0, 1, 5]
    assert bm.get_num_free_cpu_blocks() == 8 - 4
    assert bm.get_num_free_gpu_blocks() == 6 - 3
    assert scheduled_ids(out) == [("a", 1)]
    simulate_model_step(sched, out, targets)  # a finishes: frees 0, 1, 5

    _, out = sched.schedule()
    # Swap-in needs 4 blocks + 1 for the next token; 6 free. Stack
    # [2, 3, 4, 0, 1, 5] pops 5, 1, 0, 4, then 3 for b's 5th logical block.
    assert out.preempted == []
    assert out.blocks_to_swap_in == [(0, 5), (1, 1), (2, 0), (3, 4)]
    assert scheduled_ids(out) == [("b", 1)]
    assert b.seqs[0].status == SequenceStatus.RUNNING
    assert ids(sched.running) == ["b"]
    assert not sched.swapped
    gpu_after = table(sched, b)
    assert gpu_after == [5, 1, 0, 4, 3]

    # The cpu blocks swapped in are exactly those swapped out, in logical order...
    assert [cpu for cpu, _ in out.blocks_to_swap_in] == [cpu for _, cpu in swapped_out]
    swap_out = dict(swapped_out)
    swap_in = dict(out.blocks_to_swap_in)
    # ...and logical block i -> gpu before -> cpu -> gpu after composes to the new table.
    assert [swap_in[swap_out[g]] for g in gpu_before] == gpu_after[:4]
    assert bm.get_num_free_cpu_blocks() == 8  # cpu pool fully restored
    assert bm.get_num_free_gpu_blocks() == 6 - 5


# -- 8. watermark -------------------------------------------------------------------


def test_watermark_keeps_blocks_free():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2)
    assert bm.watermark_blocks == 2  # int(0.2 * 10)
    needs8 = make_group("needs8", 0, 32, 4, 0.0)  # 32 / 4 = 8 blocks
    needs9 = make_group("needs9", 1, 33, 4, 1.0)  # ceil(33 / 4) = 9 blocks
    needs7 = make_group("needs7", 2, 28, 4, 2.0)  # 7 blocks
    # All 10 free: 10 - 8 = 2 >= 2 -> OK; 10 - 9 = 1 < 2 even when empty -> NEVER.
    assert bm.can_allocate(needs8) == AllocStatus.OK
    assert bm.can_allocate(needs9) == AllocStatus.NEVER

    one = make_group("one", 3, 1, 4, 3.0)
    bm.allocate(one)
    assert bm.get_num_free_gpu_blocks() == 9
    # 9 free: 9 - 8 = 1 < 2 -> LATER; 9 - 7 = 2 -> OK.
    assert bm.can_allocate(needs8) == AllocStatus.LATER
    assert bm.can_allocate(needs7) == AllocStatus.OK
    assert bm.can_allocate(needs9) == AllocStatus.NEVER


def test_watermark_in_scheduler_ignores_never_and_delays_later():
    sched = make_scheduler(block_size=4, num_gpu_blocks=10, watermark=0.2)
    sched.add_seq_group(make_group("needs9", 0, 33, 4, 0.0))
    sched.add_seq_group(make_group("one", 1, 1, 4, 1.0))
    sched.add_seq_group(make_group("needs8", 2, 32, 4, 2.0))
    _, out = sched.schedule()
    assert ids(out.ignored_seq_groups) == ["needs9"]
    assert scheduled_ids(out) == [("one", 1)]
    assert ids(sched.waiting) == ["needs8"]  # 9 free - 8 = 1 < 2 watermark blocks
    assert sched.block_manager.get_num_free_gpu_blocks() == 9


# -- 9. never-fitting request ------------------------------------------------------------


def test_never_fitting_request_is_ignored_once_and_does_not_block_the_queue():
    sched = make_scheduler(block_size=4, num_gpu_blocks=4)
    targets = {"huge": 1, "s1": 2, "s2": 2}
    huge = make_group("huge", 0, 17, 4, 0.0)  # ceil(17 / 4) = 5 blocks > 4 in the pool
    s1 = make_group("s1", 1, 4, 4, 1.0)
    s2 = make_group("s2", 2, 8, 4, 2.0)
    for g in (huge, s1, s2):
        sched.add_seq_group(g)

    _, out = sched.schedule()
    assert ids(out.ignored_seq_groups) == ["huge"]
    assert huge.seqs[0].status == SequenceStatus.FINISHED_IGNORED
    assert huge.is_finished()
    assert huge.seqs[0].seq_id not in sched.block_manager.block_tables
    # The requests behind it are admitted in the same step: 1 + 2 blocks of 4.
    assert scheduled_ids(out) == [("s1", 4), ("s2", 8)]
    assert table(sched, s1) == [0]
    assert table(sched, s2) == [1, 2]
    assert not sched.waiting
    simulate_model_step(sched, out, targets)

    _, out = sched.schedule()
    assert out.ignored_seq_groups == []
    assert "huge" not in ids(sched.waiting) + ids(sched.running) + ids(sched.swapped)


# -- 10. allocator, ref counts, copy-on-write -------------------------------------------


def test_block_allocator_order_exhaustion_and_double_free():
    alloc = BlockAllocator(Device.GPU, block_size=4, num_blocks=3)
    blocks = [alloc.allocate() for _ in range(3)]
    assert [b.block_number for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 and b.device == Device.GPU for b in blocks)
    assert alloc.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        alloc.allocate()

    alloc.free(blocks[1])
    assert blocks[1].ref_count == 0
    assert alloc.get_num_free_blocks() == 1
    with pytest.raises(ValueError, match="Double free"):
        alloc.free(blocks[1])
    assert alloc.get_num_free_blocks() == 1  # the failed free changed nothing
    assert alloc.allocate().block_number == 1


def test_shared_prompt_blocks_are_ref_counted():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    group = make_shared_group("g", [0, 1], prompt_len=6, block_size=4)  # 2 blocks
    s0, s1 = group.seqs
    bm.allocate(group)
    assert bm.get_block_table(s0) == [0, 1]
    assert bm.get_block_table(s1) == [0, 1]
    assert [b.ref_count for b in bm.block_tables[0]] == [2, 2]
    assert bm.get_num_free_gpu_blocks() == 6  # 2 blocks for 2 sequences

    bm.free(s0)
    assert [b.ref_count for b in bm.block_tables[1]] == [1, 1]
    assert bm.get_num_free_gpu_blocks() == 6  # still held by s1
    bm.free(s1)
    assert bm.get_num_free_gpu_blocks() == 8
    assert bm.block_tables == {}
    bm.free(s1)  # freeing an already freed sequence is a no-op
    assert bm.get_num_free_gpu_blocks() == 8


def test_copy_on_write_of_shared_partial_last_block():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    group = make_shared_group("g", [0, 1], prompt_len=6, block_size=4)  # block 1 holds 2 tokens
    s0, s1 = group.seqs
    bm.allocate(group)
    for s in group.seqs:
        s.status = SequenceStatus.RUNNING
    assert bm.can_append_slots(group)

    s0.append_token_id(7, 0.0)  # 7 tokens: slot 2 of the shared block 1
    assert bm.append_slots(s0) == [(1, 2)]  # copy block 1 into fresh block 2
    assert bm.get_block_table(s0) == [0, 2]
    assert bm.get_block_table(s1) == [0, 1]
    assert [b.ref_count for b in bm.block_tables[0]] == [2, 1]
    assert [b.ref_count for b in bm.block_tables[1]] == [2, 1]

    s1.append_token_id(8, 0.0)  # block 1 is s1's alone now: written in place
    assert bm.append_slots(s1) == []
    assert bm.get_block_table(s1) == [0, 1]
    assert bm.get_num_free_gpu_blocks() == 5


def test_shared_full_last_block_needs_no_copy():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    group = make_shared_group("g", [0, 1], prompt_len=8, block_size=4)  # 2 full blocks
    s0, s1 = group.seqs
    bm.allocate(group)
    for s in group.seqs:
        s.status = SequenceStatus.RUNNING
        s.append_token_id(7, 0.0)  # 9th token opens logical block 2
    assert bm.append_slots(s0) == []
    assert bm.append_slots(s1) == []
    assert bm.get_block_table(s0) == [0, 1, 2]
    assert bm.get_block_table(s1) == [0, 1, 3]


# -- 11. abort ------------------------------------------------------------------------


def test_abort_from_waiting_running_and_swapped_frees_blocks():
    sched, a, b, targets = _swap_setup()
    bm = sched.block_manager
    c = make_group("c", 2, 4, 4, 2.0)
    sched.add_seq_group(c)
    _, out = sched.schedule()  # b swapped out; no prefill for c in a preempting step
    assert ids(sched.running) == ["a"]
    assert ids(sched.swapped) == ["b"]
    assert ids(sched.waiting) == ["c"]
    assert (bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()) == (3, 4)

    assert sched.abort_seq_group("nope") == []

    assert sched.abort_seq_group("c") == [c]
    assert c.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert not sched.waiting
    assert (bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()) == (3, 4)

    assert sched.abort_seq_group("b") == [b]
    assert b.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert not sched.swapped
    assert (bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()) == (3, 8)

    assert sched.abort_seq_group("a") == [a]
    assert a.seqs[0].status == SequenceStatus.FINISHED_ABORTED
    assert not sched.running
    assert (bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()) == (6, 8)
    assert bm.block_tables == {}
    assert not sched.has_unfinished_seqs()
    _, out = sched.schedule()
    assert out.scheduled_seq_groups == [] and out.num_batched_tokens == 0
    assert (out.blocks_to_swap_in, out.blocks_to_swap_out, out.blocks_to_copy) == ([], [], [])


# -- the watermark holds for a preempted request too (vLLM v0's rule) ---------------


def test_recomputed_request_needing_the_watermark_blocks_is_ignored():
    # Same pool: 10 blocks of 1 token, watermark 2. b (7-token prompt) grows to
    # 8 tokens, a then needs a block: b is preempted by RECOMPUTE.
    sched = make_scheduler(block_size=1, num_gpu_blocks=10, max_num_seqs=4, watermark=0.2)
    a = make_group("a", 0, 1, 1, 0.0)
    b = make_group("b", 1, 7, 1, 1.0)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    targets = {"a": 3, "b": 10}
    _, out = sched.schedule()  # a: 1 block, b: 7 blocks -> 2 free
    simulate_model_step(sched, out, targets)
    _, out = sched.schedule()  # a -> 2 blocks, b -> 8 blocks -> 0 free
    assert sched.block_manager.get_num_free_gpu_blocks() == 0
    simulate_model_step(sched, out, targets)
    # a needs a 3rd block, none free: b (last arrived) is preempted.
    _, out = sched.schedule()
    assert [(g.request_id, m) for g, m in out.preempted] == [("b", PreemptionMode.RECOMPUTE)]
    assert scheduled_ids(out) == [("a", 1)]
    simulate_model_step(sched, out, targets)  # a reaches 3 outputs and finishes
    # b now holds 7 + 2 = 9 tokens -> 9 blocks; 10 - 9 = 1 < watermark 2: like
    # any prompt, it may never use the watermark blocks, so it is ignored.
    _, out = sched.schedule()
    assert out.ignored_seq_groups == [b] and scheduled_ids(out) == []
    assert b.seqs[0].status == SequenceStatus.FINISHED_IGNORED
