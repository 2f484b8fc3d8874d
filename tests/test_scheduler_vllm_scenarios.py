"""vLLM v0.6.1's scheduler and block manager, scenario by scenario.

Each test replays a behaviour of vLLM v0.6.1's `vllm/core/scheduler.py` and
`block_manager_v1.py` (mostly scenarios of vLLM's own tests
`tests/core/test_scheduler.py`, `test_chunked_prefill_scheduler.py` and
`test_block_manager.py`, re-told here) and checks that minivllm decides the
same: which groups run and with how many tokens, in which order, what the
budget holds, which blocks are free, who is preempted and how, and what
each queue holds afterwards. The expected values were worked out by hand
from vLLM's rules; the comments show the working.

Conventions: `prompt(rid, n)` is a one-sequence request whose prompt is the
token ids 0..n-1; blocks hold 4 tokens unless said otherwise; `step()` runs
`schedule()` and then records the scheduled tokens as computed, as the
engine does after the forward pass; `add_token()` appends a sampled token.
Block *numbers* are not compared: vLLM hands out a fresh pool's blocks from
the top (N-1 first) and minivllm from the bottom (see
lessons/vllm_differences.md); counts of free blocks are compared instead.
"""

from __future__ import annotations

import logging

import pytest

from minivllm.config import CacheConfig, PreemptionMode, SchedulerConfig
from minivllm.core.block_manager import AllocStatus, BlockSpaceManager
from minivllm.core.scheduler import (
    MixedBatchScheduler,
    Scheduler,
    SchedulerOutputs,
    SchedulingBudget,
)
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

RECOMPUTE, SWAP = PreemptionMode.RECOMPUTE, PreemptionMode.SWAP


# -- helpers -------------------------------------------------------------------


def make_scheduler(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    *,
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 64,
    block_size: int = 4,
    chunked: bool = False,
    policy: str = "fcfs",
    watermark: float = 0.0,
    prefix_caching: bool = False,
    cls: type[Scheduler] = Scheduler,
) -> Scheduler:
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    cache_config.num_gpu_blocks = num_gpu_blocks
    cache_config.num_cpu_blocks = num_cpu_blocks
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        scheduling_policy=policy,
    )
    return cls(scheduler_config, cache_config, watermark=watermark)


_seq_ids = iter(range(10**6))


def prompt(
    rid: str,
    n: int,
    *,
    best_of: int = 1,
    block_size: int = 4,
    arrival: float = 0.0,
    priority: int = 0,
) -> SequenceGroup:
    seq = Sequence(next(_seq_ids), None, list(range(n)), block_size)
    if best_of == 1:
        params = SamplingParams(temperature=0, max_tokens=1000)
    else:
        params = SamplingParams(n=1, best_of=best_of, temperature=1.0, max_tokens=1000)
    return SequenceGroup(rid, [seq], params, arrival, priority=priority)


def step(sched: Scheduler) -> SchedulerOutputs:
    """One schedule(), then what the forward pass leaves: the scheduled
    tokens are computed (no token is sampled: see add_token)."""
    _, out = sched.schedule()
    for scheduled in out.scheduled_seq_groups:
        for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
            seq.data.update_num_computed_tokens(scheduled.token_chunk_size)
    return out


def add_token(*groups: SequenceGroup) -> None:
    for group in groups:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.append_token_id(7, 0.0)


def batch(out: SchedulerOutputs) -> list[tuple[str, int]]:
    return [(s.seq_group.request_id, s.token_chunk_size) for s in out.scheduled_seq_groups]


def ids(queue) -> list[str]:
    return [g.request_id for g in queue]


def preempted(out: SchedulerOutputs) -> list[tuple[str, PreemptionMode]]:
    return [(g.request_id, mode) for g, mode in out.preempted]


def run_to_decode(sched: Scheduler, group: SequenceGroup) -> None:
    """Put a group in `running` as if its prompt had been prefilled and had
    sampled one token (vLLM's tests do the same by hand)."""
    sched._allocate_and_set_running(group)
    group.get_seqs()[0].data.update_num_computed_tokens(group.get_seqs()[0].get_len())
    add_token(group)
    sched.running.append(group)


def block_appends_for(sched: Scheduler, *blocked: str) -> None:
    """The cache refuses the next token of the requests `blocked`, however
    many blocks are free (vLLM's tests mock can_append_slots the same way)."""
    bm = sched.block_manager
    real = type(bm).can_append_slots.__get__(bm)  # the class's, not an earlier patch
    bm.can_append_slots = lambda g: g.request_id not in blocked and real(g)


# -- item 1: without chunked prefill, a step is all prefills or all decodes -----


def test_default_a_waiting_prompt_takes_the_step_and_the_decode_waits():
    """vLLM test_scheduler_prefill_prioritized: budget 30, max_num_seqs 2."""
    sched = make_scheduler(30, 2, 30, num_gpu_blocks=16)
    a = prompt("A", 1)
    sched.add_seq_group(a)
    assert batch(step(sched)) == [("A", 1)]
    add_token(a)
    b = prompt("B", 30)
    sched.add_seq_group(b)
    out = step(sched)
    # B's prefill runs alone: A (ready to decode) is not scheduled this step.
    assert batch(out) == [("B", 30)] and out.num_prefill_groups == 1
    assert out.num_batched_tokens == 30
    add_token(b)
    out = step(sched)
    # No prompt waits: both decode, in running order (A first, B joined after).
    assert batch(out) == [("A", 1), ("B", 1)] and out.num_prefill_groups == 0


def test_default_running_groups_hold_their_seq_slots_during_admission():
    """vLLM test_scheduler_max_seqs: max_num_seqs 2, g0 running, g1 and g2
    waiting: g0's slot is reserved, one prompt fits, and g0 does not decode."""
    sched = make_scheduler(64, 2, 16, num_gpu_blocks=8)
    g0 = prompt("g0", 4)
    sched.add_seq_group(g0)
    assert batch(step(sched)) == [("g0", 4)]
    add_token(g0)
    assert batch(step(sched)) == [("g0", 1)]
    add_token(g0)
    sched.add_seq_group(prompt("g1", 4))
    sched.add_seq_group(prompt("g2", 4))
    out = step(sched)
    assert batch(out) == [("g1", 4)]
    assert ids(sched.waiting) == ["g2"] and ids(sched.running) == ["g0", "g1"]


def test_default_preemption_takes_the_tail_and_requeues_at_the_head():
    """vLLM test_scheduler_schedule_preempt_abort: 2 blocks of 4, two
    4-token prompts. At the first decode both need a second block and none
    is free: A (head) cannot append, so B (tail) is preempted by RECOMPUTE,
    freeing 1 block, and A decodes."""
    sched = make_scheduler(64, 2, 16, num_gpu_blocks=2, num_cpu_blocks=2)
    a, b = prompt("A", 4), prompt("B", 4)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    out = step(sched)
    assert batch(out) == [("A", 4), ("B", 4)] and out.num_batched_tokens == 8
    add_token(a, b)
    out = step(sched)
    assert batch(out) == [("A", 1)] and out.num_batched_tokens == 1
    assert preempted(out) == [("B", RECOMPUTE)]
    assert out.blocks_to_swap_out == [] and out.blocks_to_copy == []
    assert ids(sched.waiting) == ["B"] and ids(sched.running) == ["A"]
    assert sched.block_manager.get_num_free_gpu_blocks() == 0  # A took B's block
    sched.abort_seq_group("A")
    out = step(sched)
    # B is prefilled again: its 4 prompt tokens and the 1 it had generated.
    assert batch(out) == [("B", 5)] and sched.get_num_unfinished_seq_groups() == 1


def test_default_prefill_step_then_preemption_order():
    """Running [0, 1, 2, 3] and a waiting prompt "7": the step is "7"'s
    prefill only. Next step "1" cannot append: the victims come from the
    tail ("7", "3", "2") until "1" itself goes; all four RECOMPUTE victims
    land at the head of `waiting` in their running order."""
    sched = make_scheduler(1000, 1000, 1000, num_gpu_blocks=100)
    for rid in "0123":
        run_to_decode(sched, prompt(rid, 4))
    sched.add_seq_group(prompt("7", 4))
    out = step(sched)
    assert batch(out) == [("7", 4)]
    assert ids(sched.running) == ["0", "1", "2", "3", "7"]
    add_token(sched.running[-1])  # only "7" ran, and sampled
    block_appends_for(sched, "1")
    out = step(sched)
    assert batch(out) == [("0", 1)]
    assert preempted(out) == [
        ("7", RECOMPUTE),
        ("3", RECOMPUTE),
        ("2", RECOMPUTE),
        ("1", RECOMPUTE),
    ]
    assert ids(sched.waiting) == ["1", "2", "3", "7"] and ids(sched.running) == ["0"]


def test_default_swap_victims_join_swapped_newest_first():
    """Four running best_of=2 groups (one sequence each, so
    get_max_num_running_seqs() is 2 and the default mode is SWAP); "1"
    cannot append. Victims "3", "2", then "1" itself are swapped out in that
    order, so the next swap-in brings "3" back first."""
    sched = make_scheduler(1000, 1000, 1000, num_gpu_blocks=100, num_cpu_blocks=100)
    for rid in "0123":
        run_to_decode(sched, prompt(rid, 4, best_of=2))
    block_appends_for(sched, "1")
    out = step(sched)
    assert batch(out) == [("0", 1)]
    assert preempted(out) == [("3", SWAP), ("2", SWAP), ("1", SWAP)]
    assert ids(sched.swapped) == ["3", "2", "1"] and ids(sched.running) == ["0"]
    # One block each: 5 tokens, the 5th not yet given its block.
    assert len(out.blocks_to_swap_out) == 3 and out.blocks_to_swap_in == []
    block_appends_for(sched)  # the cache has room again
    add_token(*sched.running)
    out = step(sched)
    # Nothing waits; "0" decodes, then the swapped groups come back in order.
    assert batch(out) == [("0", 1), ("3", 1), ("2", 1), ("1", 1)]
    assert ids(sched.running) == ["0", "3", "2", "1"]
    assert len(out.blocks_to_swap_in) == 3


def test_default_no_swap_in_in_a_step_that_preempted():
    """vLLM test_swapped_out_prioritized: three 60-token best_of=2 prompts,
    max_num_seqs 6. "2" cannot append and is swapped out (best_of=2). Next
    step: a new prompt waits, but nothing is admitted while a group is
    swapped; "2" is swapped back in beside the two decodes."""
    sched = make_scheduler(1000, 6, 1000, num_gpu_blocks=64, num_cpu_blocks=64)
    groups = [prompt(str(i), 60, best_of=2) for i in range(3)]
    for g in groups:
        sched.add_seq_group(g)
    out = step(sched)
    assert batch(out) == [("0", 60), ("1", 60), ("2", 60)]
    add_token(*groups)
    block_appends_for(sched, "2")
    out = step(sched)
    assert batch(out) == [("0", 1), ("1", 1)] and out.num_batched_tokens == 2
    assert preempted(out) == [("2", SWAP)]
    # 61 tokens in 15 blocks: its 16th block was never allocated.
    assert len(out.blocks_to_swap_out) == 15 and out.blocks_to_swap_in == []
    block_appends_for(sched)
    add_token(groups[0], groups[1])
    sched.add_seq_group(prompt("3", 60, best_of=2))
    out = step(sched)
    assert batch(out) == [("0", 1), ("1", 1), ("2", 1)] and out.num_batched_tokens == 3
    assert len(out.blocks_to_swap_in) == 15 and out.blocks_to_swap_out == []
    assert ids(sched.waiting) == ["3"]


def test_default_nothing_admitted_while_a_swap_in_must_wait():
    """While anything is swapped, `_schedule_default` admits no prompt, even
    when nothing runs and the swap-in itself has to wait (LATER)."""
    sched = make_scheduler(1000, 1000, 1000, num_gpu_blocks=100, num_cpu_blocks=100)
    g = prompt("0", 4, best_of=2)
    run_to_decode(sched, g)
    block_appends_for(sched, "0")
    out = step(sched)
    assert preempted(out) == [("0", SWAP)] and ids(sched.swapped) == ["0"]
    sched.block_manager.can_swap_in = lambda group: AllocStatus.LATER
    sched.add_seq_group(prompt("1", 4))
    out = step(sched)
    assert batch(out) == [] and ids(sched.waiting) == ["1"] and ids(sched.swapped) == ["0"]


def test_default_head_of_line_blocking():
    """10 blocks; prompts of 8, 3 and 1 blocks: the first is admitted, the
    second must wait (LATER) and the third is not tried; 2 blocks stay free."""
    sched = make_scheduler(1000, 1000, 1000, num_gpu_blocks=10)
    for rid, n in (("a", 32), ("b", 12), ("c", 4)):
        sched.add_seq_group(prompt(rid, n))
    assert batch(step(sched)) == [("a", 32)]
    assert ids(sched.waiting) == ["b", "c"]
    assert sched.block_manager.get_num_free_gpu_blocks() == 2


# -- item 2: chunked prefill ---------------------------------------------------------


def test_chunked_complex_order_of_chunks():
    """vLLM test_complex: budget 64, two 60-token prompts, then two more.

    Step 1: r0 gets 60, r1 the 4 left. Step 2: running first, in order:
    r0 decodes (1), r1 continues (56); then the new r2 gets the 7 left. The
    batch lists new prefills, then running prefills, then decodes."""
    sched = make_scheduler(64, 60, 80, num_gpu_blocks=100, chunked=True)
    r0, r1 = prompt("r0", 60), prompt("r1", 60)
    sched.add_seq_group(r0)
    sched.add_seq_group(r1)
    metadata, out = sched.schedule()
    assert batch(out) == [("r0", 60), ("r1", 4)] and out.num_prefill_groups == 2
    assert out.num_batched_tokens == 64
    assert [m.do_sample for m in metadata] == [True, False]
    for s in out.scheduled_seq_groups:
        s.seq_group.get_seqs()[0].data.update_num_computed_tokens(s.token_chunk_size)
    add_token(r0)
    sched.add_seq_group(prompt("r2", 60))
    sched.add_seq_group(prompt("r3", 60))
    out = step(sched)
    assert batch(out) == [("r2", 7), ("r1", 56), ("r0", 1)]
    assert out.num_prefill_groups == 2 and out.num_batched_tokens == 64
    assert ids(sched.running) == ["r0", "r1", "r2"] and ids(sched.waiting) == ["r3"]


def test_chunked_running_prefill_goes_before_new_prompts():
    """vLLM test_chunked_prefill_max_seqs: budget 64, max_num_seqs 2. r0 (65
    tokens) gets 64; next step its last token is served first, and the new
    "0" gets the 63 left; max_num_seqs stops "1"."""
    sched = make_scheduler(64, 2, 80, num_gpu_blocks=100, chunked=True)
    sched.add_seq_group(prompt("r0", 65))
    assert batch(step(sched)) == [("r0", 64)]
    for i in range(4):
        sched.add_seq_group(prompt(str(i), 65))
    out = step(sched)
    assert batch(out) == [("0", 63), ("r0", 1)] and out.num_batched_tokens == 64
    assert ids(sched.waiting) == ["1", "2", "3"]


def test_chunked_running_prefill_is_checked_and_preempted():
    """vLLM test_chunked_prefill_preempt: budget 30, one 60-token prompt.
    After its first chunk the cache refuses it: the running prefill itself
    is preempted (RECOMPUTE) and nothing runs; next step it starts over."""
    sched = make_scheduler(30, 30, 200, num_gpu_blocks=100, chunked=True)
    g = prompt("1", 60)
    sched.add_seq_group(g)
    assert batch(step(sched)) == [("1", 30)]
    block_appends_for(sched, "1")
    out = step(sched)
    assert batch(out) == [] and out.num_batched_tokens == 0
    assert preempted(out) == [("1", RECOMPUTE)] and ids(sched.waiting) == ["1"]
    assert out.blocks_to_swap_out == [] and out.blocks_to_swap_in == []
    out = step(sched)
    assert batch(out) == [("1", 30)] and g.get_seqs()[0].get_num_new_tokens() == 30
    block_appends_for(sched)
    out = step(sched)
    assert batch(out) == [("1", 30)] and not g.is_prefill()


def test_chunked_prefill_of_best_of_2_is_swapped_and_resumes_as_a_prefill():
    """vLLM test_swap: budget 30, a 60-token best_of=2 prompt. After 30
    tokens the cache refuses it: being a best_of=2 group, it is swapped out
    (not recomputed). Next step it is swapped in with the whole rest of its
    prompt (30 tokens; a swap-in is never chunked), which spends the budget:
    the new prompt "2" gets nothing."""
    sched = make_scheduler(30, 30, 200, num_gpu_blocks=100, num_cpu_blocks=100, chunked=True)
    g = prompt("1", 60, best_of=2)
    sched.add_seq_group(g)
    assert batch(step(sched)) == [("1", 30)]
    block_appends_for(sched, "1")
    out = step(sched)
    assert batch(out) == [] and preempted(out) == [("1", SWAP)]
    assert len(out.blocks_to_swap_out) == 15 and ids(sched.swapped) == ["1"]
    block_appends_for(sched)
    sched.add_seq_group(prompt("2", 60))
    out = step(sched)
    assert batch(out) == [("1", 30)] and out.num_prefill_groups == 1
    assert len(out.blocks_to_swap_in) == 15 and out.blocks_to_swap_out == []
    assert not g.is_prefill() and ids(sched.waiting) == ["2"]


def test_chunked_swapped_prefill_longer_than_the_budget_comes_back_in_chunks():
    """A kept difference. Budget 16; a 40-token best_of=2 prompt is swapped
    out after its first 16 tokens. vLLM swaps a prefill back in only with
    its whole rest (24 tokens), which a 16-token budget never holds: it
    would stay swapped forever. minivllm swaps it in with a 16-token chunk,
    then finishes the prompt with the last 8."""
    sched = make_scheduler(16, 16, 64, num_gpu_blocks=100, num_cpu_blocks=100, chunked=True)
    g = prompt("1", 40, best_of=2)
    sched.add_seq_group(g)
    assert batch(step(sched)) == [("1", 16)]
    block_appends_for(sched, "1")
    assert preempted(step(sched)) == [("1", SWAP)]
    block_appends_for(sched)
    out = step(sched)
    assert batch(out) == [("1", 16)] and len(out.blocks_to_swap_in) == 10
    assert batch(step(sched)) == [("1", 8)] and not g.is_prefill()


def test_chunked_new_prompts_are_admitted_while_a_group_is_swapped():
    """vLLM test_running_prefill_prioritized_over_swap: while the swapped
    group cannot come back (LATER), the new prompt "2" is admitted anyway,
    chunk by chunk; once it decodes, the swap-in still waits for a budget
    that fits its whole prompt rest (30 > 29 left)."""
    sched = make_scheduler(30, 30, 200, num_gpu_blocks=100, num_cpu_blocks=100, chunked=True)
    sched.add_seq_group(prompt("1", 60, best_of=2))
    step(sched)
    block_appends_for(sched, "1")
    step(sched)
    block_appends_for(sched)
    real_can_swap_in = sched.block_manager.can_swap_in
    sched.block_manager.can_swap_in = lambda group: AllocStatus.LATER
    sg2 = prompt("2", 60)
    sched.add_seq_group(sg2)
    out = step(sched)
    assert batch(out) == [("2", 30)] and out.blocks_to_swap_in == []
    sched.block_manager.can_swap_in = real_can_swap_in
    out = step(sched)
    assert batch(out) == [("2", 30)] and out.blocks_to_swap_in == []
    add_token(sg2)
    out = step(sched)
    assert batch(out) == [("2", 1)] and out.blocks_to_swap_in == []
    sched.abort_seq_group("2")
    out = step(sched)
    assert batch(out) == [("1", 30)] and out.blocks_to_swap_in != []


def test_chunked_new_prompt_admitted_in_a_step_that_preempted_everything():
    """Three running decodes; "0" can never append, so all three are
    preempted ("2", "1", then "0" itself). The waiting prompt "9" is still
    admitted in that step; the victims join the head of `waiting` only at
    the end of the step, in their running order."""
    sched = make_scheduler(1000, 1000, 1000, num_gpu_blocks=100, chunked=True)
    for rid in "012":
        run_to_decode(sched, prompt(rid, 4))
    sched.add_seq_group(prompt("9", 4))
    block_appends_for(sched, "0")
    out = step(sched)
    assert preempted(out) == [("2", RECOMPUTE), ("1", RECOMPUTE), ("0", RECOMPUTE)]
    assert batch(out) == [("9", 4)]
    assert ids(sched.waiting) == ["0", "1", "2"] and ids(sched.running) == ["9"]


def test_chunked_budget_runs_out_mid_queue():
    """vLLM test_maximal_decoding (its first steps): budget 2, max_num_seqs 2.
    r0's 2-token prompt spends the budget; next step r0 decodes and r1 gets
    the one token left."""
    sched = make_scheduler(2, 2, 2, num_gpu_blocks=100, chunked=True)
    r0, r1 = prompt("r0", 2), prompt("r1", 2)
    sched.add_seq_group(r0)
    sched.add_seq_group(r1)
    assert batch(step(sched)) == [("r0", 2)]
    add_token(r0)
    sched.add_seq_group(prompt("r2", 2))
    out = step(sched)
    assert batch(out) == [("r1", 1), ("r0", 1)] and out.num_prefill_groups == 1
    add_token(r0)
    out = step(sched)
    # r1, running now, finishes its prompt; prefill chunks are listed first.
    assert batch(out) == [("r1", 1), ("r0", 1)] and not r1.is_prefill()


# -- the course's mixed batches, under their own name ---------------------------------


def test_mixed_batch_scheduler_shares_a_step_between_a_decode_and_a_prompt():
    """The Day 3 worked example: with a 64-token budget, a 1-token decode and
    a 50-token prompt share a step under MixedBatchScheduler; vLLM's default
    runs the prompt alone and the decode a step later."""
    for cls, want in ((MixedBatchScheduler, [("p", 50), ("r", 1)]), (Scheduler, [("p", 50)])):
        sched = make_scheduler(64, 8, 64, cls=cls)
        run_to_decode(sched, prompt("r", 10))
        sched.add_seq_group(prompt("p", 50))
        assert batch(step(sched)) == want, cls.__name__


def test_mixed_batch_scheduler_never_chunks_a_prompt():
    """Without chunking, a prompt that does not fit the budget left waits
    whole for a later step (15 tokens left after the decode; it needs 16)."""
    sched = make_scheduler(16, 8, 16, cls=MixedBatchScheduler)
    run_to_decode(sched, prompt("r", 4))
    sched.add_seq_group(prompt("p", 16))
    assert batch(step(sched)) == [("r", 1)]
    assert ids(sched.waiting) == ["p"]


# -- item 3: prefix caching at admission (a kept difference) --------------------------


def test_prefix_cache_hits_are_not_charged_to_the_budget():
    """vLLM v0.6.1's test_prefix_caching (chunked, budget 64, block size 4):
    two identical 50-token prompts in one step. vLLM v0.6.1 charges each
    prompt whole, so the second gets the 14 tokens left rounded down to whole
    blocks: chunks [50, 12], 62 tokens. minivllm charges only what the model
    computes, as vLLM v1 does: the second prompt finds the first's 12 full
    blocks (48 tokens) registered earlier in the step and computes the last
    2 tokens: chunks [50, 2], 52 tokens."""
    sched = make_scheduler(
        64, 10, 80, num_gpu_blocks=32, num_cpu_blocks=0, chunked=True, prefix_caching=True
    )
    sched.add_seq_group(prompt("0", 50))
    sched.add_seq_group(prompt("1", 50))
    out = step(sched)
    assert batch(out) == [("0", 50), ("1", 2)] and out.num_batched_tokens == 52
    # The 12 full blocks are shared; each prompt owns its partial last block.
    assert sched.block_manager.get_num_free_gpu_blocks() == 32 - 12 - 2


# -- item 4: memory rules ------------------------------------------------------------


def test_can_append_slots_wants_one_free_block_per_running_sequence():
    """4 blocks of 4; two 5-token prompts (2 blocks each) have sampled one
    token. Each 6th token fits in its last block, but no block is free, and
    vLLM v0 asks for one free block per running sequence: A (head) cannot
    append, so B (tail) is preempted, and A decodes into its own block."""
    sched = make_scheduler(64, 8, 64, num_gpu_blocks=4)
    a, b = prompt("A", 5), prompt("B", 5)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    step(sched)
    add_token(a, b)
    assert sched.block_manager.get_num_free_gpu_blocks() == 0
    out = step(sched)
    assert batch(out) == [("A", 1)] and preempted(out) == [("B", RECOMPUTE)]
    assert ids(sched.waiting) == ["B"] and sched.block_manager.get_num_free_gpu_blocks() == 2


def test_watermark_applies_to_a_recomputed_request():
    """100 blocks, watermark 1. A preempted request of 392 prompt tokens and 6
    outputs (398 tokens: 100 blocks) asks to be readmitted: like any prompt it
    may not use the watermark block, so it can never be (NEVER). With 2
    outputs (394 tokens: 99 blocks) it fits."""
    bm = BlockSpaceManager(4, 100, 0, watermark=0.01)
    for num_outputs, want in ((6, AllocStatus.NEVER), (2, AllocStatus.OK)):
        g = prompt("0", 392)  # still WAITING, as a RECOMPUTE victim is
        for _ in range(num_outputs):
            g.get_seqs()[0].append_token_id(7, 0.0)
        assert bm.can_allocate(g) == want, num_outputs


@pytest.mark.parametrize(
    ("num_gpu_blocks", "watermark", "prompt_len"), [(2, 0.0, 5), (100, 0.01, 396)]
)
def test_a_request_alone_without_a_free_block_is_ignored(num_gpu_blocks, watermark, prompt_len):
    """A kept difference. A request alone in the cache whose next token finds
    no free block: vLLM preempts it, and readmits it next step if it fits
    (2 blocks, a 5-token prompt: forever) or ignores it then because of the
    watermark (100 blocks, watermark 1, 398 tokens need all 100). minivllm
    sees at once that no preemption can help and ignores it in that step."""
    sched = make_scheduler(400, 8, 400, num_gpu_blocks=num_gpu_blocks, watermark=watermark)
    g = prompt("0", prompt_len)
    sched.add_seq_group(g)
    while g.get_seqs()[0].get_len() < 4 * num_gpu_blocks - 2:  # up to the last block
        step(sched)
        add_token(g)
    assert sched.block_manager.get_num_free_gpu_blocks() == 0 and sched.running
    out = step(sched)
    assert out.ignored_seq_groups == [g] and out.preempted == [] and batch(out) == []
    assert sched.block_manager.get_num_free_gpu_blocks() == num_gpu_blocks


def test_watermark_never_and_ok():
    """100 blocks, watermark 1: a 100-block prompt can never be admitted; a
    99-block prompt can."""
    bm = BlockSpaceManager(4, 100, 0, watermark=0.01)
    assert bm.can_allocate(prompt("a", 400)) == AllocStatus.NEVER
    assert bm.can_allocate(prompt("b", 396)) == AllocStatus.OK


def test_watermark_applies_to_swap_in():
    """100 blocks, watermark 1. A swapped group of 98 blocks needs 98 + 1
    (its next token's block) = 99 to come back: OK with 100 free (1 left),
    LATER with 99 free (0 left), NEVER on a pool of fewer than 99 blocks."""
    bm = BlockSpaceManager(4, 100, 100, watermark=0.01)
    g = prompt("a", 392)
    bm.allocate(g)
    g.get_seqs()[0].status = SequenceStatus.RUNNING
    bm.swap_out(g)
    g.get_seqs()[0].status = SequenceStatus.SWAPPED
    assert bm.get_num_free_gpu_blocks() == 100
    assert bm.can_swap_in(g) == AllocStatus.OK
    bm.allocate(prompt("b", 4))
    assert bm.can_swap_in(g) == AllocStatus.LATER
    small = BlockSpaceManager(4, 98, 100, watermark=0.0)
    c = prompt("c", 392)  # all 98 blocks of the small pool
    small.allocate(c)
    c.get_seqs()[0].status = SequenceStatus.RUNNING
    small.swap_out(c)
    c.get_seqs()[0].status = SequenceStatus.SWAPPED
    assert small.can_swap_in(c) == AllocStatus.NEVER
    # A kept difference: 99 blocks needed of 100 with a 2-block watermark can
    # never leave the watermark free: NEVER here, LATER (forever) in vLLM.
    tight = BlockSpaceManager(4, 100, 100, watermark=0.02)
    tight.allocate(g2 := prompt("d", 392))
    g2.get_seqs()[0].status = SequenceStatus.RUNNING
    tight.swap_out(g2)
    g2.get_seqs()[0].status = SequenceStatus.SWAPPED
    assert tight.can_swap_in(g2) == AllocStatus.NEVER


def test_block_manager_reset_frees_everything():
    """vLLM test_reset: four 4-token prompts fill 4 blocks; reset() frees all."""
    bm = BlockSpaceManager(4, 4, 4, watermark=0.0)
    for i in range(4):
        g = prompt(str(i), 4)
        assert bm.can_allocate(g) == AllocStatus.OK
        bm.allocate(g)
    assert bm.get_num_free_gpu_blocks() == 0
    bm.reset()
    assert bm.get_num_free_gpu_blocks() == 4 and bm.block_tables == {}


# -- item 5: limits and counts --------------------------------------------------------


def test_scheduling_budget():
    """vLLM test_scheduling_budget: charges are per request id, once."""
    budget = SchedulingBudget(token_budget=4, max_num_seqs=4)
    assert budget.can_schedule(num_new_tokens=1, num_new_seqs=1)
    assert budget.can_schedule(num_new_tokens=4, num_new_seqs=4)
    assert not budget.can_schedule(num_new_tokens=1, num_new_seqs=5)
    assert not budget.can_schedule(num_new_tokens=5, num_new_seqs=1)
    assert budget.remaining_token_budget() == 4
    budget.add_num_batched_tokens("1", 2)
    assert budget.remaining_token_budget() == 2 and budget.num_batched_tokens == 2
    assert budget.can_schedule(num_new_tokens=2, num_new_seqs=1)
    assert not budget.can_schedule(num_new_tokens=3, num_new_seqs=1)
    budget.add_num_batched_tokens("1", 2)  # the same request again: no-op
    assert budget.num_batched_tokens == 2
    budget.subtract_num_batched_tokens("1", 2)
    assert budget.num_batched_tokens == 0
    budget.subtract_num_batched_tokens("1", 2)  # not charged any more: no-op
    assert budget.num_batched_tokens == 0
    budget.add_num_seqs("1", 2)
    assert budget.can_schedule(num_new_tokens=1, num_new_seqs=2)
    assert not budget.can_schedule(num_new_tokens=1, num_new_seqs=3)
    budget.add_num_seqs("1", 2)
    assert budget.num_curr_seqs == 2
    budget.subtract_num_seqs("1", 2)
    budget.subtract_num_seqs("1", 2)
    assert budget.num_curr_seqs == 0


def test_a_swapped_best_of_2_group_is_charged_two_seqs():
    """vLLM test_schedule_swapped_simple: a best_of=2 group holding one
    sequence still counts 2 against max_num_seqs when it is swapped in, and
    1 token."""
    sched = make_scheduler(1000, 1000, 1000, num_gpu_blocks=64, num_cpu_blocks=64)
    g = prompt("1", 60, best_of=2)
    run_to_decode(sched, g)
    sched.running.clear()
    out = sched._new_outputs()
    sched._preempt(g, out)
    sched._requeue_preempted(out)
    assert preempted(out) == [("1", SWAP)] and ids(sched.swapped) == ["1"]
    budget = SchedulingBudget(token_budget=10000, max_num_seqs=10000)
    decodes, prefills = sched._schedule_swapped(budget, out)
    assert [s.seq_group for s in decodes] == [g] and prefills == []
    assert budget.num_batched_tokens == 1 and budget.num_curr_seqs == 2
    # All 15 CPU blocks it was swapped into come back.
    swapped_to = [cpu for _, cpu in out.blocks_to_swap_out]
    assert [cpu for cpu, _ in out.blocks_to_swap_in] == swapped_to and len(swapped_to) == 15


def test_default_prompt_over_the_limit_is_ignored(caplog):
    """vLLM test_prefill_schedule_max_prompt_len: max_model_len 30, a
    60-token prompt reaches the scheduler: it is finished as ignored, with a
    warning, and nothing is charged. (The engine refuses such a prompt
    earlier, at add_request; this is the scheduler's own guard.)"""
    sched = make_scheduler(1000, 1000, 30)
    g = prompt("0", 60)
    sched.add_seq_group(g)
    with caplog.at_level(logging.WARNING, logger="minivllm.core.scheduler"):
        out = step(sched)
    assert out.ignored_seq_groups == [g] and batch(out) == [] and out.num_batched_tokens == 0
    assert g.get_seqs()[0].status == SequenceStatus.FINISHED_IGNORED
    assert not sched.waiting and "exceed the limit of 30" in caplog.text


def test_chunked_prompt_limit_applies_to_the_chunk():
    """vLLM test_prompt_limit_exceed and its quirk: with chunking the limit
    (max_model_len) is compared with this step's chunk. A 48-token prompt
    over a limit of 32 is ignored when its chunk is 48 (budget 64), and runs
    as 16 + 16 + 16 when the budget is 16."""
    sched = make_scheduler(64, 64, 32, chunked=True)
    g = prompt("2", 48)
    sched.add_seq_group(g)
    assert step(sched).ignored_seq_groups == [g]
    sched = make_scheduler(16, 16, 32, chunked=True)
    sched.add_seq_group(prompt("3", 48))
    assert [batch(step(sched)) for _ in range(3)] == [[("3", 16)]] * 3


# -- item 6: queue order --------------------------------------------------------------


def test_fcfs_keeps_insertion_order():
    """vLLM's queues are deques in the order things happened: a request
    added later stays behind, whatever its arrival time says."""
    sched = make_scheduler(1000, 2, 1000)
    sched.add_seq_group(prompt("late", 4, arrival=5.0))
    sched.add_seq_group(prompt("early", 4, arrival=1.0))
    sched.add_seq_group(prompt("third", 4, arrival=2.0))
    assert batch(step(sched)) == [("late", 4), ("early", 4)]
    assert ids(sched.waiting) == ["third"]


def test_priority_orders_waiting_and_running_by_priority_then_arrival():
    """scheduling_policy="priority", as later vLLM: each step starts by
    sorting `waiting` and `running` by (priority, arrival). Admission takes
    the best first; the victim is the worst running request."""
    sched = make_scheduler(1000, 2, 1000, num_gpu_blocks=100, policy="priority")
    sched.add_seq_group(prompt("low", 4, arrival=0.0, priority=5))
    sched.add_seq_group(prompt("high", 4, arrival=1.0, priority=0))
    sched.add_seq_group(prompt("mid", 4, arrival=2.0, priority=1))
    assert batch(step(sched)) == [("high", 4), ("mid", 4)]
    add_token(*sched.running)
    sched.waiting.clear()
    block_appends_for(sched, "high")
    out = step(sched)
    assert preempted(out)[0] == ("mid", RECOMPUTE)


def test_queues_print_readably():
    """A learner's breakpoint() in LLMEngine.step(): print(self.scheduler.waiting)."""
    sched = make_scheduler(1000, 8, 1000)
    sched.add_seq_group(prompt("0", 5))
    assert repr(sched.waiting) == (
        "deque([SequenceGroup(request_id=0, status=WAITING, num_seqs=1, len=5, computed=0)])"
    )


@pytest.mark.parametrize("chunked", [False, True])
def test_abort_takes_one_id_or_several(chunked):
    """vLLM's abort_seq_group accepts one request id or an iterable of them."""
    sched = make_scheduler(100, 64, 100, chunked=chunked)
    for i in range(4):
        sched.add_seq_group(prompt(str(i), 4))
    sched.abort_seq_group("0")
    sched.abort_seq_group({"1", "2", "3"})
    assert sched.get_num_unfinished_seq_groups() == 0
